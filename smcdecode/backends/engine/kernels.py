"""Triton kernels of the engine. Each has a pure-torch reference (named in its docstring) and a
GPU test against it (tests/test_engine_kernels.py); the references run the CPU tests.

add + RMSNorm, SiLU·mul, RoPE + KV-page write — one launch each per layer (references in model.py).

sample and score — exponential-race sampling, log-sum-exp and the gather of log q(d) over [R, V]
logits in one read (reference: engine.sample_and_score_reference).

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


# ------------------------------------------------------------------------------------------------
# Fused elementwise kernels of a layer (one launch each instead of 5–10 small ones)


@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, H_OUT, Y, stride_x, stride_d, eps, DIM: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < DIM
    x = tl.load(X + row * stride_x + c, mask=ok, other=0.0)
    if HAS_DELTA:
        x = x + tl.load(DELTA + row * stride_d + c, mask=ok, other=0.0)  # in the stream's dtype, as torch adds
        tl.store(H_OUT + row * DIM + c, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / DIM + eps)
    w = tl.load(W + c, mask=ok, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * DIM + c, y.to(Y.dtype.element_ty), mask=ok)


def triton_add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, y) with h = x + delta (x when delta is None) and y = weight · h / rms(h), over the last dim.
    x, delta [..., dim] with unit stride in the last dim (row-strided views are fine).
    Reference: model.add_rms_norm_reference."""
    dim = x.shape[-1]
    shape = x.shape
    x2 = x.reshape(-1, dim)
    d2 = delta.reshape(-1, dim) if delta is not None else x2
    M = x2.shape[0]
    h = torch.empty(M, dim, device=x.device, dtype=x.dtype) if delta is not None else x2
    y = torch.empty(M, dim, device=x.device, dtype=x.dtype)
    block = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(M,)](x2, d2, weight, h, y, x2.stride(0), d2.stride(0), eps, DIM=dim, BLOCK=block,
                               HAS_DELTA=delta is not None, num_warps=max(1, min(16, block // 512)))
    return (h.view(shape) if delta is not None else x), y.view(shape)


@triton.jit
def _silu_mul_kernel(GU, OUT, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < INTER
    g = tl.load(GU + row * 2 * INTER + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * INTER + INTER + c, mask=ok, other=0.0).to(tl.float32)
    # torch: silu(gate) rounded to the dtype, then times up
    s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * INTER + c, (s * u).to(OUT.dtype.element_ty), mask=ok)


def triton_silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) · up for gate_up = [gate | up] [..., 2I] (contiguous). Reference: model.silu_mul."""
    I2 = gate_up.shape[-1]
    gu = gate_up.reshape(-1, I2)
    out = torch.empty(gu.shape[0], I2 // 2, device=gu.device, dtype=gu.dtype)
    block = 1024
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(I2 // 2, block))](gu, out, INTER=I2 // 2, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], I2 // 2)


@triton.jit
def _rope_kv_write_kernel(QKV, POS, COS, SIN, PAGES, OFFS, Q_OUT, KP, VP,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr):
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
    Reference: model.rope_kv_write_reference."""
    B, L, _ = qkv.shape
    _, _, PS, D = k_pool.shape
    q = torch.empty(B, L, H, D, device=qkv.device, dtype=qkv.dtype)
    _rope_kv_write_kernel[(B * L, H + Hkv)](qkv, positions, cos, sin, pages, offsets, q, k_pool, v_pool,
                                             H=H, HKV=Hkv, D=D, PS=PS, num_warps=1)
    return q


# ------------------------------------------------------------------------------------------------
# Sampling and scoring over [R, V] logits in one pass (two launches: splits, then a merge per row)


@triton.jit
def _sample_split_kernel(LOGITS, SEED, stride_r, inv_temp, PART, V: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr, NSPLIT: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    seed = tl.load(SEED)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # running max of x (per lane)
    acc = tl.zeros([BLOCK], tl.float32)  # Σ exp(x − m) per lane
    best_key = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    best_x = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, CHUNK, BLOCK):
        c = s * CHUNK + c0 + tl.arange(0, BLOCK)
        ok = c < V
        x = tl.load(LOGITS + r * stride_r + c, mask=ok, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
        # U in (0, 1) strictly, on a 2^-23 grid (tl.rand can round up to exactly 1.0, which would
        # give E = 0 and an infinite key whatever the logit)
        bits = tl.randint(seed, r * V + c).to(tl.uint32, bitcast=True) >> 9
        u = bits.to(tl.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08
        key = x - tl.log(-tl.log(u))  # Gumbel-max = exponential race: x − log E, E = −log U
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, c, best_idx)
        best_x = tl.where(better, x, best_x)
    M = tl.max(m, 0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    total = tl.sum(acc * tl.exp(m - M_safe), 0)
    K = tl.max(best_key, 0)
    j = tl.argmax(best_key, 0)
    sel = tl.arange(0, BLOCK) == j
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
                         NSPLIT: tl.constexpr, NSPLIT_P2: tl.constexpr, HAS_GATHER: tl.constexpr):
    r = tl.program_id(0)
    s = tl.arange(0, NSPLIT_P2)
    ok = s < NSPLIT
    base = PART + (r * NSPLIT + s) * 5
    m = tl.load(base + 0, mask=ok, other=float("-inf"))
    tot = tl.load(base + 1, mask=ok, other=0.0)
    key = tl.load(base + 2, mask=ok, other=float("-inf"))
    M = tl.max(m, 0)
    lse = M + tl.log(tl.sum(tot * tl.exp(m - M), 0))
    j = tl.argmax(key, 0)
    tok = tl.load(PART + (r * NSPLIT + j) * 5 + 3).to(tl.int64)
    xb = tl.load(PART + (r * NSPLIT + j) * 5 + 4)
    tl.store(TOK + r, tok)
    tl.store(LOGP_TOK + r, xb - lse)
    if HAS_GATHER:
        g = tl.load(GATHER + r)
        xg = tl.load(LOGITS + r * stride_r + g).to(tl.float32) * inv_temp
        tl.store(LOGP_GATHER + r, xg - lse)


def triton_sample_and_score(logits: Tensor, temperature: float, seed: Tensor, gather: Tensor | None = None
                            ) -> tuple[Tensor, Tensor, Tensor | None]:
    """For each row of ``logits`` [R, V] (unit stride in V) with x = logits / temperature:
    token ~ softmax(x) by the exponential race (Gumbel noise from Philox, keyed by ``seed`` — a
    device int64 scalar — and the element's index), log softmax(x)[token], and log softmax(x)[gather]
    (when ``gather`` [R] long is given). One read of the logits; no host sync.
    Reference: engine.sample_and_score_reference."""
    R, V = logits.shape
    block = 1024
    chunk = 8 * block
    if V < chunk:
        block = max(16, min(block, triton.next_power_of_2(V)))
        chunk = triton.cdiv(V, block) * block
    nsplit = triton.cdiv(V, chunk)
    part = torch.empty(R, nsplit, 5, device=logits.device, dtype=torch.float32)
    _sample_split_kernel[(R, nsplit)](logits, seed, logits.stride(0), 1.0 / temperature, part, V=V, CHUNK=chunk,
                                      BLOCK=block, NSPLIT=nsplit, num_warps=4)
    tok = torch.empty(R, device=logits.device, dtype=torch.long)
    logp_tok = torch.empty(R, device=logits.device, dtype=torch.float32)
    logp_gather = torch.empty(R, device=logits.device, dtype=torch.float32) if gather is not None else None
    _sample_merge_kernel[(R,)](part, logits, logits.stride(0), 1.0 / temperature,
                               gather if gather is not None else tok, tok, logp_tok,
                               logp_gather if gather is not None else logp_tok,
                               NSPLIT=nsplit, NSPLIT_P2=max(2, triton.next_power_of_2(nsplit)),
                               HAS_GATHER=gather is not None, num_warps=1)
    return tok, logp_tok, logp_gather
