"""The JSONSchemaBench schemas that ``benchmarks/results/schema_compile.json`` left to llguidance's path
that have a string ``format`` or ``pattern`` and whose superset widens none of them to any string (it
keeps a format of ``schema_regex.SUPERSET_FORMATS`` as its regular superset, a pattern beside a length
alone). Writes their [subset, id] list (for ``structured_quality.py --only``,
which compares the superset path with llguidance's masks on them) and the count of each kind.

    python benchmarks/superset_schemas.py        # CPU, about a minute
    # the schemas' SMC-SD outputs on both paths (GPU), then their comparison on the schemas both ran
    python benchmarks/structured_quality.py --only benchmarks/results/structured/superset_schemas.json \
        --path superset --methods smc --out A.jsonl ...     # and --path llguidance --out B.jsonl
    python benchmarks/superset_schemas.py --compare A.jsonl B.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "data" / "eval"
SUBSETS = ("Github_trivial", "Github_easy", "Glaiveai2K")


def main() -> None:
    from quality_compile import _alarm, _Timeout  # (benchmarks/ is on sys.path when run as a script)

    from smcdecode.potentials.json_schema import JSONSchema

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=EVAL)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds a schema's compile may take")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/structured/superset_schemas.json")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("SUPERSET", "LLGUIDANCE"), default=None,
                    help="structured_quality.py rows of the two paths: compare them on the schemas both ran")
    ap.add_argument("--compare-out", type=Path, default=ROOT / "benchmarks/results/structured/superset_quality.json")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare, args.compare_out)
    before = {(r["subset"], r["id"]): r["path"]
              for r in json.loads((ROOT / "benchmarks/results/schema_compile.json").read_text())["schemas"]}
    signal.signal(signal.SIGALRM, _alarm)
    moved, now = [], collections.Counter()
    for subset in SUBSETS:
        for line in (args.data / f"jsonschemabench_{subset}.jsonl").read_text().splitlines():
            r = json.loads(line)
            text = json.dumps(r["schema"])
            if before.get((subset, r["id"])) != "llguidance" or ('"format"' not in text and '"pattern"' not in text):
                continue
            signal.setitimer(signal.ITIMER_REAL, args.timeout)
            try:
                wider = JSONSchema(r["schema"], extra_properties=False, path="superset").superset_widens
                strings = [w for w in wider if w.startswith(("format", "pattern"))]
                path = ("no format or pattern widened" if not strings else "formats and patterns kept"
                        if not any("(any string)" in w for w in strings) else "one widened to any string")
            except _Timeout:
                path = f"compile over {args.timeout:g} s"
            except Exception as e:  # noqa: BLE001 - counted, never a crash
                path = type(e).__name__
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            now[path] += 1
            if path in ("formats and patterns kept", "no format or pattern widened"):
                moved.append([subset, r["id"]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"now": dict(now), "superset": moved}, indent=0))
    print(f"llguidance-path schemas with a format or pattern, by their superset: {dict(now)}")
    print(f"wrote {args.out}")


def compare(a: Path, b: Path, out: Path) -> None:
    """Valid outputs, outputs with no sample (compiled, no text) and schemas not compiled, over the
    schemas both files have a row for, and over those the first file ran on the superset path."""
    rows = [{(r["subset"], r["id"]): r for r in map(json.loads, f.read_text().splitlines())} for f in (a, b)]
    common = sorted(set(rows[0]) & set(rows[1]))
    res = {"files": [str(a), str(b)]}
    for scope, keys in (("both", common), ("first_on_superset", [k for k in common if rows[0][k]["path"] == "superset"])):
        part = {"schemas": len(keys)}
        for name, rs in zip(("first", "second"), rows):
            secs = [rs[k]["seconds"] for k in keys if rs[k].get("seconds") is not None]
            part[name] = {"valid": sum(bool(rs[k].get("valid")) for k in keys),
                          "no_sample": sum(bool(rs[k].get("compiled")) and not rs[k].get("text") for k in keys),
                          "not_compiled": sum(not rs[k].get("compiled") for k in keys),
                          "paths": dict(collections.Counter(str(rs[k]["path"]) for k in keys)),
                          "seconds_per_output_mean": sum(secs) / len(secs) if secs else None}
        part["valid_in_first_only"] = sum(bool(rows[0][k].get("valid")) and not rows[1][k].get("valid") for k in keys)
        part["valid_in_second_only"] = sum(bool(rows[1][k].get("valid")) and not rows[0][k].get("valid") for k in keys)
        res[scope] = part
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
