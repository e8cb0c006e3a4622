"""Do this host's CPUs slow each other? For each CPU, a fixed piece of pure-Python work (dictionary
reads and list appends, like the mask workers' per-row code) is timed pinned to that CPU alone, then
with one busy process (a Python loop) pinned to each other CPU in turn, and then with every other CPU
busy. On a machine whose CPUs are independent cores every ratio is about 1; on virtual CPUs that share
physical cores (with each other or with other machines' work) some are about 2.

    python benchmarks/cpu_contention.py                 # every CPU (about 30 s on 16)
    python benchmarks/cpu_contention.py --cpus 0,1,2

Writes benchmarks/results/cpu_contention_<host>.json (or --out) and prints each CPU's row: its time
alone (the best of 7) and the ratio with a busy process on each other CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def work(n: int = 60000) -> int:
    d = {i: i * 3 for i in range(512)}
    acc, lst = 0, []
    for i in range(n):
        acc += d[i & 511]
        lst.append(acc & 7)
        if len(lst) > 64:
            lst.clear()
    return acc


def best_ms(reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def busy(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    x = 0
    while not stop.value:
        x += 1


def with_busy(cpu: int, others: list[int]) -> float:
    """The work's best time on ``cpu`` while a busy process runs on each of ``others``."""
    ctx = mp.get_context("fork")
    stop = ctx.Value("i", 0)
    procs = [ctx.Process(target=busy, args=(b, stop)) for b in others]
    for p in procs:
        p.start()
    time.sleep(0.05)
    os.sched_setaffinity(0, {cpu})
    try:
        return best_ms()
    finally:
        stop.value = 1
        for p in procs:
            p.join()


def main() -> None:
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("cpu_contention.py pins processes to CPUs: it needs Linux (os.sched_setaffinity)")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default=None, help="comma-separated CPUs to time (default: every CPU this process may use)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    asked = cpus if args.cpus is None else [int(c) for c in args.cpus.split(",")]
    bad = [c for c in asked if c not in cpus]
    if bad:
        raise SystemExit(f"--cpus: {bad} not among this process's CPUs {cpus}")
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        lscpu = f"lscpu failed: {e}"
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
           "cpus": cpus, "lscpu": lscpu, "rows": {}}
    for a in asked:
        os.sched_setaffinity(0, {a})
        alone = best_ms()
        ratios = {b: with_busy(a, [b]) / alone for b in cpus if b != a}
        every = with_busy(a, [b for b in cpus if b != a]) / alone
        os.sched_setaffinity(0, set(cpus))
        res["rows"][a] = {"alone_ms": alone, "ratio_with_one_busy": ratios, "ratio_with_every_other_busy": every}
        print(f"cpu {a:2d}: alone {alone:5.2f} ms; with one busy on " + " ".join(f"{b}:{r:.2f}" for b, r in ratios.items())
              + f"; every other busy: {every:.2f}", flush=True)
    alone = [r["alone_ms"] for r in res["rows"].values()]
    worst = [max(r["ratio_with_one_busy"].values()) for r in res["rows"].values()]
    print(f"alone: {min(alone):.2f}-{max(alone):.2f} ms; the worst single busy neighbour: x{min(worst):.2f}-x{max(worst):.2f}")
    out = args.out or RESULTS / f"cpu_contention_{platform.node() or 'host'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
