"""The fused SMC-SD round: the plain, uniform case of ``Engine.smc_sd`` (α = 1, no constraints or
rewards, one N, K, budget and temperature pair for every request).

Everything inside a round is tensor code on the device — drafting (exponential-race sampling, fused
with the log-sum-exp and the gather of log q(d) into one Triton kernel on CUDA), the verify pass,
incremental weights, ESS, the resampling decision, ancestor choice and the gather of every particle
field — so one round is one CUDA graph. The page bookkeeping (fork = page-table row copy,
copy-on-write of shared partial pages, fresh pages for the next K+1 tokens) runs at the end of that
graph too (``smc_pages``), on pages the host set aside for it before the launch; the host books the
same pages one round later (``PageTable``), while the next round already runs, so rounds are
launched back to back (``_rounds``).

Weights follow samplers/smc_sd.py with α = 1:
    log w += Σ_{i ≤ first EOS, i ≤ budget} [log p_T(d_i | ·) − log q(d_i | ·)]   (+ log Σ_v p_T(v)^α = 0)
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ...errors import SMCDecodeError
from ...samplers import steps
from ...samplers.resampling import get_resampler
from .graphs import Graph
from .kv_cache import KVPool, PageTable
from .output import EngineOutput
from .rounds import draft_block, round_buffers, round_graph, verify


def run(engine, prompts: list[list[int]], settings, *, eos_token_id: int | None, resampler: str,
        ess_threshold: float, use_graphs: bool, seed: int, record_weights: bool, pipeline: bool) -> EngineOutput:
    """SMC-SD of ``prompts`` with the uniform ``settings`` (``targets.Settings``); see ``Engine.smc_sd``."""
    particles, block_size, max_new_tokens = (settings.particles[0], settings.block_size[0],
                                             settings.max_new_tokens[0])
    draft_temperature, target_temperature = settings.draft_temperature[0], settings.target_temperature[0]
    torch.manual_seed(seed)
    G, N, K, dev = len(prompts), particles, block_size, engine.device
    B = G * N
    eos = -1 if eos_token_id is None else eos_token_id
    pad = max(eos, 0)
    first_round, _ = page_bounds(prompts, N, K, max_new_tokens, engine.page_size)
    if engine.num_pages < first_round:
        raise SMCDecodeError(
            f"num_pages ({engine.num_pages}) is too small for {G} request(s) × {N} particles: the first round "
            f"alone needs {first_round} pages of {engine.page_size} tokens; raise num_pages to at least "
            f"{first_round}")
    table, pt_start = engine.start(prompts, N, max_new_tokens + K + 2)
    cap = table.table.shape[1] * engine.page_size
    key = ("smc", G, N, K, draft_temperature, target_temperature, eos, resampler, ess_threshold,
           table.table.shape[1], use_graphs)
    rows = np.arange(B)
    lens = np.repeat([len(p) - 1 for p in prompts], N)  # target tokens cached per row
    copies = table.reserve(rows, lens + K + 1, write_from=lens - 1)  # first round's pages

    def make():
        buf = round_buffers(
            engine, pt_start, B, K, cap, pad,
            log_w=torch.zeros(B, dtype=torch.float64, device=dev),
            log_Z=torch.zeros(G, dtype=torch.float64, device=dev),
            index=torch.arange(B, device=dev), do=torch.zeros(G, dtype=torch.bool, device=dev),
            ess=torch.zeros(G, dtype=torch.float64, device=dev),
            group_base=(torch.arange(G, device=dev) * N)[:, None],
            W=torch.zeros(G, N, dtype=torch.float64, device=dev),
            # what the host reads of a round: ancestors, resampled, ESS, all finished
            packed=torch.zeros(B + 2 * G + 1, dtype=torch.float64, device=dev),
            # pages set aside for the end of the round: a row's copy-on-write page, then its new ones
            fresh=torch.zeros(B, 2 + (K + 1) // engine.page_size, dtype=torch.long, device=dev),
        )
        round_ = round_code(engine, buf, G, N, K, draft_temperature, target_temperature, eos, pad, resampler,
                            ess_threshold)
        pools = [kv for kv in (engine.kv_t, engine.kv_d) if kv is not None]
        pages = smc_pages(buf, G, N, K, pools, engine.page_size)

        def round_and_pages() -> None:
            round_()
            pages()

        return buf, round_and_pages

    graph = round_graph(engine, key, make, prompts, N, lens, max_new_tokens, pad, table, copies, use_graphs,
                        zero=("log_w", "log_Z", "fresh"))
    b = graph.buffers
    # NOTE: the warm-up also wrote KV entries, but every entry a round reads at or after
    # position T-1 is written earlier in that same round, so the first replay overwrites them.

    out = EngineOutput(b["tokens"], b["n_gen"], b["log_w"], b["log_Z"])
    n_rounds = -(-max_new_tokens // (K + 1))
    _rounds(engine, graph, out, table, G, N, K, lens, n_rounds, record_weights, pipeline)
    out.peak_pages = table.peak_used
    out.tokens = b["tokens"][:, :max_new_tokens].reshape(G, N, -1).clone()
    out.lengths = b["n_gen"].view(G, N).clone()
    out.log_weights = b["log_w"].view(G, N).clone()
    out.log_evidence = b["log_Z"] + torch.logsumexp(out.log_weights, 1) - math.log(N)
    out.finished = b["finished"].view(G, N).clone()
    out.drafted = b["drafted"].view(G, N).clone()
    out.particles = [N] * G
    return out


def page_bounds(prompts: list[list[int]], N: int, K: int, max_new_tokens: int, page_size: int) -> tuple[int, int]:
    """(pages the first round of the fused SMC-SD needs, pages it needs at most over the whole
    output), the null page included.

    Columns of a row before the page of its first write (position len(prompt) − 2) hold prompt
    pages that every particle of the request shares for ever; from that page on, a particle
    holds at most one page per column of its own. The first round's count is also the least
    that the bookkeeping ever needs (all particles still share the prompt pages); the
    pipelined rounds want about two rounds' fresh pages on top (``_rounds``; with fewer free
    they wait for the round in flight)."""
    PS = page_size
    n_rounds = -(-max_new_tokens // (K + 1))
    first_round, worst = 1, 1
    for p in prompts:
        cached = len(p) - 1
        shared = (cached - 1) // PS
        first_round += shared + N * (-(-(cached + K + 1) // PS) - shared)
        worst += shared + N * (-(-(cached + n_rounds * (K + 1)) // PS) - shared)
    return first_round, worst


def _rounds(engine, graph: Graph, out: EngineOutput, table: PageTable, G: int, N: int, K: int, lens: np.ndarray,
            n_rounds: int, record_weights: bool, pipeline: bool) -> None:
    """The rounds of the fused SMC-SD and their page bookkeeping.

    Pipelined (``pipeline``): before launching round r the host sets aside, per row, one page
    for a copy-on-write and the pages of the columns the next round opens (``PageTable.hold``;
    how many is known in advance: every row advances K + 1 positions a round), uploaded to
    ``fresh``; the round's graph forks the page table and uses them (``smc_pages``). Round r + 1
    is launched before round r's flags are read (its copy to pinned memory waited for with an
    event), and the host then books round r's fork and the same pages (``reserve(held=...)``)
    while round r + 1 runs. Pages that round r frees are handed out from round r + 2 on.

    A round without pages set aside (``pipeline`` False, the last round, or too few free pages
    even after reading the round in flight) gets none (the graph only forks); the host reads it
    before launching the next and books its pages as usual, uploading the page table and
    copying pages itself. Once a read round says that every particle has finished, a round
    launched after it ran as a no-op (``round_code``): its flags and weights are dropped."""
    b, B, PS = graph.buffers, G * N, engine.page_size
    rows = np.arange(B)
    F = b["fresh"].shape[1]
    pinned = engine.device.type == "cuda"
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
                    engine.upload(table, b["pt"], table.reserve(rows, T + K + 1, write_from=T - 1))
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


def round_code(engine, b: dict, G: int, N: int, K: int, draft_temperature: float, target_temperature: float,
               eos: int, pad: int, resampler: str, ess_threshold: float):
    """The device code of one SMC-SD round over the static buffers ``b`` (captured as one graph)."""
    get_resampler(resampler)  # (refuses an unknown name before capture)
    dev = engine.device
    ar = b["ar"]
    seq_t, pending, last, tokens, n_gen = b["seq"], b["pending"], b["last"], b["tokens"], b["n_gen"]
    finished, log_w, log_Z, drafts, log_q = b["finished"], b["log_w"], b["log_Z"], b["drafts"], b["log_q"]

    def round_() -> None:
        seeds = torch.randint(0, 2**62, (K + 1,), device=dev)
        draft_block(engine, b, K, draft_temperature, seeds)
        log_p, bonus, _ = verify(engine, b, K, target_temperature, seeds)

        remaining = b["budget"] - n_gen
        incr, n_new, any_eos, has_bonus = steps.weigh(log_p, log_q, drafts, 1.0, remaining.clamp(max=K), eos,
                                                      bonus_allowed=remaining > K)
        active = ~finished
        b["drafted"].add_(torch.where(active, remaining.clamp(max=K), 0))
        block = torch.cat([drafts, bonus[:, None]], dim=1)
        block = torch.where((ar[None] < n_new[:, None]) & active[:, None], block, pad)
        tokens.scatter_(1, n_gen[:, None] + ar, block)
        n_gen.add_(torch.where(active, n_new, 0))
        lw = torch.where(active, log_w + incr, log_w)
        hit_eos = any_eos | (has_bonus & (bonus == eos))
        finished.copy_(finished | (active & (hit_eos | (n_gen >= b["budget"]))) | torch.isneginf(lw))
        pending.copy_(torch.stack([drafts[:, -1], bonus], dim=1))
        last.copy_(bonus)

        live = (~finished).view(G, N).any(1)
        A, do, W, ess, log_Z_incr, lw = steps.resample(lw.view(G, N), ess_threshold, resampler, live=live)
        idx = (A + b["group_base"]).flatten()
        log_Z.add_(log_Z_incr)
        log_w.copy_(lw.flatten())
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


def smc_pages(b: dict, G: int, N: int, K: int, pools: list[KVPool], page_size: int):
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
    PS, dev = page_size, b["pt"].device
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
