"""Decimal numbers in a range as regular expressions (``schema_regex``'s bounded integers and numbers),
and the small regex helpers ``schema_regex`` shares: a repetition count, a parsed pattern's opcodes."""

from __future__ import annotations

_FRAC_ANY, _FRAC_ZERO, _FRAC_NONZERO = r"(?:\.[0-9]+)?", r"(?:\.0+)?", r"\.[0-9]*[1-9][0-9]*"
_D = "[0-9]"


def _alt(options: list[str]) -> str:
    options = list(dict.fromkeys(options))
    if len(options) == 1:
        return options[0]
    return "(?:" + "|".join(options) + ")"


def _same_length(x: str, y: str) -> str:
    """Digit strings of len(x) from x to y (equal lengths, x <= y, leading zeros allowed)."""
    if x == y:
        return x
    if len(x) == 1:
        return f"[{x}-{y}]"
    if x[0] == y[0]:
        return x[0] + _same_length(x[1:], y[1:])
    n = len(x) - 1
    parts = [x[0] + _same_length(x[1:], "9" * n)]
    if int(x[0]) + 1 <= int(y[0]) - 1:
        parts.append(f"[{int(x[0]) + 1}-{int(y[0]) - 1}]" + _D + f"{{{n}}}")
    parts.append(y[0] + _same_length("0" * n, y[1:]))
    return _alt(parts)


def _naturals(lo: int, hi: int | None) -> str:
    """Decimal integers from lo to hi (None: unbounded), 0 <= lo, without leading zeros; "" if none."""
    if hi is not None and lo > hi:
        return ""
    parts = []
    if lo == 0:
        parts.append("0")
        if hi == 0:
            return "0"
        lo = 1
    top = len(str(hi)) if hi is not None else len(str(lo))
    for d in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (d - 1))
        b = 10**d - 1 if hi is None or d < top else hi
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    if hi is None:
        parts.append("[1-9]" + _D + f"{{{len(str(lo))},}}")
    return _alt(parts)


def _magnitude(lo: int, lo_open: bool, hi: int | None, hi_open: bool) -> str:
    """Decimals M = I(.F)? (no exponent) with lo <(=) M <(=) hi, 0 <= lo, lo and hi integers; "" if none."""
    if hi is not None and hi <= lo:
        return str(lo) + _FRAC_ZERO if hi == lo and not (lo_open or hi_open) else ""
    parts = [str(lo) + (_FRAC_NONZERO if lo_open else _FRAC_ANY)]
    inner = _naturals(lo + 1, None if hi is None else hi - 1)
    if inner:
        parts.append("(?:" + inner + ")" + _FRAC_ANY)
    if hi is not None and not hi_open:
        parts.append(str(hi) + _FRAC_ZERO)
    return _alt(parts)


def _count(lo: int, hi: int | None) -> str:
    if hi is None:
        return "*" if lo == 0 else ("+" if lo == 1 else f"{{{lo},}}")
    return "" if lo == hi == 1 else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _ops(tree) -> set:
    """Every opcode name in a parsed ``re`` pattern."""
    out = set()
    for op, arg in tree:
        out.add(str(op))
        for a in arg if isinstance(arg, (list, tuple)) else [arg]:
            if hasattr(a, "data"):
                out |= _ops(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if hasattr(b, "data"):
                        out |= _ops(b)
    return out
