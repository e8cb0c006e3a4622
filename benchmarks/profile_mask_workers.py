"""Where a host point's time goes with the mask worker processes, on the GPU engine: a timeline of
every draft step's and bonus's masks (``HostMasks._post``: the round's graph waits on the device for
each) in real SMC-SD calls.

The real SmolLM2 pair (``--smollm2-gguf``) or the random 8B/1B shapes, one of structured_engine.py's
schemas on llguidance's path, N = 8, K = 8, up to 256 new tokens, ``--requests`` requests, the
engine's default mask workers. The script times, in the engine's process, each host point's parts:

- ``column``: waiting for the draft column the host point needs (the device samples it);
- ``post``: this process's work before the step record is posted (the items, the shared columns);
- ``workers``: from the record posted to the last process done;
- ``upload``: from the workers done to the point counted (the device then copies the masks up);
- ``between``: from one host point's end to the next's start (after the bonus: the round's end,
  resampling, the next round's start and launch),

and in each worker process (patched before they are forked) the record's start after it was posted
(``wake``), the tokens consumed (``consume``), the slowest worker's fill (``fill``) and, with
``--row-times`` (each row's fill then timed alone, which makes the fill dearer), the dearest single
row of the step (``dearest_row``: with the rows spread perfectly, no host point is shorter) and the
rows' fill times summed over the workers (``rows_sum``). The unconstrained engine at the same
lengths gives the device's round without masks (``plain_ms_per_round``). Each round's parts in the engine's process: ``run_round`` (the
proposal launched, its host points, the host's end of the round and its verdicts, the resampling
launched; a pipelined superset round's read of the round before it too, which ``read`` counts again), ``HostMasks.end`` within it (on the superset path, ``--path superset``: the round's tokens
read and llguidance's check), ``host_terms`` (the verdicts uploaded) and the scheduler's read of the
round. Medians over the host points of the timed calls, in ms; the raw timeline of one call
goes to --out. ``--no-timeline`` times the calls only (an A/B against another tree);
``--pipeline-ab`` times the same calls pipelined and not, alternately, in one process.
Where the mask workers serve a round's host points themselves (every masked request theirs:
``smcdecode/backends/engine/host_points.py``), this process posts no point: ``parts_ms`` is then
empty, and the calls' and the rounds' times remain.

    python benchmarks/profile_mask_workers.py --smollm2-gguf PATH --schema small   # one NVIDIA GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import structured_engine as se  # noqa: E402

import smcdecode as sd  # noqa: E402
from smcdecode.backends.engine import (  # noqa: E402
    Engine,
    EngineConfig,
    host_masks,
    mask_process,
    mask_workers,
    request_masks,
    scheduler,
    smc,
)
from smcdecode.backends.engine.targets import EngineTarget  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

SCHEMAS = {"small": se.DEFAULT_SCHEMA, "contact": se.CONTACT_SCHEMA, "pattern": se.PATTERN_SCHEMA,
           "open": se.OPEN_SCHEMA, "tree": se.TREE_SCHEMA, "held-tree": se.HELD_TREE_SCHEMA}
SLOTS, FIELDS = 1 << 14, 7  # worker records kept: (seq, start, first fill, end, dearest row, rows' sum, rows) each
_board = mmap.mmap(-1, 8 * 16 * SLOTS * FIELDS)  # (shared with the workers forked later)
BOARD = np.frombuffer(_board, dtype=np.float64).reshape(16, SLOTS, FIELDS)


def patch(row_times: bool) -> list:
    """Time each host point's parts here (``HostMasks._post``) and each worker's step there (with ``row_times``, each row's
    fill too); returns the host-point list."""
    points: list = []
    point, step_wait, post = host_masks.HostMasks._post, mask_workers.MaskWorkers.step_wait, mask_workers.MaskWorkers.step
    marks: dict = {}

    def timed_post(self, *a, **k):
        marks["posted0"] = time.perf_counter()
        out = post(self, *a, **k)
        marks["posted"], marks["seq"] = time.perf_counter(), 2 * self._steps
        return out

    def timed_wait(self):
        step_wait(self)
        if "posted" in marks:  # (the wait for the record this host point posted)
            marks.setdefault("done", time.perf_counter())

    def timed_point(self, i):
        marks.clear()
        t0 = time.perf_counter()
        column = host_masks.HostMasks._column
        got: list = []

        def col(h, j):
            c = column(h, j)
            got.append(time.perf_counter())
            return c

        host_masks.HostMasks._column = col
        try:
            point(self, i)
        finally:
            host_masks.HostMasks._column = column
        points.append({"i": i, "start": t0, "column": got[0] if got else t0, "end": time.perf_counter(), **marks})

    host_masks.HostMasks._post = timed_point
    mask_workers.MaskWorkers.step = timed_post
    mask_workers.MaskWorkers.step_wait = timed_wait

    step, fill = mask_process._Worker.step, request_masks.fill_requests
    mine: dict = {}  # (in a worker: this step's first fill, and each row's fill time)

    def worker_step(self, items, turn, bonus, seq):
        t0 = time.perf_counter()
        mine.update(first=None, rows=[])
        step(self, items, turn, bonus, seq)
        end = time.perf_counter()
        rows = mine["rows"] or [0.0]
        BOARD[self.w, (seq // 2) % SLOTS] = (seq, t0, mine["first"] or end, end, max(rows), sum(rows), len(mine["rows"]))

    def worker_fill(items, bits, rows):
        """The worker's fill: with ``row_times``, row by row (each row timed; rows sharing a matcher:
        llguidance's cache), else in one call as the engine makes it (its rows' times unknown)."""
        if mine.get("first") is None:
            mine["first"] = time.perf_counter()
        if not row_times:
            fill(items, bits, rows)
            return
        for m, r in items:
            for j in range(m.n):
                t = time.perf_counter()
                fill([(m.part(j, j + 1), slice(r.start + j, r.start + j + 1))], bits, rows)
                mine["rows"].append(time.perf_counter() - t)

    mask_process._Worker.step = worker_step
    request_masks.fill_requests = worker_fill
    return points


def patch_rounds() -> dict:
    """Time each round's parts in the engine's process: the whole ``run_round`` (the proposal
    launched, its host points, the host's end of round and verdicts, the resampling launched), its
    ``HostMasks.end`` (for checked requests: reading the round's tokens and llguidance's check),
    ``host_terms`` (the verdicts uploaded), and the scheduler's read of the round (``_read``)."""
    spans: dict = {"run_round": [], "end": [], "host_terms": [], "read": []}

    def timed(fn, key):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans[key].append(1e3 * (time.perf_counter() - t))
        return call

    scheduler.run_round = timed(scheduler.run_round, "run_round")
    smc.host_terms = timed(smc.host_terms, "host_terms")
    host_masks.HostMasks.end = timed(host_masks.HostMasks.end, "end")
    scheduler.Scheduler._read = timed(scheduler.Scheduler._read, "read")
    return spans


def parts(points: list, workers: int) -> dict:
    """Each host point's parts (ms), and its workers' (from the board)."""
    out: dict = {k: [] for k in ("column", "post", "workers", "upload", "between", "wake", "consume", "fill",
                                 "dearest_row", "rows_sum", "rows_filled")}
    for p, q in zip(points, points[1:] + [None]):
        out["column"].append(1e3 * (p["column"] - p["start"]))
        if q is not None and q["start"] > p["end"]:
            out["between"].append(1e3 * (q["start"] - p["end"]))
        if "posted" not in p:
            continue
        out["post"].append(1e3 * (p["posted0"] - p["column"]))
        out["workers"].append(1e3 * (p.get("done", p["end"]) - p["posted"]))
        out["upload"].append(1e3 * (p["end"] - p.get("done", p["end"])))
        rows = [BOARD[w, (p["seq"] // 2) % SLOTS] for w in range(workers)]
        rows = [r for r in rows if r[0] == p["seq"]]
        if rows:
            out["wake"].append(1e3 * (max(r[1] for r in rows) - p["posted"]))
            out["consume"].append(1e3 * max(r[2] - r[1] for r in rows))
            out["fill"].append(1e3 * max(r[3] - r[2] for r in rows))
            if any(r[6] for r in rows):  # (the rows' times: --row-times)
                out["dearest_row"].append(1e3 * max(r[4] for r in rows))
                out["rows_sum"].append(1e3 * sum(r[5] for r in rows))
                out["rows_filled"].append(sum(r[6] for r in rows))
    return {k: {"median": statistics.median(v), "mean": statistics.fmean(v), "n": len(v)} for k, v in out.items() if v}


def pipeline_ab(engine, P, kw, args, name, device, sync) -> None:
    """The same calls with ``pipeline=True`` and ``False``, alternately (A/B within one process);
    medians of ms a call and a round; the outputs must be the same."""
    times: dict = {True: [], False: []}
    outs: dict = {}
    engine.smc_sd(P, max_new_tokens=256, pipeline=False, **kw)  # (both variants' rounds captured)
    same = True
    for i in range(args.calls):
        for pipeline in (True, False):  # (each pair with one seed: the same draws)
            sync()
            t0 = time.perf_counter()
            out = engine.smc_sd(P, max_new_tokens=256, pipeline=pipeline, seed=i, **kw)
            sync()
            times[pipeline].append((1e3 * (time.perf_counter() - t0), out.rounds))
            outs[pipeline] = out
        same &= all(torch.equal(getattr(outs[True], k), getattr(outs[False], k))
                    for k in ("tokens", "lengths", "log_weights"))
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": name,
           "schema": args.schema, "path": args.path, "requests": args.requests,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "same_outputs": same,
           "calls_ms": {str(k): v for k, v in times.items()}}
    for pipeline in (True, False):
        ms = [t for t, _ in times[pipeline]]
        res[f"{'pipelined' if pipeline else 'unpipelined'}_ms_median"] = statistics.median(ms)
        res[f"{'pipelined' if pipeline else 'unpipelined'}_ms_per_round"] = statistics.median(t / r for t, r in times[pipeline])
    print(f"{name} {args.schema} {args.path} G={args.requests}: pipelined {res['pipelined_ms_median']:.1f} ms a call "
          f"({res['pipelined_ms_per_round']:.2f} a round), unpipelined {res['unpipelined_ms_median']:.1f} ms "
          f"({res['unpipelined_ms_per_round']:.2f} a round), {args.calls} calls each, alternately; same outputs: {same}",
          flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2-gguf", default=None, help="SmolLM2-135M-Instruct GGUF (default: the random 8B/1B shapes)")
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="small")
    ap.add_argument("--path", choices=("llguidance", "superset"), default="llguidance",
                    help="llguidance's masks (a host point a step) or the superset path (a check a round)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--row-times", action="store_true",
                    help="time each row's fill in the workers (dearest_row, rows_sum; the fill itself then costs more)")
    ap.add_argument("--host-workers", type=int, default=None,
                    help="mask worker processes (0: masks in the engine's process; default: the engine's)")
    ap.add_argument("--cpu", action="store_true", help="on the CPU with two mask workers (checks the script)")
    ap.add_argument("--pipeline-ab", action="store_true",
                    help="time the calls only, pipelined and not (engine.smc_sd's pipeline), alternately, in this process")
    ap.add_argument("--no-timeline", action="store_true",
                    help="time the calls only (no patched timing; runs against a tree without this one's workers)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "structured" / "mask_workers_profile.json")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (or --cpu to check the script)")
    device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    args.no_timeline |= args.pipeline_ab
    points = [] if args.no_timeline else patch(args.row_times)
    spans = patch_rounds() if not args.no_timeline else None
    ns = argparse.Namespace(tiny=False, smollm2_gguf=args.smollm2_gguf, requests=[args.requests], prompt_len=128)
    load = se.smollm2_models if args.smollm2_gguf else se.random_models
    name, target, draft, model, prompts, eos = load(ns, device, dtype)
    engine = Engine(target, draft, EngineConfig(num_pages=8192, page_size=16, max_context=1024,
                                                host_workers=2 if args.cpu and args.host_workers is None else args.host_workers))
    c = JSONSchema(SCHEMAS[args.schema], path=args.path).bind(model)
    kw = dict(particles=8, block_size=8, target=EngineTarget.of(sd.LM(model) * c), eos_token_id=eos)
    P = prompts[: args.requests]
    engine.smc_sd(P, max_new_tokens=256, **kw)  # (captures the rounds, starts the workers)
    if args.pipeline_ab:
        pipeline_ab(engine, P, kw, args, name, device, sync)
        return
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": name, "schema": args.schema, "requests": args.requests,
           "host_workers": engine.config.host_workers,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "calls": []}
    for _ in range(args.calls):
        points.clear()
        for v in (spans or {}).values():
            v.clear()
        sync()
        t0 = time.perf_counter()
        out = engine.smc_sd(P, max_new_tokens=256, **kw)
        sync()
        wall = time.perf_counter() - t0
        call = {"wall_ms": 1e3 * wall, "rounds": out.rounds, "host_points": len(points),
                "parts_ms": parts(points, engine.config.host_workers or 0) if points else {},
                "round_parts_ms": {k: {"median": statistics.median(v), "sum": sum(v), "n": len(v)}
                                   for k, v in (spans or {}).items() if v}}
        res["calls"].append(call)
        print(f"{name} {args.schema} G={args.requests}: {call['wall_ms']:.1f} ms, {out.rounds} rounds, "
              f"{len(points)} host points", flush=True)
        for k, v in call["parts_ms"].items():
            print(f"    {k:12s} median {v['median']:7.3f}  mean {v['mean']:7.3f}  (n={v['n']})", flush=True)
        for k, v in call["round_parts_ms"].items():
            print(f"    round: {k:10s} median {v['median']:7.3f}  sum {v['sum']:7.2f}  (n={v['n']})", flush=True)
    walls = [c["wall_ms"] for c in res["calls"]]
    res["wall_ms_median"] = statistics.median(walls)
    res["ms_per_round"] = statistics.median(c["wall_ms"] / c["rounds"] for c in res["calls"])
    lengths = [max(1, int(out.lengths[g].max())) for g in range(len(P))]
    engine.smc_sd(P, particles=8, block_size=8, max_new_tokens=lengths)  # (captures its rounds)
    plain = []
    for _ in range(args.calls):
        sync()
        t0 = time.perf_counter()
        o = engine.smc_sd(P, particles=8, block_size=8, max_new_tokens=lengths)
        sync()
        plain.append(1e3 * (time.perf_counter() - t0) / o.rounds)
    res["plain_ms_per_round"] = statistics.median(plain)
    print(f"median {res['wall_ms_median']:.1f} ms a call over {len(walls)} calls; {res['ms_per_round']:.2f} ms a "
          f"round, unconstrained at the same lengths {res['plain_ms_per_round']:.2f} ms a round", flush=True)
    t_first = points[0]["start"] if points else 0.0
    res["timeline"] = [{k: (1e3 * (v - t_first) if isinstance(v, float) else v) for k, v in p.items()} for p in points]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
