"""Reads engine_variants.py's variants.json (e2e rows) and prints the environment that keeps, for each
A/B variant, the faster side of SMC-SD N=8 K=8 (1 and 8 requests, summed relative time): one
`export NAME=VALUE` line per variant that beat the default by more than 1 %. Used between the A/B
run and bench_engine.py in one device call:

    python benchmarks/pick_variant_env.py /tmp/ab/variants.json > /tmp/env.sh && source /tmp/env.sh
"""

from __future__ import annotations

import json
import shlex
import sys


def main(path: str) -> None:
    rows = [r for r in json.load(open(path)).get("e2e", []) if "error" not in r and r["strategy"].startswith("SMC")]
    by = {(r["strategy"], r["variant"]): r["s"] for r in rows}
    strategies = sorted({s for s, _ in by})
    base = {s: by.get((s, "default")) for s in strategies}
    picked = []
    for name in sorted({v for _, v in by} - {"default"}):
        rel = [by[(s, name)] / base[s] for s in strategies if (s, name) in by and base[s]]
        if rel and all(r < 1.0 for r in rel) and sum(rel) / len(rel) < 0.99:
            env = next(r["env"] for r in rows if r["variant"] == name)
            picked.append((name, env, rel))
    for name, env, rel in picked:
        print(f"# {name}: {' '.join(f'{x:.3f}' for x in rel)} of the default's time", file=sys.stderr)
        for k, v in env.items():
            print(f"export {k}={shlex.quote(v)}")


if __name__ == "__main__":
    main(sys.argv[1])
