"""Block-size schedules for SMC-SD: how many draft tokens K each request's next round proposes.

A schedule decides K for round t+1 from what the particles of that request have shown up to the
end of round t, and from nothing else:

* :class:`FixedBlocks` — a given K per round (the last value repeats); ``FixedBlocks([4])`` is
  plain SMC-SD with K = 4.
* :class:`AdaptiveBlocks` — K ∈ {0, …, K_max} from two statistics of the drafted tokens so far:

  - an acceptance-like rate â, the running mean over drafted tokens d (drawn from the masked
    draft q') of min(1, p_T(d)/q(d)) with p_T the target at its temperature and q the unmasked
    draft: for an unconstrained target that is E_q[min(1, p/q)] = Σ_v min(p_T(v), q(v)), exact
    speculative decoding's acceptance rate. Each drafted token counts as evidence
    u = max(1 − p_T(d), 0.05) of a token: agreement on tokens the target is sure of (a format's
    quotes and braces) says nothing about the tokens the answer hinges on, where a weak draft
    fails, so â is in effect the acceptance on the tokens the target hesitates over;
  - the spread of the draft's incremental weights, as the loss of effective sample size per
    drafted token ℓ̂ = −log(ESS_d/N)/k, ESS_d the ESS of the round's draft terms
    exp(Σ_i α·log p_T(d_i) − log q'(d_i)) over the request's live particles.

  Both are discounted means (factor ``memory`` a round) with a prior (â = ``prior_acceptance``
  worth ``prior_tokens`` tokens of evidence: one lucky token does not open a block). Then K = min(K_acc, K_ess, 2·K_prev + 1, K_max) (K at most
  doubles, plus one, from one round to the next: a few lucky drafts do not open a long block) with
  K_acc = ⌊log ρ / log â⌋ (the longest block the draft gets entirely right with probability
  ≥ ρ = ``block_acceptance``) and K_ess = ⌊``weight_loss`` / ℓ̂⌋ (the draft may cost at most
  ``weight_loss`` nats of ESS a round). K = 0 is a round whose only token is the target's bonus:
  the particle filter with the locally optimal proposal π_loc ∝ p_T^α·1[valid].
  A loop that drafts nothing in a K = 0 round learns nothing new about the draft, so after
  ``probe_after`` such rounds in a row one K = 0 round is a probe (``probing``): the draft also
  proposes one token there, which only feeds the statistics (the round's token is still the
  target's bonus); while the estimates keep K at 0 the wait doubles, up to 32 rounds. The first round has K = ``start_block`` (0:
  the schedule starts with the target as proposal and lets the draft in once it has shown that it
  agrees with the target). (The GPU engine's round drafts the largest K its requests chose, or one
  token when one of them probes.)

Why the estimates stay exact
----------------------------
Every K gives an importance-sampling step for the same unnormalised prefix target
γ(x) = p_T(x)^α·Ψ_prefix(x) (DESIGN.md §2): the round's weight is γ(x·z)/(γ(x)·proposal(z | x))
whatever the number of drafted tokens in z. So V(x) = Σ_{complete y ⊒ x} γ(y)/γ(x) satisfies
Q_K V = V for every K, with Q_K the round's unnormalised kernel; when K is a function of the past
only (the particle system up to the previous round), E[γ̂_t(V) | past] = γ̂_{t−1}(V): the
unnormalised particle measure is a martingale, and at the end (V = 1 on complete sequences)
E[Ẑ] = Z and E[Ẑ·π̂(f)] = Z·π(f) for every f, exactly as for a fixed K — the weighted particles
target π and Ẑ stays unbiased. A schedule that used the *current* round's draws to pick that
same round's K would break this; the schedules here never see them. Each request's K depends
on that request's particles only, so independent requests (replicates) stay independent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import SMCDecodeError

NEG_INF = float("-inf")
DEFAULT_MAX_BLOCK = 8
MAX_PROBE_WAIT = 32
EASY_TOKEN_WEIGHT = 0.05  # evidence of a drafted token the target is sure of (see row_statistics)


@dataclass(frozen=True)
class FixedBlocks:
    """K per round: ``blocks[t]`` for round t, the last value for every later round."""

    blocks: tuple[int, ...]

    def __init__(self, blocks: Sequence[int]):
        blocks = tuple(blocks) if not isinstance(blocks, (str, bytes)) else ()
        if not blocks or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in blocks):
            raise SMCDecodeError(f"a block schedule must be a non-empty list of integers >= 0 (K per round), "
                                 f"got {blocks!r}")
        object.__setattr__(self, "blocks", blocks)

    adaptive = False

    @property
    def max_block_size(self) -> int:
        return max(self.blocks)

    def start(self, groups: int) -> _FixedPlan:
        return _FixedPlan(self.blocks, groups)


class _FixedPlan:
    def __init__(self, blocks: tuple[int, ...], groups: int):
        self.blocks, self.groups, self.round = blocks, groups, 0
        self.probing = torch.zeros(groups, dtype=torch.bool)

    def next(self) -> Tensor:
        k = self.blocks[min(self.round, len(self.blocks) - 1)]
        self.round += 1
        return torch.full((self.groups,), k, dtype=torch.long)

    def observe(self, stats: DraftStats) -> None:
        """A fixed schedule reads nothing of the rounds (the loops call every plan alike)."""


@dataclass(frozen=True)
class AdaptiveBlocks:
    """K per request and round from the past (see the module docstring); K ≤ ``max_block_size``."""

    max_block_size: int = DEFAULT_MAX_BLOCK
    block_acceptance: float = 0.5  # ρ: a whole block right with at least this probability
    weight_loss: float = math.log(2.0)  # nats of ESS the drafts may cost a round
    start_block: int = 0  # K of the first round
    memory: float = 0.7  # discount of older rounds' statistics, per round
    prior_acceptance: float = 0.3  # (K_acc = 0 until the draft has shown better)
    prior_tokens: float = 4.0
    probe_after: int = 2  # K = 0 rounds without fresh statistics before a K = 1 probe

    adaptive = True

    def __post_init__(self):
        k = self.max_block_size
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SMCDecodeError(f"max_block_size must be an integer >= 0, got {k!r}")
        for name in ("block_acceptance", "memory", "prior_acceptance"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 < v < 1.0:
                raise SMCDecodeError(f"AdaptiveBlocks {name} must lie strictly between 0 and 1, got {v!r}")
        for name in ("weight_loss", "prior_tokens"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 < v < math.inf:
                raise SMCDecodeError(f"AdaptiveBlocks {name} must be a finite number > 0, got {v!r}")
        for name in ("start_block", "probe_after"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SMCDecodeError(f"AdaptiveBlocks {name} must be an integer >= 0, got {v!r}")

    def start(self, groups: int) -> AdaptivePlan:
        return AdaptivePlan(self, groups)


@dataclass
class DraftStats:
    """One round's draft statistics per request [G] (float64): Σ min(1, p/q) and the number of
    drafted tokens it sums over; −log(ESS_d/N) of the draft terms and the mean drafted tokens per
    live particle (0 where the request drafted nothing)."""

    accept_sum: Tensor
    accept_count: Tensor
    ess_loss: Tensor
    tokens_per_particle: Tensor


class AdaptivePlan:
    """The running state of :class:`AdaptiveBlocks` for G requests."""

    def __init__(self, rule: AdaptiveBlocks, groups: int):
        self.rule = rule
        z = torch.zeros(groups, dtype=torch.float64)
        self.accept_sum, self.accept_count = z.clone(), z.clone()
        self.loss_sum, self.loss_tokens = z.clone(), z.clone()
        self.stale = torch.zeros(groups, dtype=torch.long)  # rounds since the last fresh statistics
        self.wait = torch.full((groups,), rule.probe_after, dtype=torch.long)
        self.first = True
        self.probing = torch.zeros(groups, dtype=torch.bool)  # the round ``next`` chose is a probe
        self.last = torch.full((groups,), min(rule.start_block, rule.max_block_size), dtype=torch.long)

    @property
    def acceptance(self) -> Tensor:
        r = self.rule
        return (self.accept_sum + r.prior_acceptance * r.prior_tokens) / (self.accept_count + r.prior_tokens)

    @property
    def ess_loss_per_token(self) -> Tensor:
        return self.loss_sum / (self.loss_tokens + self.rule.prior_tokens)

    def observe(self, stats: DraftStats) -> None:
        g = self.rule.memory
        self.accept_sum = g * self.accept_sum + stats.accept_sum
        self.accept_count = g * self.accept_count + stats.accept_count
        self.loss_sum = g * self.loss_sum + stats.ess_loss
        self.loss_tokens = g * self.loss_tokens + stats.tokens_per_particle
        fresh = stats.accept_count > 0
        self.stale = torch.where(fresh, 0, self.stale + 1)

    def next(self) -> Tensor:
        """K [G] long for the next round."""
        r = self.rule
        if self.first:
            self.first = False
            return self.last.clone()
        a = self.acceptance.clamp(1e-12, 1.0)
        k_acc = torch.where(a >= 1.0, float(r.max_block_size), math.log(r.block_acceptance) / torch.log(a))
        loss = self.ess_loss_per_token
        k_ess = torch.where(loss > 0, r.weight_loss / loss.clamp(min=1e-12), float(r.max_block_size))
        k = torch.minimum(torch.minimum(k_acc, k_ess), 2.0 * self.last + 1).clamp(0, r.max_block_size).floor().long()
        probe = (k == 0) & (self.stale >= self.wait) & (r.max_block_size > 0)
        self.wait = torch.where(probe, (self.wait * 2).clamp(max=MAX_PROBE_WAIT),
                                torch.where(k > 0, r.probe_after, self.wait))
        self.probing = probe
        self.last = k
        return k


def as_schedule(block_size) -> FixedBlocks | AdaptiveBlocks | None:
    """``block_size`` of the API as a schedule: None for a plain int K (the loops' fixed path),
    ``"adaptive"`` → AdaptiveBlocks(), a list → FixedBlocks(list), or a schedule itself."""
    if isinstance(block_size, (FixedBlocks, AdaptiveBlocks)):
        return block_size
    if isinstance(block_size, str):
        if block_size == "adaptive":
            return AdaptiveBlocks()
        raise SMCDecodeError(f"block_size {block_size!r} is not a schedule: give an integer K, 'adaptive', "
                             "AdaptiveBlocks(max_block_size=...), or a list of K per round")
    if isinstance(block_size, (list, tuple)):
        return FixedBlocks(block_size)
    return None


def row_statistics(log_p: Tensor, log_q: Tensor, term: Tensor, counted: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per particle [B] (float64): Σ_i u_i·min(1, p_T(d_i)/q(d_i)), Σ_i u_i, and Σ_i term_i (the
    draft's log-weight), with u_i = max(1 − p_T(d_i), ``EASY_TOKEN_WEIGHT``) the weight of drafted
    token i as evidence: a token the target was sure of (a format's quote, a forced digit) says
    little about whether the draft finds the tokens the target hesitates over, so it counts as a
    fraction of a token. All inputs [B, k]: ``log_p`` = log p_T(d_i) (no power), ``log_q`` =
    log q(d_i) of the unmasked draft, ``term`` = α·log p_T(d_i) − log q'(d_i), ``counted`` =
    drafts that count (live particle, up to its first EOS and the budget)."""
    lp = log_p.double()
    ratio = torch.where(torch.isneginf(lp), 0.0, (lp - log_q.double()).clamp(max=0.0).exp())
    ok = counted & torch.isfinite(log_q) & ~torch.isnan(ratio)
    evidence = (1.0 - lp.exp()).clamp(min=EASY_TOKEN_WEIGHT)  # [B, k]
    accept = torch.where(ok, evidence * ratio, 0.0).sum(1)
    count = torch.where(ok, evidence, 0.0).sum(1)
    lw = torch.where(ok, term.double(), 0.0).sum(1)
    lw = torch.where(ok.any(1), lw, NEG_INF)
    return accept, count, lw


def group_statistics(accept: Tensor, count: Tensor, draft_lw: Tensor, live: Tensor, groups: int) -> DraftStats:
    """Per-request :class:`DraftStats` from per-particle values [G·N] (``live``: rows that drafted
    and count this round; a row with draft log-weight -inf counts as a zero weight)."""
    G = groups
    accept, count = accept.double().view(G, -1), count.double().view(G, -1)
    live = (live & (count.view(-1) > 0)).view(G, -1)
    lw = torch.where(live, draft_lw.double().view(G, -1), NEG_INF)
    n_live = live.double().sum(1)
    m = lw.max(1, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.where(live, (lw - m).exp(), 0.0)
    s1, s2 = w.sum(1), (w * w).sum(1)
    ess = torch.where(s2 > 0, s1 * s1 / s2.clamp(min=1e-300), 0.0)
    frac = torch.where(n_live > 0, ess / n_live.clamp(min=1), 1.0).clamp(min=1.0 / 1e6, max=1.0)
    tokens = torch.where(n_live > 0, torch.where(live, count, 0.0).sum(1) / n_live.clamp(min=1), 0.0)
    return DraftStats(torch.where(live, accept, 0.0).sum(1), torch.where(live, count, 0.0).sum(1),
                      torch.where(n_live > 0, -torch.log(frac), 0.0), tokens)
