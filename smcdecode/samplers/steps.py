"""The maths of an SMC-SD round, once: batched tensor steps with per-row parameters.

Rows are particles (G groups × M rows, group g using its first n_g rows); every parameter may be
given per row (temperatures, the power α, the number of drafts that count, budgets) so one call
serves every mix of settings. The reference request loop (``samplers.loop``; its round is in
``samplers.smc_sd``) runs these eagerly; the engine runs the same functions inside its CUDA graphs,
and its fused Triton sampler implements
:func:`sample_and_score` (``backends.engine.sampling`` dispatches between the two; a test checks
that they agree draw for draw under the same noise bits).

    race               one draw per row ∝ exp(log w) by the exponential race (Gumbel-max)
    sample_and_score   x = logits / T: draw ∝ exp(α·x)·1[valid], its log-prob, the normaliser
                       log Σ_v p^α 1[valid], and log p at gathered tokens (one read of the logits)
    propose            one masked draft step: token ~ q' and log q'(token)
    bonus              the bonus token ~ π_loc ∝ p^α·1[valid] and its log-normaliser
    weigh              incremental log-weights of a round's drafts (to the first EOS and the budget)
    reject_cut         −inf for sequences cut at their budget that a constraint does not accept
    resample           ESS, the τ rule, ancestors (segmented, any scheme) and the log Ẑ increment

Randomness is injected: a ``torch.Generator`` (None: torch's global one), or ``bits`` — int32
random bits, one per element of the logits — from which the uniforms are formed exactly as the
Triton kernel forms them (:func:`uniform_from_bits`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .resampling import ancestors, normalise

NEG_INF = float("-inf")


def uniform_from_bits(bits: Tensor) -> Tensor:
    """float32 U in (0, 1) strictly, on a 2^-23 grid, from 32 random bits per element (int32 or
    int64 holding the unsigned value): ((bits as uint32) >> 9)·2^-23 + 2^-24. The fused Triton
    sampler forms its uniforms this way from Philox bits."""
    b = bits.to(torch.int64) & 0xFFFFFFFF
    return (b >> 9).to(torch.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08


def exponential_noise(like: Tensor, generator: torch.Generator | None = None, bits: Tensor | None = None) -> Tensor:
    """E ~ Exp(1) of ``like``'s shape: −log U with U from ``bits`` (float32, as the kernel), else
    −log1p(−u), u ~ U[0, 1) float64 from ``generator``."""
    if bits is not None:
        if bits.shape != like.shape:
            raise ValueError(f"bits has shape {tuple(bits.shape)}, the logits {tuple(like.shape)}: give one "
                             "random word per element")
        return -torch.log(uniform_from_bits(bits.to(like.device)))
    u = torch.rand(like.shape, generator=generator, dtype=torch.float64, device=like.device)
    return -torch.log1p(-u)


def race(log_weights: Tensor, generator: torch.Generator | None = None, bits: Tensor | None = None) -> Tensor:
    """One draw per row from softmax(log_weights) [..., V]: argmax_v (log w_v − log E_v), E_v ~ Exp(1)
    (the exponential race; −log E is Gumbel noise). No host sync. -inf entries never win; a row that
    is all -inf returns index 0 (callers give it weight -inf)."""
    e = exponential_noise(log_weights, generator, bits)
    if bits is None:
        return torch.argmax(log_weights.double() - torch.log(e.clamp(min=1e-300)), dim=-1)
    return torch.argmax(log_weights - torch.log(e).to(log_weights.dtype), dim=-1)


class Scored(NamedTuple):
    """What :func:`sample_and_score` returns for R rows."""

    token: Tensor  # [R] long: the drawn token (−1 on rows that do not draw)
    log_prob: Tensor  # [R]: log π(token), π ∝ exp(α·x)·1[valid] (−inf on dead rows, nan where no draw)
    log_norm: Tensor | None  # [R]: log Σ_v p(v)^α·1[valid] (−inf on dead rows); None without α and mask
    gathered: Tensor | None  # [R]: log p(gather) (unmasked, α = 1); None without gather


def _per_row(value, R: int, like: Tensor) -> Tensor:
    """A scalar or [R] parameter as an [R, 1] tensor of ``like``'s dtype and device."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return t.reshape(1, 1) if t.dim() == 0 else t.reshape(R, 1)


def sample_and_score(logits: Tensor, temperature: float | Tensor, *, alpha: float | Tensor | None = None,
                     mask: Tensor | None = None, gather: Tensor | None = None, sample_every: int = 1,
                     draw: bool = True, generator: torch.Generator | None = None,
                     bits: Tensor | None = None) -> Scored:
    """For each row of ``logits`` [R, V] with x = logits · (1 / T) (T a float or [R]), p = softmax(x):

      token     ~ π(v) ∝ exp(α·x_v)·1[valid(v)] = p(v)^α·1[valid] / Σ, by :func:`race`;
      log_prob  log π(token);
      log_norm  log Σ_v p(v)^α·1[valid(v)]  (the bonus normaliser; 0 for α = 1 and no mask);
      gathered  log p(gather) (the target's unmasked log-probability, α = 1).

    ``alpha`` a float or [R] (None: 1), ``mask`` [R, V] bool (None: every token valid). A dead row (nothing
    valid) draws from the unmasked π so the batch still gets a token its model can produce; its
    log_prob and log_norm are −inf. ``sample_every`` = S: only rows r with r % S == S − 1 draw
    (``draw`` False: none); the others return token −1 and log_prob nan. Arithmetic in float32
    (float64 for float64 logits), as the fused kernel: the two agree draw for draw on ``bits``."""
    if sample_every < 1:
        raise ValueError(f"sample_every = {sample_every}: must be >= 1 (1: every row draws a token)")
    R, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if isinstance(temperature, Tensor):
        inv_t = (1.0 / temperature.to(device=logits.device, dtype=dtype)).reshape(-1, 1).expand(R, 1)
    else:
        inv_t = 1.0 / temperature
    x = logits.to(dtype) * inv_t
    lse = torch.logsumexp(x, -1)
    gathered = None
    if gather is not None:
        gathered = torch.where(torch.isneginf(lse), NEG_INF, x.gather(1, gather[:, None])[:, 0] - lse)
    general = alpha is not None or mask is not None
    y = x * _per_row(alpha, R, x) if alpha is not None else x
    dead = None
    if mask is not None:
        dead = ~mask.any(-1)
        y = y.masked_fill(~(mask | dead[:, None]), NEG_INF)
    lse_y = torch.logsumexp(y, -1) if general else lse
    log_norm = None
    if general:
        a = _per_row(alpha, R, x)[:, 0] if alpha is not None else 1.0
        log_norm = torch.where(torch.isneginf(lse_y) | torch.isneginf(lse), NEG_INF, lse_y - a * lse)
        if dead is not None:
            log_norm = torch.where(dead, NEG_INF, log_norm)
    token = torch.full((R,), -1, dtype=torch.long, device=logits.device)
    log_prob = torch.full((R,), float("nan"), dtype=dtype, device=logits.device)
    if draw:
        s = slice(sample_every - 1, None, sample_every)
        t = race(y[s], generator, None if bits is None else bits[s])
        lp = y[s].gather(1, t[:, None])[:, 0] - lse_y[s]
        none = torch.isneginf(lse_y[s]) if dead is None else torch.isneginf(lse_y[s]) | dead[s]
        lp = torch.where(none, NEG_INF, lp)  # (no valid token with mass: q' = 0, never nan)
        if sample_every == 1:
            token, log_prob = t, lp
        else:
            token[s], log_prob[s] = t, lp
    return Scored(token, log_prob, log_norm, gathered)


def propose(logits: Tensor, temperature: float | Tensor, mask: Tensor | None = None, *,
            generator: torch.Generator | None = None, bits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One draft step for every row: d ~ q'(v) = q(v)·1[valid]/Z_q with q = softmax(logits / T_row),
    and log q'(d) [R] (−inf on a dead row, whose token comes from the unmasked q)."""
    s = sample_and_score(logits, temperature, mask=mask, generator=generator, bits=bits)
    return s.token, s.log_prob


def bonus(logits: Tensor, temperature: float | Tensor, alpha: float | Tensor | None = 1.0, mask: Tensor | None = None, *,
          generator: torch.Generator | None = None, bits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The bonus token b ~ π_loc(v) ∝ p_T(v)^α·1[valid] and log Σ_v p_T(v)^α·1[valid] [R] (the
    normaliser that enters the weight; −inf on a dead row)."""
    s = sample_and_score(logits, temperature, alpha=alpha, mask=mask, generator=generator, bits=bits)
    log_norm = s.log_norm if s.log_norm is not None else torch.zeros_like(s.log_prob)
    return s.token, log_norm


class Weights(NamedTuple):
    """What :func:`weigh` returns for B rows."""

    incr: Tensor  # [B] float64 incremental log-weight
    n_new: Tensor  # [B] long: tokens the round adds (drafts to the first EOS, + the bonus)
    any_eos: Tensor  # [B] bool: a counted draft is EOS
    has_bonus: Tensor  # [B] bool: the bonus is taken (and its normaliser counted)


def weigh(log_p: Tensor, log_q: Tensor, drafts: Tensor, alpha, k: Tensor | int, eos: int,
          log_norm: Tensor | None = None, bonus_allowed: Tensor | bool = False) -> Weights:
    """Incremental log-weights of a round: with d_1..d_K the drafts [B, K], log p_T(d_i) and log q'(d_i)
    [B, K], ``k`` [B] (or int) drafts that count (min(K_row, budget left)):

        incr = Σ_{i ≤ first EOS, i ≤ k} [α·log p_T(d_i) − log q'(d_i)]  +  log_norm (when the bonus is taken)

    A draft with log q' = −inf (a dead end) makes the term −inf. The bonus is taken where
    ``bonus_allowed`` and no counted draft is EOS; n_new = drafts to the first EOS, else k (+1 with a bonus)."""
    B, K = drafts.shape
    dev = drafts.device
    k = torch.as_tensor(k, device=dev).expand(B)
    in_budget = torch.arange(K, device=dev)[None, :] < k[:, None]
    is_eos = (drafts == eos) & in_budget
    keep = ((torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0) & in_budget
    a = alpha[:, None] if isinstance(alpha, Tensor) else alpha
    term = torch.where(torch.isneginf(log_q), NEG_INF, a * log_p - log_q)
    incr = torch.where(keep, term, 0.0).double().sum(1)
    any_eos = is_eos.any(1)
    first = is_eos.long().argmax(1) if K > 0 else torch.zeros(B, dtype=torch.long, device=dev)
    n_new = torch.where(any_eos, first + 1, k)
    has_bonus = ~any_eos & torch.as_tensor(bonus_allowed, device=dev)
    if log_norm is not None:
        incr = incr + torch.where(has_bonus, log_norm.double(), 0.0)
    n_new = torch.where(has_bonus, k + 1, n_new)
    return Weights(incr, n_new, any_eos, has_bonus)


def accept_prefix(log_p: Tensor, log_q: Tensor, k: Tensor | int, u: Tensor) -> Tensor:
    """Exact speculative decoding's acceptance: draft d_i (i < k) is accepted when u_i < min(1, p/q),
    i.e. log u_i < log p(d_i) − log q(d_i); returns the number of leading accepted drafts [B]."""
    B, K = log_p.shape
    k = torch.as_tensor(k, device=log_p.device).expand(B)
    ok = (torch.log(u) < log_p.double() - log_q.double()) & (torch.arange(K, device=log_p.device)[None] < k[:, None])
    return torch.cumprod(ok.long(), 1).sum(1)


def residual(target_logits: Tensor, draft_logits: Tensor, target_temperature, draft_temperature) -> Tensor:
    """log (p − q)+ [R, V] (−inf where p ≤ q), p = softmax(target_logits / T_t), q = softmax(draft_logits / T_d)
    (per-row temperatures as [R] tensors or numbers): the distribution of the token exact speculative
    decoding draws at its first rejection. A row with no positive mass (p = q) gives log p instead."""
    R = target_logits.shape[0]
    p = torch.softmax(target_logits.double() / _per_row(target_temperature, R, target_logits).double(), -1)
    q = torch.softmax(draft_logits.double() / _per_row(draft_temperature, R, draft_logits).double(), -1)
    res = (p - q).clamp_min(0.0)
    empty = (res.sum(-1, keepdim=True) <= 0)
    return torch.log(torch.where(empty, p, res))


def reject_cut(incr: Tensor, ended: Tensor, hit_eos: Tensor, accepting: Tensor) -> Tensor:
    """−inf where a sequence ended without EOS (cut at its budget) in a state no constraint accepts."""
    return torch.where(ended & ~hit_eos & ~accepting, NEG_INF, incr)


class Resampled(NamedTuple):
    """What :func:`resample` returns for G groups of M rows."""

    ancestors: Tensor  # [G, M] long: row j's parent (j itself where the group does not resample)
    resampled: Tensor  # [G] bool
    W: Tensor  # [G, M] normalised weights before resampling
    ess: Tensor  # [G] 1 / Σ W²
    log_Z_incr: Tensor  # [G] float64: logsumexp(log w) − log n_g where resampled, else 0
    log_w: Tensor  # [G, M] after: 0 on a resampled group's rows (−inf stays on its padding rows)


def resample(log_w: Tensor, tau: float, scheme: str, *, n: Tensor | None = None, live: Tensor | None = None,
             generator: torch.Generator | None = None, sync: bool = False) -> Resampled:
    """Per group g of ``log_w`` [G, M] (rows j ≥ n_g are padding with log w = −inf; ``n`` None: all M):
    W = softmax(log w), ESS = 1/ΣW²; resample when the group is ``live`` (None: always), ESS > 0 and
    ESS < τ·n_g (every round for τ ≥ 1, never for τ = 0); ancestors by ``scheme`` over the n_g rows
    (E[#children of i] = n_g·W_i); log Ẑ += logsumexp(log w) − log n_g; resampled weights restart at 0.

    ``sync``: the caller's loop is on the host — ancestors are drawn (and the generator advanced)
    only when some group resamples (one host sync). Else they are drawn every call (no sync)."""
    G, M = log_w.shape
    dev = log_w.device
    W, ess = normalise(log_w)
    n_d = float(M) if n is None else n.double()
    do = (ess > 0) & ((ess < tau * n_d) | (tau >= 1.0))
    if live is not None:
        do = do & live
    j = torch.arange(M, device=dev)[None, :]
    if sync and not bool(do.any()):
        A = j.expand(G, M)
    else:
        A = torch.where(do[:, None], ancestors(W, scheme, generator, n), j)
    log_Z_incr = torch.where(do, log_mean_weight(log_w, M if n is None else n), 0.0)
    reset = do[:, None] if n is None else do[:, None] & (j < n[:, None])
    new_log_w = torch.where(reset, 0.0, log_w)
    return Resampled(A, do, W, ess, log_Z_incr, new_log_w)


def log_mean_weight(log_w: Tensor, n: Tensor | int) -> Tensor:
    """logsumexp(log w) − log n per group [G]: the final term of log Ẑ."""
    log_n = torch.log(n.double()) if isinstance(n, Tensor) else math.log(n)
    return torch.logsumexp(log_w, dim=1) - log_n
