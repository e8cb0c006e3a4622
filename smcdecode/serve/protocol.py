"""Requests of the OpenAI API, checked into a :class:`Spec`; OpenAI-style error bodies.

Standard fields (``messages`` / ``prompt``, ``max_tokens``, ``temperature``, ``seed``, ``n``,
``stop``, ``response_format``, ``stream``, ``logprobs``) and smcdecode's own, which the ``openai``
client sends at the top level of the body when given as ``extra_body`` (``strategy``,
``particles``, ``block_size``, ``resampler``, ``ess_threshold``, ``draft_temperature``, ``regex``,
``grammar``, ``grammar_syntax``, ``return_particles``, ``schema_in_prompt``). Anything else, or a
standard field set to a value this server cannot honour (``top_p`` below 1, penalties, tools...),
is refused with a 400 that names the field: nothing is silently ignored.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field

from ..errors import MIN_TEMPERATURE, SMCDecodeError
from ..samplers.resampling import RESAMPLERS

STRATEGIES = ("smc", "sd", "ar")
MAX_STOP = 4  # stop sequences per request (the OpenAI limit)
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 5  # alternatives per token in ``logprobs`` (the completions API's limit)
MAX_SEED = 2**64 - 1


class RequestError(Exception):
    """A request this server refuses: HTTP ``status`` with an OpenAI-style body naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict:
        kind = {404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if 400 <= self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What one request may ask of this server."""

    max_particles: int = 64
    max_block_size: int = 16
    max_n: int = 8
    max_tokens: int = 4096
    default_max_tokens: int = 256  # chat requests that give none (completions: 16, as OpenAI's)


@dataclass(frozen=True)
class Defaults:
    """The server's smcdecode settings, used where a request gives none."""

    strategy: str = "smc"
    particles: int = 4
    block_size: int = 4
    resampler: str = "systematic"
    ess_threshold: float = 0.5


@dataclass
class Spec:
    """One checked request. ``constraint`` is unbound text (compiled by ``compile_constraint``)."""

    endpoint: str  # "chat" or "completions"
    prompt: object  # chat messages (list of dicts) or text or token ids
    max_tokens: int
    temperature: float
    seed: int | None
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: none; k >= 0: the chosen token's log-prob and k alternatives
    strategy: str
    particles: int
    block_size: int
    resampler: str
    ess_threshold: float
    draft_temperature: float | None
    constraint: tuple | None  # ("regex", pattern) | ("grammar", text, syntax) | ("json", schema)
    constraint_param: str | None  # the field that asked for the constraint
    return_particles: bool
    schema_in_prompt: bool
    max_tokens_given: bool = True
    extra: dict = field(default_factory=dict)


STANDARD = {
    "chat": {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "n", "stop",
             "stream", "stream_options", "response_format", "logprobs", "top_logprobs", "user", "top_p",
             "frequency_penalty", "presence_penalty", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
             "metadata", "store", "service_tier"},
    "completions": {"model", "prompt", "max_tokens", "temperature", "seed", "n", "stop", "stream", "stream_options",
                    "response_format", "logprobs", "user", "top_p", "frequency_penalty", "presence_penalty",
                    "logit_bias", "echo", "best_of", "suffix"},
}
OWN = {"strategy", "particles", "block_size", "resampler", "ess_threshold", "draft_temperature", "regex", "grammar",
       "grammar_syntax", "return_particles", "schema_in_prompt"}
# standard fields accepted only at their neutral value
NEUTRAL = {"top_p": (1, 1.0), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
           "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False), "echo": (False,),
           "best_of": (1,), "suffix": ("",), "store": (False,)}


def _int(body: dict, name: str, default, lo: int, hi: int, fix: str = "") -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
        hint = f": {fix}" if fix and not isinstance(v, bool) and isinstance(v, numbers.Integral) and v > hi else ""
        raise RequestError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}{hint}", name)
    return int(v)


def _float(body: dict, name: str, default, lo: float, hi: float, fix: str = "") -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not lo <= v <= hi:
        hint = f": {fix}" if fix else ""
        raise RequestError(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}{hint}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be true or false, got {v!r}", name)
    return v


def _text(body: dict, name: str, empty_ok: bool = False) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str) or not (v or empty_ok):
        raise RequestError(f"{name} must be a {'' if empty_ok else 'non-empty '}string, got {v!r}", name)
    return v


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {value!r:.80}",
                           "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content', got {m!r:.80}", where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise RequestError(f"{where}.role must be 'system', 'developer', 'user' or 'assistant', got {role!r}: "
                               "tool messages are not supported", f"{where}.role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise RequestError(f"{where} has unsupported keys {sorted(extra)} (tool calls are not supported)",
                               f"{where}.{sorted(extra)[0]}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}, "
                                       f"got {part!r:.80}: this server reads text only", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string, got {content!r:.80}", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(value):
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise RequestError("prompt is empty: give some text or token ids", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return list(value)
    raise RequestError(f"prompt must be one string or one list of token ids (one prompt per request), got "
                       f"{value!r:.80}", "prompt")


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops) \
            or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them "
                           f"(each at most {MAX_STOP_CHARS} characters), got {value!r:.80}", "stop")
    return list(stops)


def _response_format(value) -> tuple | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {value!r:.80}",
                           "response_format.type")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return ("json", {"type": "object"})
    js = value.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise RequestError("response_format.json_schema must be an object with a 'schema' object (and a 'name'), "
                           f"got {js!r:.80}", "response_format.json_schema")
    return ("json", js["schema"])


def _neutral(body: dict) -> None:
    for name, allowed in NEUTRAL.items():
        v = body.get(name)
        if v is not None and not any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in allowed):
            raise RequestError(f"{name}={v!r:.60} is not supported by this server (it samples the target "
                               f"distribution as given): leave {name} out", name)


def parse(body, endpoint: str, limits: Limits, defaults: Defaults) -> Spec:
    """Check a decoded JSON body for ``endpoint`` ("chat" or "completions")."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - STANDARD[endpoint] - OWN)
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]} (smcdecode's own settings: "
                           f"{sorted(OWN)})", unknown[0])
    _neutral(body)
    if endpoint == "chat":
        if "messages" not in body:
            raise RequestError("messages is required", "messages")
        prompt = _messages(body["messages"])
        mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, mt_name, None, 1, limits.max_tokens)
        default_tokens = limits.default_max_tokens
        logprobs_on = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if body.get("top_logprobs") is not None and not logprobs_on:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = top if logprobs_on else None
    else:
        if "prompt" not in body:
            raise RequestError("prompt is required", "prompt")
        prompt = _prompt(body["prompt"])
        mt_name = "max_tokens"
        max_tokens = _int(body, "max_tokens", None, 1, limits.max_tokens)
        default_tokens = 16
        logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    temperature = _float(body, "temperature", 1.0, 0.0, 100.0)
    if temperature < MIN_TEMPERATURE:
        raise RequestError(f"temperature must be at least {MIN_TEMPERATURE:g}, got {temperature!r}: greedy decoding "
                           "(temperature 0) is not a distribution SMC can target; use a small temperature such as "
                           "0.05", "temperature")
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"} or not stream):
        raise RequestError(f"stream_options must be {{'include_usage': bool}} with stream: true, got {so!r:.80}",
                           "stream_options")
    include_usage = bool(so and so.get("include_usage"))
    strategy = body.get("strategy", defaults.strategy)
    if strategy not in STRATEGIES:
        raise RequestError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}", "strategy")
    resampler = body.get("resampler", defaults.resampler)
    if resampler not in RESAMPLERS:
        raise RequestError(f"resampler must be one of {sorted(RESAMPLERS)}, got {resampler!r}", "resampler")
    constraint, param = None, None
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        constraint, param = fmt, "response_format"
    for name in ("regex", "grammar"):
        text = _text(body, name, empty_ok=name == "regex")  # (the regex "" allows only the empty text, as Regex(""))
        if text is not None:
            if constraint is not None:
                raise RequestError(f"give one constraint: {name} and {param} are both set", name)
            constraint, param = ((name, text, body.get("grammar_syntax", "lark")) if name == "grammar"
                                 else (name, text)), name
    if body.get("grammar_syntax") is not None and body.get("grammar_syntax") not in ("lark", "gbnf"):
        raise RequestError(f"grammar_syntax must be 'lark' or 'gbnf', got {body['grammar_syntax']!r}", "grammar_syntax")
    if strategy == "sd" and constraint is not None:
        raise RequestError(f"strategy 'sd' (exact speculative decoding) samples the model alone and cannot take "
                           f"{param}: use strategy 'smc' or 'ar'", param)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise RequestError(f"seed must be an integer in [0, 2**64), got {seed!r}", "seed")
    return Spec(
        endpoint=endpoint, prompt=prompt, max_tokens=max_tokens if max_tokens is not None else default_tokens,
        max_tokens_given=max_tokens is not None, temperature=temperature, seed=seed,
        n=_int(body, "n", 1, 1, limits.max_n), stop=_stop(body.get("stop")), stream=stream,
        include_usage=include_usage, logprobs=logprobs, strategy=strategy,
        particles=_int(body, "particles", defaults.particles, 1, limits.max_particles,
                       "raise the server's --max-particles to allow more"),
        block_size=_int(body, "block_size", defaults.block_size, 1, limits.max_block_size),
        resampler=resampler,
        ess_threshold=_float(body, "ess_threshold", defaults.ess_threshold, 0.0, 1.0, "0 never resamples, 1 always"),
        draft_temperature=(None if body.get("draft_temperature") is None
                           else _float(body, "draft_temperature", None, MIN_TEMPERATURE, 100.0)),
        constraint=constraint, constraint_param=param,
        return_particles=_bool(body, "return_particles", False),
        schema_in_prompt=_bool(body, "schema_in_prompt", True),
        extra={"max_tokens_param": mt_name},
    )


def compile_constraint(spec: Spec, model):
    """The spec's constraint as a potential bound to ``model`` (None without one); compile errors
    become a 400 naming the field that asked for it."""
    if spec.constraint is None:
        return None
    from ..potentials import Grammar, JSONSchema, Regex

    kind = spec.constraint[0]
    try:
        if kind == "regex":
            return Regex(spec.constraint[1]).bind(model)
        if kind == "grammar":
            return Grammar(spec.constraint[1], syntax=spec.constraint[2]).bind(model)
        return JSONSchema(json.dumps(spec.constraint[1]), extra_properties=False).bind(model)
    except SMCDecodeError as e:
        raise RequestError(f"{spec.constraint_param}: {e}", spec.constraint_param) from None
    except Exception as e:  # noqa: BLE001 - a grammar or schema compiler's own error types
        raise RequestError(f"{spec.constraint_param} could not be compiled ({type(e).__name__}: {str(e)[:200]})",
                           spec.constraint_param) from None
