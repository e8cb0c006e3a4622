"""Constrained, reward-tilted and power targets: SMC's weighted particles follow the exact
π ∝ p_T^α · 1[x ∈ A] · exp(β·R(x)) (the global conditional, not locally masked decoding), every
particle of positive weight satisfies the constraint, and Ẑ is unbiased for Z."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import PATTERNS, PROMPT, REGEX_VOCAB, REWARDS, statistical_settings, toy_model, toy_table, toys
from hypothesis import assume, given
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.testing import (
    check_distribution,
    check_evidence_unbiased,
    exact_autoregressive,
    exact_target,
    particle_distributions,
    sequences,
    total_variation,
)

GROUPS = 2000
SCHEMES = ["multinomial", "residual", "stratified", "systematic"]


def run_smc(toy, target, block, particles=8, resampler="systematic", tau=0.5, seed=0, groups=GROUPS):
    proposal = "target" if block == "target" else toy.proposal()
    strategy = sd.SMC(
        target,
        proposal,
        particles=particles,
        block_size=None if block == "target" else block,
        resampler=resampler,
        ess_threshold=tau,
    )
    return strategy.run_groups(toy.prompt, groups, toy.max_new_tokens, seed=seed)


# -- constraints --------------------------------------------------------------------------------


@pytest.mark.parametrize("block", ["target", 1, 2])
@statistical_settings(4)
@given(
    toy=toys(vocab=REGEX_VOCAB, drafts=("noisy",), noise=(0.2, 0.4), alphas=(1.0, 2.0)),
    pattern=st.sampled_from(PATTERNS),
    resampler=st.sampled_from(SCHEMES),
    tau=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_constrained_target_is_the_global_conditional(block, toy, pattern, resampler, tau, seed):
    target = toy.lm() * sd.Regex(pattern)
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    out = run_smc(toy, target, block, resampler=resampler, tau=tau, seed=seed)
    alive = torch.isfinite(out.log_weights)
    for g in range(0, GROUPS, 7):
        for x, ok in zip(sequences(out, g), alive[g].tolist()):
            if ok:
                text = toy.model.decode(list(x))
                assert re.fullmatch(pattern, text), (
                    f"particle {list(x)} ({text!r}) has positive weight but fails {pattern!r}"
                )
    check_distribution(out, exact, z_max=5.5)
    check_evidence_unbiased(out, exact.log_Z)


@pytest.mark.parametrize("block", ["target", 2])
@statistical_settings(3)
@given(
    toy=toys(vocab=REGEX_VOCAB, drafts=("noisy",), noise=(0.2, 0.4)),
    pattern=st.sampled_from(PATTERNS),
    seed=st.integers(0, 2**31 - 1),
)
def test_two_constraints_intersect(block, toy, pattern, seed):
    """Ψ = 1[x ∈ A]·1[x ∈ B]: the masks intersect, on drafts and bonus tokens alike."""
    short = r"[ab]{0,3}"  # at most three characters
    target = toy.lm() * sd.Regex(pattern) * sd.Regex(short)
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    assume(exact.probs)
    out = run_smc(toy, target, block, seed=seed)
    alive = torch.isfinite(out.log_weights)
    for g in range(0, GROUPS, 7):
        for x, ok in zip(sequences(out, g), alive[g].tolist()):
            text = toy.model.decode(list(x))
            assert not ok or (re.fullmatch(pattern, text) and re.fullmatch(short, text)), (list(x), text)
    check_distribution(out, exact, z_max=5.5)
    check_evidence_unbiased(out, exact.log_Z)


def test_smc_is_not_locally_masked_decoding():
    """A constraint that local masking gets badly wrong: the model prefers "a" first, but nearly
    every continuation of "a" that fits the pattern is improbable. SMC matches the global
    conditional; AR's locally masked distribution is far from it, and check_distribution says so."""
    vocab = ["<bos>", "a", "b", "c", "<eos>"]

    def fn(ctx):
        logits = torch.zeros(ctx.shape[0], 5)
        logits[:, 1] = 2.0  # "a" is likely anywhere
        first = ctx[:, -1] == 0
        logits[first, 1] = 3.0
        after_a = ctx[:, -1] == 1
        logits[after_a, 2] = -4.0  # ... but "b" after "a" is unlikely
        return logits

    model = sd.FunctionModel(fn, vocab=vocab, eos="<eos>")
    target = sd.LM(model) * sd.Regex(r"ab+|c+")
    glob, local = exact_target(target, PROMPT, 3), exact_autoregressive(target, PROMPT, 3)
    assert total_variation(glob.probs, local.probs) > 0.3
    draft = toy_model(toy_table(1, 5, 0.5), vocab)
    out = sd.SMC(target, sd.Draft(draft), particles=8, block_size=2).run_groups(PROMPT, GROUPS, 3, seed=0)
    check_distribution(out, glob, z_max=5.5)
    with pytest.raises(AssertionError, match="differs from the exact target"):
        check_distribution(out, local, z_max=5.5)
    ar = sd.Autoregressive(target, samples=4).run_groups(PROMPT, GROUPS, 3, seed=0)
    ar.log_evidence = torch.zeros(GROUPS, dtype=torch.float64)  # equal-weight samples of `local`
    check_distribution(ar, local, z_max=5.5)
    with pytest.raises(AssertionError, match="differs from the exact target"):
        check_distribution(ar, glob, z_max=5.5)


def test_every_particle_dies_when_nothing_fits_the_budget(toy_lm_model):
    """r"a{5}" needs 5 tokens; with 3 allowed every weight is 0: log Ẑ = -inf, no NaN, and the
    Result says so instead of returning a sample."""
    target = sd.LM(toy_lm_model) * sd.Regex(r"a{5}")
    assert exact_target(target, PROMPT, 3).log_Z == -math.inf
    for proposal, block in (("target", None), (sd.Draft(toy_lm_model, 1.3), 2)):
        strategy = sd.SMC(target, proposal, particles=4, block_size=block, ess_threshold=1.0)
        out = strategy.run_groups(PROMPT, 50, 3, seed=0)
        assert bool(torch.isneginf(out.log_evidence).all())
        assert bool(torch.isneginf(out.log_weights).all())
        assert all(d == {} for d in particle_distributions(out))
        result = strategy.run(PROMPT, 3, seed=0, progress=False)
        assert result.text is None and result.sample_index is None and "weight 0" in result.message
        assert float(result.weights.sum()) == 0.0 and not bool(torch.isnan(result.weights).any())


# -- rewards ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefix", "complete"])
@pytest.mark.parametrize("block", ["target", 1, 2])
@statistical_settings(4)
@given(
    toy=toys(drafts=("noisy",), noise=(0.2, 0.4)),
    reward=st.sampled_from(REWARDS),
    beta=st.sampled_from([-1.0, 0.5, 1.0]),
    batched=st.booleans(),
    resampler=st.sampled_from(SCHEMES),
    tau=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reward_target_and_evidence(mode, block, toy, reward, beta, batched, resampler, tau, seed):
    """π ∝ p·exp(β·R(x)); Z = Σ p·exp(β·(R(x) − R(""))) for a prefix twist, Σ p·exp(β·R(x)) else.
    ``batched=True`` rewards score a list of texts per call."""
    if batched:
        target = toy.lm() * sd.Reward(lambda texts: [reward(t) for t in texts], beta=beta, mode=mode, batched=True)
    else:
        target = toy.lm() * sd.Reward(reward, beta=beta, mode=mode)
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    out = run_smc(toy, target, block, resampler=resampler, tau=tau, seed=seed)
    check_distribution(out, exact, z_max=5.5)
    check_evidence_unbiased(out, exact.log_Z)


# -- powers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.5, 2.0])
@pytest.mark.parametrize("block", ["target", 1, 3])
@statistical_settings(4)
@given(
    data=st.data(),
    resampler=st.sampled_from(SCHEMES),
    tau=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_power_target_and_evidence(alpha, block, data, resampler, tau, seed):
    """π ∝ p_T^α (global, not the token-wise p_T^α normalised per step); Z = Σ_x p_T(x)^α."""
    toy = data.draw(toys(drafts=("noisy",), noise=(0.2, 0.4), alphas=(alpha,)))
    target = toy.lm()
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    out = run_smc(toy, target, block, resampler=resampler, tau=tau, seed=seed)
    check_distribution(out, exact, z_max=5.5)
    check_evidence_unbiased(out, exact.log_Z)


# -- everything at once -----------------------------------------------------------------------------


@pytest.mark.parametrize("block", ["target", 2])
@statistical_settings(4)
@given(
    toy=toys(vocab=REGEX_VOCAB, drafts=("noisy",), noise=(0.2, 0.4), alphas=(0.5, 1.0, 2.0)),
    pattern=st.sampled_from(PATTERNS),
    reward=st.sampled_from(REWARDS),
    beta=st.sampled_from([-1.0, 0.5]),
    mode=st.sampled_from(["prefix", "complete"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_power_constraint_and_reward_together(block, toy, pattern, reward, beta, mode, seed):
    target = toy.lm() * sd.Regex(pattern) * sd.Reward(reward, beta=beta, mode=mode)
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    out = run_smc(toy, target, block, seed=seed)
    check_distribution(out, exact, z_max=5.5)
    check_evidence_unbiased(out, exact.log_Z)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scoring_path_is_cpu_float64_when_the_model_returns_cuda_logits():
    """An LM whose logits live on the GPU, multiplied with a Regex: the potentials' scoring path
    (logw_next / batch_logw_next, used by exact_target) returns CPU float64 for every factor, so the
    product does not mix devices."""
    vocab = ["<bos>", "a", "b", "<eos>"]
    table = torch.randn(4, 4, device="cuda")
    model = sd.FunctionModel(lambda ctx: table[ctx[:, -1]], vocab=vocab, eos="<eos>")
    target = sd.LM(model) * sd.Regex(r"ab*")
    w = target.batch_logw_next([[1], [1]], PROMPT)
    assert w.device.type == "cpu" and w.dtype == torch.float64
    assert target.logw_next([1], PROMPT).device.type == "cpu"
    exact = exact_target(target, PROMPT, 3)
    assert math.isclose(sum(exact.probs.values()), 1.0, abs_tol=1e-9) and math.isfinite(exact.log_Z)
