"""Block-size schedules (samplers/adaptive.py) against exact enumeration: E[Ẑ] = Z for fixed
schedules with K = 0 rounds and mixed K, and for the adaptive schedule (its K looks only at the
past, so Ẑ stays unbiased and E[Ẑ·π̂] = γ); on the reference loop, a feature-free draft whose
cache must stay consistent across K = 0 rounds, and on the engine's torch path on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import statistical_settings, toys
from hypothesis import assume, given
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.errors import SMCDecodeError
from smcdecode.samplers.adaptive import (
    EASY_TOKEN_WEIGHT,
    AdaptiveBlocks,
    DraftStats,
    FixedBlocks,
    as_schedule,
    group_statistics,
    row_statistics,
)
from smcdecode.testing import check_distribution, check_evidence_unbiased, exact_target

GROUPS = 2000
SCHEDULES = [[0], [2, 0, 1], [0, 0, 3], [1, 0]]
# an adaptive rule that moves: probes early, opens blocks quickly
LIVELY = AdaptiveBlocks(max_block_size=3, probe_after=1, prior_acceptance=0.6, memory=0.5)


def run(toy, schedule, particles=4, tau=0.5, seed=0, groups=GROUPS):
    smc = sd.SMC(toy.lm(), toy.proposal(), particles=particles, block_size=schedule, ess_threshold=tau)
    return smc.run_groups(toy.prompt, groups, toy.max_new_tokens, seed=seed)


@pytest.mark.parametrize("schedule", SCHEDULES)
@statistical_settings(2)
@given(toy=toys(alphas=(1.0, 2.0)), tau=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_fixed_schedules_keep_the_evidence_unbiased(schedule, toy, tau, seed):
    exact = exact_target(toy.lm(), toy.prompt, toy.max_new_tokens)
    out = run(toy, schedule, tau=tau, seed=seed)
    assert bool((out.block_sizes[0] == min(schedule[0], toy.max_new_tokens)).all())
    check_evidence_unbiased(out, exact.log_Z)


@pytest.mark.parametrize("schedule", [[0, 2], [2, 0, 1]])
@statistical_settings(2)
@given(toy=toys(drafts=("noisy",), noise=(0.2, 0.4), alphas=(1.0, 2.0)), seed=st.integers(0, 2**31 - 1))
def test_fixed_schedules_target_pi(schedule, toy, seed):
    exact = exact_target(toy.lm(), toy.prompt, toy.max_new_tokens)
    check_distribution(run(toy, schedule, particles=8, seed=seed), exact, z_max=5.5)


@statistical_settings(3)
@given(toy=toys(drafts=("noisy",), noise=(0.2, 0.4), alphas=(1.0, 2.0), max_new_tokens=(4,)),
       seed=st.integers(0, 2**31 - 1))
def test_adaptive_schedule_is_unbiased_and_targets_pi(toy, seed):
    """The adaptive K varies between groups and rounds, yet E[Ẑ] = Z and E[Ẑ·π̂] = γ."""
    exact = exact_target(toy.lm(), toy.prompt, toy.max_new_tokens)
    out = run(toy, LIVELY, particles=4, seed=seed, groups=1500)
    K = torch.stack(out.block_sizes)  # [rounds, G]
    assert len(set(K.flatten().tolist())) >= 2, "the schedule never changed K: the test tests nothing adaptive"
    check_evidence_unbiased(out, exact.log_Z)
    check_distribution(out, exact, z_max=5.5)


def test_adaptive_rule_reads_the_draft():
    """Good statistics open the block up to K_max (at most doubling plus one a round); poor ones
    close it to 0, and a K = 0 stretch is broken by probes whose wait doubles."""
    rule = AdaptiveBlocks(max_block_size=8)
    good = rule.start(1)
    assert int(good.next()[0]) == 0  # start_block
    ks = []
    for _ in range(6):
        good.observe(DraftStats(torch.tensor([15.6]), torch.tensor([16.0]), torch.tensor([0.01]), torch.tensor([2.0])))
        ks.append(int(good.next()[0]))
    assert ks[:3] == [1, 3, 7] and ks[-1] == 8, ks
    bad = rule.start(1)
    bad.next()
    probes = []
    for t in range(20):
        fresh = bool(bad.probing[0]) if t else False
        bad.observe(DraftStats(torch.tensor([0.1 * fresh]), torch.tensor([1.0 * fresh]), torch.tensor([0.0]),
                               torch.tensor([1.0 * fresh])))
        assert int(bad.next()[0]) == 0
        probes.append(bool(bad.probing[0]))
    gaps = np.diff(np.flatnonzero(probes))
    assert len(gaps) >= 2 and (np.diff(gaps) >= 0).all() and gaps[-1] > gaps[0], probes


def test_tokens_the_target_is_sure_of_are_weak_evidence():
    """A drafted token the target gives probability ~1 (a format's quote) counts as EASY_TOKEN_WEIGHT
    of a token: agreeing on it cannot open a block; agreeing where the target hesitates can."""
    log_p = torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.4, 0.4, 0.4, 0.4]]))
    log_q = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.4, 0.4, 0.4, 0.4]]))
    counted = torch.ones(2, 4, dtype=torch.bool)
    counted[1, 3] = False  # past the row's first EOS: not counted
    accept, count, lw = row_statistics(log_p, log_q, log_p - log_q, counted)
    assert torch.allclose(count, torch.tensor([4 * EASY_TOKEN_WEIGHT, 3 * 0.6], dtype=torch.float64))
    assert torch.allclose(accept, count)  # p >= q on every token: each accepted with probability 1
    assert torch.allclose(lw, torch.tensor([4 * -np.log(0.9), 0.0], dtype=torch.float64))
    rule = AdaptiveBlocks(max_block_size=8)
    ks = []
    for row in (0, 1):
        plan = rule.start(1)
        plan.next()
        stats = group_statistics(accept[row:row + 1], count[row:row + 1], lw[row:row + 1],
                                 torch.ones(1, dtype=torch.bool), 1)
        for _ in range(3):
            plan.observe(stats)
            ks.append(int(plan.next()[0]))
    assert ks[:3] == [0, 0, 0] and min(ks[3:]) >= 1, ks


def test_block_size_spellings_and_errors():
    assert as_schedule("adaptive") == AdaptiveBlocks()
    assert as_schedule([2, 0]) == FixedBlocks([2, 0]) and FixedBlocks([2, 0]).max_block_size == 2
    assert as_schedule(4) is None
    for bad in ("fast", [], [1, -1], [1.5]):
        with pytest.raises(SMCDecodeError, match="block"):
            as_schedule(bad)
    with pytest.raises(SMCDecodeError, match="block_acceptance"):
        AdaptiveBlocks(block_acceptance=1.5)


# -- the engine's general round, torch path on the CPU ------------------------------------------

@pytest.mark.parametrize("schedule", [FixedBlocks([0, 1, 0]), FixedBlocks([2, 0]),
                                      AdaptiveBlocks(max_block_size=2, probe_after=1, prior_acceptance=0.6)])
def test_engine_schedules_are_unbiased(schedule):
    from test_engine_statistics import MARGINALS, _engine, _exact, _z_scores

    hf, engine = _engine("cpu")
    prompt, n, N = [2, 7, 1, 6], 4 if schedule.adaptive else 3, 4
    G = 900 if schedule.adaptive else 1500  # (the pool of _engine holds 900 groups of 4-token outputs)
    exact = _exact(hf, prompt, n)
    out = engine.smc_sd([prompt] * G, particles=N, block_size=2, max_new_tokens=n, seed=3, schedule=schedule)
    assert (out.lengths == n).all()
    K = np.stack(out.block_sizes)
    if schedule.adaptive:
        assert len(np.unique(K)) >= 2, K
    else:
        assert (K[:, 0] == np.array(schedule.blocks[: len(K)] + schedule.blocks[-1:] * len(K))[: len(K)]).all()
    seqs = [tuple(t) for t in out.tokens.cpu().numpy().reshape(-1, n).tolist()]
    contrib = torch.exp(out.log_evidence[:, None] - torch.logsumexp(out.log_weights, 1, keepdim=True)
                        + out.log_weights).cpu().numpy()
    values = contrib.reshape(30, -1) / (G // 30)
    for m in MARGINALS:
        z = _z_scores(values, seqs, exact, m)
        assert len(z) and np.abs(z).max() < 4.5, z.round(2)
    zhat = out.log_evidence.exp().cpu().double().numpy()
    se = max(zhat.std(ddof=1) / np.sqrt(G), 1e-6)  # (K = 0 everywhere: Ẑ = 1 up to float32 rounding)
    assert abs(zhat.mean() - 1.0) < 4.5 * se


@pytest.mark.parametrize("schedule", [[0, 0, 2, 0, 1], [1, 0, 0, 3], LIVELY])
@statistical_settings(3)
@given(toy=toys(max_new_tokens=(6,)), seed=st.integers(0, 2**31 - 1))
def test_draft_cache_stays_consistent_across_k0_rounds(schedule, toy, seed):
    """With the target itself as the draft (α = 1) every weight is exactly 1 — unless the draft
    missed a token it had not seen during K = 0 rounds (the toy LMs read the whole context, so a
    missing or repeated token changes q): then Ẑ ≠ 1."""
    target = sd.LM(toy.model, temperature=toy.temperature)
    smc = sd.SMC(target, sd.Draft(toy.model, toy.temperature), particles=4, block_size=schedule)
    out = smc.run_groups(toy.prompt, 50, toy.max_new_tokens, seed=seed)
    K = torch.stack(out.block_sizes)
    assume(bool((K == 0).any()) and bool((K > 0).any()))
    # (float32 logits: about 1e-7 of rounding; a token the draft missed changes log q by O(1))
    assert torch.allclose(out.log_weights, torch.zeros_like(out.log_weights), atol=1e-5)
    assert torch.allclose(out.log_evidence, torch.zeros_like(out.log_evidence), atol=1e-5)


def _result(ess, survivors, log_evidence=-4.0, target_log_evidence=-4.0, block_size=4, block_sizes=()):
    n = 8
    return sd.Result(strategy="smc", texts=["x"] * n, tokens=[[1]] * n, log_weights=torch.zeros(n, dtype=torch.float64),
                     weights=torch.full((n,), 1 / n, dtype=torch.float64), finished=torch.ones(n, dtype=torch.bool),
                     log_evidence=log_evidence, ess=ess, resampled=[s < n for s in survivors],
                     weight_history=[], sample_index=0, seconds=1.0, prompt_tokens=3, particles=n,
                     block_size=block_size, survivors=survivors, target_log_evidence=target_log_evidence,
                     block_sizes=list(block_sizes))


def test_collapse_diagnosis_names_the_signs_and_the_fix():
    healthy = _result([6.0, 5.5, 7.0, 6.5], [8, 5, 8, 6])
    assert healthy.diagnosis == "" and "collapsed" not in healthy.summary()
    for bad, sign in ((_result([3.0, 3.5, 3.9, 3.6], [8, 5, 8, 6]), "(mean ESS 3.5/8)"),  # mean ESS < N/2
                      (_result([6.0, 5.5, 7.0, 6.5], [1, 8, 1, 8]), "(2 of 4 rounds with one surviving ancestor)"),
                      (_result([6.0, 5.5, 7.0, 6.5], [8, 5, 8, 6], log_evidence=-12.0),  # log Ẑ far below
                       "(log Z -12.0 vs about -4.0 with the target as proposal)")):
        line = bad.diagnosis  # (only the signs seen: a healthy ESS is not quoted as a sign of collapse)
        assert line.startswith("particle system collapsed " + sign + ": the draft cannot propose"), line
        assert line in bad.summary()
    one = _result([1.0, 1.0], [1, 1], log_evidence=-12.0)  # one particle: its ESS is no sign
    one.particles = 1
    assert one.diagnosis.startswith("particle system collapsed (log Z -12.0"), one.diagnosis
    # with the target as proposal there is no proposal to blame: the gap (a reward's share of log Ẑ) is
    # neither a sign nor a fact, and the fix is more particles
    tilted = _result([3.0, 3.0], [8, 8], log_evidence=-12.0, block_size=0).diagnosis
    assert "more particles" in tilted and "target as proposal" not in tilted, tilted
    assert _result([6.0, 5.5, 7.0, 6.5], [8, 5, 8, 6], log_evidence=-12.0, block_size=0).diagnosis == ""


def test_summary_says_when_the_schedule_never_let_the_draft_in():
    kept_out = _result([6.0] * 3, [8] * 3, block_size=8, block_sizes=[0, 0, 0]).summary()
    assert "K = 0 in every round (the schedule never let the draft in" in kept_out, kept_out
    mixed = _result([6.0] * 3, [8] * 3, block_size=8, block_sizes=[0, 2, 4]).summary()
    assert "K from 0 to 4 draft tokens a round (mean 2.0)" in mixed, mixed
    fixed = _result([6.0] * 3, [8] * 3, block_size=4, block_sizes=[4, 4, 4]).summary()
    assert "K = 4 draft tokens a round" in fixed, fixed
