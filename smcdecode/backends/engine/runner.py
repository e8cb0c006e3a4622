"""The reference runner contract (``backends/reference.py``) over the engine's paged KV cache, so
that the generic loops of ``samplers/`` (SMC-SD, exact speculative decoding, autoregressive
sampling) drive the engine's native Llama unchanged: ``backend="engine-runner"`` in the API.

    extend(tokens [B, L]) -> logits [B, L, V] float32   new keys/values written to fresh or
                                                        copied-on-write pages, paged attention
    reorder(index [B])                                  page-table row copy with reference counts
    crop(length)                                        length rewind (pages past it released)
    length                                              tokens fed so far (every row alike)

The prompt is prefilled once (row 0) and every row's page-table row points at its pages. A row's
partially filled last page is shared after ``reorder`` (and after ``crop`` into shared pages) and
copied only when a row that shares it writes into it (``PageTable.reserve``).

Eager: no CUDA graphs and no fused round; the engine's own ``smc_sd`` / ``speculative`` /
``autoregressive`` are the fast paths. This runner is what lets every program and proposal the
samplers support (proposal="target", host-side rewards, any constraint) run on the engine's models.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import Tensor

from ...models import Model
from .attention import PagedBatch
from .kv_cache import KVPool, PageTable
from .model import Llama

OPTIONS = ("dtype", "device", "page_size")


class EngineRunner:
    """``batch`` rows over one :class:`Llama`, its own KV pool (grown on demand) and page table."""

    def __init__(self, model: Llama, prefix_ids: list[int], batch: int, *, page_size: int = 16,
                 triton: bool | None = None):
        self.model = model
        self.batch = batch
        self.page_size = PS = page_size
        p = next(model.parameters())
        self.device = p.device
        max_pages = -(-model.cfg.max_position // PS) + 1
        num_pages = 1 + -(-len(prefix_ids) // PS) + batch * 4
        self.table = PageTable(batch, max_pages, num_pages, PS)
        self.pool = KVPool.for_model(model.cfg, num_pages, PS, p.dtype, self.device, triton=triton)
        self.rows = np.arange(batch)
        self.length = 0
        if prefix_ids:
            n = len(prefix_ids)
            self._ensure_rope(n)
            self.table.reserve(np.array([0]), np.array([n]))
            self.table.advance(np.array([0]), np.array([n]))
            ids = torch.tensor([prefix_ids], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                self.model(ids, self.pool, self._batch(torch.arange(n, device=self.device)[None], rows=1),
                           last_only=True)
            self.table.share_prefix(list(range(batch)), 0)
            self.length = n

    def _batch(self, positions: Tensor, rows: int | None = None) -> PagedBatch:
        """PagedBatch over the live columns of the page table (every row has the same page count)."""
        cols = int(self.table.n_pages[: rows or self.batch].max())
        pt = torch.from_numpy(np.ascontiguousarray(self.table.table[: rows or self.batch, :cols]))
        return PagedBatch.build(positions, pt.to(self.device), self.page_size)

    def _ensure_rope(self, n: int) -> None:
        cos = self.model.rope_cos
        if cos is None or cos.shape[0] < n:
            self.model.set_rope_cache(max(n, min(self.model.cfg.max_position, 4096)))

    def _ensure_pages(self, new_length: int) -> None:
        """Enough free pages for a reserve up to ``new_length``: at most, every row copies or
        allocates each page from the one holding position ``length`` to its last."""
        PS = self.page_size
        need = self.batch * (-(-new_length // PS) - self.length // PS)
        free = len(self.table.free)
        if need > free:
            extra = max(need - free, len(self.table.ref))  # at least double: amortised growth
            self.table.add_pages(extra)
            self.pool.add_pages(extra)

    @torch.inference_mode()
    def extend(self, tokens: Tensor) -> Tensor:
        # tokens: [B, L]
        B, L = tokens.shape
        if B != self.batch:
            raise ValueError(f"extend got {B} rows, the runner holds {self.batch}")
        new_length = self.length + L
        self._ensure_rope(new_length)
        self._ensure_pages(new_length)
        src, dst = self.table.reserve(self.rows, np.full(self.batch, new_length))
        if src:
            self.pool.copy_pages(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        self.table.advance(self.rows, np.full(self.batch, new_length))
        positions = (self.length + torch.arange(L, device=self.device)).repeat(B, 1)  # (kernels read it densely)
        logits = self.model(tokens.to(self.device), self.pool, self._batch(positions))
        self.length = new_length
        return logits.float()

    def reorder(self, index: Tensor) -> None:
        self.table.fork(index.cpu().numpy().astype(np.int64))

    def crop(self, length: int) -> None:
        if length < self.length:
            self.table.crop(self.rows, np.full(self.batch, length))
            self.length = length


class EngineModel(Model):
    """A :class:`~smcdecode.models.HFModel` whose runners run the engine's :class:`Llama` over a
    paged KV cache; vocabulary, tokenizer and prompts are the wrapped model's."""

    def __init__(self, model: Model, llama: Llama, page_size: int = 16):
        self.base = model
        self.llama = llama
        self.page_size = page_size
        self.name = model.name
        self.vocab_size = model.vocab_size
        self.eos_token_id = model.eos_token_id
        self.max_context = model.max_context

    def start(self, prefix_ids: list[int], batch: int) -> EngineRunner:
        return EngineRunner(self.llama, list(prefix_ids), batch, page_size=self.page_size)

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)

    def decode(self, ids) -> str:
        return self.base.decode(ids)

    def chat(self, messages) -> list[int]:
        return self.base.chat(messages)

    @property
    def token_strings(self) -> list[str | None]:
        return self.base.token_strings


def check_options(options: dict | None) -> dict:
    from .config import check_options as check

    return check(options, OPTIONS, "engine-runner")


def engine_model(model: Model, role: str, options: dict) -> EngineModel:
    """``model`` (an HFModel of the Llama family) with runners on the engine."""
    from .bridge import to_llama

    if isinstance(model, EngineModel):
        return model
    llama = to_llama(model, role, options.get("dtype"), options.get("device"))
    return EngineModel(model, llama, int(options.get("page_size", 16)))


def on_engine(target, options: dict):
    """The target (a Product) with its LM's model replaced by the engine's; other factors kept as
    they are (constraints stay bound to the original model: same vocabulary)."""
    from ...potentials.lm import LM

    lm = target.lm
    moved = LM(engine_model(lm.model, "target", options), lm.temperature, lm.alpha)
    out = copy.copy(target)
    out.factors = [moved if f is lm else f for f in target.factors]
    out.model = moved.model
    return out


def on_engine_proposal(proposal, options: dict):
    """A Draft whose model runs on the engine (None, the target as proposal, stays None)."""
    from ...samplers.proposals import Draft

    if proposal is None:
        return None
    return Draft(engine_model(proposal.model, "draft", options), proposal.temperature)
