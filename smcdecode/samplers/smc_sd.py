"""One SMC-SD request on the reference backend: its runners and particles, advanced a round at a time.

An :class:`SMCRun` holds one request (G groups × N particles sharing one prompt; ``loop.Request``):
its target and draft runners, tokens, weights, constraint and reward states, and its schedule.
:meth:`SMCRun.round` does one round with the step functions of ``samplers.steps``; the request loop
(``samplers.loop``) calls it for every live request between joins and leaves, and ``smc_sd`` is
that loop with one request.

One round, per particle with history h (DESIGN.md §2):
  1. draft d_1..d_k ~ q' (the draft at its temperature, masked by the target's constraints);
  2. one target pass over [last, d_1..d_k] gives p_T(· | h, d_<i), i = 1..k+1;
  3. bonus b ~ π_loc(v) ∝ p_T(v | h, d)^α · 1[valid];
  4. log w += Σ_i [α log p_T(d_i) − log q'(d_i)] + log Σ_v p_T(v | h, d)^α 1[valid]
     (terms stop at the first EOS; no bonus after an EOS or when the token budget runs out);
  5. rewards add their twist / terminal terms; a sequence cut at max_new_tokens that the
     constraints do not accept gets log w = -inf.
Then, per group, resample when ESS < τ·N (always when τ = 1) and fold the mean weight into log Ẑ.
With no draft (proposal = the target) k = 0: a plain particle filter with the locally optimal
proposal π_loc, one token per round. A ``schedule`` (``samplers/adaptive.py``) picks k per round
from the past, 0 included (a round with the draft idle; the tokens it has not seen are fed to it
in the next round that drafts); an adaptive schedule runs one group per request (its k is that
request's own).

A feature draft (``smcdecode.drafts.feature``) also reads the target's final hidden states: the
round's first drafted token reads the target's feature of the previous position, the later ones
the draft's own outputs; after the target's pass the draft's cache is cut back and the round's
tokens are fed again with the target's features at the start of the next round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import SMCDecodeError
from . import steps
from .adaptive import group_statistics, row_statistics
from .common import Constraints, RewardTracker, dead_rows
from .resampling import get_resampler

CHUNK = 256  # initial room for generated tokens per particle (the buffer doubles as needed)


@dataclass
class SMCOutput:
    """Raw output of a run, with a leading group dimension G and particle dimension N."""

    tokens: Tensor  # [G, N, T] long, EOS-padded: T ≤ max_new_tokens, the longest generation's room
    lengths: Tensor  # [G, N] generated tokens (an ending EOS included)
    finished: Tensor  # [G, N] bool: ended by EOS, budget, or weight -inf
    log_weights: Tensor  # [G, N] float64, since the last resampling
    log_evidence: Tensor  # [G] float64 log Ẑ
    ess: list[Tensor] = field(default_factory=list)  # per round, [G]
    resampled: list[Tensor] = field(default_factory=list)  # per round, [G] bool
    weights: list[Tensor] = field(default_factory=list)  # per round, normalised [G, N] before resampling
    draft_tokens: int = 0  # drafted tokens proposed in total (all particles)
    rounds: int = 0
    block_sizes: list[Tensor] = field(default_factory=list)  # per round, [G] K used
    survivors: list[Tensor] = field(default_factory=list)  # per round, [G] distinct ancestors kept (N: none resampled)
    # [G, N] log-weight each particle's path would carry with the target as proposal (Σ of the
    # local normalisers log Σ_v p_T^α·1[valid], rewards, cuts); None where not tracked
    target_log_weights: Tensor | None = None


class _Drafted(NamedTuple):
    """What the draft phase of a round hands on."""

    drafts: Tensor  # [B, k] long
    log_q: Tensor  # [B, k] float64: log q'(d_i)
    log_q_all: list  # log q(d_i) of the unmasked draft, per position (a schedule's statistic)
    masks: list  # the constraint masks the drafts were drawn under, per position
    states: list  # the constraint states after the drafts
    dead_at: Tensor  # [B] first position of the round with no allowed token (never: k + 2)
    k: int  # drafts that count (fewer than asked when every particle ended early)
    bonus: bool
    committed: int  # a feature draft: its cache length before the round's drafts (-1: it drew nothing)


class SMCRun:
    """One request's particles and runners (see the module docstring); ``request`` a ``loop.Request``."""

    def __init__(self, request):
        r = request
        draft = r.draft
        schedule = r.schedule if draft is not None else None
        self.request, self.draft = r, draft
        self.lm = lm = r.target.lm
        self.model = model = lm.model
        self.G, self.N = G, N = r.groups, r.particles
        self.B = B = G * N
        self.K = r.block_size if draft is not None else 0
        self.plan = schedule.start(G) if schedule is not None else None
        self.eos = eos = model.eos_token_id
        self.alpha = lm.alpha
        self.resample = get_resampler(r.resampler)
        self.generator = r.generator
        self.max_new_tokens = r.max_new_tokens
        prompt_ids = r.prompt

        self.t_runner = model.start(prompt_ids[:-1], B)
        self.d_runner = draft.model.start(prompt_ids[:-1], B) if self.K > 0 or self.plan is not None else None
        self.pending = torch.full((B, 1), prompt_ids[-1], dtype=torch.long)  # tokens the draft has not seen
        self.feature = self.d_runner is not None and draft.reads_target
        # a feature draft: the feature paired with each pending token (the target's, of the position before)
        self.pending_features = self.d_runner.tail_feature[:, None] if self.feature else None
        self.last = torch.full((B,), prompt_ids[-1], dtype=torch.long)  # token the target has not seen

        self.tokens = torch.full((B, min(r.max_new_tokens, CHUNK)), eos, dtype=torch.long)  # grows with position
        self.lengths = torch.zeros(B, dtype=torch.long)
        self.finished = torch.zeros(B, dtype=torch.bool)
        self.log_w = torch.zeros(B, dtype=torch.float64)
        self.log_Z = torch.zeros(G, dtype=torch.float64)
        self.constraints = Constraints.start(r.target.constraints, B)
        self.rewards = RewardTracker(r.target.rewards, model, B, incremental=True)
        self.out = SMCOutput(self.tokens, self.lengths, self.finished, self.log_w, self.log_Z)
        self.tp_lw = torch.zeros(B, dtype=torch.float64)  # the paths' log-weights with the target as proposal
        self.position = 0  # generated length of every unfinished particle (they advance in lockstep)

    @property
    def done(self) -> bool:
        """Every particle finished, or the token budget is spent."""
        return self.position >= self.max_new_tokens or bool(self.finished.all())

    def round(self) -> int:
        """One SMC-SD round over every particle of the request; returns the tokens it added per row."""
        B, G, eos, alpha, plan = self.B, self.G, self.eos, self.alpha, self.plan
        remaining = self.max_new_tokens - self.position
        K_round = self.K if plan is None else int(plan.next()[0])  # (one group, or the same K for every group)
        k = min(K_round, remaining)
        # a probe: a K = 0 round that also drafts one token, for the schedule's statistics only
        probe = k == 0 and plan is not None and bool(plan.probing[0])
        active = ~self.finished

        # 1. draft k tokens from q' (masked by the constraints)
        d = self._draft(k, 1 if probe else k, remaining > K_round, probe)
        k, bonus, drafts, log_q, masks, states, dead_at = d.k, d.bonus, d.drafts, d.log_q, d.masks, d.states, d.dead_at
        never = min(K_round, remaining) + 2  # (_draft's mark of "no dead position")
        if probe:  # nothing drafted counts: the round is the target's bonus alone
            probed, probed_log_q = drafts, log_q
            drafts, log_q, masks, states = drafts[:, :0], log_q[:, :0], [], self.constraints.states
            dead_at = torch.full((B,), never, dtype=torch.long)

        # 2. one target pass over [last, d_1..d_k]
        feed = torch.cat([self.last[:, None], drafts], dim=1)
        if self.feature:
            t_logits, t_hidden = self.t_runner.extend(feed, hidden=True)
            if d.committed >= 0:
                self.d_runner.crop(d.committed)  # the drafted positions read draft features: fed again next round
        else:
            t_logits = self.t_runner.extend(feed)
        log_p = self.lm.log_probs(t_logits.cpu()).double()  # [B, k+1, V]

        # 3. bonus token from π_loc ∝ p^α·1[valid], and its normaliser log Σ_v p^α·1[valid]
        block, log_norm = drafts, None
        if bonus:
            mask = self.constraints.allowed(states)
            b, log_norm = steps.bonus(log_p[:, k], 1.0, alpha, mask, generator=self.generator)  # (-inf: a dead row)
            dead = dead_rows(mask)
            if dead is not None:
                dead_at = torch.where(dead & (dead_at == never), k, dead_at)
            block = torch.cat([drafts, b[:, None]], dim=1)
            states = self.constraints.advanced(b, states)
            self._pending(block, drafts, b, k, probe, t_hidden if self.feature else None, d.committed >= 0)
            self.last = b
        self.constraints.states = states

        # 4. incremental weights of the drafted tokens, up to and including the first EOS (+ the bonus's)
        log_p_drafts = log_p[:, :k].gather(2, drafts[:, :, None])[:, :, 0]
        incr, n_new, any_eos, _ = steps.weigh(log_p_drafts, log_q, drafts, alpha, k, eos, log_norm, bonus)
        is_eos = drafts == eos
        keep = (torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0  # drafted positions up to the first EOS
        if plan is not None and probe:
            lp_d = log_p[:, :1].gather(2, probed[:, :, None])[:, :, 0]
            plan.observe(group_statistics(*row_statistics(lp_d, torch.stack(d.log_q_all, 1),
                                                          alpha * lp_d - probed_log_q, active[:, None]), active, G))
        elif plan is not None and k > 0:
            term = torch.where(torch.isneginf(log_q), steps.NEG_INF, alpha * log_p_drafts - log_q)
            plan.observe(group_statistics(*row_statistics(log_p_drafts, torch.stack(d.log_q_all, 1), term,
                                                          keep & active[:, None]), active, G))
        elif plan is not None:
            plan.observe(group_statistics(*(torch.zeros(B, dtype=torch.float64),) * 3, active, G))
        # the paths' log-weights with the target as proposal: the local normalisers log Σ_v p^α·1[valid]
        # at the round's drafted positions and the bonus's
        tp_incr = torch.zeros(B, dtype=torch.float64)
        for i, m in enumerate(masks):
            la = alpha * log_p[:, i]
            la = la if m is None else la.masked_fill(~m, steps.NEG_INF)
            tp_incr += torch.where(keep[:, i], torch.logsumexp(la, -1), 0.0)
        if log_norm is not None:
            tp_incr = tp_incr + torch.where(any_eos, 0.0, log_norm)

        width = block.shape[1]
        # NOTE: a particle stops before its first position with no allowed token (weight 0 there)
        n_new = torch.minimum(n_new, dead_at)
        block = torch.where(torch.arange(width)[None, :] < n_new[:, None], block, eos)
        position = self.position
        if position + width > self.tokens.shape[1]:
            self.tokens = grow(self.tokens, min(self.max_new_tokens, max(2 * self.tokens.shape[1], position + width)), eos)
        self.tokens[active, position : position + width] = block[active]
        self.lengths[active] += n_new[active]
        self.position = position + width

        hit_eos = any_eos | (block[:, -1] == eos) if bonus else any_eos
        ended = active & (hit_eos | (self.lengths >= self.max_new_tokens))
        if self.constraints:
            accepting = self.constraints.accepting(B)
            incr = steps.reject_cut(incr, ended, hit_eos, accepting)
            tp_incr = steps.reject_cut(tp_incr, ended, hit_eos, accepting)
        if self.rewards:  # particles whose weight is already 0 are not scored
            r_incr = self.rewards.increment(self.tokens, self.lengths, active & ~torch.isneginf(incr), ended)
            incr = incr + r_incr
            tp_incr = tp_incr + r_incr
        self.log_w = torch.where(active, self.log_w + incr, self.log_w)
        self.tp_lw = torch.where(active, self.tp_lw + tp_incr, self.tp_lw)
        if not bool((torch.isfinite(self.log_w) | torch.isneginf(self.log_w)).all()):
            raise _non_finite(self.log_w, log_p, log_q, self.model, self.draft, self.out.rounds)
        self.finished |= ended | torch.isneginf(self.log_w)
        if self.request.progress is not None:
            self.request.progress.update(width)
        self._resample(k)
        return width

    def _draft(self, k: int, n_draw: int, bonus: bool, probe: bool) -> _Drafted:
        """Step 1 of a round: ``n_draw`` tokens per particle from q', masked by the constraints."""
        B, eos, gen = self.B, self.eos, self.generator
        never = k + 2
        dead_at = torch.full((B,), never, dtype=torch.long)
        drafted, drafted_log_q, drafted_log_q_all, masks = [], [], [], []
        states = self.constraints.states
        hidden, committed = None, -1
        if n_draw > 0:
            d_runner, feature, temperature = self.d_runner, self.feature, self.draft.temperature
            if feature:
                logits, hidden = d_runner.extend(self.pending, self.pending_features)
                logits, hidden, committed = logits[:, -1].cpu(), hidden[:, -1:], d_runner.length
            else:
                logits = d_runner.extend(self.pending)[:, -1].cpu()
            over = self.finished.clone()  # rows whose later drafts this round are discarded: ended or dead
            for i in range(n_draw):
                mask = self.constraints.allowed(states)
                d, lq_d = steps.propose(logits.double(), temperature, mask, generator=gen)
                if self.plan is not None:  # log q(d) of the unmasked draft (a schedule's statistic)
                    lq_all = torch.log_softmax(logits.double() / temperature, -1)
                    drafted_log_q_all.append(lq_d if mask is None else lq_all.gather(1, d[:, None])[:, 0])
                masks.append(mask)
                dead = dead_rows(mask)
                if dead is not None:
                    dead_at = torch.where(dead & (dead_at == never), i, dead_at)
                drafted.append(d)
                drafted_log_q.append(lq_d)
                states = self.constraints.advanced(d, states)
                over |= d == eos if dead is None else (d == eos) | dead
                if bool(over.all()) and i < k - 1 and not probe:
                    # NOTE: every particle ends this round: its remaining drafts (a huge block_size
                    # can ask for millions) and the bonus would be discarded, so they are not drawn
                    k, bonus = i + 1, False
                    break
                if i < k - 1:
                    if feature:
                        logits, hidden = d_runner.extend(d[:, None], hidden)
                        logits = logits[:, -1].cpu()
                    else:
                        logits = d_runner.extend(d[:, None])[:, -1].cpu()
            self.out.draft_tokens += int((~self.finished).sum()) * n_draw
        drafts = torch.stack(drafted, 1) if drafted else torch.empty(B, 0, dtype=torch.long)
        log_q = torch.stack(drafted_log_q, 1) if drafted else torch.zeros(B, 0, dtype=torch.float64)
        return _Drafted(drafts, log_q, drafted_log_q_all, masks, states, dead_at, k, bonus, committed)

    def _pending(self, block: Tensor, drafts: Tensor, b: Tensor, k: int, probe: bool, t_hidden: Tensor | None,
                 drafted: bool) -> None:
        """The tokens (and a feature draft's features) the draft has not seen after a round with a bonus."""
        if self.feature and drafted:  # the round's tokens again, each with the target's feature of the position before
            self.pending, self.pending_features = block, t_hidden.to(self.pending_features.dtype)
        elif self.feature:  # the draft sat this round out: it still has to see what it has not seen
            self.pending = torch.cat([self.pending, block], dim=1)
            self.pending_features = torch.cat([self.pending_features, t_hidden.to(self.pending_features.dtype)], dim=1)
        elif k > 0:
            self.pending = torch.stack([drafts[:, -1], b], dim=1)
        elif probe:  # the draft has seen everything up to ``last``
            self.pending = b[:, None]
        else:
            self.pending = torch.cat([self.pending, b[:, None]], dim=1) if self.d_runner is not None else b[:, None]

    def _resample(self, k: int) -> None:
        """Per group: resample when ESS < τN, fold the mean weight into log Ẑ, fork every particle state."""
        G, N, out = self.G, self.N, self.out
        live_group = (~self.finished).view(G, N).any(1)
        rs = steps.resample(self.log_w.view(G, N), self.request.ess_threshold, self.resample, live=live_group,
                            generator=self.generator, sync=True)
        out.ess.append(rs.ess)
        out.resampled.append(rs.resampled)
        out.weights.append(rs.W)
        out.block_sizes.append(torch.full((G,), k, dtype=torch.long))
        out.rounds += 1
        kept = torch.full((G,), N, dtype=torch.long)
        if bool(rs.resampled.any()):  # the one host sync of the round
            kept = (rs.ancestors.sort(1).values.diff(dim=1) != 0).sum(1) + 1
            index = (rs.ancestors + (torch.arange(G) * N)[:, None]).flatten()
            self.log_Z += rs.log_Z_incr
            self.log_w = rs.log_w.flatten()
            self.tokens, self.lengths, self.finished = self.tokens[index], self.lengths[index], self.finished[index]
            self.tp_lw, self.pending, self.last = self.tp_lw[index], self.pending[index], self.last[index]
            if self.feature:
                self.pending_features = self.pending_features[index.to(self.pending_features.device)]
            self.constraints.fork(index)
            self.rewards.fork(index)
            self.t_runner.reorder(index)
            if self.d_runner is not None:
                self.d_runner.reorder(index)
        out.survivors.append(kept)

    def output(self) -> SMCOutput:
        """The run's :class:`SMCOutput` (log Ẑ with its final term folded in); call once, when done."""
        G, N, out = self.G, self.N, self.out
        lw = self.log_w.view(G, N)
        self.log_Z += steps.log_mean_weight(lw, N)
        out.tokens = self.tokens[:, : self.position].reshape(G, N, -1)
        out.lengths = self.lengths.view(G, N)
        out.finished = self.finished.view(G, N)
        out.log_weights = lw
        out.log_evidence = self.log_Z
        out.target_log_weights = self.tp_lw.view(G, N)
        return out


def stack(runs: list[SMCOutput], eos: int) -> SMCOutput:
    """Runs of one group each as one G-group output (tokens EOS-padded to the longest); per-round
    lists are padded where a run had fewer rounds (ESS and weights nan, not resampled, K 0, N survivors)."""
    T = max(r.tokens.shape[2] for r in runs)
    tokens = torch.cat([torch.nn.functional.pad(r.tokens, (0, T - r.tokens.shape[2]), value=eos) for r in runs])
    out = SMCOutput(tokens, torch.cat([r.lengths for r in runs]), torch.cat([r.finished for r in runs]),
                    torch.cat([r.log_weights for r in runs]), torch.cat([r.log_evidence for r in runs]))
    R = max(r.rounds for r in runs)
    N = runs[0].tokens.shape[1]

    def column(values: list, t: int, fill):
        return torch.cat([v[t] if t < len(v) else fill for v in values])

    nan1, nanN = torch.full((1,), math.nan, dtype=torch.float64), torch.full((1, N), math.nan, dtype=torch.float64)
    for t in range(R):
        out.ess.append(column([r.ess for r in runs], t, nan1))
        out.resampled.append(column([r.resampled for r in runs], t, torch.zeros(1, dtype=torch.bool)))
        out.weights.append(column([r.weights for r in runs], t, nanN))
        out.block_sizes.append(column([r.block_sizes for r in runs], t, torch.zeros(1, dtype=torch.long)))
        out.survivors.append(column([r.survivors for r in runs], t, torch.full((1,), N, dtype=torch.long)))
    out.rounds = R
    out.draft_tokens = sum(r.draft_tokens for r in runs)
    out.target_log_weights = torch.cat([r.target_log_weights for r in runs])
    return out


def grow(tokens: Tensor, width: int, eos: int) -> Tensor:
    """``tokens`` [B, T] with room for ``width`` ≥ T columns (EOS-padded)."""
    out = torch.full((tokens.shape[0], width), eos, dtype=tokens.dtype)
    out[:, : tokens.shape[1]] = tokens
    return out


def _non_finite(log_w: Tensor, log_p: Tensor, log_q: Tensor, model, draft, rounds: int) -> SMCDecodeError:
    """Why a log-weight became NaN or +inf (rewards raise their own RewardError earlier)."""
    i = int((torch.isnan(log_w) | torch.isposinf(log_w)).nonzero()[0, 0])
    if bool(torch.isnan(log_p[i]).any()):
        source = f"the target model {model.name!r} returned NaN logits"
    elif bool(torch.isnan(log_q[i]).any()):
        source = f"the draft model {draft.model.name!r} returned NaN logits"
    else:
        source = "the round's terms overflowed float64"
    return SMCDecodeError(
        f"particle {i}'s log-weight became {float(log_w[i])} in round {rounds + 1}: {source} (a float16 model "
        "can overflow: load it with dtype='float32'; a temperature or power that is extreme for these logits "
        "can too)"
    )
