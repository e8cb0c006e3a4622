"""What the engine's strategies return."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class EngineOutput:
    tokens: Tensor  # [G, N, max_new_tokens] long, EOS-padded (pad 0 when EOS is ignored)
    lengths: Tensor  # [G, N]
    log_weights: Tensor  # [G, N] float64, since the last resampling (SMC-SD; zeros otherwise)
    log_evidence: Tensor  # [G] float64 (SMC-SD; zeros otherwise)
    ess: list = field(default_factory=list)  # per round, [G] (host; NaN: the request had finished before it)
    resampled: list = field(default_factory=list)  # per round, [G] bool (host)
    rounds: int = 0
    peak_pages: int = 0
    accepted: Tensor | None = None  # [G, N] drafted tokens accepted (speculative decoding)
    drafted: Tensor | None = None  # [G, N] tokens drafted in each row slot while unfinished (work, not lineage)
    host_s: float = 0.0  # host time between rounds (page bookkeeping, uploads, rewards, host masks)
    finished: Tensor | None = None  # [G, N] bool: ended by EOS, budget, or weight 0 (SMC-SD)
    weights: list = field(default_factory=list)  # per round, normalised [G, N] (record_weights=True)
    particles: list | None = None  # N_g per request (rows j >= N_g of request g are padding)
    block_sizes: list = field(default_factory=list)  # per round, [G] K_row of each request (SMC-SD, general round)
    survivors: list = field(default_factory=list)  # per round, [G] distinct ancestors kept (general round)
