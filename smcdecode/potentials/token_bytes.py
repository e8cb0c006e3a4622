"""The bridge from a model's vocabulary to llguidance: the exact bytes of every token.

llguidance computes masks over token *bytes*, so its tokenizer must give each token the bytes the
model's own decoding gives it; otherwise the grammar and the text disagree (a space that is no
token's byte, say) and constrained generation stalls or admits text the schema forbids.

For a fast Hugging Face tokenizer, llguidance can read the tokenizer's JSON itself, but it infers
the byte mapping from the shape of the decoder, and that shape depends on the transformers
version that built the tokenizer: a GGUF converted by transformers 5.17 gets the decoder
``Sequence[ByteFallback, Fuse, Replace(▁), ByteLevel]``, which llguidance reads as a SentencePiece
vocabulary, so byte-level pieces such as ``Ġ"`` (space, quote) become the literal text "Ġ\"".
Nothing therefore trusts one construction: each candidate is checked against the model's own
decoding of every token (:func:`check_token_bytes`), and the first that agrees is used:

1. llguidance's reader of the HF tokenizer JSON (byte-exact when it reads the layout right);
2. the bytes computed here from the vocabulary pieces: the GPT-2 byte-to-unicode table when any
   part of the tokenizer is ``ByteLevel``, else ``<0xNN>`` byte-fallback pieces and ``▁`` spaces;
3. the model's token strings alone: tokens that are not whole UTF-8 text (a character split over
   several byte tokens) are then never allowed — sound, but such characters must come as whole
   tokens.
"""

from __future__ import annotations

import json
import re
import weakref

from ..errors import SMCDecodeError

# NOTE: building an llguidance tokenizer for a 49k vocabulary takes ~0.3 s and checking it ~0.2 s,
# so it is cached per model object (weakly: the entry goes when the model does).
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_NEVER_UTF8 = re.compile(rb"[\xc0\xc1\xf5-\xff]")


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - exercised only without the dependency
        raise SMCDecodeError(
            "grammar and JSON Schema constraints run on llguidance, which is not installed: "
            "run `pip install llguidance`"
        ) from None
    return llguidance


def byte_level_alphabet() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table: the printable character that stands for each
    byte in a byte-level BPE vocabulary (``Ġ`` for a space, ``Ċ`` for a newline)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _components(spec, kind: str) -> bool:
    """Does the tokenizer-JSON component ``spec`` (possibly a Sequence) contain a part of ``kind``?"""
    if isinstance(spec, dict):
        return spec.get("type") == kind or any(_components(v, kind) for v in spec.values())
    if isinstance(spec, list):
        return any(_components(v, kind) for v in spec)
    return False


def special_ids(model) -> set[int]:
    """Ids that are not text: the tokenizer's special and added tokens, ids past its vocabulary."""
    tok = model.tokenizer
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}).keys())
    special |= set(range(len(tok), model.vocab_size))
    return special


def vocabulary_bytes(model) -> list[bytes | None] | None:
    """Each token's bytes computed from a fast HF tokenizer's vocabulary pieces (None for special
    tokens), or None when the tokenizer's layout is not one handled here."""
    tok = model.tokenizer
    try:
        spec = json.loads(tok.backend_tokenizer.to_str())
    except Exception:  # noqa: BLE001 - not a fast tokenizer
        return None
    byte_level = _components(spec.get("decoder"), "ByteLevel") or _components(spec.get("pre_tokenizer"), "ByteLevel")
    alphabet = byte_level_alphabet()
    special = special_ids(model)
    pieces = tok.convert_ids_to_tokens(list(range(min(len(tok), model.vocab_size))))
    out: list[bytes | None] = []
    for i in range(model.vocab_size):
        piece = pieces[i] if i < len(pieces) else None
        if i in special or piece is None:
            out.append(None)
        elif byte_level:
            try:
                out.append(bytes(alphabet[c] for c in piece))
            except KeyError:
                return None
        elif _BYTE_PIECE.fullmatch(piece):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


class _BytesTokenizer:
    """The duck-typed tokenizer ``llguidance.TokenizerWrapper`` expects: token bytes, special ids,
    EOS, and the model's encoder."""

    def __init__(self, model, tokens: list[bytes | None], names: list[str] | None = None):
        # (weakly: the tokenizer is cached per model in a WeakKeyDictionary, whose entry would keep its
        # model alive forever if its value referenced it; a model that cannot be weakly referenced is
        # not cached, so it is held as it is)
        try:
            self._model = weakref.ref(model)
        except TypeError:
            self._model = lambda: model
        self._name = getattr(model, "name", type(model).__name__)
        self.eos_token_id = model.eos_token_id
        self.bos_token_id = None
        self.special_token_ids = [i for i, b in enumerate(tokens) if b is None]
        self.tokens = [
            (names[i] if names and names[i] else f"<|special_{i}|>").encode() if b is None else b
            for i, b in enumerate(tokens)
        ]

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        model = self._model()
        if model is None:
            raise SMCDecodeError(f"the model {self._name!r} this llguidance tokenizer encodes with was deleted: "
                                 "bind the constraint to a model that is still alive")
        return model.encode(text)


def _from_bytes(model, tokens: list[bytes | None]):
    llg = _llguidance()
    names = None
    hf_tok = getattr(model, "tokenizer", None)
    if hf_tok is not None and hasattr(hf_tok, "convert_ids_to_tokens"):
        n = min(len(hf_tok), model.vocab_size)
        names = [*hf_tok.convert_ids_to_tokens(list(range(n))), *[None] * (model.vocab_size - n)]
    wrapper = llg.TokenizerWrapper(_BytesTokenizer(model, tokens, names))
    return llg.LLTokenizer(wrapper, n_vocab=model.vocab_size, eos_token=model.eos_token_id)


def _is_text(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _not_text_alone(b: bytes) -> bool:
    """Bytes the model's decoding of one token cannot tell from part of a character: not UTF-8 on
    their own, or U+FFFD itself (what a broken character decodes to)."""
    return not _is_text(b) or "\ufffd" in b.decode("utf-8")


def check_token_bytes(model, lltok, pieces: set[int] | None = None) -> list[str]:
    """Where the llguidance tokenizer ``lltok`` disagrees with ``model``'s decoding (at most 5
    descriptions; empty when they agree): a text token must have exactly the bytes of the model's
    decoding and not be special; a token the model does not decode as text (a special token, or part
    of a character) must be special or not be text on its own. ``pieces``: ids that are parts of
    characters (vocabulary pieces, not special tokens), which must not be special but carry their
    bytes, so that a character split over several tokens can be written."""
    problems = []
    pieces = pieces or set()
    for i, s in enumerate(model.token_strings):
        b = lltok.decode_bytes([i])
        special = lltok.is_special_token(i)
        if s is not None:
            ok = not special and b == s.encode("utf-8")
        elif i in pieces:
            ok = not special and b != b"" and _not_text_alone(b)
        else:
            ok = special or b == b"" or _not_text_alone(b)
        if not ok:
            problems.append(f"token {i}: the model decodes {s!r}, llguidance has {b!r}{' (special)' if special else ''}")
            if len(problems) == 5:
                break
    return problems


def llguidance_tokenizer(model):
    """The llguidance tokenizer of ``model`` (cached), checked token by token against the model's own
    decoding (see the module docstring for the candidates tried)."""
    try:
        return _TOKENIZERS[model]
    except (KeyError, TypeError):  # not built yet, or a model that cannot be a weak key: build it
        pass
    _llguidance()  # a clear error when it is missing
    hf_tok = getattr(model, "tokenizer", None)
    candidates = []
    pieces: set[int] = set()  # parts of characters: the first two candidates must give their bytes
    if hf_tok is not None and hasattr(hf_tok, "backend_tokenizer"):
        special, raw = special_ids(model), vocabulary_bytes(model)  # (raw: also the second candidate's bytes)
        # (a piece with a byte no UTF-8 text has, 0xC0, 0xC1, 0xF5–0xFF, can be in no text: llguidance
        # may keep it special, as it does 0xFF, its own marker of special tokens)
        pieces = {i for i, s in enumerate(model.token_strings) if s is None and i not in special
                  and not (raw is not None and raw[i] is not None and _NEVER_UTF8.search(raw[i]))}
        import llguidance.hf

        def from_hf_json():
            return llguidance.hf.from_tokenizer(hf_tok, n_vocab=model.vocab_size, eos_token=model.eos_token_id)

        def from_vocabulary():
            return None if raw is None else _from_bytes(model, raw)

        candidates += [from_hf_json, from_vocabulary]
    text_only = len(candidates)
    candidates.append(lambda: _from_bytes(model, [None if s is None else s.encode("utf-8") for s in model.token_strings]))
    tok, problems = None, []
    for k, build in enumerate(candidates):
        try:
            tok = build()
        except Exception as e:  # noqa: BLE001 - llguidance raises several types; try the next one
            problems = [f"{type(e).__name__}: {e}"]
            tok = None
        if tok is not None:
            problems = check_token_bytes(model, tok, pieces if k < text_only else None)
            if not problems:
                break
    if tok is not None and not problems and pieces and k == text_only:
        import warnings

        warnings.warn(f"model {getattr(model, 'name', model)!r}: no byte-exact tokenizer for llguidance, so its "
                      f"{len(pieces)} tokens that are parts of characters are never allowed under a constraint: "
                      "characters split over several tokens (most CJK characters, emoji) cannot be written there",
                      stacklevel=2)
    if tok is None or problems:  # pragma: no cover - the token strings agree with themselves
        raise SMCDecodeError(
            f"cannot give llguidance the tokens of model {getattr(model, 'name', model)!r}: "
            + "; ".join(problems)
        )
    try:
        _TOKENIZERS[model] = tok
    except TypeError:  # pragma: no cover - a model that cannot be weakly referenced
        pass
    return tok


# llguidance computes a mask by walking the vocabulary's token trie; a slice of the vocabulary (the
# tokens a regex matches, each token in the first slice that matches it) that the lexer's state
# allows whole is taken without the walk. Its default slices are the JSON string characters in runs
# of 1–10, 11–30 and more bytes. Inside a string whose maxLength leaves fewer than 10 characters, or
# inside a pattern or a format, none of them applies, and a mask costs 15–50 times one inside a plain
# string. These slices add finer lengths and, per constraint, the character classes its patterns
# repeat and its formats are made of. Slices change what a mask costs, never the mask
# (tests/test_mask_slices.py compares them with llguidance's plain trie walk).
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
SLICE_LENGTHS = (1, 2, 3, 4, 6, 8, 10, 14, 20, 30)
_SLICED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {classes: tokenizer}


def mask_slices(classes: tuple = ()) -> list[str]:
    """llguidance's slices for a constraint whose patterns repeat the character ``classes``: runs of
    whitespace, then runs of each class and of JSON string characters by length."""
    out = [r"[\x20\x0A\x0D\x09]+"]
    for c in (*classes, _STRING_CHAR):
        out += [f"{c}{{1,{k}}}" for k in SLICE_LENGTHS] + [c + "+"]
    return out


def with_slices(tok, classes: tuple = ()):
    """``tok`` (an llguidance tokenizer) with ``mask_slices(classes)``; with the string slices alone
    where llguidance's regex syntax refuses one of the classes (a slice only saves time)."""
    try:
        return tok.with_slices(mask_slices(classes))
    except Exception:  # noqa: BLE001 - llguidance raises several types for a regex it refuses
        if not classes:
            raise
        return tok.with_slices(mask_slices())


SLICED_KEPT = 16  # sliced tokenizers kept per model (each set of classes builds one, in about 0.2 s)


def remembered(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` where missing; beyond ``SLICED_KEPT`` entries the oldest goes."""
    if key not in cache:
        if len(cache) >= SLICED_KEPT:
            del cache[next(iter(cache))]
        cache[key] = make()
    return cache[key]


def sliced_tokenizer(model, classes: tuple = ()):
    """``llguidance_tokenizer(model)`` with the slices of ``classes`` (``with_slices``), cached."""
    base = llguidance_tokenizer(model)
    try:
        per_model = _SLICED.setdefault(model, {})
    except TypeError:  # pragma: no cover - a model that cannot be weakly referenced
        per_model = {}
    return remembered(per_model, classes, lambda: with_slices(base, classes))


def token_texts(model, lltok=None) -> list[bytes | None]:
    """Each token's bytes as llguidance sees them (None for special tokens); cached per model."""
    try:
        return _TEXTS[model]
    except (KeyError, TypeError):
        pass
    lltok = llguidance_tokenizer(model) if lltok is None else lltok
    texts = [None if lltok.is_special_token(i) else lltok.decode_bytes([i]) for i in range(model.vocab_size)]
    try:
        _TEXTS[model] = texts
    except TypeError:  # pragma: no cover - a model that cannot be weakly referenced
        pass
    return texts
