"""The result of a run: the weighted particle set, the evidence, diagnostics and timing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


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
        return len(self.ess)

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

    def summary(self, max_chars: int = 70) -> str:
        lines = [
            f"strategy {self.strategy}: {self.particles} particle(s), block size {self.block_size}, "
            f"{self.rounds} round(s), {self.seconds:.2f} s, {self.tokens_per_second:.1f} tok/s",
        ]
        if not math.isnan(self.log_evidence):
            lines.append(
                f"log evidence log Z = {self.log_evidence:.4f}; mean ESS {self.mean_ess:.2f}/{self.particles}; "
                f"resampled in {sum(self.resampled)}/{self.rounds} rounds"
            )
        if self.acceptance_rate is not None:
            lines.append(f"draft acceptance {self.acceptance_rate:.3f}")
        if self.message:
            lines.append(self.message)
        lines.append("  #  weight   done  tokens  text")
        order = torch.argsort(self.log_weights, descending=True).tolist()
        for i in order:
            text = self.texts[i].replace("\n", "\\n")
            if len(text) > max_chars:
                text = text[: max_chars - 3] + "..."
            mark = "*" if i == self.sample_index else " "
            lines.append(
                f"{mark}{i:2d}  {float(self.weights[i]):.4f}  {'yes' if self.finished[i] else 'no ':3s}  "
                f"{len(self.tokens[i]):6d}  {text}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def plot(self, path: str | None = None):
        """ESS per round (resampling rounds marked) and the particle weights over rounds."""
        from .plotting import plot_result

        return plot_result(self, path)
