"""Language-model potential: p_T(x)^α, an LM at temperature T raised to a power α."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import SMCDecodeError, check_finite_float, check_temperature
from ..models import Model
from .base import Potential


class LM(Potential):
    """Φ(x) = p_T(x | prompt)^α, with p_T the model's next-token distribution at temperature T.

    ``LM(model, temperature=0.7) ** 2`` is the power target p_T^2 (``alpha`` multiplies).
    """

    role = "lm"

    def __init__(self, model: Model, temperature: float = 1.0, alpha: float = 1.0):
        if not isinstance(model, Model):
            raise SMCDecodeError(
                f"model must be a smcdecode Model (load_model(...) or FunctionModel(...)), got {type(model).__name__}"
            )
        self.model = model
        self.temperature = check_temperature("temperature", temperature)
        self.alpha = _check_alpha(alpha)

    def __repr__(self) -> str:
        power = f" ** {self.alpha:g}" if self.alpha != 1 else ""
        return f"LM({self.model.name}, T={self.temperature:g}){power}"

    def __pow__(self, alpha: float) -> LM:
        return LM(self.model, self.temperature, self.alpha * _check_alpha(alpha))

    def log_probs(self, logits: Tensor) -> Tensor:
        """log p_T from raw logits (last dim = vocabulary)."""
        return torch.log_softmax(logits.float() / self.temperature, dim=-1)

    def _token_logprobs(self, tokens: Sequence[int], prompt: Sequence[int]) -> Tensor:
        """[len(tokens)+1, V] log p_T(· | prompt, x_<i) for i = 0..len(tokens)."""
        if not prompt:
            raise SMCDecodeError("the LM potential needs a non-empty prompt to condition on")
        runner = self.model.start(list(prompt[:-1]), 1)
        feed = torch.tensor([[prompt[-1], *tokens]], dtype=torch.long)
        return self.log_probs(runner.extend(feed)[0]).double().cpu()  # the scoring path is CPU float64

    def prefix(self, tokens, prompt=()):
        lp = self._token_logprobs(tokens, prompt)
        idx = torch.tensor(list(tokens), dtype=torch.long)
        return float(self.alpha * lp[:-1].gather(1, idx[:, None]).sum()) if len(idx) else 0.0

    def complete(self, tokens, prompt=()):
        lp = self._token_logprobs(tokens, prompt)
        idx = torch.tensor([*tokens, self.model.eos_token_id], dtype=torch.long)
        return float(self.alpha * lp.gather(1, idx[:, None]).sum())

    def logw_next(self, tokens, prompt=()):
        return self.alpha * self._token_logprobs(tokens, prompt)[-1]

    def batch_logw_next(self, seqs, prompt=()):
        seqs = [list(s) for s in seqs]
        if not seqs:
            return torch.empty(0, self.model.vocab_size, dtype=torch.float64)
        if len({len(s) for s in seqs}) != 1:
            return super().batch_logw_next(seqs, prompt)
        # one batched forward for equal-length sequences
        runner = self.model.start(list(prompt[:-1]), len(seqs))
        feed = torch.tensor([[prompt[-1], *s] for s in seqs], dtype=torch.long)
        return self.alpha * self.log_probs(runner.extend(feed)[:, -1]).double().cpu()


MAX_ALPHA = 1e3  # p^α with larger α is the arg-max to float64 precision; T/α must stay a float32 temperature


def _check_alpha(alpha) -> float:
    a = check_finite_float("power alpha", alpha)
    if not 0 < a <= MAX_ALPHA:
        raise SMCDecodeError(f"power alpha must be a number in (0, {MAX_ALPHA:g}], got {alpha!r}")
    return a
