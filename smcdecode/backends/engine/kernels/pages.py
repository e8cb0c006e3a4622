"""Copy-on-write copies of whole KV pages: all layers, keys and values, in one launch that skips the
entries a round did not need. Reference: ``KVPool.copy_pages``' gather and scatter."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import pdl_args, pdl_enter


@triton.jit
def _copy_pages_kernel(KV, SRC, DST, n_pages, PAGE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """KV is a pool viewed as [S, n_pages, PAGE] (S = layers × keys/values, PAGE = one page of one
    slice, contiguous); program (c, s, chunk) copies BLOCK elements of slice s from page SRC[c] to
    page DST[c]. An entry whose DST is the null page 0, or equals its SRC, copies nothing (the fused
    round passes one entry a row, most of them empty)."""
    pdl_enter(PDL)
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
        kv, src, dst, n_pages, PAGE=page, BLOCK=block, num_warps=4, **pdl_args(kv.device))
