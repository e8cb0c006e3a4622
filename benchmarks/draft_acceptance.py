"""Held-out acceptance Σ_v min(p, q), χ²(p‖q) and KL(p‖q) of drafts against the target.

Compares a distilled draft (smcdecode.drafts) with truncated drafts (the target's first L layers)
on the held-out target samples that `python -m smcdecode.distill` saved in its corpus.pt.

    python benchmarks/draft_acceptance.py --target smollm2 --draft DIR [DIR ...] --corpus DIR/corpus.pt \\
        --truncated 6 10 15 20 25 --temperature 0.7 --device cuda --out acceptance.json
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
    p.add_argument("--corpus", required=True, help="corpus.pt written by smcdecode.distill (its 'heldout' part is used)")
    p.add_argument("--truncated", type=int, nargs="*", default=[6, 10, 15, 20, 25])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.7])
    p.add_argument("--limit", type=int, default=None, help="use only the first LIMIT held-out sequences")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    target = load_model(args.target, device=args.device)
    held = torch.load(args.corpus, weights_only=True)["heldout"][: args.limit]
    drafts = {}
    for d in args.draft:
        drafts["distilled" if d == "default" else f"distilled:{d}"] = \
            load_default_draft(target) if d == "default" else load_draft(target, d)
    for L in args.truncated:
        drafts[f"truncated-{L}"] = truncated_draft(target, L)
    rows = []
    for name, draft in drafts.items():
        for t in args.temperature:
            start = time.perf_counter()
            r = evaluate_draft(target, draft, held, temperature=t)
            r.update(draft=name, seconds=round(time.perf_counter() - start, 1))
            rows.append(r)
            print(f"{name:20s} T={t:g}: acceptance {r['acceptance']:.3f}  χ² mean {r['chi2_mean']:.3g}  "
                  f"median {r['chi2_median']:.3g}  E log(1+χ²) {r['log1p_chi2_mean']:.3f}  KL {r['kl']:.3f}  "
                  f"({r['positions']} positions, {r['sequences']} sequences)", flush=True)
    device = str(target.device) + (f" ({torch.cuda.get_device_name()})" if target.device.type == "cuda" else "")
    report = {"date": time.strftime("%Y-%m-%d"), "device": device, "target": target.name, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
