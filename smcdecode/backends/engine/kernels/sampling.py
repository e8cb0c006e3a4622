"""Sampling and scoring over [R, V] logits in one read (two launches: splits, then a merge per row):
exponential-race sampling, the log-sum-exp and the gather of log q(d); rows that need no token
(verify's scored rows) skip the noise and the race. The temperature is a scalar or one per row.

The general path (a power α per row and/or a token mask) also forms y = α·x over the valid tokens:
the race runs on y, and the merge returns log π(token) = y_tok − logsumexp(y) and the bonus
normaliser logsumexp(y) − α·logsumexp(x) = log Σ_v p^α·1[valid]; a dead row (nothing valid) races
on the unmasked y and gets −inf for both.

The noise is Philox keyed by (seed, row, element), or — ``bits`` given, for tests — the int32 words
of a tensor, turned into uniforms as ``samplers.steps.uniform_from_bits`` does. Reference (the same
function, draw for draw on the same bits): ``samplers.steps.sample_and_score``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ....samplers.steps import Scored
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
def _noise(seed, BITS, r, base, q, Q: tl.constexpr, n_blocks, V: tl.constexpr, BLOCK: tl.constexpr,
           NOISE_BITS: tl.constexpr):
    """The random bits of elements base + q + {0, 1, 2, 3}·Q of row r: one Philox call per lane, or
    (NOISE_BITS) the words BITS[r, c] of a [R, V] int32 tensor."""
    if NOISE_BITS:
        c = base + q
        row = BITS + r.to(tl.int64) * V
        b0 = tl.load(row + c, mask=c < V, other=0)
        b1 = tl.load(row + c + Q, mask=c + Q < V, other=0)
        b2 = tl.load(row + c + 2 * Q, mask=c + 2 * Q < V, other=0)
        b3 = tl.load(row + c + 3 * Q, mask=c + 3 * Q < V, other=0)
    else:
        b0, b1, b2, b3 = tl.randint4x(seed, (r * n_blocks + base // BLOCK) * Q + q)
    return b0, b1, b2, b3


@triton.jit
def _sample_split_chunk(LOGITS, seed, BITS, r, s, stride_r, inv_temp, V: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, RACE: tl.constexpr, NOISE_BITS: tl.constexpr):
    """Per-lane running max and Σ exp(x − max) over split s of row r, and (RACE) the lane's best
    exponential-race key with its index and x. A block of BLOCK elements is four quarters of BLOCK/4
    lanes; one Philox call (``tl.randint4x``, keyed by the row, the block and the lane) gives a lane
    its 32 random bits in all four quarters, so the noise costs a quarter of a call per element and
    an element's noise depends only on (seed, row, element). The four quarters are folded in at once
    (``_ratio_block``). NOISE_BITS: element c's bits are BITS[r, c] instead."""
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
            b0, b1, b2, b3 = _noise(seed, BITS, r, base, q, Q, n_blocks, V, BLOCK, NOISE_BITS)
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
def _sample_split_kernel(LOGITS, SEED, BITS, stride_r, inv_temp, INV_TEMP, PART, V: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, NSPLIT: tl.constexpr, SAMPLE_EVERY: tl.constexpr,
                         DRAW: tl.constexpr, TEMP_PER_ROW: tl.constexpr, NOISE_BITS: tl.constexpr,
                         PDL: tl.constexpr = 0):
    """Split s of row r: (max, Σ exp(x − max), best race key, its index, its x) into PART. Rows with
    r % SAMPLE_EVERY != SAMPLE_EVERY − 1 (every row without DRAW) run no race (no noise drawn; key
    −inf). The noise of an element is keyed by (seed, r·V + c) whatever SAMPLE_EVERY, so a sampled
    row draws the same token. TEMP_PER_ROW: 1/T is INV_TEMP[r] instead of ``inv_temp``."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    seed = tl.load(SEED)
    if TEMP_PER_ROW:
        inv_temp = tl.load(INV_TEMP + r)
    if DRAW:
        if r % SAMPLE_EVERY == SAMPLE_EVERY - 1:  # (always, for SAMPLE_EVERY = 1)
            m, acc, best_key, best_idx, best_x = _sample_split_chunk(LOGITS, seed, BITS, r, s, stride_r, inv_temp,
                                                                     V, CHUNK, BLOCK, True, NOISE_BITS)
        else:
            m, acc, best_key, best_idx, best_x = _sample_split_chunk(LOGITS, seed, BITS, r, s, stride_r, inv_temp,
                                                                     V, CHUNK, BLOCK, False, NOISE_BITS)
    else:
        m, acc, best_key, best_idx, best_x = _sample_split_chunk(LOGITS, seed, BITS, r, s, stride_r, inv_temp, V,
                                                                 CHUNK, BLOCK, False, NOISE_BITS)
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
def _sample_merge_kernel(PART, LOGITS, stride_r, inv_temp, INV_TEMP, GATHER, TOK, LOGP_TOK, LOGP_GATHER,
                         NSPLIT: tl.constexpr, NSPLIT_P2: tl.constexpr, HAS_GATHER: tl.constexpr,
                         SAMPLE_EVERY: tl.constexpr, DRAW: tl.constexpr, TEMP_PER_ROW: tl.constexpr,
                         PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    r = tl.program_id(0)
    if TEMP_PER_ROW:
        inv_temp = tl.load(INV_TEMP + r)
    s = tl.arange(0, NSPLIT_P2)
    ok = s < NSPLIT
    base = PART + (r * NSPLIT + s) * 5
    m = tl.load(base + 0, mask=ok, other=float("-inf"))
    tot = tl.load(base + 1, mask=ok, other=0.0)
    key = tl.load(base + 2, mask=ok, other=float("-inf"))
    lse = _merge_lse(m, tot)
    draws = r % SAMPLE_EVERY == SAMPLE_EVERY - 1  # (always, for SAMPLE_EVERY = 1)
    if not DRAW:
        draws = r < 0
    if draws:
        j = tl.argmax(key, 0)
        tok = tl.load(PART + (r * NSPLIT + j) * 5 + 3).to(tl.int64)
        xb = tl.load(PART + (r * NSPLIT + j) * 5 + 4)
        tl.store(TOK + r, tok)
        tl.store(LOGP_TOK + r, tl.where(lse == float("-inf"), float("-inf"), xb - lse))
    else:  # no token drawn for this row (every key −inf)
        tl.store(TOK + r, -1)
        tl.store(LOGP_TOK + r, float("nan"))
    if HAS_GATHER:
        g = tl.load(GATHER + r)
        xg = tl.load(LOGITS + r * stride_r + g).to(tl.float32) * inv_temp
        tl.store(LOGP_GATHER + r, tl.where(lse == float("-inf"), float("-inf"), xg - lse))


@triton.jit
def _merge_lse(m, tot):
    """log Σ_s tot_s·exp(m_s) over a row's splits (−inf when every m_s is −inf)."""
    M = tl.max(m, 0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    return M + tl.log(tl.sum(tot * tl.exp(m - M_safe), 0))


@triton.jit
def _general_block(LOGITS, MASK, r, c, Q: tl.constexpr, stride_r, stride_m, inv_temp, alpha, dead, b0, b1, b2, b3,
                   mx, ax, my, ay, best_e, best_E, best_idx, best_y, V: tl.constexpr, RACE: tl.constexpr,
                   HAS_MASK: tl.constexpr, PACKED: tl.constexpr):
    """The four quarters c + {0, 1, 2, 3}·Q of a block folded into the lane's running (max, Σ exp) of
    x = logits/T over every token and of y = α·x over the valid ones, and (RACE) the race on y
    (``_ratio_pick``, on e = exp(y − max_y)). The mask: a byte a token, or (PACKED) a bit a token,
    token v at bit v % 32 of int32 word v // 32."""
    row = LOGITS + r * stride_r
    x0 = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32) * inv_temp
    x1 = tl.load(row + c + Q, mask=c + Q < V, other=float("-inf")).to(tl.float32) * inv_temp
    x2 = tl.load(row + c + 2 * Q, mask=c + 2 * Q < V, other=float("-inf")).to(tl.float32) * inv_temp
    x3 = tl.load(row + c + 3 * Q, mask=c + 3 * Q < V, other=float("-inf")).to(tl.float32) * inv_temp
    y0 = alpha * x0
    y1 = alpha * x1
    y2 = alpha * x2
    y3 = alpha * x3
    if HAS_MASK:
        mrow = MASK + r * stride_m
        if PACKED:
            v0 = (tl.load(mrow + (c >> 5), mask=c < V, other=0) >> (c & 31)) & 1
            v1 = (tl.load(mrow + ((c + Q) >> 5), mask=c + Q < V, other=0) >> ((c + Q) & 31)) & 1
            v2 = (tl.load(mrow + ((c + 2 * Q) >> 5), mask=c + 2 * Q < V, other=0) >> ((c + 2 * Q) & 31)) & 1
            v3 = (tl.load(mrow + ((c + 3 * Q) >> 5), mask=c + 3 * Q < V, other=0) >> ((c + 3 * Q) & 31)) & 1
        else:
            v0 = tl.load(mrow + c, mask=c < V, other=0)
            v1 = tl.load(mrow + c + Q, mask=c + Q < V, other=0)
            v2 = tl.load(mrow + c + 2 * Q, mask=c + 2 * Q < V, other=0)
            v3 = tl.load(mrow + c + 3 * Q, mask=c + 3 * Q < V, other=0)
        y0 = tl.where((v0 != 0) | dead, y0, float("-inf"))
        y1 = tl.where((v1 != 0) | dead, y1, float("-inf"))
        y2 = tl.where((v2 != 0) | dead, y2, float("-inf"))
        y3 = tl.where((v3 != 0) | dead, y3, float("-inf"))
    mx_new = tl.maximum(tl.maximum(mx, x0), tl.maximum(tl.maximum(x1, x2), x3))
    mx_safe = tl.where(mx_new == float("-inf"), 0.0, mx_new)
    ax = ax * tl.exp(mx - mx_safe) + ((tl.exp(x0 - mx_safe) + tl.exp(x1 - mx_safe)) +
                                      (tl.exp(x2 - mx_safe) + tl.exp(x3 - mx_safe)))
    my_new = tl.maximum(tl.maximum(my, y0), tl.maximum(tl.maximum(y1, y2), y3))
    my_safe = tl.where(my_new == float("-inf"), 0.0, my_new)
    scale = tl.exp(my - my_safe)
    e0 = tl.exp(y0 - my_safe)
    e1 = tl.exp(y1 - my_safe)
    e2 = tl.exp(y2 - my_safe)
    e3 = tl.exp(y3 - my_safe)
    ay = ay * scale + ((e0 + e1) + (e2 + e3))
    if RACE:
        best_e = best_e * scale
        best_e, best_E, best_idx, best_y = _ratio_pick(e0, y0, c, b0, best_e, best_E, best_idx, best_y)
        best_e, best_E, best_idx, best_y = _ratio_pick(e1, y1, c + Q, b1, best_e, best_E, best_idx, best_y)
        best_e, best_E, best_idx, best_y = _ratio_pick(e2, y2, c + 2 * Q, b2, best_e, best_E, best_idx, best_y)
        best_e, best_E, best_idx, best_y = _ratio_pick(e3, y3, c + 3 * Q, b3, best_e, best_E, best_idx, best_y)
    return mx_new, ax, my_new, ay, best_e, best_E, best_idx, best_y


@triton.jit
def _general_chunk(LOGITS, MASK, seed, BITS, r, s, stride_r, stride_m, inv_temp, alpha, dead, V: tl.constexpr,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr, RACE: tl.constexpr, NOISE_BITS: tl.constexpr,
                   HAS_MASK: tl.constexpr, PACKED: tl.constexpr):
    """Per-lane running (max, Σ exp) of x and of y over split s of row r and (RACE) the lane's best
    race key on y with its index and y (as ``_sample_split_chunk``)."""
    Q: tl.constexpr = BLOCK // 4
    q = tl.arange(0, Q)
    mx = tl.full([Q], float("-inf"), tl.float32)
    ax = tl.zeros([Q], tl.float32)
    my = tl.full([Q], float("-inf"), tl.float32)
    ay = tl.zeros([Q], tl.float32)
    best_e = tl.zeros([Q], tl.float32)
    best_E = tl.full([Q], 1.0, tl.float32)
    best_idx = tl.zeros([Q], tl.int32)
    best_y = tl.zeros([Q], tl.float32)
    n_blocks = (V + BLOCK - 1) // BLOCK
    for c0 in range(0, CHUNK, BLOCK):
        base = s * CHUNK + c0
        if RACE:
            b0, b1, b2, b3 = _noise(seed, BITS, r, base, q, Q, n_blocks, V, BLOCK, NOISE_BITS)
        else:
            b0 = q
            b1 = q
            b2 = q
            b3 = q
        mx, ax, my, ay, best_e, best_E, best_idx, best_y = _general_block(
            LOGITS, MASK, r, base + q, Q, stride_r, stride_m, inv_temp, alpha, dead, b0, b1, b2, b3, mx, ax, my, ay,
            best_e, best_E, best_idx, best_y, V, RACE, HAS_MASK, PACKED)
    best_key = tl.where(best_e > 0, best_y - tl.log(best_E), float("-inf"))
    return mx, ax, my, ay, best_key, best_idx, best_y


@triton.jit
def _no_bit_set(MASK, r, stride_m, V: tl.constexpr):
    """Does packed row r of ``MASK`` (int32 words, a bit a token) allow no token of the V? (the bits
    past V in the last word left out; ``potentials.constraint.no_bit_set``)"""
    W: tl.constexpr = (V + 31) // 32
    WB: tl.constexpr = 512
    TAIL: tl.constexpr = V % 32
    w = tl.arange(0, WB)
    seen = tl.zeros([WB], tl.int32)
    for w0 in range(0, W, WB):
        word = tl.load(MASK + r * stride_m + w0 + w, mask=w0 + w < W, other=0)
        if TAIL:
            word = tl.where(w0 + w == W - 1, word & ((1 << TAIL) - 1), word)
        seen = seen | word
    return tl.max((seen != 0).to(tl.int32), 0) == 0


@triton.jit
def _general_split_kernel(LOGITS, SEED, BITS, MASK, DEAD, ALPHA, stride_r, stride_m, inv_temp, INV_TEMP, PART,
                          V: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NSPLIT: tl.constexpr,
                          SAMPLE_EVERY: tl.constexpr, DRAW: tl.constexpr, TEMP_PER_ROW: tl.constexpr,
                          NOISE_BITS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ALPHA: tl.constexpr,
                          PACKED: tl.constexpr = 0, DEAD_FROM_BITS: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """Split s of row r of the general path: (max_x, Σ exp(x − max_x), max_y, Σ exp(y − max_y), best
    race key on y, its index, its y) into PART [R, NSPLIT, 7]. ``DEAD_FROM_BITS``: whether the row
    is dead is read from its packed mask here (else from ``DEAD``)."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    seed = tl.load(SEED)
    if TEMP_PER_ROW:
        inv_temp = tl.load(INV_TEMP + r)
    alpha = 1.0
    if HAS_ALPHA:
        alpha = tl.load(ALPHA + r)
    dead = False
    if DEAD_FROM_BITS:
        dead = _no_bit_set(MASK, r, stride_m, V)
    elif HAS_MASK:
        dead = tl.load(DEAD + r) != 0
    if DRAW:
        if r % SAMPLE_EVERY == SAMPLE_EVERY - 1:  # (always, for SAMPLE_EVERY = 1)
            mx, ax, my, ay, best_key, best_idx, best_y = _general_chunk(
                LOGITS, MASK, seed, BITS, r, s, stride_r, stride_m, inv_temp, alpha, dead, V, CHUNK, BLOCK, True,
                NOISE_BITS, HAS_MASK, PACKED)
        else:
            mx, ax, my, ay, best_key, best_idx, best_y = _general_chunk(
                LOGITS, MASK, seed, BITS, r, s, stride_r, stride_m, inv_temp, alpha, dead, V, CHUNK, BLOCK, False,
                NOISE_BITS, HAS_MASK, PACKED)
    else:
        mx, ax, my, ay, best_key, best_idx, best_y = _general_chunk(
            LOGITS, MASK, seed, BITS, r, s, stride_r, stride_m, inv_temp, alpha, dead, V, CHUNK, BLOCK, False,
            NOISE_BITS, HAS_MASK, PACKED)
    q = tl.arange(0, BLOCK // 4)
    MX = tl.max(mx, 0)
    MY = tl.max(my, 0)
    out = PART + (r * NSPLIT + s) * 7
    tl.store(out + 0, MX)
    tl.store(out + 1, tl.sum(ax * tl.exp(mx - tl.where(MX == float("-inf"), 0.0, MX)), 0))
    tl.store(out + 2, MY)
    tl.store(out + 3, tl.sum(ay * tl.exp(my - tl.where(MY == float("-inf"), 0.0, MY)), 0))
    j = tl.argmax(best_key, 0)
    sel = q == j
    tl.store(out + 4, tl.max(best_key, 0))
    tl.store(out + 5, tl.sum(tl.where(sel, best_idx, 0), 0).to(tl.float32))
    tl.store(out + 6, tl.sum(tl.where(sel, best_y, 0.0), 0))


@triton.jit
def _general_merge_kernel(PART, LOGITS, stride_r, inv_temp, INV_TEMP, GATHER, DEAD, MASK, stride_m, ALPHA, TOK,
                          LOGP_TOK, LOG_NORM, LOGP_GATHER, UNMASKED, stride_u, V: tl.constexpr,
                          NSPLIT: tl.constexpr, NSPLIT_P2: tl.constexpr, HAS_GATHER: tl.constexpr,
                          SAMPLE_EVERY: tl.constexpr, DRAW: tl.constexpr, TEMP_PER_ROW: tl.constexpr,
                          HAS_MASK: tl.constexpr, HAS_ALPHA: tl.constexpr, DEAD_FROM_BITS: tl.constexpr = 0,
                          HAS_UNMASKED: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """Row r of the general path: the token, log π(token) = y_tok − lse_y, the normaliser
    lse_y − α·lse_x (both −inf on a dead row), log p(gather) = x_g − lse_x; (HAS_UNMASKED) log π(token)
    + the normaliser into UNMASKED[r · stride_u] (0 where the normaliser is −inf)."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    if TEMP_PER_ROW:
        inv_temp = tl.load(INV_TEMP + r)
    alpha = 1.0
    if HAS_ALPHA:
        alpha = tl.load(ALPHA + r)
    if DEAD_FROM_BITS:
        dead = _no_bit_set(MASK, r, stride_m, V)
    elif HAS_MASK:
        dead = tl.load(DEAD + r) != 0
    s = tl.arange(0, NSPLIT_P2)
    ok = s < NSPLIT
    base = PART + (r * NSPLIT + s) * 7
    lse_x = _merge_lse(tl.load(base + 0, mask=ok, other=float("-inf")), tl.load(base + 1, mask=ok, other=0.0))
    lse_y = _merge_lse(tl.load(base + 2, mask=ok, other=float("-inf")), tl.load(base + 3, mask=ok, other=0.0))
    key = tl.load(base + 4, mask=ok, other=float("-inf"))
    if HAS_MASK:
        none = dead | (lse_y == float("-inf"))
    else:
        none = lse_y == float("-inf")
    norm = tl.where(none | (lse_x == float("-inf")), float("-inf"), lse_y - alpha * lse_x)
    tl.store(LOG_NORM + r, norm)
    draws = r % SAMPLE_EVERY == SAMPLE_EVERY - 1
    if not DRAW:
        draws = r < 0
    if draws:
        j = tl.argmax(key, 0)
        tok = tl.load(PART + (r * NSPLIT + j) * 7 + 5).to(tl.int64)
        yb = tl.load(PART + (r * NSPLIT + j) * 7 + 6)
        logp = tl.where(none, float("-inf"), yb - lse_y)
        tl.store(TOK + r, tok)
        tl.store(LOGP_TOK + r, logp)
        if HAS_UNMASKED:
            finite = (norm > float("-inf")) & (norm < float("inf"))
            tl.store(UNMASKED + r * stride_u, tl.where(finite, logp + norm, 0.0))
    else:
        tl.store(TOK + r, -1)
        tl.store(LOGP_TOK + r, float("nan"))
    if HAS_GATHER:
        g = tl.load(GATHER + r)
        xg = tl.load(LOGITS + r * stride_r + g).to(tl.float32) * inv_temp
        tl.store(LOGP_GATHER + r, tl.where(lse_x == float("-inf"), float("-inf"), xg - lse_x))


def _sample_chunk(R: int, V: int, block: int, device: torch.device) -> int:
    """Logits a split program reads: 8 blocks, halved (down to one block) while the R rows' splits
    cover fewer than 4 programs per SM — a draft step's 8 rows × 128,256 logits would otherwise be
    128 programs each racing 8,192 elements."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    chunk = 8 * block
    while chunk > block and R * triton.cdiv(V, chunk) < 4 * sms:
        chunk //= 2
    return chunk


def triton_sample_and_score(logits: Tensor, temperature: float | Tensor, seed: Tensor, gather: Tensor | None = None,
                            sample_every: int = 1, chunk: int | None = None, *, alpha: Tensor | None = None,
                            mask: Tensor | None = None, draw: bool = True, bits: Tensor | None = None,
                            dead: Tensor | None = None, mask_bits: Tensor | None = None,
                            unmasked_out: Tensor | None = None) -> Scored:
    """``samplers.steps.sample_and_score`` in one read of ``logits`` [R, V] (unit stride in V), no host
    sync: for x = logits / T (``temperature`` a float or [R] float32), token ~ π ∝ exp(α·x)·1[valid] by
    the exponential race, log π(token), log Σ_v p^α·1[valid] (with ``alpha`` [R] or ``mask`` [R, V]
    bool; else None) and log p(gather) (with ``gather`` [R] long). See that function for the maths,
    the dead rows and ``sample_every`` / ``draw`` (verify: only the bonus row of each particle's K + 1
    draws; its token is the same as with S = 1, the noise being keyed by the element).

    Noise: Philox keyed by ``seed`` (a device int64 scalar), the row and the element; ``bits`` [R, V]
    int32: those words instead (the reference then draws the same tokens). ``chunk``: logits a split
    program reads (a multiple of 1024; default ``_sample_chunk``). ``dead`` [R] bool: the rows whose
    mask allows nothing (default: reduced from ``mask``). ``mask_bits`` [R, ⌈V/32⌉] int32: the mask
    packed, a bit a token (``potentials.constraint.pack_bits``), read as it is (instead of ``mask``;
    without ``dead``, each program reads the row's bits for it). ``unmasked_out``: see
    ``engine.sampling.sample_and_score`` (written by the merge)."""
    R, V = logits.shape
    if mask is not None and mask_bits is not None:
        raise ValueError("give the mask as mask (bool [R, V]) or as mask_bits (packed int32), not both")
    if mask_bits is not None and (mask_bits.dtype != torch.int32 or tuple(mask_bits.shape) != (R, (V + 31) // 32)):
        raise ValueError(f"mask_bits must be int32 of shape {(R, (V + 31) // 32)} (a bit a token), "
                         f"got {mask_bits.dtype} {tuple(mask_bits.shape)}")
    dev = logits.device
    if sample_every < 1:
        raise ValueError(f"sample_every = {sample_every}: must be >= 1 (1: every row draws a token)")
    block = 1024
    if chunk is None:
        chunk = _sample_chunk(R, V, block, dev)
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < block or chunk % block:
        raise ValueError(f"chunk={chunk!r}: give a multiple of {block}, such as 8192")
    if V < chunk:
        block = max(16, min(block, triton.next_power_of_2(V)))
        chunk = triton.cdiv(V, block) * block
    nsplit = triton.cdiv(V, chunk)
    per_row = isinstance(temperature, Tensor)
    inv_t = (1.0 / temperature.float()).contiguous() if per_row else None
    scalar_inv_t = 1.0 if per_row else 1.0 / temperature
    noise = bits.contiguous() if bits is not None else None
    if noise is not None and tuple(noise.shape) != (R, V):
        raise ValueError(f"bits has shape {tuple(noise.shape)}, the logits {(R, V)}: give one random word per element")
    tok = torch.empty(R, device=dev, dtype=torch.long)
    logp_tok = torch.empty(R, device=dev, dtype=torch.float32)
    logp_gather = torch.empty(R, device=dev, dtype=torch.float32) if gather is not None else None
    flags = dict(SAMPLE_EVERY=sample_every, DRAW=draw, TEMP_PER_ROW=per_row)
    p2 = max(2, triton.next_power_of_2(nsplit))
    if alpha is None and mask is None and mask_bits is None:
        if unmasked_out is not None:
            raise ValueError("unmasked_out needs a mask (mask or mask_bits): without one it is log π(token) itself")
        part = torch.empty(R, nsplit, 5, device=dev, dtype=torch.float32)
        _sample_split_kernel[(R, nsplit)](logits, seed, noise if noise is not None else tok, logits.stride(0),
                                          scalar_inv_t, inv_t if per_row else part, part, V=V, CHUNK=chunk,
                                          BLOCK=block, NSPLIT=nsplit, NOISE_BITS=noise is not None, num_warps=4,
                                          **flags, **pdl_args(dev))
        _sample_merge_kernel[(R,)](part, logits, logits.stride(0), scalar_inv_t, inv_t if per_row else part,
                                   gather if gather is not None else tok, tok, logp_tok,
                                   logp_gather if gather is not None else logp_tok, NSPLIT=nsplit, NSPLIT_P2=p2,
                                   HAS_GATHER=gather is not None, num_warps=1, **flags, **pdl_args(dev))
        return Scored(tok, logp_tok, None, logp_gather)
    part = torch.empty(R, nsplit, 7, device=dev, dtype=torch.float32)
    log_norm = torch.empty(R, device=dev, dtype=torch.float32)
    if mask is not None:
        m8 = mask.contiguous().view(torch.uint8)
        dead = ~mask.any(-1) if dead is None else dead.contiguous()
    elif mask_bits is not None:
        m8 = mask_bits.contiguous()
        dead = tok if dead is None else dead.contiguous()  # (none given: each program reads the row's bits)
    else:
        m8, dead = tok, tok
    masked = mask is not None or mask_bits is not None
    from_bits = mask_bits is not None and dead is tok
    if unmasked_out is not None and (unmasked_out.dtype != torch.float32 or unmasked_out.shape != (R,)):
        raise ValueError(f"unmasked_out must be float32 of shape {(R,)}, got {unmasked_out.dtype} "
                         f"{tuple(unmasked_out.shape)}")
    a = alpha.float().contiguous() if alpha is not None else part
    _general_split_kernel[(R, nsplit)](logits, seed, noise if noise is not None else tok, m8, dead, a,
                                       logits.stride(0), m8.stride(0), scalar_inv_t, inv_t if per_row else part,
                                       part, V=V, CHUNK=chunk, BLOCK=block, NSPLIT=nsplit,
                                       NOISE_BITS=noise is not None, HAS_MASK=masked, PACKED=mask_bits is not None,
                                       HAS_ALPHA=alpha is not None, DEAD_FROM_BITS=from_bits, num_warps=4, **flags,
                                       **pdl_args(dev))
    unmasked = unmasked_out if unmasked_out is not None else log_norm
    _general_merge_kernel[(R,)](part, logits, logits.stride(0), scalar_inv_t, inv_t if per_row else part,
                                gather if gather is not None else tok, dead, m8, m8.stride(0), a, tok, logp_tok,
                                log_norm, logp_gather if gather is not None else logp_tok, unmasked,
                                unmasked.stride(0), V=V, NSPLIT=nsplit, NSPLIT_P2=p2, HAS_GATHER=gather is not None,
                                HAS_MASK=masked, HAS_ALPHA=alpha is not None, DEAD_FROM_BITS=from_bits,
                                HAS_UNMASKED=unmasked_out is not None, num_warps=1, **flags, **pdl_args(dev))
    return Scored(tok, logp_tok, log_norm, logp_gather)
