"""Strings held to two or more of a ``format``, a ``pattern`` and a length (``schema_regexes``): the
device path's documents are the intersection of one regex per facet, exact against a validator on
every short string, refused inside anyOf / oneOf, the same masks as llguidance's on a toy vocabulary
and along random walks on the default model, and the engine's round exact on them. The string
formats llguidance generates exactly (``FORMATS`` but ``SUBSET_FORMATS``) equal its masks too."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

import smcdecode as sd
from smcdecode.potentials.json_schema import JSONSchema
from smcdecode.potentials.schema_regex import UnsupportedSchema, schema_regex, schema_regexes
from smcdecode.potentials.string_formats import FORMATS, SUBSET_FORMATS


def _valid(schema: dict, text: str) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^[ab]+c?$", "minLength": 2, "maxLength": 3},
    {"type": "string", "pattern": "b", "maxLength": 3},
    {"type": ["string", "null"], "pattern": "^a", "minLength": 1, "maxLength": 2},
    {"type": "array", "items": {"type": "string", "pattern": "^[ac]*$", "maxLength": 2}, "maxItems": 2},
])
def test_held_strings_are_the_intersection_of_their_facets(schema):
    """Every document over a small alphabet (strings up to 4 characters, arrays of up to 2 of them)
    matches every regex exactly when a JSON Schema validator accepts it."""
    regexes, subsets = schema_regexes(schema)
    assert len(regexes) == 2 and not subsets
    with pytest.raises(UnsupportedSchema, match="intersection"):
        schema_regex(schema)
    strings = ["".join(p) for n in range(5) for p in itertools.product("abc", repeat=n)]
    if schema["type"] == "array":
        texts = [json.dumps(list(p), separators=(", ", ": ")) for n in range(3) for p in itertools.product(strings[:13], repeat=n)]
    else:
        texts = [json.dumps(s) for s in strings] + ["null"]
    matched = 0
    for text in texts:
        ok = all(re.fullmatch(r, text) for r in regexes)
        matched += ok
        assert ok == _valid(schema, text), text
    assert matched > 3


def test_intersection_is_refused_inside_a_choice():
    held = {"type": "string", "format": "email", "maxLength": 20}
    with pytest.raises(UnsupportedSchema) as e:
        schema_regexes({"anyOf": [held, {"type": "integer"}]})
    assert e.value.keyword == "format" and "anyOf/oneOf" in str(e.value)
    auto = JSONSchema({"anyOf": [held, {"type": "integer"}]})
    assert auto.path != "automaton" and "anyOf/oneOf" in auto.path_reason
    # a list of types is no choice: values of different types never share a text
    assert JSONSchema({"type": ["string", "null"], "format": "email", "maxLength": 20}).path == "automaton"


VOCAB = ["<bos>", '"', "a", "b", "ab", "ba", 'a"', "c", "<eos>"]
EOS = len(VOCAB) - 1
TOY_SCHEMA = {"type": "string", "pattern": "^a[ab]*$", "maxLength": 3}
PROMPT = [0, 2, 3]


def _toy(seed: int = 0) -> sd.FunctionModel:
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(251, len(VOCAB), generator=g, dtype=torch.float64)
    return sd.FunctionModel(lambda ctx: table[(ctx.sum(-1) * 7 + ctx.shape[-1]) % 251], vocab=VOCAB, eos="<eos>")


def test_masks_equal_llguidance_on_every_short_sequence():
    model = _toy()
    auto = JSONSchema(TOY_SCHEMA).bind(model)
    llg = JSONSchema(TOY_SCHEMA, path="llguidance").bind(model)
    assert auto.path == "automaton" and len(auto.regexes) == 2
    text = [t for t in range(len(VOCAB)) if t not in (0, EOS)]
    checked = 0
    for n in range(5):
        for seq in itertools.product(text, repeat=n):
            a, b = auto.logw_next(list(seq)), llg.logw_next(list(seq))
            if torch.isinf(a).all():
                assert torch.isinf(b).all(), [VOCAB[t] for t in seq]
                continue
            assert torch.equal(a, b), [VOCAB[t] for t in seq]
            assert auto.complete(list(seq)) == llg.complete(list(seq))
            checked += 1
    assert checked > 10


def test_engine_round_is_exact_on_a_held_string():
    from test_structured_paths import _tiny_engine, engine_is_exact

    from smcdecode.backends.engine.targets import DeviceAutomaton, EngineTarget

    engine, model = _tiny_engine(vocab=VOCAB)
    constraint = JSONSchema(TOY_SCHEMA).bind(model)
    target = sd.LM(model) * constraint
    assert DeviceAutomaton.of(constraint, "cpu") is not None
    engine_is_exact(engine, model, constraint, EngineTarget.of(target), PROMPT, 5, seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(set(FORMATS) - SUBSET_FORMATS) + ["email+maxLength", "pattern+maxLength", "format+pattern"])
def test_exact_formats_and_held_strings_equal_llguidance_masks_on_the_default_model(fmt):
    """Along random walks through llguidance's masks with the default model's vocabulary (each step a
    token drawn uniformly from those allowed, those that close a string or hold an @ more often), the
    automaton's mask equals llguidance's at every step, to the end of the document."""
    model = sd.load_model()
    value = {"email+maxLength": {"type": "string", "format": "email", "maxLength": 12},
             "pattern+maxLength": {"type": "string", "pattern": "^[a-z]+(-[0-9]+)?$", "maxLength": 9},
             "format+pattern": {"type": "string", "format": "ipv4", "pattern": "^10\\.", "minLength": 9},
             }.get(fmt, {"type": "string", "format": fmt})
    schema = {"type": "object", "properties": {"v": value}, "required": ["v"], "additionalProperties": False}
    auto = JSONSchema(schema).bind(model)
    llg = JSONSchema(schema, path="llguidance").bind(model)
    assert auto.path == "automaton", auto.path_reason
    from test_structured_paths import walk_llguidance

    ended = walk_llguidance(model, llg, auto.token_automaton, seed=5, exact=True, what=fmt)
    assert ended, fmt


def test_unsatisfiable_budget_and_enum_beside_a_format():
    """A held string no string satisfies raises on every path (an error before any generation);
    lengths beside formats or patterns past ``MAX_HELD`` characters stay on llguidance's path (their
    product automaton would take long to build); an enum beside a format keeps its values in the format."""
    from smcdecode.potentials.schema_regex import MAX_HELD

    for schema in ({"type": "string", "pattern": "^[0-9]{3}$", "maxLength": 2},
                   {"type": "object", "properties": {"d": {"type": "string", "format": "time", "maxLength": 5}},
                    "required": ["d"], "additionalProperties": False}):
        for path in ("auto", "automaton"):
            with pytest.raises(sd.SMCDecodeError, match="nsatisfiable"):
                JSONSchema(schema, path=path)
    email = {"type": "string", "format": "email", "maxLength": MAX_HELD + 1}
    c = JSONSchema(email)
    assert c.path == "llguidance" and f"more than {MAX_HELD}" in c.path_reason, c.path_reason
    two = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
           "properties": {k: {"type": "string", "format": "email", "maxLength": MAX_HELD // 2} for k in "ab"}}
    assert JSONSchema(two).path == "automaton"
    c = JSONSchema({"enum": ["x", "12:00:00Z", 3], "format": "time"})
    assert c.path == "automaton" and all(re.fullmatch(c.regexes[0], t) for t in ('"12:00:00Z"', "3"))
    assert not re.fullmatch(c.regexes[0], '"x"')
