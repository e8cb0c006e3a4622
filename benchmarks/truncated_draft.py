"""SMC-SD with truncated drafts of the default model: mean ESS per round and resampling rate.

Writes --out-md and --out-json (by default docs/truncated_draft.md and docs/truncated_draft.json)
and a plot of the first run (--plot). Usage:
    python benchmarks/truncated_draft.py [--prompts 6] [--max-new-tokens 32] [--layers 10 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from pathlib import Path

import torch

import smcdecode as sd

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "eval"  # ../shared/data/eval beside the repository


def prompts(data: Path, n: int) -> list[str]:
    rows = json.loads((data / "sharegpt_500.json").read_text())
    out = []
    for row in rows:
        text = row["conversations"][0]["value"] if isinstance(row, dict) and "conversations" in row else str(row)
        if 20 <= len(text) <= 300:
            out.append(text)
        if len(out) == n:
            break
    return out


def _shown(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` where it lies below it, else absolute."""
    path = path.resolve()
    return str(path.relative_to(base.resolve())) if path.is_relative_to(base.resolve()) else str(path)


def markdown(meta: dict, rows: list[dict], md_path: Path, json_path: Path, plot_path: Path | None) -> str:
    """The report; every figure and finding comes from ``meta`` and ``rows``."""
    lines = [
        "# SMC-SD with a truncated draft",
        "",
        "Measured by `python benchmarks/truncated_draft.py`. " + ", ".join(f"{k}: {v}" for k, v in meta.items())
        + f". Machine-readable: `{_shown(json_path, ROOT)}`.",
        "",
        "| draft layers L | mean ESS per round (of N) | ESS / N | rounds with ESS < 2 | resampling rate | "
        "tok/s (median, CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['mean_ess']:.2f} | {r['mean_ess_fraction']:.2f} | "
                     f"{100 * r['rounds_ess_below_2']:.0f}% | {r['resample_rate']:.2f} | "
                     f"{r['tokens_per_second_median']:.1f} |")
    lines += [
        "",
        "ESS is measured after each round's reweighting, before resampling; ESS < 2 means the weight sits on about "
        "one or two particles. Mean ESS counts copies: after a resampling the copies of one particle are nearly "
        "identical, so a high ESS in later rounds does not mean a diverse population. tok/s is the sample's tokens "
        f"per second of wall time, with the load average {meta['load_average']} at the start of the run. The "
        "distilled draft: [drafts.md](drafts.md).",
    ]
    if plot_path is not None:
        lines += ["", f"![ESS and weights of one run]({_shown(plot_path, md_path.parent)})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA,
                    help="directory holding sharegpt_500.json (default: ../shared/data/eval beside the repository)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out-md", type=Path, default=ROOT / "docs" / "truncated_draft.md")
    ap.add_argument("--out-json", type=Path, default=ROOT / "docs" / "truncated_draft.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "truncated_draft_run.png",
                    help="plot of the first run (ESS and weights over rounds); 'none' for no plot")
    args = ap.parse_args(argv)
    plot = None if str(args.plot) == "none" else args.plot
    load = tuple(round(x, 1) for x in os.getloadavg())
    model = sd.load_model("smollm2", threads=args.threads)
    target = sd.LM(model, temperature=0.7)
    chats = prompts(args.data, args.prompts)
    rows = []
    for L in args.layers:
        draft = sd.Draft(sd.truncated_draft(model, L), 0.7)
        smc = sd.SMC(target, draft, particles=args.particles, block_size=args.block_size)
        ess, rate, tps, rounds_ess = [], [], [], []
        for i, text in enumerate(chats):
            r = smc.run([{"role": "user", "content": text}], max_new_tokens=args.max_new_tokens, seed=i, progress=False)
            ess.append(r.mean_ess)
            rate.append(r.resample_rate)
            tps.append(r.tokens_per_second)
            rounds_ess += r.ess
            if i == 0 and L == args.layers[0] and plot is not None:
                plot.parent.mkdir(parents=True, exist_ok=True)
                r.plot(str(plot))
        rows.append({
            "layers": L,
            "mean_ess": statistics.mean(ess),
            "mean_ess_fraction": statistics.mean(ess) / args.particles,
            "rounds_ess_below_2": sum(e < 2 for e in rounds_ess) / len(rounds_ess),
            "resample_rate": statistics.mean(rate),
            "tokens_per_second_median": statistics.median(tps),
        })
        print(rows[-1], flush=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                  f"{torch.get_num_threads()} torch thread(s))",
        "load_average": load,
        "target": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32), T=0.7",
        "draft": "first L layers of the target + final norm + head, T=0.7",
        "particles": args.particles, "block_size": args.block_size, "ess_threshold": 0.5,
        "resampler": "systematic", "max_new_tokens": args.max_new_tokens,
        "prompts": f"first {len(chats)} ShareGPT prompts of 20-300 characters (sharegpt_500.json), chat template",
    }
    args.out_json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    args.out_md.write_text(markdown(meta, rows, args.out_md, args.out_json, plot))


if __name__ == "__main__":
    main()
