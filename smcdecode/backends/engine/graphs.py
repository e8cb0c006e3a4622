"""Captured CUDA graphs of the engine's rounds: one per round shape, replayed by later calls through
the same static buffers (as serving engines do)."""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def no_collection():
    """No garbage collection inside (this process's): where a CUDA call that an object's finalizer
    makes would abort a capture, or wait for a device that waits for this host."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class GraphCache:
    """The rounds an Engine captured, keyed by (round key, config): a round key names the round's
    shape (strategy, rows, K, temperatures, page-table width, ...), and the engine's
    ``EngineConfig`` is part of every key, so a graph never replays under other settings. An entry is
    the request loop's rounds of one scheduler shape."""

    def __init__(self, config):
        self.config = config
        self._entries: dict = {}

    def get(self, key: tuple):
        return self._entries.get((key, self.config))

    def put(self, key: tuple, graph) -> None:
        self._entries[(key, self.config)] = graph

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self):
        """The (round key, config) pairs held."""
        return self._entries.keys()

    def __getitem__(self, full_key: tuple):
        return self._entries[full_key]

    def capture(self, fn, use_graphs: bool):
        """``fn``'s CUDA graph replay (``use_graphs``), or ``fn`` itself. ``fn`` runs once first, on a
        side stream (Triton compilation, cuBLAS handles): the caller undoes its effects on its buffers;
        the random stream is left where it was (a seeded call draws the same whether its rounds were
        captured in it or before, and its replays draw what the eager rounds would)."""
        if not use_graphs:
            return fn
        rng = torch.cuda.get_rng_state()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: each graph gets its own memory pool (a shared graph_pool_handle tripped an allocator
        # assertion in torch 2.11); the pool is freed with the graph (clear_graphs).
        # NOTE: no garbage collection while capturing: an object freed then (another engine's graph
        # and its memory pool, a pinned buffer) makes CUDA calls a capture forbids, which abort the
        # process (torch.cuda.graph collects once before the capture begins)
        with no_collection(), torch.cuda.graph(graph):
            fn()
        torch.cuda.set_rng_state(rng)
        return graph.replay
