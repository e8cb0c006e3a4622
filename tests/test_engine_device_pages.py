"""The fused SMC-SD round's page bookkeeping on the device (``Engine._smc_pages``: fork, reference
counts, copy-on-write of the shared partial page, fresh pages, all in the round's graph) against
the host bookkeeping (``PageTable``): the same outputs for the same seed, end to end on a tiny random
Llama (CPU, and CUDA with graphs when marked ``gpu``), the same page sharing and page contents
step by step under random ancestors, and the rule that picks one of the two."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from smcdecode.backends.engine import Engine, KVPool, Llama, LlamaConfig, PageTable
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


def _run(device, prompts, N, K, n, eos, tau, PS, *, device_pages, num_pages=None, seed=7, **kw):
    target, draft = _models(device)
    engine = Engine(target, draft, num_pages=num_pages or 10_000, page_size=PS)
    if num_pages is None:  # the smallest pool that the device bookkeeping accepts
        engine = Engine(target, draft, num_pages=engine.smc_page_bounds(prompts, N, K, n)[1], page_size=PS)
    out = engine.smc_sd(prompts, particles=N, block_size=K, max_new_tokens=n, eos_token_id=eos, ess_threshold=tau,
                        seed=seed, device_pages=device_pages, record_weights=True, **kw)
    return out, engine


def _assert_same(a, b) -> None:
    for name in ("tokens", "lengths", "log_weights", "log_evidence", "finished", "drafted"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    assert a.rounds == b.rounds and a.peak_pages == b.peak_pages
    assert len(a.ess) == len(b.ess) == len(a.resampled) == len(b.resampled) == a.rounds
    for x, y in zip(a.ess, b.ess):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.resampled, b.resampled):
        np.testing.assert_array_equal(x, y)
    assert len(a.weights) == len(b.weights) == a.rounds
    for x, y in zip(a.weights, b.weights):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_device_pages_give_the_host_bookkeepings_outputs(case, device, monkeypatch):
    """Same seed, same tokens, lengths, weights, evidence, ESS, resampling flags and peak pages, on
    the smallest pool the device path accepts (so pages are freed and handed out again). On CUDA
    both run eagerly: under CUDA graphs the two differed on an H200 (session 3) and the engine now
    refuses that combination; eagerly they agreed there in tokens and log Z, bit for bit, in all six
    cases (benchmarks/device_pages_diag.py; this test's full comparison has not run on a GPU yet)."""
    prompts, N, K, n, eos, tau, PS = CASES[case]
    handed_out = [0]
    alloc = PageTable._alloc

    def counting_alloc(self, k):
        handed_out[0] += k
        return alloc(self, k)

    monkeypatch.setattr(PageTable, "_alloc", counting_alloc)
    eager = dict(use_graphs=False) if device == "cuda" else {}
    host, engine = _run(device, prompts, N, K, n, eos, tau, PS, device_pages=False, **eager)
    dev, _ = _run(device, prompts, N, K, n, eos, tau, PS, device_pages=True, **eager)
    _assert_same(host, dev)
    assert any(r.any() for r in host.resampled)  # particles were forked
    assert handed_out[0] > engine.num_pages - 1  # more pages handed out than the pool holds: reuse
    if eos is not None:
        L = host.lengths.cpu()
        assert ((L < n) & (L % (K + 1) != 0)).any()  # an EOS inside a block
    else:
        assert (host.lengths.cpu() == n).all() and n % (K + 1) != 0  # the budget ends inside a block


@pytest.mark.parametrize("device", ["cpu"])  # (CUDA graphs with device pages are refused: see above)
def test_device_pages_with_cached_graphs_match_the_host_bookkeeping(device, monkeypatch):
    """The graph path: captured once (the capture's warm-up round moves the page table on: it must
    be restored), replayed by a second call from the cache; rounds run one past the last (the
    no-op round the host launches before it reads the "all finished" flag) and change nothing.
    On the CPU the capture is stood in by a warm-up call of the round plus the eager round."""
    monkeypatch.setattr(Engine, "_capture", lambda self, fn, use_graphs: (fn(), fn)[1])
    steps = [0]
    capture = Engine._capture

    def counting_capture(self, fn, use_graphs):
        step = capture(self, fn, use_graphs)

        def counted():
            steps[0] += 1
            step()

        return counted

    monkeypatch.setattr(Engine, "_capture", counting_capture)
    prompts, N, K, n, eos, tau, PS = CASES["eos, 3 prompts, budget ends mid-block"]
    target, draft = _models(device)
    pages = Engine(target, draft, num_pages=10, page_size=PS).smc_page_bounds(prompts, N, K, n)[1]
    engine = Engine(target, draft, num_pages=pages, page_size=PS, max_context=32)
    host_engine = Engine(target, draft, num_pages=pages, page_size=PS, max_context=32)  # same captures, same draws
    kw = dict(particles=N, block_size=K, max_new_tokens=n, eos_token_id=eos, ess_threshold=tau, use_graphs=True,
              record_weights=True)
    for seed in (3, 4):  # the first call captures, the second replays from the cache
        steps[0] = 0
        dev = engine.smc_sd(prompts, seed=seed, device_pages=True, **kw)
        assert steps[0] == dev.rounds + 1  # one no-op round after the last
        host = host_engine.smc_sd(prompts, seed=seed, device_pages=False, **kw)
        _assert_same(host, dev)
    assert len(engine._graphs) == len(host_engine._graphs) == 1


def _fake_engine(PS: int):
    return SimpleNamespace(page_size=PS, device=torch.device("cpu"))


def _contents(pool: KVPool, table: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """Keys of layer 0 at positions [0, length) of each row, read through its page table: [rows, length]."""
    PS = pool.page_size
    pos = torch.arange(length)
    return pool.k(0)[table[:rows, pos // PS].long(), 0, pos % PS, 0]


@pytest.mark.parametrize("G,N,K,PS,prompt_lens,rounds,seed", [
    (2, 4, 2, 4, [5, 9], 8, 0),
    (1, 8, 5, 2, [4], 6, 1),
    (3, 3, 1, 4, [2, 3, 7], 12, 2),
    (2, 5, 6, 3, [6, 3], 5, 3),
])
def test_device_bookkeeping_matches_page_table_under_random_forks(G, N, K, PS, prompt_lens, rounds, seed):
    """Round by round, as the fused round drives them: every row writes positions [T−1, T+K] into
    both pools (a target pool and a draft pool of another layout), then random ancestors within
    each request (or none). The device bookkeeping keeps the same pages shared by the same rows as
    ``PageTable.fork`` + ``reserve``, the same pages in use, the same contents behind every row,
    and the same peak, with a pool of exactly the worst case (pages freed and handed out again);
    a last round flagged done changes nothing."""
    g = torch.Generator().manual_seed(seed)
    B = G * N
    lens = np.repeat(np.array(prompt_lens) - 1, N)
    P = -(-(max(lens) + (rounds + 1) * (K + 1)) // PS) + 1
    # the engine's worst case for rounds + 1 reserves (the setup's and one after each round but the last)
    worst = 1 + sum((c - 1) // PS + N * (-(-(c + (rounds + 1) * (K + 1)) // PS) - (c - 1) // PS) for c in lens[::N])
    pools = {side: [KVPool(L, 1, 1, worst, PS, torch.float32, "cpu") for L in (2, 1)] for side in ("host", "dev")}

    table = PageTable(B, P, worst, PS)  # prompts prefilled once per request, then shared (as _start)
    for r0 in range(0, B, N):
        table.reserve(np.array([r0]), lens[r0 : r0 + 1])
        table.advance(np.array([r0]), lens[r0 : r0 + 1])
        pos = torch.arange(int(lens[r0]))
        pages = torch.from_numpy(table.table[r0, (pos // PS).numpy()]).long()
        for host_pool, dev_pool in zip(pools["host"], pools["dev"]):
            for layer in range(host_pool.kv.shape[0]):
                vals = torch.randn(len(pos), generator=g)
                host_pool.kv[layer, 0, pages, 0, pos % PS, 0] = vals
                dev_pool.kv[layer, 0, pages, 0, pos % PS, 0] = vals
        table.share_prefix(list(range(r0, r0 + N)), r0)
    src, dst = table.reserve(np.arange(B), lens + K + 1, write_from=lens - 1)
    for pool in pools["host"] + pools["dev"]:
        pool.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
    b = dict(pt=torch.from_numpy(table.table.copy()), seq=torch.from_numpy(lens.copy()), index=torch.arange(B),
             done=torch.zeros(1, dtype=torch.bool), peak=torch.zeros((), dtype=torch.long),
             exhausted=torch.zeros((), dtype=torch.bool))
    pages = Engine._smc_pages(_fake_engine(PS), b, G, N, K, pools["dev"])
    setup_peak = table.peak_used

    for r in range(rounds + 1):
        seq = b["seq"].clone()
        pos = (seq - 1)[:, None] + torch.arange(K + 2)[None]  # [B, K+2]: positions T−1 .. T+K
        vals = torch.randn(B, K + 2, generator=g)
        for side, pt in (("host", torch.from_numpy(table.table)), ("dev", b["pt"])):
            pg = pt.long().gather(1, pos // PS)
            for pool in pools[side]:
                for layer in range(pool.kv.shape[0]):
                    pool.kv[layer, 0, pg, 0, pos % PS, 0] = vals + layer
        done = r == rounds
        new_lens = lens + K + 1
        if done:  # every row finished: the round after it must change nothing
            before = (b["pt"].clone(), [p.kv.clone() for p in pools["dev"]], int(b["peak"]))
            b["done"].fill_(True)
            b["index"].copy_(torch.arange(B))
            pages()
            assert torch.equal(b["pt"], before[0]) and int(b["peak"]) == before[2]
            assert all(torch.equal(p.kv, kv) for p, kv in zip(pools["dev"], before[1]))
            break
        if r % 3 == 2:
            idx = np.arange(B)
        else:
            idx = (np.arange(G)[:, None] * N + torch.randint(0, N, (G, N), generator=g).numpy()).reshape(-1)
        pre_fork = {"host": torch.from_numpy(table.table.copy()), "dev": b["pt"].clone()}
        written = {s: [_contents(p, pre_fork[s], B, int(new_lens.max())) for p in pools[s]] for s in pools}
        table.advance(np.arange(B), new_lens)
        table.fork(idx)
        src, dst = table.reserve(np.arange(B), new_lens + K + 1, write_from=new_lens - 1)
        for pool in pools["host"]:
            pool.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
        b["seq"].add_(K + 1)
        b["index"].copy_(torch.from_numpy(idx))
        pages()
        lens = new_lens
        assert not bool(b["exhausted"])

        host_pt, dev_pt = torch.from_numpy(table.table).long(), b["pt"].long()
        live = torch.arange(P)[None] < torch.from_numpy(table.n_pages)[:, None]
        assert torch.equal(dev_pt[~live], host_pt[~live])  # unused entries: the null page
        for c in range(P):  # which rows share a page, column by column
            h, d = host_pt[:, c], dev_pt[:, c]
            assert torch.equal(h[:, None] == h[None], d[:, None] == d[None]), (r, c)
        assert len(set(dev_pt[live].tolist())) == table.used
        assert max(setup_peak, int(b["peak"])) == table.peak_used
        # every row reads its ancestor's history (its positions < T'), on both sides and in both pools
        stored = torch.arange(int(lens.max()))[None] < torch.from_numpy(lens)[:, None]
        for side, pt in (("host", host_pt), ("dev", dev_pt)):
            for pool, before in zip(pools[side], written[side]):
                now = _contents(pool, pt, B, int(lens.max()))
                assert torch.equal(now[stored], before[torch.from_numpy(idx)][stored]), (side, r)
        assert torch.equal(_contents(pools["host"][0], host_pt, B, int(lens.max()))[stored],
                           _contents(pools["dev"][0], dev_pt, B, int(lens.max()))[stored])
        # and the pages that the next round writes are the row's own
        nxt = dev_pt.gather(1, ((b["seq"] - 1)[:, None] + torch.arange(K + 2)[None]) // PS)
        for i in range(B):
            others = torch.cat([dev_pt[:i], dev_pt[i + 1 :]]).reshape(-1)
            assert not torch.isin(nxt[i], others).any(), (r, i)


def test_rule_for_the_device_bookkeeping(monkeypatch):
    """Host bookkeeping by default; with SMCDECODE_DEVICE_PAGES=1, device bookkeeping iff the pool
    holds the worst case (``smc_page_bounds``), the host's between that and the first round's need;
    a clear error below it, or when the device path is asked for and does not fit. The worst case is tight: without resampling every particle ends
    up owning every page from its prompt's last partial page on."""
    target, draft = _models("cpu")
    prompts, N, K, n, PS = [[1, 2, 3, 4, 5], [6, 1, 2]], 3, 2, 7, 4
    engine = Engine(target, draft, num_pages=10, page_size=PS)
    # request 0: 4 tokens cached, its first write at position 3 (column 0); after 3 rounds 13 positions
    # -> 4 columns each; request 1: 2 cached, 11 positions -> 3 columns each; + the null page
    assert engine.smc_page_bounds(prompts, N, K, n) == (1 + 3 * 2 + 3 * 2, 1 + 3 * 4 + 3 * 3)
    first, worst = engine.smc_page_bounds(prompts, N, K, n)

    used = []
    pages = Engine._smc_pages

    def spy(self, *a, **kw):
        used.append(True)
        return pages(self, *a, **kw)

    monkeypatch.setattr(Engine, "_smc_pages", spy)
    kw = dict(particles=N, block_size=K, max_new_tokens=n, seed=1)
    Engine(target, draft, num_pages=worst, page_size=PS).smc_sd(prompts, ess_threshold=0.0, **kw)
    assert not used  # opt-in
    monkeypatch.setenv("SMCDECODE_DEVICE_PAGES", "1")
    out = Engine(target, draft, num_pages=worst, page_size=PS).smc_sd(prompts, ess_threshold=0.0, **kw)
    assert used and out.peak_pages == worst - 1  # device path; without resampling the bound is reached
    used.clear()
    out = Engine(target, draft, num_pages=worst - 1, page_size=PS).smc_sd(prompts, ess_threshold=1.0, **kw)
    assert not used and out.rounds == 3  # host path (resampling every round shares pages: it fits)
    with pytest.raises(MemoryError):  # ... and the host path needs the worst case without resampling
        Engine(target, draft, num_pages=worst - 1, page_size=PS).smc_sd(prompts, ess_threshold=0.0, **kw)
    assert not used
    with pytest.raises(SMCDecodeError, match=rf"device_pages=True needs num_pages >= {worst} .* got num_pages="
                                              rf"{worst - 1}"):
        Engine(target, draft, num_pages=worst - 1, page_size=PS).smc_sd(prompts, device_pages=True, **kw)
    with pytest.raises(SMCDecodeError, match=rf"num_pages \({first - 1}\) is too small .* needs {first} pages"):
        Engine(target, draft, num_pages=first - 1, page_size=PS).smc_sd(prompts, **kw)
    Engine(target, draft, num_pages=worst, page_size=PS).smc_sd(prompts, device_pages=False, **kw)
    assert not used


def test_device_pages_under_cuda_graphs_is_refused():
    """The device bookkeeping disagrees with the host's under CUDA graphs on an H200 (docs/engine.md):
    asking for both is a clear error, not a silent difference. (A CPU engine that reports a CUDA
    device: the check comes before any CUDA work.)"""
    target, draft = _models("cpu")
    prompts, N, K, n, PS = [[1, 2, 3, 4, 5]], 2, 2, 4, 4
    engine = Engine(target, draft, num_pages=10_000, page_size=PS)
    engine.device = torch.device("cuda")
    with pytest.raises(SMCDecodeError, match="use_graphs=False with device_pages=True"):
        engine.smc_sd(prompts, particles=N, block_size=K, max_new_tokens=n, device_pages=True)
