"""Exact enumeration and property checks for potentials and samplers, on problems small enough
to enumerate (a vocabulary of a few tokens, a handful of new tokens).

Users can run these on their own potentials and strategies; the library's statistical test suite
is built on them.

The target (what SMC approximates and what :func:`exact_target` enumerates)
----------------------------------------------------------------------------
A *complete* sequence x of generated tokens either ends with EOS (EOS included, at most
``max_new_tokens`` tokens in all) or is *cut*: exactly ``max_new_tokens`` tokens and no EOS. For a
target ``LM(model, temperature=T) ** α * constraints * rewards``

    π(x) ∝ γ(x) = p_T(x)^α · Ψ(x) · exp(β·R(text(x)))

where p_T(x) is the product of x's token probabilities (for an EOS-ended x the EOS probability is
one of them; a cut x has no EOS term), Ψ(x) = 1 iff every constraint accepts x (a cut x must be
accepted as it stands), and text(x) is the decoded text without EOS.

In the potential contract this is: ``complete(x)`` for an EOS-ended x; for a cut x, the language
model's ``prefix(x)`` plus every other factor's ``complete(x)``. The normaliser that SMC estimates
(its Ẑ) is taken *relative to the empty prefix*, because the incremental weights telescope from
there:

    Z = Σ_x γ(x) / Φ_prefix(ε)

Φ_prefix(ε) = 1 for LMs, constraints and completion-mode rewards; for a prefix-mode reward it is
exp(β·R("")), so Z = Σ_x p^α Ψ exp(β·(R(x) − R(""))). With α = 1 and no constraint or reward, Z = 1.

Statistics on sampler outputs
-----------------------------
An :class:`~smcdecode.samplers.smc_sd.SMCOutput` from ``strategy.run_groups(prompt, groups=G, ...)``
holds G independent replicate runs. Two facts make exact tests possible:

* E[Ẑ] = Z (the evidence estimate is unbiased), see :func:`check_evidence_unbiased`;
* E[Ẑ · π̂_N(x)] = γ(x) for every x, where π̂_N is one run's weighted particle distribution, so
  the evidence-weighted pool of replicates converges to π as G grows for any fixed N (the plain
  average of π̂_N has an O(1/N) bias), see :func:`check_distribution`.

Outputs of exact samplers (autoregressive, exact speculative decoding) are compared with a
chi-square test, see :func:`chi_square_pvalue`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import Tensor

from .errors import check_nonneg_int
from .potentials.base import Potential, as_target
from .potentials.constraint import TokenConstraint
from .potentials.lm import LM

Seq = tuple[int, ...]

__all__ = [
    "ExactTarget",
    "chi_square_pvalue",
    "check_batch_consistency",
    "check_distribution",
    "check_evidence_unbiased",
    "check_logw_next_consistency",
    "check_tensor_path",
    "distribution_z_scores",
    "empirical_distribution",
    "enumerate_prefixes",
    "evidence_z_score",
    "exact_autoregressive",
    "exact_target",
    "particle_distributions",
    "pooled_distribution",
    "sequences",
    "total_variation",
]

NEG_INF = float("-inf")


class ExactTarget(NamedTuple):
    """An enumerated distribution: ``probs`` maps each complete sequence (a tuple of generated
    token ids, EOS included when present) of positive probability to its probability (float64,
    summing to 1); ``log_Z`` is the log normaliser (``-inf`` when no sequence has positive weight)."""

    probs: dict[Seq, float]
    log_Z: float


# ----------------------------------------------------------------------------------------------
# Exact enumeration


def exact_log_weights(target: Potential, prompt, max_new_tokens: int) -> dict[Seq, float]:
    """log γ(x) − log Φ_prefix(ε) for every complete sequence x of positive weight (see the module
    docstring), by breadth-first enumeration with the potentials' own ``batch_logw_next``
    (one call per length) and, for cut sequences, ``prefix``/``complete``. Float64."""
    check_nonneg_int("max_new_tokens", max_new_tokens)
    prod = as_target(target)
    model = prod.lm.model
    ids = model.prompt_ids(prompt)
    eos, V = model.eos_token_id, model.vocab_size
    # cut sequences: the LM contributes no EOS term, every other factor must complete
    finals = [f for f in prod.factors if not isinstance(f, LM)]
    out: dict[Seq, float] = {}
    level: dict[Seq, float] = {(): 0.0}
    for _ in range(max_new_tokens):
        if not level:
            break
        seqs = list(level)
        lw = prod.batch_logw_next([list(s) for s in seqs], ids)
        if tuple(lw.shape) != (len(seqs), V):
            raise AssertionError(f"batch_logw_next returned shape {tuple(lw.shape)}, expected {(len(seqs), V)}")
        nxt: dict[Seq, float] = {}
        for x, row in zip(seqs, lw.double().tolist()):
            base = level[x]
            for v, w in enumerate(row):
                if math.isnan(w):
                    raise AssertionError(f"NaN next-token log-weight for token {v} after prefix {list(x)}")
                if w == NEG_INF:
                    continue
                if v == eos:
                    out[x + (v,)] = base + w
                else:
                    nxt[x + (v,)] = base + w
        level = nxt
    for x, w in level.items():
        for f in finals:
            w += f.complete(list(x), ids) - f.prefix(list(x), ids)
            if w == NEG_INF:
                break
        if math.isnan(w):
            raise AssertionError(f"NaN log-weight for the cut sequence {list(x)}")
        if w != NEG_INF:
            out[x] = w
    return out


def _normalised(log_weights: dict[Seq, float]) -> ExactTarget:
    if not log_weights:
        return ExactTarget({}, NEG_INF)
    values = torch.tensor(list(log_weights.values()), dtype=torch.float64)
    log_Z = float(torch.logsumexp(values, 0))
    probs = torch.exp(values - log_Z).tolist()
    return ExactTarget(dict(zip(log_weights, probs)), log_Z)


def exact_target(target: Potential, prompt, max_new_tokens: int) -> ExactTarget:
    """The exact target π over complete sequences of at most ``max_new_tokens`` generated tokens,
    and log Z (relative to the empty prefix: the quantity SMC's log Ẑ estimates).

    ``prompt`` is anything the model accepts (token ids, text). Cost: one ``batch_logw_next`` call
    per length over every viable prefix, so keep vocabularies and lengths small
    (V^max_new_tokens sequences)."""
    return _normalised(exact_log_weights(target, prompt, max_new_tokens))


def exact_autoregressive(target: Potential, prompt, max_new_tokens: int) -> ExactTarget:
    """The distribution of plain autoregressive sampling (:class:`~smcdecode.Autoregressive`):
    each token drawn from the *locally* normalised p_T(v | h)^α · 1[h·v valid], conditioned on the
    run succeeding (no dead end, a cut sequence accepted). ``log_Z`` is log P(success).

    With α = 1 and no constraint this equals :func:`exact_target`; with a constraint it generally
    differs from the global conditional p(x | x ∈ A) that SMC targets."""
    check_nonneg_int("max_new_tokens", max_new_tokens)
    prod = as_target(target)
    model = prod.lm.model
    ids = model.prompt_ids(prompt)
    eos = model.eos_token_id
    local = [f for f in prod.factors if isinstance(f, (LM, TokenConstraint))]
    constraints = [f for f in local if isinstance(f, TokenConstraint)]
    out: dict[Seq, float] = {}
    level: dict[Seq, float] = {(): 0.0}
    for _ in range(max_new_tokens):
        if not level:
            break
        seqs = list(level)
        lw = sum(f.batch_logw_next([list(s) for s in seqs], ids) for f in local)
        lw = torch.log_softmax(lw.double(), dim=-1)  # rows of a dead end become NaN: skipped below
        nxt: dict[Seq, float] = {}
        for x, row in zip(seqs, lw.tolist()):
            for v, w in enumerate(row):
                if math.isnan(w) or w == NEG_INF:
                    continue
                (out if v == eos else nxt)[x + (v,)] = level[x] + w
        level = nxt
    for x, w in level.items():
        if all(f.complete(list(x), ids) != NEG_INF for f in constraints):
            out[x] = w
    return _normalised(out)


def enumerate_prefixes(model, max_len: int, include_eos: bool = False) -> list[list[int]]:
    """Every token sequence of length 0..``max_len`` over ``model``'s vocabulary without EOS (with
    ``include_eos``, also each of them followed by EOS) — inputs for the property checks."""
    eos = model.eos_token_id
    alphabet = [v for v in range(model.vocab_size) if v != eos]
    out: list[list[int]] = [[]]
    frontier: list[list[int]] = [[]]
    for _ in range(max_len):
        frontier = [s + [v] for s in frontier for v in alphabet]
        out.extend(frontier)
    if include_eos:
        out += [s + [eos] for s in out if len(s) < max_len]
    return out


# ----------------------------------------------------------------------------------------------
# Property checks for potentials


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def check_logw_next_consistency(
    potential: Potential, prompt: Sequence[int], seqs: Sequence[Sequence[int]], atol: float = 1e-4, rtol: float = 1e-6
) -> None:
    """Assert that ``logw_next(x)[v] == prefix(x·v) − prefix(x)`` for every token v other than EOS
    and ``logw_next(x)[EOS] == complete(x) − prefix(x)``, for every x in ``seqs`` with
    ``prefix(x) > -inf`` (the next-token weights of an impossible prefix are not constrained).

    ``seqs`` are generated-token sequences without EOS (see :func:`enumerate_prefixes`).
    Raises AssertionError naming the first disagreement."""
    model = potential._require_model()
    eos, V = model.eos_token_id, model.vocab_size
    prompt = list(prompt)
    for x in seqs:
        x = list(x)
        base = potential.prefix(x, prompt)
        if base == NEG_INF:
            continue
        lw = potential.logw_next(x, prompt)
        if tuple(lw.shape) != (V,):
            raise AssertionError(f"{potential!r}.logw_next({x}) has shape {tuple(lw.shape)}, expected ({V},)")
        for v in range(V):
            if v == eos:
                expected, how = potential.complete(x, prompt) - base, "complete(x) - prefix(x)"
            else:
                expected, how = potential.prefix(x + [v], prompt) - base, f"prefix(x + [{v}]) - prefix(x)"
            got = float(lw[v])
            if not _close(got, expected, atol, rtol):
                raise AssertionError(
                    f"{potential!r}: logw_next(x)[{v}] = {got!r} but {how} = {expected!r} for x = {x} (prompt {prompt})"
                )


def check_batch_consistency(
    potential: Potential, prompt: Sequence[int], seqs: Sequence[Sequence[int]], atol: float = 1e-5, rtol: float = 1e-6
) -> None:
    """Assert that ``batch_logw_next(seqs)`` equals ``stack([logw_next(x) for x in seqs])`` (same
    shape, the same -inf entries, finite entries within tolerance). Pass sequences of equal and of
    mixed lengths: batched implementations often take a fast path for equal lengths."""
    model = potential._require_model()
    prompt = list(prompt)
    seqs = [list(s) for s in seqs]
    batch = potential.batch_logw_next(seqs, prompt)
    expected_shape = (len(seqs), model.vocab_size)
    if tuple(batch.shape) != expected_shape:
        raise AssertionError(
            f"{potential!r}.batch_logw_next gave shape {tuple(batch.shape)}, expected {expected_shape}"
        )
    for i, x in enumerate(seqs):
        one = potential.logw_next(x, prompt)
        for v in range(model.vocab_size):
            got, want = float(batch[i, v]), float(one[v])
            if not _close(got, want, atol, rtol):
                raise AssertionError(
                    f"{potential!r}: batch_logw_next row {i} (x = {x}) token {v} is {got!r}, "
                    f"but logw_next(x)[{v}] is {want!r}"
                )


def check_tensor_path(constraint: TokenConstraint, seqs: Sequence[Sequence[int]]) -> None:
    """Assert that a constraint's tensor path (``start``/``allowed``/``advance``/``accepting``/
    ``fork``, what the samplers use) agrees with its scalar path (``prefix``/``complete``):
    ``allowed(state(x))[v]`` iff ``prefix(x·v) > -inf`` (v ≠ EOS), ``allowed[EOS]`` iff
    ``complete(x) > -inf``, and ``accepting(state(x))`` iff ``complete(x) > -inf``, for every
    viable x in ``seqs`` (all states advanced together as one batch, then forked in reverse)."""
    model = constraint._require_model()
    eos, V = model.eos_token_id, model.vocab_size
    seqs = [list(s) for s in seqs if constraint.prefix(list(s)) != NEG_INF]
    if not seqs:
        return
    for length in sorted({len(s) for s in seqs}):
        batch = [s for s in seqs if len(s) == length]
        state = constraint.start(len(batch))
        for t in range(length):
            state = constraint.advance(state, torch.tensor([s[t] for s in batch]))
        rev = torch.arange(len(batch) - 1, -1, -1)
        state = constraint.fork(state, rev)
        allowed = constraint.allowed(state).cpu()[rev]
        accepting = constraint.accepting(state).cpu()[rev]
        for i, x in enumerate(batch):
            done = constraint.complete(x) != NEG_INF
            if bool(accepting[i]) != done:
                raise AssertionError(
                    f"{constraint!r}: accepting(state({x})) = {bool(accepting[i])} but complete(x) is "
                    f"{'finite' if done else '-inf'}"
                )
            for v in range(V):
                ok = done if v == eos else constraint.prefix(x + [v]) != NEG_INF
                if bool(allowed[i, v]) != ok:
                    raise AssertionError(
                        f"{constraint!r}: allowed(state({x}))[{v}] = {bool(allowed[i, v])} but the scalar path says "
                        f"token {v} is {'allowed' if ok else 'forbidden'}"
                    )


# ----------------------------------------------------------------------------------------------
# Sampler outputs as distributions


def sequences(out, group: int) -> list[Seq]:
    """The generated sequences (EOS included when present) of one group's particles."""
    rows = out.tokens[group].tolist()
    lengths = out.lengths[group].tolist()
    return [tuple(r[:n]) for r, n in zip(rows, lengths)]


def _normalised_weights(out) -> Tensor:
    lw = out.log_weights.double()
    lse = torch.logsumexp(lw, dim=-1, keepdim=True)
    return torch.where(torch.isfinite(lse), torch.exp(lw - torch.where(torch.isfinite(lse), lse, 0.0)), 0.0)


def particle_distributions(out) -> list[dict[Seq, float]]:
    """One weighted empirical distribution per group: Σ_i W_i δ_{x_i} with W = softmax(log w)
    (zero-weight particles omitted; an all-zero group gives an empty dict)."""
    W = _normalised_weights(out).tolist()
    dists = []
    for g in range(out.tokens.shape[0]):
        d: dict[Seq, float] = {}
        for x, w in zip(sequences(out, g), W[g]):
            if w > 0:
                d[x] = d.get(x, 0.0) + w
        dists.append(d)
    return dists


def pooled_distribution(out, by_evidence: bool = True) -> dict[Seq, float]:
    """The replicates pooled into one distribution.

    ``by_evidence=True``: Σ_g Ẑ_g π̂_g / Σ_g Ẑ_g, which converges to π as the number of groups
    grows, for any number of particles. ``False``: the plain average of the π̂_g, which carries the
    O(1/N) bias of self-normalised importance sampling."""
    G = out.tokens.shape[0]
    if by_evidence:
        log_Z = out.log_evidence.double()
        scale = torch.exp(log_Z - log_Z.max()) if bool(torch.isfinite(log_Z).any()) else torch.zeros(G)
    else:
        scale = torch.ones(G, dtype=torch.float64)
    total = float(scale.sum())
    pooled: dict[Seq, float] = {}
    if total == 0:
        return pooled
    for s, d in zip(scale.tolist(), particle_distributions(out)):
        for x, w in d.items():
            pooled[x] = pooled.get(x, 0.0) + s * w / total
    return pooled


def empirical_distribution(out) -> dict[Seq, float]:
    """Unweighted frequencies of the sequences of every particle with positive weight, over all
    groups: the distribution of an exact sampler's (autoregressive, speculative) outputs."""
    counts = _counts(out)
    total = sum(counts.values())
    return {x: c / total for x, c in counts.items()} if total else {}


def _counts(out) -> dict[Seq, int]:
    alive = torch.isfinite(out.log_weights).tolist()
    counts: dict[Seq, int] = {}
    for g in range(out.tokens.shape[0]):
        for x, ok in zip(sequences(out, g), alive[g]):
            if ok:
                counts[x] = counts.get(x, 0) + 1
    return counts


def total_variation(p: dict, q: dict) -> float:
    """½ Σ_x |p(x) − q(x)| over the union of the supports."""
    return 0.5 * sum(abs(p.get(x, 0.0) - q.get(x, 0.0)) for x in set(p) | set(q))


# ----------------------------------------------------------------------------------------------
# Statistical tests


def evidence_z_score(log_evidence: Tensor, log_Z: float, rtol: float = 1e-6) -> float:
    """z = (mean_g Ẑ_g/Z − 1) / (its standard error), over the replicates' log Ẑ_g [G].

    Under E[Ẑ] = Z it is approximately standard normal for many replicates (the sample mean of a
    skewed positive variable: take a generous threshold such as 5). A difference below ``rtol``
    counts as rounding (float32 model outputs) and gives z = 0; so does a difference of exactly
    equal replicates within ``rtol``, while equal replicates farther from 1 give ±inf."""
    r = torch.exp(log_evidence.double() - log_Z)
    if bool(torch.isnan(r).any()):
        raise AssertionError(f"log evidence has NaN entries: {log_evidence[torch.isnan(r)][:5].tolist()}")
    G = r.numel()
    diff = float(r.mean()) - 1.0
    diff = math.copysign(max(abs(diff) - rtol, 0.0), diff)
    se = float(r.std(unbiased=True)) / math.sqrt(G) if G > 1 else 0.0
    if diff == 0.0:
        return 0.0
    return diff / se if se > 0 else math.copysign(math.inf, diff)


def check_evidence_unbiased(out, log_Z: float, z_max: float = 5.0) -> float:
    """Assert |z| ≤ ``z_max`` for :func:`evidence_z_score` of ``out.log_evidence``; returns z."""
    z = evidence_z_score(out.log_evidence, log_Z)
    if not abs(z) <= z_max:
        r = torch.exp(out.log_evidence.double() - log_Z)
        raise AssertionError(
            f"E[Ẑ] = Z rejected: mean Ẑ/Z = {float(r.mean()):.6f} over {r.numel()} replicates, "
            f"z = {z:.2f} (threshold {z_max}); exact log Z = {log_Z:.6f}, mean log Ẑ = {float(out.log_evidence.mean()):.6f}"
        )
    return z


def _cells(exact: ExactTarget, min_prob: float) -> tuple[dict[Seq, int], list[float], int]:
    """Cell index of each sequence with π ≥ min_prob, then one 'rest' cell for everything else."""
    big = [x for x, p in exact.probs.items() if p >= min_prob]
    index = {x: i for i, x in enumerate(big)}
    expected = [exact.probs[x] for x in big]
    expected.append(max(0.0, 1.0 - sum(expected)))
    return index, expected, len(big)


def distribution_z_scores(
    out, exact: ExactTarget, min_prob: float = 0.01, atol: float = 1e-7
) -> dict[Seq | str, float]:
    """Per-cell z-scores of Y_g(c) = (Ẑ_g/Z)·π̂_g(c), whose expectation is exactly π(c) for any
    number of particles N. Cells: each sequence with π(x) ≥ ``min_prob``, and ``"rest"`` for all
    the others (including sequences outside π's support).

    The standard error uses max(sample variance, π(c)(1−π(c))/N), the variance of the frequency
    of c among N exact draws: the sample variance alone underestimates the spread of rare cells
    and would inflate |z|, so the floor keeps the test conservative. Differences below ``atol``
    count as rounding."""
    index, expected, rest = _cells(exact, min_prob)
    G, N = out.log_weights.shape
    cell = torch.full((G, N), rest, dtype=torch.long)
    for g in range(G):
        for i, x in enumerate(sequences(out, g)):
            cell[g, i] = index.get(x, rest)
    r = torch.exp(out.log_evidence.double() - exact.log_Z)
    W = _normalised_weights(out) * r[:, None]
    Y = torch.zeros(G, len(expected), dtype=torch.float64).scatter_add_(1, cell, W)
    pi = torch.tensor(expected, dtype=torch.float64)
    var = torch.maximum(Y.var(0, unbiased=True), pi * (1 - pi) / N)
    se = torch.sqrt(var / G)
    diff = Y.mean(0) - pi
    diff = torch.sign(diff) * (diff.abs() - atol).clamp(min=0)
    names: list[Seq | str] = list(index) + ["rest"]
    scores: dict[Seq | str, float] = {}
    for c, name in enumerate(names):
        d, s = float(diff[c]), float(se[c])
        scores[name] = 0.0 if d == 0.0 else (d / s if s > 0 else math.copysign(math.inf, d))
    return scores


def check_distribution(out, exact: ExactTarget, z_max: float = 5.0, min_prob: float = 0.01) -> float:
    """Assert that an SMC output's replicates agree with the exact target:

    * every particle with positive weight is a sequence in π's support;
    * every cell's z-score from :func:`distribution_z_scores` is at most ``z_max`` in size.

    Returns the largest |z|. With C cells and z_max = 5 the false-alarm rate is below about
    C·6e-7 when the normal approximation holds: many replicates, and a proposal that puts
    reasonable mass on every cell (else Y has a heavy right tail, and its mean over a few
    thousand replicates is usually too small)."""
    W = _normalised_weights(out).tolist()
    for g in range(out.tokens.shape[0]):
        for x, w in zip(sequences(out, g), W[g]):
            if w > 0 and x not in exact.probs:
                raise AssertionError(
                    f"a particle with weight {w:.3g} in group {g} is {list(x)}, outside the target's support"
                )
    scores = distribution_z_scores(out, exact, min_prob)
    worst = max(scores, key=lambda c: abs(scores[c]))
    if not abs(scores[worst]) <= z_max:
        pooled = pooled_distribution(out)
        shown = exact.probs.get(worst, float("nan")) if worst != "rest" else "rest"
        raise AssertionError(
            f"weighted particle distribution differs from the exact target at {worst!r} (π = {shown}): "
            f"z = {scores[worst]:.2f} (threshold {z_max}); evidence-pooled estimate {pooled.get(worst, 0.0):.5f}; "
            f"TV(pooled, π) = {total_variation(pooled, exact.probs):.4f}"
        )
    return abs(scores[worst])


def chi_square_pvalue(out, exact: ExactTarget | dict, min_expected: float = 5.0, particle: int | None = None) -> float:
    """Pearson chi-square p-value of the sequences of ``out`` (every particle with positive weight,
    all groups, counted unweighted: for exact samplers) against the distribution ``exact``.

    The test assumes independent samples. Autoregressive and speculative samples are; SMC
    particles of one group after resampling are not (they share ancestors): pass ``particle=i``
    to count only particle i of each group.

    Sequences whose expected count is below ``min_expected`` share one cell. A sample outside the
    support of ``exact`` gives p = 0. Needs scipy."""
    from scipy import stats

    probs = exact.probs if isinstance(exact, ExactTarget) else exact
    if particle is not None:
        out = SimpleNamespace(
            tokens=out.tokens[:, particle : particle + 1],
            lengths=out.lengths[:, particle : particle + 1],
            log_weights=out.log_weights[:, particle : particle + 1],
        )
    counts = _counts(out)
    n = sum(counts.values())
    if n == 0:
        raise AssertionError("no sample with positive weight")
    if any(x not in probs for x in counts):
        return 0.0
    # the least likely sequences share one 'rest' cell, grown until its expected count is large enough
    order = sorted(probs, key=probs.get)
    rest_expected, cut = 0.0, 0
    while cut < len(order) and (probs[order[cut]] * n < min_expected or 0 < rest_expected < min_expected):
        rest_expected += probs[order[cut]] * n
        cut += 1
    big = order[cut:]
    observed = [counts.get(x, 0) for x in big]
    expected = [probs[x] * n for x in big]
    if cut:
        observed.append(n - sum(observed))
        expected.append(rest_expected)
    if len(observed) < 2:
        return 1.0
    scale = sum(observed) / sum(expected)  # fix rounding so the totals match exactly
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)
