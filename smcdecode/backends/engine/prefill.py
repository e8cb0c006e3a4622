"""Prefill: the prompts' keys and values written into the paged KV cache, each prompt once, shared
by the rows of its request.

All prompts of a call are prefilled together, in forwards of R rows × L_b positions, L_b a power
of two (>= 16) and R a power of two, both from a handful of values, so the same few attention
kernels serve every call: the attention kernel takes L (and the tiles and splits derived from L and
the row count) as ``tl.constexpr``, register tile sizes that must be compile-time constants, so a
forward per prompt length would compile a kernel per length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import SMCDecodeError
from .attention import PagedBatch
from .kv_cache import KVPool

PREFILL_TOKENS = 16384  # positions per prefill forward (rows × bucket length), at most


def prefill_unpadded(model, kv: KVPool, pt_dev: Tensor, row: int, ids: list[int], page_size: int) -> None:
    """One row, one forward of exactly its length (the reference ``prefill_rows`` is tested against)."""
    if not ids:
        return
    dev = pt_dev.device
    tokens = torch.tensor([ids], dtype=torch.long, device=dev)
    positions = torch.arange(len(ids), device=dev)[None]
    batch = PagedBatch.build(positions, pt_dev[row : row + 1], page_size)
    model(tokens, kv, batch, last_only=True)


def prefill_rows(model, kv: KVPool, pt_dev: Tensor, rows: list[int], seqs: list[list[int]], page_size: int,
                 max_tokens: int = PREFILL_TOKENS) -> int:
    """Write the keys/values of ``seqs[i]`` (at positions 0..) into the pages of row ``rows[i]``,
    many rows per forward. Returns the number of forwards.

    Rows are sorted by length and cut into buckets of L_b = next power of two >= max(16, n)
    positions (at most the page table's and the rope tables' capacity); a forward holds R rows
    of one bucket, R a power of two with R·L_b <= ``max_tokens``. Shorter rows are
    right-padded: padding tokens sit at positions n..L_b−1 after the row's real ones,
    so causal attention keeps them out of every real query (each query attends to positions <=
    its own); their keys/values go to the row's pages where those exist (the positions a later
    step overwrites before any query can see them: a position is written before it is
    attended to) and to the null page 0 elsewhere (unused page-table entries point there; it is
    never handed out and only read under a mask). Rows added to reach R have an all-null page
    table. So each real position gets exactly the keys/values of the one-row prefill."""
    todo = [(r, s) for r, s in zip(rows, seqs) if s]
    if not todo:
        return 0
    V = model.cfg.vocab_size
    for _, s in todo:  # (the embedding lookup of an out-of-range id would read outside the table)
        if min(s) < 0 or max(s) >= V:
            bad = next(t for t in s if not 0 <= t < V)
            raise SMCDecodeError(f"prompt token id {bad} is outside the model's vocabulary [0, {V}): "
                                 "encode prompts with the model's own tokenizer")
    budget = max_tokens
    P, PS, dev = pt_dev.shape[1], page_size, pt_dev.device
    cap = P * PS
    if model.rope_cos is not None:
        cap = min(cap, model.rope_cos.shape[0])
    todo.sort(key=lambda rs: len(rs[1]))
    forwards, i = 0, 0
    while i < len(todo):
        n = len(todo[i][1])
        Lb = min(max(16, 1 << (n - 1).bit_length()), cap)
        if n > Lb:
            raise SMCDecodeError(f"a prefill of {n} tokens does not fit the page table and rope tables "
                                 f"({cap} positions): raise max_context")
        j = i
        while j < len(todo) and len(todo[j][1]) <= Lb:
            j += 1
        per = max(1, 1 << ((budget // Lb).bit_length() - 1)) if budget >= Lb else 1
        for c in range(i, j, per):
            chunk = todo[c : min(c + per, j)]
            R = 1 << (len(chunk) - 1).bit_length()  # a power of two: few distinct launch shapes
            tokens = torch.zeros(R, Lb, dtype=torch.long)
            idx = torch.zeros(R, dtype=torch.long)
            real = torch.zeros(R, dtype=torch.bool)
            for k, (r, s) in enumerate(chunk):
                tokens[k, : len(s)] = torch.tensor(s)
                idx[k], real[k] = r, True
            pt = torch.where(real.to(dev)[:, None], pt_dev[idx.to(dev)], 0)
            positions = torch.arange(Lb, device=dev)[None].expand(R, Lb).contiguous()
            model(tokens.to(dev), kv, PagedBatch.build(positions, pt, PS), last_only=True)
            forwards += 1
        i = j
    return forwards
