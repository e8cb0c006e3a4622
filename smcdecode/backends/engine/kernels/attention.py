"""Paged attention: split-KV ("flash-decoding") over a paged KV cache.

One program per (row, kv head, KV split, query tile) holds up to 64 (token, query head) rows of one
kv head as a [BLOCK_M, D] tile, so each key/value page is read once per kv head and tile, not once
per query head. Pages, offsets and the row length are computed in the kernel from the positions and
the page table; each split's share of the context is computed from the row's length, so the launch
shape depends only on the batch shape (CUDA graphs). For decode/verify (L <= 16 new tokens a row)
one kernel also applies RoPE to q and the new keys and writes the new keys/values to their pages.
The splits are merged by the last split to finish (an atomic counter per tile;
``_merge_splits_kernel`` where the counters cannot be allocated). BLOCK_N, warps, stages and the
split count are chosen per shape class and head dim (``ATTN_CONFIGS``).
References: attention.reference_paged_attention, ops.rope_kv_write_reference,
``merge_splits_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRET, dot_precision, num_sms, pdl_args, pdl_enter, row_rstd, rowscale_args, split_counters


@triton.jit
def _block_pages(PT, b, stride_pt, n0, end, PS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of positions n0 .. n0 + BLOCK_N − 1 of row b (0 at and after ``end``)."""
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(PT + b * stride_pt + n // PS, mask=n < end, other=0)


@triton.jit
def _attend_cached(q, q1, q2, KP, VP, page, kvh, n0, end, qpos, sm_scale, m_i, l_i, acc,
                   HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr,
                   DOT: tl.constexpr):
    """One block of BLOCK_N cached keys/values (positions n0.., pages ``page``, masked at ``end`` and
    causally) folded into the online softmax (m_i, l_i, acc) of a query tile."""
    HALF: tl.constexpr = D // 2
    dh = tl.arange(0, HALF)
    d = tl.arange(0, D)
    n = n0 + tl.arange(0, BLOCK_N)
    n_valid = n < end
    kv_row = ((page * HKV + kvh) * PS + n % PS) * D
    if ROPE:
        k1 = tl.load(KP + kv_row[:, None] + dh[None, :], mask=n_valid[:, None], other=0.0)
        k2 = tl.load(KP + kv_row[:, None] + HALF + dh[None, :], mask=n_valid[:, None], other=0.0)
        s = tl.dot(q1, tl.trans(k1), input_precision=DOT) + tl.dot(q2, tl.trans(k2), input_precision=DOT)
    else:
        k = tl.load(KP + kv_row[:, None] + d[None, :], mask=n_valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT)
    s = s * sm_scale  # [BLOCK_M, BLOCK_N] fp32
    v = tl.load(VP + kv_row[:, None] + d[None, :], mask=n_valid[:, None], other=0.0)
    ok = (n[None, :] <= qpos[:, None]) & n_valid[None, :]
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
    return m_new, l_i, acc


@triton.jit
def _store_or_merge(out, m_i, l_i, O, OP, LSE, CNT, o_rows, m, m_valid, tile, mt, sid, D: tl.constexpr,  # noqa: E741
                    NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, MERGE: tl.constexpr):
    """The end of an attention program (both paged kernels): its normalised tile ``out`` [BLOCK_M, D]
    (rows ``o_rows`` of O) with online-softmax state (m_i, l_i). MERGE 0: one split, store it. Else
    store the partial (o, lse) of split ``sid``; MERGE 2: the last split of ``tile`` to finish (an
    atomic counter, reset by it) merges every split's partials into O."""
    d = tl.arange(0, D)
    if MERGE == 0:
        tl.store(O + o_rows[:, None] + d[None, :], out.to(O.dtype.element_ty), mask=m_valid[:, None])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        base = (tile * NSPLIT + sid) * BLOCK_M
        tl.store(OP + (base + m - mt * BLOCK_M)[:, None] * D + d[None, :], out)
        tl.store(LSE + base + m - mt * BLOCK_M, lse)
        if MERGE == 2:
            tl.debug_barrier()  # every thread's partials are stored before the release below
            done = tl.atomic_add(CNT + tile, 1, sem="acq_rel")
            if done == NSPLIT - 1:  # the last split of this tile: merge all of them
                r = tl.arange(0, BLOCK_M)
                r_ok = m_valid
                mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
                tot = tl.zeros([BLOCK_M], tl.float32)
                res = tl.zeros([BLOCK_M, D], tl.float32)
                for sp in tl.static_range(NSPLIT):  # online: rescale when the running max grows
                    ls = tl.load(LSE + (tile * NSPLIT + sp) * BLOCK_M + r, mask=r_ok, other=float("-inf"),
                                 cache_modifier=".cg")
                    o_s = tl.load(OP + ((tile * NSPLIT + sp) * BLOCK_M + r)[:, None] * D + d[None, :],
                                  mask=r_ok[:, None], other=0.0, cache_modifier=".cg")
                    mx_new = tl.maximum(mx, ls)
                    mx_safe = tl.where(mx_new == float("-inf"), 0.0, mx_new)
                    a = tl.exp(mx - mx_safe)
                    w = tl.exp(ls - mx_safe)
                    tot = tot * a + w
                    res = res * a[:, None] + o_s * w[:, None]
                    mx = mx_new
                res = res / tl.where(tot > 0, tot, 1.0)[:, None]
                tl.store(O + o_rows[:, None] + d[None, :], res.to(O.dtype.element_ty), mask=m_valid[:, None])
                tl.store(CNT + tile, 0)  # ready for the next launch (every split of this tile has counted)


@triton.jit
def _paged_attn_kernel(
    Q, KP, VP, PT, POS, O, OP, LSE, CNT, COS, SIN,  # noqa: E741
    sm_scale, stride_qt, stride_pt,
    L: tl.constexpr, G: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    PS: tl.constexpr, NSPLIT: tl.constexpr, MT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    ROPE: tl.constexpr, MERGE: tl.constexpr, DYN_LOOP: tl.constexpr, MAX_IT: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr = 0,
    SS=None, stride_ss=0, rs_eps=0.0, RS_T: tl.constexpr = 0, RS_TP2: tl.constexpr = 1, RS_DIM: tl.constexpr = 1,
    DOT: tl.constexpr = "tf32",
):
    """One program per (row b, kv head, KV split, query tile). Query rows of a tile are the (l, g)
    pairs m = l·G + g of the row's L tokens × the G query heads of the kv head.

    ROPE: Q is the fused projection [B·L, (H + 2·HKV)·D]; q and the L new keys are rotated here, the
    new keys/values are attended to from registers and written to their pages by one program (the
    split that holds the end of the cached context), so only positions < seq_len − L are read from
    the cache. Otherwise Q is [B·L, H·D] (already rotated) and all positions < seq_len come from the
    cache. MERGE: 0 — one split, the output is written directly; 1 — partials (o, lse) only, merged by
    ``_merge_splits_kernel``; 2 — partials, then the last split to finish (an atomic counter per
    (b, kv head, tile), reset by that program) merges them. PREFETCH: each block's page ids are
    loaded one block ahead (before the current block's keys), taking the page-table load off the
    chain page ids -> keys -> dot -> values of a block. RS_T > 0 (with ROPE): the projection's rows are
    not yet scaled by their RMSNorm's 1/rms (a folded norm, ops.Normed): q and the new keys and
    values are multiplied by it here, from the RS_T partial sums of squares SS[b·L + l, t]."""
    pdl_enter(PDL)
    pid = tl.program_id(0)  # b * HKV + kvh
    sid = tl.program_id(1)
    mt = tl.program_id(2)
    b = pid // HKV
    kvh = pid % HKV
    HALF: tl.constexpr = D // 2
    m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = m < L * G
    l_idx = tl.where(m_valid, m // G, L - 1)
    g_idx = m % G
    qpos = tl.load(POS + b * L + l_idx)  # [BLOCK_M] position of each query row
    seq_len = tl.load(POS + b * L + L - 1) + 1
    dh = tl.arange(0, HALF)
    d = tl.arange(0, D)
    # with ROPE, q and k in two halves (rotate-half RoPE pairs element i with i + D/2):
    # s = q1·k1ᵀ + q2·k2ᵀ (needs D >= 32: each half is a dot's inner dimension)
    q_row = Q + (b * L + l_idx) * stride_qt + (kvh * G + g_idx) * D
    if ROPE:
        q1 = tl.load(q_row[:, None] + dh[None, :], mask=m_valid[:, None], other=0.0)
        q2 = tl.load(q_row[:, None] + HALF + dh[None, :], mask=m_valid[:, None], other=0.0)
        c = tl.load(COS + qpos[:, None] * HALF + dh[None, :])
        s_ = tl.load(SIN + qpos[:, None] * HALF + dh[None, :])
        q1f = q1.to(tl.float32)
        q2f = q2.to(tl.float32)
        if RS_T > 0:
            rq = row_rstd(SS, b * L + l_idx, m_valid, stride_ss, rs_eps, RS_T, RS_TP2, RS_DIM)
            q1f = q1f * rq[:, None]
            q2f = q2f * rq[:, None]
        q1 = (q1f * c - q2f * s_).to(KP.dtype.element_ty)
        q2 = (q2f * c + q1f * s_).to(KP.dtype.element_ty)
        q = q1
        ctx = seq_len - L  # cached positions; the L new ones come from registers
    else:
        q = tl.load(q_row[:, None] + d[None, :], mask=m_valid[:, None], other=0.0)
        q1 = q
        q2 = q
        ctx = seq_len
    # this split's share of [0, ctx), in whole key blocks (computed from the length: the launch shape
    # depends only on the batch shape, so graphs replay at any length)
    per = tl.maximum(((ctx + NSPLIT - 1) // NSPLIT + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N)
    start = sid * per
    q_last = tl.load(POS + b * L + tl.minimum(mt * BLOCK_M + BLOCK_M - 1, L * G - 1) // G)  # tile's last query
    end = tl.minimum(tl.minimum(start + per, ctx), q_last + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if ROPE:
        if sid == tl.minimum(ctx // per, NSPLIT - 1):  # the new tokens' keys/values, from registers
            # (first: their loads do not wait for the page-table loads of the cached part)
            j = tl.arange(0, BLOCK_L)
            j_valid = j < L
            jj = tl.where(j_valid, j, L - 1)
            kpos = tl.load(POS + b * L + jj)
            ck = tl.load(COS + kpos[:, None] * HALF + dh[None, :])
            sk = tl.load(SIN + kpos[:, None] * HALF + dh[None, :])
            k_row = Q + (b * L + jj) * stride_qt + (H + kvh) * D
            k1f = tl.load(k_row[:, None] + dh[None, :]).to(tl.float32)
            k2f = tl.load(k_row[:, None] + HALF + dh[None, :]).to(tl.float32)
            v = tl.load(Q + (b * L + jj)[:, None] * stride_qt + (H + HKV + kvh) * D + d[None, :])
            if RS_T > 0:
                rk = row_rstd(SS, b * L + jj, j_valid, stride_ss, rs_eps, RS_T, RS_TP2, RS_DIM)
                k1f = k1f * rk[:, None]
                k2f = k2f * rk[:, None]
                v = (v.to(tl.float32) * rk[:, None]).to(KP.dtype.element_ty)
            k1 = (k1f * ck - k2f * sk).to(KP.dtype.element_ty)
            k2 = (k2f * ck + k1f * sk).to(KP.dtype.element_ty)
            s = (tl.dot(q1, tl.trans(k1), input_precision=DOT) + tl.dot(q2, tl.trans(k2), input_precision=DOT)) * sm_scale  # [BLOCK_M, BLOCK_L]
            ok = (kpos[None, :] <= qpos[:, None]) & j_valid[None, :]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v.to(KP.dtype.element_ty), input_precision=DOT)
            m_i = m_new
            if mt == 0:  # write the new keys/values into their pages (no other program reads them)
                kpage = tl.load(PT + b * stride_pt + kpos // PS)
                dst = ((kpage * HKV + kvh) * PS + kpos % PS) * D
                tl.store(KP + dst[:, None] + dh[None, :], k1, mask=j_valid[:, None])
                tl.store(KP + dst[:, None] + HALF + dh[None, :], k2, mask=j_valid[:, None])
                tl.store(VP + dst[:, None] + d[None, :], v.to(VP.dtype.element_ty), mask=j_valid[:, None])
    if PREFETCH:
        page = _block_pages(PT, b, stride_pt, start, end, PS, BLOCK_N)
    if DYN_LOOP:
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH:
                page_next = _block_pages(PT, b, stride_pt, n0 + BLOCK_N, end, PS, BLOCK_N)
            else:
                page = _block_pages(PT, b, stride_pt, n0, end, PS, BLOCK_N)
            m_i, l_i, acc = _attend_cached(q, q1, q2, KP, VP, page, kvh, n0, end, qpos, sm_scale,
                                           m_i, l_i, acc, HKV, D, PS, BLOCK_N, ROPE, DOT)
            if PREFETCH:
                page = page_next
    else:  # Triton's interpreter needs constant loop bounds: a fixed count of (masked) blocks
        for it in range(0, MAX_IT):
            n0 = start + it * BLOCK_N
            if PREFETCH:
                page_next = _block_pages(PT, b, stride_pt, n0 + BLOCK_N, end, PS, BLOCK_N)
            else:
                page = _block_pages(PT, b, stride_pt, n0, end, PS, BLOCK_N)
            m_i, l_i, acc = _attend_cached(q, q1, q2, KP, VP, page, kvh, n0, end, qpos, sm_scale,
                                           m_i, l_i, acc, HKV, D, PS, BLOCK_N, ROPE, DOT)
            if PREFETCH:
                page = page_next
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = ((b * L + l_idx) * H + kvh * G + g_idx) * D
    _store_or_merge(out, m_i, l_i, O, OP, LSE, CNT, o_rows, m, m_valid, pid * MT + mt, mt, sid, D, NSPLIT, BLOCK_M,
                    MERGE)


# Launch parameters of the attention kernels by shape class and head dim: (BLOCK_N, num_warps,
# num_stages, programs per SM, PREFETCH). Shape classes: "decode" (L <= 2 new tokens a row), "verify"
# (3..16), "prefill" (more); a key "CLASS:D" applies to head dim D. PREFETCH 1: each block's page ids
# are loaded a block ahead. The programs per SM set the KV splits of a launch (more splits: more
# programs for few rows, each merging more partials). Chosen from a sweep on an H200 at the 8B/1B
# benchmark's shapes and interleaved end-to-end A/B runs (SMC-SD N=8 K=8, 1 and 8 requests): the draft's
# decode on 2 warps beat 4 (1 warp was faster at 8 requests, slower at 1); fewer splits for
# decode:64 and verify:128 were faster at 1 request and the same at 8; 128-key blocks, more splits,
# and verify on 2 or 8 warps, 2 stages or 32-key blocks were not faster.
ATTN_CONFIGS: dict[str, tuple[int, int, int, float, int]] = {
    "decode:64": (64, 2, 3, 2.0, 1),  # the 1B draft's decode steps
    "decode:128": (128, 4, 2, 2.0, 0),  # the 8B target's autoregressive step
    "verify:128": (64, 4, 3, 1.0, 1),  # the 8B target's (K+1)-token verify pass
}
ATTN_DEFAULT = (64, 4, 2, 2.0, 0)  # a class and head dim without an entry


def attention_shape_class(L: int) -> str:
    """The shape class of an attention launch of L new tokens a row (``ATTN_CONFIGS``' keys)."""
    return "decode" if L <= 2 else "verify" if L <= 16 else "prefill"


def attention_config(L: int, D: int) -> tuple[int, int, int, float, int]:
    """(BLOCK_N, num_warps, num_stages, programs per SM, prefetch) of a launch: ``ATTN_CONFIGS``."""
    c = attention_shape_class(L)
    return ATTN_CONFIGS.get(f"{c}:{D}", ATTN_CONFIGS.get(c, ATTN_DEFAULT))


def _check_attention_config(config) -> tuple[int, int, int, float, int]:
    ok = isinstance(config, (tuple, list)) and len(config) == 5
    if ok:
        block_n, warps, stages, per_sm, prefetch = config
        ok = (isinstance(block_n, int) and block_n >= 16 and not block_n & (block_n - 1) and warps in (1, 2, 4, 8, 16)
              and isinstance(stages, int) and stages >= 1 and per_sm > 0 and prefetch in (0, 1))
    if not ok:
        raise ValueError(f"attention config {config!r}: expected (block_n, warps, stages, programs_per_sm, prefetch), "
                         "block_n a power of two >= 16, warps one of 1, 2, 4, 8, 16, stages >= 1, "
                         "programs_per_sm > 0 and prefetch 0 or 1")
    return tuple(config)


def _attention_launch(B: int, L: int, G: int, Hkv: int, D: int, capacity: int, device: torch.device, config):
    """(BLOCK_M, query tiles, BLOCK_N, KV splits, merge mode, num_warps, num_stages, prefetch) for a
    launch; depends on shapes only. ``config`` (default ``attention_config(L, D)``): see
    ``ATTN_CONFIGS``. The splits are merged by the last split to finish (merge mode 2)."""
    block_m = max(16, min(64, triton.next_power_of_2(L * G)))
    mt = triton.cdiv(L * G, block_m)
    block_n, warps, stages, per_sm, prefetch = (attention_config(L, D) if config is None
                                                else _check_attention_config(config))
    progs = B * Hkv * mt
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    nsplit = max(1, min(32, triton.cdiv(capacity, block_n), int(per_sm * sms) // progs))
    return block_m, mt, block_n, nsplit, 0 if nsplit == 1 else 2, warps, stages, prefetch


def _launch_attention(src: Tensor, stride_qt: int, B: int, L: int, H: int, k_pool: Tensor, v_pool: Tensor,
                      batch, cos: Tensor | None, sin: Tensor | None, out_dtype, rowscale=None, config=None) -> Tensor:
    _, Hkv, PS, D = k_pool.shape
    G = H // Hkv
    P = batch.page_table.shape[1]
    pos = batch.positions
    if pos.dtype != torch.long or not pos.is_contiguous():
        pos = pos.long().contiguous()
    block_m, mt, block_n, nsplit, merge, warps, stages, prefetch = _attention_launch(B, L, G, Hkv, D, P * PS,
                                                                                     src.device, config)
    dev = src.device
    out = torch.empty(B, L, H, D, device=dev, dtype=out_dtype)
    cnt = split_counters(dev, B * Hkv * mt) if merge == 2 else None
    if merge == 2 and cnt is None:  # (counters not yet allocated, inside a capture: a merge kernel)
        merge = 1
    if merge:
        o_part = torch.empty(B * Hkv * mt, nsplit, block_m, D, device=dev, dtype=torch.float32)
        lse = torch.empty(B * Hkv * mt, nsplit, block_m, device=dev, dtype=torch.float32)
    else:
        o_part = lse = out
    rope = cos is not None
    _paged_attn_kernel[(B * Hkv, nsplit, mt)](
        src, k_pool, v_pool, batch.page_table, pos, out, o_part, lse, cnt if cnt is not None else pos,
        cos if rope else o_part, sin if rope else o_part,
        D**-0.5, stride_qt, batch.page_table.stride(0),
        L=L, G=G, H=H, HKV=Hkv, D=D, PS=PS, NSPLIT=nsplit, MT=mt,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_L=max(16, triton.next_power_of_2(L)),
        ROPE=rope, MERGE=merge, DYN_LOOP=not INTERPRET,
        MAX_IT=max(1, triton.cdiv(triton.cdiv(P * PS, nsplit), block_n)) if INTERPRET else 1, PREFETCH=bool(prefetch),
        num_warps=warps, num_stages=stages, DOT=dot_precision(src.dtype), **pdl_args(dev), **rowscale_args(rowscale),
    )
    if merge == 1:
        _merge_splits_kernel[(B * Hkv * L * G,)](
            o_part, lse, out, L=L, G=G, H=H, HKV=Hkv, D=D, NSPLIT=nsplit,
            NSPLIT_P2=max(2, triton.next_power_of_2(nsplit)), BLOCK_M=block_m, num_warps=1, **pdl_args(dev),
        )
    return out


def triton_paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, batch, config=None) -> Tensor:
    """q [B, L, H, D] (already rotated; its keys/values already in the pools), pools
    [num_pages, Hkv, PS, D] -> [B, L, H, D]. Any L: query rows are tiled (64 a program).

    The launch shape depends only on B, L and the page-table width, never on the current lengths
    (each split's share of the context is computed in the kernel), so the call can be captured in
    a CUDA graph. ``config``: (BLOCK_N, num_warps, num_stages, programs per SM, prefetch), default
    ``attention_config(L, D)``. Reference: attention.reference_paged_attention."""
    q = q.contiguous()
    B, L, H, D = q.shape
    return _launch_attention(q, H * D, B, L, H, k_pool, v_pool, batch, None, None, q.dtype, config=config)


def triton_rope_paged_attention(qkv: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor, batch,
                                H: int, rowscale=None, config=None) -> Tensor:
    """RoPE + KV-page write + paged attention in one kernel: qkv [B, L, (H + 2Hkv)·D] (the fused
    projection, contiguous), cos/sin tables [max_pos, D/2] (float32) -> [B, L, H, D]; the rotated
    keys and the values of the L new tokens are written to the pools at their positions (pages from
    the page table). For decode/verify shapes (L <= 16). Reference: ops.rope_kv_write_reference
    followed by attention.reference_paged_attention.

    ``rowscale`` = (sumsq [B·L, T] float32, eps, dim): qkv's rows are the product of a folded norm's
    γ ⊙ h (ops.Normed), not yet scaled by 1 / rms(h); they are scaled here (q, and the new keys and
    values before they are written). Reference: scale qkv's rows by ops.Normed.rstd first.
    ``config``: as ``triton_paged_attention``'s."""
    qkv = qkv.contiguous()
    B, L, W = qkv.shape
    return _launch_attention(qkv, W, B, L, H, k_pool, v_pool, batch, cos, sin, qkv.dtype, rowscale, config)


def merge_splits_reference(o_part: Tensor, lse: Tensor, B: int, L: int, H: int, Hkv: int, dtype) -> Tensor:
    """Torch reference of ``_merge_splits_kernel``: o_part [B·Hkv·MT, S, BLOCK_M, D], lse [B·Hkv·MT, S,
    BLOCK_M] (query rows m = l·G + g, G = H / Hkv, in MT tiles of BLOCK_M) -> out [B, L, H, D] =
    Σ_s softmax_s(lse) · o_s (splits with no keys for a row have lse = -inf)."""
    S, BM, D = o_part.shape[1:]
    G = H // Hkv
    w = torch.softmax(lse, dim=1)
    out = (o_part * w[..., None]).sum(dim=1)  # [B·Hkv·MT, BM, D]
    out = out.reshape(B, Hkv, -1, D)[:, :, : L * G]  # rows ordered (l, g)
    return out.reshape(B, Hkv, L, G, D).permute(0, 2, 1, 3, 4).reshape(B, L, H, D).to(dtype)


@triton.jit
def _merge_splits_kernel(OP, LSE, OUT, L: tl.constexpr, G: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr,
                         D: tl.constexpr, NSPLIT: tl.constexpr, NSPLIT_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                         PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    pid = tl.program_id(0)  # ((b * HKV + kvh) * L + l) * G + g
    mg = pid % (L * G)
    bk = pid // (L * G)
    b = bk // HKV
    kvh = bk % HKV
    l_idx = mg // G
    g_idx = mg % G
    MT: tl.constexpr = (L * G + BLOCK_M - 1) // BLOCK_M
    tile = bk * MT + mg // BLOCK_M
    m = mg % BLOCK_M
    s = tl.arange(0, NSPLIT_P2)
    s_ok = s < NSPLIT
    lse = tl.load(LSE + (tile * NSPLIT + s) * BLOCK_M + m, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(mx == float("-inf"), 0.0, mx))
    w = w / tl.sum(w, 0)
    d = tl.arange(0, D)
    o = tl.load(OP + ((tile * NSPLIT + s) * BLOCK_M + m)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0)
    tl.store(OUT + ((b * L + l_idx) * H + kvh * G + g_idx) * D + d, out.to(OUT.dtype.element_ty))
