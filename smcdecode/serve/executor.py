"""Executors run checked requests; the HTTP layer knows them only through :class:`Executor`.

A :class:`Job` is one request: its :class:`~.protocol.Spec`, its prompt ids and compiled
constraint, and a queue of events the HTTP side reads (``("delta", index, text)`` as a choice's
text becomes final, ``("done", Outcome)`` or ``("error", exception)`` at the end).

:class:`Executor` is what the HTTP layer calls; :class:`LibraryRunner` runs one job whole through
the public API (``SMC``, ``SpeculativeDecoding``, ``Autoregressive``). ``LibraryExecutor``
(``library_executor``) interleaves SMC requests on the reference backend's request loop and runs the
others whole; ``SchedulerExecutor`` (``engine_executor``) batches requests on the GPU engine.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..errors import SMCDecodeError
from .metrics import Stats
from .protocol import Defaults, Limits, RequestError, Spec, compile_constraint
from .stream import TextStream
from .watch import Cancelled, Stopped, Watch, WatchedModel


@dataclass
class Choice:
    index: int
    text: str | None  # None: no particle satisfied the constraints (every weight 0)
    finish_reason: str  # "stop" (EOS or a stop sequence) or "length"
    tokens: list[int]
    logprobs: dict | None = None
    run: dict = field(default_factory=dict)  # the strategy's diagnostics of this choice


@dataclass
class Outcome:
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    smc: dict


class Job:
    """One request on its way through an executor (see the module docstring)."""

    def __init__(self, spec: Spec, prompt_ids: list[int], constraint, model_name: str, loop):
        self.spec, self.prompt_ids, self.constraint, self.model_name = spec, prompt_ids, constraint, model_name
        prefix = "chatcmpl" if spec.endpoint == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.outbox: Outbox | None = None  # set by an executor that delivers its events in batches

    def post(self, *event) -> None:
        """Deliver an event to the HTTP side (from any thread; with an ``outbox``, from the thread
        that flushes it, when it does)."""
        if self.outbox is not None:
            self.outbox.items.append((self, event))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutting down)
            pass


class Outbox:
    """Events of many jobs, posted by one thread and delivered with one wake-up of each event loop
    per :meth:`flush` (not one per event: the event loop and the posting thread share the GIL)."""

    def __init__(self):
        self.items: list[tuple[Job, tuple]] = []

    def flush(self) -> None:
        items, self.items = self.items, []
        by_loop: dict = {}
        for job, event in items:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the event loop has closed (server shutting down)
                pass


def _put_all(batch: list) -> None:
    for job, event in batch:
        job.events.put_nowait(event)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Seed of choice ``index``: the request's seed for the first (so a request with ``seed`` s
    reproduces ``strategy.run(prompt, seed=s)``), a fixed function of both for the others."""
    if seed is None or index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index) % 2**64


class Executor:
    """What the HTTP layer needs: ``prepare`` (check a spec against the model), ``submit`` (queue a
    job, or 429), ``cancel``, ``gauges`` (for /metrics) and ``close``."""

    model: WatchedModel
    model_name: str
    stats: Stats
    max_queue: int
    min_prompt_tokens = 1

    def __init__(self, model: WatchedModel, model_name: str, *, limits: Limits, defaults: Defaults,
                 max_queue: int, stats: Stats | None = None, has_draft: bool = True):
        self.model, self.model_name, self.limits, self.defaults = model, model_name, limits, defaults
        self.max_queue, self.has_draft = max_queue, has_draft
        self.setup = type(self).__name__  # what runs the requests, for the startup line (``cli.build`` says more)
        self.stats = stats or Stats()

    def prepare(self, spec: Spec, loop) -> Job:
        """Tokenise the prompt, check it against the context and compile the constraint (blocking:
        run it off the event loop)."""
        param = "messages" if spec.endpoint == "chat" else "prompt"
        if spec.strategy == "sd" and not self.has_draft:
            raise RequestError("strategy 'sd' needs a draft model and this server runs without one "
                               "(--draft target): use strategy 'smc' or 'ar'", "strategy")
        prompt = spec.prompt
        if spec.constraint is not None and spec.constraint[0] == "json" and spec.endpoint == "chat" \
                and spec.schema_in_prompt:
            from ..structured import schema_prompt

            prompt = schema_prompt(self.model, prompt, spec.constraint[1])
        try:
            ids = self.model.prompt_ids(prompt)
        except SMCDecodeError as e:
            raise RequestError(f"{param}: {e}", param) from None
        context = self.model.max_context
        if context is not None:
            if len(ids) + 1 > context:
                raise RequestError(f"the prompt has {len(ids)} tokens, more than the model's context of {context} "
                                   "allows: shorten it", param, code="context_length_exceeded")
            if len(ids) + spec.max_tokens > context:
                if spec.max_tokens_given:
                    name = spec.extra.get("max_tokens_param", "max_tokens")
                    raise RequestError(f"prompt ({len(ids)} tokens) + {name} ({spec.max_tokens}) exceeds the model's "
                                       f"context of {context} tokens: lower {name} or shorten the prompt", name,
                                       code="context_length_exceeded")
                spec.max_tokens = context - len(ids)
        if len(ids) < self.min_prompt_tokens:
            raise RequestError(f"the prompt has {len(ids)} token(s); this server's engine needs at least "
                               f"{self.min_prompt_tokens}: add a token (e.g. BOS) in front", param)
        return Job(spec, ids, compile_constraint(spec, self.model), self.model_name, loop)

    def submit(self, job: Job) -> None:
        raise NotImplementedError  # abstract

    def cancel(self, job: Job) -> None:
        raise NotImplementedError  # abstract

    def gauges(self) -> dict:
        raise NotImplementedError  # abstract

    def close(self) -> None:
        raise NotImplementedError  # abstract

    def full(self) -> RequestError:
        self.stats.add(rejected=1)
        return RequestError(f"the server's queue is full ({self.max_queue} requests waiting): retry later",
                            status=429, code="rate_limit_exceeded")


def run_info(result, return_particles: bool) -> dict:
    """The ``smc`` diagnostics of one choice's :class:`~smcdecode.Result`."""
    info = {"rounds": result.rounds, "particle_tokens": sum(len(t) for t in result.tokens)}
    if result.strategy == "smc":
        info.update(log_evidence=result.log_evidence if math.isfinite(result.log_evidence) else None,
                    mean_ess=result.mean_ess if result.ess else None, rounds_resampled=int(sum(result.resampled)))
    if result.acceptance_rate is not None:
        info["acceptance_rate"] = result.acceptance_rate
    if result.message:  # (in the request's terms)
        info["message"] = result.message.replace("max_new_tokens", "max_tokens").replace(
            "the number of particles", "particles")
    if return_particles:
        info["particles"] = [{"text": t, "weight": float(w), "log_weight": float(lw), "end": end}
                             for t, w, lw, end in zip(result.texts, result.weights, result.log_weights,
                                                      result.endings)]
    return info


def token_logprobs(model, prompt_ids: list[int], tokens: list[int], temperature: float, top: int,
                   endpoint: str) -> dict:
    """The model's log-probabilities (at ``temperature``) of ``tokens`` after the prompt, with the
    ``top`` most likely alternatives, in the endpoint's OpenAI format."""
    if not tokens:
        return {"content": []} if endpoint == "chat" else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                           "text_offset": []}
    runner = HFModelRunner(model, prompt_ids)
    logits = runner.logits(tokens)  # [T, V]
    lp = torch.log_softmax(logits.double() / temperature, -1)
    chosen = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    alts = torch.topk(lp, top, dim=-1) if top else None
    strings = [model.decode([t]) for t in tokens]
    if endpoint == "chat":
        content = []
        for i, (s, v) in enumerate(zip(strings, chosen)):
            top_list = []
            if alts is not None:
                for a_lp, a_id in zip(alts.values[i].tolist(), alts.indices[i].tolist()):
                    a = model.decode([a_id])
                    top_list.append({"token": a, "logprob": a_lp, "bytes": list(a.encode())})
            content.append({"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": top_list})
        return {"content": content}
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    tops = []
    for i in range(len(tokens)):
        tops.append(None if alts is None else {model.decode([a]): v for a, v in
                                               zip(alts.indices[i].tolist(), alts.values[i].tolist())})
    return {"tokens": strings, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


class HFModelRunner:
    """Logits of the model after the prompt and after each of some tokens (one forward)."""

    def __init__(self, model, prompt_ids: list[int]):
        self.model, self.prompt_ids = model, prompt_ids

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        runner = self.model.start(self.prompt_ids[:-1], 1)  # (not watched: no run is open)
        feed = torch.tensor([[self.prompt_ids[-1]] + tokens[:-1]], dtype=torch.long)
        return runner.extend(feed)[0].float().cpu()


def returned_tokens(model, tokens: list[int], text: str) -> list[int]:
    """The first tokens of ``tokens`` whose text covers ``text`` (the choice's text after a stop
    sequence cut it), EOS excluded: all of them when ``text`` is their whole text (one decode; the
    search, a decode per prefix, only for a text a stop sequence cut)."""
    tokens = [t for t in tokens if t != model.eos_token_id]
    if model.decode(tokens) == text:
        return tokens
    for k in range(len(tokens) + 1):
        if len(model.decode(tokens[:k])) >= len(text):
            return tokens[:k]
    return tokens


class LibraryRunner:
    """Runs one job through the public API's strategies, choice after choice, reporting final text
    as the target's runner sees it (``watch``)."""

    def __init__(self, model: WatchedModel, draft, stats: Stats, backend: str = "reference",
                 engine_options: dict | None = None):
        self.model, self.draft, self.stats = model, draft, stats
        self.backend, self.engine_options = backend, engine_options

    def strategy(self, spec: Spec, constraint):
        import smcdecode as sd

        target = sd.LM(self.model, temperature=spec.temperature)
        if constraint is not None:
            target = target * constraint
        options = {"backend": self.backend, "engine_options": self.engine_options}
        if spec.strategy == "ar":
            return sd.Autoregressive(target, samples=1, **options)
        proposal = "target"
        if self.draft is not None:
            proposal = sd.Draft(self.draft, draft_temperature(spec, self.draft))
        if spec.strategy == "sd":
            return sd.SpeculativeDecoding(target, proposal, block_size=spec.block_size, samples=1, **options)
        return sd.SMC(target, proposal, particles=spec.particles,
                      block_size=None if proposal == "target" else spec.block_size,
                      resampler=spec.resampler, ess_threshold=spec.ess_threshold, **options)

    def run(self, job: Job) -> Outcome:
        spec = job.spec
        strategy = self.strategy(spec, job.constraint)
        choices = []
        for i in range(spec.n):
            stream = TextStream(self.model.decode, spec.stop)
            watch = Watch(spec.strategy, self.model.eos_token_id, stream_commits(job, stream, i), job.cancelled)
            if job.cancelled.is_set():
                raise Cancelled
            try:
                with self.model.watching(watch):
                    result = strategy.run(job.prompt_ids, max_new_tokens=spec.max_tokens,
                                          seed=choice_seed(spec.seed, i), progress=False)
            except Stopped:  # a stop sequence is in the final text: the rest of the run cannot change it
                choice = Choice(i, stream.sent, "stop", returned_tokens(self.model, stream.ids, stream.sent),
                                run={"stopped_early": True})
                post_choice(self.model, job, choice, "")
                choices.append(choice)
                continue
            choices.append(finish_choice(self.model, job, i, result, stream))
            count(self.stats, result)
        return outcome(self.stats, job, choices, self.draft is not None)


def finish_choice(model, job: Job, i: int, result, stream: TextStream) -> Choice:
    """Choice ``i`` of ``job`` from its :class:`~smcdecode.Result`, reported with the rest of its text."""
    info = run_info(result, job.spec.return_particles)
    if result.text is None:
        choice = Choice(i, None, "length", [], run=info)
        post_choice(model, job, choice, "")
        return choice
    rest, text, stopped = stream.finish(result.text)
    ending = result.endings[result.sample_index]
    finish = "stop" if stopped or ending == "eos" else "length"
    choice = Choice(i, text, finish, returned_tokens(model, result.sample_tokens, text), run=info)
    post_choice(model, job, choice, rest)
    return choice


def post_choice(model, job: Job, choice: Choice, rest: str) -> None:
    """Report a finished choice (with its log-probabilities when asked) and the rest of its text."""
    spec = job.spec
    if spec.logprobs is not None and choice.text is not None:
        choice.logprobs = token_logprobs(model, job.prompt_ids, choice.tokens, spec.temperature, spec.logprobs,
                                         spec.endpoint)
    job.post("choice", choice, rest)


def outcome(stats: Stats, job: Job, choices: list[Choice], has_draft: bool) -> Outcome:
    spec = job.spec
    completion = sum(len(c.tokens) for c in choices)
    stats.add(prompt_tokens=len(job.prompt_ids), completion_tokens=completion)
    smc = {"strategy": spec.strategy, "runs": [c.run for c in choices], **_settings(spec, has_draft)}
    return Outcome(choices, len(job.prompt_ids), completion, smc)


def count(stats: Stats, result) -> None:
    """Add a result's work to the counters."""
    amounts = {"rounds": result.rounds, "particle_tokens": sum(len(t) for t in result.tokens)}
    if result.strategy == "smc" and result.ess:
        amounts.update(resampled_rounds=int(sum(result.resampled)), ess_rounds=len(result.ess),
                       ess_sum=sum(e / result.particles for e in result.ess))
    stats.add(**amounts)


def run_job(job: Job, run, stats: Stats) -> None:
    """``run(job)`` and report its outcome, its cancellation or its error to the job."""
    try:
        result = run(job)
    except Cancelled:
        stats.add(cancelled=1)
        job.post("error", Cancelled())
    except Exception as e:  # noqa: BLE001 - reported to the client (SMCDecodeError: a 400)
        job.post("error", e)
    else:
        job.post("done", result)


def _settings(spec: Spec, has_draft: bool) -> dict:
    if spec.strategy == "smc":
        return {"particles": spec.particles, "block_size": spec.block_size if has_draft else 0,
                "resampler": spec.resampler, "ess_threshold": spec.ess_threshold}
    if spec.strategy == "sd":
        return {"block_size": spec.block_size}
    return {}


def draft_temperature(spec: Spec, draft) -> float:
    """The request's draft temperature, else the draft's proposal temperature for the target's (a
    shipped or distilled draft says it; any other draft: the target's)."""
    if spec.draft_temperature is not None:
        return spec.draft_temperature
    from ..drafts import proposal_temperature

    try:
        return proposal_temperature(draft, spec.temperature)
    except (SMCDecodeError, AttributeError, KeyError, TypeError):
        return spec.temperature


def stream_commits(job: Job, stream: TextStream, index: int):
    """The ``Watch`` callback of choice ``index``: committed ids update its text, a streamed request
    gets each new piece; returns whether a stop sequence ended the text."""
    def on_commit(ids) -> bool:
        stream.ids = ids
        delta = stream.update(ids)
        if delta and job.spec.stream:
            job.post("delta", index, delta)
        return stream.stopped

    return on_commit
