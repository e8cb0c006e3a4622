"""JSON Schema constraints: Ψ(x) = 1[text(x) is a JSON document valid under the schema].

The schema is checked against its meta-schema (``jsonschema``), then compiled by llguidance into a
grammar over the model's tokens (see ``grammar.py`` for the particle state and mask path).

Supported (by llguidance): ``type`` (and type lists), ``properties`` / ``required`` /
``additionalProperties``, ``enum`` / ``const``, ``items`` / ``prefixItems`` / ``minItems`` /
``maxItems``, nested objects, ``$ref`` / ``$defs`` / ``definitions`` (local, recursive too),
``anyOf`` / ``allOf``, ``minimum`` / ``maximum`` (and exclusive), ``minLength`` / ``maxLength`` /
``pattern``, and ``format`` for date, time, date-time, duration, email, hostname, ipv4, ipv6, uri,
uuid. Unsupported keywords (``not``, ``dependencies``, ``oneOf`` unless ``coerce_one_of=True``,
unknown formats, remote ``$ref``) raise :class:`SMCDecodeError` naming them — never silently
unconstrained output.

Generated documents list object properties in the order the schema declares them (any additional
properties after), and use one fixed layout: ``whitespace="compact"`` gives ``{"a": 1, "b": [2, 3]}``
(the layout of Python's ``json.dumps``); ``"flexible"`` lets the model choose any JSON whitespace.
Strings hold other characters raw, except control characters (U+0000–U+001F and U+007F), which
are escaped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import SMCDecodeError
from .automaton import auto_limit
from .grammar import PATHS, LLGuidanceConstraint, _llguidance, lark_header
from .json_strings import automaton_strings

WHITESPACE = ("compact", "flexible")
SUPERSET = ("a superset of the documents forms a regular language (its automaton masks the proposal on the "
            "engine's device, llguidance checks each round's tokens; elsewhere llguidance's masks)")


def schema_dict(schema) -> tuple[dict, Any]:
    """Normalise a schema given as a dict, a JSON string, ``True``, or a pydantic model class
    into ``(dict, pydantic class or None)``."""
    model_cls = None
    if isinstance(schema, type):
        try:
            from pydantic import BaseModel
        except ImportError:  # pragma: no cover
            BaseModel = None  # noqa: N806
        if BaseModel is not None and issubclass(schema, BaseModel):
            model_cls = schema
            schema = schema.model_json_schema()
        else:
            raise SMCDecodeError(
                f"schema must be a dict, a JSON string or a pydantic model class, got the class {schema.__name__}"
            )
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SMCDecodeError(f"schema string is not valid JSON: {e}") from None
    if schema is True:
        schema = {}
    if schema is False:
        raise SMCDecodeError("the schema `false` accepts no document: nothing could be generated")
    if not isinstance(schema, dict):
        raise SMCDecodeError(
            f"schema must be a dict, a JSON string or a pydantic model class, got {type(schema).__name__}: "
            f"{str(schema)[:80]!r}"
        )
    return schema, model_cls


# an object schema with any of these keys gets its properties from elsewhere too, or says itself
# what else it allows: closed_schema leaves its other keys open
_OPEN_KEYS = {
    "additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
    "$ref", "if", "then", "else", "dependentSchemas", "dependencies", "propertyNames",
}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "items")  # draft-04 "items" may be a list
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
# keys_can_repeat: the further subschemas it walks (beyond the ones above), the keywords of a node that
# only combine its members, those that make a node an object's, and those that add no value of their own
_MORE_SUBSCHEMAS = ("additionalItems", "unevaluatedProperties", "propertyNames")
_COMBINED = ("anyOf", "oneOf", "allOf", "$ref")
_OBJECT_WORDS = ("properties", "required", "additionalProperties", "patternProperties", "unevaluatedProperties",
                 "minProperties", "maxProperties", "propertyNames", "dependentSchemas")
_PLAIN_WORDS = frozenset((
    "type", "enum", "const", "$defs", "definitions", "$schema", "$id", "id", "$anchor", "$comment", "title",
    "description", "default", "examples", "example", "deprecated", "readOnly", "writeOnly", "x-guidance", "format",
    "minLength", "maxLength", "pattern", "contentEncoding", "contentMediaType", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "uniqueItems",
    "minContains", "maxContains", "prefixItems", "contains", "not", "if", "then", "else",
    *_COMBINED, *_OBJECT_WORDS, *_SUBSCHEMAS, *_MORE_SUBSCHEMAS,
))


def keys_can_repeat(schema) -> bool:
    """Can a document of the grammar llguidance compiles from ``schema`` name a key twice in one
    object? False only where every object the schema allows is closed (``additionalProperties``
    false, no ``patternProperties``) and no value is left unconstrained (``{}``, ``true``, an array
    without ``items``): llguidance then writes each declared property at most once, in order, and
    the unique-key rule has nothing to remove. Conservative: a keyword it does not know of
    (``_PLAIN_WORDS``) answers True."""
    if schema is True:
        return True
    if not isinstance(schema, dict):
        return False  # (false: no value)
    if not _PLAIN_WORDS.issuperset(schema):
        return True
    if "enum" in schema or "const" in schema:
        return False  # (constants: parsed JSON, no repeated key)
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else None
    if types is None or "object" in types:
        if types is not None or any(k in schema for k in _OBJECT_WORDS):
            if schema.get("additionalProperties", True) is not False or schema.get("patternProperties") \
                    or schema.get("unevaluatedProperties", False) is not False:
                return True
        elif not any(k in schema for k in _COMBINED):
            return True  # (any value)
    if types is not None and "array" in types and "items" not in schema \
            and not ("prefixItems" in schema and schema.get("additionalItems", True) is False):
        return True  # (items of any value)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict) and any(keys_can_repeat(v) for v in schema[key].values()):
            return True
    for key in (*_SUBSCHEMA_LISTS, "allOf"):
        if isinstance(schema.get(key), list) and any(keys_can_repeat(v) for v in schema[key]):
            return True
    return any(keys_can_repeat(schema[key]) for key in (*_SUBSCHEMAS, *_MORE_SUBSCHEMAS)
               if key in schema and not isinstance(schema[key], list))


# JSON Schema's own keywords: a key named so in a document is almost always the schema copied
SCHEMA_KEYWORDS = (
    "$schema", "$id", "$ref", "$defs", "$comment", "definitions", "type", "properties", "required",
    "additionalProperties", "patternProperties", "items", "prefixItems", "enum", "const", "anyOf", "oneOf",
    "allOf", "not", "format", "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems",
    "maxItems", "title", "description", "default", "examples",
)


def _declared(schema, names: set) -> set:
    """Every property name ``schema`` declares anywhere."""
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict):
            names.update(schema["properties"])
        for v in schema.values():
            _declared(v, names)
    elif isinstance(schema, list):
        for v in schema:
            _declared(v, names)
    return names


def closed_schema(schema) -> dict:
    """A copy of ``schema`` whose objects hold no keys the schema does not name, where that can be
    said without changing what the named keys may be. Every document valid under the copy is valid
    under ``schema``:

    * an object schema that declares ``properties`` and nothing else about other keys (no
      ``additionalProperties``, ``patternProperties``, ``$ref``, ``allOf``, ``anyOf``, …) gets
      ``"additionalProperties": false``;
    * one whose properties all come from ``allOf`` members that are closed that way gets them listed
      (as ``{}``: the members still apply) and ``"additionalProperties": false``;
    * any other object schema that allows other keys (an ``additionalProperties`` schema, ``$ref``,
      ``allOf``, or nothing said) and has no ``patternProperties`` (llguidance needs their patterns
      disjoint) may not use a JSON Schema keyword (``type``, ``properties``, ``$schema``, …,
      :data:`SCHEMA_KEYWORDS`) as a key unless the schema declares that name somewhere.
    """
    forbidden = [k for k in SCHEMA_KEYWORDS if k not in _declared(schema, set())]
    pattern = "^(" + "|".join(re.escape(k) for k in forbidden) + ")$" if forbidden else None
    return _close(schema, pattern)


def without_noops(schema):
    """A copy of ``schema`` without the keywords that constrain nothing and that the grammar
    engine would refuse by name: ``"uniqueItems": false`` and ``"propertyNames": {}`` / ``true``
    (tools that write schemas emit them)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items()
           if not (k == "uniqueItems" and v is False) and not (k == "propertyNames" and v in ({}, True))}
    _map_subschemas(out, without_noops)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [without_noops(v) for v in out["allOf"]]
    return out


def _map_subschemas(out: dict, fn) -> None:
    """Replace each subschema of ``out`` (but ``allOf``'s members) by ``fn`` of it, in place."""
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: fn(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(v) for v in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key])


def _closable(schema) -> bool:
    return isinstance(schema, dict) and isinstance(schema.get("properties"), dict) and not _OPEN_KEYS & set(schema)


def _close(schema, pattern: str | None, in_all_of: bool = False):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    _map_subschemas(out, lambda v: _close(v, pattern))
    members = out.get("allOf")
    if isinstance(members, list):
        out["allOf"] = [_close(v, pattern, in_all_of=True) for v in members]
    if in_all_of:
        return out
    if _closable(out):
        out["additionalProperties"] = False
    elif (
        isinstance(members, list)
        and members
        and all(_closable(m) for m in members)
        and not (_OPEN_KEYS - {"allOf"}) & set(out)
    ):
        names = {**{k: {} for m in members for k in m["properties"]}, **out.get("properties", {})}
        out["properties"] = names
        out["additionalProperties"] = False
    elif (
        pattern is not None
        and _is_object_schema(out)
        and out.get("additionalProperties") is not False
        and not (_OPEN_KEYS - {"allOf", "$ref", "additionalProperties"}) & set(out)
    ):
        out["patternProperties"] = {pattern: False}
    return out


def _is_object_schema(schema: dict) -> bool:
    t = schema.get("type")
    keys = ("properties", "required", "additionalProperties")
    return t == "object" or (isinstance(t, list) and "object" in t) or any(k in schema for k in keys)


def check_schema(schema: dict):
    """Validate ``schema`` against its meta-schema (its ``$schema`` draft, else 2020-12) and return
    a ``jsonschema`` validator for documents; an invalid schema raises SMCDecodeError."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise SMCDecodeError(f"invalid JSON Schema at {where}: {e.message}") from None
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


class RepeatedKey(Exception):
    """A JSON object names a key twice (``unique_pairs``)."""


# a character class a pattern repeats: [...] or \d, \w, then +, * or {m}, {m,}, {m,n}
_REPEATED_CLASS = re.compile(r"(\[(?:\\.|[^\]\\])+\]|\\[dw])(?:[+*]|\{\d+(?:,\d*)?\})")
_SHORTHANDS = {"\\d": "[0-9]", "\\w": "[A-Za-z0-9_]"}
# the runs of characters the string formats llguidance checks are mostly made of
_FORMAT_CLASSES = {"email": "[A-Za-z0-9]", "hostname": "[A-Za-z0-9]", "uri": "[A-Za-z0-9]",
                   "uri-reference": "[A-Za-z0-9]", "iri": "[A-Za-z0-9]", "uuid": "[0-9a-fA-F]",
                   "date": "[0-9]", "time": "[0-9]", "date-time": "[0-9]", "duration": "[0-9]", "ipv4": "[0-9]"}
_VALUES = ("const", "enum", "default", "examples")
MAX_CLASSES = 3  # classes given slices of their own (each adds 11 slices to llguidance's tokenizer)


def repeated_classes(schema) -> tuple[str, ...]:
    """The character classes the ``pattern`` keywords and ``patternProperties`` keys of ``schema`` repeat
    (``[a-z ]+``, ``\\d{3}``) and those its string formats are mostly made of, in order, at most
    ``MAX_CLASSES``: llguidance's mask computation takes the tokens of such runs whole
    (``token_bytes.mask_slices``). A negated class leaves out the characters a JSON string escapes,
    so that the runs it matches can be inside a string."""
    found: list[str] = []

    def add(c: str) -> None:
        if c not in found:
            found.append(c)

    def scan(pattern: str) -> None:
        for m in _REPEATED_CLASS.finditer(pattern):
            c = _SHORTHANDS.get(m.group(1), m.group(1))
            add("[^" + '"\\\\\\x00-\\x1F\\x7F' + c[2:] if c.startswith("[^") else c)

    def walk(node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in _VALUES:  # (documents' values, not subschemas)
                    continue
                if k == "pattern" and isinstance(v, str):
                    scan(v)
                    continue
                if k == "format" and isinstance(v, str) and v in _FORMAT_CLASSES:
                    add(_FORMAT_CLASSES[v])
                    continue
                if k == "patternProperties" and isinstance(v, dict):
                    for key in v:
                        scan(key)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return tuple(found[:MAX_CLASSES])


def unique_pairs(pairs: list) -> dict:
    """``json.loads``'s object_pairs_hook that refuses a repeated key (RepeatedKey)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise RepeatedKey(k)
        out[k] = v
    return out


class JSONSchema(LLGuidanceConstraint):
    """Ψ(x) = 1[text(x) is valid JSON under ``schema``] (a dict, JSON string or pydantic model).

    ``whitespace``: "compact" (default, one canonical layout) or "flexible".
    ``coerce_one_of``: enforce ``oneOf`` as ``anyOf`` (documents may then match several branches);
    off by default, so a ``oneOf`` schema raises instead (llguidance accepts ``oneOf`` whose
    branches are provably disjoint, e.g. of different types, either way).
    ``extra_properties``: False compiles :func:`closed_schema` instead: objects hold no key the
    schema does not name where it can say so, and no JSON Schema keyword as a key (every such
    document is valid under ``schema``, which :meth:`parse` still checks). Default True: the
    schema's own language.
    ``unique_keys``: no object may name a key twice (default True). JSON Schema itself allows
    ``{"a": 1, "a": 2}`` wherever additional properties are allowed, and llguidance's grammar cannot
    exclude it; with ``unique_keys`` the mask also forbids every token that would close a key its
    object already has (``json_keys.py``), and :meth:`parse` rejects such documents. Where every
    object the schema allows is closed, llguidance already writes each property at most once and
    the mask skips that work (``self.key_rule`` False: :func:`keys_can_repeat`).
    ``force_canonical``: see :class:`~smcdecode.potentials.grammar.Grammar`.
    ``path``: how masks are computed. "automaton": the schema is translated to a regular expression
    (``schema_regex.py``) and compiled to a token automaton with token classes (``automaton.py``),
    which the engine steps on the device inside its captured round; a schema the translation cannot
    honour raises :class:`~smcdecode.potentials.schema_regex.UnsupportedSchema` naming the keyword.
    "llguidance": llguidance's parser masks (any schema it supports, recursive ones too).
    "superset": for the engine's SMC-SD, a token automaton of a regular *superset* of the documents
    (``schema_regex.superset_regex``: open objects' further keys, formats, bounded numbers, …)
    masks the proposal on the device, and the host checks each round's tokens with llguidance: a
    particle that left the documents gets weight 0. The target is the same (the weights are exact);
    the proposal is masked less, so particles can die. Requests of one particle (locally-masked
    decoding) and every other backend use llguidance's masks. ``self.superset_widens`` says where
    the superset is wider.
    "auto" (default): the automaton where the schema's documents are regular, else the superset path
    where a superset is and widens no string ``format`` or ``pattern`` (the draft writes strings
    outside them often, and particles die), else llguidance. ``self.path`` says which was chosen and ``self.path_reason`` why.
    """

    superset_widens: tuple | list = ()
    regexes: tuple | list = ()  # (the automaton path: the documents are the intersection of these regexes)

    def __init__(
        self,
        schema,
        *,
        whitespace: str = "compact",
        coerce_one_of: bool = False,
        extra_properties: bool = True,
        unique_keys: bool = True,
        force_canonical: bool = False,
        path: str = "auto",
        model=None,
        threads: int | None = None,
    ):
        if path not in PATHS + ("superset",):
            raise SMCDecodeError(f"path must be one of {PATHS + ('superset',)}, got {path!r}")
        if whitespace not in WHITESPACE:
            raise SMCDecodeError(f"whitespace must be one of {WHITESPACE}, got {whitespace!r}")
        self.schema, self.pydantic_model = schema_dict(schema)
        self.validator = check_schema(self.schema)
        self.extra_properties = bool(extra_properties)
        # the schema the grammar is compiled from; documents are validated against self.schema
        self.compiled_schema = without_noops(self.schema if self.extra_properties else closed_schema(self.schema))
        self.whitespace = whitespace
        self.coerce_one_of = bool(coerce_one_of)
        self.unique_keys = bool(unique_keys)
        # (where every object is closed, llguidance writes each property at most once: no rule to apply)
        self.key_rule = self.unique_keys and keys_can_repeat(self.compiled_schema)
        options = {"lenient": False, "coerce_one_of": self.coerce_one_of}
        if whitespace == "compact":
            options.update(whitespace_flexible=False, item_separator=", ", key_separator=": ")
        else:
            options.update(whitespace_flexible=True)
        self.force_canonical = bool(force_canonical)
        # llguidance's grammar (every path: the automaton's falls back to it where, bound to a model,
        # its token automaton is too large); x-guidance carries the JSON options (ours override any
        # in the schema), the Lark wrapper the tokenisation option
        source = self.compiled_schema
        compiled = {**source, "x-guidance": {**source.get("x-guidance", {}), **options}}
        self._grammar = lark_header(self.force_canonical) + "start: %json " + json.dumps(compiled)
        self._classes = repeated_classes(source)
        self._what = f"JSON Schema not supported by the grammar engine (llguidance {_llguidance().__version__})"
        self.path_asked = path
        with auto_limit(path):
            chosen, regex, fsm, self.path_reason = self._choose_path(path)
        if chosen == "automaton":  # (the documents: the intersection of ``regexes``, one regex mostly)
            self.regexes = regex
            self._use_automaton(regex[0], fsm, threads, model)
            return
        if chosen == "superset":
            self.path, self.superset_regex, self._superset_fsm = "superset", regex, fsm
        self._setup(model, threads)

    def _choose_path(self, path: str) -> tuple[str, str | None, object, str]:
        """(the path chosen; the regex and its character automaton: the documents' for "automaton" (a
        list of regexes, their intersection), a superset's for "superset", None, None for
        "llguidance"; why)."""
        from functools import reduce

        from .regex import char_fsm
        from .schema_regex import UnsupportedSchema, schema_regexes, superset_regex

        if path == "llguidance":
            return "llguidance", None, None, "asked for (path='llguidance')"
        why = "asked for (path='superset')"
        if path != "superset":
            try:
                if self.force_canonical:
                    raise UnsupportedSchema("(force_canonical)", "", "canonical tokenisation is llguidance's rule")
                regexes, subsets = schema_regexes(self.compiled_schema, self.whitespace, self.coerce_one_of)
                if subsets and path != "automaton":
                    # NOTE: every path must sample the same target: where the device path would take a strict
                    # subset of the documents (bounded numbers, dates), 'auto' does not take it
                    raise UnsupportedSchema("(subset)", "", "the device path takes a strict subset of the documents "
                                            "here (" + "; ".join(subsets) + "): path='automaton' accepts that subset")
                fsm = reduce(lambda a, b: a & b, map(char_fsm, regexes))
                if len(regexes) > 1 and fsm.empty():  # (each regex alone has documents: their intersection may not)
                    raise UnsupportedSchema("(unsatisfiable)", "", "no string satisfies a string's format, pattern "
                                            "and length together: the schema has no document")
                return "automaton", regexes, fsm, "the schema's documents form a regular language"
            except (UnsupportedSchema, SMCDecodeError) as e:  # (SMCDecodeError: a regex interegular refuses)
                if path == "automaton":
                    raise
                why = str(e)
        # the superset path: a device automaton of more documents, llguidance's check of each round
        try:
            if self.force_canonical:
                raise UnsupportedSchema("(force_canonical)", "", "canonical tokenisation is llguidance's rule")
            regex, wider = superset_regex(self.compiled_schema, self.whitespace, self.coerce_one_of)
            fsm = char_fsm(regex)
        except (UnsupportedSchema, SMCDecodeError) as e:
            if path == "superset":
                raise
            return "llguidance", None, None, f"{why}; no superset automaton either: {e}"
        strings = [w for w in wider if w.startswith(("format", "pattern"))]
        if strings and path != "superset":
            # NOTE: a string format or pattern widened: the draft writes strings outside them, so particles
            # die, at times all of a request's in one round, which leaves it no sample (JSONSchemaBench: to
            # any string, 31 fewer valid of 273 such schemas; to a format's regular superset or a pattern
            # without its length, 85 valid against 91 of 121, 36 left without a sample against 30:
            # benchmarks/results/structured/superset_quality.json)
            return "llguidance", None, None, (f"{why}; the superset widens {strings[0]}, where particles leave the documents "
                                "often: llguidance's masks (path='superset' takes the superset)")
        self.superset_widens = wider
        return "superset", regex, fsm, SUPERSET

    def _automaton_strings(self):
        # (with canonical tokenisation llguidance's masks drop tokens a string's automaton keeps)
        if self.force_canonical or not automaton_strings(self.compiled_schema):
            return None
        return self.compiled_schema

    def __repr__(self) -> str:
        text = json.dumps(self.schema, separators=(",", ":"))
        return f"JSONSchema({text[:60]}{'...' if len(text) > 60 else ''})"

    def parse(self, text: str):
        """The document ``text`` as a Python object (or a pydantic instance when the schema came from
        a pydantic model), validated; an invalid document raises SMCDecodeError."""
        try:
            value = json.loads(text, object_pairs_hook=unique_pairs if self.unique_keys else None)
        except json.JSONDecodeError as e:
            raise SMCDecodeError(f"output is not valid JSON ({e}): {text[:80]!r}") from None
        except RepeatedKey as e:
            raise SMCDecodeError(
                f"output repeats the key {e.args[0]!r} in one object (unique_keys=True): {text[:80]!r}"
            ) from None
        errors = sorted(self.validator.iter_errors(value), key=lambda e: list(e.absolute_path))
        if errors:
            where = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
            raise SMCDecodeError(f"output does not validate against the schema at {where}: {errors[0].message}")
        if self.pydantic_model is not None:
            return self.pydantic_model.model_validate(value)
        return value

    def is_valid(self, text: str) -> bool:
        """Does ``text`` parse as JSON and validate against the schema (with format checks)?"""
        try:
            self.parse(text)
        except SMCDecodeError:
            return False
        except Exception:  # noqa: BLE001 - a pydantic ValidationError
            return False
        return True
