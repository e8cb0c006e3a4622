"""Regular-expression constraint compiled to a token-level DFA.

The character automaton comes from ``interegular``; walking every token's text through it from
every state gives a transition table ``[S+1, V]`` of integers (row S is the dead state). A
particle's constraint state is one integer, so forking is a gather and the masks for all particles
are one row lookup: ``table[state] != DEAD``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SMCDecodeError
from .constraint import TokenConstraint


class Regex(TokenConstraint):
    """Ψ(x) = 1[text(x) fully matches ``pattern``] (Python ``re`` syntax, no look-arounds or
    back-references). The generated text, not the prompt, must match."""

    def __init__(self, pattern: str, model=None):
        if not isinstance(pattern, str):
            raise SMCDecodeError(f"regex pattern must be a string, got {type(pattern).__name__}")
        import re

        import interegular

        try:
            re.compile(pattern)
            _reject_unsupported(pattern)
            self._fsm = interegular.parse_pattern(pattern).to_fsm()
        except Exception as e:  # interegular raises several types for unsupported syntax
            raise SMCDecodeError(
                f"invalid or unsupported regex {pattern!r}: {type(e).__name__}: {e}. Use Python regex "
                "syntax without look-arounds or back-references"
            ) from None
        self.pattern = pattern
        self.model = None
        self._table: Tensor | None = None
        if model is not None:
            self._compile(model)

    def __repr__(self) -> str:
        return f"Regex({self.pattern!r})"

    def bind(self, model) -> Regex:
        if self.model is model:
            return self
        bound = Regex.__new__(Regex)
        bound.__dict__.update(self.__dict__)
        bound._compile(model)
        return bound

    # -- compilation -----------------------------------------------------------------------
    def _compile(self, model) -> None:
        fsm = self._fsm
        states = sorted(fsm.states)
        # live states: a final state is reachable
        live = set(fsm.finals)
        changed = True
        while changed:
            changed = False
            for s in states:
                if s not in live and any(t in live for t in fsm.map.get(s, {}).values()):
                    live.add(s)
                    changed = True
        index = {s: i for i, s in enumerate(sorted(live))}
        S = len(index)
        dead = S
        from interegular.fsm import anything_else

        alphabet = fsm.alphabet
        other = alphabet[anything_else] if anything_else in alphabet else None

        def step(s, ch):
            sym = alphabet[ch] if ch in alphabet else other
            nxt = fsm.map.get(s, {}).get(sym)
            return nxt if nxt in live else None

        strings = model.token_strings
        V = model.vocab_size
        table = torch.full((S + 1, V), dead, dtype=torch.long)
        for s, i in index.items():
            row = table[i]
            for v, text in enumerate(strings):
                if not text:
                    continue
                cur = s
                for ch in text:
                    cur = step(cur, ch)
                    if cur is None:
                        break
                if cur is not None:
                    row[v] = index[cur]
            if s in fsm.finals:
                row[model.eos_token_id] = i  # EOS allowed exactly in accepting states
        self._accepting = torch.zeros(S + 1, dtype=torch.bool)
        for s, i in index.items():
            self._accepting[i] = s in fsm.finals
        self._initial = index.get(fsm.initial, dead)
        self._dead = dead
        self._table = table
        self.model = model

    @property
    def num_states(self) -> int:
        self._require_model()
        return self._table.shape[0]

    @property
    def table(self) -> Tensor:
        """[S+1, V] next state for each (state, token); row and value S is the dead state."""
        self._require_model()
        return self._table

    def satisfiable(self) -> bool:
        """Can any token sequence over the bound vocabulary match?"""
        self._require_model()
        seen = {self._initial}
        frontier = [self._initial]
        while frontier:
            s = frontier.pop()
            if s == self._dead:
                continue
            if self._accepting[s]:
                return True
            for t in self._table[s].unique().tolist():
                if t not in seen:
                    seen.add(t)
                    frontier.append(t)
        return False

    # -- tensor path -----------------------------------------------------------------------
    def start(self, batch: int) -> Tensor:
        self._require_model()
        return torch.full((batch,), self._initial, dtype=torch.long)

    def allowed(self, state: Tensor) -> Tensor:
        table = self._table.to(state.device)
        return table[state] != self._dead

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        table = self._table.to(state.device)
        return table[state, tokens.to(state.device)]

    def accepting(self, state: Tensor) -> Tensor:
        return self._accepting.to(state.device)[state]



def _reject_unsupported(pattern: str) -> None:
    """interegular silently approximates look-arounds; refuse them (and back-references) instead."""
    try:
        from re import _parser as sre_parse  # Python >= 3.11
    except ImportError:  # pragma: no cover
        import sre_parse  # type: ignore[no-redef]
    bad = {"ASSERT": "look-around", "ASSERT_NOT": "look-around", "GROUPREF": "back-reference",
           "GROUPREF_EXISTS": "conditional", "AT": "anchor"}

    def walk(items, copies):
        for op, arg in items:
            name = str(op)
            if name in bad and not (name == "AT" and str(arg) in ("AT_BEGINNING", "AT_END", "AT_BEGINNING_STRING", "AT_END_STRING")):
                raise ValueError(f"{bad[name]} ({name}) is not supported")
            inner = copies
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                low, high = arg[0], arg[1]
                # NOTE: the automaton holds a copy of the repeated part per counted repetition
                inner = copies * (max(low, 1) if high == sre_parse.MAXREPEAT else max(high, 1))
                if inner > MAX_REPEAT:
                    raise ValueError(
                        f"repetition counts multiply to {inner} copies, more than {MAX_REPEAT}: the token automaton "
                        "would take minutes to build; bound the length with max_new_tokens instead"
                    )
            for a in arg if isinstance(arg, (list, tuple)) else [arg]:
                if isinstance(a, sre_parse.SubPattern):
                    walk(a, inner)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, sre_parse.SubPattern):
                            walk(b, inner)

    walk(sre_parse.parse(pattern), 1)


MAX_REPEAT = 1000  # counted repetitions in one regex (a{n}, a{m,n}, nested counts multiplied)
