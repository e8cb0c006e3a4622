"""Regular languages as token automata with token classes.

A regular expression becomes a character automaton (``interegular``), then a byte automaton (each
character's UTF-8 encoding spelled out; bytes that cannot start or continue a character lead to the
dead state), then a *token* automaton over the model's vocabulary: the state after each token's
bytes from each state reachable at a token boundary. Two tokens with the same next state from
every state are interchangeable, so they share a *class*; a token automaton is

    classes   [V]      int32  token -> class
    table     [S+1, C] int32  (state, class) -> next state; row and value S are the dead state
    accepting [S+1]    bool

and the mask of a batch of states is two gathers, ``(table[state] != S)[:, classes]``. JSON-Schema
automata over a 49k vocabulary have tens to a few thousand classes, so a table takes kilobytes to
a few MiB where the dense ``[S+1, V]`` table took ``4·V`` bytes per state.

Building it walks every token's bytes from a batch of states at once (numpy gathers over all
(state, token) pairs still alive, so structural states where most tokens die at their first byte
cost little), hashes each token's column of next states to find the classes, drops states from
which no accepting state can be reached, and merges equivalent states (Moore's refinement).
EOS is allowed exactly in accepting states; special tokens (no text) and empty tokens never.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import SMCDecodeError

PAIRS_PER_BATCH = 4_000_000  # (state, token) pairs walked at once: bounds the builder's memory
MAX_STATES = 20_000  # token-automaton states: past this, binding falls back to llguidance (path='auto') or raises

_LEAD_RANGES = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


# seconds each step of building a device automaton may take where the path was chosen ("auto"): the
# character automaton (construction), then the token automaton (binding to a model); past it, the
# constraint takes llguidance's masks, which need no build (a path asked for has no limit)
AUTO_BUILD_S = 30.0


class TooLarge(SMCDecodeError):
    """The automaton would exceed :data:`MAX_STATES` states (or, :class:`TooSlow`, its build time)."""


class TooSlow(TooLarge):
    """Building the automaton passed the time given to it (:func:`build_limit`)."""


_DEADLINE: contextvars.ContextVar = contextvars.ContextVar("smcdecode_automaton_deadline", default=None)


@contextlib.contextmanager
def build_limit(seconds: float | None):
    """Within it, building an automaton (interegular's walk, ``regex._crawl``, and the token walk)
    raises :class:`TooSlow` once ``seconds`` have passed (None: no limit)."""
    token = _DEADLINE.set(None if seconds is None else (time.perf_counter() + seconds, seconds))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def auto_limit(path: str):
    """:func:`build_limit` of a constraint's ``path`` argument: ``AUTO_BUILD_S`` for "auto", else none."""
    return build_limit(AUTO_BUILD_S if path == "auto" else None)


def check_time() -> None:
    """Raise :class:`TooSlow` where the build limit (:func:`build_limit`) has passed."""
    limit = _DEADLINE.get()
    if limit is not None and time.perf_counter() >= limit[0]:
        raise TooSlow(f"building the automaton took longer than {limit[1]:g} s (automaton.AUTO_BUILD_S; "
                      "path='automaton' or 'superset' builds it without a limit)")


@dataclass
class TokenAutomaton:
    """A token-level DFA with token classes (host tensors; see the module docstring)."""

    classes: Tensor  # [V] int32
    table: Tensor  # [S+1, C] int32
    accepting: Tensor  # [S+1] bool
    initial: int

    @property
    def dead(self) -> int:
        return self.table.shape[0] - 1

    @property
    def num_states(self) -> int:
        """Live states (the dead state not counted)."""
        return self.table.shape[0] - 1

    @property
    def num_classes(self) -> int:
        return self.table.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the device representation (table, class map, accepting flags)."""
        return sum(t.numel() * t.element_size() for t in (self.classes, self.table, self.accepting))

    def allowed(self, state: Tensor) -> Tensor:
        """bool [B, V]: tokens that keep each state's prefix viable."""
        return (self.table[state] != self.dead)[:, self.classes]

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        return self.table[state, self.classes[tokens]].long()

    def dense(self) -> Tensor:
        """The ``[S+1, V]`` next-state table (for inspection and tests; large)."""
        return self.table[:, self.classes.long()]

    def satisfiable(self) -> bool:
        return self.initial != self.dead


# -- characters -> bytes ------------------------------------------------------------------------


def byte_dfa(fsm) -> tuple[np.ndarray, np.ndarray, int]:
    """The byte automaton of an ``interegular`` character FSM: ``(table [n+1, 256] int32, accepting
    [n+1] bool, initial)``; row and value n are the dead state. Only characters' valid UTF-8
    encodings (no surrogates, nothing past U+10FFFF) lead anywhere but the dead state."""
    from interegular.fsm import anything_else

    states = sorted(fsm.states)
    live = set(fsm.finals)
    reverse: dict = {}
    for s in states:
        for t in fsm.map.get(s, {}).values():
            reverse.setdefault(t, set()).add(s)
    frontier = list(live)
    while frontier:
        for p in reverse.get(frontier.pop(), ()):
            if p not in live:
                live.add(p)
                frontier.append(p)
    mapping = dict(fsm.alphabet.items())
    other = mapping.pop(anything_else, None)
    explicit = {ch: sym for ch, sym in mapping.items()}
    multibyte: dict[int, list[tuple[bytes, str]]] = {}
    for ch in explicit:
        enc = ch.encode("utf-8")
        if len(enc) > 1:
            multibyte.setdefault(enc[0], []).append((enc, ch))

    ids: dict = {}
    rows: list[np.ndarray] = []
    pending: list = []

    def node(key) -> int:
        if key not in ids:
            ids[key] = len(rows)
            rows.append(None)
            pending.append(key)
        return ids[key]

    DEAD = -1  # noqa: N806 - replaced by n once every node is known

    def target(s, sym) -> int:
        t = fsm.map.get(s, {}).get(sym) if sym is not None else None
        return node(("q", t)) if t in live else DEAD

    def char_target(s, ch) -> int:
        return target(s, explicit.get(ch, other))

    def chain(k: int, t: int) -> int:  # k more continuation bytes, then state t
        return t if k == 0 or t == DEAD else node(("chain", k, t))

    def continuation(lead: int, i: int, length: int, prefix: bytes, s, t_other: int) -> int:
        """The node after ``prefix`` (``i`` bytes of a ``length``-byte character) from state s."""
        subtree = [c for c in multibyte.get(lead, ()) if c[0].startswith(prefix)]
        if not subtree:
            if t_other == DEAD:
                return DEAD
            if i == 1 and lead in _LEAD_RANGES:
                return node(("lead", lead, t_other))
            return chain(length - i, t_other)
        return node(("trie", s, prefix))

    initial = node(("q", fsm.initial)) if fsm.initial in live else None
    while pending:
        key = pending.pop()
        row = np.full(256, DEAD, dtype=np.int64)
        if key[0] == "q":
            s = key[1]
            for b in range(128):
                row[b] = char_target(s, chr(b))
            t_other = target(s, other)
            for lead in range(0xC2, 0xF5):
                length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
                row[lead] = continuation(lead, 1, length, bytes([lead]), s, t_other)
        elif key[0] == "chain":
            _, k, t = key
            row[0x80:0xC0] = chain(k - 1, t)
        elif key[0] == "lead":
            _, lead, t = key
            lo, hi = _LEAD_RANGES[lead]
            length = 3 if lead < 0xF0 else 4
            row[lo : hi + 1] = chain(length - 2, t)
        else:  # a trie node: a prefix of some explicit character's encoding
            _, s, prefix = key
            lead, i = prefix[0], len(prefix)
            length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            lo, hi = _LEAD_RANGES.get(lead, (0x80, 0xBF)) if i == 1 else (0x80, 0xBF)
            t_other = target(s, other)
            for c in range(lo, hi + 1):
                p = prefix + bytes([c])
                if i + 1 == length:
                    row[c] = char_target(s, p.decode("utf-8"))
                else:
                    row[c] = continuation(lead, i + 1, length, p, s, t_other)
        rows[ids[key]] = row
    n = len(rows)
    table = np.full((n + 1, 256), n, dtype=np.int32)
    for i, row in enumerate(rows):
        table[i] = np.where(row == DEAD, n, row)
    accepting = np.zeros(n + 1, dtype=bool)
    for key, i in ids.items():
        accepting[i] = key[0] == "q" and key[1] in fsm.finals
    return table, accepting, (n if initial is None else initial)


# -- bytes -> tokens ----------------------------------------------------------------------------


class _Vocabulary:
    """The vocabulary's text tokens as a padded byte matrix, longest first."""

    def __init__(self, token_bytes: list[bytes | None]):
        text = [i for i, b in enumerate(token_bytes) if b]
        text.sort(key=lambda i: -len(token_bytes[i]))
        self.ids = np.array(text, dtype=np.int64)
        self.lengths = np.array([len(token_bytes[i]) for i in text], dtype=np.int64)
        width = int(self.lengths.max()) if len(text) else 1
        self.bytes = np.zeros((len(text), width), dtype=np.int64)
        for row, i in enumerate(text):
            self.bytes[row, : len(token_bytes[i])] = np.frombuffer(token_bytes[i], dtype=np.uint8)
        self.size = len(token_bytes)


def _walk(table: np.ndarray, states: np.ndarray, vocab: _Vocabulary, columns: np.ndarray | None = None) -> np.ndarray:
    """[len(states), V] (or [len(states), len(columns)] over text-token rows ``columns``): the byte
    state after each token from each state (dead = ``len(table) - 1``; non-text tokens dead)."""
    dead = len(table) - 1
    rows_of = np.arange(len(vocab.ids)) if columns is None else columns
    width = vocab.size if columns is None else len(columns)
    out = np.full((len(states), width), dead, dtype=np.int32)
    n = len(rows_of)
    if n == 0 or len(states) == 0:
        return out
    r = np.repeat(np.arange(len(states)), n)
    k = np.tile(np.arange(n), len(states))
    tok = rows_of[k]
    st = table[np.repeat(states, n), vocab.bytes[tok, 0]]
    col = vocab.ids[tok] if columns is None else k
    j = 1
    while len(st):
        alive = st != dead
        done = alive & (vocab.lengths[tok] == j)
        out[r[done], col[done]] = st[done]
        keep = alive & (vocab.lengths[tok] > j)
        r, tok, col, st = r[keep], tok[keep], col[keep], st[keep]
        if len(st):
            st = table[st, vocab.bytes[tok, j]]
        j += 1
    return out


_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)


def token_automaton(table: np.ndarray, accepting: np.ndarray, initial: int, token_bytes: list[bytes | None],
                    eos_token_id: int, max_states: int = MAX_STATES) -> TokenAutomaton:
    """The token automaton of a byte automaton (see :func:`byte_dfa`) over a vocabulary whose token
    ``i`` has the bytes ``token_bytes[i]`` (None: a special token)."""
    vocab = _Vocabulary(token_bytes)
    V = vocab.size
    table, accepting, initial = minimal_bytes(table, accepting, initial)
    dead_b = len(table) - 1
    if not 0 <= eos_token_id < V:
        raise SMCDecodeError(f"eos_token_id {eos_token_id} is outside the vocabulary of {V} tokens")
    # 1. states reachable at token boundaries, and a 128-bit hash of each token's column
    order = [initial] if initial != dead_b else []
    index = {initial: 0} if order else {}
    h1 = np.zeros(V, dtype=np.uint64)
    h2 = np.zeros(V, dtype=np.uint64)
    batch = max(1, PAIRS_PER_BATCH // max(1, len(vocab.ids)))
    done = 0
    bar = _progress(dead_b, len(vocab.ids))
    with np.errstate(over="ignore"):
        while done < len(order):
            if bar is not None:
                bar.update(done - bar.n)
            check_time()
            states = np.array(order[done : done + batch], dtype=np.int64)
            rows = _walk(table, states, vocab)
            rows[:, eos_token_id] = np.where(accepting[states], states, dead_b)
            for s in np.unique(rows).tolist():
                if s != dead_b and s not in index:
                    index[s] = len(order)
                    order.append(s)
            if len(order) > max_states:
                raise TooLarge(f"the token automaton has more than {max_states} states")
            for row in rows.astype(np.uint64):
                h1 = (h1 * _M1) ^ (row + np.uint64(1))
                h2 = (h2 + row) * _M2 ^ (h2 >> np.uint64(29))
            done += len(states)
    if bar is not None:
        bar.close()
    if not order:
        return TokenAutomaton(torch.zeros(V, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                              torch.zeros(1, dtype=torch.bool), 0)
    # 2. classes: tokens with equal hashes; the table over one representative per class
    _, first, classes = np.unique(np.stack([h1, h2], 1), axis=0, return_index=True, return_inverse=True)
    classes = classes.reshape(-1)
    reps = first  # a token id per class
    states = np.array(order, dtype=np.int64)
    row_of = np.full(V, -1, dtype=np.int64)
    row_of[vocab.ids] = np.arange(len(vocab.ids))
    text_reps = np.flatnonzero(row_of[reps] >= 0)
    small = np.full((len(states), len(reps)), dead_b, dtype=np.int32)
    for lo in range(0, len(states), batch):
        small[lo : lo + batch, text_reps] = _walk(table, states[lo : lo + batch], vocab, row_of[reps[text_reps]])
    eos_class = classes[eos_token_id]
    small[:, eos_class] = np.where(accepting[states], states, dead_b)
    # byte states -> token states (dead = S)
    S = len(order)
    to_token = np.full(dead_b + 1, S, dtype=np.int64)
    to_token[states] = np.arange(S)
    trans = to_token[small]  # [S, C]
    acc = accepting[states]
    trans, acc, init = _prune(trans, acc, 0)
    trans, acc, init = _minimise(trans, acc, init)
    # 3. columns that became equal after pruning and merging share a class
    cols, inverse = np.unique(trans.T, axis=0, return_inverse=True)
    classes = inverse.reshape(-1)[classes]
    S = trans.shape[0]
    full = np.vstack([cols.T, np.full((1, cols.shape[0]), S)]).astype(np.int32)
    return TokenAutomaton(torch.from_numpy(classes.astype(np.int32)), torch.from_numpy(np.ascontiguousarray(full)),
                          torch.from_numpy(np.append(acc, False)), int(init))


PROGRESS_PAIRS = 100_000_000  # (byte state, token) pairs past which building a token automaton shows a bar


def _progress(states: int, tokens: int):
    """A progress bar over the byte states walked (at most ``states``: those reached at a token
    boundary), where the walk takes more than ``PROGRESS_PAIRS`` (state, token) pairs (seconds of
    work: a large JSON Schema), on a terminal only (tqdm's ``disable=None``)."""
    if states * tokens <= PROGRESS_PAIRS:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=states, desc="smcdecode: token automaton", unit="states", leave=False, disable=None)


def minimal_bytes(table: np.ndarray, accepting: np.ndarray, initial: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The minimal byte automaton of ``table`` (as :func:`byte_dfa` writes it): the token walk's cost
    grows with the byte states, and interegular's automata are not minimal (a value a schema writes
    at several places is a copy at each: a JSON Schema's automaton shrank from 14,425 states to
    1,181). Refined over the byte classes (bytes whose columns are equal)."""
    n = len(table) - 1
    if n == 0 or initial == n:  # (nothing, or the initial state dead: nothing to merge)
        return table, accepting, initial
    columns, byte_class = np.unique(table[:n].T, axis=0, return_inverse=True)
    trans, acc, init = _prune(columns.T.astype(np.int64), accepting[:n], initial)
    trans, acc, init = _minimise(trans, acc, init)
    S = len(trans)
    out = np.vstack([trans[:, byte_class.reshape(-1)], np.full((1, table.shape[1]), S)]).astype(table.dtype)
    return out, np.append(acc, False), init


def _prune(trans: np.ndarray, acc: np.ndarray, init: int):
    """Keep the states reachable from ``init`` from which an accepting state is reachable; the
    others become the dead state ``len(trans)``."""
    S = trans.shape[0]
    live = acc.copy()
    src, col = np.nonzero(trans < S)
    dst = trans[src, col]
    while True:
        grown = live.copy()
        grown[src[live[dst]]] = True
        if (grown == live).all():
            break
        live = grown
    reach = np.zeros(S, dtype=bool)
    if live[init]:
        reach[init] = True
        while True:
            grown = reach.copy()
            ok = reach[src] & live[dst]
            grown[dst[ok]] = True
            if (grown == reach).all():
                break
            reach = grown
    keep = np.flatnonzero(reach)
    new = np.full(S + 1, len(keep), dtype=np.int64)
    new[keep] = np.arange(len(keep))
    out = new[np.where(trans[keep] < S, trans[keep], S)]
    return out, acc[keep], (int(new[init]) if reach.any() else 0)


def _refine(trans: np.ndarray, acc: np.ndarray, exact: bool) -> np.ndarray:
    """Each state's block once no block splits: starting from accepting / not, a state's signature is
    its block and its successors' blocks (the dead state: -1), as one hash, or (``exact``) the row."""
    weights = np.random.default_rng(0).integers(1, 2**63, size=trans.shape[1] + 1, dtype=np.uint64)
    block = acc.astype(np.int64)
    n_blocks = len(np.unique(block))
    with np.errstate(over="ignore"):
        while True:
            ext = np.append(block, -1)[trans]  # [S, C]
            if exact:
                _, block = np.unique(np.column_stack([block, ext]), axis=0, return_inverse=True)
            else:
                sig = block.astype(np.uint64) * weights[0] + (ext.astype(np.uint64) * weights[1:]).sum(1)
                _, block = np.unique(sig, return_inverse=True)
            block = block.reshape(-1)
            if block.max() + 1 == n_blocks:
                return block
            n_blocks = int(block.max()) + 1


def _stable(trans: np.ndarray, acc: np.ndarray, block: np.ndarray) -> bool:
    """Do the states of each block agree on accepting and on their successors' blocks?"""
    first = np.unique(block, return_index=True)[1][block]  # (each state's block's first state)
    ext = np.append(block, -1)[trans]
    return bool((acc == acc[first]).all() and (ext == ext[first]).all())


def _minimise(trans: np.ndarray, acc: np.ndarray, init: int):
    """Merge equivalent states (Moore's partition refinement: rows compared by a 64-bit hash, the
    result checked to be stable, and refined again comparing whole rows where a collision merged
    states)."""
    S, C = trans.shape
    if S == 0:
        return trans, acc, init
    block = _refine(trans, acc, exact=False)
    if not _stable(trans, acc, block):
        block = _refine(trans, acc, exact=True)
    n_blocks = int(block.max()) + 1
    first = np.unique(block, return_index=True)[1]
    relabel = np.append(block, n_blocks)
    out = relabel[np.where(trans[first] < S, trans[first], S)]
    return out, acc[first], int(block[init])
