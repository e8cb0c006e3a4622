"""Reward tilts Φ(x) = exp(β·R(text(x))) with a user Python function R."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..errors import RewardError, SMCDecodeError, check_finite_float
from .base import Potential

MODES = ("prefix", "complete")


class Reward(Potential):
    """exp(β·R(text)), applied as a prefix twist or only at completion.

    ``mode="prefix"``: R scores every prefix; each SMC round adds β·(R(new) − R(old)), a twist that
    telescopes to β·(R(x) − R("")). ``mode="complete"``: β·R(x) is added when a particle finishes.
    Either way the target is ∝ p·exp(β·R(x)). ``batched=True`` means ``fn(list[str]) -> list[float]``.
    """

    role = "reward"

    def __init__(
        self,
        fn: Callable,
        beta: float = 1.0,
        mode: str = "complete",
        batched: bool = False,
        name: str | None = None,
    ):
        if not callable(fn):
            raise SMCDecodeError(f"reward fn must be callable, got {type(fn).__name__}")
        if mode not in MODES:
            raise SMCDecodeError(f"reward mode must be one of {MODES}, got {mode!r}")
        self.fn = fn
        self.beta = check_finite_float("beta", beta)
        self.mode = mode
        self.batched = bool(batched)
        self.name = str(name) if name else getattr(fn, "__name__", "reward")
        self.model = None

    def __repr__(self) -> str:
        return f"Reward({self.name}, beta={self.beta:g}, mode={self.mode!r})"

    def bind(self, model) -> Reward:
        if self.model is model:
            return self
        bound = Reward(self.fn, self.beta, self.mode, self.batched, self.name)
        bound.model = model
        return bound

    def __pow__(self, alpha: float) -> Reward:
        beta = check_finite_float("beta × alpha", self.beta * check_finite_float("alpha", alpha))
        bound = Reward(self.fn, beta, self.mode, self.batched, self.name)
        bound.model = self.model
        return bound

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """[B] float64 values R(text), checked: an exception or a non-finite value is a RewardError."""
        texts = list(texts)
        try:
            values = self.fn(texts) if self.batched else [self.fn(t) for t in texts]
        except Exception as e:
            raise RewardError(f"reward {self.name!r} raised {type(e).__name__}: {e}") from e
        if self.batched:
            if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
                raise RewardError(
                    f"batched reward {self.name!r} returned {type(values).__name__} {str(values)[:40]!r}: it must "
                    f"return one float per text (a list of {len(texts)})"
                )
            try:
                values = [float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in values]
            except Exception as e:
                raise RewardError(f"reward {self.name!r} raised {type(e).__name__}: {e}") from e
            if len(values) != len(texts):
                raise RewardError(
                    f"batched reward {self.name!r} returned {len(values)} values for {len(texts)} texts"
                )
        out = []
        for t, v in zip(texts, values):
            x = None
            if not isinstance(v, (str, bytes, complex)) and hasattr(v, "__float__"):
                try:
                    x = float(v)  # a Python, numpy or one-element torch number (bool: 0 or 1)
                except (TypeError, ValueError, RuntimeError, OverflowError):
                    x = None
            if x is None:
                raise RewardError(
                    f"reward {self.name!r} returned {type(v).__name__} {str(v)[:40]!r} (not a number) for text {t[:60]!r}: "
                    "return a float"
                )
            if not math.isfinite(x):
                raise RewardError(
                    f"reward {self.name!r} returned {x} for text {t[:60]!r}: rewards must be finite "
                    "(use a Regex constraint to forbid outputs)"
                )
            out.append(x)
        return torch.tensor(out, dtype=torch.float64)

    def _text(self, tokens) -> str:
        return self._require_model().decode(list(tokens))

    def prefix(self, tokens, prompt=()):
        if self.mode == "complete":
            return 0.0
        text = self._text(tokens)
        return float(tilt(self, self.scores([text]), texts=[text])[0])

    def complete(self, tokens, prompt=()):
        text = self._text(tokens)
        return float(tilt(self, self.scores([text]), texts=[text])[0])

    def logw_next(self, tokens, prompt=()):
        model = self._require_model()
        V = model.vocab_size
        if self.mode == "complete":
            out = torch.zeros(V, dtype=torch.float64)
            out[model.eos_token_id] = self.complete(tokens, prompt)
            return out
        base = self.scores([self._text(tokens)])  # R(x)
        texts = [self._text([*tokens, v]) for v in range(V)]
        out = tilt(self, self.scores(texts), base.expand(V), texts)
        out[model.eos_token_id] = 0.0  # complete(x) − prefix(x): both score the text of x
        return out


def tilt(reward, new: torch.Tensor, old: torch.Tensor | None = None, texts: Sequence[str] | None = None) -> torch.Tensor:
    """The log-weight β·(R_new − R_old) a reward adds (β·R_new without ``old``), float64 [B].

    Exact where float64 can hold it: β = 0 adds 0; R = -inf (an LMReward's log p' of a token the
    second model rules out) with β > 0 adds -inf, weight 0. A product that is not a finite
    float64 -- β·R overflowing past ±1.8e308, or +inf from β < 0 on R = -inf -- raises
    :class:`RewardError`: it must never silently become a weight."""
    beta = reward.beta
    if beta == 0.0:
        return torch.zeros_like(new, dtype=torch.float64)
    out = beta * (new if old is None else new - old)
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        if old is not None:  # β·R_new − β·R_old may fit where R_new − R_old overflowed
            out = torch.where(bad, beta * new - beta * old, out)
        zero = torch.isneginf(new) & (beta > 0)
        out = torch.where(zero, float("-inf"), out)
        bad = ~torch.isfinite(out) & ~zero
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            r = float(new[i])
            what = f"{beta:g} × {r:g}" if old is None else f"{beta:g} × ({r:g} − {float(old[i]):g})"
            where = f" for text {texts[i][:60]!r}" if texts is not None else ""
            fix = ("use beta > 0 with a reward that can be -inf (a log-probability)" if math.isinf(r) else
                   "rescale the reward or beta so that |beta·R| stays far below 1e308")
            raise RewardError(
                f"reward {reward.name!r}: beta × R = {what} is {float(out[i])}, not a finite log-weight{where}: {fix}"
            )
    return out
