"""How the engine's process waits for the mask workers at a host point: spinning until every worker
is done (``mask_workers.STEP_WATCH`` infinite) against spinning ``STEP_WATCH`` seconds and then
sleeping on the done bell (the library's default), SmolLM2 with the shipped draft, eight requests, on
llguidance's path, in one process: each schema's row measured as ``structured_engine.py`` measures
it, the two ways alternately (spin, sleep, sleep, spin, …), ``--pairs`` pairs a schema.

    python benchmarks/step_wait_ab.py --smollm2-gguf PATH --pairs 3

Why: on the GPU machine's virtual CPUs a busy process slows the others (benchmarks/cpu_contention.py),
and while the workers fill a step's masks the engine's process has nothing to do but wait for them.
Writes benchmarks/results/structured/step_wait_ab_h200.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structured_engine as se  # noqa: E402

from smcdecode.backends.engine import Engine, mask_workers  # noqa: E402
from smcdecode.backends.engine.config import EngineConfig  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "structured" / "step_wait_ab_h200.json"
SCHEMAS = {  # label -> (schema, path asked)
    "contact": (se.CONTACT_SCHEMA, "llguidance"),
    "small object": (se.DEFAULT_SCHEMA, "llguidance"),
    "tree": (se.TREE_SCHEMA, "auto"),
    "tree, held strings": (se.HELD_TREE_SCHEMA, "auto"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2-gguf", type=Path, required=True, help="SmolLM2-135M-Instruct GGUF file")
    ap.add_argument("--pairs", type=int, default=3, help="pairs (spin, sleep) a schema, order alternating")
    ap.add_argument("--repeats", type=int, default=5, help="constrained and unconstrained calls a measurement")
    ap.add_argument("--only", default=None, help="comma-separated schema labels (default: all)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_wait_ab.py times the engine on a GPU; none is visible")
    labels = list(SCHEMAS) if args.only is None else [s.strip() for s in args.only.split(",")]
    bad = [s for s in labels if s not in SCHEMAS]
    if bad:
        raise SystemExit(f"--only: {bad} not among {list(SCHEMAS)}")
    run = argparse.Namespace(smollm2_gguf=args.smollm2_gguf, requests=[8], particles=8, block_size=8,
                             max_new_tokens=256, repeats=args.repeats)
    name, target, draft, model, prompts, eos = se.smollm2_models(run, "cuda", torch.bfloat16)
    max_ctx = max(len(p) for p in prompts) + run.max_new_tokens + 16
    pages = 8 * (run.particles + 4) * (-(-max_ctx // 16) + 1) + 64
    engine = Engine(target, draft, EngineConfig(num_pages=pages, page_size=16, max_context=max_ctx))
    P = prompts[:8]
    engine.smc_sd(P, particles=8, block_size=8, max_new_tokens=18)
    t_plain, out = se.timed(lambda: engine.smc_sd(P, particles=8, block_size=8, max_new_tokens=256), 3, "cuda")
    plain = se.generated(out) / statistics.median(t_plain)
    engine.clear_graphs()
    watch = mask_workers.STEP_WATCH
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": torch.cuda.get_device_name(),
           "model": name, "requests": 8, "N": 8, "K": 8, "max_new_tokens": 256, "repeats": args.repeats,
           "step_watch_s": watch, "host": se.host_facts(), "host_workers": engine.config.host_workers, "rows": []}
    for label in labels:
        schema, path = SCHEMAS[label]
        c = JSONSchema(schema, path=path).bind(model)
        c.compile_s, c.label, c.asked, c.held_strings = 0.0, label, path, c._strings is not None
        for p in range(args.pairs):
            for way in (("spin", "sleep") if p % 2 == 0 else ("sleep", "spin")):
                mask_workers.STEP_WATCH = math.inf if way == "spin" else watch
                try:
                    r = se.measure(name, label, c, engine, model, P, eos, plain, t_plain, run, "cuda")
                finally:
                    mask_workers.STEP_WATCH = watch
                    engine.clear_graphs()
                r |= {"wait": way, "pair": p}
                res["rows"].append(r)
                print(f"STEPWAIT {label} pair {p} {way}: {100 * r['ratio_same_length']:.1f} % "
                      f"({r['ms_per_round_constrained']:.2f} vs {r['ms_per_round_plain_same_length']:.2f} ms a round)",
                      flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str))
    print("\n| schema | path | spin (each pair) | sleep (each pair) | median spin | median sleep |")
    print("|---|---|---|---|---:|---:|")
    for label in labels:
        rows = [r for r in res["rows"] if r["schema"] == label]
        got = {w: [100 * r["ratio_same_length"] for r in rows if r["wait"] == w] for w in ("spin", "sleep")}
        print(f"| {label} | {rows[0]['path']} | {', '.join(f'{v:.1f}' for v in got['spin'])} | "
              f"{', '.join(f'{v:.1f}' for v in got['sleep'])} | {statistics.median(got['spin']):.1f} % | "
              f"{statistics.median(got['sleep']):.1f} % |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
