"""Resamplers (smcdecode/samplers/resampling.py): unbiased offspring counts, variance no larger
than multinomial's, zero-weight particles never chosen, float32 cumulative sums that end below 1,
and groups whose weights are all -inf."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import statistical_settings
from hypothesis import given
from hypothesis import strategies as st

from smcdecode.samplers.resampling import RESAMPLERS, inverse_cdf, normalise

SCHEMES = sorted(RESAMPLERS)
LOW_VARIANCE = ["residual", "stratified", "systematic"]
REPLICATES = 20_000


@st.composite
def weight_vectors(draw):
    """Normalised weights W [N] with some exact zeros, as float64 or float32 (whose sums are
    generally not exactly 1)."""
    N = draw(st.integers(2, 9))
    raw = draw(st.lists(st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.3, 1.0, 2.0, 7.0]), min_size=N, max_size=N))
    if sum(raw) == 0:
        raw[draw(st.integers(0, N - 1))] = 1.0
    W = torch.tensor(raw, dtype=torch.float64)
    W = W / W.sum()
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    return W.to(dtype)


def offspring(A: torch.Tensor, N: int) -> torch.Tensor:
    """Offspring counts [G, N] from ancestors [G, N]."""
    return torch.zeros(A.shape[0], N, dtype=torch.float64).scatter_add_(1, A, torch.ones_like(A, dtype=torch.float64))


def run(scheme: str, W: torch.Tensor, seed: int, G: int = REPLICATES) -> torch.Tensor:
    A = RESAMPLERS[scheme](W.expand(G, -1).contiguous(), torch.Generator().manual_seed(seed))
    N = W.shape[0]
    assert A.shape == (G, N) and A.dtype == torch.long
    assert int(A.min()) >= 0 and int(A.max()) < N, "ancestor index outside [0, N)"
    return A


@pytest.mark.parametrize("scheme", SCHEMES)
@statistical_settings(12)
@given(W=weight_vectors(), seed=st.integers(0, 2**31 - 1))
def test_expected_offspring_is_N_times_weight(scheme, W, seed):
    N = W.shape[0]
    counts = offspring(run(scheme, W, seed), N)
    target = N * W.double() / W.double().sum()
    mean, var = counts.mean(0), counts.var(0)
    # no integer-valued count with mean m has variance below frac(m)(1 - frac(m)): a floor for the
    # standard error when a scheme is (nearly) deterministic for a particle
    frac = target - torch.floor(target)
    se = torch.sqrt(torch.maximum(var, frac * (1 - frac)) / REPLICATES)
    for i in range(N):
        if float(se[i]) == 0:
            assert float(mean[i]) == pytest.approx(float(target[i]), abs=1e-6), (scheme, i)
        else:
            z = (float(mean[i]) - float(target[i])) / float(se[i])
            assert abs(z) < 5, (
                f"{scheme}: particle {i} has mean offspring {float(mean[i]):.4f}, N·W = {float(target[i]):.4f}, z = {z:.1f}"
            )


@pytest.mark.parametrize("scheme", LOW_VARIANCE)
@statistical_settings(12)
@given(W=weight_vectors(), seed=st.integers(0, 2**31 - 1))
def test_offspring_variance_at_most_multinomial(scheme, W, seed):
    N = W.shape[0]
    Wd = W.double() / W.double().sum()
    var = offspring(run(scheme, W, seed), N).var(0)
    var_multinomial = offspring(run("multinomial", W, seed + 1), N).var(0)
    theory = N * Wd * (1 - Wd)
    # the multinomial reference itself is right (relative s.e. of a variance estimate ≈ 1-2%)
    assert torch.allclose(var_multinomial, theory, rtol=0.1, atol=2e-3), (var_multinomial, theory)
    excess = var - 1.1 * var_multinomial - 2e-3
    assert bool((excess <= 0).all()), (
        f"{scheme}: offspring variances {var.tolist()} exceed multinomial's {var_multinomial.tolist()}"
    )


@statistical_settings(12)
@given(W=weight_vectors(), seed=st.integers(0, 2**31 - 1))
def test_systematic_and_residual_counts_bracket_N_times_weight(W, seed):
    """Systematic: floor(N·W_i) or ceil(N·W_i) offspring; residual: at least floor(N·W_i)."""
    N = W.shape[0]
    target = N * W.double() / W.double().sum()
    sys_counts = offspring(run("systematic", W, seed, G=2000), N)
    assert bool((sys_counts >= torch.floor(target - 1e-9)).all() and (sys_counts <= torch.ceil(target + 1e-9)).all())
    res_counts = offspring(run("residual", W, seed, G=2000), N)
    assert bool((res_counts >= torch.floor(target - 1e-9)).all())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_weight_particles_are_never_chosen(scheme, dtype):
    W = torch.tensor(
        [
            [0.0, 0.5, 0.0, 0.5, 0.0],  # zeros first, in the middle and last
            [0.0, 0.0, 0.0, 0.0, 1.0],  # one survivor, last
            [1.0, 0.0, 0.0, 0.0, 0.0],  # one survivor, first
            [1e-12, 0.0, 0.3, 0.0, 0.7 - 1e-12],  # a tiny positive weight next to zeros
        ],
        dtype=dtype,
    ).repeat(2000, 1)
    A = RESAMPLERS[scheme](W, torch.Generator().manual_seed(3))
    assert int(A.min()) >= 0 and int(A.max()) < W.shape[1]
    assert bool((W.gather(1, A) > 0).all()), f"{scheme} chose a zero-weight particle"


def test_inverse_cdf_float32_cumsum_below_one():
    """The last uniform below 1 against a float32 cumulative sum that ends at 0.9999: no index N,
    and the trailing zero-weight particle is not chosen."""
    W = torch.tensor([[0.1] * 9 + [0.0999, 0.0]], dtype=torch.float32)
    assert float(W.cumsum(-1)[0, -1]) < 1.0
    u = torch.tensor([[0.0, 0.55, 0.99999, 1 - 2**-53]], dtype=torch.float64)
    A = inverse_cdf(W.double(), u)
    assert A.tolist() == [[0, 5, 9, 9]]
    # and the same through every scheme, many times over
    for scheme in SCHEMES:
        A = RESAMPLERS[scheme](W.repeat(5000, 1), torch.Generator().manual_seed(1))
        assert int(A.max()) <= 9, f"{scheme} chose the zero-weight particle or index N"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_unnormalised_float32_weights_are_normalised(scheme):
    """Rows that sum to 0.9 or 1.1 (float32 drift, exaggerated) are resampled ∝ W."""
    W = torch.tensor([[0.2, 0.3, 0.4, 0.0], [0.2, 0.3, 0.4, 0.2]], dtype=torch.float32)
    G = 20_000
    A = RESAMPLERS[scheme](W.repeat_interleave(G, 0), torch.Generator().manual_seed(5))
    for row in range(2):
        counts = offspring(A[row * G : (row + 1) * G], 4)
        expected = 4 * W[row].double() / W[row].double().sum()
        assert torch.allclose(counts.mean(0), expected, atol=0.03), (scheme, row, counts.mean(0), expected)


def test_all_minus_inf_weights():
    """A group whose particles all have weight 0 gets W = 0 and ESS = 0 (no NaN); every scheme
    still returns valid indices for it and leaves the other groups' draws unchanged."""
    inf = float("inf")
    log_w = torch.tensor([[-inf] * 4, [0.0, 1.0, -inf, 2.0]], dtype=torch.float64)
    W, ess = normalise(log_w)
    assert not bool(torch.isnan(W).any()) and not bool(torch.isnan(ess).any())
    assert W[0].tolist() == [0.0] * 4 and float(ess[0]) == 0.0
    assert float(W[1].sum()) == pytest.approx(1.0) and 1.0 <= float(ess[1]) <= 3.0
    other = torch.tensor([[0.25] * 4, W[1].tolist()], dtype=torch.float64)
    for scheme in SCHEMES:
        A = RESAMPLERS[scheme](W, torch.Generator().manual_seed(0))
        assert int(A.min()) >= 0 and int(A.max()) < 4, scheme
        B = RESAMPLERS[scheme](other, torch.Generator().manual_seed(0))
        assert A[1].tolist() == B[1].tolist(), f"{scheme}: a dead group changed another group's draws"
        assert 2 not in A[1].tolist()


def test_ess_bounds():
    """ESS = 1/ΣW² lies in [1, N]; N for equal weights, 1 for a single survivor."""
    log_w = torch.tensor([[0.0] * 5, [0.0] + [-math.inf] * 4, [0.0, -1.0, -2.0, -3.0, -4.0]], dtype=torch.float64)
    _, ess = normalise(log_w)
    assert ess[0].item() == pytest.approx(5.0)
    assert ess[1].item() == pytest.approx(1.0)
    assert 1.0 < ess[2].item() < 5.0
