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
        for done in sched.step():   # one round; the requests that finished in it
            ...

A scheduler runs a fixed set of target programs (``target=[...]``; a request names its own in
``Request.target``): their automata share one device table, α is per row, rewards are scored per
program. Constraints whose masks come from the host (llguidance) run the round eagerly
(host_masks.py). ``Engine.smc_sd`` is this loop with every request submitted at once
(:func:`run_batch`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from ...samplers.adaptive import group_statistics
from ...samplers.common import RewardTracker
from ...samplers.resampling import RESAMPLERS
from .host_masks import HostMasks, RequestMasks
from .kv_cache import PageTable
from .output import EngineOutput
from .smc import NEG_INF, Round, build_round, capture_round, host_terms, round_code
from .targets import CombinedAutomaton, DeviceAutomaton, EngineTarget, Settings


@dataclass
class Request:
    """One SMC-SD request: a prompt (token ids, at least 2) and its own settings."""

    prompt: list[int]
    particles: int
    block_size: int
    max_new_tokens: int
    draft_temperature: float = 1.0
    target_temperature: float = 1.0
    id: object = None
    target: EngineTarget | None = None  # one of the scheduler's programs (default: its first)


@dataclass
class Finished:
    """A finished request: its particles ([N, max_new_tokens] EOS-padded tokens), weights, log Ẑ and
    per-round ESS / resampling flags (of the rounds it was in)."""

    request: Request
    tokens: Tensor
    lengths: Tensor
    log_weights: Tensor
    log_evidence: float
    ess: list = field(default_factory=list)
    resampled: list = field(default_factory=list)
    rounds: int = 0
    joined_round: int = 0
    drafted: Tensor | None = None  # [N] tokens drafted in each row slot while unfinished
    weights: list = field(default_factory=list)  # per round, normalised [N_max] (record_weights)
    block_sizes: list = field(default_factory=list)  # per round, the K it ran with
    survivors: list = field(default_factory=list)  # per round, distinct ancestors kept (N: not resampled)


def _idle(b: dict, rows: slice) -> None:
    """Settings of rows no request holds: the round still runs over them (dead, never chosen), so
    they get a block size that fits every round shape (0: also the K = 0 rounds of a scheduler
    without drafts) and finite temperatures, power and budget."""
    for name in ("T_draft", "T_target", "alpha", "budget"):
        b[name][rows] = 1
    b["K_row"][rows] = 0


def _bucket(n: int, slots: int) -> int:
    return min(slots, 1 << max(0, (n - 1).bit_length()))


@dataclass
class _Rounds:
    """The full buffers of one scheduler shape and its captured rounds, by bucket."""

    full: Round
    by_bucket: dict = field(default_factory=dict)


class Scheduler:
    """Requests join between rounds and leave when finished (see the module docstring)."""

    @torch.inference_mode()
    def __init__(self, engine, *, slots: int, max_particles: int, max_block_size: int,
                 target: EngineTarget | list | None = None, eos_token_id: int | None = None,
                 resampler: str = "systematic", ess_threshold: float = 0.5, use_graphs: bool | None = None,
                 seed: int = 0, max_context: int | None = None, record_weights: bool = False, schedule=None):
        """``schedule`` (``samplers.adaptive``: FixedBlocks / AdaptiveBlocks) sets each request's K
        between rounds from its own past rounds, up to its ``block_size`` (slot g is the schedule's
        group g)."""
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
        self.max_context = max_context
        self.programs = list(target) if isinstance(target, (list, tuple)) else [target or EngineTarget()]
        dev = engine.device
        V = engine.target.cfg.vocab_size
        self.own: dict[int, list] = {}  # program id -> its device automata
        self.hosted: dict[int, list] = {}  # program id -> its host-mask constraints
        for t in self.programs:
            if not isinstance(t, EngineTarget):
                raise SMCDecodeError(f"target must be an EngineTarget or a list of them, got {type(t).__name__}")
            t.check()
            own, host = [], []
            for c in t.constraints:
                if c.model.vocab_size != V:
                    raise SMCDecodeError(f"constraint {c!r} is over a vocabulary of {c.model.vocab_size} tokens, "
                                         f"the engine's model has {V}: bind it to the model the engine runs")
                a = None if t.host_masks else DeviceAutomaton.of(c, dev)
                (own.append(a) if a is not None else host.append(c))
            self.own[id(t)], self.hosted[id(t)] = own, host
        n_slots = max(len(o) for o in self.own.values())
        self.combined = (CombinedAutomaton.of([a for o in self.own.values() for a in o], dev)
                         if n_slots else None)
        self.automata = [self.combined] * n_slots
        eager = any(self.hosted.values())
        if (self.automata or eager) and eos_token_id is None:
            raise SMCDecodeError("constraints allow EOS only in accepting states: pass eos_token_id")
        self.eos = -1 if eos_token_id is None else eos_token_id
        self.pad = max(self.eos, 0)
        use_graphs = engine.config.use_graphs if use_graphs is None else use_graphs
        self.use_graphs = use_graphs and not eager
        self.host = HostMasks(max_particles, V, dev) if eager else None
        self.resampler, self.tau = resampler, ess_threshold
        self.record_weights = record_weights
        self.plan = schedule.start(slots) if schedule is not None else None
        B = slots * max_particles
        PS = engine.page_size
        engine.ensure_rope(max_context + PS)
        self.table = PageTable(B, -(-max_context // PS) + 1, engine.num_pages, PS)
        self.cap = self.table.table.shape[1] * PS
        with_rewards = any(t.rewards for t in self.programs)
        key = ("smc", slots, max_particles, max_block_size, self.cap, self.eos, resampler, ess_threshold,
               self.use_graphs, n_slots, id(self.combined.table) if self.combined else None, with_rewards)
        rounds = None if eager else engine.graphs.get(key)
        if rounds is None:
            pt = torch.from_numpy(self.table.table).to(dev)
            rounds = _Rounds(build_round(engine, slots, max_particles, max_block_size, self.cap, pt, self.automata,
                                         self.eos, self.pad, resampler, ess_threshold,
                                         self.host if eager else None))
            if not eager:
                engine.graphs.put(key, rounds)
        self._rounds = rounds
        self.full = rounds.full
        b = self.full.buffers
        b["finished"].fill_(True)
        b["valid"].fill_(False)
        b["log_w"].fill_(NEG_INF)
        b["n"].fill_(1)
        b["seq"].fill_(1)
        _idle(b, slice(None))
        b["host_incr"].zero_()
        self.lens = np.ones(B, dtype=np.int64)  # target tokens cached per row (dead rows: 1)
        self.queue: deque[Request] = deque()
        self.requests: list[Request | None] = [None] * slots
        self.history: list[dict] = [{} for _ in range(slots)]
        # one reward tracker per program with rewards, and the rows its requests hold
        self.rewards = [(t, RewardTracker(t.rewards, t.decoder, B), torch.zeros(B, dtype=torch.bool))
                        for t in self.programs if t.rewards]
        self.round = 0
        self.host_s = 0.0
        pinned = dev.type == "cuda"
        self._packed = torch.empty(3 * B + 2 * slots + 1, dtype=torch.float64, pin_memory=pinned)
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
        need = len(request.prompt) + s.max_new_tokens[0] + self.Kmax + 2
        if len(request.prompt) < 2 or need > self.max_context:
            raise SMCDecodeError(f"prompt ({len(request.prompt)} tokens) must have at least 2 tokens and, with "
                                 f"max_new_tokens and a block, fit the engine's max_context "
                                 f"({self.max_context}; needs {need})")
        self._program(request)
        self.queue.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(r is not None for r in self.requests)

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
        b["pt"].copy_(torch.from_numpy(self.table.table))
        e.prefill_rows(e.target, e.kv_t, b["pt"], heads, [list(req.prompt[:-1]) for _, req in joining])
        if e.draft is not None:
            e.prefill_rows(e.draft, e.kv_d, b["pt"], heads, [list(req.prompt[:-2]) for _, req in joining])
        for g, req in joining:
            self._settings(g, req)

    def _settings(self, g: int, req: Request) -> None:
        """The request's rows: shared prompt pages and its settings in the round's buffers."""
        b, N, dev = self.full.buffers, self.Nmax, self.engine.device
        rows = np.arange(g * N, (g + 1) * N)
        ids = list(req.prompt)
        n = req.particles
        self.table.share_prefix(rows.tolist(), int(rows[0]))
        self.lens[rows] = len(ids) - 1
        r = slice(int(rows[0]), int(rows[-1]) + 1)
        valid = torch.arange(N, device=dev) < n
        b["seq"][r] = len(ids) - 1
        b["pending"][r] = torch.tensor(ids[-2:], device=dev)
        b["last"][r] = ids[-1]
        b["tokens"][r] = self.pad
        b["n_gen"][r] = 0
        b["drafted"][r] = 0
        b["budget"][r] = req.max_new_tokens
        b["K_row"][r] = req.block_size
        b["T_draft"][r] = float(req.draft_temperature)
        b["T_target"][r] = float(req.target_temperature)
        prog = self._program(req)
        b["alpha"][r] = prog.alpha
        b["valid"][r] = valid
        b["finished"][r] = ~valid
        b["log_w"][r] = torch.where(valid, 0.0, NEG_INF).double()
        b["n"][g] = n
        b["log_Z"][g] = 0.0
        own = self.own[id(prog)]
        for c, s in enumerate(b["states"]):
            s[r] = self.combined.initial_of(own[c]) if c < len(own) else 0
        if self.hosted[id(prog)]:
            self.host.add(g, RequestMasks(self.hosted[id(prog)], n, req.block_size, req.max_new_tokens))
        for t, tracker, mine in self.rewards:
            mine[r] = t is prog
            if t is prog:  # the prefix rewards' scores of the empty text, as a fresh tracker starts
                fresh = RewardTracker(tracker.rewards, tracker.model, len(rows))
                for i, v in fresh.prev.items():
                    tracker.prev[i][torch.from_numpy(rows)] = v
        self.requests[g] = req
        self.history[g] = {"ess": [], "resampled": [], "weights": [], "block_sizes": [], "survivors": [],
                           "joined": self.round}

    def _release(self, g: int) -> Finished:
        b, N = self.full.buffers, self.Nmax
        req = self.requests[g]
        n = req.particles
        r = slice(g * N, g * N + n)
        lw = b["log_w"][r].cpu().clone()  # (copies: the rows are reused)
        h = self.history[g]
        out = Finished(req, b["tokens"][r, : req.max_new_tokens].cpu().clone(), b["n_gen"][r].cpu().clone(), lw,
                       float(b["log_Z"][g].cpu() + torch.logsumexp(lw, 0) - math.log(n)),
                       h["ess"], h["resampled"], self.round - h["joined"], h["joined"],
                       drafted=b["drafted"][r].cpu().clone(), weights=h["weights"], block_sizes=h["block_sizes"],
                       survivors=h["survivors"])
        rows = np.arange(g * N, (g + 1) * N)
        self.table.free_rows(rows)
        self.lens[rows] = 1
        full = slice(g * N, (g + 1) * N)
        b["valid"][full] = False
        b["finished"][full] = True
        b["log_w"][full] = NEG_INF
        b["seq"][full] = 1
        _idle(b, full)
        b["n"][g] = 1
        for _, _, mine in self.rewards:
            mine[full] = False
        if self.host is not None:
            self.host.remove(g)
        self.requests[g] = None
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
                self._release(g)
                return True
        return False

    # -- rounds --------------------------------------------------------------------------------

    def _round(self, bucket: int, k: int):
        """The round over the first ``bucket`` slots with ``k`` draft steps (the largest block size
        among the requests in them)."""
        rnd = self._rounds.by_bucket.get((bucket, k)) if self.host is None else None
        if rnd is not None:
            return rnd
        R = bucket * self.Nmax
        full = self.full.buffers
        view = {}
        for name, v in full.items():
            if name == "states":
                view[name] = [s[:R] for s in v]
            elif name in ("n", "log_Z", "do", "ess", "W", "group_base"):
                view[name] = v[:bucket]
            elif name == "ar":
                view[name] = v[: k + 1]
            elif name == "done":
                view[name] = v
            elif name == "packed":
                view[name] = v[: 3 * R + 2 * bucket + 1]
            elif name in ("drafts", "log_q", "log_q_all"):
                view[name] = v[:R, :k]
            else:
                view[name] = v[:R]
        rnd = Round(view, None, None, keep=list(self.full.keep))
        rnd.propose_code, rnd.finish_code = round_code(self.engine, view, self.automata, self.eos, self.pad,
                                                         self.resampler, self.tau,
                                                         self.host)
        if self.use_graphs:
            # NOTE: capturing runs the round once (warm-up); save and restore every buffer around it
            saved = {name: (v.clone() if isinstance(v, Tensor) else [s.clone() for s in v])
                     for name, v in full.items()}
            # (and the random stream: a run draws the same whether its rounds were captured now or before)
            rng = torch.cuda.get_rng_state(self.engine.device)
            capture_round(self.engine, rnd, True, split=bool(self.rewards))
            torch.cuda.set_rng_state(rng, self.engine.device)
            for name, v in full.items():
                if isinstance(v, Tensor):
                    v.copy_(saved[name])
                else:
                    for s, o in zip(v, saved[name]):
                        s.copy_(o)
        else:
            capture_round(self.engine, rnd, False, split=bool(self.rewards))
        if self.host is None:
            self._rounds.by_bucket[(bucket, k)] = rnd
        return rnd

    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """Admit queued requests into free slots, run one round over the occupied bucket, release
        the requests that finished. Returns those requests."""
        t0 = time.perf_counter()
        joining = []
        for g in range(self.slots):
            if not self.queue:
                break
            if self.requests[g] is None:
                joining.append((g, self.queue.popleft()))
        if joining:
            self._admit(joining)
        occupied = [g for g, r in enumerate(self.requests) if r is not None]
        if not occupied:
            return []
        bucket = _bucket(max(occupied) + 1, self.slots)
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
        R = bucket * self.Nmax
        rows = np.arange(R)
        # pages for the rows of occupied slots (the rows of free slots write into the null page)
        held = np.concatenate([np.arange(g * self.Nmax, (g + 1) * self.Nmax) for g in occupied])
        copies = self.table.reserve(held, self.lens[held] + k + 1, write_from=self.lens[held] - 1)
        self.engine.upload(self.table, b["pt"], copies)
        rnd = self._round(bucket, k)
        self.host_s += time.perf_counter() - t0
        if self.host is not None:
            self.host.begin(R, k, rnd.buffers["drafts"])
        rnd.propose()
        if self.host is not None:
            self.host.end(rnd.buffers["bonus"])
        if self.rewards or self.host is not None:
            t1 = time.perf_counter()
            host_terms(rnd.buffers, [(tracker, mine[:R]) for _, tracker, mine in self.rewards], self.host, self.cap)
            self.host_s += time.perf_counter() - t1
        rnd.finish()
        weights = b["W"][:bucket].clone() if self.record_weights else None
        if self.plan is not None:
            stats = torch.stack([b["accept"], b["accept_n"], b["draft_lw"]]).cpu()
            self.plan.observe(group_statistics(stats[0], stats[1], stats[2], b["active"].cpu(), self.slots))
        n_packed = 3 * R + 2 * bucket + 1
        host = self._packed[:n_packed]
        host.copy_(b["packed"][:n_packed], non_blocking=True)
        if self._packed.is_pinned():
            torch.cuda.current_stream().synchronize()  # the round's one host sync
        t1 = time.perf_counter()
        h = host.numpy()
        self.round += 1
        index = np.arange(self.slots * self.Nmax)
        index[:R] = h[:R].astype(np.int64)
        self.lens[:R] = h[R : 2 * R].astype(np.int64)
        finished = h[2 * R : 3 * R].reshape(bucket, self.Nmax) > 0
        do, ess = h[3 * R : 3 * R + bucket] > 0, h[3 * R + bucket : 3 * R + 2 * bucket]
        self.table.fork(index)
        self.table.advance(rows, self.lens[:R])
        if not np.array_equal(index[:R], rows):
            idx_t = torch.from_numpy(index)
            for _, tracker, _ in self.rewards:
                tracker.fork(idx_t)
            if self.host is not None:
                self.host.fork(idx_t)
        done = []
        parents = index[:R].reshape(bucket, self.Nmax)
        for g in occupied:
            self.history[g]["ess"].append(float(ess[g]))
            self.history[g]["resampled"].append(bool(do[g]))
            self.history[g]["block_sizes"].append(K_now[g])
            n = self.requests[g].particles
            self.history[g]["survivors"].append(len(np.unique(parents[g, :n])))
            if weights is not None:
                self.history[g]["weights"].append(weights[g])
            if finished[g].all():
                done.append(self._release(g))
        self.host_s += time.perf_counter() - t1
        return done

    def run(self) -> list[Finished]:
        """Step until every submitted request has finished; results in completion order."""
        out = []
        while self.busy:
            out.extend(self.step())
        return out

    @property
    def peak_pages(self) -> int:
        return self.table.peak_used


def run_batch(engine, prompts: list[list[int]], settings: Settings, target, *, eos_token_id: int | None,
              resampler: str, ess_threshold: float, use_graphs: bool, seed: int,
              record_weights: bool = False, schedule=None) -> EngineOutput:
    """SMC-SD of ``prompts`` (each its own request, all submitted at once) with per-request
    ``settings`` and ``target`` (one EngineTarget or one per prompt). Returns an
    :class:`~smcdecode.backends.engine.output.EngineOutput` whose tensors are [G, N_max, ...] (rows
    j >= N_g of request g are padding: log w = -inf, length 0); its per-round lists hold one entry
    per request (NaN / False once a request has left)."""
    G = len(prompts)
    targets = list(target) if isinstance(target, (list, tuple)) else [target] * G
    if len(targets) != G:
        raise SMCDecodeError(f"target lists {len(targets)} programs for {G} prompts: give one or one per prompt")
    for t in targets:
        if not isinstance(t, EngineTarget):
            raise SMCDecodeError(f"target must be an EngineTarget (EngineTarget.of(LM(model) * ...)), got "
                                 f"{type(t).__name__}")
    programs = list({id(t): t for t in targets}.values())
    Nmax, Kmax = max(settings.particles), max(settings.block_size)
    longest_new = max(settings.max_new_tokens)
    context = engine.max_context or max(len(p) for p in prompts) + longest_new + Kmax + 2
    sched = Scheduler(engine, slots=G, max_particles=Nmax, max_block_size=Kmax, target=programs,
                      eos_token_id=eos_token_id, resampler=resampler, ess_threshold=ess_threshold,
                      use_graphs=use_graphs, seed=seed, max_context=context, record_weights=record_weights,
                      schedule=schedule)
    for g, p in enumerate(prompts):
        sched.submit(Request(list(p), settings.particles[g], settings.block_size[g], settings.max_new_tokens[g],
                             settings.draft_temperature[g], settings.target_temperature[g], id=g,
                             target=targets[g]))
    by_id = {f.request.id: f for f in sched.run()}
    done = [by_id[g] for g in range(G)]
    pad = sched.pad
    tokens = torch.full((G, Nmax, longest_new), pad, dtype=torch.long)
    lengths = torch.zeros(G, Nmax, dtype=torch.long)
    log_w = torch.full((G, Nmax), NEG_INF, dtype=torch.float64)
    drafted = torch.zeros(G, Nmax, dtype=torch.long)
    for g, f in enumerate(done):
        n, T = f.tokens.shape
        tokens[g, :n, :T] = f.tokens
        lengths[g, :n] = f.lengths
        log_w[g, :n] = f.log_weights
        drafted[g, :n] = f.drafted
    out = EngineOutput(tokens, lengths, log_w, torch.tensor([f.log_evidence for f in done], dtype=torch.float64))
    rounds = max(f.rounds for f in done)
    out.rounds = rounds
    for t in range(rounds):
        out.ess.append(np.array([f.ess[t] if t < len(f.ess) else math.nan for f in done]))
        out.resampled.append(np.array([f.resampled[t] if t < len(f.resampled) else False for f in done]))
        out.block_sizes.append(np.array([f.block_sizes[t] if t < len(f.block_sizes) else 0 for f in done]))
        out.survivors.append(np.array([f.survivors[t] if t < len(f.survivors) else f.log_weights.shape[0]
                                       for f in done]))
        if record_weights:
            out.weights.append(torch.stack([f.weights[t] if t < len(f.weights) else torch.zeros_like(f.weights[0])
                                            for f in done]))
    out.finished = torch.ones(G, Nmax, dtype=torch.bool)
    out.drafted = drafted
    out.peak_pages = sched.peak_pages
    out.host_s = sched.host_s
    out.particles = list(settings.particles)
    return out
