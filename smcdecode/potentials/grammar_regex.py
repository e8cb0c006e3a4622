"""A Lark grammar whose language is regular, as one regular expression: the device path of ``Grammar``.

The grammar is read by ``lark`` (its rules after EBNF expansion, and each terminal as a Python regex).
Rules are inlined from ``start``; a rule that refers to itself only at the left end of its
alternatives (``x: x a | b``, what lark makes of ``b a*``) or only at the right end (``x: a x | b``)
becomes a repetition; any other recursion, direct or through other rules, is not regular and raises
:class:`NotRegular`.

NOTE: llguidance lexes greedily — a terminal takes every character it can before the next one starts
— so its language can be smaller than the concatenation of its terminals (``start: A B``, ``A: /a+/``,
``B: "a"`` accepts nothing there). The regex is only given where the two agree: at every lexeme
boundary of the grammar (a state of the automaton over terminals), no character that can start a
terminal allowed next can also continue a terminal in progress there. Then the next character always
says whether a lexeme ends, and greedy lexing, any other lexing, and the regex accept the same texts.
Grammars with ``%ignore``, ``%import`` or llguidance's own extensions (``%json``, special tokens,
lexeme options, ``&``/``~``), terminals that match the empty string, and Unicode classes (``\\d``,
``\\w``, ``\\s``: Rust's and Python's differ) keep llguidance.
"""

from __future__ import annotations

import re

from ..errors import SMCDecodeError

# characters that stand for terminals in the regex over terminals (Unicode private use area)
_PLACEHOLDER = 0xE000
_UNICODE_CLASSES = re.compile(r"(?<!\\)(\\\\)*\\[dwsDWSbB]")
_DIRECTIVES = re.compile(r"^\s*%(\w+)", re.MULTILINE)


class NotRegular(SMCDecodeError):
    """The grammar has no regular-expression form the device path can take (the reason says why)."""


def grammar_regex(text: str) -> str:
    """A Python regex for the language of the Lark grammar ``text`` (start rule ``start``), where
    the grammar is regular and llguidance's greedy lexing gives the same language; else NotRegular."""
    import lark

    directive = _DIRECTIVES.search(text)
    if directive:
        raise NotRegular(f"%{directive.group(1)} (the device path takes plain rules and terminals)")
    try:
        parsed = lark.Lark(text, start="start", parser="earley", lexer="dynamic")
    except Exception as e:  # noqa: BLE001 - llguidance's dialect (%json, <special>, [lazy], &, ~, ...)
        raise NotRegular(f"lark cannot read it ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    terminals = {t.name: t.pattern.to_regexp() for t in parsed.terminals}
    rules: dict[str, list[list[tuple[bool, str]]]] = {}
    for r in parsed.rules:
        rules.setdefault(r.origin.name, []).append([(s.is_term, s.name) for s in r.expansion])
    used = sorted(_terminals_used(rules))
    places = {name: chr(_PLACEHOLDER + i) for i, name in enumerate(used)}
    fsms = {name: _terminal_fsm(name, terminals[name]) for name in used}
    over_terminals = _Inliner(rules, places).regex("start")
    _check_lexing(over_terminals, {places[n]: fsms[n] for n in used}, {places[n]: n for n in used})
    return "".join(f"(?:{terminals[used[ord(c) - _PLACEHOLDER]]})"
                   if _PLACEHOLDER <= ord(c) < _PLACEHOLDER + len(used) else c for c in over_terminals)


def _terminals_used(rules: dict) -> set:
    return {name for alts in rules.values() for alt in alts for is_term, name in alt if is_term}


def _terminal_fsm(name: str, pattern: str):
    from .regex import char_fsm

    if _UNICODE_CLASSES.search(pattern):
        raise NotRegular(f"terminal {name} uses \\d, \\w, \\s or \\b, whose meaning differs between llguidance's "
                         "Rust regexes and Python's: spell the characters out ([0-9], [a-zA-Z_], ...)")
    try:
        fsm = char_fsm(pattern)
    except SMCDecodeError as e:
        raise NotRegular(f"terminal {name}: {e}") from None
    if fsm.accepts(""):
        raise NotRegular(f"terminal {name} matches the empty string")
    return fsm


class _Inliner:
    """Rules inlined into one regex over terminal placeholders."""

    def __init__(self, rules: dict, places: dict):
        self.rules, self.places, self.stack, self.done = rules, places, [], {}

    def regex(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if name in self.stack:
            path = " -> ".join(self.stack[self.stack.index(name):] + [name])
            raise NotRegular(f"recursion through rules ({path})")
        if name not in self.rules:
            raise NotRegular(f"rule {name} has no definition")
        self.stack.append(name)
        alts = self.rules[name]
        own = [a for a in alts if (False, name) in a]
        base = [self.sequence(a) for a in alts if (False, name) not in a]
        if not own:
            out = _alternation(base)
        elif all(a[0] == (False, name) and (False, name) not in a[1:] for a in own) and base:
            out = f"(?:{_alternation(base)})(?:{_alternation([self.sequence(a[1:]) for a in own])})*"
        elif all(a[-1] == (False, name) and (False, name) not in a[:-1] for a in own) and base:
            out = f"(?:{_alternation([self.sequence(a[:-1]) for a in own])})*(?:{_alternation(base)})"
        else:
            raise NotRegular(f"rule {name} refers to itself other than at the left or right end of its alternatives")
        self.stack.pop()
        self.done[name] = out
        return out

    def sequence(self, symbols: list) -> str:
        return "".join(re.escape(self.places[n]) if is_term else f"(?:{self.regex(n)})" for is_term, n in symbols)


def _alternation(parts: list[str]) -> str:
    return "|".join(f"(?:{p})" for p in parts)


# -- sets of characters: finite, or everything but a finite set ---------------------------------------


class _Chars:
    __slots__ = ("chars", "co")

    def __init__(self, chars=frozenset(), co: bool = False):
        self.chars, self.co = frozenset(chars), co

    def __or__(self, other: _Chars) -> _Chars:
        if self.co and other.co:
            return _Chars(self.chars & other.chars, True)
        if self.co or other.co:
            co, fin = (self, other) if self.co else (other, self)
            return _Chars(co.chars - fin.chars, True)
        return _Chars(self.chars | other.chars)

    def meets(self, other: _Chars) -> bool:
        if self.co and other.co:
            return True
        if self.co or other.co:
            co, fin = (self, other) if self.co else (other, self)
            return bool(fin.chars - co.chars)
        return bool(self.chars & other.chars)


def _symbol_chars(fsm) -> dict:
    """Each transition symbol of an interegular FSM as a _Chars."""
    from interegular.fsm import anything_else

    explicit = {c for c in fsm.alphabet._symbol_mapping if c is not anything_else}
    out = {}
    for sym, chars in fsm.alphabet.by_transition.items():
        named = {c for c in chars if c is not anything_else}
        out[sym] = _Chars(explicit - named, True) if anything_else in chars else _Chars(named)
    return out


def _live(fsm) -> set:
    """States from which a final state can be reached."""
    live, changed = set(fsm.finals), True
    while changed:
        changed = False
        for s, moves in fsm.map.items():
            if s not in live and any(t in live for t in moves.values()):
                live.add(s)
                changed = True
    return live


def _first(fsm) -> _Chars:
    """Characters that can start a match."""
    chars, live = _symbol_chars(fsm), _live(fsm)
    first = _Chars()
    for sym, t in fsm.map.get(fsm.initial, {}).items():
        if t in live:
            first = first | chars[sym]
    return first


def _continues(done, going) -> _Chars:
    """Characters c with u·c a viable prefix of ``going`` for some non-empty u that ``done`` matches
    and that is a viable prefix of ``going`` (a search over pairs of states, by character)."""
    from interegular.fsm import anything_else

    live_done, live_going = _live(done), _live(going)
    explicit = {c for f in (done, going) for c in f.alphabet._symbol_mapping if c is not anything_else}
    other = next(chr(c) for c in range(0xF0000, 0x10FFFF) if chr(c) not in explicit)  # stands for the rest

    def step(fsm, live, state, c):
        t = fsm.map.get(state, {}).get(fsm.alphabet[c])
        return t if t in live else None

    out, seen, todo = _Chars(), set(), [(done.initial, going.initial, 0)]
    while todo:
        a, b, n = todo.pop()
        if (a, b, n) in seen:
            continue
        seen.add((a, b, n))
        for c in (*explicit, other):
            tb = step(going, live_going, b, c)
            if tb is None:
                continue
            if n and a in done.finals:  # u (non-empty) is a match of `done`, and u·c stays viable in `going`
                out = out | (_Chars({c}) if c != other else _Chars(explicit, True))
            ta = step(done, live_done, a, c)
            if ta is not None:
                todo.append((ta, tb, 1))
    return out


def _check_lexing(over_terminals: str, fsms: dict, names: dict) -> None:
    """At each state of the automaton over terminals (a lexeme boundary), when an allowed terminal has
    matched, the characters that can start a terminal allowed next must not continue any allowed
    terminal that the same text leaves in progress."""
    from .regex import interegular_module

    top = interegular_module().parse_pattern(over_terminals).to_fsm()
    live = _live(top)
    if top.initial not in live:
        raise NotRegular("the grammar accepts no text")
    symbols = {sym: [c for c in cs if c in fsms] for sym, cs in top.alphabet.by_transition.items()}
    first = {p: _first(f) for p, f in fsms.items()}
    continues: dict = {}

    def allowed(state) -> list[tuple[str, object]]:
        return [(p, t) for sym, t in top.map.get(state, {}).items() if t in live for p in symbols[sym]]

    for state in live:
        here = allowed(state)
        for p, after in here:
            cont = _Chars()
            for q, _ in here:
                if (p, q) not in continues:
                    continues[p, q] = _continues(fsms[p], fsms[q])
                cont = cont | continues[p, q]
            for q, _ in allowed(after):
                if first[q].meets(cont):
                    raise NotRegular(
                        f"terminal {names[q]} can start with a character that continues a terminal in progress "
                        f"after {names[p]}: llguidance lexes greedily, so the grammar's language is not the "
                        "regex's")
