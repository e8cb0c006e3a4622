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
        self.name = name or getattr(fn, "__name__", "reward")
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
        bound = Reward(self.fn, self.beta * check_finite_float("alpha", alpha), self.mode, self.batched, self.name)
        bound.model = self.model
        return bound

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """[B] float64 values R(text), checked: an exception or a non-finite value is a RewardError."""
        texts = list(texts)
        try:
            if self.batched:
                values = list(self.fn(texts))
                if len(values) != len(texts):
                    raise RewardError(
                        f"batched reward {self.name!r} returned {len(values)} values for {len(texts)} texts"
                    )
            else:
                values = [self.fn(t) for t in texts]
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {self.name!r} raised {type(e).__name__}: {e}") from e
        out = []
        for t, v in zip(texts, values):
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise RewardError(f"reward {self.name!r} returned {v!r} (not a number) for text {t[:60]!r}") from None
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
        return self.beta * float(self.scores([self._text(tokens)])[0])

    def complete(self, tokens, prompt=()):
        return self.beta * float(self.scores([self._text(tokens)])[0])

    def logw_next(self, tokens, prompt=()):
        model = self._require_model()
        base = self.prefix(tokens, prompt)
        if self.mode == "complete":
            out = torch.zeros(model.vocab_size, dtype=torch.float64)
        else:
            texts = [self._text([*tokens, v]) for v in range(model.vocab_size)]
            out = self.beta * self.scores(texts) - base
        out[model.eos_token_id] = self.complete(tokens, prompt) - base
        return out
