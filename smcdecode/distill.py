"""Distil a small draft from a target LM, for SMC-SD and speculative decoding.

The draft (see :mod:`smcdecode.drafts`) is ``L`` decoder layers of the target's width, initialised
from target layers, on top of the target's frozen token embeddings and LM head. It is trained to
minimise the per-token

    KL(p_T || q_T) = Σ_v p_T(v | h) [log p_T(v | h) − log q_T(v | h)],

p_T and q_T the target's and draft's next-token distributions at temperature T (the temperature
SMC-SD will run at; several may be given and their losses are averaged), over the response
positions of text *the target itself generates* from chat prompts. The held-out figures are

    acceptance α(h) = Σ_v min(p_T, q_T)      (exact speculative decoding accepts a draft token
                                               with this probability)
    χ²(h)          = Σ_v p_T² / q_T − 1      (the variance of the per-token importance weight
                                               p/q under q; SMC-SD's weights degrade with it)

averaged over positions of held-out target samples.

    python -m smcdecode.distill --target smollm2 --prompts sharegpt_500.json alpaca_eval_instructions.json \\
        --out my-draft --layers 4 --steps 2000 --device cuda

writes ``my-draft/draft.json`` + ``draft.safetensors`` (load with ``smcdecode.drafts.load_draft``),
``corpus.pt`` (the generated text), ``checkpoint.pt`` (training resumes from it when the command
is run again) and ``eval.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .drafts import (
    build_draft,
    draft_info,
    grow_draft,
    load_default_draft,
    load_draft,
    load_own_state,
    own_parameters,
    own_state,
    save_draft,
    size_bytes,
)
from .drafts.feature import FeatureDraftModel, build_feature_draft, head_logits, target_hidden
from .errors import SMCDecodeError
from .models import HFModel


@dataclass
class DistillConfig:
    """The recipe. ``steps`` optimiser steps of ``batch_size`` sequences; with ``time_budget_s``
    training also stops when that much time has passed, and the learning-rate schedule runs on
    progress = max(step / steps, elapsed / time_budget_s). With ``eval_every`` > 0,
    ``validation_prompts`` training prompts are set aside (one target sample each), the validation
    KL is measured every ``eval_every`` steps, and the draft with the lowest one is kept: a small
    corpus is memorised quickly (train KL falls while held-out KL rises)."""

    layers: int = 4
    init_layers: list[int] | None = None
    kind: str = "layers"
    unroll: int = 4
    feature_from: str | None = None
    temperatures: list[float] = field(default_factory=lambda: [0.7])
    samples_per_prompt: int = 4
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256
    holdout: int = 200
    steps: int = 2000
    time_budget_s: float | None = None
    batch_size: int = 32
    lr: float = 3e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200
    generation_batch_size: int = 256
    weights: str = "int8"
    eval_every: int = 0
    validation_prompts: int = 64
    generation_time_budget_s: float | None = None
    generator: str = "hf"
    on_policy: float = 0.0
    self_prompts: int = 0
    self_prompt_temperature: float = 1.0

    def check(self) -> None:
        for name in ("layers", "unroll", "samples_per_prompt", "max_prompt_tokens", "max_new_tokens", "steps", "batch_size",
                     "checkpoint_every", "generation_batch_size", "validation_prompts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SMCDecodeError(f"{name} must be a positive integer, got {v!r}")
        if not self.temperatures or any(not (t > 0 and math.isfinite(t)) for t in self.temperatures):
            raise SMCDecodeError(f"temperatures must be finite numbers > 0, got {self.temperatures!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SMCDecodeError(f"lr must be a finite number > 0, got {self.lr!r}")
        if self.holdout < 0:
            raise SMCDecodeError(f"holdout must be >= 0, got {self.holdout!r}")
        if self.kind not in ("layers", "feature"):
            raise SMCDecodeError(f"kind must be 'layers' (decoder layers over tokens) or 'feature' (reads the "
                                 f"target's hidden state, EAGLE-style), got {self.kind!r}")
        if self.feature_from is not None and self.kind != "feature":
            raise SMCDecodeError(f"feature_from ({self.feature_from!r}) initialises a feature draft: pass kind='feature'")
        if self.kind == "feature" and self.on_policy:
            raise SMCDecodeError("on_policy sampling needs a draft that generates on its own; a feature draft reads "
                                 "the target's hidden states: use on_policy=0 with kind='feature'")
        if self.generator not in ("hf", "engine"):
            raise SMCDecodeError(f"generator must be 'hf' or 'engine', got {self.generator!r}")
        if isinstance(self.self_prompts, bool) or not isinstance(self.self_prompts, int) or self.self_prompts < 0:
            raise SMCDecodeError(f"self_prompts must be a count >= 0 (user messages the target writes, as extra "
                                 f"training prompts), got {self.self_prompts!r}")
        if not (isinstance(self.self_prompt_temperature, (int, float)) and self.self_prompt_temperature > 0):
            raise SMCDecodeError(f"self_prompt_temperature must be > 0, got {self.self_prompt_temperature!r}")
        if isinstance(self.on_policy, bool) or not (isinstance(self.on_policy, (int, float)) and 0 <= self.on_policy <= 1):
            raise SMCDecodeError(f"on_policy must be a fraction in [0, 1] (the share of training answers the "
                                 f"draft samples), got {self.on_policy!r}")
        if self.eval_every < 0:
            raise SMCDecodeError(f"eval_every must be >= 0 (0: no validation), got {self.eval_every!r}")
        for name in ("time_budget_s", "generation_time_budget_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise SMCDecodeError(f"{name} must be > 0 seconds, got {v!r}")

    # fields that change what is trained; a checkpoint made with other values is not resumed
    # (steps and time_budget_s may change: run again with more steps to train longer)
    TRAINING_FIELDS = ("layers", "init_layers", "kind", "unroll", "feature_from", "temperatures", "batch_size", "lr", "warmup_steps",
                       "min_lr_ratio", "grad_clip", "seed")
    # what a checkpoint written before a field existed had
    FIELD_DEFAULTS = {"kind": "layers", "unroll": 4, "feature_from": None}


# ----------------------------------------------------------------------------------------------
# Prompts and the target's own text


def load_prompts(paths: Sequence[str | Path]) -> list[str]:
    """User prompts from JSON / JSONL files (``.gz`` too): plain strings, ShareGPT (``conversations``:
    first human turn), AlpacaEval (``instruction`` [+ ``input``]), Spec-Bench (``turns``), JSONSchemaBench
    (``schema``: a request for a JSON object that conforms to it, ``SCHEMA_PROMPT``), or ``prompt`` /
    ``question`` / ``problem`` / ``text`` fields (HumanEval's ``prompt``: the code to complete).
    Duplicates and empty prompts are dropped; order is kept."""
    prompts: list[str] = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise SMCDecodeError(f"prompt file {str(path)!r} does not exist")
        if path.suffix == ".gz":
            import gzip

            text = gzip.decompress(path.read_bytes()).decode()
            path = path.with_suffix("")  # the format is the inner suffix's
        else:
            text = path.read_text()
        try:
            if path.suffix == ".jsonl":
                items = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                items = json.loads(text)
        except json.JSONDecodeError as e:
            raise SMCDecodeError(f"prompt file {str(path)!r} is not valid JSON/JSONL ({e})") from None
        if not isinstance(items, list):
            raise SMCDecodeError(f"prompt file {str(path)!r} must hold a JSON list (or JSONL lines)")
        for item in items:
            p = _prompt_of(item)
            if p:
                prompts.append(p.strip())
    seen: set[str] = set()
    out = [p for p in prompts if p and not (p in seen or seen.add(p))]
    if not out:
        raise SMCDecodeError(f"no prompts found in {[str(p) for p in paths]}")
    return out


SCHEMA_PROMPT = "Write a JSON object that conforms to this JSON Schema. Reply with the JSON object only.\n\n"


def _prompt_of(item) -> str | None:
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("conversations"), list):
        for turn in item["conversations"]:
            if isinstance(turn, dict) and turn.get("from", turn.get("role")) in ("human", "user"):
                return turn.get("value", turn.get("content"))
        return None
    if isinstance(item.get("instruction"), str):
        extra = item.get("input")
        return item["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
    if isinstance(item.get("schema"), dict):
        return SCHEMA_PROMPT + json.dumps(item["schema"], ensure_ascii=False)
    if isinstance(item.get("turns"), list) and item["turns"]:
        return item["turns"][0] if isinstance(item["turns"][0], str) else None
    for key in ("prompt", "question", "problem", "text"):
        if isinstance(item.get(key), str):
            return item[key]
    return None


def chat_prompts(target: HFModel, prompts: Sequence[str], max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt as a single user chat turn (raw text if the model has no
    chat template), keeping those of at most ``max_prompt_tokens`` tokens."""
    has_chat = getattr(target.tokenizer, "chat_template", None) is not None
    out = []
    for p in prompts:
        ids = target.chat([{"role": "user", "content": p}]) if has_chat else target.encode(p)
        if 0 < len(ids) <= max_prompt_tokens:
            out.append((p, ids))
    return out


def user_turn_prefix(target: HFModel) -> list[int]:
    """Token ids of a chat up to where a user's message starts (the template's system turn and the
    user turn's header), for the target to write a user message; its end is the turn's end token."""
    tok = target.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise SMCDecodeError(f"self_prompts needs a chat model: {target.name!r} has no chat template")
    marker = "\ue000"  # a private-use character: in no template
    text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False, tokenize=False)
    if marker not in text:
        raise SMCDecodeError(f"the chat template of {target.name!r} does not show the user's message; "
                             "self_prompts cannot find where a user turn starts")
    return list(tok.encode(text[: text.index(marker)], add_special_tokens=False))


def self_prompts(target: HFModel, count: int, *, temperature: float = 1.0, max_new_tokens: int = 128,
                 batch_size: int = 256, seed: int = 0, progress: bool = True, generator: str = "hf",
                 time_budget_s: float | None = None, log: Callable[[str], None] = print) -> list[str]:
    """User messages written by the target itself: ``count`` samples (at ``temperature``) of the
    user turn of its chat template, kept when the turn ended (its end token within
    ``max_new_tokens``), non-blank, and not seen before. More prompts, of the kinds the model
    expects, for a corpus whose prompts are few (the draft otherwise fits its training prompts and
    not new ones)."""
    prefix = user_turn_prefix(target)
    eos = target.eos_token_id
    gens = generate_corpus(target, [prefix], samples=count, max_new_tokens=max_new_tokens, temperature=temperature,
                           batch_size=batch_size, seed=seed, progress=progress, generator=generator,
                           time_budget_s=time_budget_s, log=log)
    out, seen = [], set()
    for _, r in gens:
        if not r or r[-1] != eos:
            continue
        text = target.decode(r[:-1]).strip()
        if text and text not in seen:
            seen.add(text)
            out.append(text)
    log(f"the target wrote {len(out)} distinct user messages ({len(gens)} sampled)")
    return out


def split_prompts(items: Sequence, holdout: int, seed: int = 0) -> tuple[list, list]:
    """(train, held_out): a seeded shuffle, the first ``holdout`` held out. Deterministic, so the
    benchmarks recover the same held-out prompts from the same files and seed."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    if holdout >= len(items):
        raise SMCDecodeError(f"holdout ({holdout}) must be smaller than the number of usable prompts ({len(items)})")
    held = sorted(order[:holdout])
    train = sorted(order[holdout:])
    return [items[i] for i in train], [items[i] for i in held]


@torch.no_grad()
def generate_corpus(
    target: HFModel,
    prompt_ids: Sequence[Sequence[int]],
    *,
    samples: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    batch_size: int = 256,
    seed: int = 0,
    progress: bool = True,
    time_budget_s: float | None = None,
    generator: str = "hf",
    log: Callable[[str], None] = print,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) for ``samples`` target samples per prompt at ``temperature``
    (plain ancestral sampling: no top-k / top-p), each response cut after its first EOS.

    ``generator="hf"`` samples with ``transformers``' ``generate``; ``"engine"`` with smcdecode's
    own engine (:mod:`smcdecode.backends.engine`: paged KV cache, one CUDA graph per step, the
    target converted to bfloat16 on CUDA).

    Jobs run in a seeded random order (lengths sorted only within windows of 4 batches, to limit
    padding), so with ``time_budget_s`` — no batch after the first starts after that many seconds — the
    sequences that were generated are a random subset of the prompts, not the shortest ones.
    With the engine a job is a prompt with all its ``samples`` (up to ``batch_size`` of them: a
    prompt with more samples is several jobs): the prompt is prefilled once and its rows share its
    KV pages, so a time budget keeps a random subset of whole prompts, each with all its samples.
    On CUDA the KV cache is static (preallocated), which avoids regrowing it every step."""
    hf, eos = target.hf, target.eos_token_id
    device = target.device
    if generator not in ("hf", "engine"):
        raise SMCDecodeError(f"generator must be 'hf' or 'engine', got {generator!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise SMCDecodeError(f"samples must be a positive integer, got {samples!r}")
    prompts = [list(p) for p in prompt_ids]
    jobs = [p for p in prompts for _ in range(samples)]
    responses: list[list[int] | None] = [None] * len(jobs)
    torch.manual_seed(seed)
    if generator == "engine":
        _engine_corpus(target, prompts, responses, samples=samples, max_new_tokens=max_new_tokens,
                       temperature=temperature, batch_size=batch_size, seed=seed, progress=progress,
                       time_budget_s=time_budget_s, log=log)
        return [(p, r) for p, r in zip(jobs, responses) if r]
    rng = random.Random(seed)
    order = list(range(len(jobs)))
    rng.shuffle(order)
    window = 4 * batch_size
    order = [i for s in range(0, len(order), window) for i in sorted(order[s : s + window], key=lambda i: len(jobs[i]))]
    extra = {"cache_implementation": "static"} if device.type == "cuda" else {}
    bar = _bar(progress, len(jobs), "generating", "seq")
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        if start and time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            log(f"generation time budget ({time_budget_s:.0f} s) spent: {start} of {len(jobs)} sequences generated")
            break
        rows = order[start : start + batch_size]
        width = max(len(jobs[i]) for i in rows)
        ids = torch.full((len(rows), width), eos, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):  # left padding
            ids[r, width - len(jobs[i]) :] = torch.tensor(jobs[i])
            mask[r, width - len(jobs[i]) :] = 1
        out = hf.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=temperature,
            top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=eos, eos_token_id=eos, **extra,
        )
        for r, i in enumerate(rows):
            gen = out[r, width:].tolist()
            responses[i] = gen[: gen.index(eos) + 1] if eos in gen else gen
        if bar is not None:
            bar.update(len(rows))
    if bar is not None:
        bar.close()
    return [(p, r) for p, r in zip(jobs, responses) if r]


def _engine_corpus(target: HFModel, prompts: list[list[int]], responses: list, *, samples: int,
                   max_new_tokens: int, temperature: float, batch_size: int, seed: int, progress: bool,
                   time_budget_s: float | None, log: Callable[[str], None]) -> None:
    """``generate_corpus`` on the engine: fills ``responses[g·samples + s]``. Jobs are (prompt,
    k samples), k <= batch_size; a batch packs jobs up to ``batch_size`` rows and is one
    ``Engine.autoregressive`` call with ``samples=k`` (jobs of a batch with equal k; batches are
    cut where k changes, which happens only for the remainder of a prompt split over jobs)."""
    eos = target.eos_token_id
    k_full = min(samples, batch_size)
    jobs = [(g, s0, min(k_full, samples - s0)) for g in range(len(prompts)) for s0 in range(0, samples, k_full)]
    rng = random.Random(seed)
    rng.shuffle(jobs)
    per = max(1, batch_size // k_full)  # jobs per batch
    window = 4 * per
    jobs = [j for w in range(0, len(jobs), window)
            for j in sorted(jobs[w : w + window], key=lambda j: (j[2], len(prompts[j[0]])))]
    batches: list[list[tuple[int, int, int]]] = []
    for j in jobs:
        if batches and len(batches[-1]) < per and batches[-1][0][2] == j[2]:
            batches[-1].append(j)
        else:
            batches.append([j])
    sample = _engine_sampler(target, max(map(len, prompts), default=1) + max_new_tokens, batch_size)
    bar = _bar(progress, len(prompts) * samples, "generating", "seq")
    t0, done = time.perf_counter(), 0
    for n, batch in enumerate(batches):
        if n and time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            log(f"generation time budget ({time_budget_s:.0f} s) spent: {done} of {len(prompts) * samples} "
                f"sequences generated")
            break
        k = batch[0][2]
        gens = sample([prompts[g] for g, _, _ in batch], k, max_new_tokens, temperature, seed + n)
        for (g, s0, _), r in zip(batch, range(0, len(gens), k)):
            for s in range(k):
                gen = gens[r + s]
                responses[g * samples + s0 + s] = gen[: gen.index(eos) + 1] if eos in gen else gen
        done += len(batch) * k
        if bar is not None:
            bar.update(len(batch) * k)
    if bar is not None:
        bar.close()


def _engine_sampler(target: HFModel, max_context: int, batch_size: int):
    """A function (prompts, samples, max_new_tokens, temperature, seed) -> token lists (row
    g·samples + s: sample s of prompt g) that samples from ``target`` on smcdecode's engine
    (bfloat16 on CUDA, float32 on CPU). One engine for the whole corpus, with a fixed
    ``max_context``: every batch has the same page-table width, so the step graph captured for
    one batch size is replayed by all batches of that size."""
    from .backends.engine.engine import Engine
    from .backends.engine.model import Llama

    dtype = torch.bfloat16 if target.device.type == "cuda" else torch.float32
    try:
        llama = Llama.from_hf(target.hf, dtype=dtype, device=target.device)
    except Exception as e:  # an architecture the engine does not run
        raise SMCDecodeError(f"generator='engine' cannot run {target.name!r} ({e}); use generator='hf'") from None
    page = 16
    pages = batch_size * (-(-(max_context + 2) // page) + 1) + 8
    engine = Engine(llama, None, num_pages=pages, page_size=page, max_context=max_context + 2)

    def sample(prompts: list[list[int]], samples: int, max_new_tokens: int, temperature: float,
               seed: int) -> list[list[int]]:
        tokens, _ = engine.autoregressive(prompts, samples=samples, max_new_tokens=max_new_tokens,
                                          temperature=temperature, seed=seed, eos_token_id=target.eos_token_id)
        return tokens.tolist()

    return sample


# ----------------------------------------------------------------------------------------------
# Loss, evaluation


def _logits(hf: torch.nn.Module, input_ids: Tensor, positions: Tensor) -> Tensor:
    """Next-token logits [P, V] at the selected ``positions`` ([B, T] bool) only."""
    hidden = hf.model(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, T, H]
    return head_logits(hf, hidden[positions])


def kl_loss(target_logits: Tensor, draft_logits: Tensor, temperatures: Sequence[float]) -> Tensor:
    """Mean over positions and temperatures of KL(p_T || q_T); logits [P, V]."""
    total = draft_logits.new_zeros(())
    for t in temperatures:
        log_p = torch.log_softmax(target_logits / t, dim=-1)
        log_q = torch.log_softmax(draft_logits / t, dim=-1)
        total = total + (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return total / len(temperatures)


def _batch(seqs: Sequence[tuple[list[int], list[int]]], device) -> tuple[Tensor, Tensor]:
    """input ids [B, T] (right-padded) and the positions [B, T] that predict a response token."""
    width = max(len(p) + len(r) - 1 for p, r in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    positions = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, (p, r) in enumerate(seqs):
        full = (p + r)[:-1]  # the last token predicts nothing we train on
        ids[b, : len(full)] = torch.tensor(full)
        positions[b, len(p) - 1 : len(full)] = True
    return ids.to(device), positions.to(device)


@torch.no_grad()
def evaluate_draft(
    target: HFModel,
    draft: HFModel,
    corpus: Sequence[tuple[list[int], list[int]]],
    *,
    temperature: float = 0.7,
    draft_temperature: float | None = None,
    batch_size: int = 16,
    progress: bool = False,
    unroll: int | None = None,
) -> dict:
    """Held-out figures of ``draft`` against ``target`` at ``temperature`` over the response
    positions of ``corpus``: mean acceptance Σ min(p, q), χ² = Σ p²/q − 1 (mean, median, and the
    mean of log(1 + χ²)), KL(p || q), and the positions counted. Runs in float32. q is the draft at
    ``draft_temperature`` (default: ``temperature``): the proposal SMC-SD / SD would use with it.

    A feature draft is evaluated as SMC-SD runs it: at drafted position s = 1..``unroll`` (default:
    its training unroll) of a round, reading the target's feature s positions back and its own
    outputs since; ``by_draft_step`` has the figures per s, the headline figures average them."""
    if draft_temperature is None:
        draft_temperature = temperature
    if not (draft_temperature > 0 and math.isfinite(draft_temperature)):
        raise SMCDecodeError(f"draft_temperature must be a finite number > 0, got {draft_temperature!r}")
    device = target.device
    feature = isinstance(draft, FeatureDraftModel)
    steps = (unroll or draft_info(draft).get("config", {}).get("training", {}).get("config", {}).get("unroll", 4)) \
        if feature else 1
    acc, chi, kl = [[] for _ in range(steps)], [[] for _ in range(steps)], [[] for _ in range(steps)]
    bar = _bar(progress, len(corpus), "evaluating", "seq")
    for start in range(0, len(corpus), batch_size):
        seqs = corpus[start : start + batch_size]
        ids, pos = _batch(seqs, device)
        if feature:
            hidden, z_t = target_hidden(target.hf, ids, use_cache=False)
            log_p = torch.log_softmax(z_t[pos] / temperature, -1)
            z_ds = [draft.net.logits(h)[pos] for h in draft.net.unrolled(ids, hidden, steps)]
        else:
            log_p = torch.log_softmax(_logits(target.hf, ids, pos) / temperature, -1)
            z_ds = [_logits(draft.hf, ids, pos)]
        for s, z_d in enumerate(z_ds):
            log_q = torch.log_softmax(z_d / draft_temperature, -1)
            acc[s].append(torch.minimum(log_p, log_q).exp().sum(-1).double().cpu())
            chi[s].append(torch.logsumexp(2 * log_p - log_q, -1).double().cpu())  # log(1 + χ²)
            kl[s].append((log_p.exp() * (log_p - log_q)).sum(-1).double().cpu())
        if bar is not None:
            bar.update(len(seqs))
    if bar is not None:
        bar.close()
    if not acc[0]:
        raise SMCDecodeError("the evaluation corpus is empty")
    report = {
        "temperature": temperature,
        **({"draft_temperature": draft_temperature} if draft_temperature != temperature else {}),
        **_figures(torch.cat([torch.cat(a) for a in acc]), torch.cat([torch.cat(c) for c in chi]),
                   torch.cat([torch.cat(k) for k in kl])),
        "sequences": len(corpus),
    }
    if feature:  # the headline figures average the drafted positions 1..unroll of a round
        report["by_draft_step"] = [_figures(torch.cat(a), torch.cat(c), torch.cat(k)) for a, c, k in zip(acc, chi, kl)]
        report["positions"] = report["by_draft_step"][0]["positions"]
    return report


def _figures(a: Tensor, log1p_chi2: Tensor, k: Tensor) -> dict:
    chi2 = torch.expm1(log1p_chi2)
    return {
        "acceptance": float(a.mean()),
        "chi2_mean": float(chi2.mean()),
        "chi2_median": float(chi2.median()),
        "log1p_chi2_mean": float(log1p_chi2.mean()),
        "kl": float(k.mean()),
        "positions": int(a.numel()),
    }


# ----------------------------------------------------------------------------------------------
# Training


def _epoch_batches(corpus, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of one epoch: a seeded shuffle, lengths sorted within windows of 16 batches (less
    padding), batch order shuffled again. Deterministic in (seed, epoch), so training resumes
    exactly where it stopped."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(corpus)))
    rng.shuffle(order)
    window = 16 * batch_size
    batches = []
    for s in range(0, len(order), window):
        chunk = sorted(order[s : s + window], key=lambda i: len(corpus[i][0]) + len(corpus[i][1]))
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _lr_factor(step: int, progress: float, cfg: DistillConfig) -> float:
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def _unrolled_loss(target: HFModel, draft: FeatureDraftModel, ids: Tensor, pos: Tensor, config: DistillConfig) -> Tensor:
    """A feature draft's loss: the mean over unrolled steps s = 1..``config.unroll`` of the KL at
    the response positions, step s reading its own outputs of the s − 1 positions before."""
    with torch.no_grad():
        hidden, z_t = target_hidden(target.hf, ids, use_cache=False)
        z_t = z_t[pos]
    outs = draft.net.unrolled(ids, hidden, config.unroll)
    return sum(kl_loss(z_t, draft.net.logits(h)[pos], config.temperatures) for h in outs) / len(outs)


def train_draft(
    target: HFModel,
    draft: HFModel,
    corpus: Sequence[tuple[list[int], list[int]]],
    config: DistillConfig,
    *,
    checkpoint: str | Path | None = None,
    validation: Sequence[tuple[list[int], list[int]]] = (),
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Minimise KL(p_T || q_T) over ``corpus`` by AdamW on the draft's own parameters (the target
    is frozen). With ``checkpoint``, state is saved there every ``checkpoint_every`` steps and at the
    end, and a compatible checkpoint found there is resumed. With ``validation`` sequences and
    ``config.eval_every``, the draft with the lowest validation KL is the one left at the end.
    Returns {"steps", "seconds", "history", "best"}."""
    config.check()
    if not corpus:
        raise SMCDecodeError("the training corpus is empty")
    device = target.device
    for p in target.hf.parameters():
        p.requires_grad_(False)
    params = own_parameters(draft)
    feature = isinstance(draft, FeatureDraftModel)
    module = draft.net if feature else draft.hf
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, elapsed, history = 0, 0.0, []
    best: dict = {"kl": math.inf, "step": None, "state": None}
    validate = bool(config.eval_every and validation)
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        saved = {k: state["config"].get(k, DistillConfig.FIELD_DEFAULTS.get(k)) for k in DistillConfig.TRAINING_FIELDS}
        now = {k: dataclasses.asdict(config)[k] for k in DistillConfig.TRAINING_FIELDS}
        if saved != now:
            changed = {k: (saved[k], now[k]) for k in now if saved[k] != now[k]}
            raise SMCDecodeError(
                f"checkpoint {str(ckpt)!r} was made with another recipe {changed} (saved, now): "
                "use the same options to resume, or --fresh to start over"
            )
        load_own_state(draft, state["draft"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        best = state.get("best") or best
        log(f"resuming from {ckpt} at step {step} ({elapsed:.0f} s trained)")

    def progress_of(step: int, elapsed: float) -> float:
        p = step / config.steps
        if config.time_budget_s:
            p = max(p, elapsed / config.time_budget_s)
        return p

    def save() -> None:
        if ckpt is None:
            return
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"step": step, "elapsed": elapsed, "history": history, "config": dataclasses.asdict(config),
                    "draft": {k: v.detach().cpu() for k, v in own_state(draft).items()},
                    "optimizer": opt.state_dict(), "best": best}, tmp)
        tmp.replace(ckpt)

    def check_validation() -> None:
        module.eval()
        fig = evaluate_draft(target, draft, validation, temperature=config.temperatures[0], unroll=config.unroll)
        module.train()
        history.append({"step": step, "seconds": round(elapsed, 1), "validation_kl": fig["kl"],
                        "validation_acceptance": fig["acceptance"]})
        if fig["kl"] < best["kl"]:
            best.update(kl=fig["kl"], step=step,
                        state={k: v.detach().cpu().clone() for k, v in own_state(draft).items()})
        log(f"step {step}: validation KL {fig['kl']:.4f}, acceptance {fig['acceptance']:.3f} "
            f"(best KL {best['kl']:.4f} at step {best['step']})")

    use_bf16 = device.type == "cuda"
    nb = len(_epoch_batches(corpus, config.batch_size, config.seed, 0))
    module.train()
    bar = _bar(progress, config.steps, "distilling", "step", initial=step)
    t0, window = time.perf_counter() - elapsed, []
    epoch_seen, batches = -1, []
    try:
        while progress_of(step, elapsed) < 1.0:
            epoch, b = divmod(step, nb)
            if epoch != epoch_seen:
                epoch_seen, batches = epoch, _epoch_batches(corpus, config.batch_size, config.seed, epoch)
            rows = batches[b]
            ids, pos = _batch([corpus[i] for i in rows], device)
            for g in opt.param_groups:
                g["lr"] = config.lr * _lr_factor(step, progress_of(step, elapsed), config)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                if feature:
                    loss = _unrolled_loss(target, draft, ids, pos, config)
                else:
                    with torch.no_grad():
                        z_t = _logits(target.hf, ids, pos)
                    z_d = _logits(draft.hf, ids, pos)
                    loss = kl_loss(z_t, z_d, config.temperatures)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
            step += 1
            elapsed = time.perf_counter() - t0
            window.append(float(loss.detach()))  # NOTE: one sync per step, for the progress bar
            if step % 25 == 0 or progress_of(step, elapsed) >= 1.0:
                history.append({"step": step, "seconds": round(elapsed, 1), "kl": sum(window) / len(window),
                                "lr": opt.param_groups[0]["lr"]})
                window = []
                if bar is None and (step % 100 == 0 or progress_of(step, elapsed) >= 1.0):
                    h = history[-1]
                    log(f"step {step}: KL {h['kl']:.4f}, lr {h['lr']:.2e}, {elapsed:.0f} s")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(kl=f"{float(loss.detach()):.3f}")
            if validate and (step % config.eval_every == 0 or progress_of(step, elapsed) >= 1.0):
                check_validation()
            if step % config.checkpoint_every == 0:
                save()
    finally:
        if bar is not None:
            bar.close()
        module.eval()
    save()
    if validate and best["state"] is not None and best["step"] != step:
        load_own_state(draft, best["state"])
        log(f"keeping the draft of step {best['step']} (lowest validation KL {best['kl']:.4f})")
    for p in params:
        p.requires_grad_(False)
    return {"steps": step, "seconds": round(elapsed, 1), "history": history,
            "best": {"step": best["step"], "validation_kl": best["kl"]} if validate else None}


# ----------------------------------------------------------------------------------------------
# The whole recipe


def distill(
    target: HFModel,
    prompts: Sequence[str],
    out_dir: str | Path,
    config: DistillConfig | None = None,
    *,
    fresh: bool = False,
    init_draft: str | Path | None = None,
    extra_prompts: Sequence[str] = (),
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Distil a draft for ``target`` from ``prompts`` (user chat messages) into ``out_dir``.

    1. keep prompts of at most ``max_prompt_tokens`` tokens; hold ``holdout`` of them out
       (``extra_prompts`` only ever train: the held-out set depends on ``prompts`` alone; with
       ``self_prompts`` = n the target also writes n user messages, :func:`self_prompts`, that
       join the extra prompts);
    2. build the draft (:func:`smcdecode.drafts.build_draft`), or start from the saved draft
       ``init_draft`` (a warm start: more data or steps for an existing draft);
    3. sample ``samples_per_prompt`` responses per training prompt (one per held-out prompt) from
       the target at the first training temperature (saved in ``corpus.pt``, reused on resume) —
       with ``on_policy`` = f, round(f·samples_per_prompt) of each training prompt's responses are
       sampled from the draft of step 2 instead (on-policy distillation: the KL is then also taken
       on the draft's own continuations, the prefixes SMC-SD's weights are computed on; held-out and
       validation responses are always the target's) — and train the draft (:func:`train_draft`);
    4. save it (``draft.json`` + ``draft.safetensors``), reload the saved file, and evaluate the
       reloaded draft on the held-out responses at each temperature (``eval.json``).

    Returns the report written to ``eval.json``.
    """
    config = config or DistillConfig()
    config.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus_file, ckpt = out / "corpus.pt", out / "checkpoint.pt"
    if fresh:
        for f in (corpus_file, ckpt):
            f.unlink(missing_ok=True)
    started = time.perf_counter()
    gen_seconds = 0.0
    warm = None
    if init_draft is not None:
        draft = load_draft(target, init_draft)
        warm = draft_info(draft)["config"]
        if warm.get("kind", "layers") != config.kind:
            raise SMCDecodeError(f"--init-draft {str(init_draft)!r} is a {warm.get('kind', 'layers')} draft: pass "
                                 f"--kind {warm.get('kind', 'layers')}")
        grow = config.kind == "layers" and config.layers > warm["num_layers"] and config.init_layers is None
        if not grow and (config.layers != warm["num_layers"] or config.init_layers not in (None, warm["init_layers"])):
            raise SMCDecodeError(
                f"--init-draft {str(init_draft)!r} has {warm['num_layers']} layers initialised from "
                f"{warm['init_layers']}; pass --layers {warm['num_layers']} (and no other --init-layers), "
                f"or more --layers (and no --init-layers) to grow it"
            )
        log(f"warm start from {init_draft} ({warm.get('training', {}).get('steps')} steps)")
        if grow:
            draft = grow_draft(target, draft, config.layers)
            log(f"grown from {warm['num_layers']} to {config.layers} layers (init layers "
                f"{draft_info(draft)['init_layers']}; the new ones start as the identity)")
    elif config.kind == "feature":
        source = None
        if config.feature_from is not None:
            source = load_default_draft(target) if config.feature_from == "default" else \
                load_draft(target, config.feature_from)
            log(f"feature draft initialised from the layer draft {config.feature_from} (its layers and norm; "
                "the feature input at zero)")
        draft = build_feature_draft(target, config.layers, config.init_layers, from_draft=source)
    else:
        draft = build_draft(target, config.layers, config.init_layers)
    if corpus_file.exists():
        corpus = torch.load(corpus_file, weights_only=True)
        log(f"reusing {len(corpus['train'])} training and {len(corpus['heldout'])} held-out sequences from {corpus_file}")
        if float(corpus.get("on_policy", 0.0)) != float(config.on_policy):
            raise SMCDecodeError(
                f"{str(corpus_file)!r} was made with on_policy={corpus.get('on_policy', 0.0)}, not {config.on_policy}: "
                "pass the same --on-policy to reuse it, or --fresh to make a new corpus")
    else:
        usable = chat_prompts(target, prompts, config.max_prompt_tokens)
        train_p, held_p = split_prompts(usable, config.holdout, config.seed)
        val_p: list = []
        if config.eval_every:  # validation prompts come out of the training prompts, not the held-out ones
            train_p, val_p = split_prompts(train_p, min(config.validation_prompts, len(train_p) - 1), config.seed + 1)
        written = self_prompts(target, config.self_prompts, temperature=config.self_prompt_temperature,
                               batch_size=config.generation_batch_size, seed=config.seed + 4, progress=progress,
                               generator=config.generator, log=log) if config.self_prompts else []
        all_extra = list(extra_prompts) + written
        extra_p = chat_prompts(target, all_extra, config.max_prompt_tokens) if all_extra else []
        seen = {text for text, _ in held_p + val_p + train_p}
        extra_p = [(text, ids) for text, ids in extra_p if text not in seen]  # never train on a held-out prompt
        log(f"{len(usable)} of {len(prompts)} prompts fit in {config.max_prompt_tokens} tokens: "
            f"{len(train_p)} for training, {len(val_p)} for validation, {len(held_p)} held out"
            + (f"; {len(extra_p)} of {len(all_extra)} extra prompts for training" if all_extra else ""))
        t = time.perf_counter()
        temp = config.temperatures[0]
        # held-out and validation answers first: a generation time budget only shortens training text
        held = generate_corpus(target, [ids for _, ids in held_p], samples=1, max_new_tokens=config.max_new_tokens,
                               temperature=temp, batch_size=config.generation_batch_size, seed=config.seed + 1,
                               progress=progress, generator=config.generator, log=log) if held_p else []
        val = generate_corpus(target, [ids for _, ids in val_p], samples=1, max_new_tokens=config.max_new_tokens,
                              temperature=temp, batch_size=config.generation_batch_size, seed=config.seed + 2,
                              progress=progress, generator=config.generator, log=log) if val_p else []
        budget = config.generation_time_budget_s
        if budget is not None:
            budget = max(1.0, budget - (time.perf_counter() - t))
        n_draft = round(config.on_policy * config.samples_per_prompt)
        train, n_from_draft = [], 0
        for model, n, seed in ((target, config.samples_per_prompt - n_draft, config.seed),
                               (draft, n_draft, config.seed + 3)):
            if n == 0:
                continue
            share = None if budget is None else budget * n / config.samples_per_prompt
            part = generate_corpus(model, [ids for _, ids in train_p + extra_p], samples=n,
                                     max_new_tokens=config.max_new_tokens, temperature=temp,
                                     batch_size=config.generation_batch_size, seed=seed, progress=progress,
                                     time_budget_s=share, generator=config.generator, log=log)
            train += part
            n_from_draft += len(part) if model is draft else 0
        gen_seconds = time.perf_counter() - t
        corpus = {"train": train, "heldout": held, "heldout_prompts": [text for text, _ in held_p],
                  "validation": val, "generation_seconds": gen_seconds, "on_policy": float(config.on_policy),
                  "draft_sequences": n_from_draft, "self_prompts": written}
        torch.save(corpus, corpus_file)
        n_tok = sum(len(r) for _, r in train)
        log(f"generated {len(train)} training sequences ({n_tok} response tokens"
            + (f"; {n_from_draft} sampled by the draft" if n_draft else "") + f") in {gen_seconds:.0f} s")
    if config.eval_every and not corpus.get("validation"):
        log("no validation sequences in the corpus (made without --eval-every): training without model selection")
    trained = train_draft(target, draft, corpus["train"], config, checkpoint=ckpt,
                          validation=corpus.get("validation", []), progress=progress, log=log)
    recipe = {
        "config": dataclasses.asdict(config),
        "train_sequences": len(corpus["train"]),
        "draft_sequences": int(corpus.get("draft_sequences", 0)),
        "extra_prompts": len(extra_prompts) + len(corpus.get("self_prompts", [])),
        "self_prompts": len(corpus.get("self_prompts", [])),
        "train_response_tokens": sum(len(r) for _, r in corpus["train"]),
        "steps": trained["steps"],
        "train_seconds": trained["seconds"],
        "generation_seconds": round(float(corpus.get("generation_seconds", gen_seconds)), 1),
        "device": str(target.device) + (f" ({torch.cuda.get_device_name(target.device)})"
                                        if target.device.type == "cuda" else ""),
        "final_train_kl": next((h["kl"] for h in reversed(trained["history"]) if "kl" in h), None),
        "kept": trained["best"],
    }
    if warm is not None:
        recipe["warm_start"] = {"from": str(init_draft), "num_layers": warm["num_layers"],
                                "init_layers": warm["init_layers"], "training": warm.get("training"),
                                "eval": warm.get("eval")}
    save_draft(draft, out, weights=config.weights, metadata={"training": recipe})
    reloaded = load_draft(target, out)  # evaluate what was saved (int8 weights included)
    figures = [evaluate_draft(target, reloaded, corpus["heldout"], temperature=t) for t in config.temperatures] \
        if corpus["heldout"] else []
    config_file = out / "draft.json"
    saved = json.loads(config_file.read_text())
    saved["eval"] = figures
    config_file.write_text(json.dumps(saved, indent=2) + "\n")
    report = {"draft": str(out), "size_bytes": size_bytes(out), "training": recipe, "eval": figures,
              "history": trained["history"], "seconds": round(time.perf_counter() - started, 1)}
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


# ----------------------------------------------------------------------------------------------
# Command line


def _bar(enabled: bool, total: int, desc: str, unit: str, initial: int = 0):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True)


def _parser() -> argparse.ArgumentParser:
    d = DistillConfig()
    p = argparse.ArgumentParser(
        prog="smcdecode distill",
        description="Distil a small draft from a target LM (KL to the target's next-token distributions at the "
        "SMC-SD temperature, on text the target generates from your prompts). Run it again to resume.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", default="smollm2", help="target: 'smollm2', a Hugging Face directory, or a .gguf file")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                   help="JSON/JSONL prompt files (ShareGPT, AlpacaEval, Spec-Bench, or a list of strings)")
    p.add_argument("--extra-prompts", nargs="+", default=[], metavar="FILE",
                   help="more prompt files used for training only (never held out; e.g. GSM8K, MATH500)")
    p.add_argument("--out", required=True, help="output directory (draft, corpus, checkpoint, eval.json)")
    p.add_argument("--kind", choices=["layers", "feature"], default=d.kind,
                   help="layers: decoder layers over tokens; feature: decoder layers that also read the target's "
                   "last hidden state (EAGLE-style; SMC-SD on the reference backend)")
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers of the draft")
    p.add_argument("--init-layers", help="comma-separated target layers to initialise from (default: evenly "
                   "spaced for layer drafts, the last ones for feature drafts)")
    p.add_argument("--feature-from", metavar="DIR",
                   help="feature drafts: start from this layer draft ('default': the shipped one) — its layers and "
                   "norm, the feature input at zero — instead of target layers")
    p.add_argument("--unroll", type=int, default=d.unroll,
                   help="feature drafts: drafted positions per round trained on (step s reads its own outputs)")
    p.add_argument("--temperature", type=float, nargs="+", default=d.temperatures,
                   help="temperature(s) T of KL(p_T || q_T); the first is also the sampling temperature of the corpus")
    p.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt, help="target samples per training prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="skip longer (chat-formatted) prompts")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="length of each target sample")
    p.add_argument("--holdout", type=int, default=d.holdout, help="prompts held out for the final evaluation")
    p.add_argument("--steps", type=int, default=d.steps, help="optimiser steps")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="also stop training after this many seconds (the LR schedule follows whichever ends first)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints")
    p.add_argument("--generation-time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop starting new generation batches after this many seconds (a random subset of "
                   "the training prompts' samples is kept)")
    p.add_argument("--generator", choices=["hf", "engine"], default=d.generator,
                   help="what samples the target's text: transformers' generate, or smcdecode's GPU engine "
                   "(paged KV + CUDA graphs; much faster for a small target on a GPU)")
    p.add_argument("--generation-batch-size", type=int, default=d.generation_batch_size, help="sequences per generate() call")
    p.add_argument("--on-policy", type=float, default=d.on_policy, metavar="F",
                   help="share of each training prompt's samples drawn from the draft being trained (the "
                   "built or --init-draft one) instead of the target: on-policy distillation, the KL taken on "
                   "the draft's own continuations too (0: target text only)")
    p.add_argument("--self-prompts", type=int, default=d.self_prompts, metavar="N",
                   help="the target writes N user messages (samples of its chat template's user turn), added "
                   "to the training prompts (0: none)")
    p.add_argument("--self-prompt-temperature", type=float, default=d.self_prompt_temperature, metavar="T",
                   help="temperature of those samples")
    p.add_argument("--weights", choices=["int8", "bfloat16", "float32"], default=d.weights,
                   help="storage of the saved layers (int8: per-row scales, half the size of bfloat16)")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="measure the KL on validation prompts every N steps and keep the best draft (0: off)")
    p.add_argument("--validation-prompts", type=int, default=d.validation_prompts,
                   help="training prompts set aside for --eval-every")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for the split, the samples and the batches")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--fresh", action="store_true", help="ignore an existing corpus and checkpoint in --out")
    p.add_argument("--init-draft", metavar="DIR", help="start from this saved draft instead of target layers")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m smcdecode.distill ...`` / ``smcdecode distill ...``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        init = None
        if args.init_layers:
            try:
                init = [int(x) for x in args.init_layers.split(",")]
            except ValueError:
                raise SMCDecodeError(f"--init-layers must be comma-separated integers, got {args.init_layers!r}") from None
        config = DistillConfig(
            layers=args.layers, init_layers=init, kind=args.kind, unroll=args.unroll,
            feature_from=args.feature_from, temperatures=list(args.temperature),
            samples_per_prompt=args.samples_per_prompt, max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_new_tokens, holdout=args.holdout, steps=args.steps,
            time_budget_s=args.time_budget, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
            seed=args.seed, checkpoint_every=args.checkpoint_every,
            generation_batch_size=args.generation_batch_size, weights=args.weights,
            eval_every=args.eval_every, validation_prompts=args.validation_prompts,
            generation_time_budget_s=args.generation_time_budget, generator=args.generator,
            on_policy=args.on_policy,
            self_prompts=args.self_prompts,
            self_prompt_temperature=args.self_prompt_temperature,
        )
        config.check()
        prompts = load_prompts(args.prompts)
        extra = load_prompts(args.extra_prompts) if args.extra_prompts else []
        from .models import load_model

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = True
        target = load_model(args.target, device=device)
        report = distill(target, prompts, args.out, config, fresh=args.fresh, init_draft=args.init_draft,
                         extra_prompts=extra, progress=not args.no_progress,
                         log=lambda s: print(s, file=sys.stderr))
    except SMCDecodeError as e:
        print(f"smcdecode distill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("smcdecode distill: interrupted; run the same command again to resume from the checkpoint",
              file=sys.stderr)
        return 130
    t = report["training"]
    print(f"draft saved to {report['draft']} ({report['size_bytes'] / 1e6:.1f} MB): {config.layers} layers, "
          f"{t['steps']} steps in {t['train_seconds']:.0f} s on {t['device']}")
    for e in report["eval"]:
        print(f"held-out at T={e['temperature']:g}: acceptance Σmin(p,q) = {e['acceptance']:.3f}, "
              f"χ² mean {e['chi2_mean']:.3g} / median {e['chi2_median']:.3g}, KL {e['kl']:.3f} "
              f"({e['positions']} positions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
