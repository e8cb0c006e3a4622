"""Bookkeeping shared by the reference strategies: constraint states and masks, reward increments.
The sampling maths (the race, masked proposals, weights, resampling) is in ``samplers.steps``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import RewardError
from ..potentials.reward import tilt


def dead_rows(mask: Tensor | None) -> Tensor | None:
    """bool [B]: rows of a token mask [B, V] that allow no token (a particle at a dead end)."""
    return None if mask is None else ~mask.any(-1)


@dataclass
class Constraints:
    """The constraints of a target, with their per-particle states (one entry per constraint)."""

    potentials: Sequence
    states: list = field(default_factory=list)

    @classmethod
    def start(cls, potentials: Sequence, batch: int) -> Constraints:
        return cls(list(potentials), [c.start(batch) for c in potentials])

    def __bool__(self) -> bool:
        return bool(self.potentials)

    def allowed(self, states: list | None = None) -> Tensor | None:
        states = self.states if states is None else states
        mask = None
        for c, s in zip(self.potentials, states):
            m = c.allowed(s)
            mask = m if mask is None else mask & m
        return mask

    def advanced(self, tokens: Tensor, states: list | None = None) -> list:
        states = self.states if states is None else states
        return [c.advance(s, tokens) for c, s in zip(self.potentials, states)]

    def accepting(self, batch: int) -> Tensor:
        ok = torch.ones(batch, dtype=torch.bool)
        for c, s in zip(self.potentials, self.states):
            ok = ok & c.accepting(s).cpu()
        return ok

    def fork(self, index: Tensor) -> None:
        self.states = [c.fork(s, index) for c, s in zip(self.potentials, self.states)]


def texts_of(model, tokens: Tensor, lengths: Tensor, rows: Sequence[int]) -> list[str]:
    """Decoded generated text of the given rows (EOS dropped)."""
    eos = model.eos_token_id
    out = []
    for i in rows:
        ids = tokens[i, : int(lengths[i])].tolist()
        if ids and ids[-1] == eos:
            ids = ids[:-1]
        out.append(model.decode(ids))
    return out


class RewardTracker:
    """Incremental log-weights of reward tilts: prefix twists add β·(R(new) − R(old)) each round,
    completion rewards add β·R(x) once, when the particle finishes."""

    def __init__(self, rewards: Sequence, model, batch: int, incremental: bool = False):
        """``incremental``: prefix rewards that offer ``prefix_session(batch)`` (LMReward) score only
        the tokens added each round, on a cache that :meth:`fork` reorders with the particles;
        the sampler must then call :meth:`fork` on every resampling and never reuse a row for
        another sequence (the reference SMC loop; the engine's scheduler reuses rows, so not there)."""
        self.rewards = list(rewards)
        self.model = model
        self.prev = {}
        self.sessions = {}
        for i, r in enumerate(self.rewards):
            if r.mode == "prefix":
                self.prev[i] = _reward_scores(r, [""], [[]]).repeat(batch)
                if incremental and getattr(r, "incremental", False) and hasattr(r, "prefix_session"):
                    self.sessions[i] = r.prefix_session(batch)

    def __bool__(self) -> bool:
        return bool(self.rewards)

    def increment(self, tokens: Tensor, lengths: Tensor, active: Tensor, finishing: Tensor) -> Tensor:
        B = tokens.shape[0]
        incr = torch.zeros(B, dtype=torch.float64)
        rows = active.nonzero().flatten().tolist()
        if not rows:
            return incr
        # decoded texts only for rewards that score text (LMReward scores the token ids)
        needs_text = any(not hasattr(r, "score_tokens") for r in self.rewards)
        texts = texts_of(self.model, tokens, lengths, rows) if needs_text else [""] * len(rows)
        ids = None
        if any(hasattr(r, "score_tokens") for r in self.rewards):
            # an ending EOS included; a sequence cut at max_new_tokens is scored as complete too
            # (EOS appended), as every factor but the LM is (smcdecode.testing: the target)
            eos = self.model.eos_token_id
            ids = [tokens[row, : int(lengths[row])].tolist() for row in rows]
            ids = [x + [eos] if bool(finishing[row]) and (not x or x[-1] != eos) else x for x, row in zip(ids, rows)]
        idx = torch.tensor(rows, dtype=torch.long)
        for i, r in enumerate(self.rewards):
            if r.mode == "prefix":
                values = self.sessions[i].scores(ids, rows) if i in self.sessions else None
                if values is None:  # no session, or a row it cannot extend: score the whole prefixes
                    self.sessions.pop(i, None)
                    values = _reward_scores(r, texts, ids)
                incr[idx] += tilt(r, values, self.prev[i][idx], texts if needs_text else None)
                self.prev[i][idx] = values
            else:
                fin = [j for j, row in enumerate(rows) if bool(finishing[row])]
                if fin:
                    fin_texts = [texts[j] for j in fin]
                    values = _reward_scores(r, fin_texts, None if ids is None else [ids[j] for j in fin])
                    incr[idx[fin]] += tilt(r, values, texts=fin_texts if needs_text else None)
        if not bool(torch.isfinite(incr).all()):  # NOTE: -inf (weight 0) is exact; NaN or +inf never is
            bad = torch.isnan(incr) | torch.isposinf(incr)
            if bool(bad.any()):
                raise RewardError(
                    f"the rewards {[r.name for r in self.rewards]} add up to {float(incr[bad][0])} for one particle: "
                    "their beta·R terms overflow float64 together; rescale the rewards or their betas"
                )
        return incr

    def fork(self, index: Tensor) -> None:
        self.prev = {i: v[index] for i, v in self.prev.items()}
        for session in self.sessions.values():
            session.fork(index)


def _reward_scores(reward, texts: list[str], ids: list[list[int]] | None) -> Tensor:
    """R of each row: from its text, or from its token ids for rewards that define
    ``score_tokens`` (e.g. LMReward, which scores the exact tokens under a second prompt)."""
    if ids is not None and hasattr(reward, "score_tokens"):
        return reward.score_tokens(ids)
    return reward.scores(texts)
