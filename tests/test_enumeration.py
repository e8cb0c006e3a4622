"""smcdecode.testing: exact enumeration against brute force, the potential property checks
(on toy models: LM, power, Regex, Reward, products), and the output/statistics helpers."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from conftest import PATTERNS, PROMPT, REGEX_VOCAB, REWARDS, statistical_settings, toy_model, toy_table, toys
from hypothesis import given
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.samplers.smc_sd import SMCOutput
from smcdecode.testing import (
    ExactTarget,
    check_batch_consistency,
    check_distribution,
    check_logw_next_consistency,
    check_tensor_path,
    chi_square_pvalue,
    distribution_z_scores,
    empirical_distribution,
    enumerate_prefixes,
    evidence_z_score,
    exact_autoregressive,
    exact_target,
    particle_distributions,
    pooled_distribution,
    sequences,
    total_variation,
)


def brute_force(
    model, prompt, temperature, alpha, max_new_tokens, pattern=None, reward=None, beta=0.0, mode="complete"
):
    """γ(x) for every complete sequence straight from the model function, in float64, with
    Python's ``re`` for the constraint: independent of the potentials' code."""
    eos, V = model.eos_token_id, model.vocab_size
    letters = [v for v in range(V) if v != eos]
    r0 = reward("") if reward is not None and mode == "prefix" else 0.0
    out = {}
    for n in range(max_new_tokens + 1):
        for body in itertools.product(letters, repeat=n):
            seqs = [body + (eos,)] if n < max_new_tokens else [body]
            for x in seqs:
                logp = 0.0
                for i, v in enumerate(x):
                    ctx = torch.tensor([list(prompt) + list(x[:i])])
                    logits = torch.as_tensor(model.fn(ctx)).double()[0]
                    logp += float(torch.log_softmax(logits / temperature, -1)[v])
                text = model.decode(list(x))
                if pattern is not None and re.fullmatch(pattern, text) is None:
                    continue
                logw = alpha * logp
                if reward is not None:
                    logw += beta * (reward(text) - r0)
                out[x] = logw
    values = torch.tensor(list(out.values()), dtype=torch.float64)
    log_Z = float(torch.logsumexp(values, 0))
    return {x: math.exp(w - log_Z) for x, w in out.items()}, log_Z


@statistical_settings(8)
@given(
    toy=toys(vocab=REGEX_VOCAB, max_new_tokens=(3, 4), alphas=(0.5, 1.0, 2.0)),
    pattern=st.sampled_from([None, *PATTERNS]),
    reward=st.sampled_from([None, *REWARDS]),
    beta=st.sampled_from([-1.0, 0.7]),
    mode=st.sampled_from(["prefix", "complete"]),
)
def test_exact_target_matches_brute_force(toy, pattern, reward, beta, mode):
    target = toy.lm()
    if pattern is not None:
        target = target * sd.Regex(pattern)
    if reward is not None:
        target = target * sd.Reward(reward, beta=beta, mode=mode)
    M = toy.max_new_tokens
    exact = exact_target(target, toy.prompt, M)
    probs, log_Z = brute_force(toy.model, toy.prompt, toy.temperature, toy.alpha, M, pattern, reward, beta, mode)
    assert set(exact.probs) == set(probs)
    assert math.isclose(sum(exact.probs.values()), 1.0, abs_tol=1e-12)
    assert exact.log_Z == pytest.approx(log_Z, abs=1e-4)
    for x, p in probs.items():
        assert exact.probs[x] == pytest.approx(p, rel=1e-4, abs=1e-9), x


def test_plain_lm_normaliser_is_one(toy_lm_model):
    exact = exact_target(sd.LM(toy_lm_model, temperature=0.9), PROMPT, 4)
    assert exact.log_Z == pytest.approx(0.0, abs=1e-6)
    # EOS-ended sequences of 1..4 tokens and cut sequences of 4 letters, all of positive probability
    assert len(exact.probs) == sum(4**n for n in range(4)) + 4**4


def test_unsatisfiable_constraint_has_empty_target(toy_lm_model):
    exact = exact_target(sd.LM(toy_lm_model) * sd.Regex(r"a{6}"), PROMPT, 3)
    assert exact.probs == {} and exact.log_Z == float("-inf")


def test_prefix_reward_normaliser_is_relative_to_the_empty_text(toy_lm_model):
    """Z of a prefix-mode reward telescopes from R(""), a completion-mode reward's does not."""

    def reward(text):
        return 2.0 + len(text)

    beta = 0.5
    lm = sd.LM(toy_lm_model)
    prefix = exact_target(lm * sd.Reward(reward, beta, mode="prefix"), PROMPT, 3)
    complete = exact_target(lm * sd.Reward(reward, beta, mode="complete"), PROMPT, 3)
    assert complete.log_Z - prefix.log_Z == pytest.approx(beta * reward(""), abs=1e-9)
    for x, p in prefix.probs.items():
        assert complete.probs[x] == pytest.approx(p, rel=1e-9)


def test_exact_autoregressive_is_locally_masked(toy_lm_model):
    """Without a constraint AR samples p itself; with one it masks locally, which is not the
    global conditional p(x | x ∈ A)."""
    lm = sd.LM(toy_lm_model, temperature=1.2)
    plain, masked = exact_target(lm, PROMPT, 3), exact_autoregressive(lm, PROMPT, 3)
    assert total_variation(plain.probs, masked.probs) < 1e-6
    assert masked.log_Z == pytest.approx(0.0, abs=1e-12)

    target = lm * sd.Regex(r"a(b|c)*")
    glob, local = exact_target(target, PROMPT, 3), exact_autoregressive(target, PROMPT, 3)
    assert set(glob.probs) == set(local.probs)
    assert total_variation(glob.probs, local.probs) > 0.01
    # the first token is forced to "a" locally, so the locally masked first step has weight 1
    first = {}
    for x, p in local.probs.items():
        first[x[0]] = first.get(x[0], 0.0) + p
    assert first == {1: pytest.approx(1.0)}


# -- property checks ----------------------------------------------------------------------------


def _potentials(toy, pattern, reward, beta):
    lm = toy.lm()
    regex = sd.Regex(pattern).bind(toy.model)
    rewards = [sd.Reward(reward, beta, mode=m).bind(toy.model) for m in ("prefix", "complete")]
    return [lm, regex, *rewards, lm * regex * rewards[0], lm * rewards[1]]


@statistical_settings(6)
@given(
    toy=toys(vocab=REGEX_VOCAB, max_new_tokens=(3,), alphas=(0.5, 1.0, 2.0)),
    pattern=st.sampled_from(PATTERNS),
    reward=st.sampled_from(REWARDS),
    beta=st.sampled_from([-1.0, 0.7]),
)
def test_potentials_next_token_weights_agree_with_scores(toy, pattern, reward, beta):
    seqs = enumerate_prefixes(toy.model, 2)
    for potential in _potentials(toy, pattern, reward, beta):
        check_logw_next_consistency(potential, toy.prompt, seqs)


@statistical_settings(6)
@given(
    toy=toys(vocab=REGEX_VOCAB, max_new_tokens=(3,), alphas=(0.5, 1.0, 2.0)),
    pattern=st.sampled_from(PATTERNS),
    reward=st.sampled_from(REWARDS),
    beta=st.sampled_from([-1.0, 0.7]),
)
def test_potentials_batched_equals_unbatched(toy, pattern, reward, beta):
    equal = [s for s in enumerate_prefixes(toy.model, 2) if len(s) == 2]
    mixed = enumerate_prefixes(toy.model, 2)
    for potential in _potentials(toy, pattern, reward, beta):
        check_batch_consistency(potential, toy.prompt, equal)
        check_batch_consistency(potential, toy.prompt, mixed)
        check_batch_consistency(potential, [0, 1, 2], mixed[:7])  # a longer prompt


@pytest.mark.parametrize("pattern", PATTERNS + [r"(ab)+", r"a?", r"[ab]*abab"])
def test_regex_tensor_path_agrees_with_scores(pattern):
    model = toy_model(toy_table(0, 5, 1.0), REGEX_VOCAB)
    check_tensor_path(sd.Regex(pattern).bind(model), enumerate_prefixes(model, 4))


class _OffByOneEOS(sd.LM):
    def logw_next(self, tokens, prompt=()):
        out = super().logw_next(tokens, prompt).clone()
        out[self.model.eos_token_id] += 0.1
        return out


class _ShuffledBatch(sd.LM):
    def batch_logw_next(self, seqs, prompt=()):
        return super().batch_logw_next(seqs, prompt).flip(0)


class _StricterScalarRegex(sd.Regex):
    def prefix(self, tokens, prompt=()):
        return float("-inf") if 2 in tokens[1:] else super().prefix(tokens, prompt)  # a 2nd "b" rejected


def test_property_checks_can_fail(toy_lm_model):
    seqs = enumerate_prefixes(toy_lm_model, 2)
    with pytest.raises(AssertionError, match="logw_next"):
        check_logw_next_consistency(_OffByOneEOS(toy_lm_model), PROMPT, seqs)
    with pytest.raises(AssertionError, match="batch_logw_next"):
        check_batch_consistency(_ShuffledBatch(toy_lm_model), PROMPT, [s for s in seqs if len(s) == 2])
    with pytest.raises(AssertionError, match="allowed"):
        check_tensor_path(_StricterScalarRegex(r"b+", model=toy_lm_model), seqs)


# -- output helpers and statistics --------------------------------------------------------------


def _output(tokens, lengths, log_weights, log_evidence):
    tokens = torch.tensor(tokens)
    return SMCOutput(
        tokens,
        torch.tensor(lengths),
        torch.ones(tokens.shape[:2], dtype=torch.bool),
        torch.tensor(log_weights, dtype=torch.float64),
        torch.tensor(log_evidence, dtype=torch.float64),
    )


def test_output_helpers():
    inf = float("inf")
    out = _output(
        [[[1, 2, 3], [1, 3, 3], [1, 2, 3]], [[2, 3, 3], [2, 3, 3], [1, 1, 1]]],
        [[3, 2, 3], [2, 2, 3]],
        [[0.0, math.log(2), -inf], [-inf, -inf, -inf]],
        [0.0, -inf],
    )
    assert sequences(out, 0) == [(1, 2, 3), (1, 3), (1, 2, 3)]
    dists = particle_distributions(out)
    assert dists[0] == {(1, 2, 3): pytest.approx(1 / 3), (1, 3): pytest.approx(2 / 3)}
    assert dists[1] == {}
    assert pooled_distribution(out) == dists[0]  # the dead group has Ẑ = 0
    assert pooled_distribution(out, by_evidence=False) == {
        (1, 2, 3): pytest.approx(1 / 6),
        (1, 3): pytest.approx(1 / 3),
    }
    assert empirical_distribution(out) == {(1, 2, 3): 0.5, (1, 3): 0.5}
    assert total_variation({"a": 1.0}, {"b": 1.0}) == 1.0
    assert total_variation({"a": 0.5, "b": 0.5}, {"a": 0.25, "b": 0.75}) == pytest.approx(0.25)


def test_statistics_accept_exact_samples_and_reject_wrong_ones(toy_lm_model):
    """The z-tests and the chi-square test pass on exact draws and fail on slightly wrong ones."""
    exact = exact_target(sd.LM(toy_lm_model), PROMPT, 3)
    seqs = list(exact.probs)
    probs = torch.tensor([exact.probs[x] for x in seqs])
    wrong = probs.clone()
    wrong[probs.argmax()] *= 1.3
    wrong /= wrong.sum()
    gen = torch.Generator().manual_seed(0)
    G, N, L = 2000, 4, 3

    def draws(p):
        idx = torch.multinomial(p, G * N, replacement=True, generator=gen).view(G, N)
        tokens = torch.full((G, N, L), 4)
        lengths = torch.zeros(G, N, dtype=torch.long)
        for g in range(G):
            for i in range(N):
                x = seqs[int(idx[g, i])]
                tokens[g, i, : len(x)] = torch.tensor(x)
                lengths[g, i] = len(x)
        return SMCOutput(
            tokens,
            lengths,
            torch.ones(G, N, dtype=torch.bool),
            torch.zeros(G, N, dtype=torch.float64),
            torch.zeros(G, dtype=torch.float64),
        )

    good, bad = draws(probs), draws(wrong)
    assert chi_square_pvalue(good, exact) > 1e-4
    assert chi_square_pvalue(bad, exact) < 1e-6
    assert check_distribution(good, exact) < 5
    with pytest.raises(AssertionError, match="differs from the exact target"):
        check_distribution(bad, exact)
    # a sequence outside the support
    bad.tokens[0, 0] = torch.tensor([1, 1, 1])
    bad.lengths[0, 0] = 3
    with pytest.raises(AssertionError, match="outside the target's support"):
        check_distribution(bad, ExactTarget({x: p for x, p in exact.probs.items() if x != (1, 1, 1)}, 0.0))
    assert max(abs(z) for z in distribution_z_scores(good, exact).values()) < 5

    # evidence: Ẑ/Z ~ Gamma(4, 1/4) has mean 1; scaled by 1.1 it does not
    torch.manual_seed(0)
    zhat = torch.distributions.Gamma(4.0, 4.0).sample((4000,)).double()
    assert abs(evidence_z_score(zhat.log(), 0.0)) < 5
    assert evidence_z_score(zhat.log(), math.log(1.1)) < -5
    assert evidence_z_score(torch.zeros(10, dtype=torch.float64), 0.0) == 0.0
    assert evidence_z_score(torch.zeros(10, dtype=torch.float64), 0.1) == -math.inf
    assert evidence_z_score(torch.full((10,), 1e-8, dtype=torch.float64), 0.0) == 0.0  # rounding
