"""The engine's output distributions against exact enumeration on a tiny random Llama (vocab 8):
exact speculative decoding samples the target exactly; SMC-SD's Ẑ-weighted particles are unbiased
for the target (E[Ẑ · Σ_i W_i 1{x_i = s}] = p(s), Z = 1 here). On the CPU (torch reference path)
and, marked ``gpu``, on CUDA (Triton kernels, CUDA graphs). The exact distribution comes from
transformers' LlamaForCausalLM in float64."""

import itertools

import numpy as np
import pytest
import torch

from smcdecode.backends.engine import Engine, Llama

transformers = pytest.importorskip("transformers")

V = 8
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def _tiny_hf(seed: int, layers: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.normal_(0.0, 0.4)  # logits of a few nats: a far-from-uniform target
    return hf


def _exact(hf, prompt: list[int], n: int) -> dict[tuple, float]:
    """p(s | prompt) for every continuation s of n tokens (float64)."""
    hf = hf.double()
    seqs = list(itertools.product(range(V), repeat=n))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.double(), -1)
    P = len(prompt)
    lp = sum(logp[:, P - 1 + i].gather(1, ids[:, P + i : P + i + 1])[:, 0] for i in range(n))
    hf.float()
    return dict(zip(seqs, lp.exp().tolist()))


def _engine(device: str):
    target_hf, draft_hf = _tiny_hf(0, 2), _tiny_hf(0, 2)
    with torch.no_grad():  # a draft near the target (bounded p/q, as with real drafts), not equal to it
        draft_hf.lm_head.weight.add_(torch.randn(draft_hf.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
    target = Llama.from_hf(target_hf, dtype=torch.float32, device=device)
    draft = Llama.from_hf(draft_hf, dtype=torch.float32, device=device)
    return target_hf, Engine(target, draft, num_pages=16000, page_size=4, max_context=32)


def _z_scores(values: np.ndarray, seqs: list[tuple], exact: dict, marginal) -> np.ndarray:
    """values[j, i] = contribution of row i of replicate j to the estimate of P(marginal(s) = cell)."""
    cells: dict = {}
    for s, p in exact.items():
        cells[marginal(s)] = cells.get(marginal(s), 0.0) + p
    keys = [marginal(s) for s in seqs]
    zs = []
    for c, p in cells.items():
        if p < 0.02:
            continue
        hit = np.array([k == c for k in keys]).reshape(values.shape)
        est = (values * hit).sum(1)  # [replicates]
        se = est.std(ddof=1) / np.sqrt(len(est))
        zs.append((est.mean() - p) / max(se, 1e-12))
    return np.array(zs)


MARGINALS = [lambda s: s[:1], lambda s: s[1:2], lambda s: s[2:3], lambda s: s[:2], lambda s: s[1:3]]


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_decoding_samples_the_target(device):
    hf, engine = _engine(device)
    prompt, n = [3, 1, 4, 1, 5], 3
    exact = _exact(hf, prompt, n)
    reps, per = 20, 250
    # a first, shorter call captures the round graph; the measured call replays it (a regression: a
    # tensor the graph read was freed after the first call)
    engine.speculative([prompt] * reps, samples=per, block_size=2, max_new_tokens=1, seed=4)
    torch.zeros(1 << 20, device=device)  # reuse freed memory
    out = engine.speculative([prompt] * reps, samples=per, block_size=2, max_new_tokens=n, seed=5)
    assert (out.lengths == n).all()
    toks = out.tokens.cpu().numpy()  # [reps, per, n]
    seqs = [tuple(t) for t in toks.reshape(-1, n).tolist()]
    values = np.full((reps, per), 1.0 / per).reshape(reps, per)
    for m in MARGINALS:
        z = _z_scores(values, seqs, exact, m)
        assert len(z) and np.abs(z).max() < 4.5, (z.round(2), device)
    assert 0 < int(out.accepted.sum()) < reps * per * n  # some drafts accepted, not all


@pytest.mark.parametrize("device", DEVICES)
def test_smc_sd_weighted_particles_are_unbiased_for_the_target(device):
    hf, engine = _engine(device)
    prompt, n, N = [2, 7, 1, 6], 3, 4
    exact = _exact(hf, prompt, n)
    G = 1500
    # K=1: round one drafts d1 and adds the bonus; round two drafts one token (the budget); always resample
    engine.smc_sd([prompt] * G, particles=N, block_size=1, max_new_tokens=1, ess_threshold=1.0, seed=2)
    torch.zeros(1 << 20, device=device)
    out = engine.smc_sd([prompt] * G, particles=N, block_size=1, max_new_tokens=n, ess_threshold=1.0, seed=3)
    assert (out.lengths == n).all() and out.rounds == 2
    toks = out.tokens.cpu().numpy().reshape(-1, n)
    seqs = [tuple(t) for t in toks.tolist()]
    # Ẑ · W_i = exp(log Z_resampled + log w_i) / N, per group; groups are independent replicates
    contrib = torch.exp(out.log_evidence[:, None] - torch.logsumexp(out.log_weights, 1, keepdim=True)
                        + out.log_weights).cpu().numpy()  # [G, N]: Σ_i Ẑ W_i = Ẑ
    groups = 30  # pool groups into replicates so each replicate's estimate is near-Gaussian
    values = contrib.reshape(groups, -1) / (G // groups)
    for m in MARGINALS:
        z = _z_scores(values, seqs, exact, m)
        assert len(z) and np.abs(z).max() < 4.5, (z.round(2), device)
    # the evidence estimate is unbiased for Z = 1
    zhat = out.log_evidence.exp().cpu().numpy()
    assert abs(zhat.mean() - 1.0) < 4.5 * zhat.std(ddof=1) / np.sqrt(G)
