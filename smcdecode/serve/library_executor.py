"""The executor of the public API: SMC requests interleaved on the reference backend's request loop.

:class:`LibraryExecutor` runs on one worker thread. On the reference backend every SMC request's
choices (``n``) are requests of one :class:`~smcdecode.samplers.loop.Loop`: up to ``slots`` of them
are live at once, each advanced by one round per step in turn (round-robin; each request has its
own runners, so rounds of different prompts run one after another, not as one batch), a request
joining between rounds when there is room and leaving when its particles have finished. Its draws
are those of ``SMC.run`` with the same seed whatever else is running. Every other request (SD,
AR, or any strategy on the engine backend) runs whole through the public API between two steps
of the loop (the loop waits meanwhile). Requests are taken in arrival order; up to ``max_queue``
wait, one more gets 429.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..samplers.loop import Loop
from .executor import (
    Choice,
    Executor,
    Job,
    LibraryRunner,
    choice_seed,
    count,
    finish_choice,
    outcome,
    post_choice,
    returned_tokens,
    run_job,
    stream_commits,
)
from .metrics import Stats
from .protocol import Defaults, Limits
from .stream import TextStream
from .watch import Cancelled, Stopped, Watch, WatchedModel


@dataclass
class _LoopJob:
    """A job whose choices are requests of the loop."""

    job: Job
    strategy: object
    streams: list
    started: float
    choices: dict = field(default_factory=dict)  # index -> Choice


class LibraryExecutor(Executor):
    """The public API's strategies on a worker thread; SMC on the reference backend interleaved
    (module docstring)."""

    def __init__(self, model: WatchedModel, model_name: str, draft=None, *, backend: str = "reference",
                 engine_options: dict | None = None, limits: Limits, defaults: Defaults, max_queue: int = 64,
                 stats: Stats | None = None, slots: int = 8):
        super().__init__(model, model_name, limits=limits, defaults=defaults, max_queue=max_queue, stats=stats,
                         has_draft=draft is not None)
        self.runner = LibraryRunner(model, draft, self.stats, backend, engine_options)
        self.backend, self.slots = backend, slots
        self.queue: deque[Job] = deque()
        self.loop = Loop(max_live=slots)
        self.jobs: dict[str, _LoopJob] = {}  # job id -> its choices on the loop
        self.running: Job | None = None  # a job running whole
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._work, name="smcdecode-serve-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.queue) >= self.max_queue:
                raise self.full()
            self.queue.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """From the HTTP side: a waiting job leaves the queue; a running one stops at its next step."""
        job.cancelled.set()
        with self.cond:
            if job in self.queue:
                self.queue.remove(job)
                self.stats.add(cancelled=1)

    def gauges(self) -> dict:
        with self.cond:
            return {"smcdecode_queue_length": len(self.queue),
                    "smcdecode_running": len(self.jobs) + int(self.running is not None)}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for job in self.queue:
                job.cancelled.set()
            self.queue.clear()
            for state in self.jobs.values():
                state.job.cancelled.set()
            if self.running is not None:
                self.running.cancelled.set()
            self.cond.notify_all()
        self.thread.join(timeout=30)

    def _interleaved(self, job: Job) -> bool:
        return self.backend == "reference" and job.spec.strategy == "smc"

    def _work(self) -> None:
        while True:
            joining, whole = [], None
            with self.cond:
                while not self.queue and not self.jobs and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                room = self.slots - len(self.loop.live) - len(self.loop.queue)
                while self.queue:
                    job = self.queue[0]
                    if not self._interleaved(job):
                        whole = self.running = self.queue.popleft()
                        break
                    if room <= 0:
                        break
                    joining.append(self.queue.popleft())
                    room -= job.spec.n
            for job in joining:
                self._join(job)
            if whole is not None:
                try:
                    run_job(whole, self.runner.run, self.stats)
                finally:
                    with self.cond:
                        self.running = None
            self._step()

    def _join(self, job: Job) -> None:
        """Submit a job's choices to the loop, each watched for final text and cancellation."""
        spec = job.spec
        try:
            strategy = self.runner.strategy(spec, job.constraint)
            state = _LoopJob(job, strategy, [], time.perf_counter())
            for i in range(spec.n):
                stream = TextStream(self.model.decode, spec.stop)
                state.streams.append(stream)
                watch = Watch("smc", self.model.eos_token_id, stream_commits(job, stream, i), job.cancelled)
                request = strategy.as_request(job.prompt_ids, spec.max_tokens, choice_seed(spec.seed, i), (job.id, i))
                request.scope = lambda watch=watch: self.model.watching(watch)
                self.loop.submit(request)
        except Exception as e:  # noqa: BLE001 - reported to the client (SMCDecodeError: a 400)
            for i in range(spec.n):
                self.loop.cancel((job.id, i))
            job.post("error", e)
            return
        with self.cond:
            self.jobs[job.id] = state

    def _step(self) -> None:
        """One step of the loop (one round of every live request); finished choices and jobs are reported."""
        for state in list(self.jobs.values()):
            if state.job.cancelled.is_set():
                self._drop(state, Cancelled())
        if not self.loop.busy:
            return
        for f in self.loop.step():
            job_id, i = f.request.id
            state = self.jobs.get(job_id)
            if state is None:
                continue
            job, stream = state.job, state.streams[i]
            try:
                if isinstance(f.error, Stopped):  # a stop sequence is in the final text
                    choice = Choice(i, stream.sent, "stop", returned_tokens(self.model, stream.ids, stream.sent),
                                    run={"stopped_early": True})
                    post_choice(self.model, job, choice, "")
                else:
                    result = state.strategy.result_of(f, time.perf_counter() - state.started)
                    choice = finish_choice(self.model, job, i, result, stream)
                    count(self.stats, result)
            except Exception as e:  # noqa: BLE001 - Cancelled, or reported to the client
                self._drop(state, e)
                continue
            state.choices[i] = choice
            if len(state.choices) == job.spec.n:
                with self.cond:
                    del self.jobs[job_id]
                job.post("done", outcome(self.stats, job, [state.choices[k] for k in range(job.spec.n)],
                                         self.has_draft))

    def _drop(self, state: _LoopJob, error: Exception) -> None:
        """End a job early: its other choices leave the loop and the error (or cancellation) is reported."""
        job = state.job
        for i in range(job.spec.n):
            self.loop.cancel((job.id, i))
        with self.cond:
            self.jobs.pop(job.id, None)
        if isinstance(error, Cancelled):
            self.stats.add(cancelled=1)
        job.post("error", error)
