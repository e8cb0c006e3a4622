"""generate_json: schemas as dicts or pydantic models in, parsed objects out; errors before any
generation; the schema stated in the prompt for chat models."""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel

import smcdecode as sd
from smcdecode.structured import StructuredResult, generate_json, schema_prompt

VOCAB = ["<bos>", "{", '"x"', '"y"', ": ", ", ", "1", "2", "3", "}", "true", "false", "<eos>"]


def toy() -> sd.FunctionModel:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(len(VOCAB), len(VOCAB), generator=gen)
    table[:, [VOCAB.index("}"), VOCAB.index(", ")]] += 2.0  # short numbers
    return sd.FunctionModel(lambda ctx: table[ctx[:, -1]], VOCAB, name="toy-json")


class Point(BaseModel):
    x: int
    y: int


def test_pydantic_schema_returns_instances():
    out = generate_json(toy(), [0], Point, particles=4, max_new_tokens=16, seed=0)
    assert isinstance(out, StructuredResult)
    assert out.ok and isinstance(out.value, Point)
    for v, w in zip(out.values, out.weights.tolist()):
        assert (v is not None) == (w > 0)
        if v is not None:
            assert isinstance(v, Point)
    assert out.text is not None and Point.model_validate_json(out.text) == out.value


def test_the_result_says_which_constraint_path_ran():
    out = generate_json(toy(), [0], Point, particles=2, max_new_tokens=16, seed=0)
    assert out.path == "automaton" == out.constraint.path  # a closed pydantic object: a regular language
    assert "constraint path: automaton" in str(out)


def test_dict_schema_returns_python_objects_and_masked_strategy():
    schema = {
        "type": "object",
        "properties": {"x": {"type": "boolean"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    for strategy in ["smc", "masked"]:
        out = generate_json(toy(), [0], schema, strategy=strategy, particles=3, max_new_tokens=12, seed=1)
        assert out.value in ({"x": True}, {"x": False})
        assert out.result.strategy == ("smc" if strategy == "smc" else "autoregressive")


def test_no_valid_particle_gives_none_with_a_message():
    out = generate_json(toy(), [0], Point, particles=2, max_new_tokens=3, seed=0)
    assert out.value is None and not out.ok and out.text is None
    assert "max_new_tokens" in out.result.message


@pytest.mark.parametrize(
    "schema, needle",
    [
        ({"type": "object", "properties": {"x": {"not": {"type": "integer"}}}}, "not supported"),
        ({"type": "objekt"}, "invalid JSON Schema"),
    ],
)
def test_bad_schemas_raise_before_generation(schema, needle):
    calls = []

    def fn(ctx):
        calls.append(1)
        return torch.zeros(ctx.shape[0], len(VOCAB))

    model = sd.FunctionModel(fn, VOCAB)
    with pytest.raises(sd.SMCDecodeError, match=needle):
        generate_json(model, [0], schema)
    assert not calls


def test_bad_arguments():
    with pytest.raises(sd.SMCDecodeError, match="strategy"):
        generate_json(toy(), [0], Point, strategy="greedy")
    with pytest.raises(sd.SMCDecodeError, match="temperature"):
        generate_json(toy(), [0], Point, temperature=0)


def test_schema_prompt_adds_a_system_message_for_chat_models_only():
    class ChatTok:
        chat_template = "{{ messages }}"

    chat_model = toy()
    chat_model.tokenizer = ChatTok()
    schema = {"type": "integer"}
    messages = schema_prompt(chat_model, "Pick a number.", schema)
    assert messages[0]["role"] == "system" and '{"type": "integer"}' in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": "Pick a number."}
    merged = schema_prompt(
        chat_model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], schema
    )
    assert merged[0]["content"].startswith("Be brief.") and len(merged) == 2
    assert schema_prompt(toy(), "Pick a number.", schema) == "Pick a number."
    assert schema_prompt(chat_model, [5, 6], schema) == [5, 6]
    # what describes no document ($schema, a draft-04 "id") is left out; a property named "id" stays
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "id": "urn:x", "type": "object",
              "properties": {"id": {"type": "integer"}}}
    text = schema_prompt(chat_model, "Hi", schema)[0]["content"]
    assert "draft-04" not in text and "urn:x" not in text and '"properties": {"id": {"type": "integer"}}' in text


def test_extra_properties_are_closed_by_default_and_outputs_validate_against_the_given_schema():
    # VOCAB can spell {"x": 1, "y": 2}; the schema declares only x and allows other keys
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    out = generate_json(toy(), [0], schema, particles=6, max_new_tokens=16, seed=0)
    texts = [v for v, w in zip(out.values, out.weights.tolist()) if w > 0]
    assert texts and all(set(v) == {"x"} for v in texts)
    assert out.constraint.schema == schema and out.constraint.compiled_schema["additionalProperties"] is False
    loose = generate_json(toy(), [0], schema, particles=6, max_new_tokens=16, seed=0, extra_properties=True)
    assert loose.constraint.compiled_schema == schema
    assert loose.constraint.matches('{"x": 1, "y": 2}') and not out.constraint.matches('{"x": 1, "y": 2}')


@pytest.mark.slow
def test_cli_exits_1_with_one_line_when_no_particle_is_valid(capsys):
    from smcdecode.cli import main

    schema = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    argv = ["generate", "--chat", "A person as JSON.", "--json-schema", schema, "--max-new-tokens", "3",
            "-n", "2", "--draft", "target", "--no-progress"]
    assert main(argv) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("smcdecode:")]
    assert len(lines) == 1 and "no valid sample" in lines[0] and "--max-new-tokens 3" in lines[0]


@pytest.mark.slow
def test_smollm2_returns_a_valid_object():
    class City(BaseModel):
        name: str
        country: str

    model = sd.load_model()
    out = generate_json(
        model, "Paris is the capital of France. Describe the city.", City, particles=4, max_new_tokens=32, seed=0
    )
    assert out.ok and isinstance(out.value, City)
