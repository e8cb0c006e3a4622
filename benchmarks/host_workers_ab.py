"""How many mask worker processes: SmolLM2 with the shipped draft, eight requests, rows on
llguidance's path measured as ``structured_engine.py`` measures them, on engines over the same models
that differ only in ``EngineConfig.host_workers``, in one process, in rotating order (8, 4, 16, then
4, 16, 8, …), ``--rounds`` times each.

    python benchmarks/host_workers_ab.py --smollm2-gguf PATH --workers 8,4,16 --rounds 2

With eight requests and eight workers each worker holds one request (8 rows); with four, two
requests; with sixteen, each request is cut over two workers (each consumes the request's 8 rows and
fills 4). Writes benchmarks/results/structured/host_workers_ab_<counts>_h200.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structured_engine as se  # noqa: E402

from smcdecode.backends.engine import Engine  # noqa: E402
from smcdecode.backends.engine.config import EngineConfig  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "structured"
SCHEMAS = {  # label -> (schema, path asked)
    "contact": (se.CONTACT_SCHEMA, "llguidance"),
    "small object": (se.DEFAULT_SCHEMA, "llguidance"),
    "tree": (se.TREE_SCHEMA, "auto"),
    "tree, held strings": (se.HELD_TREE_SCHEMA, "auto"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2-gguf", type=Path, required=True, help="SmolLM2-135M-Instruct GGUF file")
    ap.add_argument("--workers", default="8,4,16", help="comma-separated worker counts (the first: the reference)")
    ap.add_argument("--rounds", type=int, default=2, help="measurements of each count a schema")
    ap.add_argument("--repeats", type=int, default=5, help="constrained and unconstrained calls a measurement")
    ap.add_argument("--only", default=None, help="comma-separated schema labels (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_workers_ab.py times the engine on a GPU; none is visible")
    try:
        counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise SystemExit(f"--workers takes comma-separated integers, got {args.workers!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--workers: each count must be at least 1, got {args.workers!r}")
    labels = list(SCHEMAS) if args.only is None else [s.strip() for s in args.only.split(",")]
    bad = [s for s in labels if s not in SCHEMAS]
    if bad:
        raise SystemExit(f"--only: {bad} not among {list(SCHEMAS)}")
    out_path = args.out or RESULTS / f"host_workers_ab_{'_'.join(map(str, counts))}_h200.json"
    run = argparse.Namespace(smollm2_gguf=args.smollm2_gguf, requests=[8], particles=8, block_size=8,
                             max_new_tokens=256, repeats=args.repeats)
    name, target, draft, model, prompts, eos = se.smollm2_models(run, "cuda", torch.bfloat16)
    max_ctx = max(len(p) for p in prompts) + run.max_new_tokens + 16
    pages = 8 * (run.particles + 4) * (-(-max_ctx // 16) + 1) + 64
    engines = {w: Engine(target, draft, EngineConfig(num_pages=pages, page_size=16, max_context=max_ctx,
                                                     host_workers=w)) for w in counts}
    P = prompts[:8]
    ref = engines[counts[0]]
    ref.smc_sd(P, particles=8, block_size=8, max_new_tokens=18)
    t_plain, out = se.timed(lambda: ref.smc_sd(P, particles=8, block_size=8, max_new_tokens=256), 3, "cuda")
    plain = se.generated(out) / statistics.median(t_plain)
    ref.clear_graphs()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": torch.cuda.get_device_name(),
           "model": name, "requests": 8, "N": 8, "K": 8, "max_new_tokens": 256, "repeats": args.repeats,
           "workers": counts, "host": se.host_facts(), "rows": []}
    for label in labels:
        schema, path = SCHEMAS[label]
        c = JSONSchema(schema, path=path).bind(model)
        c.compile_s, c.label, c.asked, c.held_strings = 0.0, label, path, c._strings is not None
        for k in range(args.rounds):
            order = counts[k % len(counts):] + counts[: k % len(counts)]
            for w in order:
                eng = engines[w]
                try:
                    r = se.measure(name, label, c, eng, model, P, eos, plain, t_plain, run, "cuda")
                finally:
                    eng.clear_graphs()
                r |= {"host_workers": w, "round": k}
                res["rows"].append(r)
                print(f"WORKERS {label} round {k} {w} workers: {100 * r['ratio_same_length']:.1f} % "
                      f"({r['ms_per_round_constrained']:.2f} vs {r['ms_per_round_plain_same_length']:.2f} ms a round)",
                      flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(res, indent=1, default=str))
    print("\n| schema | path | " + " | ".join(f"{w} workers (each)" for w in counts) + " | "
          + " | ".join(f"median {w}" for w in counts) + " |")
    print("|---|---|" + "---|" * len(counts) + "---:|" * len(counts))
    for label in labels:
        rows = [r for r in res["rows"] if r["schema"] == label]
        got = {w: [100 * r["ratio_same_length"] for r in rows if r["host_workers"] == w] for w in counts}
        print(f"| {label} | {rows[0]['path']} | " + " | ".join(", ".join(f"{v:.1f}" for v in got[w]) for w in counts)
              + " | " + " | ".join(f"{statistics.median(got[w]):.1f} %" for w in counts) + " |")
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
