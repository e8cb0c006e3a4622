"""The GPU engine's strategies: SMC-SD and autoregressive decoding over G requests × N particles.

Everything inside a round is tensor code on the device — drafting (exponential-race sampling,
fused with the log-sum-exp and the gather of log q(d) into one Triton kernel on CUDA),
the verify pass, incremental weights, ESS, the resampling decision, ancestor choice and the gather
of every particle field — so one round is one CUDA graph (``use_graphs=True``). The page
bookkeeping of SMC-SD (fork = page-table row copy, copy-on-write of shared partial pages, fresh
pages for the next K+1 tokens) runs at the end of that graph too (``_smc_pages``), on pages the host
set aside for it before the launch; the host books the same pages one round later (``PageTable``),
while the next round already runs, so rounds are launched back to back (``_smc_rounds``).

Weights follow samplers/smc_sd.py (α = 1, no constraints or rewards in this slice):
    log w += Σ_{i ≤ first EOS, i ≤ budget} [log p_T(d_i | ·) − log q(d_i | ·)]   (+ log Σ_v p_T(v)^α = 0)
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from ...samplers.resampling import get_resampler, normalise
from .attention import PagedBatch
from .config import EngineConfig
from .kv_cache import KVPool, PageTable
from .model import Llama
from .smc import EngineTarget


def sample_exponential_race(scaled_logits: Tensor) -> Tensor:
    """One draw per row from softmax(scaled_logits) [B, V]: argmax_v (x_v − log E_v), E ~ Exp(1)."""
    e = torch.empty_like(scaled_logits, dtype=torch.float32).exponential_()
    return torch.argmax(scaled_logits.float() - e.log(), dim=-1)


def sample_and_score_reference(logits: Tensor, temperature: float, gather: Tensor | None = None,
                               generator: torch.Generator | None = None, sample_every: int = 1
                               ) -> tuple[Tensor, Tensor, Tensor | None]:
    """x = logits [R, V] / temperature -> (token ~ softmax(x) [R], log softmax(x)[token] [R],
    log softmax(x)[gather] [R] or None), float32. The torch reference of the fused Triton kernel.
    ``sample_every`` = S > 1: only rows r with r % S == S − 1 draw a token (and noise); the others
    return token −1 and log-prob nan."""
    if sample_every < 1:
        raise ValueError(f"sample_every = {sample_every}: must be >= 1 (1: every row draws a token)")
    x = logits.float() / temperature
    lse = torch.logsumexp(x, -1)
    xs = x[sample_every - 1 :: sample_every]  # [R / S, V] the rows that draw
    e = torch.empty_like(xs).exponential_(generator=generator)
    drawn = torch.argmax(xs - e.log(), dim=-1)
    lp_drawn = xs.gather(1, drawn[:, None])[:, 0] - lse[sample_every - 1 :: sample_every]
    if sample_every == 1:
        tok, lp_tok = drawn, lp_drawn
    else:
        tok = torch.full_like(lse, -1, dtype=torch.long)
        lp_tok = torch.full_like(lse, float("nan"))
        tok[sample_every - 1 :: sample_every] = drawn
        lp_tok[sample_every - 1 :: sample_every] = lp_drawn
    lp_gather = x.gather(1, gather[:, None])[:, 0] - lse if gather is not None else None
    return tok, lp_tok, lp_gather


def sample_and_score(logits: Tensor, temperature: float, seed: Tensor, gather: Tensor | None = None,
                     sample_every: int = 1, triton: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """With ``triton`` one fused kernel (one read of the [R, V] logits; randomness keyed by the device
    scalar ``seed``), else the reference (torch's global generator). ``sample_every``: see the
    reference."""
    if triton:
        from .kernels.sampling import triton_sample_and_score

        return triton_sample_and_score(logits, temperature, seed, gather, sample_every)
    return sample_and_score_reference(logits, temperature, gather, sample_every=sample_every)


def _without_pdl(fn):
    """``fn`` with its kernels launched (and captured) without PDL (``kernels.pdl_off``): for
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


@dataclass
class EngineOutput:
    tokens: Tensor  # [G, N, max_new_tokens] long, EOS-padded (pad 0 when EOS is ignored)
    lengths: Tensor  # [G, N]
    log_weights: Tensor  # [G, N] float64, since the last resampling (SMC-SD; zeros otherwise)
    log_evidence: Tensor  # [G] float64 (SMC-SD; zeros otherwise)
    ess: list = field(default_factory=list)  # per round, [G] (host)
    resampled: list = field(default_factory=list)  # per round, [G] bool (host)
    rounds: int = 0
    peak_pages: int = 0
    accepted: Tensor | None = None  # [G, N] drafted tokens accepted (speculative decoding)
    drafted: Tensor | None = None  # [G, N] tokens drafted in each row slot while unfinished (work, not lineage)
    host_s: float = 0.0  # host time between rounds (page bookkeeping, uploads, rewards, host masks)
    finished: Tensor | None = None  # [G, N] bool: ended by EOS, budget, or weight 0 (SMC-SD)
    weights: list = field(default_factory=list)  # per round, normalised [G, N] (record_weights=True)
    particles: list | None = None  # N_g per request (rows j >= N_g of request g are padding)


@dataclass
class _Graph:
    """Static buffers of one captured round and its replay (reused across calls of one shape)."""

    buffers: dict
    step: object
    fn: object = None  # the captured closure: keeps every tensor it references alive with the graph


class Engine:
    """Holds the models and their KV pools; runs SMC-SD, exact speculative decoding and
    autoregressive decoding on them.

    CUDA graphs are captured once per round shape (rows, K, temperatures, ...) and replayed by
    later calls through static buffers, as serving engines do; ``clear_graphs`` frees them."""

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
        self._graphs: dict[tuple, _Graph] = {}
        if self.max_context is not None:  # (before any graph exists)
            self._ensure_rope(self.max_context + self.page_size)

    def clear_graphs(self) -> None:
        self._graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _ensure_rope(self, n: int) -> None:
        for m in (self.target, self.draft):
            if m is not None and (m.rope_cos is None or m.rope_cos.shape[0] < n):
                self._graphs.clear()  # NOTE: captured graphs read the old tables
                m.set_rope_cache(n)

    # ------------------------------------------------------------------------------------------

    # Prefill. NOTE (why the engine's corpus generation was no faster than ``generate``, issue 4):
    # ``_start`` used to prefill one prompt per forward, so a batch of 1024 rows cost 1024 small
    # forwards, and each forward had L = that prompt's length: ``_paged_attn_kernel`` takes L (and
    # MT, BLOCK_L, NSPLIT/MERGE, derived from L and the row count) as ``tl.constexpr``, so Triton
    # compiled a new attention kernel for every new prompt length (up to ~256 of them for prompts
    # <= 256 tokens: the slow first batches). Now all prompts of a call are prefilled together, in
    # forwards of R rows × L_b positions, L_b a power of two (>= 16) and R a power of two, both
    # from a handful of values, so the same few kernels serve every call. The constexprs stay:
    # they size register tiles, which must be compile-time constants in Triton.

    PREFILL_TOKENS = 16384  # positions per prefill forward (rows × bucket length), at most

    def _prefill(self, model: Llama, kv: KVPool, pt_dev: Tensor, row: int, ids: list[int]) -> None:
        """One row's prompt (the scheduler's join), through ``_prefill_rows``: bucketed shapes too."""
        self._prefill_rows(model, kv, pt_dev, [row], [ids])

    def _prefill_unpadded(self, model: Llama, kv: KVPool, pt_dev: Tensor, row: int, ids: list[int]) -> None:
        """One row, one forward of exactly its length (the reference ``_prefill_rows`` is tested against)."""
        if not ids:
            return
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(len(ids), device=self.device)[None]
        batch = PagedBatch.build(positions, pt_dev[row : row + 1], self.page_size)
        model(tokens, kv, batch, last_only=True)

    def _prefill_rows(self, model: Llama, kv: KVPool, pt_dev: Tensor, rows: list[int], seqs: list[list[int]],
                      max_tokens: int | None = None) -> int:
        """Write the keys/values of ``seqs[i]`` (at positions 0..) into the pages of row ``rows[i]``,
        many rows per forward. Returns the number of forwards.

        Rows are sorted by length and cut into buckets of L_b = next power of two >= max(16, n)
        positions (at most the page table's and the rope tables' capacity); a forward holds R rows
        of one bucket, R a power of two with R·L_b <= ``max_tokens`` (``PREFILL_TOKENS``). Shorter
        rows are right-padded: padding tokens sit at positions n..L_b−1 after the row's real ones,
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
        budget = max_tokens or self.PREFILL_TOKENS
        P, PS, dev = pt_dev.shape[1], self.page_size, self.device
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

    def _start(self, prompts: list[list[int]], N: int, extra: int, batched_prefill: bool = True
               ) -> tuple[PageTable, Tensor]:
        """Page table for G·N rows; each request's prompt prefilled once (in row g·N) and shared by
        its N rows (copy-on-write of the partial last page when a row first writes into it).
        ``batched_prefill`` False prefills one prompt per forward of its own length (the reference
        for tests; on CUDA that compiles an attention kernel per prompt length)."""
        G, PS = len(prompts), self.page_size
        longest = max(len(p) for p in prompts) + extra
        if self.max_context is not None and longest > self.max_context:
            raise ValueError(f"prompt + new tokens + block need {longest} positions, more than the engine's "
                             f"max_context ({self.max_context}): raise max_context")
        self._ensure_rope(longest + PS)
        table = PageTable(G * N, -(-(self.max_context or longest) // PS) + 1, self.num_pages, PS)
        for g, ids in enumerate(prompts):
            r = g * N
            table.reserve(np.array([r]), np.array([len(ids) - 1]))
            table.advance(np.array([r]), np.array([len(ids) - 1]))
        pt_dev = torch.from_numpy(table.table).to(self.device)
        heads = [g * N for g in range(G)]
        if batched_prefill:
            self._prefill_rows(self.target, self.kv_t, pt_dev, heads, [p[:-1] for p in prompts])
            if self.draft is not None:
                self._prefill_rows(self.draft, self.kv_d, pt_dev, heads, [p[:-2] for p in prompts])
        else:
            for g, ids in enumerate(prompts):
                self._prefill_unpadded(self.target, self.kv_t, pt_dev, g * N, ids[:-1])
                if self.draft is not None:
                    self._prefill_unpadded(self.draft, self.kv_d, pt_dev, g * N, ids[:-2])
        for g in range(G):
            table.share_prefix(list(range(g * N, (g + 1) * N)), g * N)
        return table, pt_dev

    def _upload(self, table: PageTable, pt_dev: Tensor, copies: tuple[list[int], list[int]]) -> None:
        src, dst = copies
        if src:  # one host-to-device copy for both index lists
            sd = torch.tensor(src + dst, dtype=torch.long).to(self.device, non_blocking=True)
            s, d = sd[: len(src)], sd[len(src):]
            self.kv_t.copy_pages(s, d)
            if self.kv_d is not None:
                self.kv_d.copy_pages(s, d)
        # NOTE: not waited for: from pageable memory the copy is staged before the call returns (the
        # host may change the table afterwards), and the work that reads pt_dev follows on this stream
        pt_dev.copy_(torch.from_numpy(table.table), non_blocking=True)

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
        # assertion in torch 2.11); the pool is freed with the graph (clear_graphs).
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def _round_buffers(self, pt_start: Tensor, B: int, K: int, cap: int, pad: int, **extra: Tensor) -> dict:
        """Static buffers of the SMC-SD and speculative-decoding rounds for B rows and K drafts
        (page table, positions, pending tokens, outputs, drafts), plus the strategy's ``extra``."""
        dev = self.device
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

    def _round_graph(self, key: tuple, make, prompts: list[list[int]], N: int, lens: np.ndarray,
                     max_new_tokens: int, pad: int, table: PageTable, copies, use_graphs: bool,
                     zero: tuple[str, ...] = ()) -> _Graph:
        """The round of ``key`` — captured on first use from ``make() -> (buffers, step)``, replayed
        through the same buffers by later calls — with the page table uploaded and the buffers reset
        for this call: positions, each row's two pending tokens, outputs, budgets, and ``zero``."""
        dev = self.device
        graph = self._graphs.get(key)
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

        return self._ready(key, graph, b, step, reset, table, copies, use_graphs)

    def _ready(self, key: tuple, graph: _Graph | None, buffers: dict, step, reset, table: PageTable, copies,
               use_graphs: bool) -> _Graph:
        """Upload the page table, reset the buffers for this call, and capture ``step`` the first
        time ``key`` is seen (cached when graphs are on; the capture's warm-up run advances the
        state, so the buffers are reset again)."""
        self._upload(table, buffers["pt"], copies)
        reset()
        if graph is None:
            graph = _Graph(buffers, self._capture(step, use_graphs), step)
            if use_graphs:
                self._graphs[key] = graph
                buffers["pt"].copy_(torch.from_numpy(table.table))  # NOTE: device page bookkeeping rewrote it
                reset()
        return graph

    def _draft_block(self, buf: dict, K: int, draft_temperature: float, seeds: Tensor,
                     keep_logits: bool = False) -> None:
        """K draft tokens for every row: the first forward covers the two tokens the draft has not
        seen (``pending``, at positions T−1, T), then one token a step. Fills drafts/log_q (and
        draft_logits [B, K, V] when asked)."""
        T, pt, PS, ar = buf["seq"], buf["pt"], self.page_size, buf["ar"]
        batch = PagedBatch.build((T - 1)[:, None] + ar[:2], pt, PS)
        logits = self.draft(buf["pending"], self.kv_d, batch, last_only=True)[:, 0]  # [B, V]
        for i in range(K):
            d, lq, _ = sample_and_score(logits, draft_temperature, seeds[i], triton=self.config.triton)
            buf["drafts"][:, i] = d
            buf["log_q"][:, i] = lq
            if keep_logits:
                buf["draft_logits"][:, i] = logits
            if i < K - 1:
                batch = PagedBatch.build((T + 1 + i)[:, None], pt, PS)
                logits = self.draft(d[:, None], self.kv_d, batch)[:, 0]

    def _verify(self, buf: dict, K: int, target_temperature: float, seeds: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Target pass over [last, d_1..d_K] -> (log p(d_i) [B, K], bonus ~ p(· | d_1..d_K) [B],
        logits [B, K+1, V])."""
        B, ar = buf["last"].shape[0], buf["ar"]
        feed = torch.cat([buf["last"][:, None], buf["drafts"]], dim=1)
        batch = PagedBatch.build(buf["seq"][:, None] + ar, buf["pt"], self.page_size)
        logits = self.target(feed, self.kv_t, batch)  # [B, K+1, V]
        gather = torch.cat([buf["drafts"], buf["drafts"][:, :1]], dim=1).reshape(-1)
        # only the last row of each particle's K + 1 draws a token (the bonus); the others are scored
        tok, _, lp = sample_and_score(logits.view(B * (K + 1), -1), target_temperature, seeds[K], gather,
                                      sample_every=K + 1, triton=self.config.triton)
        return lp.view(B, K + 1)[:, :K], tok.view(B, K + 1)[:, K], logits

    # ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def smc_sd(self, prompts: list[list[int]], *, particles, block_size, max_new_tokens,
               draft_temperature=1.0, target_temperature=1.0, eos_token_id: int | None = None,
               resampler: str = "systematic", ess_threshold: float = 0.5, use_graphs: bool | None = None,
               seed: int = 0, target: EngineTarget | list | None = None, record_weights: bool = False,
               pipeline: bool = True) -> EngineOutput:
        """SMC-SD for G = len(prompts) requests × N particles, K = block_size drafted tokens a round.

        ``particles``, ``block_size``, ``max_new_tokens`` and the temperatures are one value or one
        per prompt. ``target`` (an :class:`~smcdecode.backends.engine.smc.EngineTarget`, e.g.
        ``EngineTarget.of(LM(model) ** 2 * Regex(...) * Reward(...))``, or one per prompt) adds a
        power α, constraints and rewards. The plain uniform case runs the fused round below; anything else
        runs ``smc.run`` (per-row settings, masks, rewards). eos_token_id None ignores EOS
        (fixed-length outputs, as in the benchmark).

        Page bookkeeping of the fused round (``_smc_rounds``): the host sets pages aside before each
        launch, so the round's graph forks the page table, copies the shared partial pages and adds
        fresh ones itself and the next round is launched before the host has read this one (the host
        books the same pages one round late). A round whose pages could not be set aside (a nearly
        full pool) is read before the next launch and its pages booked in between; ``pipeline=False``
        does that for every round (the reference the pipelined rounds are tested against: the same
        outputs for the same seed, with and without CUDA graphs)."""
        from . import smc

        if self.draft is None:
            raise SMCDecodeError("SMC-SD needs a draft model: Engine(target, draft, ...)")
        if not prompts or any(len(p) < 2 for p in prompts):
            raise SMCDecodeError("prompts must be a non-empty list of prompts of at least 2 tokens each")
        settings = smc.Settings.of(len(prompts), particles, block_size, max_new_tokens, draft_temperature,
                                   target_temperature)
        use_graphs = self.config.use_graphs if use_graphs is None else use_graphs
        programs = target if isinstance(target, (list, tuple)) else [target]
        plain = all(t is None or (t.alpha == 1.0 and not t.constraints and not t.rewards) for t in programs)
        if not (plain and settings.uniform):
            if target is None or (isinstance(target, (list, tuple)) and any(t is None for t in target)):
                target = [t or smc.EngineTarget() for t in programs] if isinstance(target, (list, tuple)) \
                    else smc.EngineTarget()
            return smc.run(self, prompts, settings, target, eos_token_id=eos_token_id,
                           resampler=resampler, ess_threshold=ess_threshold, use_graphs=use_graphs, seed=seed,
                           record_weights=record_weights)
        particles, block_size, max_new_tokens = (settings.particles[0], settings.block_size[0],
                                                 settings.max_new_tokens[0])
        draft_temperature, target_temperature = settings.draft_temperature[0], settings.target_temperature[0]
        torch.manual_seed(seed)
        G, N, K, dev = len(prompts), particles, block_size, self.device
        B = G * N
        eos = -1 if eos_token_id is None else eos_token_id
        pad = max(eos, 0)
        first_round, _ = self.smc_page_bounds(prompts, N, K, max_new_tokens)
        if self.num_pages < first_round:
            raise SMCDecodeError(
                f"num_pages ({self.num_pages}) is too small for {G} request(s) × {N} particles: the first round "
                f"alone needs {first_round} pages of {self.page_size} tokens; raise num_pages to at least "
                f"{first_round}")
        table, pt_start = self._start(prompts, N, max_new_tokens + K + 2)
        cap = table.table.shape[1] * self.page_size
        key = ("smc", G, N, K, draft_temperature, target_temperature, eos, resampler, ess_threshold,
               table.table.shape[1], use_graphs, self.config)
        rows = np.arange(B)
        lens = np.repeat([len(p) - 1 for p in prompts], N)  # target tokens cached per row
        copies = table.reserve(rows, lens + K + 1, write_from=lens - 1)  # first round's pages

        def make():
            buf = self._round_buffers(
                pt_start, B, K, cap, pad,
                log_w=torch.zeros(B, dtype=torch.float64, device=dev),
                log_Z=torch.zeros(G, dtype=torch.float64, device=dev),
                index=torch.arange(B, device=dev), do=torch.zeros(G, dtype=torch.bool, device=dev),
                ess=torch.zeros(G, dtype=torch.float64, device=dev),
                group_base=(torch.arange(G, device=dev) * N)[:, None],
                W=torch.zeros(G, N, dtype=torch.float64, device=dev),
                # what the host reads of a round: ancestors, resampled, ESS, all finished
                packed=torch.zeros(B + 2 * G + 1, dtype=torch.float64, device=dev),
                # pages set aside for the end of the round: a row's copy-on-write page, then its new ones
                fresh=torch.zeros(B, 2 + (K + 1) // self.page_size, dtype=torch.long, device=dev),
            )
            round_ = self._smc_round(buf, G, N, K, draft_temperature, target_temperature, eos, pad, resampler,
                                     ess_threshold)
            pages = self._smc_pages(buf, G, N, K, [kv for kv in (self.kv_t, self.kv_d) if kv is not None])

            def round_and_pages() -> None:
                round_()
                pages()

            return buf, round_and_pages

        graph = self._round_graph(key, make, prompts, N, lens, max_new_tokens, pad, table, copies, use_graphs,
                                  zero=("log_w", "log_Z", "fresh"))
        b = graph.buffers
        # NOTE: the warm-up also wrote KV entries, but every entry a round reads at or after
        # position T-1 is written earlier in that same round, so the first replay overwrites them.

        out = EngineOutput(b["tokens"], b["n_gen"], b["log_w"], b["log_Z"])
        n_rounds = -(-max_new_tokens // (K + 1))
        self._smc_rounds(graph, out, table, G, N, K, lens, n_rounds, record_weights, pipeline)
        out.peak_pages = table.peak_used
        out.tokens = b["tokens"][:, :max_new_tokens].reshape(G, N, -1).clone()
        out.lengths = b["n_gen"].view(G, N).clone()
        out.log_weights = b["log_w"].view(G, N).clone()
        out.log_evidence = b["log_Z"] + torch.logsumexp(out.log_weights, 1) - math.log(N)
        out.finished = b["finished"].view(G, N).clone()
        out.drafted = b["drafted"].view(G, N).clone()
        out.particles = [N] * G
        return out

    def smc_page_bounds(self, prompts: list[list[int]], N: int, K: int, max_new_tokens: int) -> tuple[int, int]:
        """(pages the first round of the fused SMC-SD needs, pages it needs at most over the whole
        output), the null page included.

        Columns of a row before the page of its first write (position len(prompt) − 2) hold prompt
        pages that every particle of the request shares for ever; from that page on, a particle
        holds at most one page per column of its own. The first round's count is also the least
        that the bookkeeping ever needs (all particles still share the prompt pages); the
        pipelined rounds want about two rounds' fresh pages on top (``_smc_rounds``; with fewer free
        they wait for the round in flight)."""
        PS = self.page_size
        n_rounds = -(-max_new_tokens // (K + 1))
        first_round, worst = 1, 1
        for p in prompts:
            cached = len(p) - 1
            shared = (cached - 1) // PS
            first_round += shared + N * (-(-(cached + K + 1) // PS) - shared)
            worst += shared + N * (-(-(cached + n_rounds * (K + 1)) // PS) - shared)
        return first_round, worst

    def _smc_rounds(self, graph: _Graph, out: EngineOutput, table: PageTable, G: int, N: int, K: int,
                    lens: np.ndarray, n_rounds: int, record_weights: bool, pipeline: bool) -> None:
        """The rounds of the fused SMC-SD and their page bookkeeping.

        Pipelined (``pipeline``): before launching round r the host sets aside, per row, one page
        for a copy-on-write and the pages of the columns the next round opens (``PageTable.hold``;
        how many is known in advance: every row advances K + 1 positions a round), uploaded to
        ``fresh``; the round's graph forks the page table and uses them (``_smc_pages``). Round r + 1
        is launched before round r's flags are read (its copy to pinned memory waited for with an
        event), and the host then books round r's fork and the same pages (``reserve(held=...)``)
        while round r + 1 runs. Pages that round r frees are handed out from round r + 2 on.

        A round without pages set aside (``pipeline`` False, the last round, or too few free pages
        even after reading the round in flight) gets none (the graph only forks); the host reads it
        before launching the next and books its pages as usual, uploading the page table and
        copying pages itself. Once a read round says that every particle has finished, a round
        launched after it ran as a no-op (``_smc_round``): its flags and weights are dropped."""
        b, B, PS = graph.buffers, G * N, self.page_size
        rows = np.arange(B)
        F = b["fresh"].shape[1]
        pinned = self.device.type == "cuda"
        host = torch.empty(2, B + 2 * G + 1, dtype=torch.float64, pin_memory=pinned)
        events = [torch.cuda.Event() for _ in range(2)] if pinned else None
        held: dict[int, np.ndarray] = {}  # round -> [B, F] pages set aside for its end (0: none)
        unread: list[int] = []

        def after(r: int) -> np.ndarray:  # positions each row has cached after round r
            return lens + (r + 1) * (K + 1)

        stage = torch.zeros(2, B, F, dtype=torch.long, pin_memory=pinned)  # the uploads of `fresh`, by round parity

        def give(r: int) -> bool:
            """Set pages aside for the end of round r and upload them (zeros: none). False, with
            nothing uploaded, when too few pages are free while a round is in flight (the caller
            reads that round, which frees pages, and asks again)."""
            fresh = np.zeros((B, F), dtype=np.int64)
            if pipeline and r + 1 < n_rounds:
                T = after(r)
                demand = 1 + (-(-(T + K + 1) // PS)) + (T // -PS)  # a copy + the columns it opens
                try:
                    pages = table.hold(int(demand.sum()))
                except MemoryError:
                    if unread:
                        return False
                else:
                    fresh[np.arange(F)[None] < demand[:, None]] = pages
                    held[r] = fresh
            # (pinned and not reused before round r has been read: the copy runs after round r − 1)
            stage[r % 2].numpy()[:] = fresh
            b["fresh"].copy_(stage[r % 2], non_blocking=True)
            return True

        def launch(r: int) -> None:
            graph.step()
            if record_weights:
                out.weights.append(b["W"].clone())
            host[r % 2].copy_(b["packed"], non_blocking=True)
            if pinned:
                events[r % 2].record()
            unread.append(r)

        def read() -> bool:
            """Read the oldest round in flight and book its pages; True when every particle has
            finished (the rounds launched after it are dropped)."""
            r = unread.pop(0)
            if pinned:
                events[r % 2].synchronize()
            t0 = time.perf_counter()
            h = host[r % 2].numpy()
            out.rounds += 1
            out.resampled.append(h[B : B + G] > 0)
            out.ess.append(h[B + G : B + 2 * G].copy())
            done = bool(h[-1] > 0)
            if done:
                for q in [r, *unread]:
                    if q in held:
                        table.unhold(held.pop(q))
                unread.clear()
                del out.weights[out.rounds :]
            else:
                T = after(r)
                table.advance(rows, T)
                table.fork(h[:B].astype(np.int64))
                if r + 1 < n_rounds:
                    if r in held:  # the graph placed them already
                        table.reserve(rows, T + K + 1, write_from=T - 1, held=held.pop(r))
                    else:
                        self._upload(table, b["pt"], table.reserve(rows, T + K + 1, write_from=T - 1))
            out.host_s += time.perf_counter() - t0
            return done

        for r in range(n_rounds):
            if unread and unread[-1] not in held and read():  # a round the host books: read before the next
                return
            if not give(r) and unread:  # too few free pages: book the round in flight, then try again
                if read():
                    return
                give(r)
            launch(r)
            if len(unread) > 1 and read():  # the previous round, while this one runs
                return
        while unread:
            if read():
                return

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

    def _smc_round(self, b: dict, G: int, N: int, K: int, draft_temperature: float, target_temperature: float,
                   eos: int, pad: int, resampler: str, ess_threshold: float):
        """The device code of one SMC-SD round over the static buffers ``b`` (captured as one graph)."""
        resample = get_resampler(resampler)
        dev = self.device
        ar = b["ar"]
        seq_t, pending, last, tokens, n_gen = b["seq"], b["pending"], b["last"], b["tokens"], b["n_gen"]
        finished, log_w, log_Z, drafts, log_q = b["finished"], b["log_w"], b["log_Z"], b["drafts"], b["log_q"]

        def round_() -> None:
            seeds = torch.randint(0, 2**62, (K + 1,), device=dev)
            self._draft_block(b, K, draft_temperature, seeds)
            log_p, bonus, _ = self._verify(b, K, target_temperature, seeds)

            remaining = b["budget"] - n_gen
            in_budget = ar[None, :K] < remaining[:, None]
            is_eos = (drafts == eos) & in_budget
            first = (torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0
            keep = first & in_budget
            incr = torch.where(keep, log_p - log_q, 0.0).double().sum(1)
            any_eos = is_eos.any(1)
            n_new = torch.where(any_eos, is_eos.long().argmax(1) + 1, remaining.clamp(max=K))
            n_new = torch.where(~any_eos & (remaining > K), K + 1, n_new)
            active = ~finished
            b["drafted"].add_(torch.where(active, remaining.clamp(max=K), 0))
            block = torch.cat([drafts, bonus[:, None]], dim=1)
            block = torch.where((ar[None] < n_new[:, None]) & active[:, None], block, pad)
            tokens.scatter_(1, n_gen[:, None] + ar, block)
            n_gen.add_(torch.where(active, n_new, 0))
            lw = torch.where(active, log_w + incr, log_w)
            hit_eos = any_eos | ((bonus == eos) & (n_new == K + 1))
            finished.copy_(finished | (active & (hit_eos | (n_gen >= b["budget"]))) | torch.isneginf(lw))
            pending.copy_(torch.stack([drafts[:, -1], bonus], dim=1))
            last.copy_(bonus)

            lw = lw.view(G, N)
            W, ess = normalise(lw)
            live = (~finished).view(G, N).any(1)
            do = live & (ess > 0) & ((ess < ess_threshold * N) | (ess_threshold >= 1.0))
            A = torch.where(do[:, None], resample(W, None), torch.arange(N, device=dev)[None])
            idx = (A + b["group_base"]).flatten()
            log_Z.add_(torch.where(do, torch.logsumexp(lw, 1) - math.log(N), 0.0))
            log_w.copy_(torch.where(do[:, None], 0.0, lw).flatten())
            for t in (pending, last, tokens, n_gen, finished, log_w):
                t.copy_(t[idx])
            b["index"].copy_(idx)
            b["do"].copy_(do)
            b["ess"].copy_(ess)
            b["W"].copy_(W)
            b["done"].copy_(finished.all()[None])
            b["packed"].copy_(torch.cat([idx.double(), do.double(), ess, b["done"].double()]))
            # NOTE: positions stay once all rows have finished, so a round run after the last (the
            # device bookkeeping's overshoot) writes inside the pages its rows own, within the tables
            seq_t.add_(torch.where(b["done"], 0, K + 1))

        return round_

    def _smc_pages(self, b: dict, G: int, N: int, K: int, pools: list[KVPool]):
        """The page bookkeeping of ``PageTable`` (``fork`` then ``reserve``) for the rows of the
        fused SMC-SD round, as device code over the static buffers ``b`` (run after resampling, in
        the round's graph; static shapes, no host sync), with the pages the host set aside in
        ``fresh`` [B, F] (row i: its copy-on-write page, then its new columns' pages; 0 = none).

        Every round writes positions [T−1, T+K] of every row (T = ``seq`` before the round), so
        after it (T' = T + K + 1):
          * fork: pt = pt[ancestors] (a pointer exchange: every page stays where it is);
          * copy-on-write: the one page a row writes that may be shared is the page of position
            T'−1 (the partially filled last page: fully written pages are never written again).
            A row copies it to fresh[i, 0] when a later row of its request holds it too, so the last
            holder keeps it (as ``PageTable.reserve``, which visits rows in order);
          * fresh pages fresh[i, 1:] for the columns [ceil(T'/PS), ceil((T'+K+1)/PS)) of every row.
        With ``fresh`` all zeros it only forks (the host then books and uploads the rest). Nothing
        changes once every row has finished (``done``): a round launched after the last is a no-op.
        ``PageTable.reserve(held=fresh)`` repeats this on the host with the same page ids."""
        PS, dev = self.page_size, self.device
        pt, seq, done, fresh = b["pt"], b["seq"], b["done"], b["fresh"]
        B, P = pt.shape
        F = fresh.shape[1]
        cols = torch.arange(P, device=dev)[None]  # [1, P]
        later = torch.ones(N, N, dtype=torch.bool, device=dev).triu(1)  # [i, j]: row j comes after row i

        def pages_() -> None:
            go = ~done  # [1]
            table = pt[b["index"]]  # [B, P] the fork
            last_col = (seq - 1) // PS  # [B] the page of position T'−1
            n_old = last_col + 1  # pages a row holds
            n_new = (seq + K + PS) // PS  # pages it needs for positions < T' + K + 1
            last_page = table.gather(1, last_col[:, None])[:, 0]  # [B]
            same = last_page.view(G, N)[:, :, None] == last_page.view(G, N)[:, None, :]  # [G, N, N]
            cow = (same & later).any(2).view(B) & go & (fresh[:, 0] > 0)  # a later row holds the page too
            new_page = fresh.gather(1, (cols - n_old[:, None] + 1).clamp(1, F - 1))  # [B, P]
            grows = (cols >= n_old[:, None]) & (cols < n_new[:, None]) & go & (new_page > 0)
            new_table = torch.where(grows, new_page.to(pt.dtype), table)
            new_table = torch.where((cols == last_col[:, None]) & cow[:, None], fresh[:, :1].to(pt.dtype), new_table)
            src = torch.where(cow, last_page.long(), 0)  # rows without a copy: (0, 0), skipped
            dst = torch.where(cow, fresh[:, 0], 0)
            for pool in pools:  # one launch over all layers, keys and values
                pool.copy_pages(src, dst)
            pt.copy_(new_table)

        return pages_

    # ------------------------------------------------------------------------------------------

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

        No per-round host work: every row's pages for the whole output are reserved up front (rows
        never fork), and the host reads the "all finished" flag of the previous round while the
        next one runs."""
        if self.draft is None:
            raise ValueError("speculative decoding needs a draft model: Engine(target, draft, ...)")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if any(len(p) < 2 for p in prompts):
            raise ValueError("every prompt needs at least 2 tokens")
        use_graphs = self.config.use_graphs if use_graphs is None else use_graphs
        torch.manual_seed(seed)
        G, N, K, dev = len(prompts), samples, block_size, self.device
        B, V = G * N, self.target.cfg.vocab_size
        eos = -1 if eos_token_id is None else eos_token_id
        pad = max(eos, 0)
        table, pt_start = self._start(prompts, N, max_new_tokens + K + 2)
        cap = table.table.shape[1] * self.page_size
        rows = np.arange(B)
        lens = np.repeat([len(p) - 1 for p in prompts], N)
        copies = table.reserve(rows, lens + max_new_tokens + K + 2, write_from=lens - 1)
        key = ("sd", G, N, K, draft_temperature, target_temperature, eos, table.table.shape[1], use_graphs, self.config)

        def make():
            buf = self._round_buffers(
                pt_start, B, K, cap, pad,
                accepted=torch.zeros(B, dtype=torch.long, device=dev),
                draft_logits=torch.zeros(B, K, V, dtype=self.dtype, device=dev),
                rows=torch.arange(B, device=dev),
            )
            return buf, self._sd_round(buf, K, draft_temperature, target_temperature, eos, pad)

        graph = self._round_graph(key, make, prompts, N, lens, max_new_tokens, pad, table, copies, use_graphs,
                                  zero=("accepted",))
        b = graph.buffers

        pinned = self.device.type == "cuda"
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

    def _sd_round(self, b: dict, K: int, draft_temperature: float, target_temperature: float, eos: int, pad: int):
        """The device code of one speculative-decoding round over the static buffers ``b``."""
        dev = self.device
        ar = b["ar"]
        drafts, log_q, last, n_gen, finished = b["drafts"], b["log_q"], b["last"], b["n_gen"], b["finished"]
        rows = b["rows"]  # NOTE: every tensor a captured graph reads must outlive the call (static buffers)

        def round_() -> None:
            seeds = torch.randint(0, 2**62, (K + 1,), device=dev)
            self._draft_block(b, K, draft_temperature, seeds, keep_logits=True)
            log_p, bonus, logits_t = self._verify(b, K, target_temperature, seeds)
            u = torch.rand(drafts.shape, device=dev)
            accept = torch.log(u) < log_p - log_q  # u < min(1, p/q)
            n_acc = torch.cumprod(accept.long(), 1).sum(1)  # [B] leading acceptances
            j = n_acc.clamp(max=K - 1)
            p = torch.softmax(logits_t[rows, j].float() / target_temperature, -1)  # [B, V]
            q = torch.softmax(b["draft_logits"][rows, j].float() / draft_temperature, -1)
            residual = (p - q).clamp_min(0.0)
            e = torch.empty_like(residual).exponential_()
            c_res = torch.argmax(residual.log() - e.log(), -1)  # ∝ (p − q)+
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

    @_without_pdl
    @torch.inference_mode()
    def autoregressive(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                       samples: int = 1, use_graphs: bool | None = None, seed: int = 0,
                       batched_prefill: bool = True, eos_token_id: int | None = None) -> tuple[Tensor, int]:
        """Plain sampling from the target, one token a step for each of G requests × ``samples``
        independent rows (no host sync until the end). Returns (tokens [G·samples, max_new_tokens],
        row g·samples + s the s-th sample of prompt g; peak pages).

        With ``eos_token_id`` a row that samples EOS keeps emitting EOS (its tokens after the first
        EOS are EOS), and decoding stops once every row has finished: the host reads an "all
        finished" flag every ``AR_CHECK_EVERY`` steps, one check behind (no sync on the step it
        was copied in), so at most 2·AR_CHECK_EVERY steps run after the last row ends; columns
        not decoded are EOS. Without it every row decodes ``max_new_tokens`` tokens.

        Each prompt is prefilled once (all prompts together, ``_prefill_rows``) and its pages are
        shared by its ``samples`` rows; the partially filled last prompt page is copied for each
        row before the row first writes into it (copy-on-write in ``PageTable.reserve``), so rows
        never see each other's tokens.

        NOTE: the step is captured as a CUDA graph once per (rows, temperature, page-table width)
        and replayed by later calls through static buffers, like the SMC-SD rounds (it used to be
        re-captured, with a warm-up step, on every call). Give the Engine a ``max_context`` so the
        page-table width, and thus the graph and the attention kernel's launch shape, is the same
        for every call."""
        if not prompts or any(len(p) < 1 for p in prompts):
            raise SMCDecodeError("prompts must be a non-empty list of non-empty token lists")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise SMCDecodeError(f"samples must be a positive integer, got {samples!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SMCDecodeError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise SMCDecodeError(f"temperature must be a finite number > 0, got {temperature!r}")
        use_graphs = self.config.use_graphs if use_graphs is None else use_graphs
        torch.manual_seed(seed)
        G, S, dev, PS = len(prompts), samples, self.device, self.page_size
        B = G * S
        table, pt_start = self._start(prompts, S, max_new_tokens + 2, batched_prefill=batched_prefill)
        rows = np.arange(B)
        lens = np.repeat([len(p) - 1 for p in prompts], S)
        copies = table.reserve(rows, lens + max_new_tokens + 1)  # copy-on-write of the shared last page
        cap = table.table.shape[1] * PS
        eos = -1 if eos_token_id is None else int(eos_token_id)
        key = ("ar", B, temperature, eos, table.table.shape[1], use_graphs, self.config)
        graph = self._graphs.get(key)
        if graph is None:
            buf = dict(pt=pt_start.clone(), seq=torch.zeros(B, dtype=torch.long, device=dev),
                       last=torch.zeros(B, dtype=torch.long, device=dev),
                       tokens=torch.zeros(B, cap + 1, dtype=torch.long, device=dev),
                       n_gen=torch.zeros(1, dtype=torch.long, device=dev),
                       finished=torch.zeros(B, dtype=torch.bool, device=dev),
                       done=torch.zeros(1, dtype=torch.bool, device=dev))
            step = self._ar_step(buf, temperature, eos)
        else:
            buf, step = graph.buffers, None
        b = buf

        def reset() -> None:
            b["seq"].copy_(torch.as_tensor(lens, device=dev))
            b["last"].copy_(torch.tensor([p[-1] for p in prompts], device=dev).repeat_interleave(S))
            b["n_gen"].zero_()
            b["finished"].zero_()
            b["done"].zero_()

        graph = self._ready(key, graph, b, step, reset, table, copies, use_graphs)
        pinned = dev.type == "cuda"
        flags = [torch.zeros(1, dtype=torch.bool, pin_memory=pinned) for _ in range(2)]
        events = [torch.cuda.Event() if pinned else None for _ in range(2)]
        steps, every = 0, self.AR_CHECK_EVERY
        for i in range(max_new_tokens):
            graph.step()
            steps += 1
            if eos < 0 or (i + 1) % every:
                continue
            c = (i + 1) // every
            flags[c % 2].copy_(b["done"], non_blocking=True)
            if pinned:
                events[c % 2].record()
                if c > 1:  # the previous check's flag: its copy has long finished
                    events[(c - 1) % 2].synchronize()
                    if bool(flags[(c - 1) % 2]):
                        break
            elif bool(flags[c % 2]):
                break
        self.ar_steps_run = steps  # (diagnostics: steps decoded by the last call)
        tokens = b["tokens"][:, :max_new_tokens].clone()
        if steps < max_new_tokens:
            tokens[:, steps:] = eos
        return tokens, table.peak_used

    AR_CHECK_EVERY = 16  # steps between the host's reads of the autoregressive "all finished" flag

    def _ar_step(self, b: dict, temperature: float, eos: int = -1):
        """One autoregressive step over the static buffers ``b`` (captured as one graph); with
        ``eos`` >= 0 a finished row emits EOS and ``done`` tells whether every row has finished."""
        seq_t, last, tokens, n_gen, pt, dev, PS = b["seq"], b["last"], b["tokens"], b["n_gen"], b["pt"], \
            self.device, self.page_size
        finished = b["finished"]

        def step_() -> None:
            batch = PagedBatch.build(seq_t[:, None], pt, PS)
            seeds = torch.randint(0, 2**62, (1,), device=dev)
            t, _, _ = sample_and_score(self.target(last[:, None], self.kv_t, batch)[:, 0], temperature, seeds[0],
                                       triton=self.config.triton)
            if eos >= 0:
                t = torch.where(finished, eos, t)
                finished.logical_or_(t == eos)
                b["done"].copy_(finished.all()[None])
            tokens.index_copy_(1, n_gen, t[:, None])
            last.copy_(t)
            seq_t.add_(1)
            n_gen.add_(1)

        return step_
