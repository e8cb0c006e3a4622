"""The host's work on llguidance's path, two source trees A/B in one process: the recorded SmolLM2
rounds of a trace (``host_masks_replay.py record``) replayed through each tree's ``HostMasks`` (the
engine's own process fills every mask, no worker), alternately A B, B A, … so that both variants see
the same CPU speed (separate processes on a shared CPU host differ by more than such a change). Tree
A's package is copied to a temporary folder and imported under another name. Before timing, one
replay of each checks that both trees give the same masks at every host point.

Without ``--fresh`` every replay after the first meets the states and masks the trees keep from the
earlier ones (the same rounds again: what an engine keeps between calls of one schema, at its most);
with ``--fresh`` each tree's constraint forgets them before each replay (each outline met anew; a tree
that keeps none has nothing to forget).

    python benchmarks/host_masks_inprocess_ab.py --a /path/to/old/tree --trace contact
    python benchmarks/host_masks_inprocess_ab.py --a /path/to/old/tree --trace small --fresh --passes 9

Prints µs per host point (a ``mask`` call) for each variant and the median of B/A over the pairs;
raw JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from replay_calls import replay_call

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
OLD = "smcdecode_a"  # (tree A's package, imported under this name)


def replayer(pkg: str, part: dict, fresh: bool):
    """A function that replays ``part`` through package ``pkg``'s HostMasks and returns (seconds, host
    points, the masks' buffer), the masks of every host point appended to ``seen`` where given."""
    sd = importlib.import_module(pkg)
    hm = importlib.import_module(pkg + ".backends.engine.host_masks")
    js = importlib.import_module(pkg + ".potentials.json_schema")
    model = sd.load_model()
    c = js.JSONSchema(part["schema"], path="llguidance", threads=1).bind(model)
    V, rows = model.vocab_size, part["particles"] * part["requests"]

    def forget():
        strings = getattr(c, "_strings", None)
        for kept in (getattr(c, "_outline_masks", None), *(getattr(strings, a, None) for a in
                                                           ("_states", "_next", "_verdicts", "_outlines"))):
            if kept is not None:
                kept.clear()

    def run(seen: list | None = None):
        if fresh:
            forget()
        host = hm.HostMasks(part["particles"], V, "cpu", rows=rows, k_max=64, workers=0)
        bits = torch.zeros(rows, (V + 31) // 32, dtype=torch.int32)
        points, t = 0, time.perf_counter()
        for name, a in part["events"]:
            if name == "add":
                slot, n, K, budget = a
                host.add(slot, hm.RequestMasks([c], n, K, budget, lane=slot * part["particles"]))
            else:
                replay_call(host, name, a, bits, {})
                points += name == "mask"
                if seen is not None and name == "mask":
                    seen.append(bits.numpy().tobytes())
        seconds = time.perf_counter() - t
        host.close()
        return seconds, points, bits

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="the other source tree (A)")
    ap.add_argument("--b", type=Path, default=ROOT, help="the source tree (B; default: this one)")
    ap.add_argument("--trace", default="contact", help="host_masks_trace_<trace>.json in benchmarks/results")
    ap.add_argument("--requests", type=int, default=1, help="the trace's part: 1 or 8 requests")
    ap.add_argument("--passes", type=int, default=15, help="pairs of replays (A B, then B A, …)")
    ap.add_argument("--fresh", action="store_true", help="each tree forgets its kept states and masks before each replay")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trace = RESULTS / f"host_masks_trace_{args.trace}.json"
    for flag, tree in (("--a", args.a), ("--b", args.b)):
        if not (tree / "smcdecode" / "__init__.py").exists():
            raise SystemExit(f"{flag} {tree}: no smcdecode package there")
    if not trace.exists():
        raise SystemExit(f"--trace {args.trace}: {trace} not found (record one with host_masks_replay.py record)")
    parts = [p for p in json.loads(trace.read_text())["parts"] if p["requests"] == args.requests]
    if not parts:
        raise SystemExit(f"--requests {args.requests}: the trace has no part of that many requests")
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    try:
        shutil.copytree(args.a / "smcdecode", tmp / OLD, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
        drafts = args.a / "smcdecode" / "drafts"
        for f in drafts.rglob("*.safetensors"):  # (linked, not copied: the default draft's weights)
            (tmp / OLD / "drafts" / f.relative_to(drafts)).symlink_to(f)
        sys.path[:0] = [str(tmp), str(args.b)]
        A, B = replayer(OLD, parts[0], args.fresh), replayer("smcdecode", parts[0], args.fresh)
        masks_a, masks_b = [], []
        A(masks_a), B(masks_b)
        if masks_a != masks_b:
            raise SystemExit("the two trees gave different masks in the same replay")
        times: dict = {"A": [], "B": []}
        for i in range(args.passes):
            for name, run in ((("A", A), ("B", B)) if i % 2 == 0 else (("B", B), ("A", A))):
                seconds, points, _ = run()
                times[name].append(1e6 * seconds / points)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = statistics.median(b / a for a, b in zip(times["A"], times["B"]))
    for name in "AB":
        print(f"{name}: median {statistics.median(times[name]):.1f} µs a host point (min {min(times[name]):.1f})")
    print(f"B/A over the pairs: median {ratio:.3f} ({args.trace}, {args.requests} request(s), "
          f"{'fresh' if args.fresh else 'kept'} states, {args.passes} pairs)")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "cpu_count": os.cpu_count(),
           "a": str(args.a.resolve()), "b": str(args.b.resolve()), "trace": trace.name, "requests": args.requests,
           "fresh": args.fresh, "us_per_point": times, "b_over_a_median": ratio}
    out = args.out or RESULTS / f"host_masks_inprocess_ab_{args.trace}{'_fresh' if args.fresh else ''}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
