"""Regular-expression constraint compiled to a token automaton with token classes.

The character automaton comes from ``interegular``; ``automaton.py`` turns it into a byte automaton
and walks every token's bytes through it (``token_bytes.py`` gives the exact bytes of each token),
giving ``table [S+1, C]`` over token classes and ``classes [V]`` (row S is the dead state). A
particle's constraint state is one integer, so forking is a gather and the masks for all particles
are two gathers: ``(table[state] != DEAD)[:, classes]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SMCDecodeError
from .automaton import TokenAutomaton, byte_dfa, token_automaton
from .constraint import TokenConstraint


class Regex(TokenConstraint):
    """Ψ(x) = 1[text(x) fully matches ``pattern``] (Python ``re`` syntax, no look-arounds or
    back-references). The generated text, not the prompt, must match; every tokenisation of a
    matching text is allowed (tokens are compared as bytes, so a character may be split over
    several byte tokens)."""

    path = "automaton"

    def __init__(self, pattern: str, model=None):
        if not isinstance(pattern, str):
            raise SMCDecodeError(f"regex pattern must be a string, got {type(pattern).__name__}")
        self._fsm = char_fsm(pattern)
        self.pattern = pattern
        self.model = None
        self.automaton: TokenAutomaton | None = None
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

    def _compile(self, model) -> None:
        self.automaton = compile_fsm(self._fsm, model)
        self.model = model

    @property
    def token_automaton(self) -> TokenAutomaton:
        """The compiled automaton (what the engine puts on the device)."""
        self._require_model()
        return self.automaton

    @property
    def num_states(self) -> int:
        """States of the token automaton, the dead state included."""
        self._require_model()
        return self.automaton.table.shape[0]

    @property
    def table(self) -> Tensor:
        """[S+1, V] next state for each (state, token); row and value S is the dead state (dense:
        ``token_automaton`` holds the compact form)."""
        self._require_model()
        return self.automaton.dense()

    def satisfiable(self) -> bool:
        """Can any token sequence over the bound vocabulary match?"""
        self._require_model()
        return self.automaton.satisfiable()

    # -- tensor path -----------------------------------------------------------------------
    def start(self, batch: int) -> Tensor:
        self._require_model()
        return torch.full((batch,), self.automaton.initial, dtype=torch.long)

    def allowed(self, state: Tensor) -> Tensor:
        return self.automaton.allowed(state.cpu()).to(state.device)

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        return self.automaton.advance(state.cpu(), tokens.cpu()).to(state.device)

    def accepting(self, state: Tensor) -> Tensor:
        return self.automaton.accepting[state.cpu()].to(state.device)


def interegular_module():
    """``interegular``, its automaton builder's state lookup made a dictionary's.

    interegular (0.3.3) builds every automaton (a regex's parts, their concatenation, repetition,
    union and intersection) with ``fsm.crawl``, a breadth-first walk over new states that finds each
    state's number with ``list.index``: quadratic in the states. A JSON Schema's automaton has
    thousands (a superset with keys of up to 255 characters: 11,343), where that lookup took over a
    minute. :func:`_crawl` is the same walk, numbering the states in the same order (the automata
    are equal, ``tests/test_automaton_build.py``), with the lookup in a dictionary. It replaces
    ``interegular.fsm.crawl`` once, where that function has the signature this one expects."""
    import inspect

    import interegular
    import interegular.fsm as fsm

    if fsm.crawl is not _crawl and list(inspect.signature(fsm.crawl).parameters) == ["alphabet", "initial", "final",
                                                                                     "follow"]:
        global _ORIGINAL_CRAWL
        _ORIGINAL_CRAWL, fsm.crawl = fsm.crawl, _crawl
    return interegular


_ORIGINAL_CRAWL = None  # (interegular's own, once replaced: the tests compare the two)


def _state_key(state):
    """A hashable key equal for equal states (interegular's states: frozensets, sets, dicts of ints;
    lists, should a caller of ``crawl`` use them)."""
    kind = type(state)
    if kind is dict:
        return frozenset(state.items())
    if kind is set:
        return frozenset(state)
    if kind is list:
        return ("(list)", *state)
    return state


def _crawl(alphabet, initial, final, follow):
    """interegular's ``crawl`` (the automaton of the states reachable from ``initial``: ``follow``
    (state, transition) gives the next state or raises OblivionError, ``final`` (state) whether it
    accepts), each new state numbered in the order it is found, found again by its key."""
    from interegular.fsm import FSM, OblivionError

    from .automaton import check_time

    states, number, finals, table = [initial], {_state_key(initial): 0}, set(), {}
    transitions = list(alphabet.by_transition)
    i = 0
    while i < len(states):
        if i % 256 == 0:
            check_time()  # (the build limit of path='auto')
        state = states[i]
        if final(state):
            finals.add(i)
        row = table[i] = {}
        for t in transitions:
            try:
                new = follow(state, t)
            except OblivionError:
                continue
            key = _state_key(new)
            j = number.get(key)
            if j is None:
                j = number[key] = len(states)
                states.append(new)
            row[t] = j
        i += 1
    return FSM(alphabet=alphabet, states=range(len(states)), initial=0, finals=finals, map=table,
               __no_validation__=True)


def char_fsm(pattern: str):
    """The ``interegular`` character automaton of ``pattern`` (Python ``re`` syntax); unsupported
    syntax raises SMCDecodeError."""
    import re

    from .automaton import TooSlow

    interegular = interegular_module()
    try:
        re.compile(pattern)
        _reject_unsupported(pattern)
        return interegular.parse_pattern(pattern).to_fsm()
    except TooSlow:
        raise
    except Exception as e:  # interegular raises several types for unsupported syntax
        raise SMCDecodeError(
            f"invalid or unsupported regex {pattern!r}: {type(e).__name__}: {e}. Use Python regex "
            "syntax without look-arounds or back-references"
        ) from None


def compile_fsm(fsm, model) -> TokenAutomaton:
    """The token automaton of a character FSM over ``model``'s vocabulary (raises ``TooLarge`` past
    ``automaton.MAX_STATES`` states)."""
    from . import automaton

    table, accepting, initial = byte_dfa(fsm)
    return token_automaton(table, accepting, initial, vocabulary_bytes(model), model.eos_token_id,
                           max_states=automaton.MAX_STATES)


def vocabulary_bytes(model) -> list[bytes | None]:
    """Each token's bytes (None: special): ``token_bytes.token_texts`` (checked against the model's
    decoding); without llguidance installed, the model's whole-text token strings (tokens that are
    part of a character are then never allowed)."""
    from .token_bytes import token_texts

    try:
        import llguidance  # noqa: F401
    except ImportError:
        return [None if s is None else s.encode("utf-8") for s in model.token_strings]
    return token_texts(model)


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
