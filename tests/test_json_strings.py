"""Masks inside string values (json_strings.py) on llguidance's path: the same masks as llguidance's,
bit for bit, on the default model's vocabulary along random walks; the subschema found along a
document's path; the engine's round with them still exact (exact enumeration)."""

from __future__ import annotations

import random

import pytest
import torch
from test_structured_paths import _tiny_engine, engine_is_exact

import smcdecode as sd
from smcdecode.backends.engine.targets import EngineTarget
from smcdecode.potentials import json_strings
from smcdecode.potentials.constraint import unpack_bits
from smcdecode.potentials.json_schema import JSONSchema
from smcdecode.potentials.json_strings import AUTOMATON, StringMasks, automaton_strings
from smcdecode.potentials.matchers import MatcherBatch, Stopped, consume_rows, fill_bits_together
from smcdecode.potentials.schema_regex import UnsupportedSchema, schema_regex

pytest.importorskip("llguidance")

# a tree of nodes (recursive: llguidance's path) with a pattern, a format beside a length, a length
# and an enum among their strings
NODE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"}, "role": {"enum": ["lead", "dev"]},
    "email": {"type": "string", "format": "email", "maxLength": 32}, "id": {"type": "string", "minLength": 3,
                                                                             "maxLength": 8},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["name", "email"]}}}
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
     "properties": {"name": {"type": "string", "maxLength": 10},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}}},
    NODE,
    # enums (one with a number beside its strings, one with a character that JSON may escape), a plain
    # string, a const
    {"type": "object", "additionalProperties": False, "required": ["kind", "note"],
     "properties": {"kind": {"enum": ["café", "tea", 3, "a\"b"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
                    "note": {"type": "string"}, "v": {"const": "v1"}}},
    # an array of formatted strings at the root; a key that JSON writes with an escape
    {"type": "array", "items": {"type": "string", "format": "ipv4"}, "maxItems": 3},
    {"type": "object", "properties": {'a"b': {"type": "string", "maxLength": 3}, "c": {"type": "string", "minLength": 2}},
     "required": ['a"b', "c"], "additionalProperties": False},
    # further keys (unique: the key rule) whose values are held strings; a prefixItems tuple
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "pair": {"type": "array", "prefixItems": [{"type": "string", "format": "uuid"},
                                                                                {"type": "string", "maxLength": 3}]}},
     "additionalProperties": {"type": "string", "minLength": 2, "maxLength": 5}},
]
# numbers at several places beside held strings (outlines leave a number's digits out once it ended)
NUMBERS = {"type": "object", "additionalProperties": False, "required": ["a", "b", "c", "d"], "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 150}, "b": {"type": "array", "items": {"type": "integer"},
                                                                    "maxItems": 3},
    "c": {"type": "string", "maxLength": 5}, "d": {"type": "number"},
    "e": {"type": "array", "maxItems": 2, "items": {"type": "object", "additionalProperties": False, "required": ["n", "s"],
                                                    "properties": {"n": {"type": "integer"},
                                                                   "s": {"type": "string", "maxLength": 3}}}}}}


def _masks(c, state) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mask with the string automata's masks, llguidance's alone) at ``state`` (one row)."""
    ours = torch.zeros(1, c._words, dtype=torch.int32)
    theirs = torch.zeros(1, c._words, dtype=torch.int32)
    fill_bits_together([(c, state, 0)], ours, 1)
    fill_bits_together([(c, MatcherBatch([state.matchers[0].deep_copy()], state.keys, None), 0)], theirs, 1)
    return ours, theirs


@pytest.mark.slow
@pytest.mark.parametrize("index, whitespace", [(i, "compact") for i in range(len(SCHEMAS))] + [(0, "flexible"),
                                                                                           (1, "flexible")])
def test_string_masks_equal_llguidance_on_the_default_model(index, whitespace):
    model = sd.load_model()
    c = JSONSchema(SCHEMAS[index], path="llguidance", whitespace=whitespace).bind(model)
    assert c._strings is not None
    assert _walks_agree(c, model, random.Random(index), 12) > 20  # (the walks went through the strings)


@pytest.mark.slow
def test_automata_built_when_first_needed_give_the_same_masks(monkeypatch):
    """Past the build budget at binding (here none), automata and rows are built during the walk."""
    monkeypatch.setattr(json_strings, "EAGER_S", 0.0)
    monkeypatch.setattr(json_strings, "_BUILT", {})
    model = sd.load_model()
    c = JSONSchema(NODE, path="llguidance").bind(model)
    assert not c._strings._distinct  # (nothing built at binding)
    assert _walks_agree(c, model, random.Random(7), 6) > 5


@pytest.mark.slow
def test_masks_and_steps_kept_past_their_caches_limits_stay_llguidances(monkeypatch):
    """A state's whole masks (one per set of rest verdicts), the automata's cached steps, the scanner's
    states and steps, the outlines, the rests' verdicts and llguidance's masks kept by outline, each
    with little room: every later one evicts earlier ones, and the masks stay llguidance's."""
    from smcdecode.potentials import matchers

    monkeypatch.setattr(json_strings, "_MASKS_KEPT", 1)
    monkeypatch.setattr(json_strings, "_STEPS_KEPT", 1)
    monkeypatch.setattr(json_strings, "_OUTLINES_KEPT", 3)
    monkeypatch.setattr(json_strings, "_VERDICTS_KEPT", 1)
    monkeypatch.setattr(matchers, "OUTLINE_MASK_BYTES", 0)  # (64 masks)
    kept, keep = [0], matchers._keep_outlines

    def counted(c, pairs, outlines, words):
        kept[0] += len(outlines)
        keep(c, pairs, outlines, words)

    monkeypatch.setattr(matchers, "_keep_outlines", counted)
    model = sd.load_model()
    for schema in (SCHEMAS[0], NODE, NUMBERS):
        kept[0] = 0
        c = JSONSchema(schema, path="llguidance").bind(model)
        assert _walks_agree(c, model, random.Random(3), 12) > 10
        assert len(c._outline_masks) <= 64 < kept[0] and len(c._strings._outlines) <= 3


def _walks_agree(c, model, rng, walks: int, steps: list | None = None) -> int:
    """Random walks through ``c``'s documents, the masks compared at every step; the steps inside strings
    (``steps``: each step's scanner state appended)."""
    texts = c._strings.token_bytes
    in_automata = 0
    for _ in range(walks):
        state, written = c.start(1), []
        for _ in range(60):
            ours, theirs = _masks(c, state)
            in_automata += state.scans[0][1] == AUTOMATON
            if steps is not None:
                steps.append(state.scans[0])
            diff = unpack_bits(ours ^ theirs, model.vocab_size)[0].nonzero().flatten().tolist()
            assert not diff, (model.decode(written), [texts[d] for d in diff[:8]])
            allowed = unpack_bits(ours, model.vocab_size)[0].nonzero().flatten().tolist()
            if not allowed or model.eos_token_id in allowed:
                break
            # half the time a token that closes something (a quote, a bracket), so walks go deep and end
            closing = [t for t in allowed if texts[t] and any(b in texts[t] for b in b'"]},')]
            t = rng.choice(closing if closing and rng.random() < 0.5 else allowed)
            written.append(t)
            state = c.advance(state, torch.tensor([t]))
    return in_automata


@pytest.mark.slow
@pytest.mark.parametrize("schema", [NUMBERS, NODE], ids=["numbers", "tree"])
def test_masks_kept_by_outline_stay_llguidances(schema, monkeypatch):
    """Many walks through one constraint: most masks outside strings are the ones kept by the
    particles' outlines (``StringMasks.outline``: the document with string automata's contents, and
    the digits of numbers that ended, left out), and every mask is llguidance's."""
    from smcdecode.potentials import matchers

    stored, keep = [], matchers._keep_outlines
    monkeypatch.setattr(matchers, "_keep_outlines", lambda c, pairs, outlines, words: (
        stored.extend(outlines), keep(c, pairs, outlines, words)))
    model = sd.load_model()
    c = JSONSchema(schema, path="llguidance").bind(model)
    steps = []
    assert _walks_agree(c, model, random.Random(5), 40, steps) > 20
    outside = [s for s in steps if s[1] != AUTOMATON]
    assert len(outside) - len(stored) > 200, (len(stored), len(outside))  # (masks copied from those kept)
    if schema is NUMBERS:  # (numbers written, and left the outline once they ended)
        assert sum(s[1] == json_strings.NUMBER for s in steps) > 20
        assert any(step == json_strings._NUMBERED for _, step in c._strings._outlines)


def test_each_grammar_of_a_schema_has_its_own_scanner_states_and_the_same_automata():
    """The rests' verdicts depend on the grammar (compact or flexible whitespace after a string), so
    each grammar's scanner states (which hold them) are its own; the automata are built once."""
    model = sd.load_model()
    a, b = (JSONSchema(SCHEMAS[0], path="llguidance", whitespace=w).bind(model) for w in ("compact", "flexible"))
    again = JSONSchema(SCHEMAS[0], path="llguidance").bind(model)
    assert a._strings is not b._strings and a._strings is again._strings
    assert a._strings._distinct is b._strings._distinct and a._strings._verdicts is not b._strings._verdicts


@pytest.mark.slow
def test_strings_of_a_container_held_to_an_enum_or_const_keep_llguidances_masks():
    """An object held to whole values (``enum``/``const`` beside its properties): what its strings may
    hold depends on the rest of the object, so they keep llguidance's masks (a string automaton's
    would allow every string of the property's own subschema)."""
    model = sd.load_model()
    for held in ({"enum": [{"a": "xy", "b": 1}, {"a": "zz", "b": 2}]}, {"const": {"a": "xy", "b": 1}}):
        schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                  "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "integer"}}, **held}
        c = JSONSchema(schema, path="llguidance").bind(model)
        assert _walks_agree(c, model, random.Random(2), 4) == 0


@pytest.mark.slow
def test_particles_with_one_outline_share_llguidances_mask_within_a_fill(monkeypatch):
    """Rows at one place of the document with different numbers and strings behind them have one
    outline (the numbers' digits and the strings' content left out): one fill has llguidance compute
    the mask once and copies it to the others; every row's mask is llguidance's, a dead row's none."""
    from smcdecode.potentials import matchers

    stored, keep = [], matchers._keep_outlines
    monkeypatch.setattr(matchers, "_keep_outlines", lambda c, pairs, outlines, words: (
        stored.extend(outlines), keep(c, pairs, outlines, words)))
    model = sd.load_model()
    c = JSONSchema(NUMBERS, path="llguidance").bind(model)
    texts = ['{"a": 25, "b": [1, 22], "c": "ab", "d": ', '{"a": 3, "b": [7, 1], "c": "xyz", "d": ',
             '{"a": 140, "b": [0, 9], "c": "q", "d": ', '{"a": 3, "b": [7, 1], "c": "xyz", "d": ']
    state = consume_rows(c, c.start(4), [model.encode(t) for t in texts])
    assert len({s[3] for s in state.scans}) == 1 and not state.matchers[3].is_error()
    state.matchers[3].consume_token(model.encode("x")[0])  # (dead, its outline the others')
    bits = torch.full((4, c._words), -1, dtype=torch.int32)
    fill_bits_together([(c, state, 0)], bits, 4)
    assert len(stored) == 1  # (one mask computed for the four rows)
    for i in range(3):
        _, theirs = _masks(c, MatcherBatch([state.matchers[i]], None, [state.scans[i]]))
        assert torch.equal(bits[i: i + 1], theirs) and bits[i].any()
    assert not bits[3].any()


@pytest.mark.slow
def test_a_dead_particle_gets_no_token_where_its_outline_has_a_kept_mask():
    model = sd.load_model()
    c = JSONSchema(NUMBERS, path="llguidance").bind(model)
    state = c.advance(c.start(2), torch.tensor(model.encode('{"a')[:1] * 2))
    bits = torch.zeros(2, c._words, dtype=torch.int32)
    fill_bits_together([(c, state, 0)], bits, 2)
    assert state.scans[0][3] in c._outline_masks and bits[1].any()
    state.matchers[1].consume_token(model.encode("x")[0])  # (dead, its scanner state as the live row's)
    assert state.matchers[1].is_error()
    bits[:] = -1
    fill_bits_together([(c, state, 0)], bits, 2)
    assert bits[0].any() and not bits[1].any()


def _reference_row(c, matcher) -> tuple:
    """llguidance's own verdicts at ``matcher`` (a real llguidance matcher): its packed mask (none where
    it is dead, as the engine's masks), accepting (the constraint's: not dead), dead, and the matcher's
    own accepting."""
    bits = torch.zeros(1, c._words, dtype=torch.int32)
    if not matcher.is_error():
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), c._words * 4)
    return bits, matcher.is_accepting() and not matcher.is_error(), matcher.is_error(), matcher.is_accepting()


def _our_rows(c, state) -> list:
    bits = torch.zeros(len(state), c._words, dtype=torch.int32)
    fill_bits_together([(c, state, 0)], bits, len(state))
    accepting = c.accepting(state).tolist()
    return [(bits[i: i + 1], accepting[i], state.dead(i), state.matchers[i].is_accepting()) for i in range(len(state))]


def _same(ours, theirs, what) -> None:
    assert torch.equal(ours[0], theirs[0]), what
    assert ours[1:] == theirs[1:], (what, ours[1:], theirs[1:])


@pytest.mark.slow
@pytest.mark.parametrize("index, whitespace", [(0, "compact"), (1, "compact"), (3, "compact"), (5, "compact"),
                                               (0, "flexible")])
def test_a_closed_document_stands_for_llguidances_stopped_parser(index, whitespace):
    """Where a token closes the document (its top-level object or array), the particle's matcher is
    not advanced by it: a ``Stopped`` state stands in for llguidance's stopped parser (learned from
    the first such token of the constraint, consumed for real). Against llguidance's matchers fed the
    same tokens: the same masks, accepting and dead rows at the close and after it (end-of-sequence
    tokens, then any other token), for rows of their own and rows sharing a matcher (a fork), and in
    the superset path's check (``consume_rows``)."""
    model = sd.load_model()
    c = JSONSchema(SCHEMAS[index], path="llguidance", whitespace=whitespace).bind(model)
    assert c._strings is not None and c._stop_mask is None
    texts, eos = c._strings.token_bytes, model.eos_token_id
    rng, stood_in, shared_stood_in, closed = random.Random(index), 0, 0, 0
    for _ in range(6):
        state, ref, written = c.start(1), c._lane(0).deep_copy(), []
        for _ in range(80):
            _same(_our_rows(c, state)[0], _reference_row(c, ref), model.decode(written))
            allowed = unpack_bits(_our_rows(c, state)[0][0], model.vocab_size)[0].nonzero().flatten().tolist()
            if eos in allowed or not allowed:
                break
            closing = [t for t in allowed if texts[t] and any(b in texts[t] for b in b'"]},')]
            t = rng.choice(closing if closing and rng.random() < 0.7 else allowed)
            before = state.matchers[0].deep_copy(), state.keys, state.scans, ref.deep_copy(), t
            state = c.advance(state, torch.tensor([t]))
            ref.consume_token(t)
            written.append(t)
        if eos not in allowed:
            continue
        closed += 1
        stood_in += isinstance(state.matchers[0], Stopped)
        # the closing token taken by rows that share one matcher (a fork), beside a row that takes
        # another token
        matcher, keys, scans, prev_ref, t = before

        def prev(n=1, matcher=matcher, keys=keys, scans=scans):  # (n rows of the state before the close, a
            # matcher of their own each)
            return MatcherBatch([matcher.deep_copy() for _ in range(n)], None if keys is None else keys * n, scans * n)

        others = [a for a in unpack_bits(_our_rows(c, prev())[0][0], model.vocab_size)[0].nonzero().flatten().tolist()
                  if a != t]
        step = [t, t] + others[:1]
        rows = c.advance(c.fork(prev(), torch.zeros(len(step), dtype=torch.long)), torch.tensor(step))
        for i, (ours, u) in enumerate(zip(_our_rows(c, rows), step)):
            r = prev_ref.deep_copy()
            r.consume_token(u)
            _same(ours, _reference_row(c, r), ("shared", i))
        shared_stood_in += isinstance(rows.matchers[0], Stopped) and rows.matchers[0] is rows.matchers[1]
        # the same with a matcher of its own for each row
        rows = c.advance(prev(len(step)), torch.tensor(step))
        for i, (ours, u) in enumerate(zip(_our_rows(c, rows), step)):
            r = prev_ref.deep_copy()
            r.consume_token(u)
            _same(ours, _reference_row(c, r), ("own", i))
        # three rows of this state (one matcher shared), then: end, end; end, another token; another
        # token twice (the other tokens: one the grammar takes before a close, and a plain one)
        other = [t for t in range(model.vocab_size) if t != eos and texts[t] == b"}"][0]
        refs = [ref.deep_copy() for _ in range(3)]
        copies = [MatcherBatch([state.matchers[0].deep_copy()], state.keys, state.scans) for _ in range(2)]
        rows = c.fork(copies[0], torch.tensor([0, 0, 0]))
        for step in ([eos, eos, other], [eos, other, other]):
            rows = c.advance(rows, torch.tensor(step))
            for r, t in zip(refs, step):
                r.consume_token(t)
            for i, (ours, r) in enumerate(zip(_our_rows(c, rows), refs)):
                _same(ours, _reference_row(c, r), (step, i))
        # the superset path's check: whole sequences after the close
        seqs = [[eos], [eos, other], [other], None]
        checked = consume_rows(c, c.fork(copies[1], torch.tensor([0, 0, 0, 0])), seqs)
        for i, q in enumerate(seqs):
            r = ref.deep_copy()
            for t in q or ():
                r.consume_token(t)
            _same(_our_rows(c, checked)[i], _reference_row(c, r), ("check", q))
    assert closed >= 3  # (the walks ended documents)
    # (llguidance's parser stops after a document, flexible whitespace too: none may follow it. The first
    # close of the constraint is consumed for real, to learn the stopped mask; a document written in
    # one token, ``{}``, leaves the scanner where it began and is consumed too)
    assert c._stop_mask not in (None, False) and stood_in >= 1 and shared_stood_in >= 1


@pytest.mark.slow
def test_closed_documents_with_llguidances_thread_pool_and_a_new_binding():
    """Masks through llguidance's thread pool (``threads=2``) where every row, or some, stood in for a
    stopped parser; and a constraint bound anew learns the stopped mask anew."""
    model = sd.load_model()
    c = JSONSchema(SCHEMAS[0], path="llguidance", threads=2).bind(model)
    assert c._executor is not None
    ids = model.tokenizer.encode('{"name": "ab", "tags": ["x"]}', add_special_tokens=False)
    state = c.start(3)
    for t in ids[:-1]:
        state = c.advance(state, torch.tensor([t] * 3))
    ref = c._lane(0).deep_copy()
    for t in ids[:-1]:
        ref.consume_token(t)
    closed = ref.deep_copy()
    closed.consume_token(ids[-1])
    learn = c.advance(MatcherBatch([m.deep_copy() for m in state.matchers], state.keys, state.scans),
                      torch.tensor([ids[-1]] * 3))  # (the first close: consumed for real)
    assert c._stop_mask not in (None, False)
    for step, refs in (([ids[-1]] * 3, [closed] * 3), ([ids[-1], ids[-1], ids[-2]], [closed, closed, None])):
        rows = c.advance(MatcherBatch([m.deep_copy() for m in state.matchers], state.keys, state.scans),
                         torch.tensor(step))
        assert sum(isinstance(m, Stopped) for m in rows.matchers) == 2 + (refs[2] is not None)
        bits = c.allowed_bits(rows)
        for i, r in enumerate(refs):
            if r is None:  # (a row that took the token before the close again: llguidance's own)
                r = ref.deep_copy()
                r.consume_token(step[i])
            _same((bits[i: i + 1], *_our_rows(c, rows)[i][1:]), _reference_row(c, r), (step, i))
    assert len(learn) == 3
    again = JSONSchema(SCHEMAS[0], path="llguidance", threads=2)
    first = again.bind(model)
    first.advance(MatcherBatch([m.deep_copy() for m in state.matchers], state.keys, state.scans),
                  torch.tensor([ids[-1]] * 3))
    other = sd.load_model()  # (another model object: bound anew)
    assert other is not model
    assert first._stop_mask not in (None, False) and first.bind(other)._stop_mask is None


@pytest.mark.slow
def test_a_close_llguidance_refuses_leaves_the_particle_dead():
    """A token that would close a document missing a required key (no mask drew it: a potential's
    replay, a proposal that ignores the constraint) is consumed, and its particle dies, as with
    llguidance's matcher; after the constraint learned that its closes stop the parser too."""
    model = sd.load_model()
    c = JSONSchema(SCHEMAS[0], path="llguidance").bind(model)
    ids = model.tokenizer.encode('{"name": "ab", "tags": []}', add_special_tokens=False)
    short = model.tokenizer.encode('{"name": "ab"}', add_special_tokens=False)
    assert model.tokenizer.decode(short[-1:]).endswith("}")
    for seq, dead in ((ids, False), (short, True), (ids, False)):
        state = c.start(1)
        for t in seq:
            state = c.advance(state, torch.tensor([t]))
        assert state.dead(0) is dead and c.accepting(state).tolist() == [not dead]
    assert isinstance(state.matchers[0], Stopped)  # (the second complete document: stood in)


def test_subschemas_along_the_path():
    texts = [b"x", b'"', b"{", b"}"]
    s = StringMasks(NODE, texts, 1)
    node = NODE["$defs"]["node"]
    root = s._value(())
    assert root is node
    assert s.child(node, "name") is node["properties"]["name"]
    assert s.child(s.child(node, "children"), 1) is node
    assert s.child(node, "other") is None  # (closed object: no such key)
    assert s.automaton(node["properties"]["name"]) is not None
    assert s.automaton(node["properties"]["children"]) is None
    assert s.automaton({"enum": [1, 2]}) is None and s.automaton({"enum": ["a", 2]}) is not None
    either = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "null"}]},
                                               "b": {"type": "string", "format": "date"}},
              "patternProperties": {"^a": {"type": "string"}, "^x": {"type": "string", "maxLength": 3}}}
    s = StringMasks(either, texts, 1)
    assert s.child(either, "a") is None  # (a property and a pattern both apply)
    assert s.automaton(s.child(either, "b")) is None  # (date: the translation takes a subset)
    assert s.automaton(s.child(either, "xy")) is not None
    assert s.child(either, "zz") is None  # (any value)
    assert automaton_strings(either) and automaton_strings({"type": "object", "properties": {"a": {"type": "string"}}})
    assert not automaton_strings({"type": "array", "items": {"type": ["string", "null"]}})


def test_canonical_tokenisation_keeps_llguidance_masks_in_strings():
    model = sd.load_model()
    assert JSONSchema(NODE, path="llguidance").bind(model)._strings is not None
    assert JSONSchema(NODE, path="llguidance", force_canonical=True).bind(model)._strings is None
    assert JSONSchema(NODE).bind(model)._strings is not None  # ('auto': recursive, llguidance's path)


VOCAB = ["<bos>", '"', "a", "b", "ab", 'a"', '"a', "<eos>"]
STRING = {"type": "string", "pattern": "^a", "maxLength": 2}


def test_engine_round_with_string_masks_is_exact(monkeypatch):
    engine, model = _tiny_engine(vocab=VOCAB)
    constraint = JSONSchema(STRING, path="llguidance").bind(model)
    assert constraint._strings is not None
    used = []
    fill = StringMasks.fill

    def spy(self, scan, matcher, out):
        done = fill(self, scan, matcher, out)
        used.append(done)
        return done

    monkeypatch.setattr(StringMasks, "fill", spy)
    engine_is_exact(engine, model, constraint, EngineTarget.of(sd.LM(model) * constraint), [0, 3], 4, seed=5)
    assert any(used)  # (the rounds' masks inside the string came from its automaton)


def _one_of(sub):
    return {"type": "object", "properties": {"p": sub}, "required": ["p"]}


_FURTHER = {"type": "string", "maxLength": 5}
# where Python's reading of a pattern, a key or a reference differs from llguidance's: each must give
# llguidance's masks (the translation refuses the pattern, or the string keeps llguidance's masks)
DIFFERENT_READINGS = [
    (_one_of({"type": "string", "pattern": "^a|b$"}), '{"p": "'),  # (^a)|(b$)
    (_one_of({"type": "string", "pattern": "^[[:alpha:]]+$"}), '{"p": "'),  # a POSIX class
    (_one_of({"type": "string", "pattern": "^[a-c&&b]$"}), '{"p": "'),  # a class intersection
    ({"type": "object", "patternProperties": {"^a$": {"type": "string", "maxLength": 1}},
      "additionalProperties": _FURTHER}, '{"a\\n": "'),  # ($ before a final newline in Python)
    ({"type": "object", "patternProperties": {"^\\d+$": {"type": "string", "maxLength": 1}},
      "additionalProperties": _FURTHER}, '{"\u0663": "'),  # (Python's \d takes other digits)
    ({"enum": ["a\x7fb"]}, '"a'),  # (llguidance writes U+007F escaped)
    ({"type": "object", "properties": {"\x7f": {"type": "string", "maxLength": 1}},
      "additionalProperties": _FURTHER}, '{"\\u007f": "'),  # (an escaped key is a key of its own)
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Possible:FutureWarning")  # (Python's warning on [[ and && in a class)
@pytest.mark.parametrize("schema, prefix", DIFFERENT_READINGS)
def test_patterns_keys_and_literals_read_as_llguidance_reads_them(schema, prefix):
    model = sd.load_model()
    c = JSONSchema(schema, path="llguidance").bind(model)
    state = c.start(1)
    for t in model.encode(prefix):
        state = c.advance(state, torch.tensor([t]))
    assert not state.matchers[0].is_error()
    ours, theirs = _masks(c, state)
    assert torch.equal(ours, theirs)


def test_a_subschema_with_its_own_base_uri_keeps_llguidance_masks():
    scoped = {"type": "object", "$defs": {"B": {"type": "string", "maxLength": 1},
                                          "A": {"$id": "http://example.com/a", "type": "object",
                                                "$defs": {"B": {"type": "string", "maxLength": 6}},
                                                "properties": {"q": {"$ref": "#/$defs/B"}}}},
              "properties": {"a": {"$ref": "#/$defs/A"}}}
    assert not automaton_strings(scoped)  # ($ref resolves against A's $id there)
    assert automaton_strings({**scoped, "$id": "http://example.com/root", "$defs": {"B": scoped["$defs"]["B"]},
                              "properties": {"b": {"$ref": "#/$defs/B"}}})


@pytest.mark.filterwarnings("ignore:Possible:FutureWarning")
def test_the_device_translation_refuses_what_it_would_read_otherwise():
    for pattern in ("^a|b$", "^[[:alpha:]]+$", "^[a-c&&b]$", "x|^y$"):
        with pytest.raises(UnsupportedSchema):
            schema_regex({"type": "string", "pattern": pattern})
    assert schema_regex({"type": "string", "pattern": "^(a|b)$"})  # (the anchors hold the whole pattern)
    assert "\\\\u007f" in schema_regex({"enum": ["a\x7fb"]})
