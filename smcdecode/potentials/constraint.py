"""Prefix-checkable constraints Ψ(x) = 1[x ∈ A] with a vectorised, forkable state.

The tensor path used by the samplers, for a batch of B particles:

    start(B)              -> state        initial state (tensor with leading dim B, or any
                                          object ``fork`` can index)
    allowed(state)        -> bool [B, V]  tokens that keep the prefix viable; EOS iff x ∈ A
    allowed_bits(state)   -> int32 [B, ⌈V/32⌉]  the same set packed: bit v % 32 of word v // 32
                                          (what the engine uploads; ``unpack_bits`` inverts it)
    advance(state, v [B]) -> state        state after appending token v
    accepting(state)      -> bool [B]     is the prefix itself in A (for sequences cut at
                                          max_new_tokens)
    fork(state, index)    -> state        rows ``index`` (resampling: a gather)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import SMCDecodeError, check_finite_float
from .base import Potential


class TokenConstraint(Potential):
    """Base for constraints with a tensor path. Subclasses implement the five state methods."""

    role = "constraint"

    def start(self, batch: int):
        raise NotImplementedError  # abstract

    def allowed(self, state) -> Tensor:
        raise NotImplementedError  # abstract

    def allowed_bits(self, state) -> Tensor:
        """``allowed(state)`` packed 32 tokens to an int32 word (llguidance's bitmask layout)."""
        return pack_bits(self.allowed(state))

    def advance(self, state, tokens: Tensor):
        raise NotImplementedError  # abstract

    def accepting(self, state) -> Tensor:
        raise NotImplementedError  # abstract

    def fork(self, state, index: Tensor):
        return state[index.to(state.device)]

    def bind(self, model) -> TokenConstraint:
        """A copy of this constraint over ``model``'s vocabulary (``self`` is left as it was):
        ``self.model`` is the model in the copy, which is what ``allowed`` and the scoring methods
        read. Subclasses that compile per vocabulary (Regex, Grammar) override this."""
        from ..models import Model

        if self.model is model:
            return self
        if not isinstance(model, Model):
            raise SMCDecodeError(
                f"bind needs a smcdecode Model (load_model(...) or FunctionModel(...)), got {type(model).__name__}"
            )
        bound = copy.copy(self)
        bound.model = model
        return bound

    def __pow__(self, alpha: float) -> TokenConstraint:
        a = check_finite_float("constraint power", alpha)
        if not a > 0:
            raise SMCDecodeError(f"a constraint can only be raised to a power > 0, got {alpha!r}")
        return self  # 1[x ∈ A]^α = 1[x ∈ A]

    def _state_of(self, tokens: Sequence[int]):
        model = self._require_model()
        state = self.start(1)
        for t in tokens:
            if not bool(self.allowed(state)[0, t]):
                return None
            if t == model.eos_token_id:
                raise SMCDecodeError("tokens passed to a potential must not contain EOS: use complete()")
            state = self.advance(state, torch.tensor([t]))
        return state

    def prefix(self, tokens, prompt=()):
        return 0.0 if self._state_of(tokens) is not None else float("-inf")

    def complete(self, tokens, prompt=()):
        state = self._state_of(tokens)
        return 0.0 if state is not None and bool(self.accepting(state)[0]) else float("-inf")

    def logw_next(self, tokens, prompt=()):
        state = self._state_of(tokens)
        V = self._require_model().vocab_size
        if state is None:
            return torch.full((V,), float("-inf"), dtype=torch.float64)
        return torch.where(self.allowed(state)[0], 0.0, float("-inf")).double()


# -- packed token sets: bit v % 32 of word v // 32 (little-endian within a word, as llguidance) --


def pack_bits(mask: Tensor) -> Tensor:
    """bool [B, V] -> int32 [B, ⌈V/32⌉] (bits past V are 0)."""
    B, V = mask.shape
    W = (V + 31) // 32
    padded = torch.zeros(B, W * 32, dtype=torch.int64, device=mask.device)
    padded[:, :V] = mask
    words = (padded.view(B, W, 32) << torch.arange(32, device=mask.device)).sum(-1)  # [B, W] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def no_bit_set(bits: Tensor, vocab_size: int) -> Tensor:
    """int32 [B, W] -> bool [B]: the rows that allow no token (the bits past ``vocab_size`` in the
    last word left out), without unpacking."""
    tail = vocab_size % 32
    if not tail:
        return ~(bits != 0).any(-1)
    last = bits[:, -1] & ((1 << tail) - 1)
    return ~((bits[:, :-1] != 0).any(-1) | (last != 0))


def unpack_bits(bits: Tensor, vocab_size: int) -> Tensor:
    """int32 [B, W] -> bool [B, vocab_size] on the device of ``bits`` (a few element-wise ops)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    # [B, W, 32] -> [B, 32·W] -> [B, V]
    return ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab_size].bool()
