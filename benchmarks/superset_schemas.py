"""The JSONSchemaBench schemas that ``benchmarks/results/schema_compile.json`` left to llguidance's path
and that path "auto" now takes on the superset path: those with a string ``format`` or ``pattern``,
where the superset keeps a format of ``schema_regex.SUPERSET_FORMATS`` (or a pattern beside a length)
instead of widening it to any string. Writes their [subset, id] list (for
``structured_quality.py --only``) and the count of each path they take now.

    python benchmarks/superset_schemas.py        # CPU, about a minute
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


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout


def main() -> None:
    from smcdecode.potentials.json_schema import JSONSchema

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=EVAL)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds a schema's compile may take")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/structured/superset_schemas.json")
    args = ap.parse_args()
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
                path = JSONSchema(r["schema"], extra_properties=False).path
            except _Timeout:
                path = f"compile over {args.timeout:g} s"
            except Exception as e:  # noqa: BLE001 - counted, never a crash
                path = type(e).__name__
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            now[path] += 1
            if path == "superset":
                moved.append([subset, r["id"]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"now": dict(now), "superset": moved}, indent=0))
    print(f"llguidance-path schemas with a format or pattern, by the path auto takes now: {dict(now)}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
