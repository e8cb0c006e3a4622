"""The whole recipe, :func:`distill`: prompts, corpus, draft, training, the saved draft and its
held-out figures, in one output directory that a second run resumes from."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..drafts import build_draft, draft_info, grow_draft, load_default_draft, load_draft, save_draft, size_bytes
from ..drafts.feature import build_feature_draft
from ..errors import SMCDecodeError
from ..models import HFModel
from .config import DistillConfig
from .corpus import chat_prompts, generate_corpus, self_prompts, split_prompts
from .evaluation import evaluate_draft
from .training import train_draft


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
