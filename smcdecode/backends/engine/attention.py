"""Paged attention for decode (L = 1 or 2 queries per row) and the (K+1)-query verify pass.

Query i of row b sits at position ``seq_lens[b] - L + i`` and attends to every cached position
<= its own (the new keys were written to the cache before attention). Two implementations with the
same contract: ``reference_paged_attention`` (pure torch: gather the row's pages, masked softmax in
float32; runs anywhere, and is what the Triton kernel is tested against) and the Triton
split-KV kernel in ``kernels/attention.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass
class PagedBatch:
    """Where the L new tokens of each of B rows go and what they attend to (device tensors).

    The Triton kernels read only ``positions`` and ``page_table`` (pages, offsets and lengths are
    computed in the kernels); the derived fields below are computed on first use, for the torch
    references."""

    positions: Tensor  # [B, L] long: position of each new token (consecutive within a row)
    page_table: Tensor  # [B, P] int32: page ids of each row, in order
    page_size: int

    @classmethod
    def build(cls, positions: Tensor, page_table: Tensor, page_size: int) -> PagedBatch:
        """From positions [B, L] and the page table; no host sync, no device work (capturable)."""
        return cls(positions, page_table, page_size)

    @cached_property
    def seq_lens(self) -> Tensor:  # [B] int32: cached tokens per row after the write
        return (self.positions[:, -1] + 1).to(torch.int32)

    @cached_property
    def slot_pages(self) -> Tensor:  # [B*L] long: page of each new token
        page_idx = torch.div(self.positions, self.page_size, rounding_mode="floor")
        return self.page_table.long().gather(1, page_idx).reshape(-1)

    @cached_property
    def slot_offsets(self) -> Tensor:  # [B*L] long: offset in that page
        return (self.positions % self.page_size).reshape(-1)


def reference_paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, batch: PagedBatch) -> Tensor:
    """q [B, L, H, D]; pools [num_pages, Hkv, PS, D] -> out [B, L, H, D] (q's dtype).

    Gathers all P pages of every row (P·PS keys), masks positions after each query; float32 softmax."""
    B, L, H, D = q.shape
    _, Hkv, PS, _ = k_pool.shape
    P = batch.page_table.shape[1]
    pt = batch.page_table.long()
    k = k_pool[pt].permute(0, 2, 1, 3, 4).reshape(B, Hkv, P * PS, D)  # [B, Hkv, S, D]
    v = v_pool[pt].permute(0, 2, 1, 3, 4).reshape(B, Hkv, P * PS, D)
    G = H // Hkv
    qf = q.float().permute(0, 2, 1, 3).reshape(B, Hkv, G * L, D)  # rows ordered (g, l)
    scores = qf @ k.float().transpose(-1, -2) / D**0.5  # [B, Hkv, G*L, S]
    qpos = batch.positions.repeat(1, G)  # [B, G*L] matching (g, l) order
    allowed = torch.arange(P * PS, device=q.device)[None, None, :] <= qpos[:, :, None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()  # [B, Hkv, G*L, D]
    return out.reshape(B, H, L, D).permute(0, 2, 1, 3).to(q.dtype)


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, batch: PagedBatch, backend: str = "auto") -> Tensor:
    """Dispatch: ``"triton"`` (the kernel), ``"torch"`` (the reference), ``"auto"`` (the kernel where
    ``config.default_triton`` says so: on CUDA)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'triton' or 'torch'")
    if backend == "auto":
        from .config import default_triton

        backend = "triton" if default_triton(q.device) else "torch"
    if backend == "triton":
        from .kernels.attention import triton_paged_attention

        return triton_paged_attention(q, k_pool, v_pool, batch)
    return reference_paged_attention(q, k_pool, v_pool, batch)
