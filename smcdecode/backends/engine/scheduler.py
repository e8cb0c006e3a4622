"""The engine's request loop for SMC-SD: requests join between rounds, finished requests leave.

A :class:`Scheduler` owns ``slots`` request slots of ``max_particles`` rows each (rows of slot g:
g·N_max … g·N_max + N_max − 1) in the static buffers of :mod:`smc`. Between rounds it admits queued
requests into free slots (lowest first: prefill the prompts once, batched, share their pages with
each request's rows, write the request's per-row settings into the buffers) and releases requests
whose particles have all finished (their pages are freed, the rows become dead padding). Each round
runs over the first ``bucket`` slots only, ``bucket`` the smallest power of two covering every
occupied slot: one captured graph per bucket, each over views of the same buffers, so the slots past
the last occupied one cost nothing. The buffers and graphs are kept in the engine's graph cache and
reused by later schedulers of the same shape.

    sched = Scheduler(engine, slots=8, max_particles=8, max_block_size=4, eos_token_id=eos)
    sched.submit(Request(prompt_ids, particles=8, block_size=4, max_new_tokens=64))
    while sched.busy:
        finished = sched.step()   # one round; the requests that finished (in the round read)

Pipelined rounds (one K for every request, no reward or schedule): the host sets pages aside before
the launch, the round's graph forks the page table and places them (``smc.pages_code``), and ``step``
launches round r + 1 before it reads round r, booking the same pages while round r + 1 runs (with
host masks before its first host point; superset checks: before the host checks its tokens). A
request whose particles all finished in round r leaves after round r + 1's launch (a no-op for its
rows); its outputs reach the host without waiting for that round (``_collect``).

A scheduler runs a fixed set of target programs (``target=[...]``; a request names its own in
``Request.target``): their automata share one device table, α is per row, rewards are scored per
program. Constraints whose masks come from the host (llguidance) give the proposal host points,
where the device waits for the host's masks of that step; on the superset path the host checks the
proposal's tokens before the resampling instead (host_masks.py). ``Engine.smc_sd`` is this loop with every request
submitted at once (``batch.run_batch``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import numpy as np
import torch

from ...errors import SMCDecodeError
from ...samplers.adaptive import group_statistics
from ...samplers.common import RewardTracker
from ...samplers.resampling import RESAMPLERS
from . import prefill
from .exact import launches
from .host_masks import HostMasks, RequestMasks
from .kv_cache import PageTable
from .requests import (
    Finished,
    Flight,
    Leaving,
    Request,
    Rounds,
    bucket_of,
    bucket_views,
    check_exact,
    check_fits,
    idle_settings,
    program_constraints,
    request_settings,
    rows_of,
)
from .smc import Round, build_round, capture_round, round_code, run_round
from .targets import CombinedAutomaton, EngineTarget, Settings


class Scheduler:
    """Requests join between rounds and leave when finished (see the module docstring)."""

    @torch.inference_mode()
    def __init__(self, engine, *, slots: int, max_particles: int, max_block_size: int,
                 target: EngineTarget | list | None = None, eos_token_id: int | None = None,
                 resampler: str = "systematic", ess_threshold: float = 0.5, use_graphs: bool | None = None,
                 seed: int = 0, max_context: int | None = None, record_weights: bool = False, schedule=None,
                 pipeline: bool | None = None, shrink: bool = True, speculative: bool = False,
                 exact_only: bool = False, batched_prefill: bool = True):
        """``schedule`` (``samplers.adaptive``: FixedBlocks / AdaptiveBlocks) sets each request's K
        between rounds from its own past rounds, up to its ``block_size`` (slot g is the schedule's
        group g). ``pipeline`` (default: with CUDA graphs) launches a round before the host reads the
        one before it, where the round allows (``_pipelined``): the same outputs, without the host's
        bookkeeping between rounds on the device's time. ``shrink`` False runs every round over all
        slots (one round shape for a batch submitted at once: no capture when its last slots leave,
        and the same draws pipelined or not). ``speculative`` lets requests ask for exact speculative
        decoding (``Request(exact=True)``: unconstrained, accepted drafts then a draw from (p − q)+ at
        the first rejection), in the same rounds as the SMC-SD requests; ``exact_only`` takes those
        requests alone, in the round of exact.py (no weights, statistics, resampling or page forks):
        with max_block_size 0 and no draft, autoregressive sampling (``Request(exact=True,
        block_size=0)``: prompts of one token too). ``batched_prefill`` False prefills each prompt in
        a forward of its own length (the reference the bucketed prefill is tested against)."""
        if engine.draft is None and max_block_size != 0:
            raise SMCDecodeError("SMC-SD with drafted tokens needs a draft model: Engine(target, draft, ...), or "
                                 "max_block_size=0 (the target as proposal: one token a round)")
        max_context = max_context or engine.max_context
        if max_context is None:
            raise SMCDecodeError("a Scheduler needs max_context (or an engine with a fixed max_context)")
        for name, v, least in (("slots", slots, 1), ("max_particles", max_particles, 1),
                               ("max_block_size", max_block_size, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise SMCDecodeError(f"{name} must be an integer >= {least}, got {v!r}")
        if resampler not in RESAMPLERS:
            raise SMCDecodeError(f"unknown resampler {resampler!r}: choose one of {sorted(RESAMPLERS)}")
        self.engine, self.slots, self.Nmax, self.Kmax = engine, slots, max_particles, max_block_size
        self.speculative, self.exact_only = speculative or exact_only, exact_only
        if speculative and (engine.draft is None or max_block_size < 1):
            raise SMCDecodeError("speculative=True needs a draft model and max_block_size >= 1")
        if exact_only and schedule is not None:
            raise SMCDecodeError("exact_only=True takes no schedule: its round keeps no draft statistics")
        self.max_context = max_context
        self.programs = list(target) if isinstance(target, (list, tuple)) else [target or EngineTarget()]
        dev = engine.device
        V = engine.target.cfg.vocab_size
        # program id -> its device automata, and its host-mask constraints
        self.own, self.hosted = program_constraints(self.programs, V, dev)
        n_slots = max(len(o) for o in self.own.values())
        self.combined = (CombinedAutomaton.of([a for o in self.own.values() for a in o], dev)
                         if n_slots else None)
        self.automata = [self.combined] * n_slots
        hosted = any(self.hosted.values())
        if (self.automata or hosted) and eos_token_id is None:
            raise SMCDecodeError("constraints allow EOS only in accepting states: pass eos_token_id")
        self.eos = -1 if eos_token_id is None else eos_token_id
        self.pad = max(self.eos, 0)
        self.use_graphs = engine.config.use_graphs if use_graphs is None else use_graphs
        self.resampler, self.tau = resampler, ess_threshold
        self.record_weights = record_weights
        self.plan = schedule.start(slots) if schedule is not None else None
        B = slots * max_particles
        PS = engine.page_size
        engine.ensure_rope(max_context + PS)
        self.table = PageTable(B, -(-max_context // PS) + 1, engine.num_pages, PS)
        self.cap = self.table.table.shape[1] * PS
        with_rewards = any(t.rewards for t in self.programs)
        # NOTE: a scheduler that never drafts (K = 0 and no schedule: autoregressive sampling) leaves
        # the draft out of its rounds; one that may draft later feeds it every round (smc.py)
        self.drafts = engine.draft is not None and (max_block_size > 0 or schedule is not None)
        key = ("ar" if exact_only and not self.drafts else "sd" if exact_only else "smc", slots, max_particles, max_block_size, self.cap, self.eos, resampler, ess_threshold,
               self.use_graphs, n_slots, id(self.combined.table) if self.combined else None, with_rewards,
               self.speculative, self.drafts, exact_only, hosted)
        rounds = engine.graphs.get(key)
        if rounds is None:
            pt = torch.from_numpy(self.table.table).to(dev)
            rounds = Rounds(build_round(engine, slots, max_particles, max_block_size, self.cap, pt, self.automata,
                                         self.eos, self.pad, resampler, ess_threshold, hosted, self.speculative,
                                         self.drafts, exact_only),
                            host=HostMasks(max_particles, V, dev, rows=slots * max_particles,
                                           k_max=max_block_size, workers=engine.config.host_workers) if hosted else None)
            engine.graphs.put(key, rounds)
        self._rounds = rounds
        self.host = rounds.host
        if self.host is not None:
            self.host.clear()
            self.host.eos = self.eos
        self.full = rounds.full
        b = self.full.buffers
        idle_settings(b, slice(None), slice(None))
        b["host_incr"].zero_()
        self.lens = np.ones(B, dtype=np.int64)  # target tokens cached per row (dead rows: 1)
        self.t_end = np.zeros(slots, dtype=np.int64)
        self.queue: deque[Request] = deque()
        self.requests: list[Request | None] = [None] * slots
        self.history: list[dict] = [{} for _ in range(slots)]
        # one reward tracker per program with rewards, and the rows its requests hold
        self.rewards = [(t, RewardTracker(t.rewards, t.decoder, B), torch.zeros(B, dtype=torch.bool))
                        for t in self.programs if t.rewards]
        self.round = 0  # rounds read
        self.launched = 0  # rounds launched (pipelined: one more than read while one is in flight)
        self.host_s = 0.0
        # rounds launched but not read yet (pipelined: one launched ahead) and finished requests whose
        # outputs are on their way to the host
        self.pipeline, self.shrink = (self.use_graphs if pipeline is None else pipeline), shrink
        self.batched_prefill, self._flights, self._leaving, self._steps = batched_prefill, [], [], 0
        # (inside a launch with host points: requests that ended in the round read there are released
        # after the host's last point, since releasing uploads to the device, which waits for it)
        self._leaving_late: list[int] | None = None
        pinned, self._parity = dev.type == "cuda", 0
        self._host_packed = torch.empty(2, 3 * B + 2 * slots + 1, dtype=torch.float64, pin_memory=pinned)
        self._stage = torch.zeros(2, B, b["fresh"].shape[1], dtype=torch.long, pin_memory=pinned)
        self._fresh_set = True  # (``fresh`` may hold an earlier scheduler's pages: ``_give_none``)
        torch.manual_seed(seed)

    # -- requests ------------------------------------------------------------------------------

    def _program(self, request: Request) -> EngineTarget:
        if request.target is None:
            return self.programs[0]
        for t in self.programs:
            if t is request.target:
                return t
        raise SMCDecodeError("request.target is not one of the scheduler's programs: pass it in "
                             "Scheduler(target=[...]) (the automata of every program share one device table)")

    @torch.inference_mode()
    def submit(self, request: Request) -> None:
        """Queue a request; it joins at the start of a round when a slot is free."""
        s = Settings.of(1, request.particles, request.block_size, request.max_new_tokens,
                        request.draft_temperature, request.target_temperature)
        if request.particles > self.Nmax:
            raise SMCDecodeError(f"particles ({request.particles}) exceeds the scheduler's max_particles "
                                 f"({self.Nmax}): raise max_particles")
        if request.block_size > self.Kmax:
            raise SMCDecodeError(f"block_size ({request.block_size}) exceeds the scheduler's max_block_size "
                                 f"({self.Kmax}): raise max_block_size")
        check_fits(request, s.max_new_tokens[0] + self.Kmax + 2, self.max_context, 2 if self.drafts else 1)
        check_exact(request, self._program(request), self.speculative, self.exact_only, self.Kmax)
        self.queue.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self._leaving or self._flights) or any(r is not None for r in self.requests)

    def _admit(self, joining: list[tuple[int, Request]]) -> None:
        """Requests into free slots: one batched prefill of all their prompts (target and draft)."""
        e, b, N = self.engine, self.full.buffers, self.Nmax
        heads = []
        for g, req in joining:
            rows = np.arange(g * N, (g + 1) * N)
            self.table.free_rows(rows)
            self.table.reserve(rows[:1], np.array([len(req.prompt) - 1]))
            self.table.advance(rows[:1], np.array([len(req.prompt) - 1]))
            heads.append(g * N)
        e.upload(self.table, b["pt"], ([], []), rows=self._rows([g for g, _ in joining]))
        for model, kv, cut in ((e.target, e.kv_t, 1), (e.draft if self.drafts else None, e.kv_d, 2)):
            seqs = [list(req.prompt[:-cut]) for _, req in joining]
            if model is None:
                continue
            if self.batched_prefill:
                e.prefill_rows(model, kv, b["pt"], heads, seqs)
            else:
                for row, ids in zip(heads, seqs):
                    prefill.prefill_unpadded(model, kv, b["pt"], row, ids, e.page_size)
        for g, req in joining:
            self._settings(g, req)
        # rows of exact speculative decoding move on by what they accept, which the host learns only
        # after the round: their pages for the whole output are reserved now (they never fork), so
        # the rounds need no pages of theirs booked ahead and stay pipelined (the draft writes from
        # position T−1 on, the target from T)
        exact = [g for g, req in joining if req.exact]
        if exact:
            rows = self._rows(exact)
            need = np.repeat([self.t_end[g] + self.Kmax + 2 for g in exact], N)
            copies = self.table.reserve(rows, need, write_from=self.lens[rows] - int(self.drafts))
            e.upload(self.table, b["pt"], copies, rows=rows)

    def _settings(self, g: int, req: Request) -> None:
        """The request's rows: shared prompt pages and its settings in the round's buffers."""
        b, N, n = self.full.buffers, self.Nmax, req.particles
        rows = np.arange(g * N, (g + 1) * N)
        self.table.share_prefix(rows.tolist(), int(rows[0]))
        self.lens[rows] = len(req.prompt) - 1
        self.t_end[g] = len(req.prompt) - 1 + req.max_new_tokens  # its position once its budget is spent
        r = slice(int(rows[0]), int(rows[-1]) + 1)
        prog = self._program(req)
        request_settings(b, r, g, req, prog.alpha, self.pad)
        own = self.own[id(prog)]
        for c, s in enumerate(b["states"]):
            s[r] = self.combined.initial_of(own[c]) if c < len(own) else 0
        if self.hosted[id(prog)]:
            self.host.add(g, RequestMasks(self.hosted[id(prog)], n, req.block_size, req.max_new_tokens,
                                          lane=g * self.Nmax, checks=not prog.host_masks))
        for t, tracker, mine in self.rewards:
            mine[r] = t is prog
            if t is prog:  # the prefix rewards' scores of the empty text, as a fresh tracker starts
                fresh = RewardTracker(tracker.rewards, tracker.model, len(rows))
                for i, v in fresh.prev.items():
                    tracker.prev[i][torch.from_numpy(rows)] = v
        self.requests[g] = req
        self.history[g] = {"ess": [], "resampled": [], "weights": [], "block_sizes": [], "survivors": [],
                           "joined": self.launched}

    def _release(self, g: int, keep: bool = True) -> None:
        """Free slot g: its pages, its rows' settings; with ``keep`` its outputs start their way to
        the host (``_collect`` hands them out once there, without waiting for a round in flight)."""
        b, N, req = self.full.buffers, self.Nmax, self.requests[g]
        if keep:
            self._leaving.append(Leaving.start(b, g, N, req, self.history[g], self._steps,
                                               self._host_packed.is_pinned()))
        rows = np.arange(g * N, (g + 1) * N)
        self.table.free_rows(rows)
        self.engine.upload(self.table, b["pt"], ([], []), rows=rows)  # (idle rows write to the null page)
        self.lens[rows] = 1
        full = slice(g * N, (g + 1) * N)
        idle_settings(b, full, slice(g, g + 1))
        for _, _, mine in self.rewards:
            mine[full] = False
        if self.host is not None:
            self.host.remove(g)
        self.requests[g] = None

    def _collect(self, wait_all: bool) -> list[Finished]:
        """The released requests whose outputs reached the host: released in an earlier step, or all."""
        out, left = [], []
        for lv in self._leaving:
            if not (wait_all or lv.step < self._steps):
                left.append(lv)
                continue
            out.append(lv.finished())
        self._leaving = left
        return out

    @torch.inference_mode()
    def cancel(self, request_id) -> bool:
        """Drop the request with this ``id`` (queued or running: its rows and pages are freed at
        once). Returns whether one was found."""
        for r in list(self.queue):
            if r.id == request_id:
                self.queue.remove(r)
                return True
        for g, r in enumerate(self.requests):
            if r is not None and r.id == request_id:
                self._release(g, keep=False)
                return True
        return False

    # -- rounds --------------------------------------------------------------------------------

    def _round(self, bucket: int, k: int):
        """The round over the first ``bucket`` slots with ``k`` draft steps (the largest block size
        among the requests in them); with host points where a request's masks come from the host."""
        masked = self.host is not None and self.host.masked
        rnd = self._rounds.by_bucket.get((bucket, k, masked))
        if rnd is not None:
            return rnd
        full = self.full.buffers
        view = bucket_views(full, bucket, k, self.Nmax)
        rnd = Round(view, None, None, keep=list(self.full.keep))
        # (the host's work between the proposal and the resampling: rewards, checked requests' tokens)
        split, host = bool(self.rewards) or self.host is not None, (self.host if masked else None)
        rnd.propose_code, rnd.finish_code = round_code(self.engine, view, self.automata, self.eos, self.pad,
                                                         self.resampler, self.tau, host, self.drafts,
                                                         self.exact_only)
        # NOTE: capturing runs the round once (warm-up); save and restore every buffer around it, and
        # the random stream (a run draws the same whether its rounds were captured now or before)
        if self.use_graphs:
            saved = {name: [t.clone() for t in (v if isinstance(v, list) else [v])] for name, v in full.items()}
            cuda = self.engine.device.type == "cuda"
            rng = torch.cuda.get_rng_state(self.engine.device) if cuda else torch.get_rng_state()
        capture_round(self.engine, rnd, self.use_graphs, split=split, host=host)
        if self.use_graphs:
            torch.cuda.set_rng_state(rng, self.engine.device) if cuda else torch.set_rng_state(rng)
            for name, v in full.items():
                for t, o in zip(v if isinstance(v, list) else [v], saved[name]):
                    t.copy_(o)
        self._rounds.by_bucket[(bucket, k, masked)] = rnd
        return rnd

    def _shape(self, occupied: list[int]) -> tuple[int, int, dict]:
        """(bucket, k, K of each occupied slot) of the next round."""
        bucket = bucket_of(max(occupied) + 1, self.slots) if self.shrink else self.slots
        b = self.full.buffers
        # NOTE: the round's shape follows the largest block size present, so requests with a
        # small K stop paying for a large one once the requests that asked for it have left
        K_now = {g: self.requests[g].block_size for g in occupied}
        k = max(K_now.values())
        if self.plan is not None:  # this round's K of each request, from its past rounds
            chosen = self.plan.next()
            K_now = {g: min(int(chosen[g]), self.requests[g].block_size) for g in occupied}
            # (the round drafts for the statistics even when every K is 0: a probe costs the draft)
            k = max(max(K_now.values()), int(bool(self.plan.probing[occupied].any())))
            for g, kg in K_now.items():
                b["K_row"][g * self.Nmax : (g + 1) * self.Nmax] = kg
                if self.host is not None and g in self.host.requests:
                    self.host.requests[g].K = kg
        return bucket, k, K_now

    def _rows(self, groups) -> np.ndarray:
        return rows_of(groups, self.Nmax)

    def _pipelined(self, bucket: int, k: int, K_now: dict, joined: bool) -> bool:
        """Whether this round can be launched before the one in flight is read: its graph exists,
        every request drafts k tokens (so every row's pages for the next round are known before
        this one ends) or is exact, and no rewards or schedule need the round before first. With
        host masks the host reads the round before between the launch and its first host point
        (the device waits there), and no request joined (its constraints compile before a launch)."""
        masked = self.host is not None and self.host.masked
        return (self.pipeline and not (masked and joined) and not self.rewards
                and self.plan is None and (bucket, k, masked) in self._rounds.by_bucket
                # (exact rows hold their pages from admission on: any K)
                and all(v == k or self.requests[g].exact for g, v in K_now.items()))

    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """Admit queued requests into free slots, launch one round over the occupied bucket, read
        the round before it (pipelined) or this one, release the requests that finished in the
        round read. Returns those requests. (Exact-only rounds run without PDL: ``exact.launches``.)"""
        with launches() if self.exact_only else contextlib.nullcontext():
            return self._step()

    def _step(self) -> list[Finished]:
        t0 = time.perf_counter()
        self._steps += 1
        free = [g for g in range(self.slots) if self.requests[g] is None]
        joining = [(g, self.queue.popleft()) for g in free[: len(self.queue)]]
        if joining:
            self._end_host()  # (the host's end of the round in flight covers the requests in it alone)
            self._admit(joining)
        occupied = [g for g, r in enumerate(self.requests) if r is not None]
        if not occupied:
            self._drain()
            return self._collect(wait_all=True)
        bucket, k, K_now = self._shape(occupied)
        pipelined = self._pipelined(bucket, k, K_now, bool(joining))
        if self._flights and not (pipelined and self._flights[-1].held is not None):
            self._drain()  # (requests may have left)
            occupied = [g for g, r in enumerate(self.requests) if r is not None]
            if not occupied:
                return self._collect(wait_all=True)
            bucket, k, K_now = self._shape(occupied)
            pipelined = self._pipelined(bucket, k, K_now, bool(joining))
        b = self.full.buffers
        R = bucket * self.Nmax
        # pages for this round's writes: every occupied row's, or (a round in flight placed the
        # pages of its rows) the rows of requests that joined since
        # (a slot whose request left after that round's launch and that another request took since
        # is not among them)
        last = self._flights[-1] if self._flights else None
        ahead = {g for g in last.groups if self.requests[g] is last.requests[g]} if last else set()
        if ahead and all(g in ahead and not self.requests[g].exact and self.lens[g * self.Nmax] + k + 1 >= self.t_end[g]
                         for g in occupied):
            self._drain()  # every request spends its budget in the round in flight
            return self._collect(wait_all=True)
        # (rows of exact speculative decoding hold their pages from admission on)
        book = self._rows([g for g in occupied if g not in ahead and not self.requests[g].exact])
        copies = self.table.reserve(book, self.lens[book] + k + 1, write_from=self.lens[book] - 1) if len(book) else ([], [])
        self.engine.upload(self.table, b["pt"], copies, rows=self._rows(sorted(set(occupied) - ahead))
                           if ahead else None)
        rnd = self._round(bucket, k)
        held = self._give(occupied, ahead, k, R) if pipelined else self._give_none()
        # (not waited for where the round in flight's bonus masks left a row without EOS: it goes on)
        if (held is not None and ahead.issuperset(occupied)
                and not (self._flights[-1].ends is not None and self.host.continuing) and self._ended(self._flights[-1])):
            self.table.unhold(held.reshape(-1))  # (every request ended in the round in flight: no round after it)
            self._drain()
            return self._collect(wait_all=True)
        self.host_s += time.perf_counter() - t0
        # (host checks: the round in flight is read while the proposal runs, before the check needs it)
        checks = self.host is not None and bool(self.host.requests) and bool(self._flights)
        self._launch(rnd, bucket, k, occupied, K_now, held, (lambda: self._read(held)) if checks else None)
        if held is None or (not checks and len(self._flights) > 1):
            t1 = time.perf_counter()
            self._read() if held is not None else self._drain()
            self.host_s += time.perf_counter() - t1
        return self._collect(wait_all=not self._flights)

    def _ended(self, f: Flight) -> bool:
        """Whether every row of the round in flight ``f`` finished, where rows may end before their
        budget (EOS, constraints): waits for that round, so a pipelined round is never launched
        after the last one that does work (the device idles only for the launch)."""
        if self.eos < 0 and not self.automata:
            return False
        if f.event is not None:
            f.event.synchronize()
        return bool(self._host_packed[f.parity, 3 * f.bucket * self.Nmax + 2 * f.bucket] > 0)

    def _give_none(self) -> None:
        """No pages set aside for the end of the round about to launch: ``fresh`` all zeros (pages an
        earlier round was given, this scheduler's or one before it on these buffers, are booked by now)."""
        if self._fresh_set:
            self.full.buffers["fresh"].zero_()
            self._fresh_set = False

    def _give(self, occupied: list[int], ahead: set, k: int, R: int) -> np.ndarray | None:
        """Set pages aside for the end of the round about to launch (the pages of the round after
        it) and upload them to ``fresh``; None (zeros uploaded) when too few pages are free."""
        b, rows = self.full.buffers, self._rows(occupied)
        slot = rows // self.Nmax
        T = self.lens[rows] + np.where(np.isin(slot, list(ahead)), k + 1, 0) + k + 1  # after it
        # (no round after it where its budget is spent; exact rows hold their pages from admission on)
        done = (T >= self.t_end[slot]) | np.isin(slot, [g for g in occupied if self.requests[g].exact])
        held = self.table.set_aside(rows, T, k, done, b["fresh"].shape[1])
        stage = self._stage[self._parity]
        stage.numpy()[:R] = 0 if held is None else held[:R]
        b["fresh"][:R].copy_(stage[:R], non_blocking=True)
        self._fresh_set = True
        return held

    def _launch(self, rnd, bucket: int, k: int, occupied: list[int], K_now: dict, held, meanwhile=None) -> None:
        b, R, host = self.full.buffers, bucket * self.Nmax, self.host
        requests = {g: self.requests[g] for g in occupied}  # (as launched: ``meanwhile`` may release some)
        before_points = meanwhile
        if host is not None and rnd.hosted:  # (host points: the round before ends on the host after the launch)
            host.prepare(R, k, handed=True)

            def before_points() -> None:  # (the read of the round before, then this round's start)
                if meanwhile is not None:
                    meanwhile()
                host.begin(R, k, rnd.buffers["drafts"], handed=True)
            self._leaving_late = []
        elif host is not None:
            self._end_host()
            host.begin(R, k, rnd.buffers["drafts"], handed=True)
        try:
            seconds, ends = run_round(rnd, host, [(tracker, mine[:R]) for _, tracker, mine in self.rewards], k,
                                      self.cap, meanwhile=before_points)
        except BaseException:
            with contextlib.suppress(Exception):  # (the pages set aside go back; the original error propagates)
                self._release_late()
                if held is not None:
                    self.table.unhold(held.reshape(-1))
            raise
        self._release_late()
        self.host_s += seconds
        if self.plan is not None:
            stats = torch.stack([b["accept"], b["accept_n"], b["draft_lw"]]).cpu()
            self.plan.observe(group_statistics(stats[0], stats[1], stats[2], b["active"].cpu(), self.slots))
        n_packed = 3 * R + 2 * bucket + 1
        p = self._parity
        self._host_packed[p, :n_packed].copy_(b["packed"][:n_packed], non_blocking=True)
        event = None
        if self._host_packed.is_pinned():
            event = torch.cuda.Event()
            event.record()
        self._flights.append(Flight(p, bucket, k, list(occupied), requests, dict(K_now), held, event,
                                     b["W"][:bucket].clone() if self.record_weights else None,
                                     rnd.buffers["bonus"] if ends else None))
        self._parity ^= 1
        self.launched += 1

    def _release_late(self) -> None:
        late, self._leaving_late = self._leaving_late or [], None
        for g in late:
            self._release(g)

    def _drain(self) -> None:
        while self._flights:
            self._read()

    def _end_host(self, f: Flight | None = None) -> None:
        """The host's end of round ``f`` (default: the last launched), where still due (``run_round``)."""
        f = f or (self._flights[-1] if self._flights else None)
        if f is not None and f.ends is not None:
            self.host.end(f.ends)
            f.ends = None

    def _read(self, next_held=None) -> None:
        """Read the oldest round in flight: book its forks and pages on the host, record the requests'
        statistics, release those whose particles all finished. ``next_held``: the pages set aside for
        the round launched after it (read while its proposal runs), else the next flight's."""
        f = self._flights.pop(0)
        self._end_host(f)  # (its drafts and bonus consumed: before its forks)
        if f.event is not None:
            f.event.synchronize()
        R, bucket, N = f.bucket * self.Nmax, f.bucket, self.Nmax
        h = self._host_packed[f.parity, : 3 * R + 2 * bucket + 1].numpy()
        index = np.arange(self.slots * N)
        index[:R] = h[:R].astype(np.int64)
        T = h[R : 2 * R].astype(np.int64)
        finished = h[2 * R : 3 * R].reshape(bucket, N) > 0
        do, ess = h[3 * R : 3 * R + bucket] > 0, h[3 * R + bucket : 3 * R + 2 * bucket]
        # a request cancelled since the launch: its rows were freed (another may hold them now)
        stale = [g for g in f.groups if self.requests[g] is not f.requests[g]]
        for g in stale:
            index[g * N : (g + 1) * N] = np.arange(g * N, (g + 1) * N)
        groups = [g for g in f.groups if g not in stale]
        self.round += bool(groups)  # (a round launched after its requests all ended did nothing)
        self.table.fork(index)
        gone = [g for g in groups if finished[g].all()]
        live = self._rows([g for g in groups if not finished[g].all()])
        self.lens[live] = T[live]
        self.table.advance(live, T[live])
        if f.held is not None:  # mirror the pages the round's graph placed; return the unused ones
            k = f.k
            booked = self._rows([g for g in groups if not finished[g].all() and not f.requests[g].exact])
            if len(booked):
                self.table.reserve(booked, T[booked] + k + 1, write_from=T[booked] - 1, held=f.held[booked])
            out = self._rows(gone)
            self.table.unhold(f.held[self._rows(gone + stale)].reshape(-1))
            nxt = next_held if next_held is not None else (self._flights[0].held if self._flights else None)
            if nxt is not None:  # (the round launched after it left these requests' rows alone)
                self.table.unhold(nxt[out].reshape(-1))
                nxt[out] = 0
        if not np.array_equal(index[:R], np.arange(R)):
            idx_t = torch.from_numpy(index)
            for _, tracker, _ in self.rewards:
                tracker.fork(idx_t)
            if self.host is not None:
                self.host.fork(index)
        parents = index[:R].reshape(bucket, N)
        for g in groups:
            f.record(self.history[g], g, float(ess[g]), bool(do[g]), None if self.exact_only else parents[g])
            if g in gone:
                if self._leaving_late is not None:
                    self._leaving_late.append(g)
                else:
                    self._release(g)

    def run(self) -> list[Finished]:
        """Step until every submitted request has finished; results in completion order."""
        out = []
        while self.busy:
            out.extend(self.step())
        return out

    @property
    def peak_pages(self) -> int:
        return self.table.peak_used
