"""The GPU engine: models, KV pools and captured rounds, and the strategies run on them.

An :class:`Engine` holds a target (and optionally a draft) :class:`~.model.Llama`, one KV pool per
model, its :class:`~.config.EngineConfig` and the cache of captured CUDA graphs. Its strategies
live in their own modules and take the engine as their first argument:

    smc_sd          batch.py: the request loop of scheduler.py over the round of smc.py with
                    every request submitted at once (any target program: constraints,
                    powers, rewards, per-request settings)
    speculative     batch.py: the request loop in the exact-only round of exact.py (exact speculative decoding)
    autoregressive  batch.py: the request loop in the exact-only round of exact.py, K = 0
    serve           scheduler.py (continuous batching of SMC-SD requests)

prefill.py writes the prompts into the pools; graphs.py the graph cache.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from . import batch, prefill
from .config import EngineConfig
from .graphs import GraphCache
from .kv_cache import KVPool, PageTable
from .model import Llama
from .output import EngineOutput
from .targets import EngineTarget, Settings


def _without_pdl(fn):
    """``fn`` with its kernels launched (and captured) without PDL (``kernels.common.pdl_off``): for
    autoregressive decoding, where PDL measured slower, and exact speculative decoding, whose
    one-request round (1-row draft steps, like AR's) measured slower with it too (9.04 -> 9.20 ms
    a round, not A/B-measured)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            from .kernels.common import pdl_off
        except ImportError:  # no Triton: no PDL either
            return fn(*args, **kwargs)
        with pdl_off():
            return fn(*args, **kwargs)

    return wrapped


class Engine:
    """Holds the models and their KV pools; runs SMC-SD, exact speculative decoding and
    autoregressive decoding on them.

    CUDA graphs are captured once per round shape (rows, K, temperatures, ...) and replayed by
    later calls through static buffers, as serving engines do (``graphs``, keyed by the round's
    shape and the engine's config); ``clear_graphs`` frees them."""

    PREFILL_TOKENS = prefill.PREFILL_TOKENS  # positions per prefill forward (rows × bucket length), at most

    def __init__(self, target: Llama, draft: Llama | None = None, config: EngineConfig | None = None, *,
                 num_pages: int | None = None, page_size: int = 16, max_context: int | None = None,
                 use_graphs: bool | None = None, triton: bool | None = None):
        """Settings: ``config`` (an :class:`EngineConfig`), or its fields as keywords (``num_pages``
        required). The config is resolved for the target model's dtype and device (``self.config``)."""
        if config is None:
            if num_pages is None:
                raise SMCDecodeError("Engine needs num_pages (KV pages of each pool) or config=EngineConfig(...)")
            config = EngineConfig(num_pages=num_pages, page_size=page_size, max_context=max_context,
                                  use_graphs=use_graphs, triton=triton)
        elif num_pages is not None:
            raise SMCDecodeError("give the Engine's settings as config=EngineConfig(...) or as keywords, not both")
        self.target, self.draft = target, draft
        p = next(target.parameters())
        self.config = config = config.resolved(p.dtype, p.device)
        self.device, self.dtype = p.device, p.dtype
        self.page_size, self.num_pages, self.max_context = config.page_size, config.num_pages, config.max_context
        self.kv_t = KVPool.for_model(target.cfg, self.num_pages, self.page_size, self.dtype, self.device,
                                     triton=config.triton)
        self.kv_d = None
        if draft is not None:
            if draft.cfg.vocab_size != target.cfg.vocab_size:
                raise ValueError(f"draft vocabulary ({draft.cfg.vocab_size}) differs from target vocabulary "
                                 f"({target.cfg.vocab_size}): use a draft with the target's tokenizer")
            self.kv_d = KVPool.for_model(draft.cfg, self.num_pages, self.page_size, self.dtype, self.device,
                                         triton=config.triton)
        self.graphs = GraphCache(config)
        if self.max_context is not None:  # (before any graph exists)
            self.ensure_rope(self.max_context + self.page_size)

    def clear_graphs(self) -> None:
        """Drop every captured round, and stop the mask worker processes of those that have any now
        (not when the rounds are collected: a reference kept elsewhere would keep the processes)."""
        for key in list(self.graphs.keys()):
            host = getattr(self.graphs[key], "host", None)
            if host is not None:
                host.close()
        self.graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def ensure_rope(self, n: int) -> None:
        """RoPE tables of both models for positions below ``n`` (captured graphs read the old tables:
        growing them drops the graphs)."""
        for m in (self.target, self.draft):
            if m is not None and (m.rope_cos is None or m.rope_cos.shape[0] < n):
                self.graphs.clear()
                m.set_rope_cache(n)

    # -- prefill and page tables ----------------------------------------------------------------

    def prefill(self, model: Llama, kv: KVPool, pt_dev: Tensor, row: int, ids: list[int]) -> None:
        """One row's prompt (the scheduler's join), through ``prefill_rows``: bucketed shapes too."""
        self.prefill_rows(model, kv, pt_dev, [row], [ids])

    def prefill_rows(self, model: Llama, kv: KVPool, pt_dev: Tensor, rows: list[int], seqs: list[list[int]],
                     max_tokens: int | None = None) -> int:
        """``prefill.prefill_rows`` with this engine's page size, at most ``max_tokens`` positions a
        forward (default ``PREFILL_TOKENS``). Returns the number of forwards."""
        return prefill.prefill_rows(model, kv, pt_dev, rows, seqs, self.page_size, max_tokens or self.PREFILL_TOKENS)

    def upload(self, table: PageTable, pt_dev: Tensor, copies: tuple[list[int], list[int]],
               rows: np.ndarray | None = None) -> None:
        """The host's page bookkeeping to the device: the copy-on-write ``copies`` (src, dst) in both
        pools, and the page table into ``pt_dev`` (only ``rows`` of it, when given: the other rows'
        device entries may be ahead of the host's, a round in flight forking them)."""
        src, dst = copies
        if src:  # one host-to-device copy for both index lists
            sd = torch.tensor(src + dst, dtype=torch.long).to(self.device, non_blocking=True)
            s, d = sd[: len(src)], sd[len(src):]
            self.kv_t.copy_pages(s, d)
            if self.kv_d is not None:
                self.kv_d.copy_pages(s, d)
        # NOTE: not waited for: from pageable memory the copy is staged before the call returns (the
        # host may change the table afterwards), and the work that reads pt_dev follows on this stream
        if rows is None:
            pt_dev.copy_(torch.from_numpy(table.table), non_blocking=True)
        elif len(rows):
            idx = np.asarray(rows, dtype=np.int64)
            pt_dev.index_copy_(0, torch.from_numpy(idx).to(pt_dev.device, non_blocking=True),
                               torch.from_numpy(table.table[idx]).to(pt_dev.device, non_blocking=True))

    # -- strategies -----------------------------------------------------------------------------

    @torch.inference_mode()
    def smc_sd(self, prompts: list[list[int]], *, particles, block_size, max_new_tokens,
               draft_temperature=1.0, target_temperature=1.0, eos_token_id: int | None = None,
               resampler: str = "systematic", ess_threshold: float = 0.5, use_graphs: bool | None = None,
               seed: int = 0, target: EngineTarget | list | None = None, record_weights: bool = False,
               pipeline: bool = True, schedule=None) -> EngineOutput:
        """SMC-SD for G = len(prompts) requests × N particles, K = block_size drafted tokens a round.

        ``particles``, ``block_size``, ``max_new_tokens`` and the temperatures are one value or one
        per prompt. ``target`` (an :class:`~smcdecode.backends.engine.targets.EngineTarget`, e.g.
        ``EngineTarget.of(LM(model) ** 2 * Regex(...) * Reward(...))``, or one per prompt) adds a
        power α, constraints and rewards. Every call runs the request loop (``batch.run_batch``):
        one round shape for every program, per-row settings, masks, rewards. eos_token_id None
        ignores EOS (fixed-length outputs, as in the benchmark). ``schedule`` (a
        ``samplers.adaptive`` FixedBlocks / AdaptiveBlocks) sets each request's K between rounds, up
        to its ``block_size``.

        Page bookkeeping: where a round allows (one K for every request, no host work inside the
        round: ``Scheduler._pipelined``) the host sets pages aside before each launch, so the
        round's graph forks the page table, copies the shared partial pages and adds fresh ones
        itself and the next round is launched before the host has read this one (the host books the
        same pages one round late). A round whose pages could not be set aside (a nearly full pool)
        is read before the next launch and its pages booked in between; ``pipeline=False`` does that
        for every round (the reference the pipelined rounds are tested against: the same outputs for
        the same seed, with and without CUDA graphs)."""
        if not prompts or any(len(p) < 2 for p in prompts):
            raise SMCDecodeError("prompts must be a non-empty list of prompts of at least 2 tokens each")
        settings = Settings.of(len(prompts), particles, block_size, max_new_tokens, draft_temperature,
                               target_temperature)
        if self.draft is None and max(settings.block_size) > 0:
            raise SMCDecodeError("SMC-SD with drafted tokens needs a draft model: Engine(target, draft, ...), or "
                                 "block_size=0 (the target as proposal: one token a round)")
        use_graphs = self.config.use_graphs if use_graphs is None else use_graphs
        programs = target if isinstance(target, (list, tuple)) else [target]
        targets = [t or EngineTarget() for t in programs]
        return batch.run_batch(self, prompts, settings, targets if isinstance(target, (list, tuple)) else targets[0],
                               eos_token_id=eos_token_id, resampler=resampler, ess_threshold=ess_threshold,
                               use_graphs=use_graphs, seed=seed, record_weights=record_weights, schedule=schedule,
                               pipeline=pipeline)

    def smc_page_bounds(self, prompts: list[list[int]], N: int, K: int, max_new_tokens: int) -> tuple[int, int]:
        """(pages the first round of SMC-SD needs, pages it needs at most over the whole
        output), the null page included: ``batch.page_bounds``."""
        return batch.page_bounds(prompts, N, K, max_new_tokens, self.page_size)

    @torch.inference_mode()
    def serve(self, requests: list, *, slots: int | None = None, target: EngineTarget | None = None,
              eos_token_id: int | None = None, resampler: str = "systematic", ess_threshold: float = 0.5,
              use_graphs: bool | None = None, seed: int = 0) -> list:
        """SMC-SD of ``requests`` (:class:`~smcdecode.backends.engine.scheduler.Request`, each with its
        own N, K, temperatures and budget) with continuous batching: at most ``slots`` run at once
        (default: all), a request joins when a slot frees up and leaves when its particles have all
        finished. Returns :class:`~smcdecode.backends.engine.scheduler.Finished` in request order."""
        from .scheduler import Scheduler

        if not requests:
            return []
        sched = Scheduler(self, slots=slots or len(requests), max_particles=max(r.particles for r in requests),
                          max_block_size=max(r.block_size for r in requests), target=target,
                          eos_token_id=eos_token_id, resampler=resampler, ess_threshold=ess_threshold,
                          use_graphs=use_graphs, seed=seed)
        for r in requests:
            sched.submit(r)
        done = {id(f.request): f for f in sched.run()}
        return [done[id(r)] for r in requests]

    @_without_pdl
    @torch.inference_mode()
    def speculative(self, prompts: list[list[int]], *, block_size: int, max_new_tokens: int, samples: int = 1,
                    draft_temperature: float = 1.0, target_temperature: float = 1.0,
                    eos_token_id: int | None = None, use_graphs: bool | None = None, seed: int = 0) -> EngineOutput:
        """Exact speculative decoding (Leviathan et al. / Chen et al.) for G = len(prompts) requests ×
        ``samples`` independent rows, K = block_size drafts a round, each row with its own
        acceptance length: d_i is accepted while u_i < min(1, p(d_i)/q(d_i)); at the first rejection
        the token is drawn from the residual (p − q)+ (normalised), after K acceptances a bonus
        from p. Outputs are exact samples of the target at ``target_temperature``.

        A program of the request loop (``batch.run_speculative``): each prompt is one request of
        ``samples`` exact rows (``Request(exact=True)``) in an exact-only scheduler, whose round
        (exact.py) drafts, verifies and accepts with no weights or resampling; every row's pages for
        its whole output are reserved when it joins, so the host reads round r while round r + 1 runs."""
        return batch.run_speculative(self, prompts, block_size=block_size, max_new_tokens=max_new_tokens,
                                     samples=samples, draft_temperature=draft_temperature,
                                     target_temperature=target_temperature, eos_token_id=eos_token_id,
                                     use_graphs=use_graphs, seed=seed)

    @_without_pdl
    @torch.inference_mode()
    def autoregressive(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                       samples: int = 1, use_graphs: bool | None = None, seed: int = 0,
                       batched_prefill: bool = True, eos_token_id: int | None = None) -> tuple[Tensor, int]:
        """Plain sampling from the target, one token a round for each of G requests × ``samples``
        independent rows. Returns (tokens [G·samples, max_new_tokens], row g·samples + s the s-th
        sample of prompt g; peak pages).

        A program of the request loop (``batch.run_autoregressive``): each prompt is one request of
        exact rows with K = 0 (``Request(exact=True, block_size=0)``) in a scheduler without drafts,
        whose round (exact.py) is a target forward on each row's last token, a draw at the
        temperature and the token, EOS and budget bookkeeping: no weights, no resampling, every row's
        pages for its whole output reserved when it joins, so the rounds are pipelined (the host
        reads round r while round r + 1 runs). A prompt may be one token long.

        With ``eos_token_id`` a row that samples EOS stops (its tokens after the first EOS are EOS),
        and a request leaves once all its rows have finished: decoding stops at most one round
        after the last row ends (``ar_steps_run``: rounds run by the last call). Without it every
        row decodes ``max_new_tokens`` tokens.

        Each prompt is prefilled once (all prompts together, ``prefill_rows``; ``batched_prefill``
        False: one forward of its own length each) and its pages are shared by its ``samples`` rows;
        the partially filled last prompt page is copied for each row before the row first writes
        into it (copy-on-write in ``PageTable.reserve``), so rows never see each other's tokens.

        The round is captured as a CUDA graph once per (rows, page-table width) — temperatures are
        per-row buffers — and replayed by later calls, like the SMC-SD rounds. Give the Engine a
        ``max_context`` so the page-table width, and thus the graph and the attention kernel's
        launch shape, is the same for every call."""
        return batch.run_autoregressive(self, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                        samples=samples, use_graphs=use_graphs, seed=seed,
                                        batched_prefill=batched_prefill, eos_token_id=eos_token_id)
