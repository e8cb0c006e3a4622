"""``smcdecode distill`` / ``python -m smcdecode.distill``: the command line of :func:`distill`."""

from __future__ import annotations

import argparse
import sys

import torch

from ..errors import SMCDecodeError
from .config import DistillConfig
from .corpus import load_prompts
from .recipe import distill


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
        from ..models import load_model

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
