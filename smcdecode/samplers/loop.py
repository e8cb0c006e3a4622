"""The reference backend's request loop for SMC-SD: requests join between rounds and leave when done.

A :class:`Loop` keeps a queue and a set of live requests. Each :meth:`Loop.step` first admits
queued requests (up to ``max_live`` live at once; admission prefills the request's prompt into its
own runners), then advances every live request by one round (``SMCRun.round``, in the order they
joined), then releases the requests whose particles have all finished or whose token budget is
spent, as :class:`Finished` records. Each request has its own settings — target (temperature, power,
constraints, rewards), draft and draft temperature, particles N, groups G, block size K or
schedule, resampler, τ, budget — and its own generator, so its draws do not depend on which other
requests share the loop.

    loop = Loop()
    loop.submit(Request(prompt_ids, target, Draft(draft_model, 0.7), particles=8, block_size=4, max_new_tokens=64))
    while loop.busy:
        for done in loop.step():   # one round of every live request; the requests that left
            ...

The rounds of different requests run one after another (each on its own runners: the reference
backend batches over a request's particles, not across prompts); the GPU engine's loop
(``backends.engine.scheduler``) has the same shape and runs the live requests' rounds as one batch.
:func:`smc_sd` — what ``SMC.run`` and ``SMC.run_groups`` call on the reference backend — is this
loop with one request (an adaptive schedule: one request per group, since each request's K is its own).
The baselines are programs on the same loop: :func:`speculative` (a request with ``exact=True``: a
``speculative.SpeculativeRun`` of independent sequences) and ``autoregressive.autoregressive`` (the
target as proposal, τ = 0); exact and SMC requests may share one loop.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import SMCDecodeError
from ..potentials.base import as_target
from .resampling import RESAMPLERS
from .smc_sd import SMCOutput, SMCRun, stack
from .speculative import SpeculativeRun


@dataclass
class Request:
    """One SMC-SD request: a prompt (token ids) and its own program and settings.

    ``target`` a Product (LM, constraints, rewards) or anything ``as_target`` takes; ``draft`` a
    :class:`~smcdecode.samplers.proposals.Draft` or None (the target as proposal: K = 0);
    ``groups`` independent particle systems of ``particles`` each (replicates, sharing the prompt);
    ``schedule`` a FixedBlocks / AdaptiveBlocks or None (``block_size`` every round); ``generator``
    the request's random stream (None: torch's global one); ``progress`` a bar told the tokens of
    every round; ``id`` any hashable (None: the loop numbers it); ``scope`` a function returning a
    context manager the loop enters around the request's prefill and each of its rounds (the server
    watches the request's runners with it); ``exact`` makes it exact speculative decoding (weights 1,
    no evidence; a draft, K >= 1 and a plain LM target)."""

    prompt: list[int]
    target: object
    draft: object = None
    particles: int = 8
    block_size: int = 4
    max_new_tokens: int = 64
    groups: int = 1
    resampler: str = "systematic"
    ess_threshold: float = 0.5
    schedule: object = None
    generator: torch.Generator | None = None
    progress: object = None
    id: object = None
    scope: Callable[[], contextlib.AbstractContextManager] | None = None
    exact: bool = False  # exact speculative decoding: groups × particles independent sequences of the target


@dataclass
class Finished:
    """A request that left the loop: its output (None when it failed), the error that ended it
    (None when it finished), and the loop steps at which it joined and left."""

    request: Request
    output: SMCOutput | None
    joined: int
    left: int
    error: Exception | None = None

    @property
    def rounds(self) -> int:
        return 0 if self.output is None else self.output.rounds


class Loop:
    """Requests join between rounds and leave when done (see the module docstring)."""

    def __init__(self, max_live: int | None = None):
        if max_live is not None and (isinstance(max_live, bool) or not isinstance(max_live, int) or max_live < 1):
            raise SMCDecodeError(f"max_live must be an integer >= 1 (requests advanced together) or None, got {max_live!r}")
        self.max_live = max_live
        self.queue: deque[Request] = deque()
        self.live: dict[object, tuple[SMCRun | SpeculativeRun, int]] = {}  # id -> (its run, the step it joined)
        self.steps = 0  # steps run so far (the index of the next one)
        self._ids = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.live)

    def submit(self, request: Request) -> object:
        """Queue ``request``; it joins at the start of the next step with room. Returns its id."""
        _check(request)
        request.target = as_target(request.target)
        if request.exact:
            _check_exact(request)
        if request.draft is None:
            request.block_size, request.schedule = 0, None
        if request.id is None:
            request.id = next(self._ids)
        elif request.id in self.live or any(r.id == request.id for r in self.queue):
            raise SMCDecodeError(f"a request with id {request.id!r} is already in the loop: give each request its own id")
        self.queue.append(request)
        return request.id

    def cancel(self, request_id) -> bool:
        """Drop a queued or live request (its runners are freed); True if it was in the loop."""
        if self.live.pop(request_id, None) is not None:
            return True
        for r in self.queue:
            if r.id == request_id:
                self.queue.remove(r)
                return True
        return False

    def step(self) -> list[Finished]:
        """Admit, advance every live request by one round, release the finished (see the module docstring).
        A request whose prefill or round raises leaves with the error; the others go on."""
        left: list[Finished] = []
        while self.queue and (self.max_live is None or len(self.live) < self.max_live):
            request = self.queue.popleft()
            try:
                with _scope(request):
                    run = SpeculativeRun(request) if request.exact else SMCRun(request)
                    self.live[request.id] = (run, self.steps)
            except Exception as e:  # noqa: BLE001 (handed back to the caller with its request)
                left.append(Finished(request, None, self.steps, self.steps, e))
        for rid, (run, joined) in list(self.live.items()):
            try:
                with _scope(run.request):
                    run.round()
            except Exception as e:  # noqa: BLE001
                del self.live[rid]
                left.append(Finished(run.request, None, joined, self.steps, e))
                continue
            if run.done:
                del self.live[rid]
                left.append(Finished(run.request, run.output(), joined, self.steps))
        self.steps += 1
        return left

    def run(self) -> list[Finished]:
        """Step until every request has left; the requests in the order they left."""
        done: list[Finished] = []
        while self.busy:
            done.extend(self.step())
        return done


def smc_sd(target, draft, prompt_ids: list[int], *, groups: int, particles: int, block_size: int,
           max_new_tokens: int, resampler: str = "systematic", ess_threshold: float = 0.5,
           generator: torch.Generator | None = None, progress=None, schedule=None) -> SMCOutput:
    """Run SMC-SD: the loop with one request of ``groups`` groups (an adaptive schedule: ``groups``
    requests of one group each, stacked). ``target`` is a Product (one LM, constraints, rewards);
    ``draft`` a :class:`~smcdecode.samplers.proposals.Draft` or None (target as proposal, block size 0);
    ``schedule`` a FixedBlocks / AdaptiveBlocks (K per round) or None (``block_size`` every round)."""
    split = draft is not None and schedule is not None and schedule.adaptive and groups > 1
    loop = Loop()
    for g in range(groups if split else 1):
        loop.submit(Request(prompt_ids, target, draft, particles, block_size, max_new_tokens, 1 if split else groups,
                            resampler, ess_threshold, schedule, generator, progress, id=g))
    outputs: dict[int, SMCOutput] = {}
    while loop.busy:
        for done in loop.step():
            if done.error is not None:
                raise done.error
            outputs[done.request.id] = done.output
    if not split:
        return outputs[0]
    return stack([outputs[g] for g in range(groups)], target.lm.model.eos_token_id)


def speculative(target, draft, prompt_ids: list[int], *, batch: int, block_size: int, max_new_tokens: int,
                generator: torch.Generator | None = None, progress=None) -> SMCOutput:
    """``batch`` sequences of exact speculative decoding: the loop with one ``exact`` request."""
    loop = Loop()
    loop.submit(Request(prompt_ids, target, draft, particles=batch, block_size=block_size,
                        max_new_tokens=max_new_tokens, generator=generator, progress=progress, exact=True))
    (done,) = loop.run()
    if done.error is not None:
        raise done.error
    return done.output


def _scope(r: Request) -> contextlib.AbstractContextManager:
    return r.scope() if r.scope is not None else contextlib.nullcontext()


def _check(r: Request) -> None:
    """Types and ranges of a request's settings (SMCDecodeError naming the field and the fix)."""
    if not isinstance(r, Request):
        raise SMCDecodeError(f"submit takes a Request, got {type(r).__name__}")
    if not isinstance(r.prompt, (list, tuple)) or not r.prompt or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in r.prompt):
        raise SMCDecodeError(f"Request.prompt must be a non-empty list of token ids, got {str(r.prompt)[:60]!r}")
    for name, low in (("particles", 1), ("groups", 1), ("max_new_tokens", 1), ("block_size", 0)):
        v = getattr(r, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise SMCDecodeError(f"Request.{name} must be an integer >= {low}, got {v!r}")
    if r.resampler not in RESAMPLERS:
        raise SMCDecodeError(f"Request.resampler {r.resampler!r} is unknown: choose one of {sorted(RESAMPLERS)}")
    tau = r.ess_threshold
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
        raise SMCDecodeError(f"Request.ess_threshold must lie in [0, 1] (0 never resamples, 1 always), got {tau!r}")
    if r.schedule is not None and r.draft is not None and r.schedule.adaptive and r.groups > 1:
        raise SMCDecodeError(f"an adaptive schedule picks K per request: submit {r.groups} requests of groups=1 "
                             f"instead of one with groups={r.groups}")


def _check_exact(r: Request) -> None:
    t = r.target
    if r.draft is None or r.block_size < 1:
        raise SMCDecodeError(f"an exact (speculative decoding) request needs a draft and block_size >= 1, got "
                             f"draft={r.draft!r}, block_size={r.block_size}")
    if t.lm.alpha != 1 or t.constraints or t.rewards:
        raise SMCDecodeError(f"an exact (speculative decoding) request samples the LM alone; target {t!r} has a "
                             "power, constraint or reward: submit it with exact=False (SMC)")
