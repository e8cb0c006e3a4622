"""Captured CUDA graphs of the engine's rounds: one per round shape, replayed by later calls through
the same static buffers (as serving engines do)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Graph:
    """Static buffers of one captured round and its replay (reused across calls of one shape)."""

    buffers: dict
    step: object
    fn: object = None  # the captured closure: keeps every tensor it references alive with the graph


class GraphCache:
    """The rounds an Engine captured, keyed by (round key, config): a round key names the round's
    shape (strategy, rows, K, temperatures, page-table width, ...), and the engine's
    ``EngineConfig`` is part of every key, so a graph never replays under other settings. An entry is
    a ``Graph`` (the speculative and autoregressive rounds) or the request loop's rounds."""

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
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.set_rng_state(rng)
        return graph.replay

    def capture_parts(self, steps, warm_up) -> list:
        """The CUDA graphs of the parts of the generator function ``steps`` between its yields:
        [(replay, the event it yielded after that part, or None for the last)]. Runs ``steps`` once
        first, on a side stream, with ``warm_up(event)`` at each yield (as ``capture``: the caller
        undoes its effects on its buffers; the random stream is left where it was). A tensor one part
        writes and a later one reads lives in the first part's private pool, which no other
        allocation uses while that graph lives, so its address holds for the replays."""
        rng = torch.cuda.get_rng_state()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for event in steps():
                warm_up(event)
        torch.cuda.current_stream().wait_stream(stream)
        parts, running, event = [], steps(), None
        while True:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                event = next(running, None)
            parts.append((graph.replay, event))
            if event is None:
                break
        torch.cuda.set_rng_state(rng)
        return parts


def ready(engine, key: tuple, graph: Graph | None, buffers: dict, step, reset, table, copies,
          use_graphs: bool) -> Graph:
    """Upload the page table, reset the buffers for this call, and capture ``step`` the first time
    ``key`` is seen (cached when graphs are on; the capture's warm-up run advances the state, so the
    buffers are reset again)."""
    engine.upload(table, buffers["pt"], copies)
    reset()
    if graph is None:
        graph = Graph(buffers, engine.graphs.capture(step, use_graphs), step)
        if use_graphs:
            engine.graphs.put(key, graph)
            buffers["pt"].copy_(torch.from_numpy(table.table))  # NOTE: device page bookkeeping rewrote it
            reset()
    return graph
