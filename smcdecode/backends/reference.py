"""Reference backend: eager PyTorch, batched over particles.

A *runner* holds the KV state of B sequences (B = groups x particles) that share one prompt and
advance in lockstep, so every row has the same length and no padding is needed. Finished particles
keep being fed (their tokens are ignored by the sampler), which keeps every step's shape fixed.

Runner contract (the GPU engine implements the same four calls):
    extend(tokens [B, L]) -> logits [B, L, V] float32   feed L tokens, logits after each
    reorder(index [B])                                  row i becomes old row index[i] (resampling)
    crop(length)                                        keep the first `length` fed tokens
    length                                              number of tokens fed so far
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import SMCDecodeError


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword under which ``module.forward`` takes its KV cache: ``cache`` where transformers
    names it so (5.24 deprecates ``past_key_values``, to be removed in 5.40), else ``past_key_values``
    (5.17 and earlier)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class HFRunner:
    """Runs a Hugging Face causal LM with a ``DynamicCache`` batched over particles."""

    def __init__(self, model: torch.nn.Module, prefix_ids: list[int], batch: int):
        from transformers import DynamicCache

        self.model = model
        self.batch = batch
        self.device = next(model.parameters()).device
        self.cache = DynamicCache()
        self._cache_kw = cache_keyword(model)
        inner = getattr(model, "model", None)  # the decoder a feature draft's target_hidden runs
        self._inner_cache_kw = cache_keyword(inner) if isinstance(inner, torch.nn.Module) else self._cache_kw
        self.length = 0
        if prefix_ids:
            ids = torch.tensor([prefix_ids], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                self.model(input_ids=ids, **{self._cache_kw: self.cache}, use_cache=True, logits_to_keep=1)
            # NOTE: the prompt is computed once and then repeated for every particle.
            self.cache.batch_repeat_interleave(batch)
            self.length = len(prefix_ids)

    @torch.inference_mode()
    def extend(self, tokens: Tensor, hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        # tokens: [B, L]; with hidden=True also the final hidden states [B, L, D] (after the final
        # norm: what a feature draft reads)
        if hidden:
            h, logits = target_hidden(self.model, tokens.to(self.device), use_cache=True,
                                      **{self._inner_cache_kw: self.cache})
            self.length += tokens.shape[1]
            return logits, h
        out = self.model(input_ids=tokens.to(self.device), **{self._cache_kw: self.cache}, use_cache=True)
        self.length += tokens.shape[1]
        return out.logits.float()

    def reorder(self, index: Tensor) -> None:
        if self.length:
            self.cache.reorder_cache(index.to(self.device))

    def crop(self, length: int) -> None:
        if length < self.length:
            # NOTE: a negative argument means "drop that many tokens" in every transformers version
            self.cache.crop(length - self.length)
            self.length = length


class FunctionRunner:
    """Runs a user callable ``fn(contexts [B, T]) -> next-token logits or log-probs [B, V]``."""

    def __init__(self, fn: Callable[[Tensor], Tensor], prefix_ids: list[int], batch: int, vocab_size: int):
        self.fn = fn
        self.vocab_size = vocab_size
        self.history = torch.tensor(prefix_ids, dtype=torch.long).reshape(1, -1).repeat(batch, 1)

    @property
    def length(self) -> int:
        return self.history.shape[1]

    def extend(self, tokens: Tensor) -> Tensor:
        outs = []
        for i in range(tokens.shape[1]):
            self.history = torch.cat([self.history, tokens[:, i : i + 1].to(self.history.device)], dim=1)
            out = self.fn(self.history)
            try:
                out = torch.as_tensor(out).float()
            except (TypeError, ValueError, RuntimeError):
                raise SMCDecodeError(
                    f"the model function returned {type(out).__name__} {str(out)[:60]!r}: it must return a tensor of "
                    f"next-token logits or log-probabilities [batch, vocab_size]"
                ) from None
            if out.shape != (self.history.shape[0], self.vocab_size):
                raise SMCDecodeError(
                    f"the model function returned shape {tuple(out.shape)} for {self.history.shape[0]} "
                    f"contexts; it must return next-token log-probabilities of shape "
                    f"[batch, vocab_size] = [{self.history.shape[0]}, {self.vocab_size}]"
                )
            # NOTE: NaN, +inf or an all -inf row has no next-token distribution (log_softmax gives NaN)
            bad = torch.isnan(out).any(-1) | torch.isposinf(out).any(-1) | torch.isneginf(out).all(-1)
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise SMCDecodeError(
                    f"the model function returned {out[row].tolist()[:8]} for context {self.history[row].tolist()[-8:]}: "
                    "next-token logits must be finite or -inf, with at least one finite entry per row"
                )
            outs.append(out)
        return torch.stack(outs, dim=1)

    def reorder(self, index: Tensor) -> None:
        self.history = self.history[index.to(self.history.device)]

    def crop(self, length: int) -> None:
        self.history = self.history[:, :length]


def target_hidden(hf: torch.nn.Module, input_ids: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
    """The target's final hidden states (after its final norm) [B, T, D] and logits [B, T, V]."""
    hidden = hf.model(input_ids=input_ids, **kwargs).last_hidden_state
    return hidden, head_logits(hf, hidden)


def head_logits(hf: torch.nn.Module, hidden: Tensor) -> Tensor:
    logits = hf.get_output_embeddings()(hidden)
    cap = getattr(hf.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()
