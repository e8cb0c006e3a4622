"""Triton kernels of the engine. Each has a pure-torch reference (named in its docstring) and a
GPU test against it (tests/test_engine_kernels.py).

merge of the splits — one program per output row. Reference: merge_splits_reference.

paged attention — split-KV ("flash-decoding") over a paged cache, for L <= 16 queries per row
(decode: 1–2, SMC-SD verify: K+1). One program per (row, kv head, KV split) holds all L·G query
rows of its kv head (GQA group G = H / Hkv) as one [BLOCK_M, D] tile, so each key/value page is
read once per kv head, not once per query head. Partial results (unnormalised by the other splits)
are merged with their log-sum-exps in torch. Reference: attention.reference_paged_attention.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _paged_attn_split_kernel(
    Q, KP, VP, PT, SL, O, LSE,  # noqa: E741
    sm_scale, stride_pt,
    L: tl.constexpr, G: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    PS: tl.constexpr, NSPLIT: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)  # b * HKV + kvh
    sid = tl.program_id(1)
    b = pid // HKV
    kvh = pid % HKV
    seq_len = tl.load(SL + b)
    m = tl.arange(0, BLOCK_M)
    l_idx = m // G
    g_idx = m % G
    m_valid = m < L * G
    d = tl.arange(0, D)
    q_ptrs = Q + (((b * L + l_idx) * H + kvh * G + g_idx) * D)[:, None] + d[None, :]
    q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
    qpos = seq_len - L + l_idx  # [BLOCK_M]

    start = sid * CHUNK
    end = tl.minimum(start + CHUNK, seq_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_valid = n < end
        page = tl.load(PT + b * stride_pt + n // PS, mask=n_valid, other=0)
        kv_off = (((page * HKV + kvh) * PS + n % PS) * D)[:, None] + d[None, :]
        k = tl.load(KP + kv_off, mask=n_valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_M, BLOCK_N] fp32
        ok = (n[None, :] <= qpos[:, None]) & n_valid[None, :]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VP + kv_off, mask=n_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    base = (pid * NSPLIT + sid) * BLOCK_M
    tl.store(O + (base + m)[:, None] * D + d[None, :], out, mask=m_valid[:, None])
    tl.store(LSE + base + m, lse, mask=m_valid)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def triton_paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, batch, block_n: int = 64) -> Tensor:
    """q [B, L, H, D] (contiguous), pools [num_pages, Hkv, PS, D] -> [B, L, H, D].

    The KV split size depends only on the page-table width (the row capacity), never on the
    current lengths, so the launch shape is static and the call can be captured in a CUDA graph."""
    q = q.contiguous()
    B, L, H, D = q.shape
    _, Hkv, PS, _ = k_pool.shape
    G = H // Hkv
    P = batch.page_table.shape[1]
    capacity = P * PS
    block_m = max(16, triton.next_power_of_2(L * G))
    n_blocks = triton.cdiv(capacity, block_n)
    nsplit = max(1, min(n_blocks, triton.cdiv(2 * _num_sms(q.device.index or 0), B * Hkv)))
    chunk = triton.cdiv(n_blocks, nsplit) * block_n
    nsplit = triton.cdiv(capacity, chunk)
    o_part = torch.empty(B * Hkv, nsplit, block_m, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B * Hkv, nsplit, block_m, device=q.device, dtype=torch.float32)
    _paged_attn_split_kernel[(B * Hkv, nsplit)](
        q, k_pool, v_pool, batch.page_table, batch.seq_lens, o_part, lse,
        D**-0.5, batch.page_table.stride(0),
        L=L, G=G, H=H, HKV=Hkv, D=D, PS=PS, NSPLIT=nsplit, CHUNK=chunk,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=2,
    )
    out = torch.empty_like(q)
    _merge_splits_kernel[(B * Hkv * L * G,)](
        o_part, lse, out, L=L, G=G, H=H, HKV=Hkv, D=D, NSPLIT=nsplit,
        NSPLIT_P2=triton.next_power_of_2(nsplit), BLOCK_M=block_m, num_warps=1,
    )
    return out


def merge_splits_reference(o_part: Tensor, lse: Tensor, B: int, L: int, H: int, dtype) -> Tensor:
    """Torch reference of ``_merge_splits_kernel``: o_part [B*Hkv, S, BLOCK_M, D], lse [B*Hkv, S, BLOCK_M]
    -> out [B, L, H, D] = Σ_s softmax_s(lse) · o_s (splits past a row's length have lse = -inf)."""
    Hkv = o_part.shape[0] // B
    G, D = H // Hkv, o_part.shape[-1]
    w = torch.softmax(lse[:, :, : L * G], dim=1)
    out = (o_part[:, :, : L * G] * w[..., None]).sum(dim=1)  # [B*Hkv, L*G, D], rows ordered (l, g)
    return out.view(B, Hkv, L, G, D).permute(0, 2, 1, 3, 4).reshape(B, L, H, D).to(dtype)


@triton.jit
def _merge_splits_kernel(OP, LSE, OUT, L: tl.constexpr, G: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr,
                         D: tl.constexpr, NSPLIT: tl.constexpr, NSPLIT_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)  # ((b * HKV + kvh) * L + l) * G + g
    m = pid % (L * G)
    bk = pid // (L * G)
    b = bk // HKV
    kvh = bk % HKV
    l_idx = m // G
    g_idx = m % G
    s = tl.arange(0, NSPLIT_P2)
    s_ok = s < NSPLIT
    lse = tl.load(LSE + (bk * NSPLIT + s) * BLOCK_M + m, mask=s_ok, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    d = tl.arange(0, D)
    o = tl.load(OP + ((bk * NSPLIT + s) * BLOCK_M + m)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0)
    tl.store(OUT + ((b * L + l_idx) * H + kvh * G + g_idx) * D + d, out.to(OUT.dtype.element_ty))
