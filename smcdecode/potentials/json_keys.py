"""Unique object keys for JSON constraints.

A JSON Schema does not forbid an object from naming a key twice, and llguidance's grammar cannot
(which keys an object already holds is not a context-free property): a schema that allows
additional properties therefore allows ``{"gender": "m", "gender": "m"}``, and a small model that
likes a key repeats it. :class:`KeyTracker` removes those documents from the language exactly:
each particle carries a small scanner state (the stack of open objects and arrays, each object's
keys so far, and the key being written), and the mask forbids every token that would close a key
its object already has. A token can only close a key with a ``"`` byte, so only the vocabulary's
tokens that contain one (163 of SmolLM2's 49,152) are ever checked, and their verdict depends on
the scanner state alone, so it is cached per state. Most of them hold one or two ``"`` and no
backslash: such a token repeats a key only by closing the key being written with the bytes before
its first quote (found by looking up each key the object holds that continues the key so far), or
by enclosing a held key between its two quotes; the others (11 on SmolLM2) are scanned.

States are immutable tuples (forking shares them); :data:`DEAD` is the state after a repeated key
(only reachable by a token the mask forbade), from which nothing is allowed.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import numpy as np
import torch
from torch import Tensor

DEAD = "dead"  # the scanner state after a repeated key
START = ((), False, False, None)  # (stack, in a string, after a backslash, raw bytes of the key being written)
_ARRAY = None  # a stack frame for an array; an object's frame is (frozenset of its keys, expecting a key)
_QUOTE, _BACKSLASH = 0x22, 0x5C
_OPEN_OBJECT, _CLOSE_OBJECT, _OPEN_ARRAY, _CLOSE_ARRAY, _COMMA = 0x7B, 0x7D, 0x5B, 0x5D, 0x2C
_CONTROL = re.compile(rb"[\x00-\x1f]")
_NOT_RAW = re.compile('[\x00-\x1f"\\\\]')  # characters a key's name holds only written as an escape
_PLAIN_NOT = frozenset((_QUOTE, _BACKSLASH, _OPEN_OBJECT, _CLOSE_OBJECT, _OPEN_ARRAY, _CLOSE_ARRAY, _COMMA))


def _name(raw: bytes) -> str | None:
    """The key that the bytes ``raw`` between a key's quotes name (JSON unescaped), or None where they
    are no JSON string (a token llguidance forbids anyway)."""
    if b"\\" in raw:
        try:
            return json.loads(b'"' + raw + b'"')
        except ValueError:
            return None
    if _CONTROL.search(raw):  # (control characters are written escaped)
        return None
    try:
        return raw.decode("utf-8", "surrogatepass")  # (as json.loads decodes)
    except UnicodeDecodeError:
        return None


def _raw(name: str) -> bytes | None:
    """The bytes that name ``name`` without an escape (inverse of ``_name``), or None if none do."""
    if _NOT_RAW.search(name):
        return None
    return name.encode("utf-8", "surrogatepass")


def step(state, data: bytes):
    """The scanner state after the text ``data``. Only valid JSON is ever kept (llguidance's mask sees
    to that), but candidate tokens are scanned before that mask applies, so invalid text must not
    raise: it gives some state, never DEAD unless a key repeats."""
    if state == DEAD:
        return DEAD
    stack, in_string, escaped, key = state
    for c in data:
        if in_string:
            if escaped:
                escaped = False
            elif c == _BACKSLASH:
                escaped = True
            elif c == _QUOTE:
                in_string = False
                if key is not None:
                    keys = stack[-1][0]
                    name = _name(key)
                    if name is not None and name in keys:
                        return DEAD
                    stack = (*stack[:-1], (keys if name is None else keys | {name}, False))
                    key = None
                continue
            if key is not None:
                key += bytes((c,))
        elif c == _QUOTE:
            in_string = True
            top = stack[-1] if stack else _ARRAY
            key = b"" if top is not _ARRAY and top[1] else None
        elif c == _OPEN_OBJECT:
            stack = (*stack, (frozenset(), True))
        elif c == _OPEN_ARRAY:
            stack = (*stack, _ARRAY)
        elif c in (_CLOSE_OBJECT, _CLOSE_ARRAY):
            stack = stack[:-1]
        elif c == _COMMA and stack and stack[-1] is not _ARRAY:
            stack = (*stack[:-1], (stack[-1][0], True))
    return (stack, in_string, escaped, key)


_MISSING = object()


class KeyTracker:
    """The unique-key rule for one vocabulary: ``token_bytes[i]`` is token i's text (None for special
    tokens, which are no text)."""

    def __init__(self, token_bytes: list[bytes | None], cache_size: int = 4096):
        self.token_bytes = token_bytes
        self.quote_ids = [i for i, b in enumerate(token_bytes) if b is not None and b'"' in b]
        self._blocked: OrderedDict = OrderedDict()
        self._words: dict = {}  # state -> _cleared(state)
        self._cache_size = cache_size
        # tokens that change the scanner only by extending the key being written: no byte of _PLAIN_NOT
        self.plain = [bool(b) and _PLAIN_NOT.isdisjoint(b) for b in token_bytes]
        # quote tokens without a backslash and with one or two quotes, by the bytes before their first
        # quote (``by_head``), and those with two by the key their quotes would enclose (``pairs``);
        # the others are always scanned
        self.by_head: dict[bytes, list[int]] = {}
        self.pairs: list[tuple[int, str | None]] = []
        self.scanned: list[int] = []
        for t in self.quote_ids:
            b = token_bytes[t]
            q = b.count(b'"')
            if q > 2 or b"\\" in b:
                self.scanned.append(t)
                continue
            first = b.index(b'"')
            self.by_head.setdefault(b[:first], []).append(t)
            if q == 2:
                self.pairs.append((t, _name(b[first + 1: b.index(b'"', first + 1)])))

    def advance(self, state, token: int):
        data = self.token_bytes[token]
        if data is None:
            return state
        if self.plain[token] and state != DEAD:  # (what step gives, without scanning the bytes)
            stack, in_string, _, key = state
            if not in_string:
                return state
            return (stack, True, False, None if key is None else key + data)
        return step(state, data)

    def replay(self, tokens) -> object:
        state = START
        for t in tokens:
            state = self.advance(state, int(t))
        return state

    def blocked(self, state) -> list[int]:
        """Tokens that would close a key its object already holds, from ``state``."""
        try:
            self._blocked.move_to_end(state)
            return self._blocked[state]
        except KeyError:
            pass
        out = self._scan(state)
        self._blocked[state] = out
        if len(self._blocked) > self._cache_size:
            self._blocked.popitem(last=False)
        return out

    def _scan(self, state) -> list[int]:
        """``blocked(state)`` computed: exactly the quote tokens whose ``step`` from ``state`` is DEAD.
        Without a backslash, a token of one or two quotes can repeat a key only by closing the key
        being written (with the bytes before its first quote: looked up), or, outside a string, by
        enclosing a key between its two quotes (scanned only where some object holds that name);
        the others are scanned."""
        if state == DEAD:
            return list(self.quote_ids)
        stack, in_string, escaped, key = state
        tb = self.token_bytes
        out = [t for t in self.scanned if step(state, tb[t]) == DEAD]
        # where the key so far holds an escape, the name a token's first quote closes is the key's
        # name so far and then the token's bytes before that quote (when the key so far decodes)
        named = None if key is None or escaped or b"\\" not in key else _name(key)
        if escaped or (key is not None and b"\\" in key and named is None):  # (scan)
            out += [t for ts in self.by_head.values() for t in ts if step(state, tb[t]) == DEAD]
        elif named is not None:
            for name in stack[-1][0]:
                raw = _raw(name[len(named):]) if name.startswith(named) else None
                if raw is not None:
                    out += self.by_head.get(raw, [])
        elif in_string and key is not None:  # the first quote closes the key being written
            for name in stack[-1][0]:
                raw = _raw(name)
                if raw is not None and raw.startswith(key):
                    out += self.by_head.get(raw[len(key):], [])
        elif not in_string:  # the first quote opens a string, the second (if any) closes it
            held = set().union(*(f[0] for f in stack if f is not _ARRAY))
            out += [t for t, name in self.pairs if name in held and step(state, tb[t]) == DEAD]
        # (inside a value: the first quote closes it, a second opens a string that stays open)
        return sorted(out)

    def _cleared(self, state) -> tuple | None:
        """``blocked(state)`` as (word indices, each word's mask of the bits kept), or None if none."""
        hit = self._words.get(state, _MISSING)
        if hit is not _MISSING:  # (the engine's host masks look up every row at every step)
            return hit
        blocked = self.blocked(state)
        out = None
        if blocked:
            t = np.asarray(blocked, dtype=np.int64)
            words, where = np.unique(t >> 5, return_inverse=True)
            clear = np.zeros(len(words), dtype=np.int64)
            np.bitwise_or.at(clear, where, np.left_shift(np.int64(1), t & 31))
            out = (words, (~clear & 0xFFFFFFFF).astype(np.uint32).view(np.int32))
        if len(self._words) >= self._cache_size:  # (the oldest entry out: first in, first out)
            del self._words[next(iter(self._words))]
        self._words[state] = out
        return out

    def restrict_bits(self, bits: Tensor, states: list, rows=None) -> Tensor:
        """``bits`` (int32 [B, ⌈V/32⌉] on the CPU, packed as ``constraint.pack_bits``) with the bits of
        tokens that repeat a key cleared (rows of dead states zeroed); in place. ``rows``: only these
        rows (default: all)."""
        at = range(len(states)) if rows is None else list(rows)
        self.restrict_rows(bits.numpy(), at, [states[i] for i in at])
        return bits

    def restrict_rows(self, words: np.ndarray, at, states: list) -> None:
        """``words[at[j]]`` (int32 rows of packed bits) restricted by the key rule at ``states[j]``,
        in place: the cleared words of every row gathered, then cleared in one array operation."""
        cleared = self._cleared
        rows, cols, keep, dead = [], [], [], []
        for r, s in zip(at, states):
            if s == DEAD:
                dead.append(r)
            elif (c := cleared(s)) is not None:
                rows.append(np.full(len(c[0]), r))
                cols.append(c[0])
                keep.append(c[1])
        if rows:
            rows, cols = np.concatenate(rows), np.concatenate(cols)
            words[rows, cols] &= np.concatenate(keep)  # (a row's words are distinct: no index repeats)
        if dead:
            words[dead] = 0

    def restrict(self, mask: Tensor, states: list) -> Tensor:
        """``mask`` [B, V] with the tokens that repeat a key removed (rows of dead states emptied); in
        place."""
        for i, s in enumerate(states):
            if s == DEAD:
                mask[i] = False
            else:
                blocked = self.blocked(s)
                if blocked:
                    mask[i, torch.tensor(blocked, dtype=torch.long)] = False
        return mask
