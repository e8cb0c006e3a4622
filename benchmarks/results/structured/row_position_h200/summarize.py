"""The SmolLM2 eight-request contact record on llguidance's path (strings' automata) in every process of
this folder: structured_engine's own row, then the same row measured again in that process on the run's
own engine and on a new engine over the same models (ctx4.py's "ABAB"), from the raw files here.

    python benchmarks/results/structured/row_position_h200/summarize.py
"""

import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {"alone": "SmolLM2 rows, 1 and 8 requests (every schema)", "only": "8 requests, contact only",
        "all": "8 requests, every schema", "gone": "1 and 8 requests (the one-request rows first), contact only",
        "full": "SmolLM2 rows, 1 and 8 requests (every schema)", "rand": "random 8B/1B rows, then SmolLM2's (every row)",
        "full_run_8": "random 8B/1B rows, then SmolLM2's (every row)"}


def is_row(r):
    return (r.get("schema") == "contact" and r.get("path") == "llguidance" and r.get("held_strings")
            and r.get("requests") == 8 and "SmolLM2" in r.get("model", "") and "error" not in r)


def ms(xs):
    return f"{1e3 * statistics.median(xs):.0f}"


def line(r):
    return (f"{100 * r['ratio_same_length']:.1f} % (constrained {ms(r['constrained_seconds'])} ms, "
            f"unconstrained {ms(r['plain_same_length_seconds'])} ms; mask workers' CPU "
            f"{1e3 * r['children_cpu_s_per_constrained_call']:.0f} ms a call)")


print("| machine | process | structured_engine ran | its contact row | then, in the same process: own engine, new engine, own, new |")
print("|---|---|---|---|---|")
# the processes in the order they ran (each machine in turn)
ORDER = {"machine1": ["alone"], "machine2": ["only", "all"],
         "machine3": ["gone1", "only1", "gone2", "only2", "full1", "only3", "full_run_8", "rand1"]}
for machine, names in ORDER.items():
    for name in names:
        log = HERE / machine / (f"{name}.log" if name.startswith("full_run") else
                              f"ctx{3 if name == 'alone' else 4}_{name}.txt")
        kind = name if name == "full_run_8" else name.rstrip("0123456789")
        se = next((p for p in (HERE / machine).glob(f"*se_{name}.json")), None)
        if log.suffix == ".log":
            se = log.with_suffix(".json")
        if se is not None:
            row = line(next(r for r in json.loads(se.read_text())["rows"] if is_row(r)))
        else:  # (the call brought back 8 files at most: this run's JSON stayed behind; its log line, rounded)
            m = re.search(r"G=8 contact llguidance \(held strings\): .*?: (\d+) % a pair", log.read_text())
            row = f"{m.group(1)} % (log, rounded)"
        abab = next((p for p in (HERE / machine).glob(f"ctx4_abab_{name}.json")), None)
        tl = next((p for p in (HERE / machine).glob(f"tl_ctx3_{name}.json")), None)
        after = ""
        if abab is not None:
            after = ", ".join(f"{100 * r['ratio_same_length']:.1f}" for r in json.loads(abab.read_text())["rows"]) + " %"
        elif tl is not None:
            t = json.loads(tl.read_text())
            after = "timeline (3 stamped pairs, median ratio): " + ", ".join(
                f"{k}: {100 * sorted(p / c for c, p in zip(t[k]['call_ms'], t[k]['plain_same_length_call_ms']))[1]:.1f} %"
                for k in ("A_own", "B_own_recaptured", "C_new_engine"))
        print(f"| {machine} | {name} | {RUNS[kind]} | {row} | {after} |")

# the run's own engine against a new one: each measurement on the new engine less the one before it on the own
diffs = []
for path in sorted(HERE.glob("machine*/ctx4_abab_*.json")):
    r = [x["ratio_same_length"] for x in json.loads(path.read_text())["rows"]]
    diffs += [100 * (r[1] - r[0]), 100 * (r[3] - r[2])]
print(f"\nnew engine less own engine, {len(diffs)} pairs in {len(diffs) // 2} processes: mean "
      f"{statistics.mean(diffs):+.1f} points, {min(diffs):+.1f} to {max(diffs):+.1f}; the new one faster in "
      f"{sum(d > 0 for d in diffs)}")
