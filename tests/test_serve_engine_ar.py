"""Autoregressive requests on the server's engine executor: the second scheduler (target as
proposal, one particle a choice, no resampling) batches them continuously. In-process, on the CPU
(the engine's torch path), with a tiny random Llama whose distributions can be enumerated exactly."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama_pair

import smcdecode as sd
from smcdecode.serve.engine_executor import SchedulerExecutor
from smcdecode.serve.executor import Job
from smcdecode.serve.protocol import Defaults, Limits, parse
from smcdecode.serve.watch import Cancelled, WatchedModel
from smcdecode.testing import chi_square_pvalue, exact_autoregressive

pytest.importorskip("transformers")
PROMPT = [0, 1, 2]
LIMITS = Limits(max_particles=2, max_block_size=2, max_n=4, max_tokens=40)
DEFAULTS = Defaults(particles=2, block_size=2)


@pytest.fixture(scope="module")
def served():
    """(executor, event loop, target model): 4 AR slots, 2 SMC slots, context 64."""
    target, draft = tiny_llama_pair("cpu", head_std=0.3, value_scale=20.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ex = SchedulerExecutor(WatchedModel(target), "tiny", draft, limits=LIMITS, defaults=DEFAULTS, max_queue=2000,
                           slots=2, max_particles=2, max_block_size=2, context=64, ar_slots=4, seed=0)
    yield ex, loop, target
    ex.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _job(ex, loop, **body) -> Job:
    spec = parse({"prompt": PROMPT, "strategy": "ar", **body}, "completions", LIMITS, DEFAULTS)
    job = Job(spec, list(PROMPT), None, "tiny", loop)
    assert ex.lane(job) == ("api" if body.get("seed") is not None else "ar")
    ex.submit(job)
    return job


def _event(job, loop, timeout=60):
    return asyncio.run_coroutine_threadsafe(asyncio.wait_for(job.events.get(), timeout), loop).result()


def _collect(job, loop):
    """(the streamed text of each choice: deltas and the rest sent with it, the choices, the outcome)."""
    text: dict[int, str] = {}
    deltas: dict[int, int] = {}
    choices = {}
    while True:
        kind, *rest = _event(job, loop)
        if kind == "delta":
            text[rest[0]] = text.get(rest[0], "") + rest[1]
            deltas[rest[0]] = deltas.get(rest[0], 0) + 1
        elif kind == "choice":
            choice, tail = rest
            text[choice.index] = text.get(choice.index, "") + tail
            choices[choice.index] = choice
        elif kind == "done":
            return text, deltas, choices, rest[0]
        else:
            raise AssertionError(f"unexpected event {kind}: {rest}")


def test_ar_streams_token_by_token_and_later_requests_join_mid_run(served):
    ex, loop, _ = served
    long = _job(ex, loop, max_tokens=40, temperature=0.8, stream=True, n=2)
    kind, index, first = _event(long, loop)  # the long request is running and streaming
    assert kind == "delta" and first
    short = _job(ex, loop, max_tokens=3, temperature=0.8, stream=True)
    s_text, _, s_choices, _ = _collect(short, loop)
    text, deltas, choices, out = _collect(long, loop)
    text[index] = first + text.get(index, "")
    deltas[index] = deltas.get(index, 0) + 1
    for i, c in choices.items():
        assert text[i] == c.text  # the streamed pieces concatenate to the final text
        assert c.run["rounds"] == c.run["particle_tokens"] >= len(c.tokens)  # one token a round
    assert s_text[0] == s_choices[0].text
    # the short request joined the AR scheduler while the long one ran
    joined, left = s_choices[0].run["scheduler_rounds"]
    longest = max(choices.values(), key=lambda c: c.run["scheduler_rounds"][1])
    l_joined, l_left = longest.run["scheduler_rounds"]
    assert l_joined < joined < l_left, (longest.run, s_choices[0].run)
    # the long request streamed its first piece while it ran, and more pieces after it (how many
    # pieces each choice's text comes in depends on how often the host reads rounds: under load one
    # choice's whole text may come in one piece)
    if len(longest.tokens) > 5:
        assert sum(deltas.values()) > 1, deltas
    assert out.smc["strategy"] == "ar" and len(out.choices) == 2
    assert ex.gauges()["smcdecode_kv_pages_in_use"] == 0


def test_the_device_thread_records_the_wait_a_request_ends(served):
    ex, loop, _ = served
    deadline = time.time() + 60
    while any(s.busy for s in ex.schedulers) or ex.live:
        assert time.time() < deadline, "the executor did not go idle"
        time.sleep(0.01)
    time.sleep(0.05)  # (the device thread waits for work now)
    submitted = time.perf_counter()
    _collect(_job(ex, loop, max_tokens=2), loop)
    ended_by_it = [(a, b) for a, b in ex.idle_waits if b >= submitted]
    assert ended_by_it, list(ex.idle_waits)[-3:]
    began, ended = ended_by_it[0]
    assert began < submitted <= ended


def test_ar_samples_the_models_distribution(served):
    """600 AR choices of 3 tokens through the scheduler against exact enumeration of p_T, compared
    as what the server returns: (text, whether EOS ended it)."""
    ex, loop, target = served
    exact = exact_autoregressive(sd.LM(target, temperature=0.8), PROMPT, 3)
    eos = target.eos_token_id
    cells: dict[tuple, float] = {}
    for seq, p in exact.probs.items():
        key = (target.decode([t for t in seq if t != eos]), seq[-1] == eos)
        cells[key] = cells.get(key, 0.0) + p
    index = {key: k for k, key in enumerate(cells)}
    jobs = [_job(ex, loop, max_tokens=3, temperature=0.8, n=4) for _ in range(150)]
    seen = []
    for job in jobs:
        _, _, choices, _ = _collect(job, loop)
        seen += [index.get((c.text, c.finish_reason == "stop"), -1) for c in choices.values()]
    assert len(seen) == 600 and -1 not in seen  # every answer is one the model can give
    # (the cells as one-token sequences, for the helper's binning of rare cells)
    out = SimpleNamespace(tokens=torch.tensor(seen)[:, None, None], lengths=torch.ones(600, 1, dtype=torch.long),
                          log_weights=torch.zeros(600, 1, dtype=torch.float64))
    assert chi_square_pvalue(out, {(k,): p for key, p in cells.items() for k in [index[key]]}) > 1e-4


def test_seeded_ar_stays_reproducible_and_a_cancel_frees_the_slot(served):
    ex, loop, _ = served
    a = _collect(_job(ex, loop, max_tokens=6, temperature=0.8, seed=5), loop)[2][0]
    b = _collect(_job(ex, loop, max_tokens=6, temperature=0.8, seed=5), loop)[2][0]
    assert a.tokens == b.tokens
    cancelled = ex.stats.cancelled
    job = _job(ex, loop, max_tokens=40, temperature=0.8, stream=True)
    assert _event(job, loop)[0] == "delta"  # running: it holds a slot and pages
    assert ex.pages_in_use > 0
    ex.cancel(job)
    event = _event(job, loop)
    while event[0] == "delta":
        event = _event(job, loop)
    assert event[0] == "error" and isinstance(event[1], Cancelled)
    assert all(r is None for r in ex.ar.requests) and not ex.ar.queue
    assert ex.pages_in_use == 0 and ex.stats.cancelled == cancelled + 1
