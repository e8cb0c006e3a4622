"""Drawing tokens on the engine: ``samplers.steps.sample_and_score`` (the exponential race with the
log-probabilities and the bonus normaliser a round needs), dispatched to the fused Triton kernel
(kernels/sampling.py, one read of the logits) or to the torch function itself. The two are the same
function: tests check them draw for draw under the same noise bits."""

from __future__ import annotations

import torch
from torch import Tensor

from ...potentials.constraint import unpack_bits
from ...samplers.steps import Scored
from ...samplers.steps import sample_and_score as sample_and_score_torch


def sample_and_score(logits: Tensor, temperature: float | Tensor, seed: Tensor, gather: Tensor | None = None,
                     sample_every: int = 1, triton: bool = False, *, alpha: Tensor | None = None,
                     mask: Tensor | None = None, draw: bool = True, dead: Tensor | None = None,
                     mask_bits: Tensor | None = None, unmasked_out: Tensor | None = None) -> Scored:
    """``samplers.steps.sample_and_score`` of ``logits`` [R, V]: with ``triton`` the fused kernel (noise
    keyed by the device scalar ``seed``), else the torch function (torch's global generator).
    ``dead`` [R] bool: the rows whose ``mask`` allows nothing, when the caller knows them (the
    kernel then need not reduce the mask to find them). ``mask_bits``: the mask packed instead
    (int32 [R, ⌈V/32⌉], a bit a token: the host's masks as uploaded), which the kernel reads as it is.
    ``unmasked_out`` ([R] float32, any stride; with ``mask`` or ``mask_bits``): written with
    log π(token) + the normaliser, which for α = 1 is the token's log-probability without the mask
    (a draft's log q(d)), and 0 on a row the mask leaves no token; rows that do not draw
    (``sample_every``, ``draw``) are left as they are by the kernel."""
    if mask is not None and mask_bits is not None:
        raise ValueError("give the mask as mask (bool [R, V]) or as mask_bits (packed int32), not both")
    if unmasked_out is not None and mask is None and mask_bits is None:
        raise ValueError("unmasked_out needs a mask (mask or mask_bits): without one it is log π(token) itself")
    if triton:
        from .kernels.sampling import triton_sample_and_score

        return triton_sample_and_score(logits, temperature, seed, gather, sample_every, alpha=alpha, mask=mask,
                                       draw=draw, dead=dead, mask_bits=mask_bits, unmasked_out=unmasked_out)
    if mask_bits is not None:
        mask = unpack_bits(mask_bits, logits.shape[-1])
    scored = sample_and_score_torch(logits, temperature, alpha=alpha, mask=mask, gather=gather,
                                    sample_every=sample_every, draw=draw)
    if unmasked_out is not None:
        norm = scored.log_norm
        unmasked_out.copy_(torch.where(torch.isfinite(norm), scored.log_prob + norm, 0.0))
    return scored
