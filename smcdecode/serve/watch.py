"""What a run has made final, seen from the target model's runner; cancelling a run between steps.

The strategies of ``smcdecode.samplers`` feed every generated token to the target's runner
(``extend``), reorder its rows when they resample (``reorder``) and roll it back after a
rejection (``crop``). A :class:`WatchedModel` hands out runners that keep a copy of what was fed,
so a :class:`Watch` can tell which generated tokens can no longer change:

- SMC (``"smc"``): the longest prefix shared by every particle. Tokens are never rejected, only
  reweighted; resampling copies whole particles, so a prefix every particle shares is a prefix of
  every later particle and of the returned sample.
- Autoregressive sampling (``"ar"``): every token fed (it was sampled one step before).
- Exact speculative decoding (``"sd"``): what survives a ``crop`` (the runner is rolled back to
  the accepted context before each verification).

Before each ``extend`` the watch checks whether its request was cancelled (the client went away)
and, if so, raises :class:`Cancelled`, which unwinds the run and frees its caches.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from ..models import HFModel


class Cancelled(Exception):
    """The request was cancelled (its client disconnected): the run stops at its next step."""


class Stopped(Exception):
    """The choice's text is final before the run ended (a stop sequence is in its final text)."""


class Watch:
    """One run's final tokens: ``on_commit(ids)`` gets the generated ids that can no longer change
    (EOS excluded) each time they grow; it returns True when nothing more is needed (then the run
    stops with :class:`Stopped`)."""

    def __init__(self, mode: str, eos_token_id: int, on_commit: Callable[[list[int]], bool],
                 cancelled: threading.Event):
        if mode not in ("smc", "ar", "sd"):
            raise ValueError(f"unknown watch mode {mode!r}")
        self.mode, self.eos, self.on_commit, self.cancelled = mode, eos_token_id, on_commit, cancelled
        self.committed = 0
        self.runners = 0

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled

    def _commit(self, ids: Tensor) -> None:
        # ids: [T] generated tokens that can no longer change
        ids = ids.tolist()
        if self.eos in ids:
            ids = ids[: ids.index(self.eos)]
        if len(ids) > self.committed:
            self.committed = len(ids)
            if self.on_commit(ids):
                raise Stopped

    def fed(self, fed: Tensor) -> None:
        """After an ``extend``: ``fed`` [B, T] is every token fed since the prompt's last one (included)."""
        generated = fed[:, 1:]
        if self.mode == "ar":
            self._commit(generated[0])
        elif self.mode == "smc":
            same = (generated == generated[:1]).all(0)  # [T]
            n = int(same.long().cumprod(0).sum())
            self._commit(generated[0, :n])

    def cropped(self, fed: Tensor) -> None:
        """After a ``crop``: ``fed`` [B, T] is what the runner kept (the accepted context)."""
        if self.mode == "sd":
            self._commit(fed[0, 1:])


class WatchedRunner:
    """A runner that keeps a copy of the tokens fed since the prompt (see the module docstring)."""

    def __init__(self, inner, watch: Watch, base: int, batch: int):
        self.inner, self.watch, self.base = inner, watch, base
        self.tokens = torch.empty(batch, 0, dtype=torch.long)  # [B, fed since the prompt]

    def __getattr__(self, name):  # whatever else a runner offers (e.g. a feature draft's hooks)
        return getattr(self.inner, name)

    @property
    def length(self) -> int:
        return self.inner.length

    def extend(self, tokens: Tensor, *args, **kwargs):
        self.watch.check()
        out = self.inner.extend(tokens, *args, **kwargs)
        self.tokens = torch.cat([self.tokens, tokens.detach().to("cpu", torch.long)], dim=1)
        self.watch.fed(self.tokens)
        return out

    def reorder(self, index: Tensor) -> None:
        self.inner.reorder(index)
        self.tokens = self.tokens[index.cpu()]

    def crop(self, length: int) -> None:
        self.inner.crop(length)
        self.tokens = self.tokens[:, : max(0, length - self.base)]
        self.watch.cropped(self.tokens)


class WatchedModel(HFModel):
    """The server's view of its target model: the same weights and tokenizer, runners watched while
    a :meth:`watching` block is open, and the tokenizer used under one lock (the HTTP side encodes
    prompts while a run decodes text, and a fast tokenizer must not be used from two threads at
    once)."""

    def __init__(self, model: HFModel):
        if not isinstance(model, HFModel):
            raise TypeError(f"WatchedModel wraps an HFModel, got {type(model).__name__}")
        self.__dict__.update(vars(model))  # weights, tokenizer, EOS, context
        self._token_strings = model.token_strings  # (computed once, before any other thread runs)
        self.lock = threading.RLock()
        # NOTE: one run at a time uses this model (the executor's worker thread sets and clears it)
        self._watch: Watch | None = None

    @contextlib.contextmanager
    def watching(self, watch: Watch):
        self._watch = watch
        try:
            yield watch
        finally:
            self._watch = None

    def start(self, prefix_ids: list[int], batch: int):
        runner = super().start(prefix_ids, batch)
        watch = self._watch
        if watch is None:
            return runner
        watch.runners += 1
        return WatchedRunner(runner, watch, len(prefix_ids), batch)

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return super().encode(text)

    def decode(self, ids) -> str:
        with self.lock:
            return super().decode(ids)

    def chat(self, messages) -> list[int]:
        with self.lock:
            return super().chat(messages)

    @property
    def token_strings(self) -> list[str | None]:
        return self._token_strings
