"""The reference backend's request loop (samplers/loop.py) against exact enumeration: requests with
their own N, K, power, constraints, resampler and τ join between rounds and leave when done, and
each one's Ẑ stays unbiased and its weighted particles target its own π; a request draws the same
with or without company; queueing (max_live), cancelling and a failing request leave the others alone."""

from __future__ import annotations

import pytest
import torch
from conftest import PATTERNS, REGEX_VOCAB, statistical_settings, toys
from hypothesis import given
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.errors import SMCDecodeError
from smcdecode.samplers.adaptive import AdaptiveBlocks
from smcdecode.samplers.loop import Loop, Request
from smcdecode.testing import check_distribution, check_evidence_unbiased, chi_square_pvalue, exact_target

GROUPS = 2000
MAX_NEW = 4


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same(a, b) -> bool:
    return (torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
            and torch.equal(a.log_weights, b.log_weights) and torch.equal(a.log_evidence, b.log_evidence))


@statistical_settings(3)
@given(toy=toys(vocab=REGEX_VOCAB, drafts=("noisy",), noise=(0.2, 0.4)), pattern=st.sampled_from(PATTERNS),
       seed=st.integers(0, 2**31 - 1))
def test_requests_joining_and_leaving_each_target_their_own_pi(toy, pattern, seed):
    """A: LM·Regex, draft K = 1, N = 4, systematic, τ = 0.5, from step 0; B: LM^0.5, draft K = 2 at its
    own temperature, N = 8, stratified, τ = 1, joins at step 1 (after A's first round). A leaves at
    step 1 (two rounds of K + 1 = 2 tokens), B at step 2 (rounds of 3 tokens, then 1). Each request
    is G = 2000 replicate groups: E[Ẑ] = Z and E[(Ẑ/Z)·π̂] = π per request, with its own exact π."""
    target_a = toy.lm() * sd.Regex(pattern)
    target_b = sd.LM(toy.model, temperature=toy.temperature) ** 0.5
    draft_b = sd.Draft(toy.draft, toy.draft_factor * toy.temperature / 0.5)
    a = Request(toy.prompt, target_a, toy.proposal(), particles=4, block_size=1, max_new_tokens=MAX_NEW,
                groups=GROUPS, generator=_generator(seed), id="a")
    b = Request(toy.prompt, target_b, draft_b, particles=8, block_size=2, max_new_tokens=MAX_NEW, groups=GROUPS,
                resampler="stratified", ess_threshold=1.0, generator=_generator(seed + 1), id="b")
    loop = Loop()
    loop.submit(a)
    assert loop.step() == []
    loop.submit(b)
    done = {f.request.id: f for f in loop.run()}
    assert (done["a"].joined, done["a"].left, done["a"].rounds) == (0, 1, 2)
    assert (done["b"].joined, done["b"].left, done["b"].rounds) == (1, 2, 2)
    assert done["a"].error is None and done["b"].error is None
    for f, target in ((done["a"], target_a), (done["b"], target_b)):
        exact = exact_target(target, toy.prompt, MAX_NEW)
        out = f.output
        assert out.tokens.shape[:2] == (GROUPS, f.request.particles)
        assert bool(out.finished.all())
        check_evidence_unbiased(out, exact.log_Z)
        check_distribution(out, exact, z_max=5.5)
    # B alone, same seed: the same draws (a request's rounds do not depend on its company)
    alone = Loop()
    alone.submit(Request(toy.prompt, target_b, draft_b, particles=8, block_size=2, max_new_tokens=MAX_NEW,
                         groups=GROUPS, resampler="stratified", ess_threshold=1.0, generator=_generator(seed + 1)))
    (solo,) = alone.run()
    assert _same(solo.output, done["b"].output)


@statistical_settings(2)
@given(toy=toys(), seed=st.integers(0, 2**31 - 1))
def test_exact_speculative_and_smc_requests_share_the_loop(toy, seed):
    """An exact speculative decoding request (3,000 sequences, K = 2) joins while an SMC request with
    the target as proposal runs: its sequences are distributed as p_T (chi-square), the SMC request's
    Ẑ stays unbiased."""
    smc = Request(toy.prompt, toy.lm(), None, particles=4, max_new_tokens=toy.max_new_tokens, groups=GROUPS,
                  generator=_generator(seed), id="smc")
    exact = Request(toy.prompt, toy.lm(), toy.proposal(), particles=10, block_size=2,
                    max_new_tokens=toy.max_new_tokens, groups=300, generator=_generator(seed + 1), id="sd", exact=True)
    loop = Loop()
    loop.submit(smc)
    loop.step()
    loop.submit(exact)
    done = {f.request.id: f for f in loop.run()}
    assert done["sd"].joined == 1 and done["smc"].error is None and done["sd"].error is None
    target = exact_target(toy.lm(), toy.prompt, toy.max_new_tokens)
    check_evidence_unbiased(done["smc"].output, target.log_Z)
    out = done["sd"].output
    assert out.tokens.shape[:2] == (300, 10) and 0 <= out.accepted_tokens <= out.draft_tokens
    assert chi_square_pvalue(out, target) > 1e-4


def _mixed_requests(toy, n: int) -> list[Request]:
    """n single-group requests with mixed settings (N, K, α, a constraint, the target as proposal)."""
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            r = Request(toy.prompt, toy.lm(), toy.proposal(), particles=4, block_size=2, max_new_tokens=MAX_NEW)
        elif kind == 1:
            r = Request(toy.prompt, toy.lm() * sd.Regex(PATTERNS[0]), None, particles=3, max_new_tokens=MAX_NEW,
                        ess_threshold=1.0)
        else:
            r = Request(toy.prompt, toy.lm(), toy.proposal(), particles=2, block_size=1, max_new_tokens=3)
        r.generator, r.id = _generator(100 + i), i
        out.append(r)
    return out


@statistical_settings(1)
@given(toy=toys(vocab=REGEX_VOCAB))
def test_queued_requests_draw_as_if_alone(toy):
    """max_live = 2 of 7 mixed requests submitted over several steps, one cancelled while queued and
    one while live: every other request finishes, with the draws it makes alone, and never more than
    two are live."""
    loop = Loop(max_live=2)
    requests = _mixed_requests(toy, 7)
    done = []
    for r in requests[:4]:
        loop.submit(r)
    assert loop.cancel(3) and not loop.cancel(3)  # queued
    done += loop.step()
    assert len(loop.live) <= 2
    live = next(iter(loop.live))
    assert loop.cancel(live)  # live: its runners go
    for r in requests[4:]:
        loop.submit(r)
    while loop.busy:
        done += loop.step()
        assert len(loop.live) <= 2
    got = {f.request.id: f for f in done}
    assert sorted(got) == sorted(set(range(7)) - {3, live})
    assert all(f.error is None and f.joined <= f.left for f in done)
    for i, f in got.items():
        solo = Loop()
        solo.submit(_mixed_requests(toy, 7)[i])
        (alone,) = solo.run()
        assert _same(alone.output, f.output), i


def test_a_failing_request_leaves_with_its_error_and_the_others_go_on(toy_lm_model):
    def broken(text: str) -> float:
        raise ValueError("broken reward")

    loop = Loop()
    good = loop.submit(Request([0], sd.LM(toy_lm_model), None, particles=4, max_new_tokens=3,
                               generator=_generator(0)))
    bad = loop.submit(Request([0], sd.LM(toy_lm_model) * sd.Reward(broken, mode="prefix"), None, particles=4,
                              max_new_tokens=3, generator=_generator(1)))
    done = {f.request.id: f for f in loop.run()}
    assert isinstance(done[bad].error, ValueError) and done[bad].output is None
    assert done[good].error is None and bool(done[good].output.finished.all())


def test_smc_run_is_the_loop_with_one_request(toy_lm_model):
    smc = sd.SMC(sd.LM(toy_lm_model) * sd.Regex("a+b?"), sd.Draft(toy_lm_model, 1.3), particles=4, block_size=2)
    out = smc.run_groups([0], 50, max_new_tokens=5, seed=3)
    loop = Loop()
    loop.submit(Request([0], smc.target, smc.proposal, particles=4, block_size=2, max_new_tokens=5, groups=50,
                        generator=_generator(3)))
    (f,) = loop.run()
    assert _same(out, f.output)


@pytest.mark.parametrize("field, value, words", [
    ("prompt", [], "Request.prompt"),
    ("particles", 0, "Request.particles"),
    ("groups", 1.5, "Request.groups"),
    ("max_new_tokens", -1, "Request.max_new_tokens"),
    ("resampler", "best", "Request.resampler"),
    ("ess_threshold", 2.0, "Request.ess_threshold"),
])
def test_bad_requests_are_refused_naming_the_field(toy_lm_model, field, value, words):
    r = Request([0], sd.LM(toy_lm_model), None, particles=2, max_new_tokens=3)
    setattr(r, field, value)
    with pytest.raises(SMCDecodeError, match=words):
        Loop().submit(r)


def test_ids_are_unique_and_adaptive_requests_have_one_group(toy_lm_model):
    loop = Loop()
    loop.submit(Request([0], sd.LM(toy_lm_model), None, particles=2, max_new_tokens=3, id="x"))
    with pytest.raises(SMCDecodeError, match="'x' is already in the loop"):
        loop.submit(Request([0], sd.LM(toy_lm_model), None, particles=2, max_new_tokens=3, id="x"))
    with pytest.raises(SMCDecodeError, match="submit 3 requests of groups=1"):
        loop.submit(Request([0], sd.LM(toy_lm_model), sd.Draft(toy_lm_model), groups=3, max_new_tokens=3,
                            schedule=AdaptiveBlocks()))
    with pytest.raises(SMCDecodeError, match="needs a draft and block_size >= 1"):
        loop.submit(Request([0], sd.LM(toy_lm_model), None, max_new_tokens=3, exact=True))
    with pytest.raises(SMCDecodeError, match="samples the LM alone"):
        loop.submit(Request([0], sd.LM(toy_lm_model) ** 2.0, sd.Draft(toy_lm_model), max_new_tokens=3, exact=True))
    with pytest.raises(SMCDecodeError, match="max_live"):
        Loop(max_live=0)
