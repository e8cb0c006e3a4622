"""The native Llama against transformers' LlamaForCausalLM (tiny random config, float32, CPU), and
the engine's strategies on the reference attention path."""

import numpy as np
import pytest
import torch
from conftest import llama3_scaled_hf

from smcdecode.backends.engine import Engine, KVPool, Llama, LlamaConfig, PagedBatch, PageTable
from smcdecode.backends.engine.graphs import GraphCache

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():
    return llama3_scaled_hf()


def test_config_and_rope_scaling_read_from_hf(hf_model):
    cfg = LlamaConfig.from_hf(hf_model.config)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 8.0


@torch.inference_mode()
def test_logits_match_hf_through_prefill_extend_and_fork(hf_model):
    model = Llama.from_hf(hf_model, dtype=torch.float32, device="cpu")
    PS = 4
    pool = KVPool.for_model(model.cfg, num_pages=32, page_size=PS, dtype=torch.float32, device="cpu")
    table = PageTable(rows=2, max_pages=8, num_pages=32, page_size=PS)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (1, 7), generator=g)
    table.reserve(np.array([0]), np.array([7]))
    pt = torch.from_numpy(table.table)
    logits = model(prompt, pool, PagedBatch.build(torch.arange(7)[None], pt[:1], PS))
    ref = hf_model(prompt).logits
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)

    # two particles share the prompt pages, then extend by different 3-token blocks
    table.advance(np.array([0]), np.array([7]))
    table.share_prefix([0, 1], 0)
    src, dst = table.reserve(np.arange(2), np.full(2, 10))
    assert len(src) == 1  # copy-on-write of the shared partial page
    pool.copy_pages(torch.tensor(src), torch.tensor(dst))
    table.advance(np.arange(2), np.full(2, 10))
    pt = torch.from_numpy(table.table)
    block = torch.randint(0, 97, (2, 3), generator=g)
    logits = model(block, pool, PagedBatch.build(7 + torch.arange(3)[None].repeat(2, 1), pt, PS))
    full = torch.cat([prompt.repeat(2, 1), block], 1)
    torch.testing.assert_close(logits, hf_model(full).logits[:, 7:], rtol=1e-4, atol=1e-4)

    # resampling: both rows continue particle 1's history (a page-table row copy)
    table.fork(np.array([1, 1]))
    src, dst = table.reserve(np.arange(2), np.full(2, 12))
    pool.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
    pt = torch.from_numpy(table.table)
    more = torch.randint(0, 97, (2, 2), generator=g)
    logits = model(more, pool, PagedBatch.build(10 + torch.arange(2)[None].repeat(2, 1), pt, PS))
    full = torch.cat([full[1:].repeat(2, 1), more], 1)
    torch.testing.assert_close(logits, hf_model(full).logits[:, 10:], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_engine_smc_sd_and_ar_run_on_cpu(hf_model):
    target = Llama.from_hf(hf_model, dtype=torch.float32)
    draft = Llama(LlamaConfig(97, 32, 1, 2, 1, 48, rope_theta=10000.0)).eval()
    engine = Engine(target, draft, num_pages=128, page_size=4)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    out = engine.smc_sd(prompts, particles=3, block_size=2, max_new_tokens=7, ess_threshold=1.0, seed=0)
    assert out.tokens.shape == (2, 3, 7) and (out.lengths == 7).all()
    # τ = 1: resample every round while a particle is alive (not after the last round)
    assert out.rounds == 3 and all(r.all() for r in out.resampled[:-1]) and not out.resampled[-1].any()
    assert torch.isfinite(out.log_evidence).all()
    assert out.peak_pages <= 128
    eos_out = engine.smc_sd(prompts, particles=2, block_size=3, max_new_tokens=9, eos_token_id=5, seed=1)
    L = eos_out.lengths
    toks = eos_out.tokens
    for g in range(2):
        for n in range(2):
            seq = toks[g, n, : L[g, n]].tolist()
            assert 5 not in seq[:-1]  # nothing after the first EOS
    toks, _ = engine.autoregressive(prompts, max_new_tokens=5)
    assert toks.shape == (2, 5) and (toks >= 0).all() and (toks < 97).all()


def test_exponential_race_samples_softmax():
    from smcdecode.samplers.steps import race

    torch.manual_seed(0)  # (no generator: torch's global one, as the engine's torch path)
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]]).repeat(20000, 1)
    counts = torch.bincount(race(logits), minlength=4).double() / 20000
    torch.testing.assert_close(counts, torch.softmax(logits[0].double(), 0), atol=0.015, rtol=0)


def test_cached_round_and_step_graphs_replay_like_a_fresh_capture(hf_model, monkeypatch):
    """The path a second call of the same shape takes on a GPU (the round / step "graph" found in
    the cache, its buffers reset and replayed), run on the CPU by standing in a plain call for the
    CUDA-graph capture: a cached replay with seed s gives exactly what a fresh capture with seed s
    gives, for SMC-SD, exact SD and autoregressive decoding."""
    target = Llama.from_hf(hf_model, dtype=torch.float32)
    draft = Llama(LlamaConfig(97, 32, 1, 2, 1, 48, rope_theta=10000.0)).eval()
    monkeypatch.setattr(GraphCache, "capture", lambda self, fn, use_graphs: fn)  # "graph" = the eager step
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    calls = {
        "smc_sd": lambda e, s: e.smc_sd(prompts, particles=3, block_size=2, max_new_tokens=7, seed=s, use_graphs=True),
        "speculative": lambda e, s: e.speculative(prompts, block_size=2, max_new_tokens=7, seed=s, use_graphs=True),
        "autoregressive": lambda e, s: e.autoregressive(prompts, max_new_tokens=6, seed=s, use_graphs=True),
    }

    def tokens(out):
        return out[0] if isinstance(out, tuple) else out.tokens

    for name, call in calls.items():
        engine = Engine(target, draft, num_pages=256, page_size=4, max_context=32)
        first = tokens(call(engine, 3)).clone()  # captured now
        assert engine.graphs, f"{name}: nothing cached"
        again = tokens(call(engine, 4))  # found in the cache, reset and replayed
        fresh = tokens(call(Engine(target, draft, num_pages=256, page_size=4, max_context=32), 4))
        assert torch.equal(again, fresh), name
        assert not torch.equal(first, fresh), name  # the seed matters, so the check above can fail
