"""The exact baselines: speculative decoding (rejection) and autoregressive sampling reproduce
the target LM's distribution p_T exactly (chi-square tests against enumeration), and
autoregressive sampling under a constraint reproduces *locally masked* decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import PATTERNS, PROMPT, REGEX_VOCAB, statistical_settings, toys
from hypothesis import given
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.testing import chi_square_pvalue, exact_autoregressive, exact_target

P_MIN = 1e-4  # a correct sampler fails a test with probability 1e-4 per example


@pytest.mark.parametrize("block", [1, 2, 4])
@statistical_settings(2)
@given(toy=toys(), seed=st.integers(0, 2**31 - 1))
def test_speculative_decoding_samples_p(block, toy, seed):
    """Accept d with probability min(1, p/q), else draw from (p − q)+: the output is p_T, whatever
    the draft (close or bigram) and its temperature."""
    target = toy.lm()
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    strategy = sd.SpeculativeDecoding(target, toy.proposal(), block_size=block, samples=10)
    out = strategy.run_groups(toy.prompt, 300, toy.max_new_tokens, seed=seed)
    assert bool(torch.isfinite(out.log_weights).all())
    assert 0 <= out.accepted_tokens <= out.draft_tokens
    assert chi_square_pvalue(out, exact) > P_MIN


def test_speculative_decoding_with_the_target_as_draft_accepts_everything(toy_lm_model):
    target = sd.LM(toy_lm_model, temperature=0.9)
    strategy = sd.SpeculativeDecoding(target, sd.Draft(toy_lm_model, 0.9), block_size=3, samples=20)
    out = strategy.run_groups(PROMPT, 10, 5, seed=0)
    assert out.draft_tokens > 0 and out.accepted_tokens == out.draft_tokens


@statistical_settings(4)
@given(toy=toys(), seed=st.integers(0, 2**31 - 1))
def test_autoregressive_samples_p(toy, seed):
    target = toy.lm()
    exact = exact_target(target, toy.prompt, toy.max_new_tokens)
    out = sd.Autoregressive(target, samples=4).run_groups(toy.prompt, 1500, toy.max_new_tokens, seed=seed)
    assert chi_square_pvalue(out, exact) > P_MIN


@statistical_settings(4)
@given(
    toy=toys(vocab=REGEX_VOCAB, alphas=(0.5, 1.0, 2.0)),
    pattern=st.sampled_from([None, *PATTERNS]),
    seed=st.integers(0, 2**31 - 1),
)
def test_autoregressive_samples_the_locally_normalised_target(toy, pattern, seed):
    """Each token ∝ p_T(v | h)^α·1[valid]: locally masked decoding, conditioned on success
    (failed sequences get weight 0)."""
    target = toy.lm() if pattern is None else toy.lm() * sd.Regex(pattern)
    local = exact_autoregressive(target, toy.prompt, toy.max_new_tokens)
    out = sd.Autoregressive(target, samples=4).run_groups(toy.prompt, 1500, toy.max_new_tokens, seed=seed)
    assert chi_square_pvalue(out, local) > P_MIN


def test_chi_square_rejects_the_wrong_temperature(toy_lm_model):
    """The test has power: samples at T = 1 against the exact distribution at T = 1.25."""
    out = sd.Autoregressive(sd.LM(toy_lm_model), samples=4).run_groups(PROMPT, 1500, 3, seed=0)
    assert chi_square_pvalue(out, exact_target(sd.LM(toy_lm_model), PROMPT, 3)) > P_MIN
    assert chi_square_pvalue(out, exact_target(sd.LM(toy_lm_model, temperature=1.25), PROMPT, 3)) < 1e-6
