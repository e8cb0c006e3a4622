"""Triton kernels of the engine. Each has a pure-torch reference (named in its docstring) and a
test against it: on the GPU (tests/test_engine_kernels.py) and on the CPU in Triton's interpreter
(tests/test_engine_ops.py, where triton is installed); the references run the CPU tests.

add + RMSNorm, SiLU·mul, RoPE + KV-page write — one launch each (references in model.py); the
separate RoPE + KV-page write is used only for long extensions (prefill).

paged attention — split-KV ("flash-decoding") over a paged cache. One program per (row, kv head,
KV split, query tile) holds up to 64 (token, query head) rows of one kv head as a [BLOCK_M, D] tile,
so each key/value page is read once per kv head and tile, not once per query head. Pages, offsets
and the row length are computed in the kernel from the positions and the page table; each split's
share of the context is computed from the row's length, so the launch shape depends only on the
batch shape (CUDA graphs). For decode/verify (L <= 16 new tokens a row) one kernel also applies
RoPE to q and the new keys and writes the new keys/values to their pages. The splits are merged by
the last split to finish (an atomic counter per tile; ``_merge_splits_kernel`` where the counters
cannot be allocated). BLOCK_N, warps, stages and the split count are chosen per shape class and head
dim (``ATTN_CONFIGS``). References: attention.reference_paged_attention,
model.rope_kv_write_reference, merge_splits_reference.

skinny products — x · Wᵀ for few rows (draft decode), optionally with SiLU·mul in the epilogue
(reference: torch's linear and model.silu_mul).

page copies — the copy-on-write copies of whole KV pages, all layers, keys and values, in one launch
that skips the entries a round did not need (reference: ``KVPool.copy_pages``' gather and scatter).

sample and score — exponential-race sampling, log-sum-exp and the gather of log q(d) over [R, V]
logits in one read; rows that need no token (verify's scored rows) can skip the noise and the race
(reference: engine.sample_and_score_reference).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

try:  # grid dependency control (programmatic dependent launch; Triton >= 3.3, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off (pdl_mode() returns 0)
    gdc_launch_dependents = gdc_wait = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL)
#
# In a CUDA graph a chain of small dependent kernels (a draft step: ~7 launches a layer) pays each
# launch's set-up and ramp before any work starts. With PDL a kernel is launched while the one before
# it still runs and waits (griddepcontrol.wait) before it reads or writes anything; every Triton
# kernel of the engine takes PDL (0: off; 1: wait, then release the next kernel at once). Kernels
# that are not ours (cuBLAS, torch) are launched normally and wait for full completion, so mixing is
# safe. An L2 prefetch of the skinny product's weights before the wait measured slower.


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # everything the earlier kernels wrote is visible after this
        gdc_launch_dependents()  # the next kernel may start (it waits likewise before it reads)


@functools.lru_cache(maxsize=8)
def _pdl_capable(device_index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


_PDL_OFF = [0]  # depth of ``pdl_off()`` contexts


@contextlib.contextmanager
def pdl_off():
    """Kernels launched (and captured) within it do not take PDL: ``Engine.autoregressive`` and
    ``Engine.speculative`` run in it (PDL measured slower for autoregressive decoding)."""
    _PDL_OFF[0] += 1
    try:
        yield
    finally:
        _PDL_OFF[0] -= 1


def pdl_enabled() -> bool:
    """Whether kernels launched now take PDL where the device allows it: yes, except inside
    ``pdl_off()``."""
    return not _PDL_OFF[0]


def pdl_mode(device: torch.device) -> int:
    """The PDL constexpr of a launch on ``device``: 1 (wait for the previous kernel, then release the
    next one) where ``pdl_enabled()``, on sm_90+ (Hopper) with a Triton that has grid dependency
    control; 0 on the CPU, under Triton's interpreter, before sm_90 and inside ``pdl_off()``.
    Measured on an H200 (interleaved, 1,024-token outputs): SMC-SD N=8 K=8 0.07 ms a round faster
    with it at 1 request and 0.05-0.10 ms at 8; autoregressive decoding 0.07 ms a token slower."""
    if not pdl_enabled() or device.type != "cuda" or _INTERPRET or not _pdl_capable(device.index or 0):
        return 0
    return 1


def _pdl(device: torch.device) -> dict:
    """Launch keywords of a kernel taking PDL: {"PDL": mode} and, when on, Triton's launch_pdl."""
    mode = pdl_mode(device)
    return {"PDL": mode, "launch_pdl": True} if mode else {}


@triton.jit
def _block_pages(PT, b, stride_pt, n0, end, PS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of positions n0 .. n0 + BLOCK_N − 1 of row b (0 at and after ``end``)."""
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(PT + b * stride_pt + n // PS, mask=n < end, other=0)


@triton.jit
def _row_rstd(SS, rows, rows_ok, stride_ss, eps, T: tl.constexpr, T_P2: tl.constexpr, DIM: tl.constexpr):
    """1 / rms of the residual-stream rows ``rows`` from their float32 partial sums of squares
    SS[row, t] over T column blocks (a folded norm's ``sumsq``, written by the skinny product's
    RESID epilogue; a row's T partials are contiguous, one vector load): rsqrt(Σ_t SS[row, t] / DIM
    + eps). Reference: model.Normed.rstd."""
    t = tl.arange(0, T_P2)
    s = tl.load(SS + rows[:, None] * stride_ss + t[None, :], mask=(t[None, :] < T) & rows_ok[:, None], other=0.0)
    return 1.0 / tl.sqrt(tl.sum(s, 1) / DIM + eps)


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
    not yet scaled by their RMSNorm's 1/rms (a folded norm, model.Normed): q and the new keys and
    values are multiplied by it here, from the RS_T partial sums of squares SS[b·L + l, t]."""
    _pdl_enter(PDL)
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
            rq = _row_rstd(SS, b * L + l_idx, m_valid, stride_ss, rs_eps, RS_T, RS_TP2, RS_DIM)
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
                rk = _row_rstd(SS, b * L + jj, j_valid, stride_ss, rs_eps, RS_T, RS_TP2, RS_DIM)
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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_COUNTERS: dict = {}


def _split_counters(device: torch.device, n: int, kind: str = "attn") -> Tensor | None:
    """A zeroed int32 buffer of >= n counters, kept for the process (each merging program resets its
    counter, so it stays zero between launches), one per ``kind`` of kernel. None when it would have
    to be allocated inside a CUDA-graph capture (the caller then merges some other way)."""
    key = (device, kind)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


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
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
    nsplit = max(1, min(32, triton.cdiv(capacity, block_n), int(per_sm * sms) // progs))
    return block_m, mt, block_n, nsplit, 0 if nsplit == 1 else 2, warps, stages, prefetch


def _dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for operands of ``dtype``: float32 operands are multiplied in
    full float32 ("ieee") unless torch allows TF32 for float32 products
    (``torch.backends.cuda.matmul.allow_tf32``), as torch's own products are; bf16/fp16 operands
    ignore it ("tf32", Triton's default, keeps their kernels as they were). Triton's default for
    float32 is TF32: a float32 engine then differed from the float32 HF reference by ~3·10⁻³ in the
    logits of the runner tests' model (docs/engine.md)."""
    return "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


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
    cnt = _split_counters(dev, B * Hkv * mt) if merge == 2 else None
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
        ROPE=rope, MERGE=merge, DYN_LOOP=not _INTERPRET,
        MAX_IT=max(1, triton.cdiv(triton.cdiv(P * PS, nsplit), block_n)) if _INTERPRET else 1, PREFETCH=bool(prefetch),
        num_warps=warps, num_stages=stages, DOT=_dot_precision(src.dtype), **_pdl(dev), **_rowscale_args(rowscale),
    )
    if merge == 1:
        _merge_splits_kernel[(B * Hkv * L * G,)](
            o_part, lse, out, L=L, G=G, H=H, HKV=Hkv, D=D, NSPLIT=nsplit,
            NSPLIT_P2=max(2, triton.next_power_of_2(nsplit)), BLOCK_M=block_m, num_warps=1, **_pdl(dev),
        )
    return out


def _rowscale_args(rowscale, ss_name: str = "SS") -> dict:
    """Kernel arguments of a row scale (sumsq [rows, T] float32, eps, dim): see ``_row_rstd``."""
    if rowscale is None:
        return {}
    ss, eps, dim = rowscale
    if ss.dtype != torch.float32 or ss.dim() != 2 or ss.stride(1) != 1:
        raise ValueError(f"sumsq: expected float32 partial sums [rows, T], contiguous in T, got "
                         f"{ss.dtype} {tuple(ss.shape)} strides {ss.stride()}")
    return {ss_name: ss, "stride_ss": ss.stride(0), "rs_eps": float(eps), "RS_T": ss.shape[1],
            "RS_TP2": max(2, triton.next_power_of_2(ss.shape[1])), "RS_DIM": dim}


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
    the page table). For decode/verify shapes (L <= 16). Reference: model.rope_kv_write_reference
    followed by attention.reference_paged_attention.

    ``rowscale`` = (sumsq [B·L, T] float32, eps, dim): qkv's rows are the product of a folded norm's
    γ ⊙ h (model.Normed), not yet scaled by 1 / rms(h); they are scaled here (q, and the new keys and
    values before they are written). Reference: scale qkv's rows by model.Normed.rstd first.
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
    _pdl_enter(PDL)
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


# ------------------------------------------------------------------------------------------------
# Fused elementwise kernels of a layer (one launch each instead of 5–10 small ones)


@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, H_OUT, Y, stride_x, stride_d, eps, DIM: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, PDL: tl.constexpr = 0,
                         NSPLIT: tl.constexpr = 0, stride_s=0, TOK=None, GATHER: tl.constexpr = 0):
    """NSPLIT > 0: DELTA holds NSPLIT float32 partial sums (split stride stride_s), added in order and
    rounded to the stream's dtype first, as the unsplit product would have been. GATHER: X is an
    embedding table and row r's input is its row TOK[r] (stored to H_OUT: the stream)."""
    _pdl_enter(PDL)
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
    as cuBLAS writes the transposed problem W·xᵀ (model.linear_to_residual) — BLOCK_M rows a program,
    so that each column's BLOCK_M entries are one contiguous read. (Two passes over column blocks,
    to transpose smaller tiles, measured 1.5–3× slower on an H200.)"""
    _pdl_enter(PDL)
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
    Reference: model.add_rms_norm_reference (with model.SplitSum.total for ``parts``)."""
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
                BLOCK=triton.next_power_of_2(dim), BLOCK_M=block_m, num_warps=warps, **_pdl(x.device))
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
                               num_warps=max(1, min(16, block // 512)), **_pdl(x.device))
    return (h.view(shape) if has_delta else x), y.view(shape)


def triton_embed_rms_norm(tokens: Tensor, table: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x, y) with x = table[tokens] (the embedding lookup, [..., dim]) and y = weight · x / rms(x): the
    lookup and the first RMSNorm in one launch. Reference: model.add_rms_norm_reference of the lookup."""
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
                               **_pdl(table.device))
    shape = (*tokens.shape, dim)
    return x.view(shape), y.view(shape)


@triton.jit
def _silu_mul_kernel(GU, OUT, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
                     SS=None, stride_ss=0, rs_eps=0.0, RS_T: tl.constexpr = 0, RS_TP2: tl.constexpr = 1,
                     RS_DIM: tl.constexpr = 1):
    """RS_T > 0: gate and up are first scaled by the row's 1/rms (a folded norm; see ``_row_rstd``)."""
    _pdl_enter(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < INTER
    g = tl.load(GU + row * 2 * INTER + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * INTER + INTER + c, mask=ok, other=0.0).to(tl.float32)
    if RS_T > 0:
        r = tl.sum(_row_rstd(SS, row + tl.arange(0, 1), tl.full([1], 1, tl.int1), stride_ss, rs_eps, RS_T, RS_TP2,
                             RS_DIM), 0)
        g = (g * r).to(OUT.dtype.element_ty).to(tl.float32)
        u = (u * r).to(OUT.dtype.element_ty).to(tl.float32)
    # torch: silu(gate) rounded to the dtype, then times up
    s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * INTER + c, (s * u).to(OUT.dtype.element_ty), mask=ok)


def triton_silu_mul(gate_up: Tensor, rowscale=None) -> Tensor:
    """silu(gate) · up for gate_up = [gate | up] [..., 2I] (contiguous). Reference: model.silu_mul.
    ``rowscale`` = (sumsq [rows, T], eps, dim): gate and up are first scaled row by row by a folded
    norm's 1/rms (each rounded to the dtype, as a product of the scaled input would be); reference:
    model.silu_mul of the rows times model.Normed.rstd."""
    I2 = gate_up.shape[-1]
    gu = gate_up.reshape(-1, I2)
    out = torch.empty(gu.shape[0], I2 // 2, device=gu.device, dtype=gu.dtype)
    block = 1024
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(I2 // 2, block))](gu, out, INTER=I2 // 2, BLOCK=block, num_warps=4,
                                                                  **_pdl(gu.device), **_rowscale_args(rowscale))
    return out.view(*gate_up.shape[:-1], I2 // 2)


@triton.jit
def _rope_kv_write_kernel(QKV, POS, COS, SIN, PAGES, OFFS, Q_OUT, KP, VP,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                          PDL: tl.constexpr = 0):
    _pdl_enter(PDL)
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
                                             H=H, HKV=Hkv, D=D, PS=PS, num_warps=1, **_pdl(qkv.device))
    return q


# ------------------------------------------------------------------------------------------------
# Sampling and scoring over [R, V] logits in one pass (two launches: splits, then a merge per row)


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
    _pdl_enter(PDL)
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
    _pdl_enter(PDL)
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
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
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
    Reference: engine.sample_and_score_reference."""
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
                                      **_pdl(logits.device))
    tok = torch.empty(R, device=logits.device, dtype=torch.long)
    logp_tok = torch.empty(R, device=logits.device, dtype=torch.float32)
    logp_gather = torch.empty(R, device=logits.device, dtype=torch.float32) if gather is not None else None
    _sample_merge_kernel[(R,)](part, logits, logits.stride(0), 1.0 / temperature,
                               gather if gather is not None else tok, tok, logp_tok,
                               logp_gather if gather is not None else logp_tok,
                               NSPLIT=nsplit, NSPLIT_P2=max(2, triton.next_power_of_2(nsplit)),
                               HAS_GATHER=gather is not None, SAMPLE_EVERY=sample_every, num_warps=1,
                               **_pdl(logits.device))
    return tok, logp_tok, logp_gather


# ------------------------------------------------------------------------------------------------
# Copy-on-write page copies


@triton.jit
def _copy_pages_kernel(KV, SRC, DST, n_pages, PAGE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """KV is a pool viewed as [S, n_pages, PAGE] (S = layers × keys/values, PAGE = one page of one
    slice, contiguous); program (c, s, chunk) copies BLOCK elements of slice s from page SRC[c] to
    page DST[c]. An entry whose DST is the null page 0, or equals its SRC, copies nothing (the fused
    round passes one entry a row, most of them empty)."""
    _pdl_enter(PDL)
    c = tl.program_id(0)
    s = tl.program_id(1)
    dst = tl.load(DST + c).to(tl.int64)
    src = tl.load(SRC + c).to(tl.int64)
    if (dst != 0) & (dst != src):
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < PAGE
        base = s.to(tl.int64) * n_pages * PAGE
        x = tl.load(KV + base + src * PAGE + offs, mask=ok)
        tl.store(KV + base + dst * PAGE + offs, x, mask=ok)


def triton_copy_pages(kv: Tensor, src: Tensor, dst: Tensor) -> None:
    """kv [..., num_pages, ...] with the page axis third ([layers, 2, num_pages, Hkv, PS, D], as
    ``KVPool.kv``): every page dst[i] of every layer's keys and values becomes a copy of page src[i];
    entries with dst[i] == 0 or dst[i] == src[i] are skipped. src/dst: int tensors of one length on
    kv's device. Reference: ``KVPool.copy_pages`` without Triton (a gather then a scatter)."""
    S = kv.shape[0] * kv.shape[1]
    n_pages = kv.shape[2]
    page = kv[0, 0, 0].numel()
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)}: give two 1-D tensors of one length")
    if src.numel() == 0:
        return
    block = min(4096, triton.next_power_of_2(page))
    _copy_pages_kernel[(src.numel(), S, triton.cdiv(page, block))](
        kv, src, dst, n_pages, PAGE=page, BLOCK=block, num_warps=4, **_pdl(kv.device))


# ------------------------------------------------------------------------------------------------
# Skinny matrix products (few rows: the draft's decode steps), optionally with SiLU·mul fused


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

    Folded RMSNorm (model.Normed): RESID adds the product to the residual stream R [M, N] in the
    epilogue and prepares the next RMSNorm without a launch of its own: h = R + X·Wᵀ -> H_OUT,
    γ ⊙ h -> GH_OUT (GAMMA: the next norm's weight), and this program's Σ h² over its BLOCK_N
    columns -> SS[row, pid_n] (float32 [M, cdiv(N, BLOCK_N)]). With SPLIT > 1 the partials go to Y
    as above and the last split of a column block to finish (an atomic counter in CNT, reset by
    it) adds them up in order and runs that epilogue. RS_T > 0 (not with RESID): the product's rows
    are scaled by the 1/rms of a folded norm from its RS_T partial sums SS_IN (``_row_rstd``), before
    SiLU·mul's rounding."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_first = tl.program_id(2) * K_PER  # (K_PER = K without a split: one program on the K axis)
    _pdl_enter(PDL)
    if RS_T > 0:  # (loaded before the K loop: its latency hides behind the weights')
        r = _row_rstd(SS_IN, rm, m_ok, stride_ss, rs_eps, RS_T, RS_TP2, RS_DIM)
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
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
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
    model.silu_mul of it.

    ``split`` > 1 splits K over that many programs a column block and returns their float32
    partial sums [split, ..., N] instead (their sum over the first dim is the product; reference:
    ``model.SplitSum.total``); ``triton_add_rms_norm(..., parts=...)`` consumes them.

    ``rowscale`` = (sumsq [rows, T], eps, dim) (not with split): x is a folded norm's γ ⊙ h and the
    product's rows are scaled by 1 / rms(h) before SiLU·mul (reference: the product's rows times
    model.Normed.rstd, then silu_mul)."""
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
        SPLIT=split, K_PER=k_per if split > 1 else K, num_warps=warps, num_stages=stages, **_pdl(x.device),
        DOT=_dot_precision(x.dtype), **_rowscale_args(rowscale, "SS_IN"))
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
    epilogue (no extra launch). Reference: model.linear_add_norm_reference."""
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
        cnt = _split_counters(x.device, cols * triton.cdiv(M, bm), kind="skinny")
        if cnt is None:  # (counters would have to be allocated inside a graph capture: no split)
            split, k_per = 1, K
    y = torch.empty(split, M, N, device=x.device, dtype=torch.float32) if split > 1 else h
    _skinny_linear_kernel[(cols, triton.cdiv(M, bm), split)](
        x2, weight, y, M, x2.stride(0), N=N, K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SILU=False,
        SPLIT=split, K_PER=k_per if split > 1 else K, R=r2, H_OUT=h, GAMMA=gamma, GH_OUT=gh, SS=ss,
        CNT=cnt if cnt is not None else ss, RESID=1, num_warps=warps, num_stages=stages, **_pdl(x.device),
        DOT=_dot_precision(x.dtype))
    shape = (*x.shape[:-1], N)
    return h.view(shape), gh.view(shape), ss


def splitk_config(M: int, N: int, K: int, device: torch.device) -> tuple[tuple[int, int, int, int, int], int] | None:
    """(skinny config, K splits) for a product whose output only feeds a residual add + RMSNorm (a
    layer's wo and w2) at few rows, or None where it stays as it was (no split would be made): the
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
    if K < 4096 or M > 16:  # (small products, and more rows: not measured; they stay as they were)
        return None
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
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
