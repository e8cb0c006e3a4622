"""One call of many requests on the request loop: every request submitted at once to a
:class:`~smcdecode.backends.engine.scheduler.Scheduler` sized for them, the finished requests
gathered into one output. SMC-SD (``Engine.smc_sd``: ``run_batch``), autoregressive sampling
(``Engine.autoregressive``: ``run_autoregressive``) and exact speculative decoding
(``run_speculative``), the last two in the exact-only round of exact.py."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from .output import EngineOutput
from .scheduler import Request, Scheduler
from .smc import NEG_INF
from .targets import EngineTarget, Settings


def page_bounds(prompts: list[list[int]], N: int, K: int, max_new_tokens: int, page_size: int) -> tuple[int, int]:
    """(pages the first round of SMC-SD needs, pages it needs at most over the whole output) for
    ``prompts`` with N particles and K drafts each, the null page included.

    Columns of a row before the page of its first write (position len(prompt) − 2) hold prompt
    pages that every particle of the request shares for ever; from that page on, a particle
    holds at most one page per column of its own. The first round's count is also the least
    that the bookkeeping ever needs (all particles still share the prompt pages); the
    pipelined rounds want about two rounds' fresh pages on top (``_rounds``; with fewer free
    they wait for the round in flight)."""
    PS = page_size
    n_rounds = -(-max_new_tokens // (K + 1))
    first_round, worst = 1, 1
    for p in prompts:
        cached = len(p) - 1
        shared = (cached - 1) // PS
        first_round += shared + N * (-(-(cached + K + 1) // PS) - shared)
        worst += shared + N * (-(-(cached + n_rounds * (K + 1)) // PS) - shared)
    return first_round, worst


def run_batch(engine, prompts: list[list[int]], settings: Settings, target, *, eos_token_id: int | None,
              resampler: str, ess_threshold: float, use_graphs: bool, seed: int,
              record_weights: bool = False, schedule=None, pipeline: bool | None = None) -> EngineOutput:
    """SMC-SD of ``prompts`` (each its own request, all submitted at once) with per-request
    ``settings`` and ``target`` (one EngineTarget or one per prompt). Returns an
    :class:`~smcdecode.backends.engine.output.EngineOutput` whose tensors are [G, N_max, ...] (rows
    j >= N_g of request g are padding: log w = -inf, length 0); its per-round lists hold one entry
    per request (NaN / False once a request has left)."""
    G = len(prompts)
    targets = list(target) if isinstance(target, (list, tuple)) else [target] * G
    if len(targets) != G:
        raise SMCDecodeError(f"target lists {len(targets)} programs for {G} prompts: give one or one per prompt")
    for t in targets:
        if not isinstance(t, EngineTarget):
            raise SMCDecodeError(f"target must be an EngineTarget (EngineTarget.of(LM(model) * ...)), got "
                                 f"{type(t).__name__}")
    programs = list({id(t): t for t in targets}.values())
    Nmax, Kmax = max(settings.particles), max(settings.block_size)
    longest_new = max(settings.max_new_tokens)
    context = engine.max_context or max(len(p) for p in prompts) + longest_new + Kmax + 2
    first = 1 + sum(page_bounds([p], n, k, m, engine.page_size)[0] - 1 for p, n, k, m in
                    zip(prompts, settings.particles, settings.block_size, settings.max_new_tokens))
    if engine.num_pages < first:
        raise SMCDecodeError(
            f"num_pages ({engine.num_pages}) is too small for {G} request(s) × {Nmax} particles: the first round "
            f"alone needs {first} pages of {engine.page_size} tokens; raise num_pages to at least {first}")
    sched = Scheduler(engine, slots=G, max_particles=Nmax, max_block_size=Kmax, target=programs,
                      eos_token_id=eos_token_id, resampler=resampler, ess_threshold=ess_threshold,
                      use_graphs=use_graphs, seed=seed, max_context=context, record_weights=record_weights,
                      schedule=schedule, pipeline=pipeline, shrink=False)
    for g, p in enumerate(prompts):
        sched.submit(Request(list(p), settings.particles[g], settings.block_size[g], settings.max_new_tokens[g],
                             settings.draft_temperature[g], settings.target_temperature[g], id=g,
                             target=targets[g]))
    by_id = {f.request.id: f for f in sched.run()}
    done = [by_id[g] for g in range(G)]
    pad = sched.pad
    tokens = torch.full((G, Nmax, longest_new), pad, dtype=torch.long)
    lengths = torch.zeros(G, Nmax, dtype=torch.long)
    log_w = torch.full((G, Nmax), NEG_INF, dtype=torch.float64)
    drafted = torch.zeros(G, Nmax, dtype=torch.long)
    for g, f in enumerate(done):
        n, T = f.tokens.shape
        tokens[g, :n, :T] = f.tokens
        lengths[g, :n] = f.lengths
        log_w[g, :n] = f.log_weights
        drafted[g, :n] = f.drafted
    out = EngineOutput(tokens, lengths, log_w, torch.tensor([f.log_evidence for f in done], dtype=torch.float64))
    rounds = max(f.rounds for f in done)
    out.rounds = rounds
    for t in range(rounds):
        out.ess.append(np.array([f.ess[t] if t < len(f.ess) else math.nan for f in done]))
        out.resampled.append(np.array([f.resampled[t] if t < len(f.resampled) else False for f in done]))
        out.block_sizes.append(np.array([f.block_sizes[t] if t < len(f.block_sizes) else 0 for f in done]))
        out.survivors.append(np.array([f.survivors[t] if t < len(f.survivors) else f.log_weights.shape[0]
                                       for f in done]))
        if record_weights:
            out.weights.append(torch.stack([f.weights[t] if t < len(f.weights) else torch.zeros_like(f.weights[0])
                                            for f in done]))
    out.finished = torch.ones(G, Nmax, dtype=torch.bool)
    out.drafted = drafted
    out.peak_pages = sched.peak_pages
    out.host_s = sched.host_s
    out.particles = list(settings.particles)
    return out


def _exact_pages(prompts: list[list[int]], samples: int, extra: int, page_size: int, num_pages: int) -> None:
    """Refuse a call whose rows' pages for their whole outputs (``extra`` positions past the cached
    prompt, reserved when their request joins) cannot all be held at once."""
    PS = page_size
    need = 1 + sum(-(-(len(p) - 1) // PS) + samples * (-(-(len(p) - 1 + extra) // PS) - (len(p) - 2) // PS)
                   for p in prompts)
    if num_pages < need:
        raise SMCDecodeError(f"num_pages ({num_pages}) is too small for {len(prompts)} prompt(s) × {samples} samples: "
                             f"their outputs need {need} pages of {PS} tokens; raise num_pages to at least {need}")


def run_autoregressive(engine, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                       samples: int = 1, use_graphs: bool | None = None, seed: int = 0, batched_prefill: bool = True,
                       eos_token_id: int | None = None) -> tuple[Tensor, int]:
    """Autoregressive sampling on the request loop (``Engine.autoregressive``): each prompt one
    request of ``samples`` independent rows (``Request(exact=True, block_size=0)`` in an exact-only
    scheduler without drafts), all submitted at once. Returns (tokens [G·samples, max_new_tokens],
    EOS after a row's first EOS; peak pages)."""
    if not prompts or any(len(p) < 1 for p in prompts):
        raise SMCDecodeError("prompts must be a non-empty list of non-empty token lists")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise SMCDecodeError(f"samples must be a positive integer, got {samples!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SMCDecodeError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise SMCDecodeError(f"temperature must be a finite number > 0, got {temperature!r}")
    G, S = len(prompts), samples
    context = engine.max_context or max(len(p) for p in prompts) + max_new_tokens + 2
    _exact_pages(prompts, S, max_new_tokens + 2, engine.page_size, engine.num_pages)
    sched = Scheduler(engine, slots=G, max_particles=S, max_block_size=0, eos_token_id=eos_token_id,
                      ess_threshold=0.0, use_graphs=use_graphs, seed=seed, max_context=context, shrink=False,
                      exact_only=True, batched_prefill=batched_prefill)
    for g, p in enumerate(prompts):
        sched.submit(Request(list(p), S, 0, max_new_tokens, target_temperature=temperature, id=g, exact=True))
    by_id = {f.request.id: f for f in sched.run()}
    engine.ar_steps_run = sched.launched  # (diagnostics: rounds of one token run by the last call)
    return torch.cat([by_id[g].tokens for g in range(G)]), sched.peak_pages


def run_speculative(engine, prompts: list[list[int]], *, block_size: int, max_new_tokens: int, samples: int = 1,
                    draft_temperature: float = 1.0, target_temperature: float = 1.0,
                    eos_token_id: int | None = None, use_graphs: bool | None = None, seed: int = 0) -> EngineOutput:
    """Exact speculative decoding of ``prompts`` on the request loop: each prompt one request of
    ``samples`` independent rows (``Request(exact=True)``), all submitted at once. Returns an
    :class:`~smcdecode.backends.engine.output.EngineOutput` with tokens [G, S, T], lengths,
    ``accepted`` and ``drafted`` [G, S] (weights and evidence zero)."""
    if engine.draft is None:
        raise SMCDecodeError("speculative decoding needs a draft model: Engine(target, draft, ...)")
    for name, v, least in (("block_size", block_size, 1), ("samples", samples, 1), ("max_new_tokens", max_new_tokens, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise SMCDecodeError(f"{name} must be an integer >= {least}, got {v!r}")
    if not prompts or any(len(p) < 2 for p in prompts):
        raise SMCDecodeError("every prompt needs at least 2 tokens")
    G, S, K = len(prompts), samples, block_size
    context = engine.max_context or max(len(p) for p in prompts) + max_new_tokens + K + 2
    _exact_pages(prompts, S, max_new_tokens + K + 2, engine.page_size, engine.num_pages)
    sched = Scheduler(engine, slots=G, max_particles=S, max_block_size=K, eos_token_id=eos_token_id,
                      ess_threshold=0.0, use_graphs=use_graphs, seed=seed, max_context=context, shrink=False,
                      exact_only=True)
    for g, p in enumerate(prompts):
        sched.submit(Request(list(p), S, K, max_new_tokens, draft_temperature, target_temperature, id=g, exact=True))
    by_id = {f.request.id: f for f in sched.run()}
    done = [by_id[g] for g in range(G)]
    out = EngineOutput(torch.stack([f.tokens for f in done]), torch.stack([f.lengths for f in done]),
                       torch.zeros(G, S, dtype=torch.float64), torch.zeros(G, dtype=torch.float64))
    out.accepted = torch.stack([f.accepted for f in done])
    out.drafted = torch.stack([f.drafted for f in done])
    out.rounds = max(f.rounds for f in done)
    out.finished = torch.ones(G, S, dtype=torch.bool)
    out.peak_pages = sched.peak_pages
    out.host_s = sched.host_s
    return out
