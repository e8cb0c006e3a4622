"""The GPU engine behind the server: continuous batching of SMC-SD and autoregressive requests.

One device thread owns the engines. Plain SMC requests (no constraint, no seed, the server's
resampler and ESS threshold, N and K within the scheduler's bounds) go to the engine's
:class:`~smcdecode.backends.engine.scheduler.Scheduler`: each choice is one scheduler request with
its own N, K and temperatures, joining between rounds when a slot is free and leaving when its
particles have finished; streamed requests get the prefix every particle shares after each round.

Plain autoregressive requests (no constraint, seed or logprobs) go to a second Scheduler, exact-only
with K = 0 (``Engine.autoregressive``'s program): each choice one exact row sampled token by token
from p_T, in the lean round of exact.py (a target forward, a draw, the bookkeeping: no weights or
resampling). It runs on its own Engine over the same target Llama without a draft model. AR choices
join and leave between rounds like SMC requests, and stream token by token.
The device thread steps the two schedulers in turn.

Everything else (exact speculative decoding, constraints, seeded requests) runs whole between
rounds: plain SD batched with the waiting SD requests of the same settings in one engine call (its
own KV pool), the rest through the public API on the engine; their text is sent when they end.
Seeded requests stay there because the schedulers draw from one random stream shared by every
request in a round, so a seed could not reproduce a request's sample.

The scheduled requests' events (streamed text, finished choices) are handed to the HTTP side's event
loop once a step, all together (``Outbox``): the device thread and the event loop share the GIL, and
a wake-up per event would hand it over once per request and round.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import torch

from ..errors import SMCDecodeError
from ..result import NO_SAMPLE, Result
from .executor import Choice, Executor, Job, LibraryRunner, Outbox, count, finish_choice, outcome, run_job
from .metrics import Stats
from .protocol import Defaults, Limits
from .stream import TextStream
from .watch import Cancelled, WatchedModel


class SchedulerExecutor(Executor):
    """See the module docstring. ``ignore_eos``: generate exactly ``max_tokens`` tokens (benchmarks).
    ``ar_slots``: autoregressive choices in flight at once (default ``slots``). ``stream_interval``:
    a streamed choice gets new text at most once every that many seconds (its first text and its
    end at once; 0: after every round)."""

    min_prompt_tokens = 2  # the engine feeds the last two prompt tokens to the draft in the first round

    def __init__(self, model, model_name: str, draft, *, limits: Limits, defaults: Defaults,
                 max_queue: int = 64, slots: int = 8, max_particles: int = 8, max_block_size: int = 8,
                 context: int = 2048, page_size: int = 16, use_graphs: bool | None = None, ignore_eos: bool = False,
                 stats: Stats | None = None, seed: int = 0, llamas: tuple | None = None, ar_slots: int | None = None,
                 lockstep=None, stream_interval: float = 0.02):
        super().__init__(model, model_name, limits=limits, defaults=defaults, max_queue=max_queue, stats=stats,
                         has_draft=True)
        self.eos = None if ignore_eos else model.eos_token_id
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, (int, float)) \
                or not 0 <= stream_interval < float("inf"):
            raise SMCDecodeError(f"stream_interval must be a number of seconds >= 0, got {stream_interval!r}")
        self.stream_interval = float(stream_interval)
        context = min(context, model.max_context or context)
        settings = dict(slots=slots, max_particles=max_particles, max_block_size=max_block_size, context=context,
                        page_size=page_size, use_graphs=use_graphs, eos=self.eos, resampler=defaults.resampler,
                        ess_threshold=defaults.ess_threshold, seed=seed,
                        ar_slots=slots if ar_slots is None else ar_slots)
        self.lockstep = lockstep
        if lockstep is None:
            parts: dict = {}
            build_device(llamas if llamas is not None else _llamas(model, draft), parts, settings)
        else:  # a sharded target (``serve.tensor_parallel``): every rank builds and steps the same objects
            from ..backends.engine import parallel

            lockstep.run(build_device, settings)
            parts = dict(lockstep.state)
            parts["sched"] = parallel.SharedScheduler(lockstep, "sched")
            parts["ar"] = parallel.SharedScheduler(lockstep, "ar")
            parts["sd"] = parallel.SharedScheduler(lockstep, "sd")
            parts["batch_engine"] = parallel.Replica(lockstep, "batch_engine", ("speculative",))
        self.engine, self.batch_engine, self.ar_engine = parts["engine"], parts["batch_engine"], parts["ar_engine"]
        self.sched, self.ar, self.sd = parts["sched"], parts["ar"], parts["sd"]
        self.schedulers = (self.sched, self.sd, self.ar)
        self.slots, self.use_graphs = slots, use_graphs
        self.Nmax, self.Kmax, self.context = max_particles, max_block_size, self.engine.max_context
        # the rest runs through the public API on the engine (it needs the Hugging Face models)
        self.side = (LibraryRunner(model, draft, self.stats, "engine", {"device": str(self.engine.device)})
                     if isinstance(model, WatchedModel) else None)
        self.draft = draft
        self.generator = torch.Generator().manual_seed(seed)  # the returned particle of each choice
        self.cond = threading.Condition()
        self.incoming: deque[Job] = deque()
        self.side_queue: deque[Job] = deque()
        self.cancels: list[Job] = []
        self.outbox = Outbox()  # the scheduled jobs' events, delivered once a step (not once an event)
        # seconds of the device thread: in the schedulers' steps (their host work and their waits for
        # the device), streaming, finishing choices, handing events to the HTTP side, waiting for work
        self.seconds = dict.fromkeys(("rounds", "stream", "finish", "deliver", "idle"), 0.0)
        self._idle_since: float | None = None  # when the device thread's current wait for work began
        self.idle_waits: deque = deque(maxlen=4096)  # the last waits for work: (began, ended), perf_counter
        self.waiting: set[Job] = set()  # submitted, not yet running
        self.live: dict[Job, dict] = {}  # job -> {"choices": {index: Choice}, "streams": [...]}
        self._pending: dict = {}  # scheduler id -> (stream read in flight, its slots, its event)
        self.running_side: Job | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._work, name="smcdecode-serve-engine", daemon=True)
        self.thread.start()

    # -- the interface -------------------------------------------------------------------------

    def lane(self, job: Job) -> str:
        """"scheduler" (plain smc), "ar" (plain ar), "sd" (plain sd with block_size <= the server's max),
        "batch" (other plain sd, batched with others of the same
        settings) or "api"."""
        s = job.spec
        plain = job.constraint is None and s.seed is None and s.logprobs is None
        if (plain and s.strategy == "smc" and s.particles <= self.Nmax and s.block_size <= self.Kmax
                and s.resampler == self.defaults.resampler and s.ess_threshold == self.defaults.ess_threshold
                and len(job.prompt_ids) + s.max_tokens + self.Kmax + 2 <= self.context):
            return "scheduler"
        if plain and s.strategy == "ar" and len(job.prompt_ids) + s.max_tokens + 2 <= self.context:
            return "ar"
        if (plain and s.strategy == "sd" and 1 <= s.block_size <= self.Kmax
                and len(job.prompt_ids) + s.max_tokens + self.Kmax + 2 <= self.context):
            return "sd"
        if plain and s.strategy == "sd" and len(job.prompt_ids) + 2 * s.max_tokens + s.block_size + 2 \
                <= self.context:
            return "batch"
        return "api"

    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                raise self.full()
            self.waiting.add(job)
            self.incoming.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        with self.cond:
            self.cancels.append(job)
            self.cond.notify()

    def gauges(self) -> dict:
        with self.cond:
            running = len(self.live) + int(self.running_side is not None)  # (live: both schedulers)
            return {"smcdecode_queue_length": len(self.waiting), "smcdecode_running": running,
                    "smcdecode_kv_pages_in_use": self.pages_in_use}

    pages_in_use = 0

    def device_seconds(self) -> dict:
        """``seconds`` (see ``__init__``) up to now, a wait for work in progress included."""
        with self.cond:
            out = dict(self.seconds)
            if self._idle_since is not None:
                out["idle"] += time.perf_counter() - self._idle_since
        return out

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=60)
        if self.lockstep is not None:
            self.lockstep.close()

    # -- the device thread -------------------------------------------------------------------------

    def _work(self) -> None:
        side_turn = False
        while True:
            with self.cond:
                self._idle_since, waited = time.perf_counter(), False
                while not (self.incoming or self.cancels or self.side_queue or any(x.busy for x in self.schedulers)
                           or self.closed):
                    waited = True
                    if not self.cond.wait(KEEPALIVE_S if self.lockstep else None):
                        self.lockstep.run(_keepalive)  # the other ranks wait for a call under a timeout
                now = time.perf_counter()
                self.seconds["idle"] += now - self._idle_since
                if waited:  # (a wait for work, not a look at the queues)
                    self.idle_waits.append((self._idle_since, now))
                self._idle_since = None
                if self.closed:
                    return
                incoming, self.incoming = list(self.incoming), deque()
                cancels, self.cancels = self.cancels, []
            for job in incoming:
                if job.cancelled.is_set():  # its client went away before it reached the device thread
                    with self.cond:
                        self.waiting.discard(job)
                    self.stats.add(cancelled=1)
                    continue
                lane = self.lane(job)
                if lane == "scheduler":
                    self._enqueue(job, self.sched)
                elif lane == "ar":
                    self._enqueue(job, self.ar)
                elif lane == "sd":
                    self._enqueue(job, self.sd)
                else:
                    self.side_queue.append(job)
            try:
                for job in cancels:
                    self._cancel(job)
                busy = any(x.busy for x in self.schedulers)
                # (a batched sd call shares its engine's pages with the sd request loop: only when that is idle)
                side = bool(self.side_queue) and (side_turn or not busy) and not (
                    self.sd.busy and self.lane(self.side_queue[0]) == "batch")
                if side:
                    self._run_side()
                else:  # one round of each busy scheduler, in turn
                    for sched in self.schedulers:
                        if sched.busy:
                            self._step(sched)
            except Exception as e:  # noqa: BLE001 - a bug: the requests in flight get it, the thread goes on
                for job in list(self.live):
                    job.post("error", e)
                self.live.clear()
                for sched in self.schedulers:
                    for r in [r for r in sched.requests if r is not None] + list(sched.queue):
                        sched.cancel(r.id)
            self._deliver()
            side_turn = not side_turn

    def _enqueue(self, job: Job, sched) -> None:
        """Each choice of ``job`` as one request of ``sched`` (AR: one particle, no draft)."""
        from ..backends.engine import Request

        s = job.spec
        job.outbox = self.outbox
        self.live[job] = {"choices": {}, "streams": [TextStream(self.model.decode, s.stop) for _ in range(s.n)],
                          "shared": [0] * s.n, "sent_at": [-math.inf] * s.n, "started": time.perf_counter()}
        ar, exact = sched is self.ar, sched is self.sd or sched is self.ar
        dt = 1.0 if ar else _draft_temperature(s, self.draft)
        for i in range(s.n):
            sched.submit(Request(list(job.prompt_ids), particles=1 if exact else s.particles,
                                 block_size=0 if ar else s.block_size, max_new_tokens=s.max_tokens,
                                 draft_temperature=dt, target_temperature=s.temperature, id=(job, i),
                                 exact=exact))

    def _cancel(self, job: Job) -> None:
        with self.cond:
            self.waiting.discard(job)
        if job in self.side_queue:
            self.side_queue.remove(job)
            self.stats.add(cancelled=1)
            return
        if job not in self.live:  # finished, or running in the side lane (it stops at its next step)
            return
        for sched in self.schedulers:
            for r in [r for r in [*sched.queue, *sched.requests] if r is not None and r.id[0] is job]:
                sched.cancel(r.id)  # queued or running: its rows and pages are freed
        self._count_pages()
        del self.live[job]
        self.stats.add(cancelled=1)
        job.post("error", Cancelled())

    def _run_side(self) -> None:
        """The first waiting side job: with every waiting job of the same settings in one engine call
        (plain sd), or alone through the public API."""
        job = self.side_queue.popleft()
        jobs = [job]
        if self.lane(job) == "batch":
            key = _batch_key(job.spec)
            for other in list(self.side_queue):
                if len(jobs) < self.slots and self.lane(other) == "batch" and _batch_key(other.spec) == key:
                    self.side_queue.remove(other)
                    jobs.append(other)
        with self.cond:
            for j in jobs:
                self.waiting.discard(j)
            self.running_side = job
        try:
            if len(jobs) > 1 or self.lane(job) == "batch":
                self._run_batch(jobs)
            elif self.side is None:
                job.post("error", SMCDecodeError(
                    "this server runs engine models without a Hugging Face model behind them: it serves plain "
                    "requests only (no constraint, seed or logprobs)"))
            else:
                run_job(job, self.side.run, self.stats)
        finally:
            with self.cond:
                self.running_side = None

    def _run_batch(self, jobs: list[Job]) -> None:
        """Plain sd of several jobs (their choices as rows) in one engine call."""
        spec = jobs[0].spec
        rows = [(job, i) for job in jobs for i in range(job.spec.n) if not job.cancelled.is_set()]
        if not rows:
            return
        prompts = [list(job.prompt_ids) for job, _ in rows]
        T = max(job.spec.max_tokens for job, _ in rows)
        start = time.perf_counter()
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        try:
            out = self.batch_engine.speculative(
                prompts, block_size=spec.block_size, max_new_tokens=T, samples=1,
                draft_temperature=_draft_temperature(spec, self.draft), target_temperature=spec.temperature,
                eos_token_id=self.eos, use_graphs=self.use_graphs, seed=seed)
            tokens, rounds = out.tokens[:, 0].cpu(), out.rounds
            accepted, drafted = out.accepted[:, 0].cpu().tolist(), out.drafted[:, 0].cpu().tolist()
        except Exception as e:  # noqa: BLE001 - every job of the batch gets the error
            for job in jobs:
                job.post("error", e)
            return
        seconds = time.perf_counter() - start
        done: dict[Job, list[Choice]] = {}
        for r, (job, i) in enumerate(rows):
            row = tokens[r, : job.spec.max_tokens].tolist()
            if self.eos is not None and self.eos in row:
                row = row[: row.index(self.eos) + 1]
            result = Result(
                strategy="speculative", texts=[self.model.decode([t for t in row if t != self.eos])], tokens=[row],
                log_weights=torch.zeros(1, dtype=torch.float64), weights=torch.ones(1, dtype=torch.float64),
                finished=torch.ones(1, dtype=torch.bool), log_evidence=math.nan, ess=[], resampled=[],
                weight_history=[], sample_index=0, seconds=seconds, prompt_tokens=len(job.prompt_ids), particles=1,
                block_size=spec.block_size, draft_tokens=int(drafted[r]), accepted_tokens=int(accepted[r]),
                n_rounds=rounds, eos_token_id=self.eos, max_new_tokens=job.spec.max_tokens)
            choice = finish_choice(self.model, job, i, result, TextStream(self.model.decode, job.spec.stop))
            count(self.stats, result)
            done.setdefault(job, []).append(choice)
        for job, choices in done.items():
            job.post("done", outcome(self.stats, job, choices, True))

    def _count_pages(self) -> None:
        self.pages_in_use = sum(int(x.table.used) for x in self.schedulers)

    def _step(self, sched) -> None:
        """One round of ``sched``: stream what became final, report the choices that finished."""
        t0 = time.perf_counter()
        finished = sched.step()
        t1 = time.perf_counter()
        with self.cond:
            for r in sched.requests:
                if r is not None:
                    self.waiting.discard(r.id[0])
            for f in finished:
                self.waiting.discard(f.request.id[0])
        self._count_pages()
        self._stream(sched)
        t2 = time.perf_counter()
        for f in finished:
            job, i = f.request.id
            if job in self.live:
                self._finish(job, i, f, {id(self.ar): "autoregressive", id(self.sd): "speculative"}.get(id(sched), "smc"))
        t3 = time.perf_counter()
        self.seconds["rounds"] += t1 - t0
        self.seconds["stream"] += t2 - t1
        self.seconds["finish"] += t3 - t2
        self._deliver()

    def _deliver(self) -> None:
        t0 = time.perf_counter()
        self.outbox.flush()
        self.seconds["deliver"] += time.perf_counter() - t0

    def _stream(self, sched) -> None:
        """Send each streamed choice the prefix all its particles share (those whose last text went
        ``stream_interval`` seconds ago or more). One device read for all of them, started after the round just launched and taken at the next step (on a GPU: so the
        host does not wait for the round in flight; a prefix that every particle shares never
        changes, so an earlier one is as final as the newest)."""
        pending = self._pending.pop(id(sched), None)
        if pending is not None:
            self._send(*pending)
        now = time.perf_counter()
        slots = [(g, r) for g, r in enumerate(sched.requests) if r is not None and r.id[0].spec.stream
                 and r.id[0] in self.live and now - self.live[r.id[0]]["sent_at"][r.id[1]] >= self.stream_interval]
        if not slots:
            return
        for _, r in slots:
            self.live[r.id[0]]["sent_at"][r.id[1]] = now
        b, N = sched.full.buffers, sched.Nmax
        top = max(g for g, _ in slots) + 1
        T = max(r.max_new_tokens for _, r in slots)
        toks = b["tokens"][: top * N, :T].view(top, N, T)
        valid = b["valid"][: top * N].view(top, N)
        # a column is shared when every particle of the request holds the first one's token there
        same = ((toks == toks[:, :1]) | ~valid[:, :, None]).all(1)  # [top, T]
        shared = same.long().cumprod(1).sum(1)
        n_gen = torch.where(valid, b["n_gen"][: top * N].view(top, N), T).min(1).values
        packed = torch.cat([torch.minimum(shared, n_gen)[:, None], toks[:, 0]], 1)
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending[id(sched)] = (host, slots, event)
        else:
            self._send(packed, slots, None)

    def _send(self, packed, slots, event) -> None:
        if event is not None:
            event.synchronize()
        packed = packed.numpy()
        for g, r in slots:
            job, i = r.id
            state = self.live.get(job)
            if state is None or i in state["choices"]:  # (finished since: its text went with it)
                continue
            n = min(int(packed[g, 0]), r.max_new_tokens)  # (past a row's generated tokens lies padding)
            if n <= state["shared"][i]:  # nothing new is shared
                continue
            state["shared"][i] = n
            ids = packed[g, 1 : 1 + n].tolist()
            if self.eos is not None and self.eos in ids:
                ids = ids[: ids.index(self.eos)]
            delta = state["streams"][i].update(ids)
            if delta:
                job.post("delta", i, delta)

    def _finish(self, job: Job, i: int, f, strategy: str) -> None:
        """Choice ``i`` of ``job`` from its finished scheduler request (``strategy``: "smc", or
        "autoregressive" / "speculative": one particle and no weights)."""
        state = self.live[job]
        n = f.request.particles
        lw = f.log_weights.double()
        W = torch.softmax(lw, 0) if torch.isfinite(lw).any() else torch.zeros(n, dtype=torch.float64)
        sample = int(torch.multinomial(W, 1, generator=self.generator)) if float(W.sum()) > 0 else None
        tokens = [f.tokens[k, : int(f.lengths[k])].tolist() for k in range(n)]
        texts = [self.model.decode([t for t in row if t != self.eos]) for row in tokens]
        smc = strategy == "smc"
        result = Result(
            strategy=strategy, texts=texts, tokens=tokens, log_weights=lw, weights=W,
            finished=torch.ones(n, dtype=torch.bool), log_evidence=f.log_evidence if smc else math.nan,
            ess=list(f.ess) if smc else [], resampled=list(f.resampled) if smc else [], weight_history=[],
            sample_index=sample, seconds=time.perf_counter() - state["started"], prompt_tokens=len(job.prompt_ids),
            particles=n, block_size=f.request.block_size, eos_token_id=self.eos,
            max_new_tokens=f.request.max_new_tokens, n_rounds=f.rounds,
            message="" if sample is not None else NO_SAMPLE,
            **({"draft_tokens": int(f.drafted[0]), "accepted_tokens": int(f.accepted[0])}
               if strategy == "speculative" else {}))
        choice = finish_choice(self.model, job, i, result, state["streams"][i])
        choice.run["scheduler_rounds"] = [f.joined_round, f.joined_round + f.rounds]  # [joined, left)
        count(self.stats, result)
        state["choices"][i] = choice
        if len(state["choices"]) == job.spec.n:
            del self.live[job]
            choices: list[Choice] = [state["choices"][k] for k in range(job.spec.n)]
            job.post("done", outcome(self.stats, job, choices, True))


KEEPALIVE_S = 60.0  # an idle server's no-op call to the other ranks (their wait times out after 30 minutes)


def build_device(llamas: tuple, state: dict, settings: dict) -> None:
    """The engines and schedulers of one device (one rank of a sharded target) into ``state``:
    ``engine`` and ``sched`` (SMC-SD), ``batch_engine`` and ``sd`` (exact SD: its request loop, and
    batched calls for requests it cannot take), ``ar_engine`` and ``ar`` (AR)."""
    from ..backends.engine import Engine, EngineConfig, EngineTarget, Scheduler

    target_llama, draft_llama = llamas
    S = settings
    context, page_size, use_graphs, slots = S["context"], S["page_size"], S["use_graphs"], S["slots"]

    def config(rows: int) -> EngineConfig:
        return EngineConfig(num_pages=rows * (-(-context // page_size) + 2) + 16, page_size=page_size,
                            max_context=context, use_graphs=use_graphs)

    state["engine"] = engine = Engine(target_llama, draft_llama, config(slots * S["max_particles"]))
    state["batch_engine"] = Engine(target_llama, draft_llama, config(slots))  # its own KV pools
    state["sched"] = Scheduler(engine, slots=slots, max_particles=S["max_particles"],
                               max_block_size=S["max_block_size"], target=EngineTarget(), eos_token_id=S["eos"],
                               resampler=S["resampler"], ess_threshold=S["ess_threshold"], use_graphs=use_graphs,
                               seed=S["seed"])
    state["sd"] = Scheduler(state["batch_engine"], slots=slots, max_particles=1, max_block_size=S["max_block_size"],
                            target=EngineTarget(), eos_token_id=S["eos"], resampler=S["resampler"], ess_threshold=0.0,
                            use_graphs=use_graphs, seed=S["seed"] + 2, exact_only=True)
    # autoregressive sampling: exact rows of K = 0 on the target alone
    state["ar_engine"] = ar_engine = Engine(target_llama, None, config(S["ar_slots"]))
    state["ar"] = Scheduler(ar_engine, slots=S["ar_slots"], max_particles=1, max_block_size=0,
                            target=EngineTarget(), eos_token_id=S["eos"], use_graphs=use_graphs, seed=S["seed"] + 1,
                            exact_only=True)


def _keepalive(engine, state: dict) -> None:
    return None


def _batch_key(spec) -> tuple:
    return (spec.strategy, spec.temperature, spec.draft_temperature, spec.block_size if spec.strategy == "sd" else 0)


def _llamas(model, draft) -> tuple:
    """The engine's Llama modules of the target and draft HF models, sharing what HF shares."""
    from ..backends.engine.bridge import to_llama

    target_llama, draft_llama = to_llama(model, "target"), to_llama(draft, "draft")
    hf_t, hf_d = model.hf, draft.hf
    with torch.no_grad():
        if hf_d.get_input_embeddings() is hf_t.get_input_embeddings():
            draft_llama.tok_embeddings = target_llama.tok_embeddings
        if hf_d.get_output_embeddings() is hf_t.get_output_embeddings():
            draft_llama.output = target_llama.output
    return target_llama, draft_llama


def _draft_temperature(spec, draft) -> float:
    from .executor import draft_temperature

    t = draft_temperature(spec, draft)
    return t if math.isfinite(t) else spec.temperature
