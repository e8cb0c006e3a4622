"""JSON Schema -> regular expression, for schemas whose documents form a regular language.

The regex describes exactly the documents the device path generates, a subset of the schema's
documents (every one validates), in the llguidance path's layout: properties in the order the schema
declares them, optional ones may be left out; objects *closed* (only declared properties, so no key
can repeat); ``whitespace="compact"`` separators ``", "`` and ``": "`` and no other whitespace
(``"flexible"``: any JSON whitespace around structural characters, none around the document);
strings with other characters raw except U+0000–U+001F and U+007F, which do not occur, and
the escapes ``\\" \\\\ \\b \\f \\n \\r \\t`` and ``\\u0000``–``\\u001F``, ``\\u007F``.

Where a schema is regular but the regex is a strict subset of its documents, the subset is stated:
numbers with bounds take no exponent and bounds must be integers; ``date`` and ``date-time`` take
no 29 February and no year 0000 (the other formats are llguidance's languages: ``string_formats.py``). A string held to two or more
of a ``format``, a ``pattern`` and a length is the intersection of their languages: the documents
are then the intersection of several regexes (:func:`schema_regexes`). A keyword the translation cannot honour
raises :class:`UnsupportedSchema` naming it (the constraint then runs on llguidance, or the error
reaches the user when the device path was asked for); keywords that are not JSON Schema's are
ignored, as validators ignore them.

``superset=True`` (:func:`superset_regex`) asks instead for a regex of a *superset* of the documents
llguidance generates for a schema the exact translation refuses (the proposal of the engine's
superset path: the device masks with it, llguidance checks each round's tokens). It follows
llguidance's layout where it is exact and widens the rest: an object open to other keys gets, after
its declared properties, any number of further ``"key": value`` pairs (a key a ``patternProperties``
pattern matches with its value, or any key with the ``additionalProperties`` value; repeated and
declared keys too); bounded numbers take any
number; a format of ``SUPERSET_FORMATS`` a regular language at least as wide as llguidance's (without
a ``pattern`` or length beside it), a ``pattern`` beside a length the pattern alone, other formats,
unsupported patterns and long strings any string; keywords that only narrow the
documents (``uniqueItems``, ``minProperties``, ``multipleOf``, ``propertyNames``, ``contains``, …)
are dropped. Any JSON value (``{}``, no type) and recursion stay refused: a regular superset of them
follows no structure (its automaton guides nothing, and a bounded one is no superset).
"""

from __future__ import annotations

import json
import math
import re

from ..errors import SMCDecodeError
from .regex_numbers import _alt, _count, _magnitude, _naturals, _ops
from .string_formats import (
    ANY_CHAR,
    ANY_STRING,
    CHAR,
    FORMATS,
    SUBSET_FORMATS,
    SUPERSET_FORMATS,
    literal,
    string_except,
)

__all__ = ["SUPERSET_FORMATS", "UnsupportedSchema", "literal", "schema_regex", "schema_regexes", "string_except",
           "superset_regex"]

ANNOTATIONS = {
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "id", "deprecated",
    "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "contentSchema", "$anchor", "definitions",
    "$defs", "$vocabulary",
}
KEYWORDS = ANNOTATIONS | {
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties", "items",
    "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains",
    "maxContains", "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "anyOf", "allOf", "oneOf", "not", "if", "then", "else", "$ref",
    "$dynamicRef", "$recursiveRef", "dependencies", "dependentRequired", "dependentSchemas", "propertyNames",
    "minProperties", "maxProperties", "unevaluatedProperties", "unevaluatedItems",
}
MAX_COUNT = 256  # counted repetitions (string lengths, array lengths) the automaton spells out
MAX_REGEX = 200_000  # characters of regex: past this the automaton is not worth building
# characters counted by the lengths of strings held to a format or pattern too, over a schema: the
# intersection (interegular's product of the document's automata) takes seconds near this
MAX_HELD = 64

_CLASS_SYNTAX = re.compile(r"\[:|&&|~~|--")  # POSIX classes and class set operations (llguidance's syntax)
_BAD_IN_PATTERN = r'[\s\S]*["\\\x00-\x1f\x7f][\s\S]*'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
# keywords that only narrow the documents (dropped by the superset translation)
_NARROWING = {
    "uniqueItems", "minProperties", "maxProperties", "multipleOf", "propertyNames", "contains", "minContains",
    "maxContains", "dependentRequired", "unevaluatedProperties", "unevaluatedItems",
}
_COUNTS = ("minProperties", "maxProperties")


class UnsupportedSchema(SMCDecodeError):
    """A schema keyword the regular translation cannot honour; ``keyword`` and ``where`` (a JSON
    pointer) say which."""

    def __init__(self, keyword: str, where: str, why: str):
        self.keyword, self.where, self.why = keyword, where, why
        super().__init__(f"JSON Schema keyword {keyword!r} at {where or '/'} has no token automaton: {why}")


def schema_regex(schema: dict, whitespace: str = "compact", coerce_one_of: bool = False) -> str:
    """The regex of the documents the device path generates for ``schema`` (see the module
    docstring); raises :class:`UnsupportedSchema`, also where the documents are the intersection of
    several regexes (:func:`schema_regexes`)."""
    regexes, _ = schema_regexes(schema, whitespace, coerce_one_of)
    if len(regexes) > 1:
        raise UnsupportedSchema("(intersection)", "", "the documents are the intersection of several regexes "
                                "(a string with two of format, pattern and a length): see schema_regexes")
    return regexes[0]


def schema_regexes(schema: dict, whitespace: str = "compact", coerce_one_of: bool = False
                   ) -> tuple[list[str], list[str]]:
    """(regexes whose intersection is the documents the device path generates, where they are a
    strict subset of the llguidance path's documents: "keyword at pointer" for each bounded
    ``number`` and each ``date`` or ``date-time`` format). One regex, unless a string holds two or more of a format, a
    pattern and a length: each regex then writes one of them there (any string where that string has
    none), the same documents elsewhere. The intersection is exact where such a string is not inside
    an ``anyOf`` or ``oneOf`` (refused there): JSON's syntax puts each string of a document at one
    place in every regex (values of different types in a list of types never share a text). Lengths
    beside a format or pattern count at most ``MAX_HELD`` characters over the schema."""
    t = _Translator(schema, whitespace, coerce_one_of, facet=_FACETS[0])
    first = _sized(t.value(schema, "", ()))
    if not t.facets:
        return [first], t.subsets
    return [first if f == _FACETS[0] else _sized(_Translator(schema, whitespace, coerce_one_of, facet=f).value(schema, "", ()))
            for f in _FACETS if f in t.facets], t.subsets


def superset_regex(schema: dict, whitespace: str = "compact", coerce_one_of: bool = False) -> tuple[str, list[str]]:
    """(a regex of a superset of the documents llguidance generates for ``schema``, where it is wider:
    "what at pointer" for each widening; see the module docstring); raises :class:`UnsupportedSchema`
    where no superset is built (a conjunction it cannot merge, a keyword llguidance refuses too)."""
    t = _Translator(schema, whitespace, coerce_one_of, superset=True)
    return _sized(t.value(schema, "", ())), t.wider


def _sized(out: str) -> str:
    if len(out) > MAX_REGEX:
        raise UnsupportedSchema("(size)", "", f"the regex has {len(out)} characters, more than {MAX_REGEX}")
    return out


_FACETS = ("format", "pattern", "length")  # what a string may be held to, one regex each (schema_regexes)


def nested_base_uri(schema) -> str:
    """The first ``$id`` / ``id`` (a string) set below the root of ``schema``, or "": a subschema's own
    base URI, against which the ``$ref``s inside it resolve (neither translation follows that)."""
    todo = list(schema.values()) if isinstance(schema, dict) else []
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            found = next((node[k] for k in ("$id", "id") if isinstance(node.get(k), str)), None)
            if found is not None:
                return found
            todo += node.values()
        elif isinstance(node, list):
            todo += node
    return ""


class _Translator:
    def __init__(self, root: dict, whitespace: str, coerce_one_of: bool, superset: bool = False,
                 facet: str | None = None):
        self.root = root
        self.base_uris: str | None = None  # (where a subschema sets its own $id / id: ``nested_base_uri``)
        # ``facet``: a string held to several of _FACETS is written as this one alone (schema_regexes);
        # None: such a string is refused. ``facets``: the ones such strings use; ``choices``: how many
        # anyOf / oneOf the translation is inside; ``counted``: the lengths of such strings (MAX_HELD)
        self.facet, self.facets, self.choices, self.counted = facet, set(), 0, 0
        self.coerce_one_of = coerce_one_of
        # superset: widen what the exact translation refuses (listed in ``wider``), see superset_regex
        self.superset, self.wider = superset, []
        if whitespace == "compact":
            self.ws, self.item_sep, self.key_sep = "", ", ", ": "
        else:
            w = r"[ \t\n\r]*"
            self.ws, self.item_sep, self.key_sep = w, w + "," + w, w + ":" + w
        self.flexible = whitespace != "compact"
        self.subsets: list[str] = []  # where the regex takes a strict subset (see schema_regexes)

    def sep(self, text: str) -> str:
        return text if self.flexible else literal(text)

    def widen(self, what: str, where: str, regex: str) -> str:
        """(superset translation) ``regex`` in place of what the exact one refuses, noted in ``wider``."""
        self.wider.append(f"{what} at {where or '/'}")
        return regex

    # -- dispatch ------------------------------------------------------------------------------
    def value(self, s, where: str, refs: tuple) -> str:
        if s is True or s == {}:
            raise UnsupportedSchema("(any)", where, "any JSON value, whose objects may hold any keys")
        if s is False:
            raise UnsupportedSchema("false", where, "the schema `false` accepts nothing")
        if not isinstance(s, dict):
            raise UnsupportedSchema("(schema)", where, f"a subschema must be an object, got {s!r}")
        if self.superset:
            narrowing = [k for k in s if k in _NARROWING]
            if narrowing:  # (min/maxProperties stay for object(): they change llguidance's layout)
                self.wider.append(f"{', '.join(narrowing)} dropped at {where or '/'}")
                s = {k: v for k, v in s.items() if k not in _NARROWING or k in _COUNTS}
        for k in s:
            if k in KEYWORDS and k not in _HANDLED and not (self.superset and k in _COUNTS):
                raise UnsupportedSchema(k, where, "not expressible as a regular language here")
        if "$ref" in s:
            return self.ref(s, where, refs)
        if "allOf" in s:
            return self.value(self.merge_all_of(s, where), where, refs)
        for key in ("anyOf", "oneOf"):
            if key in s:
                if key == "oneOf" and not self.coerce_one_of and not self.superset:
                    # (llguidance takes a oneOf whose branches it proves disjoint: within their anyOf)
                    raise UnsupportedSchema("oneOf", where, "exactly one branch must match (coerce_one_of=True "
                                            "enforces it as anyOf)")
                others = [k for k in s if k in KEYWORDS and k not in ANNOTATIONS and k != key]
                if others:
                    raise UnsupportedSchema(key, where, f"{key} beside {others[0]!r} (their conjunction)")
                if not isinstance(s[key], list) or not s[key]:
                    raise UnsupportedSchema(key, where, "must be a non-empty list")
                if key == "oneOf" and not self.coerce_one_of:
                    self.wider.append(f"oneOf (as anyOf) at {where or '/'}")
                return self.choice([(b, f"{where}/{key}/{i}") for i, b in enumerate(s[key])], refs)
        if "enum" in s or "const" in s:
            return self.literals(s, where)
        types = s.get("type", _inferred_type(s))
        if types is None:
            raise UnsupportedSchema("(any)", where, "no type: any JSON value, whose objects may hold any keys")
        types = types if isinstance(types, list) else [types]
        # (a list of types is no choice here: the texts of values of different types differ)
        return _alt([self.typed(t, s, where, refs) for t in types])

    def choice(self, branches: list, refs: tuple) -> str:
        """The alternation of the ``branches`` ((schema, pointer) each) of an anyOf / oneOf."""
        self.choices += 1
        try:
            return _alt([self.value(b, where, refs) for b, where in branches])
        finally:
            self.choices -= 1

    def typed(self, t: str, s: dict, where: str, refs: tuple) -> str:
        if t == "null":
            return "null"
        if t == "boolean":
            return "(?:true|false)"
        if t == "integer":
            return self.integer(s, where)
        if t == "number":
            return self.number(s, where)
        if t == "string":
            return '"' + self.string(s, where) + '"'
        if t == "array":
            return self.array(s, where, refs)
        if t == "object":
            return self.object(s, where, refs)
        raise UnsupportedSchema("type", where, f"unknown type {t!r}")

    def ref(self, s: dict, where: str, refs: tuple) -> str:
        ref = s["$ref"]
        others = [k for k in s if k in KEYWORDS and k not in ANNOTATIONS and k != "$ref"]
        if others:
            raise UnsupportedSchema("$ref", where, f"$ref beside {others[0]!r}")
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise UnsupportedSchema("$ref", where, f"only local JSON-pointer references (# or #/...) are resolved, "
                                                   f"got {ref!r}")
        if self.base_uris is None:
            self.base_uris = nested_base_uri(self.root)
        if self.base_uris:  # (a subschema with its own $id: "#/..." inside it means that subschema)
            raise UnsupportedSchema("$ref", where, f"a subschema sets its own base URI ({self.base_uris}): its "
                                                   "references resolve against it, which is not followed here")
        if ref in refs:
            raise UnsupportedSchema("$ref", where, f"{ref} is recursive: the documents are not a regular language")
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else []:  # (a JSON pointer: "#/" is the key "")
            part = part.replace("~1", "/").replace("~0", "~")
            try:
                target = target[int(part)] if isinstance(target, list) else target[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise UnsupportedSchema("$ref", where, f"{ref} does not resolve") from None
        return self.value(target, ref, (*refs, ref))

    def merge_all_of(self, s: dict, where: str) -> dict:
        merged = {k: v for k, v in s.items() if k != "allOf"}
        for i, member in enumerate(s["allOf"] if isinstance(s["allOf"], list) else []):
            if not isinstance(member, dict) or "$ref" in member:
                raise UnsupportedSchema("allOf", f"{where}/allOf/{i}", "members must be inline schemas")
            for k, v in member.items():
                if k in ANNOTATIONS:
                    continue
                if k in merged and merged[k] != v:
                    raise UnsupportedSchema("allOf", f"{where}/allOf/{i}", f"two members constrain {k!r}")
                merged[k] = v
        return merged

    # -- scalars -------------------------------------------------------------------------------
    def literals(self, s: dict, where: str) -> str:
        import jsonschema

        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list):
            raise UnsupportedSchema("enum", where, "must be a list")
        rest = {k: v for k, v in s.items() if k not in ("enum", "const")}
        if "$ref" in rest or any(k in rest for k in ("anyOf", "oneOf", "allOf")):
            raise UnsupportedSchema("enum", where, "enum beside $ref/anyOf/oneOf/allOf")
        check = jsonschema.validators.validator_for(self.root, default=jsonschema.Draft202012Validator)(rest)
        fmt = FORMATS.get(rest.get("format"))  # (the validator checks no format: a string must match it here)
        texts = [self.dump(v) for v in values
                 if check.is_valid(v) and (fmt is None or not isinstance(v, str) or re.fullmatch(fmt, v))]
        if not texts:
            raise UnsupportedSchema("enum", where, "no value of the enum satisfies the other keywords")
        return _alt([literal(t) for t in dict.fromkeys(texts)])

    def dump(self, v) -> str:
        # (U+007F as llguidance writes it: escaped; JSON's own rules leave it raw)
        return json.dumps(v, ensure_ascii=False, separators=(",", ":") if self.flexible else (", ", ": ")
                          ).replace("\x7f", "\\u007f")

    def bounds(self, s: dict, where: str, integral: bool):
        """(lo, lo_open, hi, hi_open): integer bounds (closed for integers), None where unbounded."""
        lows, highs = [], []
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            v = s.get(key)
            if v is None or isinstance(v, bool):  # draft-04's exclusive flags are read below
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise UnsupportedSchema(key, where, f"a bound must be a finite number, got {v!r}")
            if not integral and v != int(v):
                raise UnsupportedSchema(key, where, f"bounds of a number must be integers here, got {v!r}")
            opened = key.startswith("exclusive") or s.get("exclusive" + key[0].upper() + key[1:]) is True
            (lows if key.endswith("inimum") else highs).append((v, opened))
        if integral:
            lo = max((math.floor(v) + 1 if o else math.ceil(v)) for v, o in lows) if lows else None
            hi = min((math.ceil(v) - 1 if o else math.floor(v)) for v, o in highs) if highs else None
            lo_open = hi_open = False
        else:
            lo, lo_open = max(((int(v), o) for v, o in lows), key=lambda t: (t[0], t[1])) if lows else (None, False)
            hi, hi_open = min(((int(v), o) for v, o in highs), key=lambda t: (t[0], -t[1])) if highs else (None, False)
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_open or hi_open))):
            raise UnsupportedSchema("minimum", where, "the bounds leave no value")
        return lo, lo_open, hi, hi_open

    def integer(self, s: dict, where: str) -> str:
        lo, _, hi, _ = self.bounds(s, where, integral=True)
        if lo is None and hi is None:
            return INTEGER
        parts = []
        if hi is None or hi >= 0:
            parts.append(_naturals(max(lo or 0, 0), hi))
        if lo is None or lo < 0:
            neg = _naturals(1 if hi is None or hi >= 0 else -hi, None if lo is None else -lo)
            if neg:
                parts.append("-(?:" + neg + ")")
        if (lo is None or lo < 0) and (hi is None or hi >= 0):
            parts.append("-0")  # llguidance's layout: "-0" where negative values are allowed
        return _alt([p for p in parts if p])

    def number(self, s: dict, where: str) -> str:
        if self.superset and any(k in s for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            return self.widen("bounded number", where, NUMBER)
        lo, lo_open, hi, hi_open = self.bounds(s, where, integral=False)
        if lo is None and hi is None:
            return NUMBER
        if self.superset:
            return self.widen("bounded number", where, NUMBER)
        self.subsets.append(f"bounded number at {where or '/'} (no exponent)")
        parts = []
        if hi is None or hi > 0 or (hi == 0 and not hi_open):  # v >= 0
            nonneg_lo, nonneg_open = (lo, lo_open) if lo is not None and lo >= 0 else (0, False)
            parts.append(_magnitude(nonneg_lo, nonneg_open, hi, hi_open))
        if lo is None or lo < 0:  # v = -M with M > 0
            m_lo, m_open = (-hi, hi_open) if hi is not None and hi < 0 else (0, True)
            m = _magnitude(m_lo, m_open, None if lo is None else -lo, lo_open)
            if m:
                parts.append("-(?:" + m + ")")
        return _alt([p for p in parts if p])

    def string(self, s: dict, where: str) -> str:
        if self.superset:  # the exact string where there is one, else a wider one
            exact = _Translator(self.root, "compact", self.coerce_one_of)
            try:
                out = exact.string(s, where)
                if not exact.subsets:
                    return out
                keyword = "format"
            except UnsupportedSchema as e:
                keyword = e.keyword
            fmt, bounds = s.get("format"), [k for k in ("pattern", "minLength", "maxLength") if k in s]
            if fmt in SUPERSET_FORMATS:  # (a format: a regular language at least as wide, alone)
                return self.widen(f"format {fmt!r}" + (f" beside {'/'.join(bounds)}" if bounds else "")
                                  + " (a regular superset of the format alone)", where, SUPERSET_FORMATS[fmt])
            if fmt is None and "pattern" in s and ("minLength" in s or "maxLength" in s):
                try:  # (a pattern beside a length: the pattern alone)
                    body = exact.pattern(s["pattern"], where)
                    return self.widen("pattern beside minLength/maxLength (the pattern alone)", where, body)
                except UnsupportedSchema as e:
                    keyword = e.keyword
            return self.widen(f"{keyword} (any string)", where, ANY_CHAR + "*")
        fmt, pattern = s.get("format"), s.get("pattern")
        held = {}  # (the facets this string is held to: _FACETS)
        if fmt is not None:
            if fmt not in FORMATS:
                raise UnsupportedSchema("format", where, f"format {fmt!r} (regular formats: {sorted(FORMATS)})")
            if fmt in SUBSET_FORMATS:
                self.subsets.append(f"format {fmt!r} at {where or '/'}")
            held["format"] = FORMATS[fmt]
        if pattern is not None:
            held["pattern"] = self.pattern(pattern, where)
        if "minLength" in s or "maxLength" in s or not held:
            held["length"] = self.length(s, where)
        if len(held) == 1:
            return next(iter(held.values()))
        keyword = "format" if fmt is not None else "pattern"
        beside = "/".join({"length": "minLength/maxLength"}.get(k, k) for k in held if k != keyword)
        if self.facet is None:
            raise UnsupportedSchema(keyword, where, f"{keyword} beside {beside}")
        if self.choices:
            raise UnsupportedSchema(keyword, where, f"{keyword} beside {beside} inside anyOf/oneOf (the "
                                    "intersection of its branches' regexes would mix them)")
        if "length" in held:  # (the automata's product grows with the lengths counted beside a format or pattern)
            self.counted += s.get("maxLength", s.get("minLength", 0))
            if self.counted > MAX_HELD:
                raise UnsupportedSchema("maxLength", where, f"{keyword} beside lengths of more than {MAX_HELD} "
                                        "characters in all: their intersection's automaton is not built")
        self.facets |= set(held)
        return held.get(self.facet, CHAR + "*")

    def length(self, s: dict, where: str) -> str:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        for key, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v > MAX_COUNT):
                raise UnsupportedSchema(key, where, f"{v!r}: counts above {MAX_COUNT} are not spelled out")
        if hi is not None and lo > hi:
            raise UnsupportedSchema("minLength", where, "minLength above maxLength leaves no string")
        return CHAR + _count(lo, hi)

    def pattern(self, pattern: str, where: str) -> str:
        """The string body for a JSON Schema ``pattern`` (a search, anchored only by ^ and $), when
        the pattern cannot match a character that JSON would escape."""
        from .regex import _reject_unsupported, interegular_module

        interegular = interegular_module()

        try:
            from re import _parser as sre_parse
        except ImportError:  # pragma: no cover
            import sre_parse  # type: ignore[no-redef]
        if not isinstance(pattern, str):
            raise UnsupportedSchema("pattern", where, f"must be a string, got {pattern!r}")
        start = pattern.startswith("^")
        end = pattern.endswith("$") and not pattern.endswith("\\$")
        body = pattern[1 if start else 0 : len(pattern) - (1 if end else 0)]
        if _CLASS_SYNTAX.search(pattern):  # (llguidance reads these inside a class; Python does not)
            raise UnsupportedSchema("pattern", where, f"{pattern!r}: a POSIX class or a class set operation")
        try:
            if (start or end) and any(str(op) == "BRANCH" for op, _ in sre_parse.parse(pattern)):
                # (^a|b$ is (^a)|(b$): the anchors are not the whole pattern's)
                raise ValueError("an alternative of the whole pattern beside its anchors")
            tree = sre_parse.parse(body)
            if "AT" in _ops(tree):
                raise ValueError("anchors inside the pattern")
            _reject_unsupported(body)
            fsm = interegular.parse_pattern(body).to_fsm()
            clash = not (fsm & interegular.parse_pattern(_BAD_IN_PATTERN).to_fsm()).empty()
        except Exception as e:  # noqa: BLE001 - re and interegular raise several types
            raise UnsupportedSchema("pattern", where, f"{pattern!r}: {type(e).__name__}: {e}") from None
        if clash:
            raise UnsupportedSchema("pattern", where, f"{pattern!r} can match a quote, backslash or control character")
        return ("" if start else CHAR + "*") + "(?:" + body + ")" + ("" if end else CHAR + "*")

    # -- containers ----------------------------------------------------------------------------
    def array(self, s: dict, where: str, refs: tuple) -> str:
        if s.get("uniqueItems") is True and not (isinstance(s.get("maxItems"), int) and s["maxItems"] <= 1):
            raise UnsupportedSchema("uniqueItems", where, "distinct items are not a regular language")
        listed = isinstance(s.get("items"), list)
        if "prefixItems" in s and listed:
            raise UnsupportedSchema("items", where, "items as a list beside prefixItems")
        prefix = s.get("prefixItems", s["items"] if listed else [])
        rest = s.get("additionalItems", True) if listed else s.get("items", True)
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if self.superset and (not isinstance(lo, int) or lo > MAX_COUNT):
            lo = self.widen("minItems", where, 0)
        if self.superset and hi is not None and (not isinstance(hi, int) or hi > MAX_COUNT):
            hi = self.widen("maxItems", where, None)
        for key, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v > MAX_COUNT):
                raise UnsupportedSchema(key, where, f"{v!r}: counts above {MAX_COUNT} are not spelled out")
        heads = [self.value(p, f"{where}/prefixItems/{i}", refs) for i, p in enumerate(prefix)]
        k = len(heads)
        tail = None
        if rest is False or (hi is not None and hi <= k):
            hi = k if hi is None else min(hi, k)
        else:
            tail = self.value(rest, f"{where}/items", refs)
        if hi is not None and lo > hi:
            raise UnsupportedSchema("minItems", where, "no array length is allowed")
        sep = self.sep(self.item_sep)

        def after(i: int) -> str:  # the elements from i on, i elements already written
            if hi is not None and i >= hi:
                return ""
            if i >= k:
                need, room = max(lo - i, 0), None if hi is None else hi - i
                if i == 0:
                    more = _count(max(need - 1, 0), None if room is None else room - 1)
                    body = tail + ("(?:" + sep + tail + ")" + more if more != "{0}" else "")
                    return body if need else "(?:" + body + ")?"
                return "(?:" + sep + tail + ")" + _count(need, room)
            item = (sep if i else "") + heads[i] + after(i + 1)
            return item if i < lo else "(?:" + item + ")?"

        return r"\[" + self.ws + after(0) + self.ws + r"\]"

    def object(self, s: dict, where: str, refs: tuple) -> str:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise UnsupportedSchema("properties", where, "must be an object")
        others = []  # (superset) the values of further keys: pattern and additional properties
        if s.get("additionalProperties", True) is not False:
            if not self.superset:
                raise UnsupportedSchema("additionalProperties", where, "an object open to other keys: which keys "
                                        "it already holds (no key twice) is not a regular property")
            # (llguidance's further keys are never a declared name, as that name's JSON text)
            others.append((string_except([json.dumps(n, ensure_ascii=False) for n in props]),
                           self.value(s.get("additionalProperties", True), f"{where}/additionalProperties", refs)))
        for pat, sub in (s.get("patternProperties") or {}).items():
            if sub is not False:
                if not self.superset:
                    raise UnsupportedSchema("patternProperties", where, "pattern properties with a schema")
                try:  # (a key the pattern matches, where the pattern has an exact translation)
                    key = '"' + _Translator(self.root, "compact", False).pattern(pat, where) + '"'
                except UnsupportedSchema:
                    key = ANY_STRING
                others.append((key, self.value(sub, f"{where}/patternProperties/{pat}", refs)))
            elif not self.superset:
                props = {k: v for k, v in props.items() if not re.search(pat, k)}
            if self.superset and sub not in (True, {}) and any(_search(pat, k) for k in props):
                # (llguidance merges the two schemas of such a key, in a layout not followed here)
                raise UnsupportedSchema("patternProperties", where, f"a declared property matches {pat!r}")
        required = s.get("required", [])
        missing = [r for r in required if r not in props]
        if missing and not others:  # (with further keys, llguidance writes them among those: in the superset)
            raise UnsupportedSchema("required", where, f"{missing[0]!r} is required but not an allowed property")
        names = list(props)
        key_sep, sep = self.sep(self.key_sep), self.sep(self.item_sep)
        items = [literal(json.dumps(n, ensure_ascii=False)) + key_sep + self.value(props[n], f"{where}/properties/{n}",
                                                                                 refs) for n in names]
        req = [n in required for n in names]
        if self.superset and any(k in s for k in _COUNTS):  # (llguidance's layouts for them: subsets of these)
            req = [False] * len(names)
        if others:
            # llguidance's layout: the further pairs after the declared properties, any number of them
            # (a key once, other than the declared ones: the superset takes any key, repeats too)
            self.wider.append(f"further keys (repeats too) at {where or '/'}")
            pair = _alt([k + key_sep + v for k, v in others])
            names.append("(further keys)")
            items.append(pair + "(?:" + sep + pair + ")*")
            req.append(False)
        tails: dict[int, str] = {}

        def tail(i: int) -> str:  # properties i.. after at least one written
            if i not in tails:
                if i == len(names):
                    tails[i] = ""
                else:
                    item = sep + items[i]
                    tails[i] = (item if req[i] else "(?:" + item + ")?") + tail(i + 1)
            return tails[i]

        # the first property written is some i with no required property before it
        firsts = []
        for i in range(len(names)):
            firsts.append(items[i] + tail(i + 1))
            if req[i]:
                break
        body = _alt(firsts) if firsts else ""
        if not any(req):
            body = "(?:" + body + ")?" if body else ""
        return r"\{" + self.ws + body + self.ws + r"\}"


_HANDLED = ANNOTATIONS | {
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties", "items",
    "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "allOf", "oneOf", "$ref",
}
_TYPE_KEYWORDS = (
    ("object", ("properties", "required", "additionalProperties", "patternProperties")),
    ("array", ("items", "prefixItems", "minItems", "maxItems", "additionalItems")),
    ("string", ("minLength", "maxLength", "pattern", "format")),
    ("number", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")),
)


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return True  # (unknown: assume it matches)


def _inferred_type(s: dict):
    kinds = [t for t, keys in _TYPE_KEYWORDS if any(k in s for k in keys)]
    return kinds[0] if len(kinds) == 1 else None
