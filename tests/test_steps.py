"""samplers.steps: the round's maths as batched steps, and the fused Triton sampler as the same function
(in Triton's interpreter here; compiled on the GPU in test_engine_kernels.py)."""

import math

import pytest
import torch

from smcdecode.samplers import steps
from smcdecode.samplers.resampling import RESAMPLERS, ancestors

SCHEMES = sorted(RESAMPLERS)


def _bits(shape, seed):
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_uniform_from_bits_stays_strictly_inside_the_unit_interval():
    u = steps.uniform_from_bits(torch.tensor([0, -1, 2**31 - 1, -(2**31)], dtype=torch.int32))
    assert u.dtype == torch.float32
    assert float(u[0]) == 2.0**-24 and float(u[1]) == 1.0 - 2.0**-24
    assert ((u > 0) & (u < 1)).all() and torch.isfinite(-torch.log(-torch.log(u))).all()


@pytest.mark.parametrize("noise", ["generator", "bits"])
def test_race_samples_the_softmax_and_never_picks_minus_inf(noise):
    """One draw per row ∝ exp(log w): chi-square over a 6-token row repeated 30,000 times, with a
    -inf entry that is never drawn; the bits give the same draws every time."""
    R = 30000
    lw = torch.tensor([0.3, -1.0, 1.2, float("-inf"), 0.0, 0.7]).repeat(R, 1)
    g = torch.Generator().manual_seed(8)
    bits = _bits(lw.shape, 8)
    tok = steps.race(lw, generator=g) if noise == "generator" else steps.race(lw, bits=bits)
    counts = torch.bincount(tok, minlength=6).double()
    assert counts[3] == 0
    p = torch.softmax(lw[0].double(), 0)
    ok = p > 0
    chi2 = float(((counts[ok] - R * p[ok]) ** 2 / (R * p[ok])).sum())
    assert chi2 < 25.7, chi2  # 5 cells, 4 degrees of freedom: P(chi2 > 25.7) < 1e-4
    if noise == "bits":
        assert torch.equal(steps.race(lw, bits=bits), tok)


def test_sample_and_score_is_the_bonus_distribution_with_its_normaliser():
    """Per-row T, α and mask: log π(token), log Σ p^α·1[valid] and log p(gather) equal their float64
    definitions; the draws follow π ∝ p^α·1[valid] (chi-square); a dead row draws from the unmasked π
    and gets -inf; a row of -inf logits (masked tokens) never draws them."""
    g = torch.Generator().manual_seed(1)
    V = 7
    base = torch.randn(V, generator=g) * 2
    base[5] = float("-inf")
    R = 24000
    logits = base.repeat(R, 1)
    T = torch.tensor([0.7, 1.3]).repeat(R // 2)
    alpha = torch.tensor([2.0, 0.5]).repeat(R // 2)
    mask = torch.tensor([True, False, True, True, False, True, True]).repeat(R, 1)
    mask[7] = False  # a dead row
    gather = torch.randint(0, V, (R,), generator=g)
    tok, log_prob, log_norm, gathered = steps.sample_and_score(logits, T, alpha=alpha, mask=mask, gather=gather,
                                                                generator=g)
    x = logits.double() / T.double()[:, None]
    log_p = torch.log_softmax(x, -1)
    valid = mask | (~mask.any(-1))[:, None]
    y = (alpha.double()[:, None] * log_p).masked_fill(~valid, -math.inf)
    norm = torch.logsumexp(y, -1)
    log_pi = y - norm[:, None]
    live = mask.any(-1)
    torch.testing.assert_close(log_norm[live].double(), norm[live], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_prob[live].double(), log_pi[live].gather(1, tok[live, None])[:, 0],
                               rtol=1e-5, atol=1e-5)
    assert torch.isneginf(log_norm[7]) and torch.isneginf(log_prob[7]) and int(tok[7]) != 5
    torch.testing.assert_close(gathered.double(), log_p.gather(1, gather[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    assert bool(valid[live].gather(1, tok[live, None]).all()) and not bool((tok == 5).any())
    for parity in (0, 1):
        rows = (torch.arange(R) % 2 == parity) & live
        counts = torch.bincount(tok[rows], minlength=V).double()
        p = log_pi[rows][0].exp()
        ok = p > 0
        n = int(rows.sum())
        chi2 = float(((counts[ok] - n * p[ok]) ** 2 / (n * p[ok])).sum())
        assert chi2 < 27.9, (parity, chi2)  # 5 cells, 4 degrees of freedom: P(chi2 > 27.9) < 2e-5


def test_propose_masks_the_draft_and_scores_log_q():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 9, generator=g)
    mask = torch.rand(5, 9, generator=g) < 0.5
    mask[:, 0] = True
    d, log_q = steps.propose(logits, 0.8, mask, generator=g)
    assert bool(mask.gather(1, d[:, None]).all())
    q = torch.log_softmax((logits / 0.8).masked_fill(~mask, -math.inf), -1)
    torch.testing.assert_close(log_q, q.gather(1, d[:, None])[:, 0])


def test_weigh_counts_drafts_to_the_first_eos_and_the_budget():
    """Rows: no EOS with the bonus; EOS at draft 2 (later drafts and the bonus ignored); a budget of
    one draft; a dead end (log q' = -inf) at draft 1."""
    eos = 9
    drafts = torch.tensor([[1, 2, 3], [1, eos, 4], [5, 6, 7], [1, 2, 3]])
    log_p = torch.tensor([[-1.0, -2.0, -3.0]] * 4)
    log_q = torch.tensor([[-0.5, -0.5, -0.5]] * 3 + [[-0.5, -math.inf, -0.5]])
    alpha = torch.tensor([2.0, 1.0, 1.0, 1.0])
    k = torch.tensor([3, 3, 1, 3])
    log_norm = torch.tensor([0.25, 0.5, 0.75, 1.0])
    w = steps.weigh(log_p, log_q, drafts, alpha, k, eos, log_norm, torch.tensor([True, True, False, True]))
    expected = torch.tensor([2 * -6.0 + 1.5 + 0.25, -3.0 + 1.0, -1.0 + 0.5, -math.inf], dtype=torch.float64)
    torch.testing.assert_close(w.incr, expected)
    assert w.n_new.tolist() == [4, 2, 1, 4] and w.any_eos.tolist() == [False, True, False, False]
    assert w.has_bonus.tolist() == [True, False, False, True]
    cut = steps.reject_cut(w.incr, torch.tensor([True, True, True, False]), torch.tensor([False, True, False, False]),
                           torch.tensor([False, False, True, False]))
    assert torch.isneginf(cut[0]) and cut[1:3].tolist() == expected[1:3].tolist()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_resample_applies_tau_and_counts_the_evidence(scheme):
    """τ = 0: never; τ = 1: every live group with mass; τ = 0.5: exactly where ESS < n_g/2. log Ẑ's
    increment is logsumexp − log n_g where resampled; a resampled group's real rows restart at 0 and
    its padding rows stay -inf; a group that is not live keeps its ancestors."""
    lw = torch.tensor([[0.0, 0.0, 0.0, -math.inf], [0.0, -8.0, -9.0, -math.inf], [-math.inf] * 4,
                       [3.0, -1.0, 0.5, 0.2]], dtype=torch.float64)
    n = torch.tensor([3, 3, 2, 4])
    live = torch.tensor([True, True, True, False])
    ident = torch.arange(4).expand(4, 4)
    never = steps.resample(lw, 0.0, scheme, n=n, live=live)
    assert not never.resampled.any() and torch.equal(never.ancestors, ident) and torch.equal(never.log_w, lw)
    always = steps.resample(lw, 1.0, scheme, n=n, live=live)
    assert always.resampled.tolist() == [True, True, False, False]
    half = steps.resample(lw, 0.5, scheme, n=n, live=live)
    assert half.resampled.tolist() == [False, True, False, False]
    assert (half.ancestors[1, :3] == 0).all() and half.ancestors[1, 3] == 3  # the mass sits on particle 0
    torch.testing.assert_close(half.log_Z_incr[1], torch.logsumexp(lw[1], 0) - math.log(3))
    assert half.log_Z_incr[[0, 2, 3]].tolist() == [0.0, 0.0, 0.0]
    assert half.log_w[1, :3].tolist() == [0.0] * 3 and torch.isneginf(half.log_w[1, 3])
    torch.testing.assert_close(half.ess[0], torch.tensor(3.0, dtype=torch.float64))
    torch.testing.assert_close(steps.log_mean_weight(lw[:2], n[:2]), torch.logsumexp(lw[:2], 1) - torch.log(n[:2].double()))


def test_resample_on_the_host_draws_only_when_a_group_resamples():
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    out = steps.resample(torch.zeros(2, 4, dtype=torch.float64), 0.5, "multinomial", generator=g, sync=True)
    assert not out.resampled.any() and torch.equal(g.get_state(), state)
    steps.resample(torch.zeros(2, 4, dtype=torch.float64), 1.0, "multinomial", generator=g, sync=True)
    assert not torch.equal(g.get_state(), state)


def test_ancestors_over_whole_groups_equal_the_registered_schemes():
    W = torch.softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64), -1)
    for scheme in SCHEMES:
        a = ancestors(W, scheme, torch.Generator().manual_seed(5))
        b = ancestors(W, scheme, torch.Generator().manual_seed(5), n=torch.tensor([6, 6, 6]))
        c = RESAMPLERS[scheme](W, torch.Generator().manual_seed(5))
        assert torch.equal(a, c)
        if scheme != "multinomial":  # (multinomial sorts its uniforms over the used columns only)
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# The fused Triton sampler is the same function: the interpreter on the CPU, the same noise bits.

def _interpreted_sampler():
    import os

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the compiled kernel is tested in test_engine_kernels.py")
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported and the kernels decorated
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels.sampling import triton_sample_and_score

    return triton_sample_and_score


def _case(R, V, seed):
    """Logits with -inf entries (every other token of row 0, all but three tokens of row 1), per-row T
    and α, a mask with a dead row (row 2), gathered tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g) * 3
    logits[0, ::2] = float("-inf")
    logits[1, 3:] = float("-inf")
    T = torch.rand(R, generator=g) + 0.5
    alpha = torch.rand(R, generator=g) * 2 + 0.3
    mask = torch.rand(R, V, generator=g) < 0.3
    mask[1, :2] = True
    mask[2] = False
    gather = torch.randint(0, V, (R,), generator=g)
    return logits, T, alpha, mask, gather, _bits((R, V), seed)


SAMPLER_CASES = {
    "plain": dict(),
    "per-row T": dict(per_row=True),
    "alpha": dict(alpha=True),
    "mask": dict(mask=True),
    "alpha, mask, per-row T": dict(alpha=True, mask=True, per_row=True),
    "every 3rd row draws": dict(sample_every=3),
    "no draws": dict(draw=False, per_row=True),
    "mask, every 2nd row": dict(mask=True, sample_every=2),
}


@pytest.mark.parametrize("V", [10, 3000, 9000], ids=["one-block", "one-split", "two-splits"])
@pytest.mark.parametrize("case", list(SAMPLER_CASES))
def test_interpreted_sampler_equals_the_torch_function_draw_for_draw(case, V):
    kernel = _interpreted_sampler()
    opts = SAMPLER_CASES[case]
    logits, T, alpha, mask, gather, bits = _case(6, V, seed=V)
    kw = dict(alpha=alpha if opts.get("alpha") else None, mask=mask if opts.get("mask") else None,
              sample_every=opts.get("sample_every", 1), draw=opts.get("draw", True))
    temperature = T if opts.get("per_row") else 0.8
    fused = kernel(logits, temperature, torch.tensor(5), gather, bits=bits, **kw)
    ref = steps.sample_and_score(logits, temperature, gather=gather, bits=bits, **kw)
    assert torch.equal(fused.token, ref.token), (fused.token, ref.token)
    for a, b in zip(fused[1:], ref[1:]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    if kw["draw"]:
        drawn = fused.token[kw["sample_every"] - 1 :: kw["sample_every"]]
        assert (drawn >= 0).all() and (drawn < V).all()
        scored = torch.isfinite(fused.log_prob)  # (drawing rows with a valid token of positive mass)
        assert int(scored.sum()) >= 2
        assert (logits[scored].gather(1, fused.token[scored, None]) > -math.inf).all()


def test_interpreted_sampler_refuses_bits_of_the_wrong_shape():
    kernel = _interpreted_sampler()
    logits = torch.zeros(2, 50)
    with pytest.raises(ValueError, match="one random word per element"):
        kernel(logits, 1.0, torch.tensor(0), bits=torch.zeros(2, 49, dtype=torch.int32))
    with pytest.raises(ValueError, match="one random word per element"):
        steps.sample_and_score(logits, 1.0, bits=torch.zeros(2, 49, dtype=torch.int32))
