"""Plain autoregressive sampling from the locally normalised target.

Each step samples v ∝ p_T(v | h)^α · 1[valid]. With α = 1 and no constraint this is exactly p_T;
with a constraint it is *locally masked* decoding (what greedy constrained decoders do), which is
not the global conditional p(x | x ∈ A) that SMC targets.
"""

from __future__ import annotations

import torch

from .common import NEG_INF, Constraints, gumbel_argmax
from .smc_sd import SMCOutput


def autoregressive(
    target, prompt_ids: list[int], *, batch: int, max_new_tokens: int, generator=None, progress=None
) -> SMCOutput:
    lm = target.lm
    model = lm.model
    eos = model.eos_token_id
    B = batch
    runner = model.start(prompt_ids[:-1], B)
    last = torch.full((B, 1), prompt_ids[-1], dtype=torch.long)
    tokens = torch.full((B, max_new_tokens), eos, dtype=torch.long)
    lengths = torch.zeros(B, dtype=torch.long)
    finished = torch.zeros(B, dtype=torch.bool)
    failed = torch.zeros(B, dtype=torch.bool)
    constraints = Constraints.start(target.constraints, B)
    for t in range(max_new_tokens):
        if bool(finished.all()):
            break
        lw = lm.alpha * lm.log_probs(runner.extend(last)[:, -1].cpu()).double()
        mask = constraints.allowed()
        if mask is not None:
            lw = lw.masked_fill(~mask, NEG_INF)
            failed |= ~finished & ~mask.any(-1)
        v = gumbel_argmax(lw, generator)
        active = ~finished
        tokens[active, t] = v[active]
        lengths[active] += 1
        constraints.states = constraints.advanced(v)
        finished |= active & ((v == eos) | failed)
        last = v[:, None]
        if progress is not None:
            progress.update(1)
    if constraints:
        cut = ~finished & (lengths >= max_new_tokens)
        failed |= cut & ~constraints.accepting(B)
    finished[:] = True
    log_w = torch.where(failed, NEG_INF, 0.0).double()
    return SMCOutput(tokens[None], lengths[None], finished[None], log_w[None], torch.full((1,), float("nan")))
