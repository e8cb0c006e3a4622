"""Sampling and scoring over [R, V] logits in one read (two launches: splits, then a merge per row):
exponential-race sampling, the log-sum-exp and the gather of log q(d); rows that need no token
(verify's scored rows) skip the noise and the race. Reference: the engine's sampling.sample_and_score_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import num_sms, pdl_args, pdl_enter


@triton.jit
def _ratio_block(LOGITS, r, c, Q: tl.constexpr, stride_r, inv_temp, b0, b1, b2, b3, m, acc, best_e, best_E,
                 best_idx, best_x, V: tl.constexpr, RACE: tl.constexpr):
    """Elements c, c + Q, c + 2Q, c + 3Q (the four quarters of a block; ``b0``..``b3`` their random
    bits) folded into the per-lane running max m, Σ exp(x − m) and (RACE) the race's best element.
    The max is taken over the four first, so a lane pays five ``exp`` for four elements (one rescale)
    instead of eight. The race compares p / E = exp(x − m) / E (E = −log U exponential; the same
    argmax as the Gumbel key x − log E, without its second log and reusing exp(x − m)) as products,
    e·E_best > e_best·E (no division); e_best is rescaled with the sum when the max grows, and the
    split's key x_best − log E_best is formed once per lane at the end."""
    c1 = c + Q
    c2 = c1 + Q
    c3 = c2 + Q
    row = LOGITS + r * stride_r
    x0 = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32) * inv_temp
    x1 = tl.load(row + c1, mask=c1 < V, other=float("-inf")).to(tl.float32) * inv_temp
    x2 = tl.load(row + c2, mask=c2 < V, other=float("-inf")).to(tl.float32) * inv_temp
    x3 = tl.load(row + c3, mask=c3 < V, other=float("-inf")).to(tl.float32) * inv_temp
    m_new = tl.maximum(tl.maximum(m, x0), tl.maximum(tl.maximum(x1, x2), x3))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    e0 = tl.exp(x0 - m_safe)
    e1 = tl.exp(x1 - m_safe)
    e2 = tl.exp(x2 - m_safe)
    e3 = tl.exp(x3 - m_safe)
    acc = acc * alpha + ((e0 + e1) + (e2 + e3))
    if RACE:
        best_e = best_e * alpha
        best_e, best_E, best_idx, best_x = _ratio_pick(e0, x0, c, b0, best_e, best_E, best_idx, best_x)
        best_e, best_E, best_idx, best_x = _ratio_pick(e1, x1, c1, b1, best_e, best_E, best_idx, best_x)
        best_e, best_E, best_idx, best_x = _ratio_pick(e2, x2, c2, b2, best_e, best_E, best_idx, best_x)
        best_e, best_E, best_idx, best_x = _ratio_pick(e3, x3, c3, b3, best_e, best_E, best_idx, best_x)
    return m_new, acc, best_e, best_E, best_idx, best_x


@triton.jit
def _ratio_pick(e, x, c, bits, best_e, best_E, best_idx, best_x):
    """One element (e = exp(x − m), its index c and random bits) against the lane's best (e_best,
    E_best): it wins when e / E > e_best / E_best. An element with e = 0 (masked, or below exp's range
    relative to the lane's max) never wins."""
    E = -tl.log(_uniform(bits))
    better = e * best_E > best_e * E
    best_e = tl.where(better, e, best_e)
    best_E = tl.where(better, E, best_E)
    best_idx = tl.where(better, c, best_idx)
    best_x = tl.where(better, x, best_x)
    return best_e, best_E, best_idx, best_x


@triton.jit
def _uniform(bits):
    """U in (0, 1) strictly, on a 2^-23 grid, from 32 random bits (tl.rand can round up to exactly
    1.0, which would give E = 0 and an infinite key whatever the logit)."""
    return (bits.to(tl.uint32, bitcast=True) >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08


@triton.jit
def _sample_split_chunk(LOGITS, seed, r, s, stride_r, inv_temp, V: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, RACE: tl.constexpr):
    """Per-lane running max and Σ exp(x − max) over split s of row r, and (RACE) the lane's best
    exponential-race key with its index and x. A block of BLOCK elements is four quarters of BLOCK/4
    lanes; one Philox call (``tl.randint4x``, keyed by the row, the block and the lane) gives a lane
    its 32 random bits in all four quarters, so the noise costs a quarter of a call per element and
    an element's noise depends only on (seed, row, element). The four quarters are folded in at once
    (``_ratio_block``)."""
    Q: tl.constexpr = BLOCK // 4
    q = tl.arange(0, Q)
    m = tl.full([Q], float("-inf"), tl.float32)  # running max of x (per lane)
    acc = tl.zeros([Q], tl.float32)  # Σ exp(x − m) per lane
    best_e = tl.zeros([Q], tl.float32)  # exp(x_best − m) of the lane's best element
    best_E = tl.full([Q], 1.0, tl.float32)
    best_idx = tl.zeros([Q], tl.int32)
    best_x = tl.zeros([Q], tl.float32)
    n_blocks = (V + BLOCK - 1) // BLOCK  # blocks of a row
    for c0 in range(0, CHUNK, BLOCK):
        base = s * CHUNK + c0
        if RACE:
            b0, b1, b2, b3 = tl.randint4x(seed, (r * n_blocks + base // BLOCK) * Q + q)
        else:  # (no noise: the bits are not read)
            b0 = q
            b1 = q
            b2 = q
            b3 = q
        m, acc, best_e, best_E, best_idx, best_x = _ratio_block(LOGITS, r, base + q, Q, stride_r, inv_temp,
                                                                b0, b1, b2, b3, m, acc, best_e, best_E,
                                                                best_idx, best_x, V, RACE)
    # the lane's key x_best − log E_best (−inf where nothing won)
    best_key = tl.where(best_e > 0, best_x - tl.log(best_E), float("-inf"))
    return m, acc, best_key, best_idx, best_x


@triton.jit
def _sample_split_kernel(LOGITS, SEED, stride_r, inv_temp, PART, V: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr, NSPLIT: tl.constexpr, SAMPLE_EVERY: tl.constexpr,
                         PDL: tl.constexpr = 0):
    """Split s of row r: (max, Σ exp(x − max), best race key, its index, its x) into PART. Rows with
    r % SAMPLE_EVERY != SAMPLE_EVERY − 1 run no race (no noise drawn; key −inf). The noise of an
    element is keyed by (seed, r·V + c) whatever SAMPLE_EVERY, so a sampled row draws the same token."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    seed = tl.load(SEED)
    if r % SAMPLE_EVERY == SAMPLE_EVERY - 1:  # (always, for SAMPLE_EVERY = 1)
        m, acc, best_key, best_idx, best_x = _sample_split_chunk(LOGITS, seed, r, s, stride_r, inv_temp, V, CHUNK,
                                                                 BLOCK, True)
    else:
        m, acc, best_key, best_idx, best_x = _sample_split_chunk(LOGITS, seed, r, s, stride_r, inv_temp, V, CHUNK,
                                                                 BLOCK, False)
    M = tl.max(m, 0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    total = tl.sum(acc * tl.exp(m - M_safe), 0)
    K = tl.max(best_key, 0)
    j = tl.argmax(best_key, 0)
    sel = tl.arange(0, BLOCK // 4) == j
    idx = tl.sum(tl.where(sel, best_idx, 0), 0)
    xb = tl.sum(tl.where(sel, best_x, 0.0), 0)
    out = PART + (r * NSPLIT + s) * 5
    tl.store(out + 0, M)
    tl.store(out + 1, total)
    tl.store(out + 2, K)
    tl.store(out + 3, idx.to(tl.float32))  # exact below 2**24 (vocabularies are far smaller)
    tl.store(out + 4, xb)


@triton.jit
def _sample_merge_kernel(PART, LOGITS, stride_r, inv_temp, GATHER, TOK, LOGP_TOK, LOGP_GATHER,
                         NSPLIT: tl.constexpr, NSPLIT_P2: tl.constexpr, HAS_GATHER: tl.constexpr,
                         SAMPLE_EVERY: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    r = tl.program_id(0)
    s = tl.arange(0, NSPLIT_P2)
    ok = s < NSPLIT
    base = PART + (r * NSPLIT + s) * 5
    m = tl.load(base + 0, mask=ok, other=float("-inf"))
    tot = tl.load(base + 1, mask=ok, other=0.0)
    key = tl.load(base + 2, mask=ok, other=float("-inf"))
    M = tl.max(m, 0)
    lse = M + tl.log(tl.sum(tot * tl.exp(m - M), 0))
    if r % SAMPLE_EVERY == SAMPLE_EVERY - 1:  # (always, for SAMPLE_EVERY = 1)
        j = tl.argmax(key, 0)
        tok = tl.load(PART + (r * NSPLIT + j) * 5 + 3).to(tl.int64)
        xb = tl.load(PART + (r * NSPLIT + j) * 5 + 4)
        tl.store(TOK + r, tok)
        tl.store(LOGP_TOK + r, xb - lse)
    else:  # no token drawn for this row (every key −inf)
        tl.store(TOK + r, -1)
        tl.store(LOGP_TOK + r, float("nan"))
    if HAS_GATHER:
        g = tl.load(GATHER + r)
        xg = tl.load(LOGITS + r * stride_r + g).to(tl.float32) * inv_temp
        tl.store(LOGP_GATHER + r, xg - lse)


def _sample_chunk(R: int, V: int, block: int, device: torch.device) -> int:
    """Logits a split program reads: 8 blocks, halved (down to one block) while the R rows' splits
    cover fewer than 4 programs per SM — a draft step's 8 rows × 128,256 logits would otherwise be
    128 programs each racing 8,192 elements."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    chunk = 8 * block
    while chunk > block and R * triton.cdiv(V, chunk) < 4 * sms:
        chunk //= 2
    return chunk


def triton_sample_and_score(logits: Tensor, temperature: float, seed: Tensor, gather: Tensor | None = None,
                            sample_every: int = 1, chunk: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """For each row of ``logits`` [R, V] (unit stride in V) with x = logits / temperature:
    token ~ softmax(x) by the exponential race (Gumbel noise from Philox, keyed by ``seed`` — a
    device int64 scalar — and the element's index), log softmax(x)[token], and log softmax(x)[gather]
    (when ``gather`` [R] long is given). One read of the logits; no host sync.

    ``sample_every`` = S > 1: only rows r with r % S == S − 1 draw a token (verify: the bonus row of
    each particle's K + 1); the others skip the noise and the race and return token −1 and
    log-prob nan (their gathered log-prob is computed as usual). A drawn token is the same as with
    S = 1 (the noise is keyed by the element, not by which rows draw). ``chunk``: logits a split
    program reads (a multiple of 1024; default ``_sample_chunk``).
    Reference: the engine's sampling.sample_and_score_reference."""
    R, V = logits.shape
    if sample_every < 1:
        raise ValueError(f"sample_every = {sample_every}: must be >= 1 (1: every row draws a token)")
    block = 1024
    if chunk is None:
        chunk = _sample_chunk(R, V, block, logits.device)
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < block or chunk % block:
        raise ValueError(f"chunk={chunk!r}: give a multiple of {block}, such as 8192")
    if V < chunk:
        block = max(16, min(block, triton.next_power_of_2(V)))
        chunk = triton.cdiv(V, block) * block
    nsplit = triton.cdiv(V, chunk)
    part = torch.empty(R, nsplit, 5, device=logits.device, dtype=torch.float32)
    _sample_split_kernel[(R, nsplit)](logits, seed, logits.stride(0), 1.0 / temperature, part, V=V, CHUNK=chunk,
                                      BLOCK=block, NSPLIT=nsplit, SAMPLE_EVERY=sample_every, num_warps=4,
                                      **pdl_args(logits.device))
    tok = torch.empty(R, device=logits.device, dtype=torch.long)
    logp_tok = torch.empty(R, device=logits.device, dtype=torch.float32)
    logp_gather = torch.empty(R, device=logits.device, dtype=torch.float32) if gather is not None else None
    _sample_merge_kernel[(R,)](part, logits, logits.stride(0), 1.0 / temperature,
                               gather if gather is not None else tok, tok, logp_tok,
                               logp_gather if gather is not None else logp_tok,
                               NSPLIT=nsplit, NSPLIT_P2=max(2, triton.next_power_of_2(nsplit)),
                               HAS_GATHER=gather is not None, SAMPLE_EVERY=sample_every, num_warps=1,
                               **pdl_args(logits.device))
    return tok, logp_tok, logp_gather
