"""A mask worker's step, timed inside the worker: the recorded SmolLM2 rounds of a schema
(``host_masks_replay.py record``) replayed through a CPU ``HostMasks`` with one mask worker process,
whose step records (consume the drafted tokens, fill the masks) are timed where they run (wall
clock and the worker thread's CPU time). With
``--a OLD --b NEW`` (two source trees) the processes alternate A B B A …, ``--passes`` pairs.

    python benchmarks/worker_step_time.py --b .                        # this tree
    python benchmarks/worker_step_time.py --a /path/to/old --b . --passes 4

One request (8 rows, a worker's share with eight requests on eight workers) by default; ``--requests 8``
gives the worker all 64 rows. Prints µs a step per process and the medians; raw JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

WORKER = r"""
import json, sys, time
sys.path.insert(0, json.loads(sys.argv[1])["bench"])
from replay_calls import replay_call, start
import torch
import smcdecode as sd
from smcdecode.backends.engine import mask_process
from smcdecode.backends.engine.host_masks import HostMasks, RequestMasks
from smcdecode.potentials.json_schema import JSONSchema
cfg, model = start()
step = mask_process._Worker.step
timed = {"n": 0, "s": 0.0, "cpu": 0.0}

def timed_step(self, mine, turn, bonus, seq):  # (patched before the worker is forked)
    t, c = time.perf_counter(), time.thread_time()
    step(self, mine, turn, bonus, seq)
    timed["s"] += time.perf_counter() - t
    timed["cpu"] += time.thread_time() - c
    timed["n"] += 1
    if timed["n"] % 50 == 0:
        with open(cfg["stats"], "w") as f:
            f.write(json.dumps([timed["n"], timed["s"], timed["cpu"]]))

mask_process._Worker.step = timed_step
trace = json.load(open(cfg["trace"]))
V = model.vocab_size
part = next(p for p in trace["parts"] if p["requests"] == cfg["requests"])
c = JSONSchema(part["schema"], path="llguidance", threads=1).bind(model)
rows = part["particles"] * part["requests"]
host = HostMasks(part["particles"], V, "cpu", rows=rows, k_max=64, workers=1)
bits = torch.empty(rows, (V + 31) // 32, dtype=torch.int32)
for _ in range(cfg["replays"]):
    host.clear()
    for name, a in part["events"]:
        if name == "add":
            slot, n, K, budget = a
            host.add(slot, RequestMasks([c], n, K, budget, lane=slot * part["particles"]))
        else:
            replay_call(host, name, a, bits, {"handed": True})
host.close()
print("RESULT " + json.dumps({"smcdecode": sd.__file__}))
"""


def one(tree: Path, trace: Path, requests: int, replays: int, stats: Path) -> dict:
    stats.unlink(missing_ok=True)
    cfg = {"trace": str(trace), "requests": requests, "replays": replays, "stats": str(stats), "bench": str(BENCH)}
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cfg)], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=1800)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line or not stats.exists():
        raise SystemExit(f"the replay in {tree} failed:\n{out.stderr[-3000:]}")
    n, s, cpu = json.loads(stats.read_text())
    return {"tree": str(tree), "smcdecode": json.loads(line[0][7:])["smcdecode"], "steps": n, "us_per_step": 1e6 * s / n,
            "cpu_us_per_step": 1e6 * cpu / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, default=None, help="another source tree (A)")
    ap.add_argument("--b", type=Path, default=Path("."), help="the source tree (B)")
    ap.add_argument("--trace", type=Path, default=RESULTS / "host_masks_trace_contact.json")
    ap.add_argument("--requests", type=int, default=1, help="the trace's part: 1 or 8 requests")
    ap.add_argument("--replays", type=int, default=12, help="replays of the part per process")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trees = {"B": args.b.resolve()} | ({"A": args.a.resolve()} if args.a else {})
    for name, tree in trees.items():
        if not (tree / "smcdecode" / "__init__.py").exists():
            raise SystemExit(f"--{name.lower()} {tree}: no smcdecode package there")
    if not args.trace.exists():
        raise SystemExit(f"--trace {args.trace}: not found (record one with host_masks_replay.py record)")
    stats = Path(f"/tmp/worker_step_time_{os.getpid()}.json")
    raw = []
    for p in range(args.passes):
        order = list(trees) if p % 2 == 0 else list(reversed(trees))
        for name in order:
            r = one(trees[name], args.trace.resolve(), args.requests, args.replays, stats) | {"variant": name, "pass": p}
            raw.append(r)
            print(f"pass {p} {name}: {r['us_per_step']:.1f} µs a step, {r['cpu_us_per_step']:.1f} µs of the worker's CPU "
                  f"({r['steps']} steps; {r['smcdecode']})", flush=True)
    stats.unlink(missing_ok=True)
    for name in trees:
        got = [r["us_per_step"] for r in raw if r["variant"] == name]
        cpu = [r["cpu_us_per_step"] for r in raw if r["variant"] == name]
        print(f"{name} ({trees[name]}): median {statistics.median(got):.1f} µs a step (each {', '.join(f'{g:.0f}' for g in got)}), "
              f"CPU {statistics.median(cpu):.1f} µs (each {', '.join(f'{g:.0f}' for g in cpu)})")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "cpu_count": os.cpu_count(),
           "trace": args.trace.name, "requests": args.requests, "replays": args.replays, "raw": raw}
    out = args.out or RESULTS / f"worker_step_time_{args.trace.stem.removeprefix('host_masks_trace_')}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
