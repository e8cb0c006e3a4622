"""The GPU engine's strategies: SMC-SD and autoregressive decoding over G requests × N particles.

Everything inside a round is tensor code on the device — drafting (exponential-race sampling),
the verify pass, incremental weights, ESS, the resampling decision, ancestor choice and the gather
of every particle field — so one round is one CUDA graph (``use_graphs=True``). Between rounds the
host does the page bookkeeping (fork = page-table row copy with reference counts, copy-on-write of
shared partial pages, fresh pages for the next K+1 tokens) after the round's one deliberate sync,
the copy of the ancestor indices.

Weights follow samplers/smc_sd.py (α = 1, no constraints or rewards in this slice):
    log w += Σ_{i ≤ first EOS, i ≤ budget} [log p_T(d_i | ·) − log q(d_i | ·)]   (+ log Σ_v p_T(v)^α = 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...samplers.resampling import get_resampler, normalise
from .attention import PagedBatch
from .kv_cache import KVPool, PageTable
from .model import Llama


def sample_exponential_race(scaled_logits: Tensor) -> Tensor:
    """One draw per row from softmax(scaled_logits) [B, V]: argmax_v (x_v − log E_v), E ~ Exp(1)."""
    e = torch.empty_like(scaled_logits, dtype=torch.float32).exponential_()
    return torch.argmax(scaled_logits.float() - e.log(), dim=-1)


@dataclass
class EngineOutput:
    tokens: Tensor  # [G, N, max_new_tokens] long, EOS-padded (pad 0 when EOS is ignored)
    lengths: Tensor  # [G, N]
    log_weights: Tensor  # [G, N] float64, since the last resampling
    log_evidence: Tensor  # [G] float64
    ess: list = field(default_factory=list)  # per round, [G] (host)
    resampled: list = field(default_factory=list)  # per round, [G] bool (host)
    rounds: int = 0
    peak_pages: int = 0


class Engine:
    """Holds the models and their KV pools; runs SMC-SD and autoregressive decoding on them."""

    def __init__(self, target: Llama, draft: Llama | None = None, *, num_pages: int, page_size: int = 16,
                 max_context: int | None = None, attention_backend: str = "auto"):
        """``max_context`` fixes the page-table width (so kernel launch shapes, and thus compiled
        kernels and graphs, do not depend on each call's lengths); None sizes it per call."""
        self.target, self.draft = target, draft
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.page_size, self.num_pages, self.max_context = page_size, num_pages, max_context
        self.kv_t = KVPool.for_model(target.cfg, num_pages, page_size, self.dtype, self.device,
                                     attention_backend=attention_backend)
        self.kv_d = None
        if draft is not None:
            if draft.cfg.vocab_size != target.cfg.vocab_size:
                raise ValueError(f"draft vocabulary ({draft.cfg.vocab_size}) differs from target vocabulary "
                                 f"({target.cfg.vocab_size}): use a draft with the target's tokenizer")
            self.kv_d = KVPool.for_model(draft.cfg, num_pages, page_size, self.dtype, self.device,
                                         attention_backend=attention_backend)

    # ------------------------------------------------------------------------------------------

    def _prefill(self, model: Llama, kv: KVPool, pt_dev: Tensor, row: int, ids: list[int]) -> None:
        if not ids:
            return
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(len(ids), device=self.device)[None]
        batch = PagedBatch.build(positions, pt_dev[row : row + 1], self.page_size)
        model(tokens, kv, batch, last_only=True)

    def _start(self, prompts: list[list[int]], N: int, extra: int) -> tuple[PageTable, Tensor]:
        """Page table for G·N rows; each request's prompt prefilled once (in row g·N) and shared."""
        G, PS = len(prompts), self.page_size
        longest = max(len(p) for p in prompts) + extra
        if self.max_context is not None and longest > self.max_context:
            raise ValueError(f"prompt + new tokens + block need {longest} positions, more than the engine's "
                             f"max_context ({self.max_context}): raise max_context")
        table = PageTable(G * N, -(-(self.max_context or longest) // PS) + 1, self.num_pages, PS)
        for g, ids in enumerate(prompts):
            r = g * N
            table.reserve(np.array([r]), np.array([len(ids) - 1]))
            table.advance(np.array([r]), np.array([len(ids) - 1]))
        pt_dev = torch.from_numpy(table.table).to(self.device)
        for g, ids in enumerate(prompts):
            self._prefill(self.target, self.kv_t, pt_dev, g * N, ids[:-1])
            if self.draft is not None:
                self._prefill(self.draft, self.kv_d, pt_dev, g * N, ids[:-2])
            table.share_prefix(list(range(g * N, (g + 1) * N)), g * N)
        return table, pt_dev

    def _upload(self, table: PageTable, pt_dev: Tensor, copies: tuple[list[int], list[int]]) -> None:
        src, dst = copies
        if src:
            s = torch.tensor(src, device=self.device)
            d = torch.tensor(dst, device=self.device)
            self.kv_t.copy_pages(s, d)
            if self.kv_d is not None:
                self.kv_d.copy_pages(s, d)
        pt_dev.copy_(torch.from_numpy(table.table), non_blocking=False)

    def _capture(self, fn, use_graphs: bool):
        if not use_graphs:
            return fn
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: Triton compilation, cuBLAS handles (its effects are undone by the caller)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: each graph gets its own memory pool (a shared graph_pool_handle tripped an allocator
        # assertion in torch 2.11); the pool is freed with the graph, i.e. when the call returns.
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    # ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def smc_sd(self, prompts: list[list[int]], *, particles: int, block_size: int, max_new_tokens: int,
               draft_temperature: float = 1.0, target_temperature: float = 1.0, eos_token_id: int | None = None,
               resampler: str = "systematic", ess_threshold: float = 0.5, use_graphs: bool | None = None,
               seed: int = 0) -> EngineOutput:
        """SMC-SD for G = len(prompts) requests × N particles, K = block_size drafted tokens a round.

        eos_token_id None ignores EOS (fixed-length outputs, as in the benchmark)."""
        if self.draft is None:
            raise ValueError("SMC-SD needs a draft model: Engine(target, draft, ...)")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if any(len(p) < 2 for p in prompts):
            raise ValueError("every prompt needs at least 2 tokens")
        use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        torch.manual_seed(seed)
        G, N, K, dev = len(prompts), particles, block_size, self.device
        B, PS = G * N, self.page_size
        eos = -1 if eos_token_id is None else eos_token_id
        pad = max(eos, 0)
        resample = get_resampler(resampler)
        table, pt = self._start(prompts, N, max_new_tokens + K + 2)

        lens = np.repeat([len(p) - 1 for p in prompts], N)  # target tokens cached per row
        seq_t = torch.tensor(lens, device=dev)
        pending = torch.tensor([p[-2:] for p in prompts], device=dev).repeat_interleave(N, 0)  # [B, 2]
        last = pending[:, 1].clone()
        tokens = torch.full((B, max_new_tokens + K + 1), pad, dtype=torch.long, device=dev)
        n_gen = torch.zeros(B, dtype=torch.long, device=dev)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        log_w = torch.zeros(B, dtype=torch.float64, device=dev)
        log_Z = torch.zeros(G, dtype=torch.float64, device=dev)
        drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
        log_q = torch.zeros(B, K, dtype=torch.float32, device=dev)
        index = torch.arange(B, device=dev)
        do_buf = torch.zeros(G, dtype=torch.bool, device=dev)
        ess_buf = torch.zeros(G, dtype=torch.float64, device=dev)
        done_buf = torch.zeros(1, dtype=torch.bool, device=dev)
        ar = torch.arange(K + 1, device=dev)
        group_base = (torch.arange(G, device=dev) * N)[:, None]
        state = (seq_t, pending, last, tokens, n_gen, finished, log_w, log_Z)

        def round_() -> None:
            T = seq_t
            batch = PagedBatch.build((T - 1)[:, None] + ar[:2], pt, PS)
            logits = self.draft(pending, self.kv_d, batch, last_only=True)[:, 0].float() / draft_temperature
            for i in range(K):
                d = sample_exponential_race(logits)
                drafts[:, i] = d
                log_q[:, i] = logits.gather(1, d[:, None])[:, 0] - torch.logsumexp(logits, -1)
                if i < K - 1:
                    batch = PagedBatch.build((T + 1 + i)[:, None], pt, PS)
                    logits = self.draft(d[:, None], self.kv_d, batch)[:, 0].float() / draft_temperature
            feed = torch.cat([last[:, None], drafts], dim=1)
            batch = PagedBatch.build(T[:, None] + ar, pt, PS)
            logits_t = self.target(feed, self.kv_t, batch).float() / target_temperature  # [B, K+1, V]
            lse = torch.logsumexp(logits_t, dim=-1)
            log_p = logits_t[:, :K].gather(2, drafts[:, :, None])[:, :, 0] - lse[:, :K]
            b = sample_exponential_race(logits_t[:, K])

            remaining = max_new_tokens - n_gen
            in_budget = ar[None, :K] < remaining[:, None]
            is_eos = (drafts == eos) & in_budget
            first = (torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0
            keep = first & in_budget
            incr = torch.where(keep, log_p - log_q, 0.0).double().sum(1)
            any_eos = is_eos.any(1)
            n_new = torch.where(any_eos, is_eos.long().argmax(1) + 1, remaining.clamp(max=K))
            n_new = torch.where(~any_eos & (remaining > K), K + 1, n_new)
            active = ~finished
            block = torch.cat([drafts, b[:, None]], dim=1)
            block = torch.where((ar[None] < n_new[:, None]) & active[:, None], block, pad)
            tokens.scatter_(1, n_gen[:, None] + ar, block)
            n_gen.add_(torch.where(active, n_new, 0))
            lw = torch.where(active, log_w + incr, log_w)
            finished.copy_(finished | (active & (any_eos | (n_gen >= max_new_tokens))) | torch.isneginf(lw))
            pending.copy_(torch.stack([drafts[:, -1], b], dim=1))
            last.copy_(b)
            seq_t.add_(K + 1)

            lw = lw.view(G, N)
            W, ess = normalise(lw)
            live = (~finished).view(G, N).any(1)
            do = live & (ess > 0) & ((ess < ess_threshold * N) | (ess_threshold >= 1.0))
            A = torch.where(do[:, None], resample(W, None), torch.arange(N, device=dev)[None])
            idx = (A + group_base).flatten()
            log_Z.add_(torch.where(do, torch.logsumexp(lw, 1) - math.log(N), 0.0))
            log_w.copy_(torch.where(do[:, None], 0.0, lw).flatten())
            for t in (pending, last, tokens, n_gen, finished, log_w):
                t.copy_(t[idx])
            index.copy_(idx)
            do_buf.copy_(do)
            ess_buf.copy_(ess)
            done_buf.copy_(finished.all()[None])

        # first round's pages (copy-on-write of the shared partial prompt page) before capture
        rows = np.arange(B)
        self._upload(table, pt, table.reserve(rows, lens + K + 1, write_from=lens - 1))
        saved = [t.clone() for t in state]
        step = self._capture(round_, use_graphs)
        if use_graphs:  # the warm-up run advanced the state: restore it
            for t, s in zip(state, saved):
                t.copy_(s)
        # NOTE: the warm-up also wrote KV entries, but every entry a round reads at or after
        # position T-1 is written earlier in that same round, so the first replay overwrites them.

        host = torch.empty(B + 2 * G + 1, dtype=torch.float64, pin_memory=self.device.type == "cuda")
        out = EngineOutput(tokens, n_gen, log_w, log_Z)
        n_rounds = -(-max_new_tokens // (K + 1))
        for r in range(n_rounds):
            step()
            packed = torch.cat([index.double(), do_buf.double(), ess_buf, done_buf.double()])
            host.copy_(packed, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the round's one host sync
            h = host.numpy()
            out.rounds += 1
            out.resampled.append(h[B : B + G] > 0)
            out.ess.append(h[B + G : B + 2 * G].copy())
            if h[-1] > 0:
                break
            lens = lens + K + 1
            table.advance(rows, lens)
            table.fork(h[:B].astype(np.int64))
            if r + 1 < n_rounds:
                self._upload(table, pt, table.reserve(rows, lens + K + 1, write_from=lens - 1))
        out.peak_pages = table.peak_used
        out.tokens = tokens[:, :max_new_tokens].reshape(G, N, -1)
        out.lengths = n_gen.view(G, N)
        out.log_weights = log_w.view(G, N)
        out.log_evidence = log_Z + torch.logsumexp(log_w.view(G, N), 1) - math.log(N)
        return out

    @torch.inference_mode()
    def autoregressive(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                       use_graphs: bool | None = None, seed: int = 0) -> tuple[Tensor, int]:
        """Plain sampling from the target, one token a step for each of G requests (no host sync
        until the end). Returns (tokens [G, max_new_tokens], peak pages)."""
        use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        torch.manual_seed(seed)
        G, dev, PS = len(prompts), self.device, self.page_size
        table, pt = self._start(prompts, 1, max_new_tokens + 2)
        rows = np.arange(G)
        lens = np.array([len(p) - 1 for p in prompts])
        self._upload(table, pt, table.reserve(rows, lens + max_new_tokens + 1))
        seq_t = torch.tensor(lens, device=dev)
        last = torch.tensor([p[-1] for p in prompts], device=dev)
        tokens = torch.zeros(G, max_new_tokens + 1, dtype=torch.long, device=dev)
        n_gen = torch.zeros(1, dtype=torch.long, device=dev)

        def step_() -> None:
            batch = PagedBatch.build(seq_t[:, None], pt, PS)
            logits = self.target(last[:, None], self.kv_t, batch)[:, 0].float() / temperature
            b = sample_exponential_race(logits)
            tokens.index_copy_(1, n_gen, b[:, None])
            last.copy_(b)
            seq_t.add_(1)
            n_gen.add_(1)

        saved = (seq_t.clone(), last.clone())
        step = self._capture(step_, use_graphs)
        if use_graphs:
            seq_t.copy_(saved[0])
            last.copy_(saved[1])
            n_gen.zero_()
        for _ in range(max_new_tokens):
            step()
        return tokens[:, :max_new_tokens], table.peak_used
