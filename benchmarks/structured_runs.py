"""The speed table of docs/constraints.md from ``structured_engine.py`` runs: each row of the
latest run given (the last file), with the range of the row's ratio over every run given.

    python benchmarks/structured_runs.py RUN1.json RUN2.json ... LATEST.json

A row is a model, a number of requests, a schema, a path and whether the strings' automata gave the
masks inside strings; the ratio is each row's median over its pairs of calls of the constrained
call's tok/s over the unconstrained one's at the same lengths (``ratio_same_length``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def key(row: dict) -> tuple:
    return row["model"], row["requests"], row["schema"], row["path"], bool(row.get("held_strings"))


def path_label(row: dict) -> str:
    """The path, and whether the constraint was asked for it (``path="llguidance"`` …) rather than let
    ``path="auto"`` choose."""
    return row["path"] + (" (insisted on)" if row.get("path_asked") not in (None, "auto") else "")


def inside(row: dict) -> str:
    if row["path"] == "automaton":
        return "—"
    if row["path"] == "superset":
        return "automata (masks at the switch)"
    return "automata" if row.get("held_strings") else "llguidance's walk"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="structured_engine.py JSON files, the latest last")
    args = ap.parse_args()
    runs = [json.loads(p.read_text()) for p in args.runs]
    ratios: dict = {}
    for run in runs:
        for r in run["rows"]:
            if "ratio_same_length" in r:
                ratios.setdefault(key(r), []).append(r["ratio_same_length"])
    latest = runs[-1]
    print(f"latest: {args.runs[-1]} ({latest['date'][:10]}, {latest['rows'][0].get('device', '?')}); "
          f"ranges over {len(runs)} runs\n")
    print("| model | requests | schema | path | inside strings | unconstrained, 256 tokens | unconstrained, same lengths "
          "| constrained | of same-length plain | over the runs | ms / round (constrained vs plain) | valid |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|---:|---|---:|")
    for r in latest["rows"]:
        if "ratio_same_length" not in r:
            why = r.get("error", r.get("skipped", ""))
            why = "no particle ended a document in 256 tokens" if "no particle finished" in why else why[-80:]
            print(f"| {r['model']} | {r['requests']} | {r['schema']} | {r['path']} | | not measured: {why} | | | | | | |")
            continue
        got = ratios[key(r)]
        spread = f"{100 * min(got):.0f}–{100 * max(got):.0f} %" if len(got) > 1 else "—"
        print(f"| {r['model']} | {r['requests']} | {r['schema']} | {path_label(r)} | {inside(r)} | "
              f"{r['plain_tok_s']:,.0f} | {r['plain_same_length_tok_s']:,.0f} | {r['constrained_tok_s']:,.0f} | "
              f"**{100 * r['ratio_same_length']:.0f} %** | {spread} | {r['ms_per_round_constrained']:.1f} vs "
              f"{r['ms_per_round_plain_same_length']:.1f} | {r['documents_valid']} / {r['documents_ended']} |")


if __name__ == "__main__":
    main()
