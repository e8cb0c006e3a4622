"""How automata are built: interegular's builder with the dictionary state lookup
(``regex.interegular_module``) builds every automaton equal, state for state, to the one
interegular's own ``crawl`` builds; the minimal byte automaton (``automaton.minimal_bytes``) takes
the same byte strings as the one it comes from."""

from __future__ import annotations

import itertools

import pytest

from smcdecode.potentials import regex as regex_module
from smcdecode.potentials.automaton import byte_dfa, minimal_bytes
from smcdecode.potentials.schema_regex import schema_regexes, superset_regex

interegular = regex_module.interegular_module()
import interegular.fsm as fsm  # noqa: E402

PATTERNS = [
    "a", "abc|abd", "(ab|a)*b", "(b*ab)*", "[a-z]{2,5}", "x{0,3}y{3}", "(?:ab){2,4}|c+",
    "[0-9]+(\\.[0-9]+)?([eE][+-]?[0-9]+)?", "(?:[^\"\\\\]|\\\\.)*", "((a|b)c?){3}", "",
]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
     "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "additionalProperties": False},
    {"type": "string", "format": "email", "maxLength": 20},
]


def _built(build, crawl):
    saved = fsm.crawl
    fsm.crawl = crawl
    try:
        return build()
    finally:
        fsm.crawl = saved


def _assert_same(build) -> None:
    ours, theirs = _built(build, regex_module._crawl), _built(build, regex_module._ORIGINAL_CRAWL)
    assert (ours.initial, ours.finals, ours.map) == (theirs.initial, theirs.finals, theirs.map)
    assert list(ours.states) == list(theirs.states)


def test_crawl_is_replaced_once():
    assert fsm.crawl is regex_module._crawl
    assert regex_module._ORIGINAL_CRAWL is not None and regex_module._ORIGINAL_CRAWL is not regex_module._crawl
    regex_module.interegular_module()
    assert fsm.crawl is regex_module._crawl and regex_module._ORIGINAL_CRAWL is not regex_module._crawl


@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_automata_equal(pattern):
    _assert_same(lambda: interegular.parse_pattern(pattern).to_fsm())


@pytest.mark.parametrize("a, b", [("[a-c]*", "a?b*c?"), ("(ab)*", "a(ba)*b|"), ("[0-9]{1,4}", "1[0-9]*")])
def test_products_and_set_operations_equal(a, b):
    def fa():
        return interegular.parse_pattern(a).to_fsm()

    def fb():
        return interegular.parse_pattern(b).to_fsm()

    _assert_same(lambda: fa() & fb())
    _assert_same(lambda: fa() | fb())
    _assert_same(lambda: fa() - fb())
    _assert_same(lambda: fa().everythingbut())
    _assert_same(lambda: fa().reversed())


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_schema_automata_equal(i):
    schema = SCHEMAS[i]
    regexes, _ = schema_regexes(schema)

    def build():
        out = interegular.parse_pattern(regexes[0]).to_fsm()
        for r in regexes[1:]:
            out = out & interegular.parse_pattern(r).to_fsm()
        return out

    _assert_same(build)
    if schema.get("type") == "object":
        # (open to further string keys: the superset's any-key-but-these strings)
        wide = superset_regex({**schema, "additionalProperties": {"type": "string"}})[0]
        _assert_same(lambda: interegular.parse_pattern(wide).to_fsm())


def _run(table, init: int, data: bytes) -> int:
    state = init
    for b in data:
        state = int(table[state, b])
    return state


@pytest.mark.parametrize("pattern", PATTERNS + ["x(?:a|b)c|y(?:a|b)c", "(?:ab|cb)(?:ab|cb)?[0-2]*", "é|ü|a{2}"])
def test_minimal_byte_automaton_takes_the_same_strings(pattern):
    table, acc, init = byte_dfa(interegular.parse_pattern(pattern).to_fsm())
    small, small_acc, small_init = minimal_bytes(table, acc, init)
    assert len(small) <= len(table) and small[-1].tolist() == [len(small) - 1] * 256  # (the dead row last)
    again = minimal_bytes(small, small_acc, small_init)
    assert len(again[0]) == len(small)  # (minimal: nothing left to merge)
    letters = sorted(set(pattern.encode()) | {ord("a"), ord("0"), 0xC3})
    for n in range(5):
        for data in itertools.product(letters, repeat=n):
            a, b = _run(table, init, bytes(data)), _run(small, small_init, bytes(data))
            assert bool(acc[a]) == bool(small_acc[b]), (pattern, bytes(data))
            if b != len(small) - 1:  # (live in the minimal one: live in the first; it may end earlier there)
                assert a != len(table) - 1, (pattern, bytes(data))


def test_copies_of_a_value_merge():
    """interegular writes each copy of a repeated part anew; the minimal automaton merges them."""
    table, acc, init = byte_dfa(interegular.parse_pattern("x(?:a|b)c|y(?:a|b)c").to_fsm())
    assert len(minimal_bytes(table, acc, init)[0]) < len(table)


def test_minimal_bytes_of_a_dead_start_is_itself():
    import numpy as np

    table = np.array([[0] * 256, [1] * 256], dtype=np.int32)  # (row 1 dead; the start is dead)
    out, acc, init = minimal_bytes(table, np.array([True, False]), 1)
    assert init == 1 and out is table and acc.tolist() == [True, False]


def test_minimise_checks_the_hashed_partition():
    """States merged by a hash collision would leave a partition that is not stable: the check sees
    it, and the exact refinement gives the minimal automaton either way."""
    import numpy as np

    from smcdecode.potentials.automaton import _minimise, _refine, _stable

    # a -> b -> c (accepting); d -> c; states 0..3, column 0 the only symbol, 4 = dead
    trans = np.array([[1], [2], [4], [2]], dtype=np.int64)
    acc = np.array([False, False, True, False])
    exact = _refine(trans, acc, exact=True)
    assert _stable(trans, acc, exact) and exact[1] == exact[3] and len(set(exact.tolist())) == 3
    assert not _stable(trans, acc, np.array([0, 0, 1, 0]))  # (0 and 1 merged: they differ)
    hashed = _refine(trans, acc, exact=False)
    assert all((hashed[i] == hashed[j]) == (exact[i] == exact[j]) for i in range(4) for j in range(4))
    out, out_acc, init = _minimise(trans, acc, 0)
    assert out.shape == (3, 1) and out_acc.sum() == 1
