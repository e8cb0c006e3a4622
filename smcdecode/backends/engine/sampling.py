"""Drawing tokens on the engine: the exponential race (Gumbel-max) with the log-probabilities a
round needs, in one read of the logits. ``sample_and_score`` is the fused Triton kernel
(kernels/sampling.py) with ``triton``, else ``sample_and_score_reference``."""

from __future__ import annotations

import torch
from torch import Tensor


def sample_exponential_race(scaled_logits: Tensor) -> Tensor:
    """One draw per row from softmax(scaled_logits) [B, V]: argmax_v (x_v − log E_v), E ~ Exp(1)."""
    e = torch.empty_like(scaled_logits, dtype=torch.float32).exponential_()
    return torch.argmax(scaled_logits.float() - e.log(), dim=-1)


def sample_and_score_reference(logits: Tensor, temperature: float, gather: Tensor | None = None,
                               generator: torch.Generator | None = None, sample_every: int = 1
                               ) -> tuple[Tensor, Tensor, Tensor | None]:
    """x = logits [R, V] / temperature -> (token ~ softmax(x) [R], log softmax(x)[token] [R],
    log softmax(x)[gather] [R] or None), float32. The torch reference of the fused Triton kernel.
    ``sample_every`` = S > 1: only rows r with r % S == S − 1 draw a token (and noise); the others
    return token −1 and log-prob nan."""
    if sample_every < 1:
        raise ValueError(f"sample_every = {sample_every}: must be >= 1 (1: every row draws a token)")
    x = logits.float() / temperature
    lse = torch.logsumexp(x, -1)
    xs = x[sample_every - 1 :: sample_every]  # [R / S, V] the rows that draw
    e = torch.empty_like(xs).exponential_(generator=generator)
    drawn = torch.argmax(xs - e.log(), dim=-1)
    lp_drawn = xs.gather(1, drawn[:, None])[:, 0] - lse[sample_every - 1 :: sample_every]
    if sample_every == 1:
        tok, lp_tok = drawn, lp_drawn
    else:
        tok = torch.full_like(lse, -1, dtype=torch.long)
        lp_tok = torch.full_like(lse, float("nan"))
        tok[sample_every - 1 :: sample_every] = drawn
        lp_tok[sample_every - 1 :: sample_every] = lp_drawn
    lp_gather = x.gather(1, gather[:, None])[:, 0] - lse if gather is not None else None
    return tok, lp_tok, lp_gather


def sample_and_score(logits: Tensor, temperature: float, seed: Tensor, gather: Tensor | None = None,
                     sample_every: int = 1, triton: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """With ``triton`` one fused kernel (one read of the [R, V] logits; randomness keyed by the device
    scalar ``seed``), else the reference (torch's global generator). ``sample_every``: see the
    reference."""
    if triton:
        from .kernels.sampling import triton_sample_and_score

        return triton_sample_and_score(logits, temperature, seed, gather, sample_every)
    return sample_and_score_reference(logits, temperature, gather, sample_every=sample_every)
