"""Mask worker processes (backends/engine/mask_workers.py): the engine's llguidance states held in
forked processes give the samples of the engine's own process, bit for bit; a worker that dies or a
bad setting is a clear error."""

from __future__ import annotations

import gc
import mmap
import os
import signal
import time
import weakref
from pathlib import Path

import pytest
import torch

import smcdecode as sd
from smcdecode.backends.engine.bridge import _ENGINES
from smcdecode.backends.engine.config import EngineConfig, check_options
from smcdecode.backends.engine.host_masks import HostMasks, RequestMasks
from smcdecode.backends.engine.mask_workers import default_workers
from smcdecode.potentials.json_schema import JSONSchema

OPEN = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name"], "additionalProperties": {"type": "integer"}}
# its strings held to lengths (OPEN's plain strings take their automata too: json_strings.py)
HELD = {**OPEN, "properties": {"name": {"type": "string", "maxLength": 16},
                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}}}


@pytest.mark.slow
@pytest.mark.parametrize("path, groups, workers, schema", [("llguidance", 3, 2, OPEN), ("superset", 3, 2, OPEN),
                                                           ("llguidance", 1, 3, OPEN), ("superset", 1, 3, OPEN),
                                                           ("llguidance", 2, 2, HELD)])
def test_engine_samples_the_same_with_mask_workers(model, path, groups, workers, schema):
    """``groups`` requests of four particles, SmolLM2 proposing to itself on the CPU engine, the same
    seed, an open object (the unique-key rule applies; strings held to lengths too) on llguidance's path (masks) or the superset
    path (the device automaton's proposal, llguidance's check of each round's tokens): with mask
    workers (which hold the requests' matchers; one request is held by all three, each filling a
    block of its rows) the tokens, lengths and weights equal those computed in the engine's process,
    and every finished document validates."""
    c = JSONSchema(schema, path=path)
    assert c.bind(model).key_rule and c.path == path
    assert c.bind(model)._strings is not None  # (the strings' masks from their automata, in the workers too)
    prompt = "Describe a cat as JSON with a name, tags and integer fields:"
    outs = []
    for w in (0, workers):
        smc = sd.SMC(sd.LM(model) * c, sd.Draft(model), particles=4, block_size=3, backend="engine",
                     engine_options={"host_workers": w})
        outs.append(smc.run_groups(prompt, groups, max_new_tokens=40, seed=5))
        (engine,) = _ENGINES[model].values()
        hosts = [engine.graphs[k].host for k in engine.graphs.keys() if getattr(engine.graphs[k], "host", None) is not None]
        assert hosts and all((h._pool is not None) == bool(w) for h in hosts)  # (the requests went there)
    a, b = outs
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.log_weights, b.log_weights)
    finished = 0
    for g in range(groups):
        for i in range(4):
            x = b.tokens[g, i, : b.lengths[g, i]].tolist()
            if x and x[-1] == model.eos_token_id and b.log_weights[g, i] > float("-inf"):
                assert c.bind(model).is_valid(model.decode(x[:-1])), model.decode(x)
                finished += 1
    # (several rounds each; documents finished: of three requests, where the first alone writes further keys)
    assert b.lengths.min() > 5 and (finished or groups == 1)


@pytest.mark.slow
def test_a_request_alone_is_shared_by_the_workers(model):
    """One request of five rows on three mask workers: each holds its states and fills a block of its
    rows (1, 2 and 2 rows); a second request, added later when no worker is free, goes whole to the
    one that fills fewest rows. Through two rounds with a resampling between them, every step's masks and the rows that
    accept equal those computed in this process."""
    c = JSONSchema(OPEN, path="llguidance").bind(model)
    hosts = [HostMasks(5, model.vocab_size, "cpu", rows=10, k_max=2, workers=w) for w in (0, 3)]
    g = torch.Generator().manual_seed(3)
    for _round in range(2):
        if _round == 1:
            for h in hosts:
                h.fork(torch.tensor([1, 1, 0, 4, 4, 5, 6, 7, 8, 9]))
                h.add(1, RequestMasks([c], 5, block_size=2, budget=100))
        else:
            for h in hosts:
                h.add(0, RequestMasks([c], 5, block_size=2, budget=100))
        drafts = torch.zeros(10, 2, dtype=torch.long)
        for h in hosts:
            h.begin(10, 2, drafts)
        for i in range(3):
            outs = [torch.empty(10, hosts[0].W, dtype=torch.int32) for _ in hosts]
            for h, out in zip(hosts, outs):
                h.mask(i, out)
            assert torch.equal(outs[0], outs[1]), (_round, i)
            allowed = torch.stack([(outs[0][:, t // 32] >> (t % 32)) & 1 for t in range(model.vocab_size)], 1).bool()
            allowed[:, model.eos_token_id] = False
            d = torch.multinomial(allowed.double() + 1e-30 * (~allowed.any(1, keepdim=True)), 1, generator=g)[:, 0]
            if i < 2:
                drafts[:, i] = d
            else:
                for h in hosts:
                    h.end(d, None)
        assert torch.equal(hosts[0].rejects(10), hosts[1].rejects(10))
    where = hosts[1]._pool.where
    assert where[0] == [(0, 0, 1), (1, 1, 3), (2, 3, 5)] and where[1] == [(0, 0, 5)]
    hosts[1].close()


@pytest.mark.slow
def test_placement_of_requests_added_together(model):
    """Three requests added together on three workers take one each, whole; two requests on three
    workers share them (1 and 2); a request whose rows fill no masks (checked) stays whole; placed at
    the next send, not at ``add``."""
    c = JSONSchema(OPEN, path="llguidance").bind(model)
    host = HostMasks(4, model.vocab_size, "cpu", rows=16, k_max=2, workers=3)
    host.add(0, RequestMasks([c], 4, block_size=2, budget=100))  # (starts the workers)
    pool = host._pool
    try:
        assert not pool.where and set(pool._pending) == {0}
        for slot in (1, 2):
            pool.add(slot, [c], 4, slot * 4)
        pool.send()
        assert sorted(pool.where.values()) == [[(0, 0, 4)], [(1, 0, 4)], [(2, 0, 4)]]
        pool.clear()
        pool.add(0, [c], 4, 0)
        pool.add(1, [c], 4, 4)
        pool.send()
        assert pool.where == {0: [(0, 0, 4)], 1: [(1, 0, 2), (2, 2, 4)]}
        pool.clear()
        pool.add(0, [c], 4, 0, share=False)
        pool.send()
        assert pool.where == {0: [(0, 0, 4)]}
    finally:
        host.close()


@pytest.mark.slow
def test_settle_waits_until_the_workers_hold_the_requests_added(model):
    """``settle`` (before a round whose device waits for the host's masks) sends the requests added
    and returns once the processes built them: nothing queued, no answer owed, each held."""
    c = JSONSchema(OPEN, path="llguidance").bind(model)
    host = HostMasks(4, model.vocab_size, "cpu", rows=8, k_max=2, workers=2)
    host.add(0, RequestMasks([c], 4, block_size=2, budget=100))  # (starts the workers)
    pool = host._pool
    try:
        pool.add(1, [c], 4, 4)
        pool.settle()
        assert set(pool.where) == {0, 1} and not any(pool._queued) and not any(pool._owed)
        assert pool.accepting([0, 1]) == {0: [False] * 4, 1: [False] * 4}
        pool.settle()  # (nothing added since: nothing sent)
        assert not any(pool._owed)
        # a new call's clear posts the reset and returns: its answer is owed until the next
        # operation that asks (here the settle before the call's first round), which collects it
        host.clear()
        assert pool._owed == pool._posted and not pool.where
        host.add(0, RequestMasks([c], 4, block_size=2, budget=100))
        pool.settle()
        assert set(pool.where) == {0} and not any(pool._owed)
        assert pool.accepting([0]) == {0: [False] * 4}
    finally:
        host.close()


@pytest.mark.slow
def test_idle_workers_sleep_and_a_post_wakes_them(model):
    """A worker idle past its watch flags its sleep on the bell; a batch posted then wakes it (the
    wake-up is skipped while every worker watches, so a lost one would leave the answer to the
    sleep's 1 s timeout)."""
    c = JSONSchema(OPEN, path="llguidance").bind(model)
    host = HostMasks(4, model.vocab_size, "cpu", rows=8, k_max=2, workers=2)
    host.add(0, RequestMasks([c], 4, block_size=2, budget=100))
    host.add(1, RequestMasks([c], 4, block_size=2, budget=100))
    pool = host._pool
    try:
        pool.settle()
        for _ in range(5):
            deadline = time.monotonic() + 5
            while not pool._asleep.all() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool._asleep.all()
            start = time.monotonic()
            assert pool.accepting([0, 1]) == {0: [False] * 4, 1: [False] * 4}
            assert time.monotonic() - start < 0.5
    finally:
        host.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_pinned_buffer_is_unpinned_without_an_error_left_behind():
    """On a GPU: the buffers of a round with host masks (HostMasks with mask workers: the columns, the
    step buffers, the sync lines) are pinned, and unpinned when it goes, each once, while still
    mapped (as CUDA asks), every unregistering accepted (0); the next CUDA work runs."""
    from smcdecode.backends.engine import mask_workers

    calls = []  # (address, still mapped?, CUDA's answer)
    real = torch.cuda.cudart

    class Recording:
        def __getattr__(self, name):
            return getattr(real(), name)

        def cudaHostUnregister(self, address):
            mapped = _mapped(address)
            calls.append((address, mapped, int(real().cudaHostUnregister(address))))
            return calls[-1][2]

    gc.collect()  # (buffers of earlier tests unpinned before the recording)
    try:
        torch.cuda.cudart = Recording
        host = HostMasks(4, 1000, "cuda", rows=8, k_max=4, workers=2)
        addresses = {torch.frombuffer(m, dtype=torch.uint8).data_ptr() for m in (host._shared, host._mem, host._syncmem)}
        del host
        gc.collect()
        mask_workers.unpin_deferred()
    finally:
        torch.cuda.cudart = real
    ours = [c for c in calls if c[0] in addresses]
    assert len(ours) == 3 and {c[0] for c in ours} == addresses
    assert all(mapped and code == 0 for _, mapped, code in ours)
    x = torch.arange(5, device="cuda") * 2
    torch.cuda.synchronize()
    assert x.tolist() == [0, 2, 4, 6, 8]


def test_a_buffer_freed_while_a_round_is_served_is_unpinned_after():
    """A pinned buffer freed while a round waits on the device for the host's masks is not unpinned
    then (that waits for the device, which waits for this host), but once the round is served."""
    from smcdecode.backends.engine import mask_workers

    unpinned = []

    class Cudart:  # (CUDA's own would refuse the made-up address and leave an error for later CUDA calls)
        def cudaHostUnregister(self, address):
            unpinned.append(address)
            return 0

    real, real_cudart = torch.cuda.synchronize, torch.cuda.cudart
    mem = mmap.mmap(-1, 4096)
    serving = mask_workers._SERVING[0]
    try:
        torch.cuda.synchronize, torch.cuda.cudart = lambda *a: unpinned.append("synchronized"), Cudart
        mask_workers._SERVING[0] += 1
        mask_workers._unpin(1234, mem)
        assert mask_workers._DEFERRED == [(1234, mem)] and not unpinned
        mask_workers._SERVING[0] -= 1
        mask_workers.unpin_deferred()
        assert not mask_workers._DEFERRED and unpinned == ["synchronized", 1234]
    finally:
        torch.cuda.synchronize, torch.cuda.cudart = real, real_cudart
        mask_workers._SERVING[0] = serving
        mask_workers._DEFERRED.clear()


def test_an_unpinning_cuda_refuses_is_a_warning_that_names_the_error():
    from smcdecode.backends.engine import mask_workers

    class Refusing:
        def cudaHostUnregister(self, address):
            return 713

    real, real_cudart = torch.cuda.synchronize, torch.cuda.cudart
    try:
        torch.cuda.synchronize, torch.cuda.cudart = (lambda *a: None), Refusing
        with pytest.warns(RuntimeWarning, match=r"refused to unpin 4096 bytes .*error 713"):
            mask_workers._unpin(1234, mmap.mmap(-1, 4096))
    finally:
        torch.cuda.synchronize, torch.cuda.cudart = real, real_cudart


def _mapped(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        first, end = (int(x, 16) for x in line.split()[0].split("-"))
        if first <= address < end:
            return True
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_pinned_buffer_is_unpinned_while_still_mapped_when_its_owner_goes():
    """A pinned buffer is unregistered while its pages are still mapped, as CUDA asks: the unpinning
    hangs on the buffer's owner and holds the mapping (an mmap's own finalizer runs after its pages
    are unmapped). CUDA's two calls are recorded here (no GPU needed): each buffer is registered
    once and unregistered once, mapped then, and let go after."""
    from smcdecode.backends.engine import mask_workers

    calls = []

    class Cudart:
        def cudaHostRegister(self, address, nbytes, flags):
            calls.append(("register", address, nbytes, _mapped(address)))
            return 0

        def cudaHostUnregister(self, address):
            calls.append(("unregister", address, None, _mapped(address)))
            return 0

    class Owner:  # (any object that takes weak references: the buffers' unpinning hangs on it)
        pass

    real_cudart, real_sync = torch.cuda.cudart, torch.cuda.synchronize
    try:
        torch.cuda.cudart, torch.cuda.synchronize = Cudart, lambda *a: None
        owner = Owner()
        mems = [mask_workers.shared_buffer(n, True, owner) for n in (5000, 1 << 20)]
        addresses = [torch.frombuffer(m, dtype=torch.uint8).data_ptr() for m in mems]
        alive = [weakref.ref(m) for m in mems]
        assert [c[0] for c in calls] == ["register", "register"] and all(c[3] for c in calls)
        del mems
        gc.collect()
        assert len(calls) == 2 and all(_mapped(a) for a in addresses)  # (pinned while the owner lives)
        del owner
        gc.collect()
        assert sorted(c[1] for c in calls[2:]) == sorted(addresses)
        assert [c[0] for c in calls[2:]] == ["unregister"] * 2 and all(c[3] for c in calls[2:])
        assert not any(r() for r in alive)  # (the mappings let go once unpinned)
        with pytest.raises(ValueError, match="owner"):
            mask_workers.shared_buffer(4096, True)
    finally:
        owner = mems = None  # noqa: F841 - (a failure above: their unpinning runs now, with the recording cudart)
        gc.collect()
        torch.cuda.cudart, torch.cuda.synchronize = real_cudart, real_sync


def _first_step(host, c, slot=0):
    """Request ``slot`` (2 rows of ``c``) added, a round begun and its first masks: (masks, the rows
    that do not accept)."""
    host.add(slot, RequestMasks([c], 2, block_size=2, budget=100))
    out = torch.empty(4, host.W, dtype=torch.int32)
    host.begin(4, 2, torch.zeros(4, 2, dtype=torch.long))
    host.mask(0, out)
    return out, host.rejects(4)


@pytest.mark.slow
def test_a_worker_that_dies_is_a_clear_error_and_the_next_call_starts_new_ones(model):
    c = JSONSchema(OPEN, path="llguidance").bind(model)
    ref_out, ref_rejects = _first_step(HostMasks(2, model.vocab_size, "cpu"), c)  # (in this process)
    host = HostMasks(2, model.vocab_size, "cpu", rows=4, k_max=2, workers=1)
    out, rejects = _first_step(host, c)
    assert torch.equal(out, ref_out) and torch.equal(rejects, ref_rejects) and (out[2:] == -1).all()
    os.kill(host._pool._procs[0].pid, signal.SIGINT)  # (Ctrl-C is the main process's: ignored)
    time.sleep(0.2)
    assert host._pool.usable
    os.kill(host._pool._procs[0].pid, signal.SIGKILL)
    host._pool._procs[0].join(5)
    with pytest.raises(sd.SMCDecodeError, match="worker process .* ended .*host_workers=0"):
        host.rejects(4)
    host.clear()  # (a new call: the dead workers are replaced)
    out, rejects = _first_step(host, c)
    assert host._pool.usable and torch.equal(out, ref_out) and torch.equal(rejects, ref_rejects)
    host.close()


@pytest.mark.slow
def test_operations_left_by_a_failed_call_do_not_reach_the_next(model):
    """A call that raised between queueing and sending (here: a check of slot 0's rows by an EOS that
    would kill them and an accepting question, never sent) leaves nothing behind once the next call's
    scheduler clears the host: its first step's masks and verdicts are those of a fresh request."""
    c = JSONSchema(OPEN, path="llguidance").bind(model)
    ref_out, ref_rejects = _first_step(HostMasks(2, model.vocab_size, "cpu"), c)
    host = HostMasks(2, model.vocab_size, "cpu", rows=4, k_max=2, workers=1)
    _first_step(host, c)
    host._pool.check(0, [[model.eos_token_id]] * 2)
    host._pool._queued[0].append(("accepting", 0))
    host.clear()
    out, rejects = _first_step(host, c)
    assert torch.equal(out, ref_out) and torch.equal(rejects, ref_rejects)
    host.close()


@pytest.mark.slow
def test_a_request_a_worker_cannot_build_is_a_prompt_error(model, monkeypatch):
    """A request whose constraint fails to build in its worker (compiled there from its grammar): the
    first step of its round raises that failure, at once, and the next call starts afresh."""
    from smcdecode.backends.engine import mask_process

    c = JSONSchema(OPEN, path="llguidance").bind(model)
    ref_out, _ = _first_step(HostMasks(2, model.vocab_size, "cpu"), c)
    host = HostMasks(2, model.vocab_size, "cpu", rows=4, k_max=2, workers=1)

    def refused(spec, *args):
        raise RuntimeError("no grammar here")

    monkeypatch.setattr(mask_process, "_rebuilt", refused)  # (the worker, forked after this, inherits it)
    t0 = time.perf_counter()
    with pytest.raises(sd.SMCDecodeError, match="worker process failed: RuntimeError: no grammar here"):
        _first_step(host, c)
    assert time.perf_counter() - t0 < 30  # (not the workers' 300 s timeout)
    monkeypatch.undo()
    host.close()  # (its workers run the refusing build: new ones)
    out, _ = _first_step(host, c)
    assert torch.equal(out, ref_out)
    host.close()


def test_host_workers_setting():
    assert EngineConfig(num_pages=4).resolved(torch.float32, torch.device("cpu")).host_workers == 0
    assert default_workers("cpu") == 0
    assert EngineConfig(num_pages=4, host_workers=3).resolved(torch.float32, torch.device("cpu")).host_workers == 3
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(sd.SMCDecodeError, match="host_workers must be an integer >= 0"):
            EngineConfig(num_pages=4, host_workers=bad)
        with pytest.raises(sd.SMCDecodeError, match="host_workers must be an integer >= 0"):
            check_options({"host_workers": bad})
    assert check_options({"host_workers": 2}) == {"host_workers": 2}


def test_default_workers_on_a_gpu_host(monkeypatch):
    """One process per two cores, at most 8, on a GPU host of 8 or more cores (a process fills in one thread)."""
    from smcdecode.backends.engine import mask_workers

    for cores, expected in ((4, 0), (7, 0), (8, 4), (16, 8), (64, 8)):
        monkeypatch.setattr(mask_workers, "_cores", lambda cores=cores: cores)
        assert default_workers("cuda") == expected, cores


@pytest.mark.slow
def test_idle_workers_of_another_round_shape_make_way(model, monkeypatch):
    """Beyond ``MAX_LIVE`` sets of workers, a new set stops an idle one; its HostMasks starts a new
    set at its next request, with the same masks."""
    from smcdecode.backends.engine import mask_workers

    monkeypatch.setattr(mask_workers, "MAX_LIVE", 1)
    c = JSONSchema(OPEN, path="llguidance").bind(model)
    ref_out, _ = _first_step(HostMasks(2, model.vocab_size, "cpu"), c)
    a = HostMasks(2, model.vocab_size, "cpu", rows=4, k_max=2, workers=1)
    b = HostMasks(2, model.vocab_size, "cpu", rows=4, k_max=2, workers=1)
    _first_step(a, c)
    a.remove(0)  # (a holds no request: idle)
    first = a._pool
    out, _ = _first_step(b, c)
    assert first.closed and b._pool.usable and torch.equal(out, ref_out)
    b.remove(0)
    a.clear()
    out, _ = _first_step(a, c)
    assert a._pool is not first and a._pool.usable and torch.equal(out, ref_out) and b._pool.closed
    a.close()
    b.close()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_superset_rounds_pipelined_give_the_unpipelined_outputs(model, monkeypatch, workers):
    """Superset-path requests (checked after each proposal, no host masks) on the CPU engine:
    pipelined — the next round launched before the host reads the last one, which it reads while the
    proposal runs, before the check — the tokens, lengths and weights equal those of rounds read
    before the next launch, with the checks in this process and in mask workers."""
    from functools import partialmethod

    from smcdecode.backends.engine import scheduler
    from smcdecode.backends.engine.engine import Engine
    from smcdecode.backends.engine.kv_cache import PageTable
    from smcdecode.backends.engine.targets import EngineTarget

    c = JSONSchema(OPEN, path="superset")
    prompt = "Describe a cat as JSON with a name, tags and integer fields:"
    smc_sd, run_round = Engine.smc_sd, scheduler.run_round
    read_meanwhile = []

    def counted(*a, **k):
        read_meanwhile.append(k.get("meanwhile") is not None)
        return run_round(*a, **k)

    monkeypatch.setattr(scheduler, "run_round", counted)
    outs = []
    for pipeline in (False, True):
        monkeypatch.setattr(Engine, "smc_sd", partialmethod(smc_sd, pipeline=pipeline))
        read_meanwhile.clear()
        smc = sd.SMC(sd.LM(model) * c, sd.Draft(model), particles=4, block_size=3, backend="engine",
                     engine_options={"host_workers": workers})
        outs.append(smc.run_groups(prompt, 3, max_new_tokens=40, seed=5))
        assert any(read_meanwhile) == pipeline, read_meanwhile  # (the pipelined run read rounds meanwhile)
    a, b = outs
    assert a.rounds == b.rounds > 2
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.log_weights, b.log_weights)
    # requests of other budgets, which end in other rounds (a request released while the next
    # round's proposal runs), straight on the engine
    (engine,) = _ENGINES[model].values()
    ids = model.encode(prompt)
    program = EngineTarget.of(sd.LM(model) * c)
    # and pipelined with no pages set aside every other round (a pool too tight: such a round is read
    # at once, and the round in flight before it still goes to the host states before its check)
    set_aside, calls, short, runs = PageTable.set_aside, [0], [False], []

    def sometimes(self, *a, **k):
        calls[0] += 1
        return None if calls[0] % 2 == 0 and short[0] else set_aside(self, *a, **k)

    monkeypatch.setattr(PageTable, "set_aside", sometimes)
    for pipeline, tight in ((False, False), (True, False), (True, True)):
        read_meanwhile.clear()
        short[0] = tight
        runs.append(smc_sd(engine, [ids] * 3, particles=4, block_size=3, max_new_tokens=[5, 30, 14], target=program,
                           eos_token_id=model.eos_token_id, seed=3, pipeline=pipeline, record_weights=True))
        assert any(read_meanwhile) == pipeline
    a = runs[0]
    for b in runs[1:]:
        assert a.rounds == b.rounds and torch.equal(a.lengths, b.lengths) and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.log_weights, b.log_weights)


@pytest.mark.slow
def test_clear_graphs_stops_the_mask_workers_at_once(model):
    """``Engine.clear_graphs``: the rounds' mask worker processes stop then, even where the rounds are
    still referenced (here: their HostMasks, kept by the test), and the next call starts new ones
    and samples as before."""
    c = JSONSchema(OPEN, path="llguidance")
    smc = sd.SMC(sd.LM(model) * c, sd.Draft(model), particles=2, block_size=2, backend="engine",
                 engine_options={"host_workers": 1})
    first = smc.run_groups("A cat as JSON:", 1, max_new_tokens=6, seed=3)
    (engine,) = [e for e in _ENGINES[model].values() if e.config.host_workers == 1]
    hosts = [engine.graphs[k].host for k in engine.graphs.keys() if getattr(engine.graphs[k], "host", None) is not None]
    pools = [h._pool for h in hosts if h._pool is not None]
    procs = [p for pool in pools for p in pool._procs]
    assert pools and all(p.is_alive() for p in procs)
    engine.clear_graphs()
    assert all(pool.closed for pool in pools) and not any(p.is_alive() for p in procs)
    assert all(h._pool is None for h in hosts)
    again = smc.run_groups("A cat as JSON:", 1, max_new_tokens=6, seed=3)
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.log_weights, first.log_weights)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schema", [OPEN, HELD])
def test_rounds_the_workers_serve_on_a_gpu_sample_as_the_engine_process_does(schema):
    """On a GPU a round is one CUDA graph that waits at each host point. With mask workers holding
    every masked request, the workers serve the round's points on their own (host_points.py: the
    device hands each column over with a flag they watch, and waits for each worker's count): the
    tokens, lengths and weights equal those of the engine's process serving every point itself
    (no workers), for three requests of four particles over several rounds, one request alone
    (shared by the workers) and a request whose particles are resampled."""
    model = sd.load_model(device="cuda")
    c = JSONSchema(schema, path="llguidance")
    prompt = "Describe a cat as JSON with a name, tags and integer fields:"
    for groups in (3, 1):
        outs = []
        for w in (0, 2):
            smc = sd.SMC(sd.LM(model) * c, sd.Draft(model), particles=4, block_size=3, backend="engine",
                         engine_options={"host_workers": w})
            outs.append(smc.run_groups(prompt, groups, max_new_tokens=40, seed=5))
            engine = next(e for e in _ENGINES[model].values() if e.config.host_workers == w)
            hosts = [engine.graphs[k].host for k in engine.graphs.keys()
                     if getattr(engine.graphs[k], "host", None) is not None]
            assert hosts and all(h.waits for h in hosts)  # (rounds launched whole: the served path)
            assert all((h._pool is not None) == bool(w) for h in hosts)
        a, b = outs
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.tokens, b.tokens), groups
        assert torch.equal(a.log_weights, b.log_weights), groups
        assert b.lengths.min() > 5


@pytest.mark.slow
def test_a_plan_the_workers_serve_gives_the_masks_of_the_engine_process(model):
    """The host points of rounds the mask workers serve on their own (host_points.py: one plan record,
    the drafted columns and a flag in shared memory, each worker's count), with a thread here playing
    the device: it waits for every count, reads the point's masks, draws the next column from them
    and hands it over with its flag. Through three rounds with resamplings between them (two requests
    of 3 and 2 rows of N_max 4, so some rows no request constrains; in the last round one request
    left), every point's masks equal those the engine's process computes itself from the same
    tokens, and the counts end where the plans say."""
    import threading

    c = JSONSchema(HELD, path="llguidance").bind(model)
    d = JSONSchema(OPEN, path="llguidance").bind(model)
    V, K, rows = model.vocab_size, 2, 8
    host = HostMasks(4, V, "cpu", rows=rows, k_max=K, workers=2)
    host._init_points(pin=False)  # (the sync lines a GPU's HostMasks has, in plain shared memory)
    host.waits = True
    ref = HostMasks(4, V, "cpu", rows=rows, k_max=K, workers=0)
    for h in (host, ref):
        h.add(0, RequestMasks([c], 3, block_size=K, budget=100))
        h.add(1, RequestMasks([d], 2, block_size=K, budget=100))
    g = torch.Generator().manual_seed(7)

    def draw(bits: torch.Tensor) -> torch.Tensor:
        allowed = torch.stack([(bits[:, t // 32] >> (t % 32)) & 1 for t in range(V)], 1).bool()
        allowed[:, model.eos_token_id] = False
        return torch.multinomial(allowed.double() + 1e-30 * (~allowed.any(1, keepdim=True)), 1, generator=g)[:, 0]

    for _round in range(3):
        if _round == 2:
            for h in (host, ref):
                h.remove(0)
        for h in (host, ref):
            h.begin(rows, K, torch.zeros(rows, K, dtype=torch.long), handed=True)
        base, seen, failed = host._count, [], []

        def device(base=base, seen=seen, failed=failed):
            try:
                for i in range(K + 1):
                    deadline = time.monotonic() + 60
                    while host._counts.min() < base + i + 1:
                        assert time.monotonic() < deadline, f"point {i} never counted"
                    bits = host._bits[0][:rows].clone()
                    tokens = draw(bits)
                    seen.append((bits, tokens))
                    if i < K:
                        host._handed[i, :rows] = tokens
                        host._flag[0] = base + i + 1
            except BaseException as e:  # noqa: BLE001 - reported below
                failed.append(e)
                host._counts[:] = 2**62

        player = threading.Thread(target=device, daemon=True)
        player.start()
        host.serve()
        player.join(60)
        assert not failed and len(seen) == K + 1
        assert host._count == base + K + 1 and (host._counts == base + K + 1).all()
        for i, (bits, tokens) in enumerate(seen):
            out = torch.empty(rows, host.W, dtype=torch.int32)
            ref.mask(i, out)
            assert torch.equal(out, bits), (_round, i)
            if i < K:
                ref.hand_over(i, tokens)
        bonus = seen[-1][1]
        for h in (host, ref):
            h.end(bonus)
        index = torch.tensor([1, 1, 0, 3, 5, 4, 6, 7]) if _round == 0 else torch.arange(rows)
        for h in (host, ref):
            h.fork(index)
    host.close()


@pytest.mark.slow
def test_a_plan_called_off_stops_its_workers_counting(model):
    """``MaskWorkers.abort`` (what ``HostMasks.release`` does first after an error): workers serving a
    plan whose drafted columns never come stop waiting at once and count no further point, so the
    release's reset of the counts is not overwritten afterwards."""
    import threading

    c = JSONSchema(OPEN, path="llguidance").bind(model)
    host = HostMasks(4, model.vocab_size, "cpu", rows=4, k_max=2, workers=2)
    host._init_points(pin=False)
    host.waits = True
    host.add(0, RequestMasks([c], 4, block_size=2, budget=100))
    host.begin(4, 2, torch.zeros(4, 2, dtype=torch.long), handed=True)
    served = threading.Thread(target=host.serve, daemon=True)
    served.start()
    deadline = time.monotonic() + 60
    while host._counts[1:].min() < 1:  # (point 0 needs no column: both workers count it)
        assert time.monotonic() < deadline
    time.sleep(0.2)  # (the workers now wait for column 0, which no device hands over)
    assert host._counts[1:].max() == 1 and served.is_alive()
    t0 = time.monotonic()
    host._pool.abort()
    served.join(10)
    assert not served.is_alive() and time.monotonic() - t0 < 5
    time.sleep(0.2)
    assert (host._counts[1:] == 1).all()  # (no further point counted)
    host.close()
