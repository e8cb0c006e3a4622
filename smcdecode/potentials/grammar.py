"""Context-free grammar constraints (Lark or GBNF syntax), run by llguidance.

llguidance (guidance-ai, MIT) compiles a grammar against the model's tokenizer and computes, for a
parser state, the mask of tokens that keep the text a viable prefix of the language — at the byte
level, so every tokenisation of a valid text is allowed, not only the canonical one. It was chosen
over xgrammar and outlines-core after measuring all three (docs/constraints.md).

A particle's constraint state is an ``LLMatcher`` (a parser state held in Rust). A batch of particle
states is a :class:`MatcherBatch`; the tensor path of :class:`TokenConstraint` maps onto it as

    allowed(state)        one call into llguidance's thread pool fills a [B, ⌈V/32⌉] int32 bitmask
                          for all B particles; it is unpacked to bool [B, V] on the CPU
    advance(state, v [B]) each matcher consumes its token in place; the old batch is spent
    fork(state, A [B])    copy-on-write gather: the first child of an ancestor takes its matcher,
                          further children get ``deep_copy`` (a few µs: the compiled grammar and
                          lexer caches are shared, only the parser stack is copied)

NOTE: states are used linearly — ``advance`` and ``fork`` consume their input batch, and using a
spent batch again raises. Every strategy in ``samplers/`` threads states that way.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import SMCDecodeError
from .constraint import TokenConstraint

SYNTAXES = ("lark", "gbnf")


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - exercised only without the dependency
        raise SMCDecodeError(
            "grammar and JSON Schema constraints run on llguidance, which is not installed: "
            "run `pip install llguidance`"
        ) from None
    return llguidance


# -- tokenizers --------------------------------------------------------------------------------

# NOTE: building an llguidance tokenizer for a 49k vocabulary takes ~0.3 s, so it is cached per
# model object (weakly: the entry goes when the model does).
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _VocabTokenizer:
    """The duck-typed tokenizer ``llguidance.TokenizerWrapper`` expects, built from a
    :class:`~smcdecode.models.Model`'s token strings (models without a fast HF tokenizer)."""

    def __init__(self, model):
        self._model = model
        strings = model.token_strings
        self.eos_token_id = model.eos_token_id
        self.bos_token_id = None
        # tokens that are not plain text can never be produced by a grammar over text
        self.special_token_ids = [i for i, s in enumerate(strings) if s is None]
        self.tokens = [f"<|special_{i}|>".encode() if s is None else s.encode("utf-8") for i, s in enumerate(strings)]

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._model.encode(text)


def llguidance_tokenizer(model):
    """The llguidance tokenizer of ``model`` (cached): from its fast HF tokenizer when it has one
    (byte-exact), else from its token strings."""
    try:
        return _TOKENIZERS[model]
    except (KeyError, TypeError):  # not built yet, or a model that cannot be a weak key: build it
        pass
    llg = _llguidance()
    tok = None
    hf_tok = getattr(model, "tokenizer", None)
    if hf_tok is not None and hasattr(hf_tok, "backend_tokenizer"):
        import llguidance.hf

        try:
            tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=model.vocab_size, eos_token=model.eos_token_id)
        except Exception:  # noqa: BLE001 - fall back to the token strings below
            tok = None
    if tok is None:
        tok = llg.LLTokenizer(
            llg.TokenizerWrapper(_VocabTokenizer(model)), n_vocab=model.vocab_size, eos_token=model.eos_token_id
        )
    try:
        _TOKENIZERS[model] = tok
    except TypeError:  # pragma: no cover - a model that cannot be weakly referenced
        pass
    return tok


# -- particle states ---------------------------------------------------------------------------


class MatcherBatch:
    """Constraint states of B particles: one llguidance matcher per particle."""

    __slots__ = ("matchers", "mask", "spent")

    def __init__(self, matchers: list):
        self.matchers = matchers
        self.mask: Tensor | None = None  # cached allowed() of this batch, bool [B, V]
        self.spent = False

    def __len__(self) -> int:
        return len(self.matchers)

    def take(self) -> list:
        """The matchers, marking this batch spent (its states are about to change)."""
        self.check()
        self.spent = True
        return self.matchers

    def check(self) -> None:
        if self.spent:
            raise SMCDecodeError(
                "a grammar constraint state was used after it was advanced or forked: constraint states "
                "are consumed by advance()/fork(); keep the returned state instead"
            )


class LLGuidanceConstraint(TokenConstraint):
    """Ψ(x) = 1[text(x) ∈ L(grammar)] for an llguidance grammar; the base of :class:`Grammar` and
    :class:`~smcdecode.potentials.json_schema.JSONSchema`. Subclasses set ``self._grammar`` (the
    llguidance grammar string) and ``self._what`` (how errors name the source) before ``_setup``."""

    _grammar: str
    _what: str

    def _setup(self, model, threads: int | None) -> None:
        llg = _llguidance()
        self.threads = threads
        # grammar errors that do not depend on the vocabulary are reported at construction
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self._grammar)
        if is_error:
            raise self._error(messages[0] if messages else "llguidance rejected it")
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
        return SMCDecodeError(f"{self._what}: {message}")

    def bind(self, model) -> LLGuidanceConstraint:
        if self.model is model:
            return self
        bound = type(self).__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound._compile(model)
        return bound

    def _compile(self, model) -> None:
        llg = _llguidance()
        tok = llguidance_tokenizer(model)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self._grammar, tok)
        if is_error:
            raise self._error(messages[0] if messages else "llguidance rejected it")
        template = llg.LLMatcher(tok, self._grammar, log_level=0)
        if template.is_error():
            raise self._error(template.get_error())
        self._template = template
        self._executor = llg.LLExecutor(self.threads) if self.threads else llg.LLExecutor()
        self.model = model
        self._words = (model.vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)

    # -- tensor path -----------------------------------------------------------------------
    def start(self, batch: int) -> MatcherBatch:
        self._require_model()
        return MatcherBatch([self._template.deep_copy() for _ in range(batch)])

    def allowed(self, state: MatcherBatch) -> Tensor:
        state.check()
        if state.mask is None:
            B = len(state)
            bitmask = torch.zeros(B, self._words, dtype=torch.int32)
            # NOTE: what llguidance.torch.fill_next_token_bitmask_par does, without importing that
            # module (it applies torch.compile at import, which costs seconds)
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(state.matchers)], bitmask.data_ptr(), self._words * 4, B
            )
            for i, m in enumerate(state.matchers):
                if m.is_error():  # a dead particle: llguidance would still allow EOS
                    bitmask[i] = 0
            # bitmask: [B, W] int32 -> bits [B, W, 32] -> [B, V]
            bits = (bitmask[:, :, None] >> self._bits) & 1
            state.mask = bits.view(B, -1)[:, : self.model.vocab_size].bool()
        return state.mask

    def advance(self, state: MatcherBatch, tokens: Tensor) -> MatcherBatch:
        matchers = state.take()
        for m, t in zip(matchers, tokens.tolist()):
            m.consume_token(t)  # a disallowed token puts the matcher in its (absorbing) error state
        return MatcherBatch(matchers)

    def accepting(self, state: MatcherBatch) -> Tensor:
        state.check()
        return torch.tensor([m.is_accepting() and not m.is_error() for m in state.matchers], dtype=torch.bool)

    def fork(self, state: MatcherBatch, index: Tensor) -> MatcherBatch:
        matchers = state.take()
        taken = [False] * len(matchers)
        out = []
        for a in index.tolist():
            if taken[a]:
                out.append(matchers[a].deep_copy())
            else:
                taken[a] = True
                out.append(matchers[a])
        forked = MatcherBatch(out)
        if state.mask is not None:
            forked.mask = state.mask[index.to(state.mask.device)]
        return forked

    # -- the scalar path: replay with llguidance's own token check (independent of the masks) --
    def _replay(self, seqs: Sequence[Sequence[int]]) -> MatcherBatch:
        """States after each token sequence; a sequence that leaves the language gives a dead
        (error-state) matcher."""
        eos = self._require_model().eos_token_id
        matchers = []
        for s in seqs:
            s = [int(t) for t in s]
            if eos in s:
                raise SMCDecodeError("tokens passed to a potential must not contain EOS: use complete()")
            m = self._template.deep_copy()
            if s:
                m.consume_tokens(s)
            matchers.append(m)
        return MatcherBatch(matchers)

    def prefix(self, tokens, prompt=()):
        m = self._replay([tokens]).matchers[0]
        return float("-inf") if m.is_error() else 0.0

    def complete(self, tokens, prompt=()):
        m = self._replay([tokens]).matchers[0]
        return 0.0 if m.is_accepting() and not m.is_error() else float("-inf")

    def logw_next(self, tokens, prompt=()):
        return self.batch_logw_next([tokens], prompt)[0]

    def batch_logw_next(self, seqs, prompt=()):
        if not len(seqs):
            return torch.empty(0, self._require_model().vocab_size, dtype=torch.float64)
        mask = self.allowed(self._replay(seqs))
        return torch.where(mask, 0.0, float("-inf")).double()

    def satisfiable(self) -> bool:
        """A necessary condition: some first token is allowed (llguidance only allows tokens that
        keep a viable prefix, so for grammars without resource limits this is also sufficient)."""
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
    the offending rule). ``threads``: llguidance mask threads (None: its default).

    ``force_canonical=False`` (default): every tokenisation of a text in the language is allowed,
    so Ψ depends on the text alone (as for :class:`~smcdecode.potentials.regex.Regex`) and SMC
    targets p(x | text(x) ∈ L). ``True`` turns on llguidance's fast-forward rule: text that the
    grammar forces (a fixed key, a closing quote) must be taken as the tokenizer's canonical
    tokens; the allowed set then also depends on the tokenisation.
    """

    def __init__(
        self,
        grammar: str,
        syntax: str = "lark",
        *,
        force_canonical: bool = False,
        model=None,
        threads: int | None = None,
    ):
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
        self._grammar = llg.LLMatcher.grammar_from_lark(lark_header(self.force_canonical) + lark)
        self._setup(model, threads)

    def __repr__(self) -> str:
        first = self.source.strip().splitlines()[0]
        return f"Grammar({first[:40]!r}{'...' if len(self.source.strip()) > len(first) else ''})"


def lark_header(force_canonical: bool) -> str:
    """The llguidance options line that starts every grammar we compile."""
    return "" if force_canonical else '%llguidance {"no_forcing": true}\n'


def grammar_of_regex(pattern: str) -> str:
    """An llguidance grammar string for a regular expression (used by tests and benchmarks to run a
    regex through llguidance; the :class:`~smcdecode.potentials.regex.Regex` potential uses an
    integer token DFA instead)."""
    return _llguidance().LLMatcher.grammar_from_regex(pattern)
