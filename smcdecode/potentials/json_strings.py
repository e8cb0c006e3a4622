"""Masks inside a JSON document's string values, for llguidance's path (``StringMasks``).

llguidance computes a mask by walking the vocabulary's token trie through its lexer. Inside a string
held to a ``pattern``, a ``format`` or a length that walk is dear (benchmarks/string_masks_cost.py:
about a tenth of a millisecond or more a mask, a string automaton's a few microseconds), and an engine round of eight requests of eight particles needs
64 masks at each of its nine steps. A string value's language is regular, and inside it a token's
fate depends on the string's automaton state alone, except for the tokens that close the string:
their bytes after the closing quote belong to the grammar. So, for a JSON Schema on llguidance's path:

- each particle carries a small scanner state (``StringMasks.advance``): the stack of open objects and
  arrays with the subschema of each, the key being written, and, inside a string value whose
  subschema is a string (plain, or held to a pattern, a format or a length) or an enum with strings,
  that string's byte-automaton state (``_StringDFA``);
- inside such a string the mask is the automaton's: every token whose bytes keep the string open and
  alive (one packed row per automaton state, built at binding), and every token that closes the
  string validly and whose rest (its bytes after the closing quote) the grammar takes. The rest's
  verdict does not depend on the string's content (the parser's state after a string value is the
  same whatever the value), so llguidance is asked once per place in the document and rest
  (``validate_tokens`` of one token that closes there), and the answer is kept by the particle's
  outline where the string opened (below). A rest that JSON cannot let follow a value (anything but a
  comma, a closing bracket or whitespace first) is never allowed;
- everywhere else (keys, numbers, structure) the mask is llguidance's, kept by *outline*: a particle's
  document so far with the content of every string an automaton wrote, and the digits of every
  number value that ended, left out (``StringMasks.outline``: an id per outline). For the same
  reason as the rests', llguidance's parser is in the same state after any such value, so particles
  with one outline get one mask: llguidance computes it for the first (``matchers._known_rows``),
  the others copy it. A scanner state is a function of the outline (and, inside a string, of the
  automaton's state), so the scanner keeps one object per state and the step from it by each token:
  most steps are one lookup.

The masks are llguidance's, bit for bit (``tests/test_json_strings.py`` compares them along random
walks over the default model's vocabulary); only their cost changes. A string's subschema is
resolved along the document's path through ``properties``, ``patternProperties``,
``additionalProperties``, ``items``, ``prefixItems`` and local ``$ref``; where a step is ambiguous
(``anyOf``, ``oneOf``, ``allOf``, conditionals, type lists), or where a container is held to whole
values (``enum``, ``const``), the strings and numbers below it keep llguidance's masks and stay in
the outline. ``date`` and ``date-time`` formats keep them too (the device translation takes a strict
subset of their languages), and so do all strings of a constraint with ``force_canonical``.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import time
from functools import reduce

import numpy as np

from ..errors import SMCDecodeError
from .automaton import TooSlow, _Vocabulary, _walk, build_limit, byte_dfa, minimal_bytes
from .json_keys import _name
from .schema_regex import ANNOTATIONS, UnsupportedSchema, nested_base_uri, schema_regexes
from .string_formats import FORMATS, SUBSET_FORMATS

__all__ = ["StringMasks", "automaton_strings"]

MAX_STRING_STATES = 4096  # byte states past which a string keeps llguidance's masks
STRING_BUILD_S = 5.0  # seconds a string's byte automaton may take to build (else llguidance's masks)
EAGER_S = 2.0  # seconds a schema's automata and rows are built in at binding (the rest: when first needed)
EAGER_STATES = 1024  # byte states past which an automaton's rows are built when first needed
KEPT = 16  # StringMasks kept per process (``StringMasks.of``)
_MASKS_KEPT = 4  # whole masks kept per automaton state (one per set of verdicts on its rests)
_STEPS_KEPT = 1 << 14  # (state, token bytes) steps kept per automaton; scanner steps kept per StringMasks
_VERDICTS_KEPT = 4096  # strings' verdicts kept per StringMasks (by the outline where the string opened)
_BUILT: dict = {}
_AFTER_VALUE = frozenset(b",}] \t\n\r")  # (the bytes JSON lets follow a string value)
_HELD = ("pattern", "format", "minLength", "maxLength")
_STRING_KEYS = {"type", *_HELD}
_VALUE_KEYS = {*_STRING_KEYS, "enum", "const"}
# keywords under which a child's subschema is not one subschema of the parent's (the strings below keep
# llguidance's masks)
_AMBIGUOUS = {"anyOf", "oneOf", "allOf", "not", "if", "then", "else", "dependentSchemas", "dependencies",
              "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef", "contains"}
_QUOTE, _BACKSLASH = 0x22, 0x5C
# scanner modes: between strings, in a key, in a string, in a string automaton, in a number value whose
# subschema is known
OUT, KEY, STRING, AUTOMATON, NUMBER = range(5)
START = ((), OUT, None, 0)  # (stack, mode, the mode's state, the outline's id: ``StringMasks.outline``)
_OUTLINES_KEPT = 1 << 16  # outline steps kept per StringMasks (then forgotten: ids are never given twice)
_IDS = itertools.count(1)  # outline ids, unique in the process (0: the empty document)
_SHUT = b"\""  # (an automaton string's closing quote in an outline: its content left out)
_NUMBERED = "number"  # (a number value in an outline, once it ended: its digits left out)
_NUMBER_BYTES = frozenset(b"0123456789+-.eE")
_NUMBER_START = frozenset(b"-0123456789")
_UNKNOWN = False  # a key whose subschema is not known here (one written with an escape): none
_PLAIN_KEY = re.compile(r"[\x20-\x7e]*")  # (keys whose patternProperties matches Python finds as llguidance does)


def _automaton_schema(s) -> bool:
    """Is ``s`` a string (plain, or held to a pattern, a format or a length) or an enum (or const) with
    a string among its values, and nothing else?"""
    if not isinstance(s, dict):
        return False
    if "enum" in s or "const" in s:
        values = s.get("enum", [s.get("const")])
        return isinstance(values, list) and any(isinstance(v, str) for v in values) and \
            s.get("type", "string") == "string" and all(k in _VALUE_KEYS or k in ANNOTATIONS for k in s) and \
            not any(k in s for k in _HELD)
    if s.get("type") != "string" or s.get("format") in SUBSET_FORMATS or \
            (s.get("format") is not None and s["format"] not in FORMATS):
        return False
    return all(k in _STRING_KEYS or k in ANNOTATIONS for k in s)


def _subschemas(schema):
    """Every dict inside ``schema`` (itself too), depth first."""
    if isinstance(schema, dict):
        yield schema
        for v in schema.values():
            yield from _subschemas(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _subschemas(v)


def automaton_strings(schema) -> bool:
    """Does ``schema`` hold any string value a string automaton could take (``_automaton_schema``)?
    Not where a subschema sets its own base URI (``$id``, ``id``): its ``$ref``s resolve there."""
    if nested_base_uri(schema):
        return False
    return any(map(_automaton_schema, _subschemas(schema)))


class _Row:
    """An automaton state's tokens: the packed row of those that keep the string open [W]; of those that
    close it, the ones whose rest (their bytes after the closing quote) JSON lets follow a string
    value (empty, or a comma, a closing bracket or whitespace first; the others never do): the
    distinct rests among them (``rests``, ids into ``StringMasks.rests``), one such token for each
    (``first``), each token's rest (``of``: an index into ``rests``), word and bit in the packed row."""

    __slots__ = ("packed", "rests", "first", "of", "word", "bit", "masks")

    def __init__(self, packed, ids, rest_ids, may: list):
        keep = np.array([may[r] for r in rest_ids], dtype=bool)
        ids, rest_ids = ids[keep], rest_ids[keep]
        self.packed = packed
        rests, first, self.of = np.unique(rest_ids, return_index=True, return_inverse=True)
        # (a state has a few rests: plain lists, read per particle and step, cost less than arrays)
        self.rests, self.first = rests.tolist(), ids[first].tolist()
        self.word, self.bit = ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
        self.masks: dict = {}  # the rests' verdicts (a tuple of 0 / 1) -> the whole packed mask with them

    def mask(self, got: tuple) -> np.ndarray:
        """The packed mask of this state where the rests' verdicts are ``got`` (1: taken)."""
        out = self.masks.get(got)
        if out is None:
            out = self.packed.copy()
            taken = np.array(got, dtype=np.int8)[self.of] == 1
            np.bitwise_or.at(out.view(np.uint32), self.word[taken], self.bit[taken])
            if len(self.masks) >= _MASKS_KEPT:
                self.masks.clear()
            self.masks[got] = out
        return out


class _Verdicts:
    """llguidance's verdicts on the rests after a string closes, kept by the outline where the string
    opened (every particle writing a string there shares them: ``StringMasks._stepped``)."""

    __slots__ = ("ok", "masks")

    def __init__(self):
        self.ok: dict = {}  # rest id -> 1 (llguidance takes a token that closes the string so) or 0
        self.masks: dict = {}  # automaton state -> its mask with these verdicts, all known (``StringMasks.fill``)


class _StringDFA:
    """A string value's byte automaton (opening quote consumed at ``start``; the states after the
    closing quote absorb every byte) and, per state, its tokens (``_Row``), built for every state at
    once where ``eager`` (else each when first needed)."""

    def __init__(self, table: np.ndarray, accepting: np.ndarray, start: int, owner: StringMasks, eager: bool):
        self.table, self.accepting, self.start = table, accepting, start
        self.dead = len(table) - 1
        self.owner = owner
        self._rows: dict = {}  # state -> _Row
        self._steps: dict = {}  # (state, bytes) -> ``step``'s answer
        if eager:
            inside = [q for q in range(self.dead) if not accepting[q]]
            for i in range(0, len(inside), 32):  # (32 states a walk: its [states, V] table stays small)
                self._build(inside[i: i + 32])

    def row(self, state: int) -> _Row:
        if state not in self._rows:
            self._build([state])
        return self._rows[state]

    def _build(self, states: list) -> None:
        o = self.owner
        for state, ends in zip(states, _walk(self.table, np.array(states), o.vocab)):
            closes = (ends != self.dead) & self.accepting[ends]
            opened = (ends != self.dead) & ~self.accepting[ends]
            bits = np.zeros(o.words * 32, dtype=bool)
            bits[: len(opened)] = opened
            packed = np.packbits(bits, bitorder="little").view(np.int32).copy()
            ids = np.nonzero(closes)[0].astype(np.int64)
            # (each closing token's rest: its bytes after the quote that closes the string)
            rest_ids = np.array([o.rest_id(o.token_bytes[t][self.step(state, o.token_bytes[t])[1]:])
                                 for t in ids.tolist()], dtype=np.int64)
            self._rows[state] = _Row(packed, ids, rest_ids, o.may)

    def step(self, state: int, data: bytes) -> tuple[int, int]:
        """(state after ``data``, index of the first byte after the closing quote, or -1 if still open)."""
        key = (state, data)
        hit = self._steps.get(key)
        if hit is None:
            hit = self._stepped(state, data)
            if len(self._steps) >= _STEPS_KEPT:
                self._steps.clear()
            self._steps[key] = hit
        return hit

    def _stepped(self, state: int, data: bytes) -> tuple[int, int]:
        for j, b in enumerate(data):
            state = int(self.table[state, b])
            if state == self.dead:
                return state, -1
            if self.accepting[state]:
                return state, j + 1
        return state, -1


class StringMasks:
    """The string automata of one JSON Schema over one vocabulary (``token_bytes``: each token's bytes as
    llguidance sees them, None for special tokens), and the scanner that follows a particle through
    its document (states are immutable tuples: forking shares them)."""

    def __init__(self, schema: dict, token_bytes: list, words: int):
        self.root, self.words = schema, words
        self.token_bytes = token_bytes
        self.vocab = _Vocabulary(token_bytes)
        self._children: dict = {}  # (id(schema), key or index) -> child subschema or None
        self._automata: dict = {}  # id(schema) -> _StringDFA or None
        self._distinct: dict = {}  # a string's keywords (JSON text) -> its _StringDFA or None
        self._keep: list = []  # (the subschemas whose ids key the caches)
        self.rests: dict = {}  # bytes after a closing quote -> id (shared by the automata)
        self.may: list = []  # rest id -> may it follow a string value (``_Row.may``)
        self._outlines: dict = {}  # (outline id, token id or bytes) -> the outline's id after them
        self._states: dict = {}  # (outline id, mode, automaton state or -1) -> the scanner state
        self._next: dict = {}  # (id of a scanner state, token) -> (that state, the state after the token)
        self._verdicts: dict = {}  # outline id inside a string -> the verdicts on its rests (_Verdicts)
        self._grammars: dict = {}  # a grammar -> its StringMasks (``of``: these automata, its own states)
        # the schema's automata and their states' rows built now while EAGER_S last (the rest when first needed)
        self._eager_until = time.perf_counter() + EAGER_S
        for sub in _subschemas(schema):
            if time.perf_counter() >= self._eager_until:
                break
            self.automaton(sub)

    @classmethod
    def of(cls, schema: dict, token_bytes: list, words: int, grammar) -> StringMasks:
        """The string masks of ``schema`` over a vocabulary for the llguidance grammar ``grammar``
        (hashable: its text), one per schema, vocabulary and grammar in this process (a mask worker
        forked from it finds the automata built). The grammars of one schema (its whitespace, say)
        share the automata; each has its own scanner states, whose rests' verdicts are its own."""
        key = (json.dumps(schema, sort_keys=True), len(token_bytes), words)
        hit = _BUILT.get(key)
        if hit is None or not (hit.token_bytes is token_bytes or hit.token_bytes == token_bytes):
            hit = _BUILT[key] = cls(schema, token_bytes, words)
            while len(_BUILT) > KEPT:
                _BUILT.pop(next(iter(_BUILT)))
        if grammar not in hit._grammars:
            own = hit._grammars[grammar] = copy.copy(hit)
            own._states, own._next, own._verdicts = {}, {}, {}
        return hit._grammars[grammar]

    def rest_id(self, rest: bytes) -> int:
        if rest not in self.rests:
            self.rests[rest] = len(self.rests)
            self.may.append(not rest or rest[0] in _AFTER_VALUE)
        return self.rests[rest]

    # -- the schema along the document's path ------------------------------------------------
    def _deref(self, s, seen: int = 0):
        while isinstance(s, dict) and "$ref" in s:
            ref = s["$ref"]
            if seen > 32 or not isinstance(ref, str) or not ref.startswith("#") or \
                    any(k not in ANNOTATIONS for k in s if k != "$ref"):
                return None
            node = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    return None
            s, seen = node, seen + 1
        return s if isinstance(s, dict) and not (_AMBIGUOUS & s.keys()) else None

    def child(self, parent, slot):
        """The subschema of the value at ``slot`` (a key: str; an index: int) of a container whose
        subschema is ``parent`` (None: unknown, or not one subschema)."""
        if parent is None or slot is None or slot is _UNKNOWN or "enum" in parent or "const" in parent:
            return None  # (a container held to values as a whole: its values' contents matter after them)
        key = (id(parent), slot)
        if key not in self._children:
            self._children[key] = self._resolve(parent, slot)
            self._keep.append(parent)
        return self._children[key]

    def _resolve(self, parent: dict, slot):
        if isinstance(slot, str):
            props = parent.get("properties", {})
            pattern_props = parent.get("patternProperties", {})
            if pattern_props and (not _PLAIN_KEY.fullmatch(slot) or not all(map(_compiles, pattern_props))):
                return None  # (which patterns match is known here for printable ASCII keys and patterns Python reads)
            patterns = [p for p in pattern_props if re.search(p, slot, re.ASCII)]
            if patterns and (slot in props or len(patterns) > 1):
                return None  # (more than one subschema applies)
            if slot in props:
                return self._deref(props[slot])
            if patterns:
                return self._deref(parent["patternProperties"][patterns[0]])
            extra = parent.get("additionalProperties")
            return self._deref(extra) if isinstance(extra, dict) else None
        prefix = parent.get("prefixItems")
        items = parent.get("items")
        if isinstance(items, list):  # (draft 4–2019: items as a list, then additionalItems)
            prefix, items = items, parent.get("additionalItems")
        if isinstance(prefix, list) and slot < len(prefix):
            return self._deref(prefix[slot])
        return self._deref(items) if isinstance(items, dict) else None

    def automaton(self, s):
        """The automaton of the string value ``s`` (None: llguidance's masks there)."""
        if s is None:
            return None
        if id(s) not in self._automata:
            dfa = None
            if _automaton_schema(s):  # (one automaton for each distinct string: a schema repeats them)
                key = json.dumps({k: v for k, v in s.items() if k in _VALUE_KEYS}, sort_keys=True)
                if key not in self._distinct:
                    self._distinct[key] = self._build(s)
                dfa = self._distinct[key]
            self._automata[id(s)] = dfa
            self._keep.append(s)
        return self._automata[id(s)]

    def _build(self, s: dict):
        from .regex import char_fsm

        try:
            with build_limit(STRING_BUILD_S):
                regexes, subsets = schema_regexes({k: v for k, v in s.items() if k in _VALUE_KEYS})
                if subsets:
                    return None
                fsm = reduce(lambda a, b: a & b, map(char_fsm, regexes))
                table, accepting, initial = minimal_bytes(*byte_dfa(fsm))
        except (UnsupportedSchema, SMCDecodeError, TooSlow):
            return None
        if len(table) - 1 > MAX_STRING_STATES:
            return None
        table = table.astype(np.int64)
        start = int(table[initial, _QUOTE])
        if start == len(table) - 1:
            return None  # (no string satisfies it: llguidance's masks, which say so)
        for a in np.nonzero(accepting)[0]:  # (after the closing quote: any bytes, the grammar's)
            table[a, :] = a
        eager = time.perf_counter() < self._eager_until and len(table) - 1 <= EAGER_STATES
        return _StringDFA(table, accepting, start, self, eager)

    # -- the scanner -------------------------------------------------------------------------
    def _value(self, stack: tuple):
        """The subschema of the value that starts here."""
        if not stack:
            return self._deref(self.root)
        schema, slot, _ = stack[-1]
        return self.child(schema, slot)

    def advance(self, scan, token: int):
        """The scanner state after token ``token``. A state is a function of the particle's outline
        (``outline``) and, inside a string automaton's string, its automaton state: one object for
        each (``_states``), whose steps are kept (``_next``), so that most steps are one lookup."""
        hit = self._next.get((id(scan), token))
        if hit is not None:
            return hit[1]
        new = self._stepped(scan, token)
        mode = new[1]
        key = (new[3], mode, new[2][1] if mode == AUTOMATON else new[2] if mode == NUMBER else -1)
        new = self._states.setdefault(key, new)
        if len(self._next) >= _STEPS_KEPT:
            self._next.clear()
            self._states.clear()
        self._next[(id(scan), token)] = (scan, new)  # (the state kept with its step: its id is not reused)
        return new

    def _stepped(self, scan, token: int):
        data = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        if not data:
            return scan[0], scan[1], scan[2], self.outline(scan[3], token)
        if scan[1] == AUTOMATON:  # (most tokens inside a string keep it open)
            dfa, state, verdicts = scan[2]
            state, after = dfa.step(state, data)
            if after < 0 and state != dfa.dead:
                return scan[0], AUTOMATON, (dfa, state, verdicts), scan[3]
        stack, mode, x, base, kept = self._scan(scan, data)
        at = self.outline(base, token if kept is None else bytes(kept)) if kept is None or kept else base
        if mode == AUTOMATON and x[2] is None:  # (a string opened: its rests' verdicts are its outline's)
            verdicts = self._verdicts.get(at)
            if verdicts is None:
                if len(self._verdicts) >= _VERDICTS_KEPT:
                    self._verdicts.clear()
                verdicts = self._verdicts[at] = _Verdicts()
            x = (x[0], x[1], verdicts)
        return stack, mode, x, at

    def outline(self, at: int, step) -> int:
        """The id of the outline ``at`` followed by ``step`` (a token id: its bytes, none inside a
        string automaton's string; bytes; or ``_NUMBERED``, a number value that ended). A
        particle's *outline* is its document so far with the content of every string value a string
        automaton wrote (its quotes kept), and the digits of every number value that ended, left
        out. One id names one outline (the same steps from the same id give the same id, and ids are
        never given twice); one outline may have several ids (other tokenisations, a table
        cleared), which only costs a mask computed again. llguidance's parser is in the same state
        after any value of such a string or number (the premise of the string automata's rests,
        ``_Row``), so particles with one outline, outside those strings, get the same mask from
        llguidance (``matchers.fill_bits_together`` keeps them)."""
        key = (at, step)
        got = self._outlines.get(key)
        if got is None:
            if len(self._outlines) >= _OUTLINES_KEPT:
                self._outlines.clear()
            got = self._outlines[key] = next(_IDS)
        return got

    def _scan(self, scan, data: bytes):
        """(stack, mode, the mode's state after ``data``, the outline id the token's step extends, and
        the token's step: None where it is the token itself, else the bytes of it that the outline
        keeps). In a number value whose subschema is known the state is the outline's id before the
        number; the number's digits leave the outline once it ended, as a string automaton's content
        does (the parser's state after such a value does not depend on it either)."""
        stack, mode, x, base = scan[0], scan[1], scan[2], scan[3]
        kept = None if mode != AUTOMATON and mode != NUMBER else bytearray()
        i, n = 0, len(data)
        while i < n:
            if mode == AUTOMATON:
                dfa, state, verdicts = x
                state, after = dfa.step(state, data[i:])
                if state == dfa.dead:  # (left the string's language: llguidance's error state follows)
                    return stack, OUT, None, base, kept + b"\xff"
                if after < 0:
                    return stack, AUTOMATON, (dfa, state, verdicts), base, kept
                i, mode, x = i + after, OUT, None
                kept += _SHUT
                continue
            c = data[i]
            if mode == NUMBER:
                if c in _NUMBER_BYTES:
                    kept.append(c)
                    i += 1
                    continue
                base, kept = self.outline(x, _NUMBERED), bytearray()  # (the number ended before c)
                mode, x = OUT, None
            i += 1
            if kept is not None:
                kept.append(c)
            if mode == OUT and c in _NUMBER_START and (not stack or not stack[-1][2] or stack[-1][1] is not None) \
                    and self._value(stack) is not None:  # (a number value starts)
                before = data[: i - 1] if kept is None else kept[:-1]
                base = x = self.outline(base, bytes(before)) if before else base
                mode, kept = NUMBER, bytearray((c,))
                continue
            if mode == OUT:
                if c == 0x7B:  # {
                    stack = (*stack, (self._value(stack), None, True))
                elif c == 0x5B:  # [
                    stack = (*stack, (self._value(stack), 0, False))
                elif c in (0x7D, 0x5D):  # } ]
                    stack = stack[:-1]
                elif c == 0x2C and stack:  # ,
                    schema, slot, is_object = stack[-1]
                    stack = (*stack[:-1], (schema, None if is_object else slot + 1, is_object))
                elif c == _QUOTE:
                    if stack and stack[-1][2] and stack[-1][1] is None:
                        mode, x = KEY, (b"", False)
                    else:
                        dfa = self.automaton(self._value(stack))
                        if dfa is None:
                            mode, x = STRING, False
                        else:
                            mode, x = AUTOMATON, (dfa, dfa.start, None)
                            if kept is None:
                                kept = bytearray(data[:i])
            elif mode == KEY:
                raw, escaped = x
                if c == _QUOTE and not escaped:
                    schema, _, _ = stack[-1]
                    # (llguidance takes a property by the key as written: one with an escape is a key of
                    # its own, and its value keeps llguidance's masks)
                    name = None if b"\\" in raw else _name(raw)
                    stack = (*stack[:-1], (schema, _UNKNOWN if name is None else name, True))
                    mode, x = OUT, None
                else:
                    x = (raw + bytes((c,)), not escaped and c == _BACKSLASH)
            else:  # STRING
                if c == _QUOTE and not x:
                    mode, x = OUT, None
                else:
                    x = not x and c == _BACKSLASH
        return stack, mode, x, base, kept

    def fill(self, scan, matcher, out: np.ndarray) -> bool:
        """Inside a string automaton: write the mask of a particle at ``scan`` whose llguidance state is ``matcher``
        into ``out`` (int32 [W]) and return True; elsewhere False (llguidance's mask is needed)."""
        if scan[1] != AUTOMATON:
            return False
        dfa, state, verdicts = scan[2]
        known = verdicts.masks.get(state)
        if known is not None:
            out[:] = known
            return True
        row = dfa.row(state)
        if not row.rests:
            out[:] = row.packed
            return True
        ok = verdicts.ok
        got = []
        for r, t in zip(row.rests, row.first):
            v = ok.get(r)
            if v is None:  # (llguidance's verdict: one token that closes so)
                v = ok[r] = int(matcher.validate_tokens([t]) == 1)
            got.append(v)
        out[:] = verdicts.masks[state] = row.mask(tuple(got))
        return True


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
        return True
    except re.error:
        return False
