"""Drawing tokens on the engine: ``samplers.steps.sample_and_score`` (the exponential race with the
log-probabilities and the bonus normaliser a round needs), dispatched to the fused Triton kernel
(kernels/sampling.py, one read of the logits) or to the torch function itself. The two are the same
function: tests check them draw for draw under the same noise bits."""

from __future__ import annotations

from torch import Tensor

from ...potentials.constraint import unpack_bits
from ...samplers.steps import Scored
from ...samplers.steps import sample_and_score as sample_and_score_torch


def sample_and_score(logits: Tensor, temperature: float | Tensor, seed: Tensor, gather: Tensor | None = None,
                     sample_every: int = 1, triton: bool = False, *, alpha: Tensor | None = None,
                     mask: Tensor | None = None, draw: bool = True, dead: Tensor | None = None,
                     mask_bits: Tensor | None = None) -> Scored:
    """``samplers.steps.sample_and_score`` of ``logits`` [R, V]: with ``triton`` the fused kernel (noise
    keyed by the device scalar ``seed``), else the torch function (torch's global generator).
    ``dead`` [R] bool: the rows whose ``mask`` allows nothing, when the caller knows them (the
    kernel then need not reduce the mask to find them). ``mask_bits``: the mask packed instead
    (int32 [R, ⌈V/32⌉], a bit a token: the host's masks as uploaded), which the kernel reads as it is."""
    if mask is not None and mask_bits is not None:
        raise ValueError("give the mask as mask (bool [R, V]) or as mask_bits (packed int32), not both")
    if triton:
        from .kernels.sampling import triton_sample_and_score

        return triton_sample_and_score(logits, temperature, seed, gather, sample_every, alpha=alpha, mask=mask,
                                       draw=draw, dead=dead, mask_bits=mask_bits)
    if mask_bits is not None:
        mask = unpack_bits(mask_bits, logits.shape[-1])
    return sample_and_score_torch(logits, temperature, alpha=alpha, mask=mask, gather=gather,
                                  sample_every=sample_every, draw=draw)
