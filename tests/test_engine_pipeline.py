"""The SMC-SD request loop's page bookkeeping (``Scheduler``): pipelined — the round's graph
forks the page table, copies the shared partial page and adds fresh pages from pages the host set
aside (``smc.pages_code``), the next round is launched before the host reads this one, and the
host books the same pages one round late (``PageTable.hold`` / ``reserve(held=...)``) — against the
unpipelined host bookkeeping: the same outputs for the same seed, end to end on a tiny random Llama
(CPU, and CUDA with graphs when marked ``gpu``), also when the pool is too small to set pages aside
every round; the same page tables and page contents step by step under random ancestors; and the
argument that picks one of the two."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from smcdecode.backends.engine import Engine, KVPool, Llama, LlamaConfig, PageTable
from smcdecode.backends.engine.graphs import GraphCache
from smcdecode.backends.engine.smc import pages_code
from smcdecode.errors import SMCDecodeError

transformers = pytest.importorskip("transformers")

V, EOS = 8, 5  # token 5: frequent under this random target, so EOS ends many particles early
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]

_MODELS: dict = {}


def _models(device: str) -> tuple[Llama, Llama]:
    """A 2-layer random target (vocabulary 8) and an unrelated 1-layer draft with other head
    shapes (so the two KV pools differ in layout): weights vary, particles get resampled."""
    if device not in _MODELS:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       rope_theta=10000.0, tie_word_embeddings=False)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            hf.lm_head.weight.normal_(0.0, 0.5)
        target = Llama.from_hf(hf, dtype=torch.float32, device=device)
        torch.manual_seed(1)
        draft = Llama(LlamaConfig(V, 32, 1, 2, 1, 48, rope_theta=10000.0)).eval().to(device)
        _MODELS[device] = (target, draft)
    return _MODELS[device]


# (prompts, N, K, max_new_tokens, eos, ess_threshold, page_size)
CASES = {
    "eos, 3 prompts, budget ends mid-block": ([[1, 2, 3, 4, 5], [6, 1, 2], [3, 3, 4, 5, 6, 1, 2, 3, 4]], 3, 2, 7, EOS,
                                              0.5, 4),
    "eos, always resample": ([[1, 2], [5, 6, 1, 2, 3, 4]], 4, 3, 13, EOS, 1.0, 4),
    "no eos, 3 new pages a round": ([[1, 2, 3, 4]], 8, 5, 20, None, 0.9, 2),
    "eos, K+1 < page size": ([[1, 2, 3], [4, 5, 6], [1, 2, 3, 4, 5, 6, 1], [2, 3]], 2, 1, 9, EOS, 1.0, 4),
    "no eos, many rounds": ([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2]], 5, 4, 31, None, 0.7, 3),
    "no eos, block of 4.5 pages": ([[1, 2]], 3, 8, 28, None, 1.0, 2),
}


# seeds under which the cases show what they are for (an EOS inside a block, a pool too tight to set
# pages aside, more than one round); the others use 7
SEEDS = {"eos, 3 prompts, budget ends mid-block": 10, "eos, always resample": 9}


def _run(device, prompts, N, K, n, eos, tau, PS, *, pipeline, num_pages=10_000, seed=7, **kw):
    target, draft = _models(device)
    engine = Engine(target, draft, num_pages=num_pages, page_size=PS)
    out = engine.smc_sd(prompts, particles=N, block_size=K, max_new_tokens=n, eos_token_id=eos, ess_threshold=tau,
                        seed=seed, pipeline=pipeline, record_weights=True, **kw)
    return out, engine


def _assert_same(a, b) -> None:
    for name in ("tokens", "lengths", "log_weights", "log_evidence", "finished", "drafted"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    assert a.rounds == b.rounds  # (peak pages may differ: pipelined, a finished request's pages go a round later)
    assert len(a.ess) == len(b.ess) == len(a.resampled) == len(b.resampled) == a.rounds
    for x, y in zip(a.ess, b.ess):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.resampled, b.resampled):
        np.testing.assert_array_equal(x, y)
    assert len(a.weights) == len(b.weights) == a.rounds
    for x, y in zip(a.weights, b.weights):
        assert torch.equal(x, y)


class _Holds:
    """Counts ``PageTable.hold`` calls that set pages aside and those that found too few free."""

    def __init__(self, monkeypatch):
        self.ok = self.short = 0
        hold = PageTable.hold

        def counting(table, n):
            try:
                pages = hold(table, n)
            except MemoryError:
                self.short += 1
                raise
            self.ok += 1
            return pages

        monkeypatch.setattr(PageTable, "hold", counting)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_rounds_give_the_unpipelined_outputs(case, device, monkeypatch):
    """Same seed, same tokens, lengths, weights, evidence, ESS, resampling flags and peak pages:
    pipelined on a roomy pool (pages set aside before every round but the last), and on the
    smallest pool the unpipelined bookkeeping runs in (its peak + the null page), where some rounds
    find too few free pages and fall back to being read before the next launch. On CUDA with the
    engine's default, CUDA graphs."""
    prompts, N, K, n, eos, tau, PS = CASES[case]
    holds = _Holds(monkeypatch)
    seed = SEEDS.get(case, 7)
    plain, _ = _run(device, prompts, N, K, n, eos, tau, PS, pipeline=False, seed=seed)
    assert holds.ok == holds.short == 0
    roomy, _ = _run(device, prompts, N, K, n, eos, tau, PS, pipeline=True, seed=seed)
    _assert_same(plain, roomy)
    # the first round captures and is read at once; later ones set pages aside (none once budgets end)
    assert holds.short == 0 and (holds.ok > 0 or roomy.rounds < 3) and holds.ok <= roomy.rounds
    assert any(r.any() for r in plain.resampled)  # particles were forked
    holds.ok = 0
    tight, _ = _run(device, prompts, N, K, n, eos, tau, PS, pipeline=True, num_pages=plain.peak_pages + 1,
                    seed=seed)
    _assert_same(plain, tight)
    assert holds.short > 0  # some rounds could not set pages aside
    if eos is not None:
        L = plain.lengths.cpu()
        assert ((L < n) & (L % (K + 1) != 0)).any()  # an EOS inside a block
    else:
        assert (plain.lengths.cpu() == n).all() and n % (K + 1) != 0  # the budget ends inside a block


@pytest.mark.parametrize("device", ["cpu"])
def test_pipelined_rounds_with_cached_graphs_match_the_unpipelined(device, monkeypatch):
    """The graph path: captured once (the capture's warm-up round forks the page table: it must be
    restored), replayed by a second call from the cache; when every particle finishes before the
    last round, no round is launched after that one.
    On the CPU the capture is stood in by a warm-up call of the round plus the eager round (the
    CUDA case of the test above runs real graphs)."""
    steps = [0]

    def counting_capture(self, fn, use_graphs):
        fn()  # the warm-up

        def counted():
            steps[0] += 1
            fn()

        return counted

    monkeypatch.setattr(GraphCache, "capture", counting_capture)
    prompts, N, K, n, eos, tau, PS = CASES["eos, 3 prompts, budget ends mid-block"]
    target, draft = _models(device)
    engine = Engine(target, draft, num_pages=200, page_size=PS, max_context=32)
    plain_engine = Engine(target, draft, num_pages=200, page_size=PS, max_context=32)  # same captures, same draws
    kw = dict(particles=N, block_size=K, max_new_tokens=n, eos_token_id=eos, ess_threshold=tau, use_graphs=True,
              record_weights=True)
    n_rounds = -(-n // (K + 1))
    early = 0
    for seed in (3, 4, 5, 6):  # the first call captures, the others replay from the cache
        steps[0] = 0
        piped = engine.smc_sd(prompts, seed=seed, pipeline=True, **kw)
        # no round after an early end: the host waits for the round in flight before launching the next
        # one where rows may end at EOS, and launches none when every particle finished in it
        assert steps[0] == piped.rounds
        early += piped.rounds < n_rounds
        plain = plain_engine.smc_sd(prompts, seed=seed, pipeline=False, **kw)
        _assert_same(plain, piped)
    assert early  # some call ended early
    assert len(engine.graphs) == len(plain_engine.graphs) == 1


def _contents(pool: KVPool, table: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """Keys of layer 0 at positions [0, length) of each row, read through its page table: [rows, length]."""
    PS = pool.page_size
    pos = torch.arange(length)
    return pool.k(0)[table[:rows, pos // PS].long(), 0, pos % PS, 0]


def _prefilled(B, N, K, P, num_pages, PS, lens, pools, g) -> PageTable:
    """A page table with every request's prompt written once into ``pools`` (both sets alike) and
    shared by its N rows (as ``prefill.start``), the first round's pages reserved and copied."""
    table = PageTable(B, P, num_pages, PS)
    for r0 in range(0, B, N):
        table.reserve(np.array([r0]), lens[r0 : r0 + 1])
        table.advance(np.array([r0]), lens[r0 : r0 + 1])
        pos = torch.arange(int(lens[r0]))
        pages = torch.from_numpy(table.table[r0, (pos // PS).numpy()]).long()
        for pool_a, pool_b in zip(*pools):
            for layer in range(pool_a.kv.shape[0]):
                vals = torch.randn(len(pos), generator=g)
                pool_a.kv[layer, 0, pages, 0, pos % PS, 0] = vals
                pool_b.kv[layer, 0, pages, 0, pos % PS, 0] = vals
        table.share_prefix(list(range(r0, r0 + N)), r0)
    src, dst = table.reserve(np.arange(B), lens + K + 1, write_from=lens - 1)
    for pool in pools[0] + pools[1]:
        pool.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
    return table


@pytest.mark.parametrize("G,N,K,PS,prompt_lens,rounds,seed", [
    (2, 4, 2, 4, [5, 9], 8, 0),
    (1, 8, 5, 2, [4], 6, 1),
    (3, 3, 1, 4, [2, 3, 7], 12, 2),
    (2, 5, 6, 3, [6, 3], 5, 3),
])
def test_device_bookkeeping_matches_page_table_under_random_forks(G, N, K, PS, prompt_lens, rounds, seed):
    """Round by round, as the pipelined request loop drives them: every row writes positions [T−1, T+K] into
    both pools (a target pool and a draft pool of another layout), then random ancestors within
    each request (or none). The device bookkeeping (``smc_pages``, on pages set aside by
    ``PageTable.hold``) leaves exactly the page table that the host's ``reserve(held=...)`` books
    one round later, and the same rows share the same pages with the same contents as under the
    unpipelined ``fork`` + ``reserve`` (other page ids); every third round gets no pages set aside
    (the device only forks, the host books and uploads, as the ``Scheduler`` does for a round it reads
    first); a last round flagged done changes nothing."""
    g = torch.Generator().manual_seed(seed)
    B = G * N
    F = 2 + (K + 1) // PS
    lens = np.repeat(np.array(prompt_lens) - 1, N)
    P = -(-(max(lens) + (rounds + 1) * (K + 1)) // PS) + 1
    worst = 1 + sum((c - 1) // PS + N * (-(-(c + (rounds + 1) * (K + 1)) // PS) - (c - 1) // PS) for c in lens[::N])
    num_pages = worst + 2 * B * F
    pools = {side: [KVPool(L, 1, 1, num_pages, PS, torch.float32, "cpu") for L in (2, 1)] for side in ("host", "dev")}
    plain = _prefilled(B, N, K, P, num_pages, PS, lens, (pools["host"], pools["dev"]), g)  # the unpipelined
    mirror = PageTable(B, P, num_pages, PS)  # the pipelined host's: same state as `plain` to begin with
    mirror.__dict__.update(copy.deepcopy(plain.__dict__))
    b = dict(pt=torch.from_numpy(plain.table.copy()), seq=torch.from_numpy(lens.copy()), index=torch.arange(B),
             fresh=torch.zeros(B, F, dtype=torch.long), K_row=torch.full((B,), K), W=torch.zeros(G, N))
    run_pages = pages_code(b, pools["dev"], PS)

    def pages(go=True):
        run_pages(torch.full((B,), go))

    for r in range(rounds + 1):
        seq = b["seq"].clone()
        pos = (seq - 1)[:, None] + torch.arange(K + 2)[None]  # [B, K+2]: positions T−1 .. T+K
        vals = torch.randn(B, K + 2, generator=g)
        for side, pt in (("host", torch.from_numpy(plain.table)), ("dev", b["pt"])):
            pg = pt.long().gather(1, pos // PS)
            for pool in pools[side]:
                for layer in range(pool.kv.shape[0]):
                    pool.kv[layer, 0, pg, 0, pos % PS, 0] = vals + layer
        new_lens = lens + K + 1
        # the pages set aside for the end of this round (as Scheduler._give)
        demand = 1 + (-(-(new_lens + K + 1) // PS)) + (new_lens // -PS)
        fresh = np.zeros((B, F), dtype=np.int64)
        aside = r % 3 != 2
        if aside:
            fresh[np.arange(F)[None] < demand[:, None]] = mirror.hold(int(demand.sum()))
        b["fresh"].copy_(torch.from_numpy(fresh))
        if r == rounds:  # every row finished: the round after it must change nothing
            before = (b["pt"].clone(), [p.kv.clone() for p in pools["dev"]])
            b["index"].copy_(torch.arange(B))
            pages(False)
            assert torch.equal(b["pt"], before[0])
            assert all(torch.equal(p.kv, kv) for p, kv in zip(pools["dev"], before[1]))
            mirror.unhold(fresh.reshape(-1))
            assert len(mirror.free) + mirror.used + 1 == num_pages  # every page set aside came back
            break
        if r % 4 == 3:
            idx = np.arange(B)
        else:
            idx = (np.arange(G)[:, None] * N + torch.randint(0, N, (G, N), generator=g).numpy()).reshape(-1)
        pre_fork = {"host": torch.from_numpy(plain.table.copy()), "dev": b["pt"].clone()}
        written = {s: [_contents(p, pre_fork[s], B, int(new_lens.max())) for p in pools[s]] for s in pools}
        plain.advance(np.arange(B), new_lens)
        plain.fork(idx)
        src, dst = plain.reserve(np.arange(B), new_lens + K + 1, write_from=new_lens - 1)
        for pool in pools["host"]:
            pool.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
        b["seq"].add_(K + 1)
        b["index"].copy_(torch.from_numpy(idx))
        pages()  # the device: fork, and with pages set aside, copies and new columns
        mirror.advance(np.arange(B), new_lens)  # the host, a round later
        mirror.fork(idx)
        if aside:
            mirror.reserve(np.arange(B), new_lens + K + 1, write_from=new_lens - 1, held=fresh)
        else:  # the host books it and uploads (as Engine.upload)
            src, dst = mirror.reserve(np.arange(B), new_lens + K + 1, write_from=new_lens - 1)
            for pool in pools["dev"]:
                pool.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
            b["pt"].copy_(torch.from_numpy(mirror.table))
        lens = new_lens

        host_pt, dev_pt = torch.from_numpy(plain.table).long(), b["pt"].long()
        assert torch.equal(dev_pt, torch.from_numpy(mirror.table).long()), r  # the same page ids
        assert mirror.used == plain.used and mirror.peak_used == plain.peak_used
        assert len(mirror.free) + mirror.used + 1 == num_pages  # nothing lost, nothing still set aside
        live = torch.arange(P)[None] < torch.from_numpy(plain.n_pages)[:, None]
        assert torch.equal(dev_pt[~live], host_pt[~live])  # unused entries: the null page
        for c in range(P):  # which rows share a page, column by column
            h, d = host_pt[:, c], dev_pt[:, c]
            assert torch.equal(h[:, None] == h[None], d[:, None] == d[None]), (r, c)
        # every row reads its ancestor's history (its positions < T'), on both sides and in both pools
        stored = torch.arange(int(lens.max()))[None] < torch.from_numpy(lens)[:, None]
        for side, pt in (("host", host_pt), ("dev", dev_pt)):
            for pool, before in zip(pools[side], written[side]):
                now = _contents(pool, pt, B, int(lens.max()))
                assert torch.equal(now[stored], before[torch.from_numpy(idx)][stored]), (side, r)
        # and the pages that the next round writes are the row's own
        nxt = dev_pt.gather(1, ((b["seq"] - 1)[:, None] + torch.arange(K + 2)[None]) // PS)
        for i in range(B):
            others = torch.cat([dev_pt[:i], dev_pt[i + 1 :]]).reshape(-1)
            assert not torch.isin(nxt[i], others).any(), (r, i)


def test_pipeline_argument_and_pool_errors(monkeypatch):
    """Pipelined by default; pipeline=False reads every round before the next. A pool below the
    first round's need is a clear error, and one that the bookkeeping outgrows raises MemoryError
    (pipelined or not)."""
    target, draft = _models("cpu")
    prompts, N, K, n, PS = [[1, 2, 3, 4, 5], [6, 1, 2]], 3, 2, 7, 4
    engine = Engine(target, draft, num_pages=10, page_size=PS)
    # request 0: 4 tokens cached, its first write at position 3 (column 0); after 3 rounds 13 positions
    # -> 4 columns each; request 1: 2 cached, 11 positions -> 3 columns each; + the null page
    assert engine.smc_page_bounds(prompts, N, K, n) == (1 + 3 * 2 + 3 * 2, 1 + 3 * 4 + 3 * 3)
    first, worst = engine.smc_page_bounds(prompts, N, K, n)
    holds = _Holds(monkeypatch)
    kw = dict(particles=N, block_size=K, max_new_tokens=n, seed=1)
    Engine(target, draft, num_pages=100, page_size=PS).smc_sd(prompts, **kw)
    # round 1 of 3 captures its round (read before the next launch), round 2 sets pages aside for
    # round 3, round 3 none (every budget ends in it)
    assert holds.ok == 1
    Engine(target, draft, num_pages=100, page_size=PS).smc_sd(prompts, pipeline=False, **kw)
    assert holds.ok == 1
    Engine(target, draft, num_pages=100, page_size=PS).smc_sd(prompts, pipeline=True, **kw)
    assert holds.ok == 2
    out = Engine(target, draft, num_pages=worst, page_size=PS).smc_sd(prompts, ess_threshold=0.0, **kw)
    assert out.peak_pages == worst - 1  # without resampling the bound is reached
    out = Engine(target, draft, num_pages=worst - 1, page_size=PS).smc_sd(prompts, ess_threshold=1.0, **kw)
    assert out.rounds == 3  # resampling every round shares pages: it fits
    for pipeline in (True, False):  # ... and without resampling it does not
        with pytest.raises(MemoryError, match="KV pool exhausted"):
            Engine(target, draft, num_pages=worst - 1, page_size=PS).smc_sd(prompts, ess_threshold=0.0,
                                                                            pipeline=pipeline, **kw)
    with pytest.raises(SMCDecodeError, match=rf"num_pages \({first - 1}\) is too small .* needs {first} pages"):
        Engine(target, draft, num_pages=first - 1, page_size=PS).smc_sd(prompts, **kw)


def test_pipelined_request_loop_with_requests_joining_freed_slots():
    """The request loop pipelined (a round launched before the one in flight is read) while
    requests keep joining: a request takes the slot of one that finished in the round in flight, so
    its rows must be booked by the host, not taken for rows the device set pages up for. Every request
    gets its whole budget, no page is left in use, and no page set aside is lost."""
    from smcdecode.backends.engine.scheduler import Request, Scheduler

    target, draft = _models("cpu")
    engine = Engine(target, draft, num_pages=400, page_size=4)
    sched = Scheduler(engine, slots=2, max_particles=3, max_block_size=2, eos_token_id=None, ess_threshold=0.9,
                      max_context=40, pipeline=True, seed=0)
    budgets = [4, 9, 3, 7, 5, 6]
    for i, n in enumerate(budgets):
        sched.submit(Request([1 + i % 5, 2, 3, 4], particles=3, block_size=2, max_new_tokens=n, id=i))
    done = {}
    steps = 0
    while sched.busy:
        for f in sched.step():
            done[f.request.id] = f
        steps += 1
        assert steps < 100
    assert sorted(done) == list(range(len(budgets)))
    for i, f in done.items():
        assert bool((f.lengths == budgets[i]).all()) and torch.isfinite(f.log_weights).all()
    assert sched.table.used == 0 and len(sched.table.free) == 400 - 1


@pytest.mark.parametrize("device", DEVICES)
def test_exact_only_rounds_pipelined_give_the_unpipelined_outputs(device, monkeypatch):
    """Exact-only rounds (exact.py) hold their pages from admission on, so they pipeline whatever
    each request's K: exact speculative decoding with K = 1, 2 and 3 in one scheduler, and
    autoregressive sampling (K = 0, a one-token prompt among them), give the same tokens, lengths and
    acceptance counts for the same seed pipelined (graphs) as read round by round (on the CPU the
    capture is stood in by the eager round)."""
    from smcdecode.backends.engine import Request, Scheduler

    if device == "cpu":
        monkeypatch.setattr(GraphCache, "capture", lambda self, fn, use_graphs: fn)
    target, draft = _models(device)
    for K, prompts in ((3, [[1, 2, 3, 4, 5], [6, 1, 2], [3, 3, 4, 5, 6, 1, 2, 3, 4]]), (0, [[1, 2, 3, 4, 5], [6], [3, 4]])):
        outs = []
        for pipeline in (False, True):
            engine = Engine(target, draft if K else None, num_pages=200, page_size=4, max_context=40)
            sched = Scheduler(engine, slots=len(prompts), max_particles=3, max_block_size=K, eos_token_id=EOS,
                              seed=5, use_graphs=True, pipeline=pipeline, shrink=False, exact_only=True)
            for g, p in enumerate(prompts):
                sched.submit(Request(p, particles=3, block_size=min(K, g + 1), max_new_tokens=9 + 4 * g,
                                     target_temperature=0.8 + 0.2 * g, id=g, exact=True))
            done = sorted(sched.run(), key=lambda f: f.request.id)
            outs.append([(f.tokens, f.lengths, f.accepted, f.drafted) for f in done])
        for a, b in zip(*outs):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), K
        lengths = torch.cat([f[1] for f in outs[0]])
        assert (lengths < torch.tensor([9] * 3 + [13] * 3 + [17] * 3)).any()  # an EOS ended some row early
