"""Plain autoregressive sampling from the locally normalised target.

Each step samples v ∝ p_T(v | h)^α · 1[valid]. With α = 1 and no constraint this is exactly p_T;
with a constraint it is *locally masked* decoding (what greedy constrained decoders do), which is
not the global conditional p(x | x ∈ A) that SMC targets.
"""

from __future__ import annotations

import torch

from ..errors import SMCDecodeError
from . import steps
from .common import Constraints, dead_rows
from .smc_sd import CHUNK, SMCOutput, grow


def autoregressive(
    target, prompt_ids: list[int], *, batch: int, max_new_tokens: int, generator=None, progress=None
) -> SMCOutput:
    lm = target.lm
    model = lm.model
    eos = model.eos_token_id
    B = batch
    runner = model.start(prompt_ids[:-1], B)
    last = torch.full((B, 1), prompt_ids[-1], dtype=torch.long)
    tokens = torch.full((B, min(max_new_tokens, CHUNK)), eos, dtype=torch.long)  # grows with t
    lengths = torch.zeros(B, dtype=torch.long)
    finished = torch.zeros(B, dtype=torch.bool)
    failed = torch.zeros(B, dtype=torch.bool)
    constraints = Constraints.start(target.constraints, B)
    for t in range(max_new_tokens):
        if bool(finished.all()):
            break
        log_p = lm.log_probs(runner.extend(last)[:, -1].cpu()).double()
        mask = constraints.allowed()
        dead = dead_rows(mask)
        active = ~finished
        if dead is not None:
            # NOTE: a sequence at a dead end fails and stops: its draw (from the unmasked target, so
            # the model is only fed tokens it can produce) is not recorded
            failed |= active & dead
            active = active & ~dead
        if bool(torch.isnan(log_p).any()):
            raise SMCDecodeError(
                f"the target model {model.name!r} returned NaN logits at step {t + 1} (a float16 model can "
                "overflow: load it with dtype='float32')"
            )
        v, _ = steps.bonus(log_p, 1.0, lm.alpha, mask, generator=generator)  # v ∝ p^α·1[valid]
        if t >= tokens.shape[1]:
            tokens = grow(tokens, min(max_new_tokens, 2 * tokens.shape[1]), eos)
        tokens[active, t] = v[active]
        lengths[active] += 1
        constraints.states = constraints.advanced(v)
        finished |= failed | (active & (v == eos))
        last = v[:, None]
        if progress is not None:
            progress.update(1)
    if constraints:
        cut = ~finished & (lengths >= max_new_tokens)
        failed |= cut & ~constraints.accepting(B)
    finished[:] = True
    log_w = torch.where(failed, steps.NEG_INF, 0.0).double()
    tokens = tokens[:, : int(lengths.max())]
    return SMCOutput(tokens[None], lengths[None], finished[None], log_w[None], torch.full((1,), float("nan")))
