"""The distillation recipe (:class:`DistillConfig`) and the progress bar its steps share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import SMCDecodeError


@dataclass
class DistillConfig:
    """The recipe. ``steps`` optimiser steps of ``batch_size`` sequences; with ``time_budget_s``
    training also stops when that much time has passed, and the learning-rate schedule runs on
    progress = max(step / steps, elapsed / time_budget_s). With ``eval_every`` > 0,
    ``validation_prompts`` training prompts are set aside (one target sample each), the validation
    KL is measured every ``eval_every`` steps, and the draft with the lowest one is kept: a small
    corpus is memorised quickly (train KL falls while held-out KL rises)."""

    layers: int = 4
    init_layers: list[int] | None = None
    kind: str = "layers"
    unroll: int = 4
    feature_from: str | None = None
    temperatures: list[float] = field(default_factory=lambda: [0.7])
    samples_per_prompt: int = 4
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256
    holdout: int = 200
    steps: int = 2000
    time_budget_s: float | None = None
    batch_size: int = 32
    lr: float = 3e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200
    generation_batch_size: int = 256
    weights: str = "int8"
    eval_every: int = 0
    validation_prompts: int = 64
    generation_time_budget_s: float | None = None
    generator: str = "hf"
    on_policy: float = 0.0
    self_prompts: int = 0
    self_prompt_temperature: float = 1.0

    def check(self) -> None:
        for name in ("layers", "unroll", "samples_per_prompt", "max_prompt_tokens", "max_new_tokens", "steps", "batch_size",
                     "checkpoint_every", "generation_batch_size", "validation_prompts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SMCDecodeError(f"{name} must be a positive integer, got {v!r}")
        if not self.temperatures or any(not (t > 0 and math.isfinite(t)) for t in self.temperatures):
            raise SMCDecodeError(f"temperatures must be finite numbers > 0, got {self.temperatures!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SMCDecodeError(f"lr must be a finite number > 0, got {self.lr!r}")
        if self.holdout < 0:
            raise SMCDecodeError(f"holdout must be >= 0, got {self.holdout!r}")
        if self.kind not in ("layers", "feature"):
            raise SMCDecodeError(f"kind must be 'layers' (decoder layers over tokens) or 'feature' (reads the "
                                 f"target's hidden state, EAGLE-style), got {self.kind!r}")
        if self.feature_from is not None and self.kind != "feature":
            raise SMCDecodeError(f"feature_from ({self.feature_from!r}) initialises a feature draft: pass kind='feature'")
        if self.kind == "feature" and self.on_policy:
            raise SMCDecodeError("on_policy sampling needs a draft that generates on its own; a feature draft reads "
                                 "the target's hidden states: use on_policy=0 with kind='feature'")
        if self.generator not in ("hf", "engine"):
            raise SMCDecodeError(f"generator must be 'hf' or 'engine', got {self.generator!r}")
        if isinstance(self.self_prompts, bool) or not isinstance(self.self_prompts, int) or self.self_prompts < 0:
            raise SMCDecodeError(f"self_prompts must be a count >= 0 (user messages the target writes, as extra "
                                 f"training prompts), got {self.self_prompts!r}")
        if not (isinstance(self.self_prompt_temperature, (int, float)) and self.self_prompt_temperature > 0):
            raise SMCDecodeError(f"self_prompt_temperature must be > 0, got {self.self_prompt_temperature!r}")
        if isinstance(self.on_policy, bool) or not (isinstance(self.on_policy, (int, float)) and 0 <= self.on_policy <= 1):
            raise SMCDecodeError(f"on_policy must be a fraction in [0, 1] (the share of training answers the "
                                 f"draft samples), got {self.on_policy!r}")
        if self.eval_every < 0:
            raise SMCDecodeError(f"eval_every must be >= 0 (0: no validation), got {self.eval_every!r}")
        for name in ("time_budget_s", "generation_time_budget_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise SMCDecodeError(f"{name} must be > 0 seconds, got {v!r}")

    # fields that change what is trained; a checkpoint made with other values is not resumed
    # (steps and time_budget_s may change: run again with more steps to train longer)
    TRAINING_FIELDS = ("layers", "init_layers", "kind", "unroll", "feature_from", "temperatures", "batch_size", "lr", "warmup_steps",
                       "min_lr_ratio", "grad_clip", "seed")
    # what a checkpoint written before a field existed had
    FIELD_DEFAULTS = {"kind": "layers", "unroll": 4, "feature_from": None}


def progress_bar(enabled: bool, total: int, desc: str, unit: str, initial: int = 0):
    """A tqdm bar, or None when ``enabled`` is false (callers log instead)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True)
