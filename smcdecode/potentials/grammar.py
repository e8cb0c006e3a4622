"""Context-free grammar constraints (Lark or GBNF syntax), run by llguidance.

llguidance (guidance-ai, MIT) compiles a grammar against the model's tokenizer and computes, for a
parser state, the mask of tokens that keep the text a viable prefix of the language — at the byte
level, so every tokenisation of a valid text is allowed, not only the canonical one. It was chosen
over xgrammar and outlines-core after measuring all three (docs/constraints.md).

A particle's constraint state is an ``LLMatcher`` (a parser state held in Rust). A batch of particle
states is a :class:`MatcherBatch`; the tensor path of :class:`TokenConstraint` maps onto it as

    allowed_bits(state)   a [B, ⌈V/32⌉] int32 bitmask for all B particles, filled in the calling
                          thread or (threads >= 2) llguidance's pool (what the engine uploads)
    allowed(state)        that bitmask unpacked to bool [B, V] on the CPU
    advance(state, v [B]) each distinct matcher consumes its token in place; the old batch is spent
    fork(state, A [B])    a gather of references: children of one ancestor share its matcher

Rows share a matcher copy-on-write: rows that hold one object have the same tokens since the
ancestor they were forked from, hence the same parser state, key state and mask, so a mask is
computed and a token consumed once per distinct matcher (after a resampling, and where a peaked
model makes particles agree, many rows share one). ``advance`` copies a shared matcher
(``deep_copy``: a few µs, the compiled grammar and lexer caches are shared, only the parser stack
is copied) only where its rows' tokens differ.

NOTE: states are used linearly — ``advance`` and ``fork`` consume their input batch, and using a
spent batch again raises. Every strategy in ``samplers/`` threads states that way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import SMCDecodeError
from .automaton import auto_limit
from .constraint import TokenConstraint, unpack_bits
from .json_keys import START, KeyTracker
from .json_strings import START as SCAN_START
from .json_strings import StringMasks
from .matchers import MatcherBatch, _check_threads, _executor, advance_together, fill_bits_together
from .token_bytes import _llguidance, llguidance_tokenizer, sliced_tokenizer, token_texts

SYNTAXES = ("lark", "gbnf")
# how a constraint's masks are computed (Grammar, JSONSchema; JSONSchema also "superset")
PATHS = ("auto", "automaton", "llguidance")

class LLGuidanceConstraint(TokenConstraint):
    """Ψ(x) = 1[text(x) ∈ L(grammar)] for an llguidance grammar; the base of :class:`Grammar` and
    :class:`~smcdecode.potentials.json_schema.JSONSchema`. Subclasses set ``self._grammar`` (the
    llguidance grammar string) and ``self._what`` (how errors name the source) before ``_setup``."""

    _grammar: str
    _what: str
    unique_keys = False  # JSONSchema: forbid repeated object keys (json_keys.py)
    key_rule = False  # does the mask apply that rule (where the grammar itself lets a key repeat)?
    # how masks are computed: "llguidance" (parser masks on the host) or "automaton" (a token automaton
    # over token classes, stepped on the device by the engine: a regular language, see _use_automaton)
    path = "llguidance"
    path_reason = ""
    path_asked = "auto"  # (the ``path`` argument: with "auto", a token automaton too large to build falls back)
    automaton = None
    # the "superset" path (JSONSchema): llguidance's parser state as on the llguidance path, and a token
    # automaton of a superset of the documents, which the engine steps on the device as its proposal's
    # mask while the host checks each round's tokens with llguidance (backends/engine/host_masks.py)
    _superset_fsm = None
    superset_automaton = None
    # the character classes the grammar's patterns repeat: slices of llguidance's mask computation
    # (token_bytes.mask_slices; JSONSchema sets them from its patterns)
    _classes: tuple = ()
    # masks inside string values without llguidance's walk (json_strings.py; JSONSchema, where it has
    # strings): built when bound to a model
    _strings = None
    # past a complete document (matchers.py ``_stopped``): None, not known yet in this process; False,
    # llguidance's parser does not stop there; else the stopped parser's mask and end tokens
    _stop_mask = None
    # llguidance's masks by the particles' outlines (matchers.py ``_known_rows``): made when bound
    _outline_masks = None

    def _automaton_strings(self):
        """The schema whose string values take ``json_strings.StringMasks`` (None: every mask is llguidance's)."""
        return None

    def _validate(self) -> None:
        """Grammar errors that do not depend on the vocabulary, reported at construction (on either path)."""
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(self._grammar)
        if is_error:
            raise self._error(messages[0] if messages else "llguidance rejected it")

    def _setup(self, model, threads: int | None) -> None:
        _check_threads(threads)
        self.threads = threads
        self._keys: KeyTracker | None = None
        self._validate()
        self.model = None
        self._template = None
        self._executor = None
        if model is not None:
            self._compile(model)

    def _error(self, message: str) -> SMCDecodeError:
        message = message.strip()
        if "failed to compile JSON schema: " in message:
            # llguidance quotes the whole wrapped grammar after the reason: keep the reason
            message = message.split("failed to compile JSON schema: ", 1)[1]
            message = re.split(r"\n\s*1 \| ", message, maxsplit=1)[0]
            message = " ".join(line.strip() for line in message.splitlines() if line.strip())
        elif getattr(self, "_header_lines", 0):
            message = _without_header(message, self._header_lines)
        return SMCDecodeError(f"{self._what}: {message}")

    def bind(self, model) -> LLGuidanceConstraint:
        if self.model is model:
            return self
        bound = type(self).__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound._compile(model)
        return bound

    def _use_automaton(self, regex: str, fsm, threads: int | None, model) -> None:
        """Take the automaton path: ``regex`` is the language as a Python regex, ``fsm`` its character
        automaton (``regex.char_fsm``); the token automaton is built when bound to a model."""
        _check_threads(threads)
        self.regex, self._fsm, self.path = regex, fsm, "automaton"
        self.threads, self.model = threads, None
        if model is not None:
            self._compile(model)

    def _compile(self, model) -> None:
        from .automaton import TooLarge
        from .regex import compile_fsm

        if self.path == "automaton":
            try:
                with auto_limit(self.path_asked):
                    self.automaton = compile_fsm(self._fsm, model)
                self.model = model
                return
            except TooLarge as e:
                if self.path_asked != "auto":
                    raise SMCDecodeError(f"{e}: use path='llguidance' here") from None
                # (path='auto': llguidance's masks, as for a language with no automaton)
                self.path, self._fsm, self.regexes, self.regex, self.automaton = "llguidance", None, (), None, None
                self.path_reason = f"{e} over this vocabulary"
        llg = _llguidance()
        tok = sliced_tokenizer(model, self._classes)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self._grammar, tok)
        if is_error:
            raise self._error(messages[0] if messages else "llguidance rejected it")
        template = llg.LLMatcher(tok, self._grammar, log_level=0)
        if template.is_error() and self._classes and "repeating slices" in template.get_error():
            # (two slices that take the same tokens, e.g. of [a-zA-Z] and [A-Za-z], or of [^\x00] and a
            # JSON string's characters: llguidance refuses them; the string slices alone, as without patterns)
            self._classes = ()
            tok = sliced_tokenizer(model, ())
            template = llg.LLMatcher(tok, self._grammar, log_level=0)
        if template.is_error():
            raise self._error(template.get_error())
        if self._superset_fsm is not None:  # (None with superset_automaton set: compiled for this vocabulary)
            try:
                with auto_limit(self.path_asked):
                    self.superset_automaton = compile_fsm(self._superset_fsm, model)
            except TooLarge as e:
                if self.path_asked != "auto":
                    raise SMCDecodeError(f"{e}: use path='llguidance' here") from None
                self.path, self._superset_fsm, self.superset_automaton = "llguidance", None, None
                self.superset_regex, self.superset_widens = None, ()
                self.path_reason = f"{self.path_reason}; the superset's {e} over this vocabulary: llguidance's masks"
        self._template = template
        self._tok, self._lanes = tok, [template]
        self._base_tok = llguidance_tokenizer(model)  # (without the slices: what mask workers inherit)
        self._executor = _executor(self.threads)
        self._keys = KeyTracker(token_texts(model, tok)) if self.key_rule else None
        self.model = model
        self._words = (model.vocab_size + 31) // 32
        strings = self._automaton_strings()
        self._strings = None if strings is None else \
            StringMasks.of(strings, token_texts(model, tok), self._words, self._grammar)
        self._stop_mask = None  # (learned anew for this model's vocabulary: matchers._stopped)
        self._outline_masks = {}

    def worker_spec(self) -> tuple:
        """What a mask worker process needs to rebuild this constraint's llguidance path
        (backends/engine/mask_process.py): picklable and hashable."""
        strings = None if self._strings is None else json.dumps(self._strings.root)
        return type(self), self._grammar, bool(self.key_rule), self._classes, strings

    # -- tensor path -----------------------------------------------------------------------
    @property
    def token_automaton(self):
        """The compiled token automaton on the automaton path (None on the llguidance path)."""
        self._require_model()
        return self.automaton

    def start(self, batch: int, lane: int = 0) -> MatcherBatch | Tensor:
        """``lane``: which compile of the grammar the batch's first matcher comes from (``_lane``), row
        j's from lane + j: rows whose masks are filled together (the engine's requests: ``lane`` = slot
        × rows) take different lanes."""
        self._require_model()
        if self.path == "automaton":
            return torch.full((batch,), self.automaton.initial, dtype=torch.long)
        keys = [START] * batch if self._keys is not None else None
        scans = [SCAN_START] * batch if self._strings is not None else None
        self._lane(lane)  # (refuses a lane that is not a whole number >= 0)
        return MatcherBatch([self._lane(lane + j).deep_copy() for j in range(batch)], keys, scans)

    def _lane(self, lane: int):
        """The template matcher of ``lane``. The matchers copied from one compiled grammar share its
        lexer, behind a lock, so llguidance's thread pool fills their masks one after the other; a
        lane is a compile of its own (made when first asked for, about 0.2 ms), and the pool fills
        the masks of different lanes in parallel (8 rows on a 16-core host: 2.2x faster than from
        one lane). One lane per thread of the pool: ``lane`` is taken modulo it; without a pool
        (``threads`` None or 1) every row takes lane 0. (A matcher copied at a resampling stays in
        its ancestor's lane.)"""
        if isinstance(lane, bool) or not isinstance(lane, int) or lane < 0:
            raise SMCDecodeError(f"lane must be an integer >= 0, got {lane!r}")
        i = lane % (self.threads or 1)
        while len(self._lanes) <= i:
            m = _llguidance().LLMatcher(self._tok, self._grammar, log_level=0)
            if m.is_error():  # (the same grammar compiled once already: not expected)
                raise self._error(m.get_error())
            self._lanes.append(m)
        return self._lanes[i]

    def allowed_bits(self, state: MatcherBatch) -> Tensor:
        if self.path == "automaton":
            return TokenConstraint.allowed_bits(self, state)
        state.check()
        if state.bits is None:
            bits = torch.empty(len(state), self._words, dtype=torch.int32)
            self.fill_bits(state, bits)
            state.bits = bits
        return state.bits

    @property
    def shares_fill(self) -> bool:
        """Can fill_bits_together fill this constraint's rows with other constraints' rows?"""
        return self.path != "automaton"

    def fill_bits(self, state: MatcherBatch, out: Tensor) -> None:
        """Write ``allowed_bits(state)`` into ``out`` (int32 [B, ⌈V/32⌉], contiguous rows on the CPU,
        e.g. a view of a pinned upload buffer): one call into llguidance's thread pool for all B."""
        if self.path == "automaton":
            out.copy_(TokenConstraint.allowed_bits(self, state))
            return
        fill_bits_together([(self, state, 0)], out, len(state))

    def allowed(self, state: MatcherBatch) -> Tensor:
        if self.path == "automaton":
            return self.automaton.allowed(state.cpu()).to(state.device)
        state.check()
        if state.mask is None:
            state.mask = unpack_bits(self.allowed_bits(state), self.model.vocab_size)
        return state.mask

    def advance(self, state: MatcherBatch, tokens: Tensor) -> MatcherBatch:
        if self.path == "automaton":
            return self.automaton.advance(state.cpu(), tokens.cpu()).to(state.device)
        return advance_together([(self, state, tokens.tolist())])[0]

    def accepting(self, state: MatcherBatch) -> Tensor:
        if self.path == "automaton":
            return self.automaton.accepting[state.cpu()].to(state.device)
        state.check()
        first, rest, src = state.distinct()
        ok = [False] * len(state)
        for i in first:
            ok[i] = state.matchers[i].is_accepting() and not state.dead(i)
        for i, j in zip(rest, src):
            ok[i] = ok[j]
        return torch.tensor(ok, dtype=torch.bool)

    def fork(self, state: MatcherBatch, index: Tensor) -> MatcherBatch:
        if self.path == "automaton":
            return TokenConstraint.fork(self, state, index)
        matchers = state.take()
        index_list = index.tolist()
        forked = MatcherBatch([matchers[a] for a in index_list],
                              None if state.keys is None else [state.keys[a] for a in index_list],
                              None if state.scans is None else [state.scans[a] for a in index_list])
        if state.mask is not None:
            forked.mask = state.mask[index.to(state.mask.device)]
        if state.bits is not None:
            forked.bits = state.bits[index]
        return forked

    # -- the scalar path: replay with llguidance's own token check (independent of the masks) --
    def _replay(self, seqs: Sequence[Sequence[int]]) -> MatcherBatch:
        """States after each token sequence; a sequence that leaves the language gives a dead
        (error-state) matcher."""
        eos = self._require_model().eos_token_id
        matchers, keys = [], []
        for s in seqs:
            s = [int(t) for t in s]
            if eos in s:
                raise SMCDecodeError("tokens passed to a potential must not contain EOS: use complete()")
            m = self._template.deep_copy()
            if s:
                m.consume_tokens(s)
            matchers.append(m)
            if self._keys is not None:
                keys.append(self._keys.replay(s))
        return MatcherBatch(matchers, keys if self._keys is not None else None)

    def prefix(self, tokens, prompt=()):
        if self.path == "automaton":
            return TokenConstraint.prefix(self, tokens, prompt)
        return float("-inf") if self._replay([tokens]).dead(0) else 0.0

    def complete(self, tokens, prompt=()):
        if self.path == "automaton":
            return TokenConstraint.complete(self, tokens, prompt)
        state = self._replay([tokens])
        return 0.0 if state.matchers[0].is_accepting() and not state.dead(0) else float("-inf")

    def logw_next(self, tokens, prompt=()):
        if self.path == "automaton":
            return TokenConstraint.logw_next(self, tokens, prompt)
        return self.batch_logw_next([tokens], prompt)[0]

    def batch_logw_next(self, seqs, prompt=()):
        if not len(seqs):
            return torch.empty(0, self._require_model().vocab_size, dtype=torch.float64)
        if self.path == "automaton":
            return torch.stack([self.logw_next(s, prompt) for s in seqs])
        mask = self.allowed(self._replay(seqs))
        return torch.where(mask, 0.0, float("-inf")).double()

    def satisfiable(self) -> bool:
        """Automaton path: exact. llguidance: a necessary condition, some first token is allowed
        (llguidance only allows tokens that keep a viable prefix, so for grammars without resource
        limits this is also sufficient)."""
        if self.path == "automaton":
            return self.token_automaton.satisfiable()
        return bool(self.allowed(self.start(1)).any())

    def matches(self, text: str) -> bool:
        """Does ``text`` (as the model would tokenise it) belong to the language?"""
        model = self._require_model()
        state = self.start(1)
        for t in model.encode(text):
            if not bool(self.allowed(state)[0, t]):
                return False
            state = self.advance(state, torch.tensor([t]))
        return bool(self.accepting(state)[0])


class Grammar(LLGuidanceConstraint):
    """Ψ(x) = 1[text(x) ∈ L(G)] for a context-free grammar G.

    ``syntax="lark"`` (default): llguidance's Lark dialect — rules in lower case, terminals in
    upper case, ``/regex/`` terminals, ``%import common.NUMBER``, ``%ignore``; the start rule is
    ``start``. ``syntax="gbnf"``: llama.cpp's GBNF/EBNF (``root ::= ...``), converted to Lark.

        Grammar('''
            start: expr
            expr: term (("+" | "-") term)*
            term: NUMBER | "(" expr ")"
            %import common.NUMBER
        ''')

    An invalid grammar raises :class:`SMCDecodeError` quoting llguidance's message (line, column,
    the offending rule). ``threads``: None or 1 (the default): masks filled in the calling thread; n >= 2:
    llguidance's thread pool of n threads, the particles spread over n lanes.

    ``force_canonical=False`` (default): every tokenisation of a text in the language is allowed,
    so Ψ depends on the text alone (as for :class:`~smcdecode.potentials.regex.Regex`) and SMC
    targets p(x | text(x) ∈ L). ``True`` turns on llguidance's fast-forward rule: text that the
    grammar forces (a fixed key, a closing quote) must be taken as the tokenizer's canonical
    tokens; the allowed set then also depends on the tokenisation.

    ``path``: how masks are computed. "automaton": a grammar whose language is regular (no
    recursion through a rule, other than the left- or right-end repetition lark makes of ``*`` and
    ``+``; see ``grammar_regex.py`` for the conditions) becomes one regular expression and a token
    automaton with token classes, which the engine steps on the device inside its captured round, as
    a :class:`~smcdecode.potentials.regex.Regex`; a grammar it cannot take raises
    :class:`~smcdecode.potentials.grammar_regex.NotRegular` saying why. "llguidance": llguidance's
    parser masks (any grammar). "auto" (default): the automaton where the grammar has one,
    llguidance otherwise. ``self.path`` says which was chosen and ``self.path_reason`` why.
    """

    def __init__(
        self,
        grammar: str,
        syntax: str = "lark",
        *,
        force_canonical: bool = False,
        path: str = "auto",
        model=None,
        threads: int | None = None,
    ):
        if path not in PATHS:
            raise SMCDecodeError(f"path must be one of {PATHS}, got {path!r}")
        if not isinstance(grammar, str) or not grammar.strip():
            raise SMCDecodeError(f"grammar must be a non-empty string in {syntax} syntax, got {grammar!r}")
        if syntax not in SYNTAXES:
            raise SMCDecodeError(f"grammar syntax must be one of {SYNTAXES}, got {syntax!r}")
        llg = _llguidance()
        self.source = grammar
        self.syntax = syntax
        lark = grammar
        if syntax == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(grammar)
            except Exception as e:  # noqa: BLE001 - the converter raises several types
                raise SMCDecodeError(f"invalid GBNF grammar: {type(e).__name__}: {e}") from None
        self._what = f"invalid {syntax} grammar"
        self.force_canonical = bool(force_canonical)
        header = lark_header(self.force_canonical)
        self._header_lines = header.count("\n") if syntax == "lark" else 0  # (GBNF: lines of the converted text)
        self._grammar = llg.LLMatcher.grammar_from_lark(header + lark)
        self._validate()
        self.path_asked = path
        with auto_limit(path):
            regex, fsm, self.path_reason = self._choose_path(path, lark)
        if regex is not None:
            self._use_automaton(regex, fsm, threads, model)
            return
        self._setup(model, threads)

    def _choose_path(self, path: str, lark: str) -> tuple[str | None, object, str]:
        """(the language as a regex and its character automaton for the automaton path, or None, None
        for llguidance; why)."""
        from .grammar_regex import NotRegular, grammar_regex
        from .regex import char_fsm

        if path == "llguidance":
            return None, None, "asked for (path='llguidance')"
        try:
            if self.force_canonical:
                raise NotRegular("canonical tokenisation (force_canonical) is llguidance's rule")
            regex = grammar_regex(lark)
            fsm = char_fsm(regex)
        except SMCDecodeError as e:
            if path == "automaton":
                raise NotRegular(f"this grammar has no token automaton: {e}; use path='auto' or "
                                 "path='llguidance'") from None
            return None, None, str(e)
        return regex, fsm, "the grammar's language is regular"

    def __repr__(self) -> str:
        first = self.source.strip().splitlines()[0]
        return f"Grammar({first[:40]!r}{'...' if len(self.source.strip()) > len(first) else ''})"


def lark_header(force_canonical: bool) -> str:
    """The llguidance options line that starts every grammar we compile."""
    return "" if force_canonical else '%llguidance {"no_forcing": true}\n'


def _without_header(message: str, lines: int) -> str:
    """llguidance's message about header + the user's grammar, in the user's line numbers: "L(C):"
    and the quoted "  L | text" lines shifted back by the header's ``lines``, the header's own
    quoted lines dropped."""
    message = re.sub(r"\b(\d+)\((\d+)\)(?=:)", lambda m: f"{max(1, int(m[1]) - lines)}({m[2]})", message)
    out = []
    for line in message.splitlines():
        quoted = re.match(r"(\s*)(\d+)( \|.*)", line)
        if quoted:
            number = int(quoted[2]) - lines
            if number < 1:
                continue
            line = f"{quoted[1]}{str(number).rjust(len(quoted[2]))}{quoted[3]}"
        out.append(line)
    return "\n".join(out)


def grammar_of_regex(pattern: str) -> str:
    """An llguidance grammar string for a regular expression (used by tests and benchmarks to run a
    regex through llguidance; the :class:`~smcdecode.potentials.regex.Regex` potential uses an
    integer token DFA instead)."""
    return _llguidance().LLMatcher.grammar_from_regex(pattern)
