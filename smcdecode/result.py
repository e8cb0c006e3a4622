"""The result of a run: the weighted particle set, the evidence, diagnostics and timing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .errors import SMCDecodeError

COLLAPSE_GAP = 2.0  # nats of log Ẑ below the target-as-proposal estimate that mean collapse
COLLAPSE_ESS = 0.5  # mean ESS / N below which the particle system counts as collapsed
NO_SAMPLE = ("every particle has weight 0: no particle satisfied the constraints within max_new_tokens; "
             "raise max_new_tokens or the number of particles")


@dataclass
class Result:
    """Weighted particles approximating the target, with diagnostics.

    ``weights`` are the normalised final weights (they sum to 1, or are all 0 when no particle
    has positive weight, e.g. a constraint nothing satisfied). ``sample`` is drawn in proportion to
    them; ``best`` (the arg-max particle) is a different estimator, offered only explicitly.
    """

    strategy: str
    texts: list[str]
    tokens: list[list[int]]
    log_weights: Tensor  # [N] float64
    weights: Tensor  # [N] float64
    finished: Tensor  # [N] bool
    log_evidence: float  # log Ẑ (nan for strategies that do not estimate it)
    ess: list[float]  # per round
    resampled: list[bool]  # per round
    weight_history: list[Tensor]  # per round, normalised weights [N] before resampling
    sample_index: int | None
    seconds: float
    prompt_tokens: int
    particles: int
    block_size: int
    draft_tokens: int = 0
    accepted_tokens: int | None = None
    message: str = ""
    extra: dict = field(default_factory=dict)
    n_rounds: int | None = None  # rounds run where ``ess`` does not count them (speculative decoding)
    eos_token_id: int | None = None
    max_new_tokens: int | None = None
    block_sizes: list[int] = field(default_factory=list)  # per round, the K drafted (SMC)
    survivors: list[int] = field(default_factory=list)  # per round, distinct ancestors kept (N: not resampled)
    # log Ẑ that the target as proposal would give, estimated from these particles (−log Σ_i W_i e^{−L_i},
    # L_i the log-weight particle i's path carries with the target as proposal); None where not tracked
    target_log_evidence: float | None = None
    chosen: str = ""  # what the API chose for the user (proposal, K) and why, when it chose

    # -- the answer -----------------------------------------------------------------------
    @property
    def text(self) -> str | None:
        """The sampled text (drawn ∝ final weights), or None if every particle has weight 0."""
        return None if self.sample_index is None else self.texts[self.sample_index]

    @property
    def sample_tokens(self) -> list[int] | None:
        return None if self.sample_index is None else self.tokens[self.sample_index]

    def best(self) -> str | None:
        """The highest-weight particle's text (not a sample from the target)."""
        if self.sample_index is None:
            return None
        return self.texts[int(torch.argmax(self.log_weights))]

    # -- diagnostics ----------------------------------------------------------------------
    @property
    def rounds(self) -> int:
        """Rounds run: SMC's reweighting rounds; speculative decoding's draft-and-verify rounds
        (over all samples); 0 for autoregressive sampling, which has none."""
        return self.n_rounds if self.n_rounds is not None else len(self.ess)

    @property
    def endings(self) -> list[str]:
        """How each particle ended: ``"eos"`` (it sampled the end-of-sequence token), ``"cut"``
        (it reached ``max_new_tokens`` first) or ``"stopped"`` (neither: it dropped out early with
        weight 0, e.g. no token could continue it under a constraint); ``"?"`` where the result does
        not record the EOS token and the budget."""
        out = []
        for toks in self.tokens:
            if self.eos_token_id is not None and toks and toks[-1] == self.eos_token_id:
                out.append("eos")
            elif self.max_new_tokens is not None and len(toks) >= self.max_new_tokens:
                out.append("cut")
            elif self.eos_token_id is not None and self.max_new_tokens is not None:
                out.append("stopped")
            else:
                out.append("?")
        return out

    @property
    def mean_ess(self) -> float:
        return float(sum(self.ess) / len(self.ess)) if self.ess else float("nan")

    @property
    def resample_rate(self) -> float:
        return float(sum(self.resampled) / len(self.resampled)) if self.resampled else float("nan")

    @property
    def generated_tokens(self) -> int:
        return len(self.sample_tokens) if self.sample_tokens is not None else 0

    @property
    def tokens_per_second(self) -> float:
        """Tokens of the returned sample per second of wall time (per-request throughput)."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def particle_tokens_per_second(self) -> float:
        """Tokens generated over all particles per second."""
        return sum(len(t) for t in self.tokens) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float | None:
        if self.accepted_tokens is None or not self.draft_tokens:
            return None
        return self.accepted_tokens / self.draft_tokens

    @property
    def one_ancestor_rounds(self) -> int:
        """Rounds after which every particle descended from a single ancestor."""
        return sum(1 for s in self.survivors if s == 1) if self.particles > 1 else 0

    @property
    def diagnosis(self) -> str:
        """One line when the particle system collapsed, with the fix; "" when it did not (or for
        strategies without particles). Collapsed means: log Ẑ more than ``COLLAPSE_GAP`` nats below
        what the target as proposal would give (estimated from the same particles: the proposal
        missed most of the target's mass), or at least a quarter of the rounds (and two) ended with
        one surviving ancestor, or a mean ESS below ``COLLAPSE_ESS``·N."""
        if self.strategy != "smc" or not self.ess or self.sample_index is None:
            return ""
        n, rounds = self.particles, self.rounds
        # (with the target as proposal, the gap is the rewards' share of log Z: no proposal to blame)
        far_below = bool(self.block_size) and self.target_log_evidence is not None and \
            math.isfinite(self.target_log_evidence) and self.target_log_evidence - self.log_evidence > COLLAPSE_GAP
        ones = self.one_ancestor_rounds
        one_ancestor = ones >= max(2, rounds / 4)
        low_ess = n > 1 and self.mean_ess < COLLAPSE_ESS * n
        if not (far_below or one_ancestor or low_ess):
            return ""
        facts = []  # (the signs seen, only: none of them contradicts the verdict)
        if low_ess:
            facts.append(f"mean ESS {self.mean_ess:.1f}/{n}")
        if one_ancestor:
            facts.append(f"{ones} of {rounds} rounds with one surviving ancestor")
        if far_below:
            facts.append(f"log Z {self.log_evidence:.1f} vs about {self.target_log_evidence:.1f} with the target "
                         "as proposal")
        if self.block_size:
            fix = ("the draft cannot propose what the target wants: use the target as proposal (proposal='target', "
                   "--draft target), block_size='adaptive' or a smaller K, more particles, or a better draft")
        else:
            fix = "use more particles (or a resampling threshold nearer 1)"
        return f"particle system collapsed ({'; '.join(facts)}): {fix}"

    def summary(self, max_chars: int = 70) -> str:
        """A few lines in the strategy's own terms, then one row per particle (or sample), highest
        weight first; ``*`` marks the returned sample."""
        n, total = self.particles, sum(len(t) for t in self.tokens)
        timing = (f"{self.seconds:.2f} s, {self.tokens_per_second:.1f} tok/s (the returned sample), "
                  f"{self.particle_tokens_per_second:.1f} tok/s (all {n})")
        if self.strategy == "smc":
            if len(set(self.block_sizes[:-1])) > 1:  # (the last round's K may be cut by the budget)
                proposal = (f"K from {min(self.block_sizes)} to {max(self.block_sizes)} draft tokens a round "
                            f"(mean {sum(self.block_sizes) / len(self.block_sizes):.1f})")
            elif self.block_size and self.block_sizes and not any(self.block_sizes):
                proposal = ("K = 0 in every round (the schedule never let the draft in: the target proposed one "
                            "token a round)")
            elif self.block_size:
                proposal = f"K = {self.block_sizes[0] if self.block_sizes else self.block_size} draft tokens a round"
            else:
                proposal = "the target as proposal (one token a round)"
            lines = [
                f"strategy smc: {n} particles, {proposal}, {self.rounds} rounds ({sum(self.resampled)} resampled); "
                f"{timing}",
                f"log evidence log Z = {self.log_evidence:.4f}; mean ESS {self.mean_ess:.2f}/{n}",
            ]
        elif self.strategy == "speculative":
            lines = [
                f"strategy speculative: {n} samples, K = {self.block_size} draft tokens a round, {self.rounds} "
                f"draft-and-verify rounds, {total} tokens in all; {timing}",
            ]
            if self.acceptance_rate is not None:
                lines.append(f"draft acceptance {self.acceptance_rate:.3f} ({self.accepted_tokens} of "
                             f"{self.draft_tokens} drafted tokens accepted)")
        elif self.strategy == "autoregressive":
            lines = [f"strategy autoregressive: {n} samples, {total} tokens in all; {timing}"]
        else:
            lines = [f"strategy {self.strategy}: {n} particles, {self.rounds} rounds; {timing}"]
            if not math.isnan(self.log_evidence):
                lines.append(f"log evidence log Z = {self.log_evidence:.4f}")
        if self.chosen:
            lines.append(self.chosen)
        if self.diagnosis:
            lines.append(self.diagnosis)
        if self.message:
            lines.append(self.message)
        lines.append("  #  weight  end      tokens  text")
        endings = self.endings
        order = torch.argsort(self.log_weights, descending=True).tolist()
        for i in order:
            text = self.texts[i].replace("\n", "\\n")
            if len(text) > max_chars:
                text = text[: max_chars - 3] + "..."
            mark = "*" if i == self.sample_index else " "
            lines.append(f"{mark}{i:2d}  {float(self.weights[i]):.4f}  {endings[i]:7s}  {len(self.tokens[i]):6d}  {text}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def plot(self, path: str | None = None):
        """ESS per round (resampling rounds marked) and the particle weights over rounds; saved to
        ``path`` (a PNG, say) when given, else returned as a matplotlib figure."""
        from pathlib import Path

        from .plotting import plot_result

        if self.strategy != "smc" or not self.ess:
            raise SMCDecodeError(f"plot draws SMC's effective sample size and particle weights over rounds; a "
                                 f"{self.strategy} result has none (run sd.SMC for them)")
        if path is not None:
            if not isinstance(path, (str, Path)):
                raise SMCDecodeError(f"plot path must be a file name, got {type(path).__name__} {path!r}")
            if not Path(path).parent.is_dir():
                raise SMCDecodeError(f"cannot save the plot to {str(path)!r}: its directory does not exist")

        return plot_result(self, path)
