"""A reward from another language model: R(x) = log p'_T(x | prompt'), the log-probability of the
generated tokens under a second prompt (or a second model with the same tokenizer).

With the target ``LM(model) * LMReward(model, prompt2, beta=1)`` SMC samples

    π(x) ∝ p(x | prompt) · p'(x | prompt')^β

the product of experts (prompt intersection): text that both prompts find likely. ``beta`` < 1
softens the second expert. ``mode="prefix"`` (default) uses log p'(prefix) as a twist each round,
which guides resampling early; ``"complete"`` adds the whole log p'(x) only when a particle ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import SMCDecodeError, check_finite_float, check_positive_int, check_temperature
from ..models import Model
from .reward import MODES, Reward, tilt


class LMReward(Reward):
    """R(x) = log p'_T(x | prompt') of the exact generated tokens x (EOS included once x ends).

    A sequence cut at ``max_new_tokens`` is scored like an ended one (with the EOS term), as every
    factor of a target but its LM is (see ``smcdecode.testing``). ``score_tokens`` runs one batched
    forward over all sequences given; ``scores(texts)`` re-tokenises texts (for reward-style use).
    ``chunk``: rows per forward pass (bounds the [rows, length, V] logits kept in memory).
    ``incremental`` (prefix mode, in the SMC loop): keep one scoring cache over the particles and
    feed only each round's new tokens (:class:`PrefixSession`) instead of rescoring whole prefixes.
    """

    def __init__(
        self,
        model: Model,
        prompt,
        beta: float = 1.0,
        mode: str = "prefix",
        temperature: float = 1.0,
        name: str | None = None,
        chunk: int = 8,
        incremental: bool = True,
    ):
        if not isinstance(model, Model):
            raise SMCDecodeError(
                f"LMReward needs a smcdecode Model (load_model(...) or FunctionModel(...)), got {type(model).__name__}"
            )
        if mode not in MODES:
            raise SMCDecodeError(f"reward mode must be one of {MODES}, got {mode!r}")
        self.scorer = model
        self.prompt_ids = model.prompt_ids(prompt)
        self.temperature = check_temperature("LMReward temperature", temperature)
        self.fn = self.scores
        self.beta = check_finite_float("beta", beta)
        self.mode = mode
        self.batched = True
        self.name = name or f"log p'(x | {_short(prompt)})"
        self.chunk = check_positive_int("chunk", chunk, "rows per forward pass, e.g. 8")
        self.incremental = bool(incremental)
        self.model = None

    def __repr__(self) -> str:
        return f"LMReward({self.scorer.name}, {self.name!r}, beta={self.beta:g}, mode={self.mode!r})"

    def _copy(self, beta: float | None = None, model: Model | None = None) -> LMReward:
        out = LMReward.__new__(LMReward)
        out.__dict__.update(self.__dict__)
        out.fn = out.scores
        if beta is not None:
            out.beta = beta
        if model is not None:
            out.model = model
        return out

    def bind(self, model: Model) -> LMReward:
        if self.model is model:
            return self
        s = self.scorer
        if s.vocab_size != model.vocab_size or s.eos_token_id != model.eos_token_id:
            raise SMCDecodeError(
                f"LMReward model {s.name!r} ({s.vocab_size} tokens, EOS {s.eos_token_id}) does not share the "
                f"target's vocabulary ({model.name!r}: {model.vocab_size} tokens, EOS {model.eos_token_id}): "
                "use models with one tokenizer"
            )
        return self._copy(model=model)

    def __pow__(self, alpha: float) -> LMReward:
        return self._copy(beta=check_finite_float("beta × alpha", self.beta * check_finite_float("alpha", alpha)))

    # -- scoring ---------------------------------------------------------------------------
    def _token_logprobs(self, seqs: list[list[int]]) -> Tensor:
        """[B, L+1, V] float32 log p'_T(· | prompt', x_<i) for i = 0..L, sequences right-padded
        with EOS to the longest length L (padding never affects earlier positions)."""
        L = max(len(s) for s in seqs)
        eos = self.scorer.eos_token_id
        runner = self.scorer.start(self.prompt_ids[:-1], len(seqs))
        feed = torch.tensor([[self.prompt_ids[-1], *s, *([eos] * (L - len(s)))] for s in seqs], dtype=torch.long)
        return torch.log_softmax(runner.extend(feed).float() / self.temperature, dim=-1)

    def score_tokens(self, seqs: Sequence[Sequence[int]]) -> Tensor:
        """[B] float64 log p'_T(x | prompt') for each token sequence (tokens after an EOS ignored)."""
        eos = self.scorer.eos_token_id
        clean = []
        for s in seqs:
            s = [int(t) for t in s]
            clean.append(s[: s.index(eos) + 1] if eos in s else s)
        out = torch.zeros(len(clean), dtype=torch.float64)
        rows = [i for i, s in enumerate(clean) if s]
        for start in range(0, len(rows), self.chunk):
            part = rows[start : start + self.chunk]
            batch = [clean[i] for i in part]
            lp = self._token_logprobs(batch)  # [b, L+1, V]
            L = lp.shape[1] - 1
            idx = torch.tensor([s + [eos] * (L - len(s)) for s in batch], dtype=torch.long)
            tok_lp = lp[:, :L].gather(2, idx[:, :, None])[:, :, 0].double()
            n = torch.tensor([len(s) for s in batch])
            tok_lp = torch.where(torch.arange(L)[None, :] < n[:, None], tok_lp, 0.0)
            out[torch.tensor(part)] = tok_lp.sum(1)
        return out

    def prefix_session(self, batch: int) -> PrefixSession:
        """Incremental prefix scores for ``batch`` particles (see :class:`PrefixSession`)."""
        return PrefixSession(self, batch)

    def scores(self, texts: Sequence[str]) -> Tensor:
        """R(text) = log p'(tokens of text) with the scoring model's own tokenisation (no EOS)."""
        return self.score_tokens([self.scorer.encode(t) if t else [] for t in texts])

    # -- the potential contract (used by exact enumeration and property checks) ---------------
    def prefix(self, tokens, prompt=()):
        if self.mode == "complete":
            return 0.0
        return float(tilt(self, self.score_tokens([list(tokens)]))[0])

    def complete(self, tokens, prompt=()):
        return float(tilt(self, self.score_tokens([[*tokens, self.scorer.eos_token_id]]))[0])

    def logw_next(self, tokens, prompt=()):
        return self.batch_logw_next([tokens], prompt)[0]

    def batch_logw_next(self, seqs, prompt=()):
        seqs = [list(s) for s in seqs]
        V, eos = self.scorer.vocab_size, self.scorer.eos_token_id
        if not seqs:
            return torch.empty(0, V, dtype=torch.float64)
        out = torch.empty(len(seqs), V, dtype=torch.float64)
        for i, s in enumerate(seqs):  # one forward per sequence: lengths differ
            lp = self._token_logprobs([s])[0].double()  # [len+1, V]
            nxt = lp[-1]
            if self.mode == "prefix":
                out[i] = tilt(self, nxt)  # prefix(x·v) − prefix(x); EOS: complete(x) − prefix(x)
            else:
                idx = torch.tensor(s, dtype=torch.long)
                so_far = lp[:-1].gather(1, idx[:, None]).sum() if s else torch.tensor(0.0, dtype=torch.float64)
                out[i] = 0.0
                out[i, eos] = tilt(self, (so_far + nxt[eos]).reshape(1))[0]
        return out


class PrefixSession:
    """log p'(x | prompt') of ``batch`` growing particles, kept incrementally: one runner (KV cache)
    over the scoring model holds every particle's tokens, each call feeds only the tokens added
    since the last one, and :meth:`fork` reorders it with the particles. Rescoring whole prefixes
    every round costs O(length²) forwards over a generation; this costs one short forward a round.

    Rows fed fewer tokens than the round's longest (those that ended, or were not active) hold
    padding after their tokens and are marked stale: a later request to extend a stale row
    returns None, and the caller falls back to full rescoring (:meth:`LMReward.score_tokens`)."""

    def __init__(self, reward: LMReward, batch: int):
        self.reward = reward
        self.runner = reward.scorer.start(list(reward.prompt_ids[:-1]), batch)
        self.fed = torch.zeros(batch, dtype=torch.long)  # generated tokens already scored, per row
        self.total = torch.zeros(batch, dtype=torch.float64)  # their log p'
        self.carry = torch.full((batch,), int(reward.prompt_ids[-1]), dtype=torch.long)  # next token to feed
        self.stale = torch.zeros(batch, dtype=torch.bool)

    def scores(self, seqs: Sequence[Sequence[int]], rows: Sequence[int]) -> Tensor | None:
        """[len(rows)] float64 log p'(seqs[j] | prompt') for the particles ``rows`` (each seqs[j]
        extends what that row was given before; tokens after an EOS ignored), or None when a row
        cannot be extended incrementally."""
        eos = self.reward.scorer.eos_token_id
        new: list[list[int]] = []
        for row, s in zip(rows, seqs):
            s = [int(t) for t in s]
            s = s[: s.index(eos) + 1] if eos in s else s
            done = int(self.fed[row])
            if len(s) < done or (len(s) > done and bool(self.stale[row])):
                return None
            new.append(s[done:])
        width = max((len(n) for n in new), default=0)
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        if width == 0:
            return self.total[idx].clone()
        B = self.fed.shape[0]
        feed = torch.full((B, width), eos, dtype=torch.long)
        feed[:, 0] = self.carry
        short = torch.ones(B, dtype=torch.bool)  # rows whose KV gets padding this call
        for row, n in zip(rows, new):
            if n:
                feed[row, 1 : len(n)] = torch.tensor(n[:-1], dtype=torch.long)
            short[row] = len(n) < width
        logp = torch.log_softmax(self.runner.extend(feed).float() / self.reward.temperature, dim=-1)
        for row, n in zip(rows, new):
            if n:
                got = logp[row, : len(n)].gather(1, torch.tensor(n, device=logp.device)[:, None])
                self.total[row] += float(got.double().sum())
                self.fed[row] += len(n)
                self.carry[row] = n[-1]
        self.stale |= short
        return self.total[idx].clone()

    def fork(self, index: Tensor) -> None:
        self.runner.reorder(index)
        for name in ("fed", "total", "carry", "stale"):
            setattr(self, name, getattr(self, name)[index])


def _short(prompt) -> str:
    text = prompt if isinstance(prompt, str) else str(prompt)
    return text[:30] + ("..." if len(text) > 30 else "")
