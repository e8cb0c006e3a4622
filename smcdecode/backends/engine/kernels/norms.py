"""The fused elementwise kernels of a layer, one launch each instead of 5–10 small ones: residual
add + RMSNorm (also reading a transposed delta, or split-K partials), the embedding lookup with the
first RMSNorm, SiLU·mul, and RoPE + KV-page write (used for long extensions: the prefill).
References: ops.add_rms_norm_reference, ops.silu_mul, ops.rope_kv_write_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import pdl_args, pdl_enter, row_rstd, rowscale_args


@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, H_OUT, Y, stride_x, stride_d, eps, DIM: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, PDL: tl.constexpr = 0,
                         NSPLIT: tl.constexpr = 0, stride_s=0, TOK=None, GATHER: tl.constexpr = 0):
    """NSPLIT > 0: DELTA holds NSPLIT float32 partial sums (split stride stride_s), added in order and
    rounded to the stream's dtype first, as the unsplit product would have been. GATHER: X is an
    embedding table and row r's input is its row TOK[r] (stored to H_OUT: the stream)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < DIM
    if GATHER:
        x = tl.load(X + tl.load(TOK + row) * stride_x + c, mask=ok, other=0.0)
        tl.store(H_OUT + row * DIM + c, x, mask=ok)
    else:
        x = tl.load(X + row * stride_x + c, mask=ok, other=0.0)
    if NSPLIT > 0:
        d = tl.load(DELTA + row * stride_d + c, mask=ok, other=0.0)
        for s in tl.static_range(1, NSPLIT):
            d += tl.load(DELTA + s * stride_s + row * stride_d + c, mask=ok, other=0.0)
        x = x + d.to(x.dtype)
        tl.store(H_OUT + row * DIM + c, x, mask=ok)
    elif HAS_DELTA:
        x = x + tl.load(DELTA + row * stride_d + c, mask=ok, other=0.0)  # in the stream's dtype, as torch adds
        tl.store(H_OUT + row * DIM + c, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / DIM + eps)
    w = tl.load(W + c, mask=ok, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * DIM + c, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _add_t_rms_norm_kernel(X, DT, W, H_OUT, Y, M, stride_x, stride_dt, eps, DIM: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr = 0):
    """``_add_rms_norm_kernel`` for a delta stored transposed — row r's entry c at DT + c·stride_dt + r,
    as cuBLAS writes the transposed problem W·xᵀ (ops.linear_to_residual) — BLOCK_M rows a program,
    so that each column's BLOCK_M entries are one contiguous read. (Two passes over column blocks,
    to transpose smaller tiles, measured 1.5–3× slower on an H200.)"""
    pdl_enter(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK)
    ok = (rm < M)[:, None] & (c < DIM)[None, :]
    x = tl.load(X + rm[:, None] * stride_x + c[None, :], mask=ok, other=0.0)
    x = x + tl.load(DT + c[None, :] * stride_dt + rm[:, None], mask=ok, other=0.0)  # in the stream's dtype
    tl.store(H_OUT + rm[:, None] * DIM + c[None, :], x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / DIM + eps)
    w = tl.load(W + c, mask=c < DIM, other=0.0)
    y = (xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * DIM + c[None, :], y.to(Y.dtype.element_ty), mask=ok)


TNORM_CONFIG = (4, 8)  # (rows a program, warps) of ``_add_t_rms_norm_kernel``


def _check_tnorm_config(config) -> tuple[int, int]:
    ok = isinstance(config, (tuple, list)) and len(config) == 2
    if ok:
        bm, warps = config
        ok = isinstance(bm, int) and bm >= 1 and not bm & (bm - 1) and warps in (1, 2, 4, 8, 16)
    if not ok:
        raise ValueError(f"transposed-norm config {config!r}: expected (rows a program, warps), the rows a power "
                         "of two and warps one of 1, 2, 4, 8, 16")
    return tuple(config)


def triton_add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float,
                        parts: Tensor | None = None, config: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """(h, y) with h = x + delta (x when delta is None) and y = weight · h / rms(h), over the last dim.
    x [..., dim] with unit stride in the last dim (row-strided views are fine); delta the same, or
    transposed (unit stride between rows: the view ``(W · xᵀ)ᵀ`` of a product cuBLAS ran on the
    transposed problem), read BLOCK_M rows a program (``config`` = (BLOCK_M, warps), default
    ``TNORM_CONFIG``). ``parts`` instead of ``delta``: float32
    partial sums [S, ..., dim] of a split-K product (``triton_skinny_linear(split=S)``), delta =
    their sum rounded to x's dtype.
    Reference: ops.add_rms_norm_reference (with ops.SplitSum.total for ``parts``)."""
    dim = x.shape[-1]
    shape = x.shape
    x2 = x.reshape(-1, dim)
    M = x2.shape[0]
    if delta is not None and parts is None and delta.stride(-1) != 1 and dim > 1:
        dt = delta.reshape(-1, dim)
        if dt.stride(0) != 1:
            dt = dt.contiguous()
        else:
            h = torch.empty(M, dim, device=x.device, dtype=x.dtype)
            y = torch.empty(M, dim, device=x.device, dtype=x.dtype)
            block_m, warps = TNORM_CONFIG if config is None else _check_tnorm_config(config)
            _add_t_rms_norm_kernel[(triton.cdiv(M, block_m),)](
                x2, dt, weight, h, y, M, x2.stride(0), dt.stride(1), eps, DIM=dim,
                BLOCK=triton.next_power_of_2(dim), BLOCK_M=block_m, num_warps=warps, **pdl_args(x.device))
            return h.view(shape), y.view(shape)
        delta = dt
    nsplit, stride_s = 0, 0
    if parts is not None:
        if delta is not None:
            raise ValueError("give delta or parts, not both")
        p3 = parts.reshape(parts.shape[0], -1, dim)
        if p3.stride(-1) != 1:
            p3 = p3.contiguous()
        nsplit, stride_s, d2 = p3.shape[0], p3.stride(0), p3[0]
    else:
        d2 = delta.reshape(-1, dim) if delta is not None else x2
    has_delta = delta is not None or parts is not None
    h = torch.empty(M, dim, device=x.device, dtype=x.dtype) if has_delta else x2
    y = torch.empty(M, dim, device=x.device, dtype=x.dtype)
    block = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(M,)](x2, d2, weight, h, y, x2.stride(0), d2.stride(0), eps, DIM=dim, BLOCK=block,
                               HAS_DELTA=has_delta, NSPLIT=nsplit, stride_s=stride_s,
                               num_warps=max(1, min(16, block // 512)), **pdl_args(x.device))
    return (h.view(shape) if has_delta else x), y.view(shape)


def triton_embed_rms_norm(tokens: Tensor, table: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x, y) with x = table[tokens] (the embedding lookup, [..., dim]) and y = weight · x / rms(x): the
    lookup and the first RMSNorm in one launch. Reference: ops.add_rms_norm_reference of the lookup."""
    dim = table.shape[1]
    tok = tokens.reshape(-1)
    if tok.dtype != torch.long or not tok.is_contiguous():
        tok = tok.long().contiguous()
    M = tok.shape[0]
    x = torch.empty(M, dim, device=table.device, dtype=table.dtype)
    y = torch.empty(M, dim, device=table.device, dtype=table.dtype)
    block = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(M,)](table, table, weight, x, y, table.stride(0), 0, eps, DIM=dim, BLOCK=block,
                               HAS_DELTA=False, TOK=tok, GATHER=1, num_warps=max(1, min(16, block // 512)),
                               **pdl_args(table.device))
    shape = (*tokens.shape, dim)
    return x.view(shape), y.view(shape)


@triton.jit
def _silu_mul_kernel(GU, OUT, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
                     SS=None, stride_ss=0, rs_eps=0.0, RS_T: tl.constexpr = 0, RS_TP2: tl.constexpr = 1,
                     RS_DIM: tl.constexpr = 1):
    """RS_T > 0: gate and up are first scaled by the row's 1/rms (a folded norm; see ``row_rstd``)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < INTER
    g = tl.load(GU + row * 2 * INTER + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * INTER + INTER + c, mask=ok, other=0.0).to(tl.float32)
    if RS_T > 0:
        r = tl.sum(row_rstd(SS, row + tl.arange(0, 1), tl.full([1], 1, tl.int1), stride_ss, rs_eps, RS_T, RS_TP2,
                             RS_DIM), 0)
        g = (g * r).to(OUT.dtype.element_ty).to(tl.float32)
        u = (u * r).to(OUT.dtype.element_ty).to(tl.float32)
    # torch: silu(gate) rounded to the dtype, then times up
    s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * INTER + c, (s * u).to(OUT.dtype.element_ty), mask=ok)


def triton_silu_mul(gate_up: Tensor, rowscale=None) -> Tensor:
    """silu(gate) · up for gate_up = [gate | up] [..., 2I] (contiguous). Reference: ops.silu_mul.
    ``rowscale`` = (sumsq [rows, T], eps, dim): gate and up are first scaled row by row by a folded
    norm's 1/rms (each rounded to the dtype, as a product of the scaled input would be); reference:
    ops.silu_mul of the rows times ops.Normed.rstd."""
    I2 = gate_up.shape[-1]
    gu = gate_up.reshape(-1, I2)
    out = torch.empty(gu.shape[0], I2 // 2, device=gu.device, dtype=gu.dtype)
    block = 1024
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(I2 // 2, block))](gu, out, INTER=I2 // 2, BLOCK=block, num_warps=4,
                                                                  **pdl_args(gu.device), **rowscale_args(rowscale))
    return out.view(*gate_up.shape[:-1], I2 // 2)


@triton.jit
def _rope_kv_write_kernel(QKV, POS, COS, SIN, PAGES, OFFS, Q_OUT, KP, VP,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                          PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    t = tl.program_id(0)  # token (b * L + l)
    h = tl.program_id(1)  # 0..H-1: query head, H..H+HKV-1: key/value head
    half = tl.arange(0, D // 2)
    pos = tl.load(POS + t)
    cos = tl.load(COS + pos * (D // 2) + half)
    sin = tl.load(SIN + pos * (D // 2) + half)
    base = QKV + t * (H + 2 * HKV) * D
    x1 = tl.load(base + h * D + half).to(tl.float32)
    x2 = tl.load(base + h * D + D // 2 + half).to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(Q_OUT.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(Q_OUT.dtype.element_ty)
    if h < H:
        tl.store(Q_OUT + (t * H + h) * D + half, r1)
        tl.store(Q_OUT + (t * H + h) * D + D // 2 + half, r2)
    else:
        kvh = h - H
        page = tl.load(PAGES + t)
        off = tl.load(OFFS + t)
        dst = ((page * HKV + kvh) * PS + off) * D
        tl.store(KP + dst + half, r1)
        tl.store(KP + dst + D // 2 + half, r2)
        v1 = tl.load(base + (H + HKV + kvh) * D + half)
        v2 = tl.load(base + (H + HKV + kvh) * D + D // 2 + half)
        tl.store(VP + dst + half, v1)
        tl.store(VP + dst + D // 2 + half, v2)


def triton_rope_kv_write(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                         pages: Tensor, offsets: Tensor, H: int, Hkv: int) -> Tensor:
    """qkv [B, L, (H + 2Hkv)·D] (contiguous) -> q [B, L, H, D] rotated; rotated k and v written to
    pools [num_pages, Hkv, PS, D] at (pages, offsets) [B·L]. cos/sin: tables [max_pos, D/2] (float32).
    Reference: ops.rope_kv_write_reference."""
    B, L, _ = qkv.shape
    _, _, PS, D = k_pool.shape
    q = torch.empty(B, L, H, D, device=qkv.device, dtype=qkv.dtype)
    _rope_kv_write_kernel[(B * L, H + Hkv)](qkv, positions, cos, sin, pages, offsets, q, k_pool, v_pool,
                                             H=H, HKV=Hkv, D=D, PS=PS, num_warps=1, **pdl_args(qkv.device))
    return q
