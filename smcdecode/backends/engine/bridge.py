"""The public API on the engine: ``SMC(..., backend="engine")``,
``SpeculativeDecoding(..., backend="engine")`` and ``Autoregressive(..., backend="engine")`` run here.

Models convert once to the engine's :class:`Llama` (``Llama.from_hf``; a GGUF file loaded with
``load_model`` is an HFModel like any other) and are cached per model object, as are the engines
(KV pools, captured graphs) per (target, draft) pair. A draft that shares the target's embedding
or head modules (the distilled drafts in ``smcdecode/drafts``, ``truncated_draft``) shares them in
the engine too.
"""

from __future__ import annotations

import math
import weakref

import torch

from ...errors import SMCDecodeError
from ...samplers.smc_sd import SMCOutput

_LLAMAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Model -> {(dtype, device): Llama}
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target Model -> {key: Engine}

SUPPORTED = ("llama",)


def check_options(options: dict | None, allowed: tuple[str, ...] | None = None, backend: str = "engine") -> dict:
    """``engine_options`` checked (names and values; see ``config.check_options``; ``allowed``: its
    ``OPTIONS`` unless given)."""
    from .config import OPTIONS
    from .config import check_options as check

    return check(options, OPTIONS if allowed is None else allowed, backend)


def to_llama(model, role: str, dtype=None, device=None):
    """The engine's Llama for a smcdecode Model (cached per model, dtype and device)."""
    from ...models import HFModel
    from .model import Llama

    if not isinstance(model, HFModel):
        raise SMCDecodeError(
            f"the engine runs Hugging Face Llama-family models (load_model(...)); the {role} {model.name!r} is a "
            f"{type(model).__name__}: use backend='reference' for it")
    kind = getattr(model.hf.config, "model_type", None)
    if kind not in SUPPORTED:
        raise SMCDecodeError(
            f"the engine runs Llama-family models (model_type {list(SUPPORTED)}); the {role} {model.name!r} is "
            f"{kind!r}: use backend='reference' for it")
    from .config import parse_device, parse_dtype

    p = next(model.hf.parameters())
    dtype = p.dtype if dtype is None else parse_dtype(dtype)
    device = parse_device(device) if device is not None else p.device
    cache = _LLAMAS.setdefault(model, {})
    key = (dtype, str(device))
    if key not in cache:
        try:
            cache[key] = Llama.from_hf(model.hf, dtype=dtype, device=device)
        except KeyError as e:
            raise SMCDecodeError(
                f"the {role} {model.name!r} lacks a weight the engine's Llama needs ({e}): use backend='reference'"
            ) from None
    return cache[key]


def _share_modules(target_hf, draft_hf, target, draft) -> None:
    """Draft embeddings / head that are the target's modules in HF become the target's in the engine."""
    with torch.no_grad():
        if draft_hf.get_input_embeddings() is target_hf.get_input_embeddings():
            draft.tok_embeddings = target.tok_embeddings
        if draft_hf.get_output_embeddings() is target_hf.get_output_embeddings():
            draft.output = target.output


def engine_for(target_model, draft_model, rows: int, context: int, options: dict):
    """An Engine over the two models with room for ``rows`` sequences of ``context`` positions
    (reused across calls when it fits): its settings are ``EngineConfig.from_options(options, ...)``."""
    from .config import EngineConfig
    from .engine import Engine

    target = to_llama(target_model, "target", options.get("dtype"), options.get("device"))
    draft = to_llama(draft_model, "draft", options.get("dtype"), options.get("device")) if draft_model else None
    if draft is not None and draft_model is not target_model:
        _share_modules(target_model.hf, draft_model.hf, target, draft)
    p = target.tok_embeddings.weight
    config = EngineConfig.from_options(options, rows, context).resolved(p.dtype, p.device)
    key = (id(draft_model), config)
    engines = _ENGINES.setdefault(target_model, {})
    engine = engines.get(key)
    if engine is None:
        engines.clear()  # one engine (KV pools) per target at a time
        engine = Engine(target, draft, config)
        engines[key] = engine
    return engine


def _seed(generator: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def run_smc(strategy, ids: list[int], groups: int, max_new_tokens: int, generator, options: dict) -> SMCOutput:
    """``SMC.run`` / ``run_groups`` on the engine: ``groups`` requests of one prompt × N particles."""
    from .targets import EngineTarget

    if len(ids) < 2:
        raise SMCDecodeError("the engine needs a prompt of at least 2 tokens: add a token (e.g. BOS) in front")
    model, draft = strategy.model, strategy.proposal
    # proposal "target": no draft model, K = 0 (one token a round, from π_loc ∝ p^α·1[valid])
    K, N = (strategy.block_size, strategy.particles) if draft is not None else (0, strategy.particles)
    engine = engine_for(model, draft.model if draft is not None else None, groups * N,
                        len(ids) + max_new_tokens + K + 2, options)
    out = engine.smc_sd(
        [ids] * groups, particles=N, block_size=K, max_new_tokens=max_new_tokens,
        draft_temperature=draft.temperature if draft is not None else 1.0,
        target_temperature=strategy.target.lm.temperature, eos_token_id=model.eos_token_id,
        resampler=strategy.resampler, ess_threshold=strategy.ess_threshold, use_graphs=options.get("use_graphs"),
        seed=_seed(generator), target=EngineTarget.of(strategy.target), record_weights=True,
        schedule=getattr(strategy, "schedule", None) if draft is not None else None)
    result = SMCOutput(out.tokens.cpu(), out.lengths.cpu(), out.finished.cpu(), out.log_weights.cpu(),
                       out.log_evidence.cpu())
    result.ess = [torch.as_tensor(e) for e in out.ess]
    result.resampled = [torch.as_tensor(r) for r in out.resampled]
    result.weights = [w.cpu() for w in out.weights]
    result.rounds = out.rounds
    result.draft_tokens = int(out.drafted.sum())
    result.block_sizes = [torch.as_tensor(k) for k in out.block_sizes]
    result.survivors = [torch.as_tensor(s) for s in out.survivors]
    target = strategy.target
    if target.lm.alpha == 1 and not target.constraints and not target.rewards:
        # with the target as proposal every weight would be 1: the path log-weights are 0
        result.target_log_weights = torch.zeros_like(result.log_weights)
    return result


def run_speculative(strategy, ids: list[int], groups: int, max_new_tokens: int, generator,
                    options: dict) -> SMCOutput:
    """``SpeculativeDecoding`` on the engine: ``groups`` × ``samples`` independent rows."""
    if len(ids) < 2:
        raise SMCDecodeError("the engine needs a prompt of at least 2 tokens: add a token (e.g. BOS) in front")
    model = strategy.model
    K, S = strategy.block_size, strategy.samples
    engine = engine_for(model, strategy.proposal.model, groups * S, len(ids) + 2 * max_new_tokens + K + 2,
                        options)
    out = engine.speculative(
        [ids] * groups, block_size=K, max_new_tokens=max_new_tokens, samples=S,
        draft_temperature=strategy.proposal.temperature, target_temperature=strategy.target.lm.temperature,
        eos_token_id=model.eos_token_id, use_graphs=options.get("use_graphs"), seed=_seed(generator))
    lengths = out.lengths.cpu()
    finished = torch.ones_like(lengths, dtype=torch.bool)
    result = SMCOutput(out.tokens.cpu(), lengths, finished, torch.zeros(groups, S, dtype=torch.float64),
                       torch.full((groups,), math.nan, dtype=torch.float64))
    result.rounds = out.rounds
    accepted = int(out.accepted.sum())
    result.accepted_tokens = accepted
    result.draft_tokens = int(out.drafted.sum())
    return result


def run_autoregressive(strategy, ids: list[int], groups: int, max_new_tokens: int, generator,
                       options: dict) -> SMCOutput:
    """``Autoregressive`` on the engine: ``groups`` × ``samples`` rows of the engine's AR step.

    p_T^α normalised per token is p at temperature T/α (α·logits/T), so the power costs nothing.
    Each row is cut after its first EOS and padded with EOS, as the generic loop returns it; the
    engine stops decoding soon after every row has sampled EOS."""
    model, lm = strategy.model, strategy.target.lm
    S, eos = strategy.samples, strategy.model.eos_token_id
    if strategy.target.constraints:
        return _masked_autoregressive(strategy, ids, groups, max_new_tokens, generator, options)
    engine = engine_for(model, None, groups * S, len(ids) + max_new_tokens + 2, options)
    # one prompt, its pages shared by all groups × samples rows (copy-on-write of the last one)
    tokens, _ = engine.autoregressive([ids], samples=groups * S, max_new_tokens=max_new_tokens,
                                      temperature=lm.temperature / lm.alpha, use_graphs=options.get("use_graphs"),
                                      seed=_seed(generator), eos_token_id=eos)
    tokens = tokens.cpu()
    is_eos = tokens == eos
    lengths = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, max_new_tokens)
    tokens = torch.where(torch.arange(max_new_tokens)[None] < lengths[:, None], tokens, eos)
    return SMCOutput(tokens.view(groups, S, -1), lengths.view(groups, S), torch.ones(groups, S, dtype=torch.bool),
                     torch.zeros(groups, S, dtype=torch.float64), torch.full((groups,), math.nan, dtype=torch.float64))


def _masked_autoregressive(strategy, ids: list[int], groups: int, max_new_tokens: int, generator,
                           options: dict) -> SMCOutput:
    """Locally masked sampling (v ∝ p^α·1[valid] a token) on the engine: the request loop with the
    target as proposal (K = 0) and no resampling (τ = 0), so every row is an independent sequence;
    a row that reaches a dead end, or is cut where the constraints do not accept, gets weight 0."""
    from .targets import EngineTarget

    if len(ids) < 2:
        raise SMCDecodeError("the engine needs a prompt of at least 2 tokens: add a token (e.g. BOS) in front")
    model, S = strategy.model, strategy.samples
    engine = engine_for(model, None, groups * S, len(ids) + max_new_tokens + 2, options)
    out = engine.smc_sd([ids] * groups, particles=S, block_size=0, max_new_tokens=max_new_tokens,
                        target_temperature=strategy.target.lm.temperature, eos_token_id=model.eos_token_id,
                        ess_threshold=0.0, use_graphs=options.get("use_graphs"), seed=_seed(generator),
                        target=EngineTarget.of(strategy.target))
    log_w = torch.where(torch.isneginf(out.log_weights.cpu()), float("-inf"), 0.0).double()
    return SMCOutput(out.tokens.cpu(), out.lengths.cpu(), torch.ones(groups, S, dtype=torch.bool), log_w,
                     torch.full((groups,), math.nan, dtype=torch.float64))
