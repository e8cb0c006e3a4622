"""Exact speculative decoding on the engine (``Engine.speculative``): G requests × S independent rows,
each with its own acceptance length, one CUDA graph a round."""

from __future__ import annotations

import numpy as np
import torch

from ...samplers.steps import race
from .output import EngineOutput
from .rounds import draft_block, round_buffers, round_graph, verify


def run(engine, prompts: list[list[int]], *, block_size: int, max_new_tokens: int, samples: int = 1,
        draft_temperature: float = 1.0, target_temperature: float = 1.0, eos_token_id: int | None = None,
        use_graphs: bool | None = None, seed: int = 0) -> EngineOutput:
    """See ``Engine.speculative``."""
    if engine.draft is None:
        raise ValueError("speculative decoding needs a draft model: Engine(target, draft, ...)")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if any(len(p) < 2 for p in prompts):
        raise ValueError("every prompt needs at least 2 tokens")
    use_graphs = engine.config.use_graphs if use_graphs is None else use_graphs
    torch.manual_seed(seed)
    G, N, K, dev = len(prompts), samples, block_size, engine.device
    B, V = G * N, engine.target.cfg.vocab_size
    eos = -1 if eos_token_id is None else eos_token_id
    pad = max(eos, 0)
    table, pt_start = engine.start(prompts, N, max_new_tokens + K + 2)
    cap = table.table.shape[1] * engine.page_size
    rows = np.arange(B)
    lens = np.repeat([len(p) - 1 for p in prompts], N)
    copies = table.reserve(rows, lens + max_new_tokens + K + 2, write_from=lens - 1)
    key = ("sd", G, N, K, draft_temperature, target_temperature, eos, table.table.shape[1], use_graphs)

    def make():
        buf = round_buffers(
            engine, pt_start, B, K, cap, pad,
            accepted=torch.zeros(B, dtype=torch.long, device=dev),
            draft_logits=torch.zeros(B, K, V, dtype=engine.dtype, device=dev),
            rows=torch.arange(B, device=dev),
        )
        return buf, _round(engine, buf, K, draft_temperature, target_temperature, eos, pad)

    graph = round_graph(engine, key, make, prompts, N, lens, max_new_tokens, pad, table, copies, use_graphs,
                        zero=("accepted",))
    b = graph.buffers

    pinned = engine.device.type == "cuda"
    flags = [torch.zeros(1, dtype=torch.bool, pin_memory=pinned) for _ in range(2)]
    events = [torch.cuda.Event() if pinned else None for _ in range(2)]
    out = EngineOutput(b["tokens"], b["n_gen"], torch.zeros(G, N, dtype=torch.float64, device=dev),
                       torch.zeros(G, dtype=torch.float64, device=dev))
    for r in range(max_new_tokens + 1):
        graph.step()
        out.rounds += 1
        flags[r % 2].copy_(b["done"], non_blocking=True)
        if pinned:
            events[r % 2].record()
        if r > 0:  # the previous round's flag: one round of overshoot at most (a no-op round)
            if pinned:
                events[(r - 1) % 2].synchronize()
            if bool(flags[(r - 1) % 2]):
                break
        elif not pinned and bool(flags[0]):
            break
    out.peak_pages = table.peak_used
    out.tokens = b["tokens"][:, :max_new_tokens].reshape(G, N, -1).clone()
    out.lengths = b["n_gen"].view(G, N).clone()
    out.accepted = b["accepted"].view(G, N).clone()
    out.drafted = b["drafted"].view(G, N).clone()
    return out


def _round(engine, b: dict, K: int, draft_temperature: float, target_temperature: float, eos: int, pad: int):
    """The device code of one speculative-decoding round over the static buffers ``b``."""
    dev = engine.device
    ar = b["ar"]
    drafts, log_q, last, n_gen, finished = b["drafts"], b["log_q"], b["last"], b["n_gen"], b["finished"]
    rows = b["rows"]  # NOTE: every tensor a captured graph reads must outlive the call (static buffers)

    def round_() -> None:
        seeds = torch.randint(0, 2**62, (K + 1,), device=dev)
        draft_block(engine, b, K, draft_temperature, seeds, keep_logits=True)
        log_p, bonus, logits_t = verify(engine, b, K, target_temperature, seeds)
        u = torch.rand(drafts.shape, device=dev)
        accept = torch.log(u) < log_p - log_q  # u < min(1, p/q)
        n_acc = torch.cumprod(accept.long(), 1).sum(1)  # [B] leading acceptances
        j = n_acc.clamp(max=K - 1)
        p = torch.softmax(logits_t[rows, j].float() / target_temperature, -1)  # [B, V]
        q = torch.softmax(b["draft_logits"][rows, j].float() / draft_temperature, -1)
        residual = (p - q).clamp_min(0.0)
        c_res = race(residual.log())  # ∝ (p − q)+
        c = torch.where((n_acc == K) | (residual.sum(-1) <= 0), bonus, c_res)
        block = torch.cat([drafts, bonus[:, None]], dim=1)
        block = torch.where(ar[None] == n_acc[:, None], c[:, None], block)
        n_new = n_acc + 1
        remaining = b["budget"] - n_gen
        is_eos = (block == eos) & (ar[None] < n_new[:, None])
        any_eos = is_eos.any(1)
        n_new = torch.where(any_eos, is_eos.long().argmax(1) + 1, n_new)
        hit_budget = n_new >= remaining
        n_new = torch.minimum(n_new, remaining)
        active = ~finished
        write = (ar[None] < n_new[:, None]) & active[:, None]
        b["tokens"].scatter_(1, n_gen[:, None] + ar, torch.where(write, block, pad))
        n_gen.add_(torch.where(active, n_new, 0))
        b["accepted"].add_(torch.where(active, torch.minimum(n_acc, n_new), 0))
        b["drafted"].add_(torch.where(active, K, 0))
        finished.copy_(finished | (active & (any_eos | hit_budget)))
        prev = torch.where(n_acc > 0, drafts[rows, (n_acc - 1).clamp(min=0)], last)
        step = torch.where(active, n_acc + 1, 0)
        b["pending"].copy_(torch.where(active[:, None], torch.stack([prev, c], 1), b["pending"]))
        last.copy_(torch.where(active, c, last))
        b["seq"].add_(step)
        b["done"].copy_(finished.all()[None])

    return round_
