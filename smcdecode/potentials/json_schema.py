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
from typing import Any

from ..errors import SMCDecodeError
from .grammar import LLGuidanceConstraint, _llguidance, lark_header

WHITESPACE = ("compact", "flexible")


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


class _RepeatedKey(Exception):
    pass


def _unique_pairs(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _RepeatedKey(k)
        out[k] = v
    return out


class JSONSchema(LLGuidanceConstraint):
    """Ψ(x) = 1[text(x) is valid JSON under ``schema``] (a dict, JSON string or pydantic model).

    ``whitespace``: "compact" (default, one canonical layout) or "flexible".
    ``coerce_one_of``: enforce ``oneOf`` as ``anyOf`` (documents may then match several branches);
    off by default, so a ``oneOf`` schema raises instead (llguidance accepts ``oneOf`` whose
    branches are provably disjoint, e.g. of different types, either way).
    ``unique_keys``: no object may name a key twice (default True). JSON Schema itself allows
    ``{"a": 1, "a": 2}`` wherever additional properties are allowed, and llguidance's grammar cannot
    exclude it; with ``unique_keys`` the mask also forbids every token that would close a key its
    object already has (``json_keys.py``), and :meth:`parse` rejects such documents.
    ``force_canonical``: see :class:`~smcdecode.potentials.grammar.Grammar`.
    """

    def __init__(
        self,
        schema,
        *,
        whitespace: str = "compact",
        coerce_one_of: bool = False,
        unique_keys: bool = True,
        force_canonical: bool = False,
        model=None,
        threads: int | None = None,
    ):
        if whitespace not in WHITESPACE:
            raise SMCDecodeError(f"whitespace must be one of {WHITESPACE}, got {whitespace!r}")
        self.schema, self.pydantic_model = schema_dict(schema)
        self.validator = check_schema(self.schema)
        self.whitespace = whitespace
        self.coerce_one_of = bool(coerce_one_of)
        self.unique_keys = bool(unique_keys)
        options = {"lenient": False, "coerce_one_of": self.coerce_one_of}
        if whitespace == "compact":
            options.update(whitespace_flexible=False, item_separator=", ", key_separator=": ")
        else:
            options.update(whitespace_flexible=True)
        self.force_canonical = bool(force_canonical)
        llg = _llguidance()
        # x-guidance carries the JSON options (ours override any in the schema); the Lark wrapper
        # carries the tokenisation option
        compiled = {**self.schema, "x-guidance": {**self.schema.get("x-guidance", {}), **options}}
        self._grammar = lark_header(self.force_canonical) + "start: %json " + json.dumps(compiled)
        self._what = f"JSON Schema not supported by the grammar engine (llguidance {llg.__version__})"
        self._setup(model, threads)

    def __repr__(self) -> str:
        text = json.dumps(self.schema, separators=(",", ":"))
        return f"JSONSchema({text[:60]}{'...' if len(text) > 60 else ''})"

    def parse(self, text: str):
        """The document ``text`` as a Python object (or a pydantic instance when the schema came from
        a pydantic model), validated; an invalid document raises SMCDecodeError."""
        try:
            value = json.loads(text, object_pairs_hook=_unique_pairs if self.unique_keys else None)
        except json.JSONDecodeError as e:
            raise SMCDecodeError(f"output is not valid JSON ({e}): {text[:80]!r}") from None
        except _RepeatedKey as e:
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
