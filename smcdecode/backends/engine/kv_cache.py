"""Paged KV memory: device page pools and a host-side, reference-counted page table.

The particles of a request share pages: the prompt is written once and every particle's page-table
row points at the same prompt pages. Resampling (``fork``) copies page-table rows — a pointer
exchange with reference counts — and the partially filled last page of a row is copied only when a
row that shares it is about to write into it (copy-on-write, ``reserve``). The draft and the target
each have their own pool (their own layer count and head shape); both use one page table, so a page
id names a page in both pools.

NOTE: the page table lives on the host (numpy). The generic paths upload it to a static device tensor
before each CUDA-graph replay, after the round's one host sync. The pipelined SMC-SD rounds apply their
own fork, copy-on-write and fresh pages on the device, at the end of their graph (``smc.pages_code``),
from pages the host set aside for it in advance (``PageTable.hold``), and the host repeats the same
bookkeeping here one round later (``reserve(..., held=...)``, the same page ids): rounds are launched
back to back, without waiting for the host.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class KVPool:
    """The keys and values of all layers of one model: ``kv [n_layers, 2, num_pages, Hkv, PS, D]``."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                 dtype=torch.bfloat16, device="cuda", triton: bool | None = None):
        """``triton``: whether forwards over this pool (and its page copies) run the Triton kernels;
        None: ``config.default_triton(device)`` (on CUDA)."""
        from .config import default_triton

        self.kv = torch.zeros(n_layers, 2, num_pages, n_kv_heads, page_size, head_dim, dtype=dtype, device=device)
        self.page_size = page_size
        self.triton = default_triton(device) if triton is None else bool(triton)

    @classmethod
    def for_model(cls, cfg, num_pages: int, page_size: int, dtype=torch.bfloat16, device="cuda", **kw) -> KVPool:
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_pages, page_size, dtype, device, **kw)

    def k(self, layer: int) -> Tensor:
        return self.kv[layer, 0]

    def v(self, layer: int) -> Tensor:
        return self.kv[layer, 1]

    def write(self, layer: int, k: Tensor, v: Tensor, pages: Tensor, offsets: Tensor) -> None:
        # k, v: [B, L, Hkv, D]; pages/offsets: [B*L]. NOTE: (page, offset) pairs must be distinct.
        Hkv, D = k.shape[-2:]
        self.kv[layer, 0][pages, :, offsets] = k.reshape(-1, Hkv, D)
        self.kv[layer, 1][pages, :, offsets] = v.reshape(-1, Hkv, D)

    def copy_pages(self, src: Tensor, dst: Tensor) -> None:
        """kv[..., dst, ...] = kv[..., src, ...] for every layer (copy-on-write; dst not in src, and a
        page named twice in dst gets the same source page each time). Entries with dst == 0 (the
        null page) or dst == src copy nothing, so a caller with a fixed number of entries (the fused
        round: one a row) pads with zeros. With Triton one launch
        (``kernels.triton_copy_pages``); elsewhere, and the reference, a gather and a scatter of
        whole pages over a [layers·2, pages, page elements] view (a page of one layer's keys, or
        values, is contiguous)."""
        if self.triton:
            from .kernels.pages import triton_copy_pages

            triton_copy_pages(self.kv, src, dst)
            return
        L, two, P = self.kv.shape[:3]
        flat = self.kv.view(L * two, P, -1)
        src = torch.where((dst != 0) & (dst != src), src, dst)  # skipped entries copy a page onto itself
        flat.index_copy_(1, dst, flat.index_select(1, src))

    def add_pages(self, n: int) -> None:
        """Grow the pool by ``n`` pages (ids after the current ones; stored pages keep their ids).
        NOTE: reallocates ``kv``; not for pools that a captured CUDA graph reads."""
        L, two, P, Hkv, PS, D = self.kv.shape
        grown = self.kv.new_zeros(L, two, P + n, Hkv, PS, D)
        grown[:, :, :P] = self.kv
        self.kv = grown

    @property
    def bytes_per_page(self) -> int:
        n_layers, two, _, Hkv, PS, D = self.kv.shape
        return n_layers * two * Hkv * PS * D * self.kv.element_size()


class PageTable:
    """Reference-counted pages of ``rows`` sequences over a pool of ``num_pages`` pages.

    ``table [rows, max_pages]`` holds page ids (unused entries point at page 0, which is never
    handed out: a harmless target for masked reads). ``n_pages[r]`` entries of row r are live and
    ``lengths[r]`` tokens are stored."""

    def __init__(self, rows: int, max_pages: int, num_pages: int, page_size: int):
        self.page_size = page_size
        self.table = np.zeros((rows, max_pages), dtype=np.int32)
        self.n_pages = np.zeros(rows, dtype=np.int64)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.ref = np.zeros(num_pages, dtype=np.int64)
        self.ref[0] = 1 << 40  # page 0: the null page
        self.free = list(range(num_pages - 1, 0, -1))
        self.peak_used = 0

    @property
    def used(self) -> int:
        return int((self.ref[1:] > 0).sum())

    def _alloc(self, n: int) -> np.ndarray:
        if n > len(self.free):
            raise MemoryError(f"KV pool exhausted: need {n} more pages, {len(self.free)} free; "
                              f"allocate more pages (num_pages) or run fewer particles")
        pages = np.array(self.free[len(self.free) - n :][::-1], dtype=np.int64)
        del self.free[len(self.free) - n :]
        self.ref[pages] = 1
        return pages

    def hold(self, n: int) -> np.ndarray:
        """Take ``n`` free pages off the free list without referencing them: set aside for
        bookkeeping that the device does first (a pipelined SMC-SD round) and ``reserve(held=...)``
        books later; ``unhold`` returns the ones that were not used. MemoryError if too few are free."""
        pages = self._alloc(n)
        self.ref[pages] = 0
        return pages

    def set_aside(self, rows: np.ndarray, T: np.ndarray, k: int, done: np.ndarray, F: int) -> np.ndarray | None:
        """Hold the pages ``rows`` (at positions ``T``) need for a round of k + 1 tokens after the one
        in flight: [all rows, F] page ids, row i's copy-on-write page, then the pages of the columns it
        opens (0 = none; none for the rows ``done``); None when too few pages are free."""
        PS = self.page_size
        demand = 1 + (-(-(T + k + 1) // PS)) + (T // -PS)  # a copy + the columns it opens
        demand[done] = 0
        try:
            pages = self.hold(int(demand.sum())) if demand.any() else np.zeros(0, dtype=np.int64)
        except MemoryError:
            return None
        part = np.zeros((len(rows), F), dtype=np.int64)
        part[np.arange(F)[None] < demand[:, None]] = pages
        fresh = np.zeros((self.table.shape[0], F), dtype=np.int64)
        fresh[rows] = part
        return fresh

    def unhold(self, pages: np.ndarray) -> None:
        """Pages of ``hold`` that were not used go back to the free list."""
        pages = np.asarray(pages, dtype=np.int64)
        pages = pages[pages != 0]
        if (self.ref[pages] != 0).any():
            raise ValueError(f"unhold: pages {pages[self.ref[pages] != 0].tolist()} are in use")
        self.free.extend(pages.tolist())

    def _release(self, pages: np.ndarray) -> None:
        np.subtract.at(self.ref, pages, 1)
        dead = np.unique(pages[self.ref[pages] == 0])
        self.free.extend(dead.tolist())

    def add_pages(self, n: int) -> None:
        """``n`` more free pages (ids after the current ones; see ``KVPool.add_pages``)."""
        old = len(self.ref)
        self.ref = np.concatenate([self.ref, np.zeros(n, dtype=self.ref.dtype)])
        self.free[:0] = range(old + n - 1, old - 1, -1)  # handed out after the pages free now

    def share_prefix(self, rows: list[int], src_row: int) -> None:
        """Rows become copies of ``src_row`` (prompt sharing): their page entries point at its pages."""
        n = int(self.n_pages[src_row])
        pages = self.table[src_row, :n]
        for r in rows:
            if r == src_row:
                continue
            self._release(self.table[r, : self.n_pages[r]])
            self.table[r, :n] = pages
            self.table[r, n:] = 0
            self.ref[pages] += 1
            self.n_pages[r] = n
            self.lengths[r] = self.lengths[src_row]

    def reserve(self, rows: np.ndarray, new_lengths: np.ndarray, write_from: np.ndarray | None = None,
                held: np.ndarray | None = None) -> tuple[list[int], list[int]]:
        """Make positions [write_from, new_lengths) of ``rows`` (distinct) writable (write_from
        defaults to the stored length): copy-on-write of every allocated page in that range that
        other rows share (the partially filled last page, in practice), fresh pages after it.
        Returns the (src, dst) page copies to perform on the device pools before the write.
        Vectorised (numpy); same result as visiting rows in order and copying a page while its
        count exceeds 1.

        ``held`` [len(rows), F] (pages of ``hold``, 0 = none): row i's copy goes to held[i, 0] and its
        new columns take held[i, 1:] in order, as a pipelined round's device bookkeeping placed them
        (``smc.pages_code``); the held pages not used go back to the free list. A row with more
        than one page to copy, or with fewer held pages than it needs, is an error."""
        PS = self.page_size
        rows = np.asarray(rows, dtype=np.int64)
        new_lengths = np.asarray(new_lengths, dtype=np.int64)
        start = self.lengths[rows] if write_from is None else np.asarray(write_from, dtype=np.int64)
        n = self.n_pages[rows]
        need_pages = -(-new_lengths // PS)
        cols = np.arange(self.table.shape[1])[None, :]
        hit = (cols >= (start // PS)[:, None]) & (cols < np.minimum(n, need_pages)[:, None])
        rr, cc = np.nonzero(hit)  # row-major: the order a loop over rows would visit them
        src: list[int] = []
        dst: list[int] = []
        if held is not None:
            held = np.array(held, dtype=np.int64)  # (our copy: used entries are zeroed below)
        if len(rr):
            r_abs = rows[rr]
            pages = self.table[r_abs, cc].astype(np.int64)
            order = np.argsort(pages, kind="stable")
            sp = pages[order]
            first = np.r_[True, sp[1:] != sp[:-1]]
            rank = np.arange(len(sp)) - np.maximum.accumulate(np.where(first, np.arange(len(sp)), 0))
            copy = np.empty(len(sp), dtype=bool)
            copy[order] = self.ref[sp] - rank > 1  # the i-th writer sees count − i
            if copy.any():
                old = pages[copy]
                if held is None:
                    fresh = self._alloc(len(old))
                else:
                    who = rr[copy]
                    if len(np.unique(who)) < len(who) or (held[who, 0] == 0).any():
                        raise ValueError("reserve(held=...): a row has more than one page to copy, or no held page "
                                         "for its copy")
                    fresh = held[who, 0]
                    held[who, 0] = 0  # used
                    self.ref[fresh] = 1
                np.subtract.at(self.ref, old, 1)
                self.table[r_abs[copy], cc[copy]] = fresh
                src, dst = old.tolist(), fresh.tolist()
        grow = need_pages - n
        if (grow > 0).any():
            if (need_pages > self.table.shape[1]).any():
                r = int(rows[np.argmax(need_pages)])
                raise MemoryError(f"row {r} needs {int(need_pages.max())} pages, the page table holds "
                                  f"{self.table.shape[1]}")
            new = (cols >= n[:, None]) & (cols < need_pages[:, None])
            ri, ci = np.nonzero(new)
            if held is None:
                self.table[rows[ri], ci] = self._alloc(len(ri))
            else:
                j = ci - n[ri] + 1
                if (j >= held.shape[1]).any() or (held[ri, np.minimum(j, held.shape[1] - 1)] == 0).any():
                    raise ValueError("reserve(held=...): a row needs more new pages than it was given")
                fresh = held[ri, j]
                self.ref[fresh] = 1
                self.table[rows[ri], ci] = fresh
                held[ri, j] = 0
            self.n_pages[rows] = np.maximum(n, need_pages)
        if held is not None:
            self.unhold(held.reshape(-1))
        self.peak_used = max(self.peak_used, self.used)
        return src, dst

    def advance(self, rows: np.ndarray, new_lengths: np.ndarray) -> None:
        self.lengths[rows] = new_lengths

    def fork(self, index: np.ndarray) -> None:
        """Row i becomes a copy of old row ``index[i]`` (resampling): shared pages, counts adjusted."""
        index = np.asarray(index)
        if np.array_equal(index, np.arange(len(index))):
            return
        cols = np.arange(self.table.shape[1])[None, :]
        old_live = self.table[cols < self.n_pages[:, None]]
        table, n_pages, lengths = self.table[index], self.n_pages[index], self.lengths[index]
        new_live = table[cols < n_pages[:, None]]
        np.add.at(self.ref, new_live, 1)
        self._release(old_live)
        self.table, self.n_pages, self.lengths = table, n_pages, lengths

    def crop(self, rows: np.ndarray, new_lengths: np.ndarray) -> None:
        """Keep the first ``new_lengths`` tokens of each row (speculative-decoding rollback)."""
        PS = self.page_size
        for r, new_len in zip(rows.tolist(), new_lengths.tolist()):
            keep = -(-new_len // PS)
            n = int(self.n_pages[r])
            if keep < n:
                self._release(self.table[r, keep:n].copy())
                self.table[r, keep:n] = 0
                self.n_pages[r] = keep
            self.lengths[r] = min(int(self.lengths[r]), new_len)

    def free_rows(self, rows: np.ndarray) -> None:
        self.crop(rows, np.zeros(len(rows), dtype=np.int64))
