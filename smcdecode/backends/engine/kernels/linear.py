"""Skinny matrix products: x · Wᵀ for few rows (the draft's decode steps), where cuBLAS's kernels
leave bandwidth unused on small matrices; optionally with SiLU·mul in the epilogue, split over K
(float32 partials summed by the next norm), or with the next RMSNorm folded into the epilogue.
References: torch's linear, ops.silu_mul, ops.linear_add_norm_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import dot_precision, num_sms, pdl_args, pdl_enter, row_rstd, rowscale_args, split_counters


@triton.jit
def _resid_epilogue(delta, R, H_OUT, GAMMA, GH_OUT, SS, rm, rn, m_ok, n_ok, M, pid_n, N: tl.constexpr):
    """h = R + delta (rounded as torch adds in the stream's dtype) -> H_OUT; γ ⊙ h -> GH_OUT; the
    sum of h² over this block's columns -> SS[rows, pid_n]. See ``_skinny_linear_kernel``'s RESID."""
    ok = m_ok[:, None] & n_ok[None, :]
    at = rm[:, None] * N + rn[None, :]
    x = tl.load(R + at, mask=ok, other=0.0)
    h = x + delta.to(x.dtype)
    tl.store(H_OUT + at, h, mask=ok)
    hf = h.to(tl.float32)
    g = tl.load(GAMMA + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(GH_OUT + at, (hf * g[None, :]).to(GH_OUT.dtype.element_ty), mask=ok)
    tl.store(SS + rm * tl.num_programs(0) + pid_n, tl.sum(tl.where(ok, hf * hf, 0.0), 1), mask=m_ok)


@triton.jit
def _skinny_linear_kernel(X, W, Y, M, stride_xm, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr,
                          K_PER: tl.constexpr, PDL: tl.constexpr = 0, SPLIT: tl.constexpr = 1,
                          R=None, H_OUT=None, GAMMA=None, GH_OUT=None, SS=None, CNT=None, RESID: tl.constexpr = 0,
                          SS_IN=None, stride_ss=0, rs_eps=0.0, RS_T: tl.constexpr = 0, RS_TP2: tl.constexpr = 1,
                          RS_DIM: tl.constexpr = 1, DOT: tl.constexpr = "tf32"):
    """Y[M, N] = X[M, K] · W[N, K]ᵀ, one program per BLOCK_N output columns × BLOCK_M rows, streaming
    its W rows once. SILU: W is [2N, K] = [gate; up] and Y = silu(X·gateᵀ) · (X·upᵀ), rounded as the
    unfused path rounds (the product to Y's dtype, silu to Y's dtype, then the product).
    Program (n, m, s) sums K columns [s·K_PER, (s+1)·K_PER) (K_PER = K: no split). SPLIT > 1 (not
    with SILU): each of the SPLIT programs of a column block stores its float32 partial at Y[s] (Y is
    float32 [SPLIT, M, N]); whoever reads Y adds the SPLIT partials in order
    (``triton_add_rms_norm(..., parts=Y)``), so no atomics and no extra launch.

    Folded RMSNorm (ops.Normed): RESID adds the product to the residual stream R [M, N] in the
    epilogue and prepares the next RMSNorm without a launch of its own: h = R + X·Wᵀ -> H_OUT,
    γ ⊙ h -> GH_OUT (GAMMA: the next norm's weight), and this program's Σ h² over its BLOCK_N
    columns -> SS[row, pid_n] (float32 [M, cdiv(N, BLOCK_N)]). With SPLIT > 1 the partials go to Y
    as above and the last split of a column block to finish (an atomic counter in CNT, reset by
    it) adds them up in order and runs that epilogue. RS_T > 0 (not with RESID): the product's rows
    are scaled by the 1/rms of a folded norm from its RS_T partial sums SS_IN (``row_rstd``), before
    SiLU·mul's rounding."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_first = tl.program_id(2) * K_PER  # (K_PER = K without a split: one program on the K axis)
    pdl_enter(PDL)
    if RS_T > 0:  # (loaded before the K loop: its latency hides behind the weights')
        r = row_rstd(SS_IN, rm, m_ok, stride_ss, rs_eps, RS_T, RS_TP2, RS_DIM)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K_PER, BLOCK_K):
        kk = k_first + k0 + rk
        k_ok = kk < K
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT)
        if SILU:
            wu = tl.load(W + (N + rn)[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                         other=0.0)
            acc_u += tl.dot(x, tl.trans(wu), input_precision=DOT)
    if RS_T > 0:
        acc = acc * r[:, None]
        acc_u = acc_u * r[:, None]
    if SILU:
        g = acc.to(Y.dtype.element_ty).to(tl.float32)
        u = acc_u.to(Y.dtype.element_ty).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        acc = sg * u
    if RESID and SPLIT == 1:
        _resid_epilogue(acc, R, H_OUT, GAMMA, GH_OUT, SS, rm, rn, m_ok, n_ok, M, pid_n, N)
    else:
        out = Y + rm[:, None] * N + rn[None, :]
        if SPLIT > 1:
            out += tl.program_id(2) * M * N
        tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
        if RESID:  # SPLIT > 1: the last split of this column block to finish adds them up
            tl.debug_barrier()  # every thread's partial is stored before the release below
            tile = pid_m * tl.num_programs(0) + pid_n
            done = tl.atomic_add(CNT + tile, 1, sem="acq_rel")
            if done == SPLIT - 1:
                ok = m_ok[:, None] & n_ok[None, :]
                at = rm[:, None] * N + rn[None, :]
                d = tl.load(Y + at, mask=ok, other=0.0, cache_modifier=".cg")
                for sp in tl.static_range(1, SPLIT):  # in order, as the norm of a SplitSum adds them
                    d += tl.load(Y + sp * M * N + at, mask=ok, other=0.0, cache_modifier=".cg")
                _resid_epilogue(d, R, H_OUT, GAMMA, GH_OUT, SS, rm, rn, m_ok, n_ok, M, pid_n, N)
                tl.store(CNT + tile, 0)  # ready for the next launch


def skinny_config(M: int, N: int, K: int, device: torch.device, silu: bool = False
                  ) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). The fixed choices are the fastest of a
    sweep on an H200 (16 Llama-3.2-1B layers at 8 rows: w13 + SiLU·mul BLOCK_N 32 × BLOCK_K 128; the
    square wo BLOCK_N 16 × BLOCK_K 256; the head BLOCK_N 64 × BLOCK_K 128; the 1B's w13 at 64 and
    128 rows); otherwise enough programs to cover the SMs about twice."""
    block_m = max(16, min(64, triton.next_power_of_2(M)))
    if silu:
        return (block_m, 32, 128, 4, 4) if M <= 16 else (64, 64, 128, 4, 4) if M <= 64 else (128, 64, 64, 8, 5)
    if N == K:
        return block_m, 16, 256, 4, 4
    if N >= 16 * K:
        return block_m, 64, 128, 4, 4
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    block_n = 64
    while block_n > 16 and triton.cdiv(N, block_n) < 2 * sms:
        block_n //= 2
    block_k = max(16, min(256 if block_n <= 32 else 128, triton.next_power_of_2(K)))
    return block_m, block_n, block_k, 4, 4


SKINNY_SILU_MAX_ROWS = 128  # most rows of a w13 + SiLU·mul on the skinny kernel


def skinny_wins(M: int, N: int, K: int, nbytes: int, silu: bool) -> bool:
    """Where the skinny product beat cuBLAS (+ the SiLU·mul kernel) in that sweep (H200, random data,
    every layer's own weights): at most 16 rows, and w13 + SiLU·mul up to 100 MB of weights (1B: 290
    vs 315 µs for 16 layers; the 8B's 235 MB w13 stays on cuBLAS), square products (wo: 1B 96.5 vs
    99.1 µs, 8B 407 vs 418 µs) and vocabulary heads (1B 123 vs 126 µs, 8B 233 vs 240 µs). wqkv and
    w2 stay on cuBLAS (equal or slower here; all products on the skinny kernel, so that PDL chains a
    draft step end to end, was not faster). w13 + SiLU·mul also at 33–``SKINNY_SILU_MAX_ROWS`` rows
    (1B, 16 layers: 64 rows 315 vs 372 µs, 128 rows 351 vs 383 µs); 17–32 rows were not measured
    and stay on cuBLAS."""
    if silu:
        return (M <= 16 or 32 < M) and M <= SKINNY_SILU_MAX_ROWS and nbytes <= 100e6
    if M > 16:
        return False
    return N == K or N >= 16 * K


def triton_skinny_linear(x: Tensor, weight: Tensor, silu: bool = False, config=None, split: int = 1,
                         rowscale=None) -> Tensor:
    """x [..., K] (unit stride in K) · weight [N, K]ᵀ -> [..., N]; with ``silu`` the weight is [gate; up]
    ([2N, K]) and the result silu(x·gateᵀ)·(x·upᵀ) [..., N]. For few rows (decode), where cuBLAS's
    kernels leave bandwidth unused on small matrices. References: torch.nn.functional.linear, and
    ops.silu_mul of it.

    ``split`` > 1 splits K over that many programs a column block and returns their float32
    partial sums [split, ..., N] instead (their sum over the first dim is the product; reference:
    ``ops.SplitSum.total``); ``triton_add_rms_norm(..., parts=...)`` consumes them.

    ``rowscale`` = (sumsq [rows, T], eps, dim) (not with split): x is a folded norm's γ ⊙ h and the
    product's rows are scaled by 1 / rms(h) before SiLU·mul (reference: the product's rows times
    ops.Normed.rstd, then silu_mul)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    N = weight.shape[0] // 2 if silu else weight.shape[0]
    bm, bn, bk, warps, stages = config or skinny_config(M, N, K, x.device, silu)
    if split < 1 or (split > 1 and silu):
        raise ValueError(f"split={split!r}: use a positive number of K splits (and 1 with silu=True: SiLU·mul "
                         "needs the whole sum)")
    if split > 1 and rowscale is not None:
        raise ValueError(f"split={split!r} with a rowscale: scale the rows of the summed product (split=1)")
    k_per = triton.cdiv(triton.cdiv(K, split), bk) * bk  # each split a whole number of K blocks
    split = triton.cdiv(K, k_per)
    if split > 1:
        y = torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    else:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _skinny_linear_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm), split)](
        x2, weight, y, M, x2.stride(0), N=N, K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SILU=silu,
        SPLIT=split, K_PER=k_per if split > 1 else K, num_warps=warps, num_stages=stages, **pdl_args(x.device),
        DOT=dot_precision(x.dtype), **rowscale_args(rowscale, "SS_IN"))
    if split > 1:
        return y.view(split, *x.shape[:-1], N)
    return y.view(*x.shape[:-1], N)


def triton_skinny_linear_add_norm(x: Tensor, weight: Tensor, resid: Tensor, gamma: Tensor, config, split: int = 1
                                  ) -> tuple[Tensor, Tensor, Tensor]:
    """A product added to the residual stream, with the next RMSNorm folded into the epilogue:
    (h, gh, sumsq) with h = resid + x·Wᵀ (the product rounded to the stream's dtype, then added),
    gh = γ ⊙ h rounded, sumsq [rows, cdiv(N, BLOCK_N)] float32 partial sums of h² (their sum over
    the last dim is Σ h² of each row). ``config``/``split`` as ``triton_skinny_linear``'s; with
    split > 1 the last split of each column block adds the float32 partials in order and runs the
    epilogue (no extra launch). Reference: ops.linear_add_norm_reference."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    r2 = resid.reshape(M, N).contiguous()
    bm, bn, bk, warps, stages = config
    k_per = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per)
    h = torch.empty(M, N, device=x.device, dtype=resid.dtype)
    gh = torch.empty(M, N, device=x.device, dtype=resid.dtype)
    cols = triton.cdiv(N, bn)
    ss = torch.empty(M, cols, device=x.device, dtype=torch.float32)
    cnt = None
    if split > 1:
        cnt = split_counters(x.device, cols * triton.cdiv(M, bm), kind="skinny")
        if cnt is None:  # (counters would have to be allocated inside a graph capture: no split)
            split, k_per = 1, K
    y = torch.empty(split, M, N, device=x.device, dtype=torch.float32) if split > 1 else h
    _skinny_linear_kernel[(cols, triton.cdiv(M, bm), split)](
        x2, weight, y, M, x2.stride(0), N=N, K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SILU=False,
        SPLIT=split, K_PER=k_per if split > 1 else K, R=r2, H_OUT=h, GAMMA=gamma, GH_OUT=gh, SS=ss,
        CNT=cnt if cnt is not None else ss, RESID=1, num_warps=warps, num_stages=stages, **pdl_args(x.device),
        DOT=dot_precision(x.dtype))
    shape = (*x.shape[:-1], N)
    return h.view(shape), gh.view(shape), ss


def splitk_config(M: int, N: int, K: int, device: torch.device) -> tuple[tuple[int, int, int, int, int], int] | None:
    """(skinny config, K splits) for a product whose output only feeds a residual add + RMSNorm (a
    layer's wo and w2) at few rows, or None where it stays unsplit (cuBLAS or the skinny kernel): the
    measured shapes of ``SPLITK_CONFIGS`` (<= 16 rows) and ``SPLITK_CONFIGS_64`` (17–64 rows), and at
    <= 16 rows other products with K >= 4096 whose column blocks alone do not cover the SMs twice.
    Above 64 rows (the 8B's verify pass at 72) the split measured slower than cuBLAS."""
    if M > 64:
        return None
    block_m = max(16, triton.next_power_of_2(M))
    measured = (SPLITK_CONFIGS if M <= 16 else SPLITK_CONFIGS_64).get((N, K))
    if measured is not None:
        bn, bk, warps, stages, split = measured
        return (block_m, bn, bk, warps, stages), split
    if K < 4096 or M > 16:  # (small products, and more rows: not measured, not split)
        return None
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    bn, bk = (64, 256) if N >= 4096 else (32, 128)
    split = 1
    while triton.cdiv(N, bn) * split * 2 <= 2 * sms and K // (2 * split) >= 4 * bk:
        split *= 2
    return ((block_m, bn, bk, 4, 4), split) if split > 1 else None


# (N, K) -> (BLOCK_N, BLOCK_K, warps, stages, splits): the fastest of a sweep inside a whole decode
# step (H200): the Llama-3.2-1B draft's wo and w2 at 8 rows (step 919 -> 862 µs with both), the
# Llama-3.1-8B's wo and w2 at 1 row (4278 -> 4139 µs).
SPLITK_CONFIGS = {(2048, 2048): (64, 128, 4, 4, 4), (2048, 8192): (32, 128, 4, 4, 4),
                  (4096, 4096): (64, 256, 4, 3, 2), (4096, 14336): (64, 256, 4, 3, 2)}
# 17–64 rows (the draft of 8 requests × 8 particles), only these: 1B step at 64 rows 1025 -> 980 µs,
# SMC-SD 8 × N=8 K=8 29.53 -> 29.23 ms a round (H200)
SPLITK_CONFIGS_64 = {(2048, 2048): (32, 128, 4, 4, 2), (2048, 8192): (64, 128, 4, 4, 4)}
