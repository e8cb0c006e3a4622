"""Plain autoregressive sampling from the locally normalised target.

Each step samples v ∝ p_T(v | h)^α · 1[valid]. With α = 1 and no constraint this is exactly p_T;
with a constraint it is *locally masked* decoding (what greedy constrained decoders do), which is
not the global conditional p(x | x ∈ A) that SMC targets.

It is a program on the request loop (``samplers.loop``): one request of ``batch`` particles with
the target as proposal (K = 0: each round draws the bonus v ∝ p^α·1[valid] and nothing else) and
no resampling (τ = 0), so every row is an independent sequence. What it reports is the sequences:
a row that reached a dead end (no valid token) or was cut in a state its constraints do not accept
has weight 0 (log w = −inf), every other row weight 1; there is no evidence estimate (nan).
"""

from __future__ import annotations

import math

import torch

from . import steps
from .loop import Loop, Request
from .smc_sd import SMCOutput


def autoregressive(
    target, prompt_ids: list[int], *, batch: int, max_new_tokens: int, generator=None, progress=None
) -> SMCOutput:
    loop = Loop()
    loop.submit(Request(prompt_ids, target, None, particles=batch, max_new_tokens=max_new_tokens, ess_threshold=0.0,
                        generator=generator, progress=progress))
    (done,) = loop.run()
    if done.error is not None:
        raise done.error
    out = done.output
    log_w = torch.where(torch.isneginf(out.log_weights), steps.NEG_INF, 0.0).double()
    tokens = out.tokens[:, :, : int(out.lengths.max())]
    return SMCOutput(tokens, out.lengths, torch.ones_like(out.finished), log_w,
                     torch.full((1,), math.nan, dtype=torch.float64))
