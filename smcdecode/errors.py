"""Errors raised by smcdecode.

Every error says what was wrong, with the offending value, and what to do about it.
They subclass ``ValueError`` so callers that already catch bad arguments keep working.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


class SMCDecodeError(ValueError):
    """Bad input or an impossible request, explained in one line."""


class RewardError(SMCDecodeError):
    """A user reward function raised or returned a non-finite value."""


def _check_int(name: str, value: Any, minimum: int, kind: str, fix: str, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # (the fix is about the number)
        raise SMCDecodeError(f"{name} must be a {kind} integer, got {type(value).__name__} {value!r}")
    hint = f": {fix}" if fix else ""
    if value < minimum:
        raise SMCDecodeError(f"{name} must be a {kind} integer, got {value!r}{hint}")
    if maximum is not None and value > maximum:
        raise SMCDecodeError(f"{name} must be at most {maximum}, got {value!r}{hint}")
    return int(value)


def check_positive_int(name: str, value: Any, fix: str = "", maximum: int | None = None) -> int:
    return _check_int(name, value, 1, "positive", fix, maximum)


def check_nonneg_int(name: str, value: Any, fix: str = "", maximum: int | None = None) -> int:
    return _check_int(name, value, 0, "non-negative", fix, maximum)


def _as_float(name: str, value: Any, kind: str) -> float:
    """``value`` as a float; text, booleans and non-numbers are refused (``float("0.5")`` would
    accept a string silently)."""
    if not isinstance(value, (str, bytes, bool, complex)) and hasattr(value, "__float__"):
        try:
            return float(value)  # a Python, numpy or one-element torch number
        except (TypeError, ValueError, RuntimeError, OverflowError):
            pass
    raise SMCDecodeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")


MIN_TEMPERATURE = 1e-4  # logits / T stays far inside float32 (the engine divides in float32)


def check_temperature(name: str, value: Any) -> float:
    t = _as_float(name, value, "a number > 0")
    if not math.isfinite(t) or t < MIN_TEMPERATURE:
        raise SMCDecodeError(
            f"{name} must be a finite number >= {MIN_TEMPERATURE:g}, got {value!r}: greedy decoding (temperature 0) "
            "is not a distribution SMC can target, and tinier temperatures overflow the tempered logits; use a "
            "small temperature such as 0.05 instead"
        )
    return t


def check_finite_float(name: str, value: Any) -> float:
    x = _as_float(name, value, "a finite number")
    if not math.isfinite(x):
        raise SMCDecodeError(f"{name} must be a finite number, got {value!r}")
    return x


def check_unit_interval(name: str, value: Any, fix: str = "") -> float:
    x = check_finite_float(name, value)
    if not 0.0 <= x <= 1.0:
        hint = f": {fix}" if fix else ""
        raise SMCDecodeError(f"{name} must lie in [0, 1], got {value!r}{hint}")
    return x
