"""Prompts and the target's own text: prompt files, the held-out split, chat formatting, prompts
the target writes itself (:func:`self_prompts`) and target samples (:func:`generate_corpus`, on
``transformers``' ``generate`` or on smcdecode's engine)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import SMCDecodeError
from ..models import HFModel
from .config import progress_bar


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
    bar = progress_bar(progress, len(jobs), "generating", "seq")
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
    bar = progress_bar(progress, len(prompts) * samples, "generating", "seq")
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
    from ..backends.engine.engine import Engine
    from ..backends.engine.model import Llama

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
