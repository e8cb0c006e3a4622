"""Autoregressive sampling in a dedicated step loop: one token a step for G requests × S independent
rows, the step captured as one CUDA graph and replayed, the host reading an "all finished" flag every
``Engine.AR_CHECK_EVERY`` steps. ``Engine.autoregressive`` runs the request loop's program instead
(batch.run_autoregressive); this loop stays only as the other side of the GPU A/B of the two
(benchmarks/loop_programs_ab.py), which decides which one is deleted."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from .attention import PagedBatch
from .graphs import ready
from .sampling import sample_and_score


def _run(engine, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0, samples: int = 1,
         use_graphs: bool | None = None, seed: int = 0, batched_prefill: bool = True,
         eos_token_id: int | None = None) -> tuple[Tensor, int]:
    """``Engine.autoregressive``'s arguments and outputs, in the dedicated step loop (run it within
    ``kernels.common.pdl_off()``, as the engine ran it)."""
    if not prompts or any(len(p) < 1 for p in prompts):
        raise SMCDecodeError("prompts must be a non-empty list of non-empty token lists")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise SMCDecodeError(f"samples must be a positive integer, got {samples!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SMCDecodeError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise SMCDecodeError(f"temperature must be a finite number > 0, got {temperature!r}")
    use_graphs = engine.config.use_graphs if use_graphs is None else use_graphs
    torch.manual_seed(seed)
    G, S, dev, PS = len(prompts), samples, engine.device, engine.page_size
    B = G * S
    table, pt_start = engine.start(prompts, S, max_new_tokens + 2, batched_prefill=batched_prefill)
    rows = np.arange(B)
    lens = np.repeat([len(p) - 1 for p in prompts], S)
    copies = table.reserve(rows, lens + max_new_tokens + 1)  # copy-on-write of the shared last page
    cap = table.table.shape[1] * PS
    eos = -1 if eos_token_id is None else int(eos_token_id)
    key = ("ar", B, temperature, eos, table.table.shape[1], use_graphs)
    graph = engine.graphs.get(key)
    if graph is None:
        buf = dict(pt=pt_start.clone(), seq=torch.zeros(B, dtype=torch.long, device=dev),
                   last=torch.zeros(B, dtype=torch.long, device=dev),
                   tokens=torch.zeros(B, cap + 1, dtype=torch.long, device=dev),
                   n_gen=torch.zeros(1, dtype=torch.long, device=dev),
                   finished=torch.zeros(B, dtype=torch.bool, device=dev),
                   done=torch.zeros(1, dtype=torch.bool, device=dev))
        step = _step(engine, buf, temperature, eos)
    else:
        buf, step = graph.buffers, None
    b = buf

    def reset() -> None:
        b["seq"].copy_(torch.as_tensor(lens, device=dev))
        b["last"].copy_(torch.tensor([p[-1] for p in prompts], device=dev).repeat_interleave(S))
        b["n_gen"].zero_()
        b["finished"].zero_()
        b["done"].zero_()

    graph = ready(engine, key, graph, b, step, reset, table, copies, use_graphs)
    pinned = dev.type == "cuda"
    flags = [torch.zeros(1, dtype=torch.bool, pin_memory=pinned) for _ in range(2)]
    events = [torch.cuda.Event() if pinned else None for _ in range(2)]
    steps, every = 0, engine.AR_CHECK_EVERY
    for i in range(max_new_tokens):
        graph.step()
        steps += 1
        if eos < 0 or (i + 1) % every:
            continue
        c = (i + 1) // every
        flags[c % 2].copy_(b["done"], non_blocking=True)
        if pinned:
            events[c % 2].record()
            if c > 1:  # the previous check's flag: its copy has long finished
                events[(c - 1) % 2].synchronize()
                if bool(flags[(c - 1) % 2]):
                    break
        elif bool(flags[c % 2]):
            break
    engine.ar_steps_run = steps  # (diagnostics: steps decoded by the last call)
    tokens = b["tokens"][:, :max_new_tokens].clone()
    if steps < max_new_tokens:
        tokens[:, steps:] = eos
    return tokens, table.peak_used


def _step(engine, b: dict, temperature: float, eos: int = -1):
    """One autoregressive step over the static buffers ``b`` (captured as one graph); with
    ``eos`` >= 0 a finished row emits EOS and ``done`` tells whether every row has finished."""
    seq_t, last, tokens, n_gen, pt, dev, PS = b["seq"], b["last"], b["tokens"], b["n_gen"], b["pt"], \
        engine.device, engine.page_size
    finished = b["finished"]

    def step_() -> None:
        batch = PagedBatch.build(seq_t[:, None], pt, PS)
        seeds = torch.randint(0, 2**62, (1,), device=dev)
        t = sample_and_score(engine.target(last[:, None], engine.kv_t, batch)[:, 0], temperature, seeds[0],
                             triton=engine.config.triton).token
        if eos >= 0:
            t = torch.where(finished, eos, t)
            finished.logical_or_(t == eos)
            b["done"].copy_(finished.all()[None])
        tokens.index_copy_(1, n_gen, t[:, None])
        last.copy_(t)
        seq_t.add_(1)
        n_gen.add_(1)

    return step_
