"""The engine's batched prefill and autoregressive sampling with prompts shared by several rows
(CPU, float32, tiny random Llama models; a few seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from smcdecode import SMCDecodeError
from smcdecode.backends.engine import Engine, KVPool, Llama, LlamaConfig, PagedBatch
from smcdecode.backends.engine.kv_cache import PageTable
from smcdecode.backends.engine.prefill import prefill_unpadded

scipy_stats = pytest.importorskip("scipy.stats")


def tiny_llama(vocab: int = 24, layers: int = 2, seed: int = 0, scale: float = 0.25, dim: int = 32,
               device: str = "cpu") -> Llama:
    """Random weights with a large init: peaked next-token distributions (chi-square tests have power)."""
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(vocab, dim, layers, 4, 2, 2 * dim, rope_theta=10000.0)).eval().to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, scale)
    return model


# prompt lengths across the buckets (16, 32, 64), page boundaries (PS = 4) and the 1-token prompt;
# with 64 positions a forward, bucket 16 holds 7 rows: chunks of 4 and 3 (+ 1 padding row)
LENGTHS = [9, 2, 5, 1, 16, 17, 18, 3, 33, 40, 6]


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")



def _prefilled(engine, prompts: list[list[int]], N: int, extra: int, batched: bool):
    """A page table for G·N rows with each prompt prefilled once (in row g·N, batched through
    ``prefill_rows`` or one forward per prompt) and shared by its N rows; its device copy."""
    G, PS = len(prompts), engine.page_size
    engine.ensure_rope(max(len(p) for p in prompts) + extra + PS)
    table = PageTable(G * N, -(-engine.max_context // PS) + 1, engine.num_pages, PS)
    for g, ids in enumerate(prompts):
        table.reserve(np.array([g * N]), np.array([len(ids) - 1]))
        table.advance(np.array([g * N]), np.array([len(ids) - 1]))
    pt_dev = torch.from_numpy(table.table).to(engine.device)
    heads = [g * N for g in range(G)]
    if batched:
        engine.prefill_rows(engine.target, engine.kv_t, pt_dev, heads, [p[:-1] for p in prompts])
        engine.prefill_rows(engine.draft, engine.kv_d, pt_dev, heads, [p[:-2] for p in prompts])
    else:
        for g, ids in enumerate(prompts):
            prefill_unpadded(engine.target, engine.kv_t, pt_dev, g * N, ids[:-1], PS)
            prefill_unpadded(engine.draft, engine.kv_d, pt_dev, g * N, ids[:-2], PS)
    for g in range(G):
        table.share_prefix(list(range(g * N, (g + 1) * N)), g * N)
    return table, pt_dev


@pytest.mark.parametrize("device, dim, tol", [
    ("cpu", 32, 1e-5),
    # the Triton kernels (float32 inputs, tf32 products; head dim 32 for the fused decode kernel)
    pytest.param("cuda", 128, 1e-2, marks=[pytest.mark.gpu, GPU]),
])
@torch.inference_mode()
def test_batched_prefill_matches_per_prompt_prefill(device, dim, tol):
    """Every real cached position holds the keys/values of the one-prompt-per-forward prefill
    (target and draft pools), the next-token logits agree (1e-5 on CPU), and the padding wrote
    nowhere but the prompts' own pages and the null page 0."""
    target = tiny_llama(seed=1, dim=dim, device=device)
    draft = tiny_llama(layers=1, seed=2, dim=dim, device=device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in LENGTHS]
    PS, N = 4, 2
    engines = {}
    for batched in (False, True):
        e = Engine(target, draft, num_pages=256, page_size=PS, max_context=64)
        e.PREFILL_TOKENS = 64  # several forwards per bucket, and a padded last chunk (R = 2^k rows)
        table, pt = _prefilled(e, prompts, N, 4, batched)
        engines[batched] = (e, table, pt)
    (e0, t0, _), (e1, t1, _) = engines[False], engines[True]
    np.testing.assert_array_equal(t0.table, t1.table)
    owned = set()
    for gi, ids in enumerate(prompts):
        r = gi * N
        for kv0, kv1, n in ((e0.kv_t, e1.kv_t, len(ids) - 1), (e0.kv_d, e1.kv_d, len(ids) - 2)):
            for pos in range(max(n, 0)):
                page = int(t1.table[r, pos // PS])
                torch.testing.assert_close(kv1.kv[:, :, page, :, pos % PS], kv0.kv[:, :, page, :, pos % PS],
                                           atol=tol, rtol=tol)
        owned.update(t1.table[r, : t1.n_pages[r]].tolist())
        assert (t1.table[r + 1, : t1.n_pages[r]] == t1.table[r, : t1.n_pages[r]]).all()  # shared by the N rows
    others = sorted(set(range(1, 256)) - owned)
    assert not e1.kv_t.kv[:, :, others].any() and not e1.kv_d.kv[:, :, others].any()

    # the next token's logits (the last prompt token fed at its position) on both caches
    heads = [gi * N for gi in range(len(prompts))]
    last = torch.tensor([[p[-1]] for p in prompts], device=device)
    pos = torch.tensor([[len(p) - 1] for p in prompts], device=device)
    logits = []
    for e, table, _ in (engines[False], engines[True]):
        src, dst = table.reserve(np.array(heads), np.array([len(p) for p in prompts]))  # copy-on-write
        if src:
            e.kv_t.copy_pages(torch.tensor(src, device=device), torch.tensor(dst, device=device))
        pt = torch.from_numpy(table.table[heads]).to(device)
        logits.append(e.target(last, e.kv_t, PagedBatch.build(pos, pt, PS))[:, 0])
    torch.testing.assert_close(logits[1], logits[0], atol=tol, rtol=tol)
    # and against a plain causal forward of each whole prompt (a fresh pool, one prompt per call)
    for gi, ids in enumerate(prompts):
        kv = KVPool.for_model(target.cfg, 32, PS, torch.float32, device)
        n = len(ids)
        pt = torch.arange(1, 1 + -(-n // PS), dtype=torch.int32, device=device)[None]
        full = target(torch.tensor([ids], device=device), kv,
                      PagedBatch.build(torch.arange(n, device=device)[None], pt, PS))[0, -1]
        torch.testing.assert_close(logits[1][gi], full, atol=tol, rtol=tol)


@torch.inference_mode()
def test_prefill_forwards_are_bucketed():
    """Prefill shapes come from a few power-of-two buckets: one forward per bucket here."""
    model = tiny_llama()
    e = Engine(model, None, num_pages=1024, page_size=4, max_context=70)
    pt = torch.arange(1, 1 + 37 * 19, dtype=torch.int32).view(37, 19)
    seqs = [[3] * n for n in range(1, 38)]
    seen = []

    def record(module, args):
        seen.append(tuple(args[0].shape))

    h = model.register_forward_pre_hook(record)
    try:
        assert e.prefill_rows(model, e.kv_t, pt, list(range(37)), seqs) == 3
        assert e.prefill_rows(model, e.kv_t, pt, list(range(37)), seqs, max_tokens=256) == 5
    finally:
        h.remove()
    # lengths 1-16, 17-32, 33-37 (5 rows, padded to 8); then at most 256 positions a forward
    assert seen == [(16, 16), (16, 32), (8, 64), (16, 16), (8, 32), (8, 32), (4, 64), (1, 64)]
    # the bucket is capped at the page table's capacity (2 pages of 4 here); longer is an error
    assert e.prefill_rows(model, e.kv_t, pt[:2, :2], [0, 1], [[3] * 8, [3] * 2]) == 1
    with pytest.raises(SMCDecodeError, match="does not fit the page table"):
        e.prefill_rows(model, e.kv_t, pt[:1, :2], [0], [[3] * 9])


def _exact(model: Llama, seq: list[int], T: float) -> torch.Tensor:
    """p_T(· | seq) from one causal forward over a fresh pool (float64)."""
    kv = KVPool.for_model(model.cfg, 32, 4, torch.float32, "cpu")
    n = len(seq)
    pt = torch.arange(1, 1 + -(-n // 4), dtype=torch.int32)[None]
    logits = model(torch.tensor([seq]), kv, PagedBatch.build(torch.arange(n)[None], pt, 4))[0, -1]
    return torch.softmax(logits.double() / T, -1)


def _chi2_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = float(counts.sum())
    keep = p * n >= 5  # pool the rare cells
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([p[keep], p[~keep].sum()[None]]) * n
    if (~keep).sum() == 0:
        obs, exp = counts[keep], p[keep] * n
    return float(scipy_stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def check_follows_target(model: Llama, prompt: list[int], rows: torch.Tensor, T: float, min_count: int = 150):
    """First tokens ~ p_T(· | prompt); second tokens, among rows with the same first token t,
    ~ p_T(· | prompt, t) (for every t drawn at least ``min_count`` times); p-values > 1e-6."""
    V = model.cfg.vocab_size
    p1 = _exact(model, prompt, T)
    assert _chi2_pvalue(torch.bincount(rows[:, 0], minlength=V).double(), p1) > 1e-6
    tested = 0
    for t in torch.unique(rows[:, 0]).tolist():
        sel = rows[rows[:, 0] == t]
        if len(sel) < min_count:
            continue
        p2 = _exact(model, prompt + [t], T)
        assert _chi2_pvalue(torch.bincount(sel[:, 1], minlength=V).double(), p2) > 1e-6, (prompt, t)
        tested += 1
    assert tested >= 1


@pytest.mark.parametrize("shared", [True, False])
@torch.inference_mode()
def test_autoregressive_rows_sharing_a_prompt_sample_the_target(shared):
    """S rows per prompt sharing its pages (shared=True) and the same prompts repeated S times,
    one row each (shared=False), both follow p_T: the first token, and the second token given the
    first (a row that read another row's first token from a shared page would fail this). The
    prompt lengths put the first generated token in the prompt's partially filled last page."""
    model = tiny_llama(seed=3)
    e = Engine(model, None, num_pages=12000, page_size=4, max_context=16)
    prompts, S, T = [[5, 9, 13], [7, 3, 11, 2, 8, 1]], 1500, 0.8
    if shared:
        toks, _ = e.autoregressive(prompts, max_new_tokens=2, temperature=T, samples=S, seed=11)
    else:
        toks, _ = e.autoregressive([p for p in prompts for _ in range(S)], max_new_tokens=2, temperature=T, seed=11)
    assert toks.shape == (len(prompts) * S, 2)
    for gi, p in enumerate(prompts):
        check_follows_target(model, p, toks[gi * S : (gi + 1) * S], T)


@torch.inference_mode()
def test_autoregressive_reuses_its_step_and_checks_input():
    model = tiny_llama(seed=4)
    e = Engine(model, None, num_pages=256, page_size=4, max_context=24)
    a, _ = e.autoregressive([[1, 2, 3], [4]], max_new_tokens=5, samples=3, seed=7)
    b, _ = e.autoregressive([[1, 2, 3], [4]], max_new_tokens=5, samples=3, seed=7)
    assert a.shape == (6, 5) and torch.equal(a, b)  # seeded
    unbatched, _ = e.autoregressive([[1, 2, 3], [4]], max_new_tokens=5, samples=3, seed=7, batched_prefill=False)
    assert torch.equal(a, unbatched)
    for kw, match in ((dict(samples=0), "samples must be"), (dict(max_new_tokens=0), "max_new_tokens must be"),
                      (dict(temperature=0.0), "temperature must be")):
        args = dict(max_new_tokens=3, **{k: v for k, v in kw.items() if k != "max_new_tokens"})
        if "max_new_tokens" in kw:
            args["max_new_tokens"] = kw["max_new_tokens"]
        with pytest.raises(SMCDecodeError, match=match):
            e.autoregressive([[1, 2]], **args)
    with pytest.raises(SMCDecodeError, match="non-empty"):
        e.autoregressive([[1, 2], []], max_new_tokens=3)


def test_autoregressive_launches_its_kernels_without_pdl(monkeypatch):
    """PDL is off inside Engine.autoregressive and Engine.speculative and in every step of an
    exact-only request loop (their rounds are captured and launched there) and on again after them,
    also when they raise; SMC-SD keeps it on."""
    pytest.importorskip("triton")
    from smcdecode.backends.engine import Request, Scheduler, kernels
    from smcdecode.backends.engine import engine as E

    seen = []  # (PDL when the request loop prefills a joining request's prompt)
    prefill_rows = E.Engine.prefill_rows

    def loop_spy(self, *a, **k):
        seen.append(kernels.pdl_enabled())
        return prefill_rows(self, *a, **k)

    monkeypatch.setattr(E.Engine, "prefill_rows", loop_spy)
    e = Engine(tiny_llama(seed=4), None, num_pages=64, page_size=4, max_context=16)
    e.autoregressive([[1, 2, 3]], max_new_tokens=2)
    assert seen and not any(seen) and kernels.pdl_enabled()
    with pytest.raises(SMCDecodeError):
        e.autoregressive([[1, 2]], max_new_tokens=0)
    assert kernels.pdl_enabled()
    seen.clear()
    sched = Scheduler(e, slots=1, max_particles=2, max_block_size=0, exact_only=True)  # (the server's AR lane)
    sched.submit(Request([1, 2, 3], particles=2, block_size=0, max_new_tokens=2, exact=True))
    sched.run()
    assert seen and not any(seen) and kernels.pdl_enabled()
    seen.clear()
    e = Engine(tiny_llama(seed=4), tiny_llama(seed=5, layers=1), num_pages=128, page_size=4, max_context=24)
    e.speculative([[1, 2, 3]], block_size=2, max_new_tokens=3)
    assert seen and not any(seen)
    seen.clear()
    e.smc_sd([[1, 2, 3]], particles=2, block_size=2, max_new_tokens=3)
    assert seen and all(seen) and kernels.pdl_enabled()


@torch.inference_mode()
def test_autoregressive_stops_soon_after_every_row_sampled_eos():
    """With eos_token_id: each row equals the run without it up to and including its first EOS
    (the same draws), is EOS after it, and decoding stops within one round of the last row's EOS
    (the round after it: pipelined) instead of running to max_new_tokens."""
    model = tiny_llama(seed=5)
    e = Engine(model, None, num_pages=2000, page_size=4, max_context=320)
    prompts, n = [[1, 2, 3], [4, 5]], 300
    free, _ = e.autoregressive(prompts, max_new_tokens=n, samples=4, seed=3)
    counts = torch.bincount(free[:, :20].flatten(), minlength=24)
    eos = int(counts.argmax())  # a token every row samples early
    first = torch.where((free == eos).any(1), (free == eos).long().argmax(1), n)
    assert int(first.max()) + 2 < n
    toks, _ = e.autoregressive(prompts, max_new_tokens=n, samples=4, seed=3, eos_token_id=eos)
    assert int(first.max()) + 1 <= e.ar_steps_run <= int(first.max()) + 2
    for r in range(free.shape[0]):
        f = int(first[r])
        assert torch.equal(toks[r, : f + 1], free[r, : f + 1])
        assert bool((toks[r, f:] == eos).all())
    again, _ = e.autoregressive(prompts, max_new_tokens=n, samples=4, seed=3, eos_token_id=eos)
    assert torch.equal(again, toks)  # the cached step graph's state is reset between calls


def _compiled(fn) -> int:
    """Kernels Triton has compiled for the JIT function ``fn`` (all devices)."""
    if hasattr(fn, "device_caches"):  # triton >= 3.1
        return sum(len(c[0]) for c in fn.device_caches.values())
    if hasattr(fn, "cache"):
        return sum(len(c) for c in fn.cache.values())
    pytest.skip("this Triton version does not expose its kernel cache")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_no_recompile_or_recapture_across_calls_on_cuda():
    """After one call, calls with other prompt lengths in the same length buckets (and the same
    rows) compile no new Triton kernels and capture no new step graph."""
    pytest.importorskip("triton")
    from smcdecode.backends.engine import kernels

    model = Llama.random(LlamaConfig(256, 128, 2, 4, 2, 256, rope_theta=10000.0), device="cuda")
    e = Engine(model, None, num_pages=4096, page_size=16, max_context=200)
    g = torch.Generator().manual_seed(0)

    def prompts():  # 4 prompts of 2-17 tokens (bucket 16), 4 of 34-65 (bucket 64)
        n = torch.cat([torch.randint(2, 18, (4,), generator=g), torch.randint(34, 66, (4,), generator=g)])
        return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in n]

    fns = [kernels.attention._paged_attn_kernel, kernels.norms._rope_kv_write_kernel,
           kernels.sampling._sample_split_kernel]
    e.autoregressive(prompts(), max_new_tokens=12, samples=4, temperature=0.8)
    before = [_compiled(f) for f in fns]
    graphs = dict(e.graphs)
    assert [k[:3] for k, _ in graphs] == [("ar", 8, 4)]  # (the request loop's AR rounds: 8 requests × 4 rows)
    for seed in range(3):
        toks, _ = e.autoregressive(prompts(), max_new_tokens=12, samples=4, temperature=0.8, seed=seed)
        assert toks.shape == (32, 12) and ((toks >= 0) & (toks < 256)).all()
    assert [_compiled(f) for f in fns] == before
    assert e.graphs.keys() == graphs.keys() and all(e.graphs[k] is graphs[k] for k in graphs)
