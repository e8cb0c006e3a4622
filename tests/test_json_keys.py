"""The unique-key scanner (potentials/json_keys.py): the tokens it blocks from a state — one-quote
tokens looked up by the bytes before their quote, the others scanned — are exactly those whose scan
ends in a repeated key, from states reached by random JSON-like texts over tricky token shapes and
over the default model's vocabulary."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smcdecode.potentials.json_keys import DEAD, START, KeyTracker, step

# token shapes that meet every branch: one quote with heads of every kind (empty, ASCII, multi-byte,
# a control byte, invalid UTF-8), several quotes, backslashes, structure
TOKENS = [b'"', b'a"', b'b"', b'ab"', b'b":', b'"a', b'\xe6\x97\xa5"', b'\xe6\x97"', b'\xa5"', b'\x01"',
          b'\\"', b'\\', b'n"', b'"a"', b'","', b'":"', b'"a":', b', "', b'{"', b'{', b'}', b'[', b']', b',',
          b': ', b'a', b'b', b'\xe6\x97\xa5', b'1', b'""', b'"\\', b'\\u00', b'41"', b'01"', b'x y"', b' ', b'\xe6\x97', b'n', b'41']

# texts (as tokens) that reach the edge cases: a key written with an escape, then a key whose bytes
# so far could continue it raw; a name holding a control character (only ever written escaped); a
# multi-byte name; a nested object's key; a key so far that no held name starts with; a token that
# encloses a held key
EDGES = [[b'{"', b'a', b'\\', b'n"', b': ', b'1', b', "', b'a', b'\\', b'n'],
         [b'{"', b'\\u00', b'41"', b': ', b'1', b', "', b'\\u00', b'41', b'b'],
         [b'{"', b'a', b'\\', b'n"', b': ', b'1', b', "', b'a'],
         [b'{"', b'\\u00', b'01"', b': ', b'1', b', "'],
         [b'{"', b'\\u00', b'41"', b': ', b'1', b', "'],
         [b'{"', b'\xe6\x97\xa5"', b': ', b'1', b', "', b'\xe6\x97'],
         [b'{"', b'a"', b': ', b'{"', b'a"', b': ', b'1', b'}', b', "'],
         [b'{"', b'ab"', b': ', b'1', b', "', b'b'],  # (a key so far that no held name starts with)
         [b'{"', b'a"', b': ', b'1', b',', b' ']]  # (between keys: '"a"' encloses a held key)


def brute(tracker: KeyTracker, state) -> list[int]:
    return sorted(t for t in tracker.quote_ids if step(state, tracker.token_bytes[t]) == DEAD)


def states_of(tracker: KeyTracker, seq: list[int]) -> list:
    out, s = [], START
    for t in seq:
        s = tracker.advance(s, t)
        out.append(s)
        if s == DEAD:
            break
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, len(TOKENS) - 1), min_size=1, max_size=24))
def test_blocked_tokens_equal_the_full_scan(seq):
    tracker = KeyTracker(TOKENS + [None])
    assert tracker.scanned and tracker.by_head  # both kinds of quote token are present
    for s in states_of(tracker, seq):
        assert tracker._scan(s) == brute(tracker, s), s


def test_blocked_tokens_equal_the_full_scan_at_the_edges():
    tracker = KeyTracker(TOKENS)
    for text in EDGES:
        for s in states_of(tracker, [TOKENS.index(t) for t in text]):
            assert tracker._scan(s) == brute(tracker, s), (text, s)


def test_blocked_tokens_from_keys_that_repeat():
    tracker = KeyTracker(TOKENS)
    # inside a key "a…" of an object holding "a" and "ab": 'b"' and '"' (closing "ab" / "a") are blocked
    s = START
    for t in [b'{"', b'a"', b': ', b'1', b',', b' ', b'"', b'ab"', b': ', b'1', b', "', b'a']:
        s = tracker.advance(s, TOKENS.index(t))
    blocked = {TOKENS[t] for t in tracker.blocked(s)}
    assert {b'"', b'b"', b'b":'} <= blocked and b'ab"' not in blocked
    assert tracker.blocked(s) == brute(tracker, s)


@pytest.mark.slow
def test_blocked_tokens_equal_the_full_scan_on_the_default_vocabulary():
    import smcdecode as sd
    from smcdecode.potentials.json_schema import JSONSchema

    model = sd.load_model()
    tracker = JSONSchema({"type": "object"}).bind(model)._keys
    assert len(tracker.scanned) < len(tracker.quote_ids) / 4  # most quote tokens are looked up
    rnd = random.Random(0)
    keys = ["a", "ab", "name", "日本", "x y", "a\\n", "Name"]
    checked = 0
    for _ in range(60):
        parts = ["{"]
        for _ in range(rnd.randint(1, 5)):
            parts.append(f'"{rnd.choice(keys)}": {rnd.choice(["1", "{", chr(34) + "v" + chr(34)])}, ')
        parts.append('"' + rnd.choice(keys)[: rnd.randint(0, 3)])
        for s in states_of(tracker, model.encode("".join(parts))):
            assert tracker._scan(s) == brute(tracker, s)
            checked += 1
    assert checked > 500


def test_keys_can_repeat_answers_by_the_schema_shape():
    from smcdecode.potentials.json_schema import keys_can_repeat

    closed = {"type": "object", "additionalProperties": False, "properties": {"a": {"type": "integer"}}}
    for schema in (closed, {"type": "string"}, {"enum": [{"a": 1}]}, {"type": "array", "items": closed},
                   {"anyOf": [closed, {"type": "null"}]}, {"type": "array", "prefixItems": [closed], "items": False},
                   {"$ref": "#/$defs/t", "$defs": {"t": {**closed, "properties": {"a": {"$ref": "#/$defs/t"}}}}}):
        assert not keys_can_repeat(schema), schema
    for schema in ({}, True, {"type": "object"}, {"type": "array"}, {"minimum": 1},
                   {"type": "object", "additionalProperties": {"type": "integer"}},
                   {**closed, "patternProperties": {"^x": {"type": "integer"}}},
                   {**closed, "properties": {"a": {}}}, {"type": "array", "items": True},
                   {"anyOf": [closed, {"type": "object"}]}, {"type": "array", "prefixItems": [closed]},
                   {"$ref": "#/$defs/t", "$defs": {"t": {"type": "object"}}},
                   {**closed, "dependencies": {"a": {"type": "object"}}}):  # (a keyword it does not know of)
        assert keys_can_repeat(schema), schema


@pytest.mark.slow
def test_closed_schemas_need_no_key_rule_on_the_default_vocabulary():
    """Where ``keys_can_repeat`` says no object can repeat a key (every JSONSchemaBench schema of two
    subsets it says so of, up to 12), the constraint skips the unique-key rule; along random valid
    token paths of SmolLM2's vocabulary (uniform over llguidance's allowed tokens, 4 paths a schema,
    each to its end or 60 tokens), the rule, applied anyway, removes no token llguidance's mask allows."""
    import json
    from pathlib import Path

    import numpy as np

    import smcdecode as sd
    from smcdecode.potentials.json_schema import JSONSchema, keys_can_repeat

    model = sd.load_model()
    eos, V = model.eos_token_id, model.vocab_size
    tracker = JSONSchema({"type": "object"}, path="llguidance").bind(model)._keys
    eval_dir = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
    if not eval_dir.exists():  # (a checkout outside the workspace: the workspace's copy)
        eval_dir = Path("/work/shared/data/eval")
    schemas = []
    for name in ("jsonschemabench_Github_easy.jsonl", "jsonschemabench_Github_trivial.jsonl"):
        with open(eval_dir / name) as f:
            schemas += [s for s in (json.loads(line)["schema"] for line in f) if not keys_can_repeat(s)][:6]

    def allowed_ids(m):
        raw = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        return set(np.flatnonzero(np.unpackbits(raw, bitorder="little")[:V]).tolist())

    # (the check has teeth: where an object is open, the rule does remove tokens llguidance allows)
    m = JSONSchema({"type": "object", "additionalProperties": {"type": "integer"}}, path="llguidance",
                   unique_keys=False).bind(model)._template.deep_copy()
    prefix = model.encode('{"a": 1, "a')
    assert m.consume_tokens(prefix)
    assert tracker.blocked(tracker.replay(prefix)) and set(tracker.blocked(tracker.replay(prefix))) & allowed_ids(m)
    rnd = random.Random(1)
    steps = bound = 0
    for schema in schemas:
        try:
            c = JSONSchema(schema, path="llguidance").bind(model)
        except sd.SMCDecodeError:
            continue
        assert c._keys is None  # (the rule skipped)
        bound += 1
        for _ in range(4):
            m, key = c._template.deep_copy(), START
            for _ in range(60):
                allowed = allowed_ids(m)
                if key != DEAD:
                    assert not set(tracker.blocked(key)) & allowed, (schema, key)
                choices = sorted(t for t in allowed if t != eos)
                if not choices:
                    break
                t = rnd.choice(choices)
                assert m.consume_token(t)
                key = tracker.advance(key, t)
                steps += 1
    assert bound >= 8 and steps > 1000, (bound, steps)
