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


def ancestors(W: Tensor, scheme: str, generator: torch.Generator | None = None, n: Tensor | None = None) -> Tensor:
    """Ancestor indices A [G, M] for weights W [G, M] by ``scheme``, with E[#{j : A_j = i}] = n_g·W_i.

    ``n`` [G] long: group g uses its first n_g rows (its other rows have weight 0 and keep A_j = j);
    None: all M. ``scheme``: a name of ``RESAMPLERS``, or a callable (W, generator) -> A. The uniforms are float64 from ``generator`` (None: torch's global generator), drawn
    for the whole [G, M] (or [G, 1] for systematic) whatever ``n``, so the call is graph-capturable."""
    G, M = W.shape
    dev = W.device
    j = torch.arange(M, device=dev)[None, :]
    if callable(scheme):  # a user's resampler (W, generator) -> A, over all M rows of each group
        if n is not None:
            raise SMCDecodeError("a custom resampler runs over whole groups: give it groups without padding rows")
        return scheme(W, generator)
    Wd = W.double()
    nd = float(M) if n is None else n.double()[:, None]
    if scheme == "systematic":
        u = (j + torch.rand(G, 1, generator=generator, dtype=torch.float64, device=dev)) / nd
        A = inverse_cdf(Wd, u)
    elif scheme == "stratified":
        u = (j + torch.rand(G, M, generator=generator, dtype=torch.float64, device=dev)) / nd
        A = inverse_cdf(Wd, u)
    elif scheme == "multinomial":
        u = torch.rand(G, M, generator=generator, dtype=torch.float64, device=dev)
        if n is not None:
            u = torch.where(j < n[:, None], u, 2.0)  # (the unused columns sort last)
        u, _ = torch.sort(u, dim=-1)
        A = inverse_cdf(Wd, u)
    elif scheme == "residual":
        A = _residual(Wd, nd, j, generator)
    else:
        raise SMCDecodeError(f"unknown resampler {scheme!r}: choose one of {sorted(RESAMPLERS)}")
    return A if n is None else torch.where(j < n[:, None], A, j.expand(G, M))


def _residual(Wd: Tensor, nd, j: Tensor, generator: torch.Generator | None) -> Tensor:
    """floor(n·W_i) deterministic copies, the remaining R draws multinomial on the residuals."""
    G, M = Wd.shape
    total = Wd.sum(dim=-1, keepdim=True)
    # NOTE: a group whose weights are all 0 stays 0 here (0/0 would be NaN, cast to int below)
    Wn = torch.where(total > 0, Wd / total.clamp(min=1e-300), 0.0)
    counts = torch.floor(nd * Wn)
    R = nd - counts.sum(dim=-1, keepdim=True)  # [G, 1] remaining draws
    res = (nd * Wn - counts).clamp(min=0)
    res_total = res.sum(dim=-1, keepdim=True)
    res_W = torch.where(res_total > 0, res / res_total.clamp(min=1e-300), Wn)
    # NOTE: unsorted: the first R of M *sorted* uniforms are the R smallest, which biases the draws
    # towards low indices; the first R columns of i.i.d. uniforms are R independent draws.
    u = torch.rand(G, M, generator=generator, dtype=torch.float64, device=Wd.device)
    extra = inverse_cdf(res_W, u)  # [G, M]; only the first R columns are used
    counts = counts.long()
    counts.scatter_add_(1, extra, (j < R).long())
    return counts_to_ancestors(counts)


def multinomial(W: Tensor, generator: torch.Generator | None = None) -> Tensor:
    return ancestors(W, "multinomial", generator)


def stratified(W: Tensor, generator: torch.Generator | None = None) -> Tensor:
    return ancestors(W, "stratified", generator)


def systematic(W: Tensor, generator: torch.Generator | None = None) -> Tensor:
    return ancestors(W, "systematic", generator)


def residual(W: Tensor, generator: torch.Generator | None = None) -> Tensor:
    return ancestors(W, "residual", generator)


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
