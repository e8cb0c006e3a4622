"""Host time per draft step of the engine's host-mask path (llguidance constraints), between two
source trees (e.g. boolean masks before, packed bitmasks after), on the CPU.

    python benchmarks/host_masks_speed.py --a /path/to/old/tree --b . --passes 3

Each pass runs one process per tree, alternating the order. A process binds JSON Schemas of
JSONSchemaBench (../shared/data/eval) to the default model's vocabulary (SmolLM2, 49,152 tokens) on
the llguidance path and drives the engine's ``HostMasks`` exactly as a round does (``begin``, then
``mask(i)`` for K draft steps and the bonus, ``drafted`` where the tree has it, ``end``), for G
requests of N particles; tokens are drawn uniformly from each row's mask (outside the timing),
so every particle follows a valid path. Timed: the host's calls per draft step (mask computation,
matcher advances, assembly of the [rows, ·] mask). On the CPU the packed path's ``mask`` also unpacks
(the device's work on a GPU): its time, measured apart on the same shape, is given and subtracted.
Raw results go to --out; the table gives medians over passes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from pathlib import Path

WORKER = r"""
import json, sys, time
import torch
import smcdecode as sd
from smcdecode.backends.engine.host_masks import HostMasks, RequestMasks
from smcdecode.potentials.json_schema import JSONSchema
cfg = json.loads(sys.argv[1])
torch.set_num_threads(1)
model = sd.load_model()
V, eos = model.vocab_size, model.eos_token_id
schemas = []
for name in cfg["sources"]:
    with open(name) as f:
        schemas += [json.loads(line)["schema"] for line in f][: cfg["schemas"]]
N, K, G, rounds = cfg["particles"], cfg["block_size"], cfg["requests"], cfg["rounds"]
g = torch.Generator().manual_seed(0)
per_schema = []
for schema in schemas:
    try:
        c = JSONSchema(schema, path="llguidance").bind(model)
    except sd.SMCDecodeError:
        continue
    host = HostMasks(N, V, "cpu")
    for slot in range(G):
        host.add(slot, RequestMasks([c], N, K, 10**6))
    rows = G * N
    step_s, unpack_s, mask_bytes = [], [], 0
    for _ in range(rounds):
        drafts = torch.zeros(rows, K, dtype=torch.long)
        host.begin(rows, K, drafts)
        for i in range(K + 1):
            t0 = time.perf_counter()
            m = host.mask(i)
            step_s.append(time.perf_counter() - t0)
            bits = getattr(host, "W", None)
            if bits is not None:  # packed masks: the unpack inside mask() is the device's work on a GPU
                from smcdecode.potentials.constraint import unpack_bits
                packed = torch.full((rows, bits), -1, dtype=torch.int32)
                t0 = time.perf_counter()
                unpack_bits(packed, V)
                unpack_s.append(time.perf_counter() - t0)
            mask_bytes = rows * (bits * 4 if bits is not None else V)
            choice = m.clone()
            choice[:, eos] = False
            d = torch.multinomial(choice.double() + 1e-30, 1, generator=g)[:, 0]
            t0 = time.perf_counter()
            if i < K:
                drafts[:, i] = d
                if hasattr(host, "drafted"):
                    host.drafted(i, d)
            else:
                host.end(d)
            step_s[-1] += time.perf_counter() - t0
    per_schema.append({"median_step_ms": 1e3 * sorted(step_s)[len(step_s) // 2],
                       "mean_step_ms": 1e3 * sum(step_s) / len(step_s), "mask_bytes": mask_bytes,
                       "median_unpack_ms": 1e3 * sorted(unpack_s)[len(unpack_s) // 2] if unpack_s else 0.0})
print("RESULT " + json.dumps({"smcdecode": sd.__file__, "schemas": per_schema}))
"""


def run_tree(tree: Path, cfg: dict) -> dict:
    from engine_ab import run_tree as run_in_tree  # (benchmarks/ is on sys.path when run as a script)

    return run_in_tree(tree, cfg, WORKER, OMP_NUM_THREADS="1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, type=Path, help="source tree A (the baseline)")
    ap.add_argument("--b", required=True, type=Path, help="source tree B (the change)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--schemas", type=int, default=5, help="schemas from each source file")
    ap.add_argument("--eval", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/eval")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/host_masks_speed.json"))
    args = ap.parse_args()
    sources = [str(args.eval / f"jsonschemabench_{s}.jsonl") for s in ("Glaiveai2K", "Github_easy")]
    trees = {"A": args.a, "B": args.b}
    raw = []
    for G in [int(x) for x in args.requests.split(",")]:
        cfg = {"particles": args.particles, "block_size": args.block_size, "requests": G, "rounds": args.rounds,
               "schemas": args.schemas, "sources": sources}
        for p in range(args.passes):
            for name in ("AB" if p % 2 == 0 else "BA"):
                r = run_tree(trees[name], cfg)
                raw.append({"tree": name, "path": str(trees[name]), "pass": p, **cfg, **r})
                print(f"G={G} pass {p} {name}: median step "
                      f"{statistics.median(s['median_step_ms'] for s in r['schemas']):.2f} ms", flush=True)
    table = []
    for G in sorted({r["requests"] for r in raw}):
        row = {"requests": G, "rows": G * args.particles}
        for name in "AB":
            runs = [r for r in raw if r["tree"] == name and r["requests"] == G]
            row[f"{name}_step_ms"] = statistics.median(
                statistics.median(s["median_step_ms"] for s in r["schemas"]) for r in runs)
            row[f"{name}_mask_bytes"] = runs[0]["schemas"][0]["mask_bytes"]
            row[f"{name}_unpack_ms"] = statistics.median(
                statistics.median(s["median_unpack_ms"] for s in r["schemas"]) for r in runs)
        table.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "cpu_count": os.cpu_count(), "table": table, "raw": raw}, indent=1))
    print("| requests × N | A ms/step | B ms/step | B ms/step less the CPU unpack | A mask bytes | B mask bytes |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['requests']} × {args.particles} | {r['A_step_ms']:.2f} | {r['B_step_ms']:.2f} | "
              f"{r['B_step_ms'] - r['B_unpack_ms']:.2f} | {r['A_mask_bytes']:,} | {r['B_mask_bytes']:,} |")


if __name__ == "__main__":
    main()
