"""SMC-SD against exact enumeration on random toy LMs: E[Ẑ] = Z for every resampler, block size
and ESS threshold; the weighted particles target π (for any N, through E[Ẑ·π̂] = γ); total
variation falls as N grows; a perfect proposal gives exact samples.

Every run uses ``run_groups``: G independent replicates vectorised in one call."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPT, Toy, statistical_settings, toy_model, toy_table, toys
from hypothesis import given
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.samplers.resampling import RESAMPLERS
from smcdecode.testing import (
    check_distribution,
    check_evidence_unbiased,
    chi_square_pvalue,
    exact_target,
    particle_distributions,
    pooled_distribution,
    total_variation,
)

SCHEMES = sorted(RESAMPLERS)
BLOCKS = ["target", 1, 2, 4]  # "target": the particle filter with the locally optimal proposal
THRESHOLDS = [0.0, 0.5, 1.0]
GROUPS = 2000


def smc(toy: Toy, target, block, particles, resampler="systematic", tau=0.5) -> sd.SMC:
    if block == "target":
        return sd.SMC(target, "target", particles=particles, resampler=resampler, ess_threshold=tau)
    return sd.SMC(target, toy.proposal(), particles=particles, block_size=block, resampler=resampler, ess_threshold=tau)


def check_wellformed(out, eos: int, max_new_tokens: int) -> None:
    """Every particle is a complete sequence: it ends at its first EOS, or has max_new_tokens
    tokens and no EOS; positions after its length are EOS padding."""
    G, N, L = out.tokens.shape
    assert L == max_new_tokens
    pos = torch.arange(L)
    is_eos = out.tokens == eos
    n_eos_before = (is_eos & (pos < out.lengths[..., None])).sum(-1)
    ends_eos = out.lengths.clamp(min=1) - 1
    last_is_eos = is_eos.gather(2, ends_eos[..., None])[..., 0]
    assert bool(((out.lengths >= 1) & (out.lengths <= L)).all())
    assert bool((is_eos | (pos < out.lengths[..., None])).all()), "tokens after a sequence's end are not EOS padding"
    ok = torch.where(last_is_eos, n_eos_before == 1, (n_eos_before == 0) & (out.lengths == L))
    assert bool(ok.all()), "a particle has an EOS before its end, or stopped short without EOS"
    assert bool(out.finished.all())
    assert not bool(torch.isnan(out.log_weights).any()) and not bool(torch.isnan(out.log_evidence).any())


@pytest.mark.parametrize("alpha", [0.5, 2.0])
@pytest.mark.parametrize("tau", THRESHOLDS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("resampler", SCHEMES)
@statistical_settings(2)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_evidence_is_unbiased(resampler, block, tau, alpha, data, seed):
    """E[Ẑ] = Z for a power target p_T^α (α ≠ 1: the bonus token's normaliser Σ_v p^α matters)."""
    toy = data.draw(toys(alphas=(alpha,)), label="toy")
    target = toy.lm()
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    out = smc(toy, target, block, 4, resampler, tau).run_groups(toy.prompt, GROUPS, toy.max_new_tokens, seed=seed)
    check_wellformed(out, toy.model.eos_token_id, toy.max_new_tokens)
    check_evidence_unbiased(out, exact.log_Z)


@pytest.mark.parametrize("block", [1, 2, 4])
@pytest.mark.parametrize("resampler", SCHEMES)
@statistical_settings(3)
@given(toy=toys(), tau=st.sampled_from(THRESHOLDS), seed=st.integers(0, 2**31 - 1))
def test_evidence_is_unbiased_plain_lm(resampler, block, toy, tau, seed):
    """Z = 1 for the LM alone; Ẑ varies through the draft/target ratios (poor bigram drafts too)."""
    target = toy.lm()
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    assert abs(exact.log_Z) < 1e-5
    out = smc(toy, target, block, 4, resampler, tau).run_groups(toy.prompt, GROUPS, toy.max_new_tokens, seed=seed)
    check_evidence_unbiased(out, exact.log_Z)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("resampler", SCHEMES)
@statistical_settings(3)
@given(toy=toys(drafts=("noisy",), noise=(0.2, 0.4)), tau=st.sampled_from(THRESHOLDS), seed=st.integers(0, 2**31 - 1))
def test_weighted_particles_target_pi(resampler, block, toy, tau, seed):
    """E[(Ẑ/Z)·π̂_N(x)] = π(x) for every sequence x, at N = 8 (no large-N limit needed)."""
    target = toy.lm()
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    out = smc(toy, target, block, 8, resampler, tau).run_groups(toy.prompt, GROUPS, toy.max_new_tokens, seed=seed)
    check_wellformed(out, toy.model.eos_token_id, toy.max_new_tokens)
    check_distribution(out, exact, z_max=5.5)


@pytest.mark.parametrize("block", ["target", 1])
@statistical_settings(3)
@given(
    toy=toys(
        vocab=["<bos>", "a", "<eos>"], max_new_tokens=(3,), drafts=("noisy",), noise=(0.2, 0.4), alphas=(1.0, 2.0)
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_total_variation_falls_as_particles_grow(block, toy, seed):
    """Per-replicate TV(π̂_N, π) falls with N (2 → 8 → 32), and so does the O(1/N) bias of the
    plain average of π̂_N (down to the noise floor of 12,800 particles, about 0.03)."""
    target = toy.lm()
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    tv, bias = {}, {}
    for N in (2, 8, 32):
        out = smc(toy, target, block, N, "systematic", 0.5).run_groups(
            toy.prompt, 12_800 // N, toy.max_new_tokens, seed=seed
        )
        dists = particle_distributions(out)
        tv[N] = sum(total_variation(d, exact.probs) for d in dists) / len(dists)
        bias[N] = total_variation(pooled_distribution(out, by_evidence=False), exact.probs)
    assert tv[2] > tv[8] > tv[32], tv
    assert tv[32] < 0.7 * tv[2], tv
    assert bias[32] < 0.5 * bias[2] + 0.03, bias


@pytest.mark.parametrize("block", ["target", 1, 3])
@pytest.mark.parametrize("resampler", SCHEMES)
@statistical_settings(2)
@given(toy=toys(), seed=st.integers(0, 2**31 - 1))
def test_perfect_proposal_gives_exact_samples(resampler, block, toy, seed):
    """With α = 1 and the draft equal to the target (or the target as proposal) every weight is 1:
    Ẑ = 1 and the particles are exact samples of p, even when resampling every round (τ = 1)
    shuffles them and their model state. A chi-square test on one particle per group (particles
    of a group share ancestors, so they are not independent)."""
    target = toy.lm()
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    if block == "target":
        strategy = sd.SMC(target, "target", particles=8, resampler=resampler, ess_threshold=1.0)
    else:
        proposal = sd.Draft(toy.model, toy.temperature)
        strategy = sd.SMC(target, proposal, particles=8, block_size=block, resampler=resampler, ess_threshold=1.0)
    out = strategy.run_groups(toy.prompt, 2000, toy.max_new_tokens, seed=seed)
    assert torch.allclose(out.log_evidence, torch.zeros(2000, dtype=torch.float64), atol=1e-5)
    assert chi_square_pvalue(out, exact, particle=5) > 1e-4


def test_result_of_a_single_run(toy_lm_model):
    """``run`` returns normalised weights, a sample drawn from them and the evidence of group 0."""
    target = sd.LM(toy_lm_model) ** 2
    draft = toy_model(toy_table(8, 5, 1.0), ["<bos>", "a", "b", "c", "<eos>"])
    result = sd.SMC(target, sd.Draft(draft), particles=6, block_size=2).run(PROMPT, 4, seed=3, progress=False)
    assert float(result.weights.sum()) == pytest.approx(1.0)
    assert result.sample_index is not None and float(result.weights[result.sample_index]) > 0
    assert result.text == result.texts[result.sample_index]
    assert len(result.tokens) == 6 and result.rounds == len(result.ess) == 2
