"""JSON Schema on the device automaton and on llguidance: the translation to a regex, the token
automaton with token classes, the choice of path, and the same distribution on every path (exact
enumeration: the engine's automaton round, the engine's host-mask round (llguidance) and the
reference backend against the exact target), and mask agreement on the real default model."""

from __future__ import annotations

import copy
import itertools
import json
import re

import pytest
import torch

import smcdecode as sd
from smcdecode.backends.engine.config import EngineConfig
from smcdecode.backends.engine.targets import CombinedAutomaton, DeviceAutomaton, EngineTarget
from smcdecode.potentials.json_schema import JSONSchema
from smcdecode.potentials.schema_regex import (
    ANY_STRING,
    SUPERSET_FORMATS,
    UnsupportedSchema,
    schema_regex,
    string_except,
)
from smcdecode.testing import check_distribution, check_evidence_unbiased, exact_target, sequences

VOCAB = ["<bos>", "[", "]", "[1", "1", "2", ", ", "true", "<eos>"]
EOS = len(VOCAB) - 1
SCHEMA = {"type": "array", "items": {"enum": [1, 2, True]}, "minItems": 1, "maxItems": 2}
PROMPT = [0, 1, 2]


def _toy(seed: int = 0) -> sd.FunctionModel:
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(251, len(VOCAB), generator=g, dtype=torch.float64)
    return sd.FunctionModel(lambda ctx: table[(ctx.sum(-1) * 7 + ctx.shape[-1]) % 251], vocab=VOCAB, eos="<eos>")


# -- the translation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lo, hi", [(0, 130), (-5, 120), (7, None), (None, -3), (-300, -7), (99, 101)])
def test_integer_ranges_are_exact(lo, hi):
    schema = {"type": "integer", **({"minimum": lo} if lo is not None else {}), **({"maximum": hi} if hi is not None else {})}
    rx = re.compile(schema_regex(schema))
    for v in range(-1000, 1000):
        assert bool(rx.fullmatch(str(v))) == ((lo is None or v >= lo) and (hi is None or v <= hi)), v
    assert not rx.fullmatch("007") and not rx.fullmatch("1.0")


def test_bounded_numbers_validate():
    import jsonschema

    schema = {"type": "number", "exclusiveMinimum": -2, "maximum": 3}
    rx, check = re.compile(schema_regex(schema)), jsonschema.Draft202012Validator(schema)
    for text in ["-2", "-1.99", "-2.0", "-2.5", "0", "-0.5", "3", "3.0", "3.01", "2.999", "-0.0"]:
        if rx.fullmatch(text):
            assert check.is_valid(json.loads(text)), text
    for text in ["-1.99", "0", "3", "3.0", "2.999"]:
        assert rx.fullmatch(text), text


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "additionalProperties": False}, "$ref"),
    ({"type": "object"}, "additionalProperties"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "string", "format": "uri"}, "format"),
    ({"not": {"type": "string"}}, "not"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "oneOf"),
    ({"type": "string", "pattern": "a\"b"}, "pattern"),
])
def test_unsupported_keywords_are_named(schema, keyword):
    with pytest.raises(UnsupportedSchema) as e:
        schema_regex(schema)
    assert e.value.keyword == keyword and repr(keyword) in str(e.value)
    # the automaton path asked for raises it; "auto" falls back to llguidance and says why
    with pytest.raises(sd.SMCDecodeError, match=re.escape(repr(keyword))):
        JSONSchema(schema, path="automaton")
    try:
        auto = JSONSchema(schema)
    except sd.SMCDecodeError:  # llguidance refuses some of them too (not, oneOf): never unconstrained
        return
    if auto.path == "superset":  # a keyword that only narrows the documents: the superset drops it
        assert any(keyword in w for w in auto.superset_widens), auto.superset_widens
    else:
        assert auto.path == "llguidance" and repr(keyword) in auto.path_reason


# a subschema with its own $id: "#/$defs/t" inside it means its own t (an integer), not the root's (a
# string); "#additionalProperties" is an anchor, not the pointer /additionalProperties
NESTED_ID = {"$defs": {"t": {"type": "string"}, "inner": {
    "$id": "http://example.com/inner", "type": "object", "properties": {"v": {"$ref": "#/$defs/t"}},
    "required": ["v"], "additionalProperties": False, "$defs": {"t": {"type": "integer"}}}},
    "type": "object", "properties": {"o": {"$ref": "#/$defs/inner"}}, "required": ["o"], "additionalProperties": False}
ANCHOR_REF = {"type": "object", "properties": {"x": {"$ref": "#additionalProperties"}}, "required": ["x"],
              "additionalProperties": {"type": "string"},
              "$defs": {"d": {"$anchor": "additionalProperties", "type": "integer"}}}


@pytest.mark.parametrize("schema", [NESTED_ID, ANCHOR_REF], ids=["nested $id", "anchor"])
def test_references_the_translations_do_not_follow_are_refused(schema):
    """A $ref that resolves against a subschema's own $id, or names an anchor, is refused by the
    automaton and the superset (which would read it against the root, or as a pointer, and drop the
    documents llguidance takes): "auto" takes llguidance's masks and says why."""
    with pytest.raises(sd.SMCDecodeError, match=re.escape("'$ref'") if schema is NESTED_ID else None):
        JSONSchema(schema, path="automaton")  # (the anchor's object is refused by its open keys first)
    with pytest.raises(sd.SMCDecodeError, match=re.escape("'$ref'")):
        JSONSchema(schema, path="superset")
    auto = JSONSchema(schema)
    assert auto.path == "llguidance" and "'$ref'" in auto.path_reason


def test_pattern_is_a_search_unless_anchored():
    loose = re.compile(schema_regex({"type": "string", "pattern": "[0-9]+"}))
    anchored = re.compile(schema_regex({"type": "string", "pattern": "^[0-9]+$"}))
    assert loose.fullmatch('"ab12c"') and not loose.fullmatch('"abc"')
    assert anchored.fullmatch('"12"') and not anchored.fullmatch('"a12"')


def test_path_choice_and_errors():
    assert JSONSchema(SCHEMA).path == "automaton"
    assert JSONSchema(SCHEMA, path="llguidance").path == "llguidance"
    assert JSONSchema(SCHEMA, force_canonical=True).path == "llguidance"
    with pytest.raises(sd.SMCDecodeError, match="path must be one of"):
        JSONSchema(SCHEMA, path="gpu")


# -- the token automaton -----------------------------------------------------------------------------


def test_masks_equal_llguidance_on_every_short_sequence():
    model = _toy()
    auto, llg = JSONSchema(SCHEMA).bind(model), JSONSchema(SCHEMA, path="llguidance").bind(model)
    assert auto.path == "automaton"
    text = [t for t in range(len(VOCAB)) if t not in (0, EOS)]
    checked = 0
    for n in range(4):
        for seq in itertools.product(text, repeat=n):
            a = auto.logw_next(list(seq))
            if torch.isinf(a).all():
                assert torch.isinf(llg.logw_next(list(seq))).all()
                continue
            assert torch.equal(a, llg.logw_next(list(seq))), [VOCAB[t] for t in seq]
            assert auto.complete(list(seq)) == llg.complete(list(seq))
            checked += 1
    assert checked > 10


def test_token_classes_and_combined_automaton():
    model = _toy()
    a = JSONSchema(SCHEMA).bind(model).token_automaton
    b = sd.Regex(r"\[(1|2)*\]").bind(model).token_automaton
    assert a.num_classes < len(VOCAB) + 1
    dense = a.dense()  # [S+1, V]: tokens of one class have one column, different classes different ones
    cols = {c: tuple(dense[:, v].tolist()) for v, c in enumerate(a.classes.tolist())}
    assert all(tuple(dense[:, v].tolist()) == cols[c] for v, c in enumerate(a.classes.tolist()))
    assert len(set(cols.values())) == len(cols) == a.num_classes
    da, db = (DeviceAutomaton(x.table, x.classes.long(), x.accepting, x.initial, x.dead) for x in (a, b))
    both = CombinedAutomaton.of([da, db], "cpu")
    g = torch.Generator().manual_seed(0)
    for part, x in ((da, a), (db, b)):
        s, t = torch.tensor([both.initial_of(part)]), torch.tensor([x.initial])
        for _ in range(6):
            m = both.allowed(s)[0]
            assert torch.equal(m, x.allowed(t)[0])
            assert bool(both.accepting[s]) == bool(x.accepting[t])
            if not m.any():
                break
            v = torch.multinomial(m.double(), 1, generator=g)
            s, t = both.advance(s, v), x.advance(t, v)


# -- the same distribution on every path -------------------------------------------------------------


def test_reference_backend_automaton_and_llguidance_paths_are_exact():
    model = _toy(1)
    for path in ("automaton", "llguidance"):
        target = sd.LM(model) * JSONSchema(SCHEMA, path=path)
        exact = exact_target(target, PROMPT, 4)
        out = sd.SMC(target, particles=4).run_groups(PROMPT, groups=800, max_new_tokens=4, seed=3)
        check_distribution(out, exact, z_max=5.0)


def _tiny_engine(host_workers: int = 0, vocab: list = VOCAB):
    transformers = pytest.importorskip("transformers")
    from smcdecode.backends.engine import Engine, Llama

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    target_hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target_hf.lm_head.weight.normal_(0.0, 0.15)
    draft_hf = copy.deepcopy(target_hf)
    with torch.no_grad():
        draft_hf.lm_head.weight.add_(torch.randn(draft_hf.lm_head.weight.shape) * 0.03)
    exact_hf = copy.deepcopy(target_hf).double()

    def fn(ctx):
        with torch.no_grad():
            return exact_hf(ctx).logits[:, -1]

    model = sd.FunctionModel(fn, vocab=vocab, eos="<eos>", name="tiny-llama")
    engine = Engine(Llama.from_hf(target_hf, dtype=torch.float32, device="cpu"),
                    Llama.from_hf(draft_hf, dtype=torch.float32, device="cpu"),
                    config=EngineConfig(num_pages=30000, page_size=4, max_context=32, host_workers=host_workers))
    return engine, model


def test_engine_device_automaton_and_host_llguidance_rounds_are_exact():
    engine, model = _tiny_engine()
    for path in ("automaton", "llguidance"):
        constraint = JSONSchema(SCHEMA, path=path).bind(model)
        target = sd.LM(model) * constraint
        prog = EngineTarget.of(target)
        assert (DeviceAutomaton.of(constraint, "cpu") is None) == (path == "llguidance")
        engine_is_exact(engine, model, constraint, prog, PROMPT, 4, seed=11)


def engine_is_exact(engine, model, constraint, prog, prompt: list, new: int, seed: int) -> None:
    """1200 requests of 4 particles (K = 2) on the engine: every finished document valid, the weighted
    particles' distribution and the evidence those of the exact target (exact enumeration)."""
    exact = exact_target(sd.LM(model) * constraint, prompt, new)
    eos = model.eos_token_id
    out = engine.smc_sd([prompt] * 1200, particles=4, block_size=2, max_new_tokens=new, draft_temperature=1.2,
                        target_temperature=1.0, eos_token_id=eos, ess_threshold=0.5, resampler="systematic",
                        target=prog, seed=seed)
    out = type("Out", (), dict(tokens=out.tokens.cpu(), lengths=out.lengths.cpu(),
                               log_weights=out.log_weights.cpu(), log_evidence=out.log_evidence.cpu()))
    for g in range(0, 1200, 40):
        for x, w in zip(sequences(out, g), out.log_weights[g].tolist()):
            if w > float("-inf"):
                assert constraint.is_valid(model.decode([t for t in x if t != eos])), x
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)


# -- the real default model --------------------------------------------------------------------------

REAL_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                      "ok": {"type": "boolean"}}, "required": ["name"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
                                      "x": {"type": "number"}, "y": {"anyOf": [{"type": "null"}, {"type": "string"}]}},
     "required": ["x", "y"]},
]
REAL_DOCUMENTS = [
    ['{"name": "Ann", "age": 31, "ok": true}', '{"name": "\\"q\\" é", "ok": false}', '{"name": ""}'],
    ['{"tags": ["red", "green"], "x": -1.5e3, "y": null}', '{"x": 0, "y": "Paris, France"}'],
]


@pytest.mark.slow
def test_automaton_masks_agree_with_llguidance_on_the_default_model():
    model = sd.load_model()
    for schema, docs in zip(REAL_SCHEMAS, REAL_DOCUMENTS):
        auto = JSONSchema(schema, extra_properties=False).bind(model)
        llg = JSONSchema(schema, extra_properties=False, path="llguidance").bind(model)
        assert auto.path == "automaton"
        assert auto.token_automaton.nbytes < 16 * 2**20
        for doc in docs:
            ids = model.encode(doc)
            sa, sl = auto.start(1), llg.start(1)
            for i, t in enumerate(ids):
                ma, ml = auto.allowed(sa)[0], llg.allowed(sl)[0]
                diff = (ma != ml).nonzero().flatten().tolist()
                assert not diff, (doc, model.decode(ids[:i]), [model.token_strings[d] for d in diff[:5]])
                assert ma[t], (doc, i)
                sa, sl = auto.advance(sa, torch.tensor([t])), llg.advance(sl, torch.tensor([t]))
            assert bool(auto.accepting(sa)[0]) and bool(llg.accepting(sl)[0])
            assert bool(auto.allowed(sa)[0, model.eos_token_id])


def test_regex_masks_allow_exactly_the_tokens_that_keep_a_match_reachable():
    model = _toy()
    c = sd.Regex(r"1|\[x").bind(model)  # "[" starts "[x" in characters, but no token spells "x"
    allowed = c.allowed(c.start(1))[0]
    assert [VOCAB[t] for t in allowed.nonzero().flatten().tolist()] == ["1"]
    assert c.token_automaton.num_states == 2  # start and after "1"


@pytest.mark.parametrize("text, ok", [('["\x80"]', True), ('["\x9f"]', True), ('["\xa0"]', True),
                                      ('["\x7f"]', False), ('["\\u007f"]', True), ('["\\u0080"]', False),
                                      ('["\x1f"]', False), ('["\\u001f"]', True)])
def test_both_paths_take_the_same_string_characters(text, ok):
    """Raw U+0080–U+009F are JSON string characters on both paths; DEL and C0 controls only escaped."""
    pytest.importorskip("llguidance")
    from test_json_schema import char_model

    schema = {"type": "array", "items": {"type": "string"}}
    model = char_model(text)
    for path in ("automaton", "llguidance"):
        assert JSONSchema(schema, path=path).bind(model).matches(text) is ok, path


def test_auto_takes_the_superset_where_the_device_path_would_take_a_subset():
    """Bounded numbers: the device regex is a strict subset of llguidance's documents, so 'auto' does
    not take it (every path must sample the same target): it takes the superset path, whose automaton
    widens them, and says where; 'automaton' takes the subset when asked. Formats but date and
    date-time are llguidance's languages: exact, beside a length too; where the superset must widen
    one, auto keeps llguidance."""
    auto = JSONSchema({"type": "number", "minimum": 0, "maximum": 5})
    assert auto.path == "superset" and auto.superset_widens == ["bounded number at /"]
    assert JSONSchema({"type": "number", "minimum": 0, "maximum": 5}, path="automaton").path == "automaton"
    # a format widened to any string: particles die often, so auto keeps llguidance's masks
    uri = {"type": "string", "format": "uri"}
    auto = JSONSchema(uri)
    assert auto.path == "llguidance" and "format (any string)" in auto.path_reason, auto.path_reason
    assert JSONSchema(uri, path="superset").superset_widens == ["format (any string) at /"]
    # a format beside a length inside an anyOf (no intersection there): the superset takes the format
    # alone; auto keeps llguidance (particles die where the draft leaves the length)
    date = {"anyOf": [{"type": "string", "format": "date", "maxLength": 20}, {"type": "integer"}]}
    assert JSONSchema(date).path == "llguidance"
    assert JSONSchema(date, path="superset").superset_widens == [
        "format 'date' beside maxLength (a regular superset of the format alone) at /anyOf/0"]
    assert JSONSchema({"type": "string", "format": "date"}).path == "llguidance"  # (a subset: no 29 February)
    for fmt in ("time", "email"):  # (llguidance's languages: exact, beside a length too)
        c = JSONSchema({"type": "string", "format": fmt, "maxLength": 20})
        assert c.path == "automaton" and len(c.regexes) == 2, c.path_reason
    # a pattern beside a length: exact on the automaton; the superset takes the pattern alone
    code = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}
    assert JSONSchema(code).path == "automaton"
    assert JSONSchema(code, path="superset").superset_widens == [
        "pattern beside minLength/maxLength (the pattern alone) at /"]
    assert JSONSchema({"type": "integer", "minimum": 0, "maximum": 5}).path == "automaton"  # (exact)


# -- the superset path -------------------------------------------------------------------------------

# bounded numbers: the exact regex would take a strict subset (no exponent), the superset any number
S_BOUNDED = {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 1, "maxItems": 2}


def test_superset_masks_contain_llguidance_masks_on_every_short_sequence():
    """After every prefix llguidance keeps, the superset automaton allows every token llguidance
    allows (the proposal's support holds the target's), and somewhere more (it is wider)."""
    model = _toy()
    sup, llg = JSONSchema(S_BOUNDED).bind(model), JSONSchema(S_BOUNDED, path="llguidance").bind(model)
    assert sup.path == "superset" and sup.token_automaton is None
    a = sup.superset_automaton
    text = [t for t in range(len(VOCAB)) if t not in (0, EOS)]
    wider = checked = 0
    for n in range(5):
        for seq in itertools.product(text, repeat=n):
            ok = torch.isfinite(llg.logw_next(list(seq)))
            if not ok.any():
                continue
            state = torch.tensor([a.initial])
            for t in seq:
                state = a.advance(state, torch.tensor([t]))
            mask = a.allowed(state)[0]
            assert not (ok & ~mask).any(), [VOCAB[t] for t in seq]
            wider += int((mask & ~ok).any())
            checked += 1
    assert checked >= 10 and wider > 0


def test_further_keys_exclude_exactly_the_declared_names():
    """``string_except``: every JSON string of up to four characters from a small alphabet (escapes
    too) matches unless it is one of the words; a word with a \\u escape falls back to any string."""
    words = [json.dumps(w) for w in ["name", "age", "nam", 'a"b', "t\\x"]]
    regex = string_except(words)
    alphabet = ["n", "a", "m", "e", "g", '\\"', "b", "t", "\\\\", "x", "é", "\\u0041"]
    checked = 0
    for k in range(5):
        for units in itertools.product(alphabet, repeat=k):
            text = '"' + "".join(units) + '"'
            assert bool(re.fullmatch(regex, text)) == (text not in words), text
            checked += 1
    assert checked > 20000
    assert string_except(['"\\u00e9"']) == ANY_STRING


def test_superset_path_choice_and_errors():
    open_keys = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "boolean"}}
    c = JSONSchema(open_keys)
    assert c.path == "superset" and c.superset_widens == ["further keys (repeats too) at /"]
    assert JSONSchema(open_keys, path="llguidance").path == "llguidance"
    assert JSONSchema(SCHEMA, path="superset").path == "superset"  # (asked for: its superset is itself)
    # any value (no type) has no regular superset that guides: auto keeps llguidance, asked for raises
    assert JSONSchema({"type": "object"}).path == "llguidance"
    with pytest.raises(UnsupportedSchema, match="'\\(any\\)'"):
        JSONSchema({"type": "object"}, path="superset")
    with pytest.raises(sd.SMCDecodeError, match="path must be one of"):
        JSONSchema(SCHEMA, path="supersets")


@pytest.mark.parametrize("block_size, host_masks, workers",
                         [(3, False, 0), (2, False, 0), (2, True, 0), (2, True, 2), (3, False, 2), (2, False, 2)])
def test_engine_superset_round_is_exact_and_one_particle_takes_masks(block_size, host_masks, workers):
    """The engine's superset path (device automaton of the superset, llguidance's check of each
    round's tokens, weight 0 where they leave the documents) samples the exact target; a request of
    one particle (locally-masked decoding) takes llguidance's masks instead, so it never dies.
    block_size 3: every document within one round (the check's verdict decides); 2: over two
    rounds (a request whose particle died switches to masks for the second); ``host_masks``: the
    program's constraints all through the host (no device automaton): llguidance's masks, computed
    in the engine's process or (``workers``) in two mask worker processes, which also check the
    superset path's tokens."""
    engine, model = _tiny_engine(workers)
    constraint = JSONSchema(S_BOUNDED).bind(model)
    target = sd.LM(model) * constraint
    assert constraint.path == "superset" and DeviceAutomaton.of(constraint, "cpu") is not None
    exact = exact_target(target, PROMPT, 4)
    kw = dict(block_size=block_size, max_new_tokens=4, draft_temperature=1.2, target_temperature=1.0, eos_token_id=EOS,
              ess_threshold=0.5, resampler="systematic", target=EngineTarget.of(target, host_masks=host_masks))
    out = engine.smc_sd([PROMPT] * 1200, particles=4, seed=11, **kw)
    out = type("Out", (), dict(tokens=out.tokens.cpu(), lengths=out.lengths.cpu(),
                               log_weights=out.log_weights.cpu(), log_evidence=out.log_evidence.cpu()))
    for g in range(1200):
        for x, w in zip(sequences(out, g), out.log_weights[g].tolist()):
            if w > float("-inf"):  # (the superset ends "[2]"; llguidance's check gives it weight 0)
                assert constraint.is_valid(model.decode([t for t in x if t != EOS])), x
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)
    hosts = [engine.graphs[k].host for k in engine.graphs.keys() if getattr(engine.graphs[k], "host", None) is not None]
    assert hosts and [h._pool is not None for h in hosts] == [bool(workers)] * len(hosts)  # (workers: they held it)
    one = engine.smc_sd([PROMPT] * 200, particles=1, seed=12, **{**kw, "max_new_tokens": 8})
    for g in range(200):
        x = one.tokens[g, 0, : one.lengths[g, 0]].tolist()
        assert x[-1] == EOS and constraint.is_valid(model.decode(x[:-1])), x


SUPERSET_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name"], "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                      "n": {"type": "number", "minimum": 0.5, "maximum": 2}},
     "required": ["d", "n"], "additionalProperties": False, "patternProperties": {"^x[0-9]$": {"type": "boolean"}}},
]
SUPERSET_DOCUMENTS = [
    ['{"name": "Ann", "age": 31, "x": 5}', '{"name": "Bo", "extra key": -2, "b": 0}', '{"name": "é"}'],
    ['{"d": "2024-02-29", "n": 1.5, "x1": true}', '{"d": "1999-12-31", "n": 2}'],
]


@pytest.mark.slow
def test_superset_masks_contain_llguidance_masks_on_the_default_model():
    model = sd.load_model()
    for schema, docs in zip(SUPERSET_SCHEMAS, SUPERSET_DOCUMENTS):
        sup = JSONSchema(schema, path="superset").bind(model)
        llg = JSONSchema(schema, path="llguidance").bind(model)
        assert sup.path == "superset"
        a = sup.superset_automaton
        assert a.nbytes < 16 * 2**20
        for doc in docs:
            assert sup.is_valid(doc), doc
            ids = model.encode(doc) + [model.eos_token_id]
            state, sl = torch.tensor([a.initial]), llg.start(1)
            for i, t in enumerate(ids):
                ml, ms = llg.allowed(sl)[0], a.allowed(state)[0]
                missing = (ml & ~ms).nonzero().flatten().tolist()
                assert not missing, (doc, model.decode(ids[:i]), [model.token_strings[d] for d in missing[:5]])
                assert ml[t], (doc, i)
                state, sl = a.advance(state, torch.tensor([t])), llg.advance(sl, torch.tensor([t]))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(SUPERSET_FORMATS) + ["email+maxLength", "pattern+maxLength"])
def test_format_supersets_contain_llguidance_strings_on_the_default_model(fmt):
    """A string format kept on the superset path (``SUPERSET_FORMATS``; beside a length, the format
    alone) and a pattern beside a length (the pattern alone): along random walks through llguidance's
    masks with the default model's vocabulary (each step a token drawn uniformly from those llguidance
    allows, those that close a string or hold an @ more often: odd corners of the format too), the
    superset automaton allows every token llguidance allows, up to the end of the document."""
    model = sd.load_model()
    if fmt == "pattern+maxLength":
        value = {"type": "string", "pattern": "^[a-z]+(-[0-9]+)?$", "maxLength": 9}
    elif fmt == "email+maxLength":
        value = {"type": "string", "format": "email", "maxLength": 12}
    else:
        value = {"type": "string", "format": fmt}
    schema = {"type": "object", "properties": {"v": value}, "required": ["v"], "additionalProperties": False}
    sup = JSONSchema(schema, path="superset").bind(model)
    llg = JSONSchema(schema, path="llguidance").bind(model)
    assert sup.path == "superset" and not any("(any string)" in w for w in sup.superset_widens), sup.superset_widens
    ended = walk_llguidance(model, llg, sup.superset_automaton, seed=11, exact=False, what=fmt)
    assert ended, fmt  # (some walks reached the end of a document)


def walk_llguidance(model, llg, a, seed: int, exact: bool, what, walks: int = 12, steps: int = 48) -> int:
    """Random walks through llguidance's masks (each step a token drawn uniformly from those allowed,
    those that close a string or hold an @, and EOS, more often, so that walks end): at every step the
    token automaton ``a`` allows every token llguidance allows (``exact``: exactly those). Returns how
    many walks ended a document."""
    g = torch.Generator().manual_seed(seed)
    closing = torch.tensor([isinstance(x, str) and ('"' in x or "@" in x) for x in model.token_strings])
    closing[model.eos_token_id] = True
    ended = 0
    for _walk in range(walks):
        state, sl = torch.tensor([a.initial]), llg.start(1)
        prefix = []
        for _ in range(steps):
            ml, ma = llg.allowed(sl)[0], a.allowed(state)[0]
            wrong = ((ml != ma) if exact else (ml & ~ma)).nonzero().flatten().tolist()
            assert not wrong, (what, model.decode(prefix), [(model.token_strings[d], bool(ml[d])) for d in wrong[:5]])
            if not ml.any():
                break
            t = int(torch.multinomial(ml.double() * (1 + 300 * closing), 1, generator=g))
            if t == model.eos_token_id:
                ended += 1
                break
            prefix.append(t)
            state, sl = a.advance(state, torch.tensor([t])), llg.advance(sl, torch.tensor([t]))
    return ended


def test_superset_check_of_a_round_takes_eos_after_a_finished_document():
    """The host's check (``consume_rows``): rows sharing a matcher part ways, a token llguidance
    refuses kills its row only, and an EOS that comes a round after the document closed is taken."""
    from smcdecode.potentials.matchers import consume_rows

    model = _toy()
    c = JSONSchema(S_BOUNDED).bind(model)
    t = {v: i for i, v in enumerate(VOCAB)}
    state = c.start(3)
    state = consume_rows(c, state, [[t["[1"], t["]"]], [t["["], t["2"]], None])
    assert [state.dead(i) for i in range(3)] == [False, True, False]  # (2 > maximum 1)
    state = consume_rows(c, state, [[EOS], None, [t["[1"], t[", "], t["1"]]])
    assert [state.dead(i) for i in range(3)] == [False, True, False]
    assert c.accepting(state).tolist() == [True, False, False]


def test_auto_falls_back_to_llguidance_where_the_token_automaton_is_too_large(monkeypatch):
    """Bound to a model, an automaton (or a superset's) past MAX_STATES: path='auto' takes llguidance's
    masks and says why, a path asked for raises; a regex interegular refuses falls back at once."""
    from smcdecode.potentials import automaton

    model = _toy()
    monkeypatch.setattr(automaton, "MAX_STATES", 2)
    auto = JSONSchema(SCHEMA)
    assert auto.path == "automaton"
    bound = auto.bind(model)
    assert bound.path == "llguidance" and "more than 2 states" in bound.path_reason
    assert bound.automaton is None and bound.token_automaton is None
    assert auto.path == "automaton"  # (the unbound constraint keeps its choice)
    llg = JSONSchema(SCHEMA, path="llguidance").bind(model)
    text = [t for t in range(len(VOCAB)) if t not in (0, EOS)]
    for n in range(3):
        for seq in itertools.product(text, repeat=n):
            assert torch.equal(bound.logw_next(list(seq)), llg.logw_next(list(seq)))
    with pytest.raises(sd.SMCDecodeError, match="more than 2 states: use path='llguidance'"):
        JSONSchema(SCHEMA, path="automaton").bind(model)
    words = ["<bos>", "{", '"a"', '"b"', ": ", "1", "true", ", ", "}", "<eos>"]
    braces = sd.FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], len(words), dtype=torch.float64),
                              vocab=words, eos="<eos>")
    open_keys = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "boolean"}}
    assert JSONSchema(open_keys).path == "superset"
    sup = JSONSchema(open_keys).bind(braces)
    assert sup.path == "llguidance" and sup.superset_automaton is None and "superset's" in sup.path_reason
    assert sup.superset_regex is None and not sup.superset_widens
    with pytest.raises(sd.SMCDecodeError, match="use path='llguidance'"):
        JSONSchema(open_keys, path="superset").bind(braces)
    # repetition counts past what is spelled out: the regex is refused, the schema takes llguidance
    nested = {"type": "array", "maxItems": 40, "items": {"type": "array", "maxItems": 40, "items": {"enum": [1]}}}
    c = JSONSchema(nested)
    assert c.path == "llguidance" and "repetition counts" in c.path_reason


def test_auto_falls_back_to_llguidance_where_building_the_automaton_takes_too_long(monkeypatch):
    """path='auto' gives each build of a device automaton AUTO_BUILD_S seconds (the character automaton
    at construction, the token automaton at binding); past it, llguidance's masks; a path asked for
    has no limit."""
    from smcdecode.potentials import automaton

    model = _toy()
    monkeypatch.setattr(automaton, "AUTO_BUILD_S", 0.0)
    c = JSONSchema(SCHEMA)  # (the character automaton: past the limit at once)
    assert c.path == "llguidance" and "took longer than 0 s" in c.path_reason
    assert JSONSchema(SCHEMA, path="automaton").bind(model).path == "automaton"
    monkeypatch.setattr(automaton, "AUTO_BUILD_S", 60.0)
    c = JSONSchema(SCHEMA)
    assert c.path == "automaton"
    monkeypatch.setattr(automaton, "AUTO_BUILD_S", 0.0)  # (the token automaton, at binding)
    bound = c.bind(model)
    assert bound.path == "llguidance" and "took longer than 0 s" in bound.path_reason
    grammar = sd.Grammar('start: "a" | "b" "c"')
    assert grammar.path == "llguidance" and "took longer" in grammar.path_reason
    with automaton.build_limit(None):  # (no limit: the walk runs to the end)
        automaton.check_time()
    with automaton.build_limit(0.0), pytest.raises(automaton.TooSlow):
        automaton.check_time()
