"""Errors raised by smcdecode.

Every error says what was wrong, with the offending value, and what to do about it.
They subclass ``ValueError`` so callers that already catch bad arguments keep working.
"""

from __future__ import annotations

import math
from typing import Any


class SMCDecodeError(ValueError):
    """Bad input or an impossible request, explained in one line."""


class RewardError(SMCDecodeError):
    """A user reward function raised or returned a non-finite value."""


def _check_int(name: str, value: Any, minimum: int, kind: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        hint = f": {fix}" if fix else ""
        raise SMCDecodeError(f"{name} must be a {kind} integer, got {value!r}{hint}")
    return value


def check_positive_int(name: str, value: Any, fix: str = "") -> int:
    return _check_int(name, value, 1, "positive", fix)


def check_nonneg_int(name: str, value: Any, fix: str = "") -> int:
    return _check_int(name, value, 0, "non-negative", fix)


def check_temperature(name: str, value: Any) -> float:
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise SMCDecodeError(f"{name} must be a number > 0, got {value!r}") from None
    if not math.isfinite(t) or t <= 0:
        raise SMCDecodeError(
            f"{name} must be a finite number > 0, got {value!r}: greedy decoding (temperature 0) "
            "is not a distribution SMC can target; use a small temperature such as 0.05 instead"
        )
    return t


def check_finite_float(name: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise SMCDecodeError(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(x):
        raise SMCDecodeError(f"{name} must be a finite number, got {value!r}")
    return x


def check_unit_interval(name: str, value: Any, fix: str = "") -> float:
    x = check_finite_float(name, value)
    if not 0.0 <= x <= 1.0:
        hint = f": {fix}" if fix else ""
        raise SMCDecodeError(f"{name} must lie in [0, 1], got {value!r}{hint}")
    return x
