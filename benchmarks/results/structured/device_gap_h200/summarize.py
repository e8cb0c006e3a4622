"""The mask workers' records of a run of twice.py, per row: each host point's device gap (from the
last worker's count to the first worker seeing the next column), its span on the host (first
worker starting to last finishing) and the slowest worker's lead over the median one, and each
round's time in a worker; plus the rows' ratios and the per-row probes. Usage:
    python summarize.py WLOG_DIR OUT.json
WLOG_DIR holds rows.json and the workers' w<pid>.jsonl files (twice.py's WLOG)."""
import collections
import glob
import json
import statistics as st
import sys
from pathlib import Path


def load(d: Path):
    rows = json.loads((d / "rows.json").read_text())
    plans = []
    for f in glob.glob(str(d / "w*.jsonl")):
        pid = Path(f).stem[1:]
        for line in open(f):
            p = json.loads(line)
            p["pid"] = pid
            plans.append(p)
    return rows, sorted(plans, key=lambda p: p["t0"])


def points(ps: list) -> list:
    """One round's workers' records -> per worker {point: (seen its column, work start, work end)}. A
    worker's point is the number of columns it waited for before it (it waits for column i − 1 before
    point i > 0, and records nothing at a point where it has no rows)."""
    per = []
    for p in ps:
        pts, h, i = {}, None, 0
        for x in p["pts"]:
            if x[0] == "h":
                h, i = x[2], i + 1
            elif x[0] == "w":
                pts[i] = (h, x[1], x[2])
                h = None
        per.append(pts)
    return per


def q(x: list, f: float) -> float:
    return sorted(x)[min(len(x) - 1, int(f * len(x)))] if x else float("nan")


def summarize(rows, plans) -> list:
    """Per row of ``rows``: its ratio and call times, and from the workers' records of its rounds the
    device gap after each point, each point's span, the slowest worker's lead over the median one,
    a worker's round, the time from a round's start to its first work (at the round's first point
    with rows), the workers' CPUs, and the probes twice.py took after the row."""
    out = []
    for r in rows:
        mine = [p for p in plans if r["t0"] <= p["t0"] <= r["t1"]]
        rounds = collections.defaultdict(list)
        for p in mine:
            rounds[p["seq"]].append(p)
        gaps, spans, lead, first = [], [], [], []
        for ps in rounds.values():
            if len(ps) < 2:
                continue
            per = points(ps)
            # (the device waits, at point i, for the workers with rows there; the others count it at once)
            for i in sorted(set().union(*per)):
                have = [x[i] for x in per if i in x]
                done = [w[2] for w in have]
                spans.append(max(done) - min(w[1] for w in have))
                lead.append(max(done) - st.median(done))
                seen = [x[i + 1][0] for x in per if i + 1 in x and x[i + 1][0] is not None]
                if seen:
                    gaps.append(min(seen) - max(done))
            low = min(min(x) for x in per if x)
            first.append(min(x[low][1] for x in per if low in x) - min(p["t0"] for p in ps))
        ms = lambda x: {"median": 1e3 * st.median(x), "p90": 1e3 * q(x, 0.9)} if x else None  # noqa: E731
        out.append({k: r[k] for k in ("name", "label", "path", "held", "G", "take", "ratio")}
                   | {"constrained_s": r["con"], "plain_same_length_s": r["same"],
                      "rounds_served": len(rounds), "worker_pids": sorted({p["pid"] for p in mine}),
                      "device_gap_ms": ms(gaps), "point_span_ms": ms(spans), "slowest_lead_ms": ms(lead),
                      "round_in_worker_ms": ms([p["t1"] - p["t0"] for p in mine]),
                      "first_work_after_plan_ms": ms(first),
                      "worker_cpus": sorted({p["cpu"] for p in mine}),
                      "worker_involuntary_switches": sum(p["nivcsw"] for p in mine)}
                   | {k: r[k] for k in ("probe", "numa") if k in r})
    return out


if __name__ == "__main__":
    rows, plans = load(Path(sys.argv[1]))
    res = summarize(rows, plans)
    Path(sys.argv[2]).write_text(json.dumps(res, indent=1))
    for r in res:
        g = r["device_gap_ms"]
        if g:
            print(f"{r['name'][:10]} G={r['G']} {r['label'][:18]:18} {r['path'][:10]:10} held={r['held']!s:5} take {r['take']!s:13} "
                  f"{100 * r['ratio']:5.1f} %  device gap {g['median']:.3f} (p90 {g['p90']:.3f}) ms, point span "
                  f"{r['point_span_ms']['median']:.3f} ms, round in a worker {r['round_in_worker_ms']['median']:.2f} ms")
