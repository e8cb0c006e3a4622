"""The summary of ``structured_quality.py``'s JSONL rows: coverage, and per subset and method the
validity, log-likelihood and time per output over the schemas every method has a row for."""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

SUBSETS = ("Github_trivial", "Github_easy", "Glaiveai2K")
METHODS = ("smc", "masked", "unconstrained")


def read_rows(files: list[Path]) -> list[dict]:
    """The rows of JSONL ``files``; a line cut short (a run killed while writing it) is left out."""
    rows = []
    for f in files:
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if line.strip():
                    print(f"{f}: left out a line that is not JSON ({line[:60]!r}...)", file=sys.stderr)
    return rows


# -- summary -----------------------------------------------------------------------------------------


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.nan


def coverage(last: dict, totals: dict[str, int] | None) -> tuple[dict, set]:
    """(schemas done per method and subset out of the subset's total, the (subset, id) every method
    present has a row for)."""
    methods = sorted({m for _, _, m in last}, key=METHODS.index)
    done = {m: {(s, i) for s, i, mm in last if mm == m} for m in methods}
    common = set.intersection(*done.values()) if done else set()
    cov = {"methods": {m: {s: sum(ss == s for ss, _ in d) for s in SUBSETS} | {"all": len(d)}
                       for m, d in done.items()},
           "all_methods": {s: sum(ss == s for ss, _ in common) for s in SUBSETS} | {"all": len(common)}}
    if totals is not None:
        cov["of"] = {**totals, "all": sum(totals.values())}
    return cov, common


def summarise(rows: list[dict], totals: dict[str, int] | None = None) -> dict:
    """Per subset (and "all") and method: schemas, compiled, valid, log-likelihood, seconds, over the
    schemas every method has a row for (a partial run compares the methods on the same schemas), and
    the coverage: schemas done per method out of ``totals`` (schemas per subset)."""
    last = {(r["subset"], r["id"], r["method"]): r for r in rows}  # a row written again replaces the old one
    cov, common = coverage(last, totals)
    last = {key: r for key, r in last.items() if key[:2] in common}
    out: dict = {"coverage": cov, "subsets": {}, "not_compiled": {}}
    for subset in (*SUBSETS, "all"):
        per = {}
        for m in METHODS:
            rs = [r for (s, _, mm), r in last.items() if mm == m and subset in ("all", s)]
            if not rs:
                continue
            compiled = [r for r in rs if r.get("compiled")]
            lls = [r["loglik_per_token"] for r in rs if r.get("loglik_per_token") is not None]
            secs = [r["seconds"] for r in rs if r.get("seconds") is not None]
            per[m] = dict(
                schemas=len(rs), compiled=len(compiled) if m != "unconstrained" else None,
                automaton=sum(r.get("path") == "automaton" for r in rs),
                superset=sum(r.get("path") == "superset" for r in rs),
                llguidance=sum(r.get("path") == "llguidance" for r in rs),
                valid=sum(bool(r["valid"]) for r in rs) / len(rs),
                valid_of_compiled=(sum(bool(r["valid"]) for r in compiled) / len(compiled)) if compiled else None,
                parses=sum(bool(r["parses"]) for r in rs) / len(rs),
                no_output=sum(r.get("text") is None for r in rs),
                loglik_per_token=sum(lls) / len(lls) if lls else None, scored=len(lls),
                seconds_mean=sum(secs) / len(secs) if secs else None,
                seconds_p50=_quantile(secs, 0.5) if secs else None, seconds_p99=_quantile(secs, 0.99) if secs else None,
            )
        out["subsets"][subset] = per
    reasons: dict = {}
    for (_, _, m), r in last.items():
        if m != "unconstrained" and r.get("compiled") is False:
            reason = (r.get("reason") or "")[:90]
            reasons[reason] = reasons.get(reason, 0) + 1
    out["not_compiled"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    out["devices"] = sorted({r.get("device") for r in last.values() if r.get("device")})
    return out


def table(summary: dict) -> str:
    def pct(x):
        return "—" if x is None else f"{100 * x:.1f} %"

    def num(x, f="{:.2f}"):
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f.format(x)

    lines = ["| subset | method | schemas | compiled (automaton + superset + llguidance) | valid | valid of compiled | parses "
             "| log-lik / token | s / output mean (p50 / p99) |", "|---|---|---|---|---|---|---|---|---|"]
    for subset, per in summary["subsets"].items():
        for m, s in per.items():
            comp = "—" if s["compiled"] is None else f"{s['compiled']} ({s['automaton']} + {s.get('superset', 0)} + {s['llguidance']})"
            lines.append(f"| {subset} | {m} | {s['schemas']} | {comp} | {pct(s['valid'])} | {pct(s['valid_of_compiled'])} "
                         f"| {pct(s['parses'])} | {num(s['loglik_per_token'], '{:.3f}')} | {num(s['seconds_mean'], '{:.3f}')} "
                         f"({num(s['seconds_p50'], '{:.3f}')} / {num(s['seconds_p99'], '{:.3f}')}) |")
    return "\n".join(lines)


def main_summarise(files: list[Path], summary_out: Path, data: Path) -> None:
    rows = read_rows(files)
    totals = None
    if all((data / f"jsonschemabench_{s}.jsonl").exists() for s in SUBSETS):
        totals = {s: len((data / f"jsonschemabench_{s}.jsonl").read_text().splitlines()) for s in SUBSETS}
    summary = summarise(rows, totals)
    cov = summary["coverage"]
    of = cov.get("of", {})
    print("coverage (schemas with a row, of the subset's schemas):")
    for m, per in cov["methods"].items():
        print(f"  {m:14s} " + ", ".join(f"{s} {n}/{of.get(s, '?')}" for s, n in per.items()))
    print(f"  {'every method':14s} " + ", ".join(f"{s} {n}/{of.get(s, '?')}" for s, n in cov["all_methods"].items()))
    print("(the table below is over the schemas every method has a row for)\n")
    print(table(summary))
    print("\nnot compiled (SMC and masked rows), by reason:")
    for reason, n in list(summary["not_compiled"].items())[:25]:
        print(f"  {n:5d}  {reason}")
    summary_out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "rows_from": [str(f) for f in files], "rows": len(rows)}
    summary_out.write_text(json.dumps({**meta, **summary}, indent=1))
    print(f"\nwrote {summary_out}")
