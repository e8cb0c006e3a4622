"""Held-out acceptance Σ_v min(p, q), χ²(p‖q) and KL(p‖q) of drafts against the target.

Compares a distilled draft (smcdecode.drafts) with truncated drafts (the target's first L layers)
on the held-out target samples that `python -m smcdecode.distill` saved in its corpus.pt, or, with
--prompts instead of --corpus, on fresh target answers to the same held-out prompts (recovered from
the prompt files as distill splits them: same seed, same 200). --draft-temperature evaluates the
draft as a proposal at other temperatures than the target's (q at T' against p at T).

    python benchmarks/draft_acceptance.py --target smollm2 --draft DIR [DIR ...] --corpus DIR/corpus.pt \\
        --truncated 6 10 15 20 25 --temperature 0.7 --device cuda --out acceptance.json
    python benchmarks/draft_acceptance.py --draft default --prompts sharegpt_500.json alpaca_eval_instructions.json \\
        --limit 40 --max-new-tokens 128 --truncated --draft-temperature 0.5 0.6 0.7 --device cpu
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from smcdecode import load_model, truncated_draft
from smcdecode.distill import evaluate_draft
from smcdecode.drafts import load_default_draft, load_draft


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--draft", nargs="+", default=["default"],
                   help="draft directories, or 'default' (the shipped draft)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", help="corpus.pt written by smcdecode.distill (its 'heldout' part is used)")
    src.add_argument("--prompts", nargs="+", help="the prompt files given to smcdecode.distill: sample fresh target "
                     "answers to its held-out prompts")
    p.add_argument("--holdout", type=int, default=200, help="with --prompts: as given to smcdecode.distill")
    p.add_argument("--seed", type=int, default=0, help="with --prompts: as given to smcdecode.distill")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="with --prompts: as given to smcdecode.distill")
    p.add_argument("--max-new-tokens", type=int, default=256, help="with --prompts: answer length")
    p.add_argument("--draft-temperature", type=float, nargs="+", default=None,
                   help="temperatures of the draft as a proposal (default: each --temperature itself)")
    p.add_argument("--truncated", type=int, nargs="*", default=[6, 10, 15, 20, 25])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.7])
    p.add_argument("--limit", type=int, default=None, help="use only the first LIMIT held-out sequences")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    target = load_model(args.target, device=args.device)
    if args.corpus:
        held = torch.load(args.corpus, weights_only=True)["heldout"][: args.limit]
    else:
        from smcdecode.distill import chat_prompts, generate_corpus, load_prompts, split_prompts

        _, held_p = split_prompts(chat_prompts(target, load_prompts(args.prompts), args.max_prompt_tokens), args.holdout, args.seed)
        held = generate_corpus(target, [ids for _, ids in held_p[: args.limit]], samples=1,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature[0],
                               seed=args.seed + 1, progress=False, log=lambda s: None)
    drafts = {}
    for d in args.draft:
        drafts["distilled" if d == "default" else f"distilled:{d}"] = \
            load_default_draft(target) if d == "default" else load_draft(target, d)
    for L in args.truncated:
        drafts[f"truncated-{L}"] = truncated_draft(target, L)
    rows = []
    for name, draft in drafts.items():
        for t, tq in [(a, b) for a in args.temperature for b in (args.draft_temperature or [a])]:
            start = time.perf_counter()
            r = evaluate_draft(target, draft, held, temperature=t, draft_temperature=tq)
            r.update(draft=name, seconds=round(time.perf_counter() - start, 1))
            rows.append(r)
            print(f"{name:20s} T={t:g} T'={tq:g}: acceptance {r['acceptance']:.3f}  χ² mean {r['chi2_mean']:.3g}  "
                  f"median {r['chi2_median']:.3g}  E log(1+χ²) {r['log1p_chi2_mean']:.3f}  KL {r['kl']:.3f}  "
                  f"({r['positions']} positions, {r['sequences']} sequences)", flush=True)
    device = str(target.device) + (f" ({torch.cuda.get_device_name()})" if target.device.type == "cuda" else "")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device, "target": target.name,
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
