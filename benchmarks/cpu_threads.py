"""Torch CPU threads for the README job: sampling time at 1, 2 and torch's default thread count,
on a quiet CPU and with a competing CPU-bound process.

The job is what ``smcdecode generate --chat "What is the capital of France?"`` samples: SMC-SD on
the default model (SmolLM2-135M-Instruct) with its shipped draft, N = 8 particles, K = 4, target
temperature 0.7 (the draft at its proposal temperature), 64 new tokens, seed 0, the reference
backend. The model is loaded once; each run sets ``torch.set_num_threads`` and times
``SMC.run`` (Result.seconds: sampling only, no loading).

Interleaved A/B: every pass runs each thread count once without and once with the competing load
(a ``while True: pass`` process this script starts before that half of the pass and stops after
it), thread counts in a seeded random order, the load/no-load halves alternating which goes first.
One untimed warm-up run per thread count comes first. Raw runs, medians, the device, the date,
the load average around each pass and the shapes go to --out:

    python benchmarks/cpu_threads.py --passes 5          # -> benchmarks/results/cpu_threads.json

Other processes on the machine add noise of their own: run it on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHAT = "What is the capital of France?"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def competing_load() -> subprocess.Popen:
    """A CPU-bound process (one core busy) that runs until it is stopped."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)  # let it get scheduled before timing starts
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summarise(runs: list[dict]) -> list[dict]:
    """Median, min and max sampling seconds per (threads, load)."""
    out = []
    keys = sorted({(r["threads_label"], r["threads"], r["load"]) for r in runs}, key=lambda k: (k[2], k[1], k[0]))
    for label, threads, load in keys:
        s = [r["seconds"] for r in runs if r["threads_label"] == label and r["load"] == load]
        out.append({"threads": label, "torch_threads": threads, "load": load, "runs": len(s),
                    "median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)})
    return out


def main(argv: list[str] | None = None) -> int:
    torch_default = torch.get_num_threads()  # before anything sets it
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", nargs="+", default=["1", "2", "default"],
                    help="thread counts to compare; 'default' is torch's own count in this process")
    ap.add_argument("--loads", nargs="+", default=["none", "one-core"], choices=["none", "one-core"],
                    help="'one-core': a competing `while True: pass` process runs during the timed runs")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed (the README job's: 0)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_threads.json")
    args = ap.parse_args(argv)
    counts = {t: torch_default if t == "default" else int(t) for t in args.threads}

    import smcdecode as sd
    from smcdecode.drafts import proposal_temperature

    model = sd.load_model("smollm2", threads=torch_default)
    draft = sd.load_default_draft(model)
    proposal = sd.Draft(draft, proposal_temperature(draft, 0.7))
    smc = sd.SMC(sd.LM(model, temperature=0.7), proposal, particles=8, block_size=4)
    prompt = [{"role": "user", "content": CHAT}]

    def sample(threads: int):
        torch.set_num_threads(threads)
        return smc.run(prompt, max_new_tokens=args.max_new_tokens, seed=args.seed, progress=False)

    for n in counts.values():  # warm-up, untimed
        sample(n)
    order = random.Random(0)
    runs, passes = [], []
    for p in range(args.passes):
        loads = args.loads if p % 2 == 0 else args.loads[::-1]
        entry = {"pass": p, "load_average_before": os.getloadavg()}
        for load in loads:
            labels = list(counts)
            order.shuffle(labels)
            proc = competing_load() if load == "one-core" else None
            try:
                for label in labels:
                    r = sample(counts[label])
                    runs.append({"pass": p, "load": load, "threads_label": label, "threads": counts[label],
                                 "seconds": r.seconds, "tokens": r.generated_tokens, "text": r.text})
                    print(f"pass {p} load {load:8s} threads {label:>7s} ({counts[label]}): {r.seconds:6.2f} s",
                          file=sys.stderr, flush=True)
            finally:
                if proc is not None:
                    stop(proc)
        entry["load_average_after"] = os.getloadavg()
        passes.append(entry)
    table = summarise(runs)
    ids = model.prompt_ids(prompt)
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": {"cpu": cpu_name(), "logical_cpus": os.cpu_count(),
                   "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                   "torch_default_threads": torch_default, "torch": torch.__version__,
                   "python": platform.python_version()},
        "job": {"command": f'smcdecode generate --chat "{CHAT}"', "model": model.name, "draft": draft.name,
                "strategy": "smc", "particles": 8, "block_size": 4, "temperature": 0.7,
                "draft_temperature": proposal.temperature, "max_new_tokens": args.max_new_tokens,
                "seed": args.seed, "prompt_tokens": len(ids), "backend": "reference"},
        "passes": args.passes, "passes_load_average": passes,
        "same_text_every_run": len({r["text"] for r in runs}) == 1,
        "summary": table, "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['device']['cpu']}, {report['device']['usable_cpus']} usable CPUs, torch default "
          f"{torch_default} threads; {args.passes} passes; load average before the passes: "
          + ", ".join(f"{e['load_average_before'][0]:.1f}" for e in passes))
    print("| competing load | threads | runs | median s | min s | max s |")
    print("|---|---|---|---|---|---|")
    for row in table:
        label = row["threads"] if row["threads"] != "default" else f"default ({row['torch_threads']})"
        print(f"| {row['load']} | {label} | {row['runs']} | {row['median_s']:.2f} | {row['min_s']:.2f} | "
              f"{row['max_s']:.2f} |")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
