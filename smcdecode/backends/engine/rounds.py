"""The speculative-decoding round's parts: its static buffers, the
capture-or-replay of a round, the K draft steps and the target's verify pass."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .attention import PagedBatch
from .graphs import Graph, ready
from .kv_cache import PageTable
from .sampling import sample_and_score


def round_buffers(engine, pt_start: Tensor, B: int, K: int, cap: int, pad: int, **extra: Tensor) -> dict:
    """Static buffers of the SMC-SD and speculative-decoding rounds for B rows and K drafts
    (page table, positions, pending tokens, outputs, drafts), plus the strategy's ``extra``."""
    dev = engine.device
    return dict(
        pt=pt_start.clone(), seq=torch.zeros(B, dtype=torch.long, device=dev),
        pending=torch.zeros(B, 2, dtype=torch.long, device=dev),
        last=torch.zeros(B, dtype=torch.long, device=dev),
        tokens=torch.full((B, cap + K + 1), pad, dtype=torch.long, device=dev),
        n_gen=torch.zeros(B, dtype=torch.long, device=dev),
        budget=torch.zeros(B, dtype=torch.long, device=dev),
        finished=torch.zeros(B, dtype=torch.bool, device=dev),
        drafted=torch.zeros(B, dtype=torch.long, device=dev),
        drafts=torch.zeros(B, K, dtype=torch.long, device=dev),
        log_q=torch.zeros(B, K, dtype=torch.float32, device=dev),
        done=torch.zeros(1, dtype=torch.bool, device=dev), ar=torch.arange(K + 1, device=dev),
        **extra,
    )


def round_graph(engine, key: tuple, make, prompts: list[list[int]], N: int, lens: np.ndarray, max_new_tokens: int,
                pad: int, table: PageTable, copies, use_graphs: bool, zero: tuple[str, ...] = ()) -> Graph:
    """The round of ``key`` — captured on first use from ``make() -> (buffers, step)``, replayed
    through the same buffers by later calls — with the page table uploaded and the buffers reset
    for this call: positions, each row's two pending tokens, outputs, budgets, and ``zero``."""
    dev = engine.device
    graph = engine.graphs.get(key)
    b, step = make() if graph is None else (graph.buffers, None)

    def reset() -> None:
        b["seq"].copy_(torch.as_tensor(lens, device=dev))
        b["pending"].copy_(torch.tensor([p[-2:] for p in prompts], device=dev).repeat_interleave(N, 0))
        b["last"].copy_(b["pending"][:, 1])
        b["tokens"].fill_(pad)
        b["n_gen"].zero_()
        b["budget"].fill_(max_new_tokens)
        b["finished"].zero_()
        b["drafted"].zero_()
        for name in zero:
            b[name].zero_()

    return ready(engine, key, graph, b, step, reset, table, copies, use_graphs)


def draft_block(engine, buf: dict, K: int, draft_temperature: float, seeds: Tensor, keep_logits: bool = False) -> None:
    """K draft tokens for every row: the first forward covers the two tokens the draft has not seen
    (``pending``, at positions T−1, T), then one token a step. Fills drafts/log_q (and draft_logits
    [B, K, V] when asked)."""
    T, pt, PS, ar = buf["seq"], buf["pt"], engine.page_size, buf["ar"]
    batch = PagedBatch.build((T - 1)[:, None] + ar[:2], pt, PS)
    logits = engine.draft(buf["pending"], engine.kv_d, batch, last_only=True)[:, 0]  # [B, V]
    for i in range(K):
        d, lq, _, _ = sample_and_score(logits, draft_temperature, seeds[i], triton=engine.config.triton)
        buf["drafts"][:, i] = d
        buf["log_q"][:, i] = lq
        if keep_logits:
            buf["draft_logits"][:, i] = logits
        if i < K - 1:
            batch = PagedBatch.build((T + 1 + i)[:, None], pt, PS)
            logits = engine.draft(d[:, None], engine.kv_d, batch)[:, 0]


def verify(engine, buf: dict, K: int, target_temperature: float, seeds: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Target pass over [last, d_1..d_K] -> (log p(d_i) [B, K], bonus ~ p(· | d_1..d_K) [B],
    logits [B, K+1, V])."""
    B, ar = buf["last"].shape[0], buf["ar"]
    feed = torch.cat([buf["last"][:, None], buf["drafts"]], dim=1)
    batch = PagedBatch.build(buf["seq"][:, None] + ar, buf["pt"], engine.page_size)
    logits = engine.target(feed, engine.kv_t, batch)  # [B, K+1, V]
    gather = torch.cat([buf["drafts"], buf["drafts"][:, :1]], dim=1).reshape(-1)
    # only the last row of each particle's K + 1 draws a token (the bonus); the others are scored
    tok, _, _, lp = sample_and_score(logits.view(B * (K + 1), -1), target_temperature, seeds[K], gather,
                                     sample_every=K + 1, triton=engine.config.triton)
    return lp.view(B, K + 1)[:, :K], tok.view(B, K + 1)[:, K], logits
