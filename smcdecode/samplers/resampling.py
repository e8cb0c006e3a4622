"""Resampling schemes as tensor functions over groups of particles.

Every scheme maps normalised weights ``W [G, N]`` (rows sum to 1) and a generator to ancestor
indices ``A [G, N]`` with E[#{j : A_j = i}] = N·W_i. Inverse-CDF lookups use
``cumsum`` + ``searchsorted`` (O(N log N), no Python loop: the same code runs on a GPU).

NOTE: the uniforms are scaled by each row's total weight, so a float32 cumulative sum that ends
below 1 never sends a draw past the last particle, and the final index is clamped to the last
particle with positive weight. Zero-weight particles own an empty interval and are never chosen.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import SMCDecodeError


def inverse_cdf(W: Tensor, u: Tensor) -> Tensor:
    """Ancestors for uniforms u [G, M] in [0, 1) against weights W [G, N] (u need not be sorted;
    sorted u give sorted ancestors)."""
    cdf = torch.cumsum(W, dim=-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, (u * total).contiguous(), right=True)
    N = W.shape[-1]
    positive = W > 0
    last_positive = torch.where(positive, torch.arange(N, device=W.device), -1).amax(dim=-1, keepdim=True)
    return torch.minimum(idx, last_positive.clamp(min=0))


def multinomial(W: Tensor, generator: torch.Generator | None = None) -> Tensor:
    G, N = W.shape
    u = torch.rand(G, N, generator=generator, dtype=torch.float64, device=W.device)
    u, _ = torch.sort(u, dim=-1)
    return inverse_cdf(W.double(), u)


def stratified(W: Tensor, generator: torch.Generator | None = None) -> Tensor:
    G, N = W.shape
    u = torch.rand(G, N, generator=generator, dtype=torch.float64, device=W.device)
    u = (torch.arange(N, dtype=torch.float64, device=W.device) + u) / N
    return inverse_cdf(W.double(), u)


def systematic(W: Tensor, generator: torch.Generator | None = None) -> Tensor:
    G, N = W.shape
    u = torch.rand(G, 1, generator=generator, dtype=torch.float64, device=W.device)
    u = (torch.arange(N, dtype=torch.float64, device=W.device) + u) / N
    return inverse_cdf(W.double(), u)


def residual(W: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """floor(N·W_i) deterministic copies, the remaining R draws multinomial on the residuals."""
    G, N = W.shape
    total = W.double().sum(dim=-1, keepdim=True)
    # NOTE: a group whose weights are all 0 stays 0 here (0/0 would be NaN, cast to int below)
    Wd = torch.where(total > 0, W.double() / total.clamp(min=1e-300), 0.0)
    counts = torch.floor(N * Wd)
    R = (N - counts.sum(dim=-1, keepdim=True))  # [G, 1] remaining draws
    res = (N * Wd - counts).clamp(min=0)
    res_total = res.sum(dim=-1, keepdim=True)
    res_W = torch.where(res_total > 0, res / res_total.clamp(min=1e-300), Wd)
    # NOTE: unsorted: the first R of N *sorted* uniforms are the R smallest, which biases the draws
    # towards low indices; the first R columns of i.i.d. uniforms are R independent draws.
    u = torch.rand(G, N, generator=generator, dtype=torch.float64, device=W.device)
    extra = inverse_cdf(res_W, u)  # [G, N]; only the first R columns are used
    use = torch.arange(N, device=W.device)[None, :] < R
    counts = counts.long()
    counts.scatter_add_(1, extra, use.long())
    return counts_to_ancestors(counts)


def counts_to_ancestors(counts: Tensor) -> Tensor:
    """Offspring counts [G, N] (rows sum to N) -> sorted ancestor indices [G, N]."""
    G, N = counts.shape
    ends = torch.cumsum(counts, dim=-1)
    j = torch.arange(N, device=counts.device).expand(G, N).contiguous()
    return torch.searchsorted(ends, j, right=True).clamp(max=N - 1)


RESAMPLERS: dict[str, Callable[[Tensor, torch.Generator | None], Tensor]] = {
    "multinomial": multinomial,
    "stratified": stratified,
    "systematic": systematic,
    "residual": residual,
}


def get_resampler(name: str) -> Callable[[Tensor, torch.Generator | None], Tensor]:
    if callable(name):
        return name
    if name not in RESAMPLERS:
        raise SMCDecodeError(f"unknown resampler {name!r}: choose one of {sorted(RESAMPLERS)}")
    return RESAMPLERS[name]


def normalise(log_w: Tensor) -> tuple[Tensor, Tensor]:
    """softmax over the particle dimension and ESS = 1/ΣW², per group; a group whose weights are
    all -inf gets W = 0 and ESS = 0 (never NaN)."""
    lse = torch.logsumexp(log_w, dim=-1, keepdim=True)
    ok = torch.isfinite(lse)
    W = torch.where(ok, torch.exp(log_w - torch.where(ok, lse, 0.0)), 0.0)
    ess = torch.where(ok.squeeze(-1), 1.0 / (W * W).sum(dim=-1).clamp(min=1e-300), 0.0)
    return W, ess
