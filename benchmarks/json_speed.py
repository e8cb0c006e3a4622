"""generate_json on JSONSchemaBench schemas: time, validity and schema echoes, SMC against masked decoding.

For a seeded sample of schemas from ../shared/data/eval (the JSONSchemaBench subsets), runs
``generate_json`` with the default model on the CPU, once with SMC (N particles, the target as
proposal) and once with locally-masked decoding, and records per run: seconds, whether the
returned document validates, the rounds and the tokens each particle generated, how many particles
ended with weight 0, and whether the document *echoes the schema* (a top-level key that is a JSON
Schema keyword — ``type``, ``properties``, ``$schema``, … — and not a property the schema declares).
Raw results go to benchmarks/results/ as JSON; a one-line summary per method is printed.

    python benchmarks/json_speed.py --label after             # 9 schemas, 5-6 minutes on 2 busy cores
    python benchmarks/json_speed.py --per-subset 1 --label quick
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "eval"
SUBSETS = ["Github_trivial", "Github_easy", "Glaiveai2K"]
USER = "Generate one realistic example object for this schema."
KEYWORDS = {
    "$schema", "$id", "$ref", "$defs", "definitions", "type", "properties", "required", "items",
    "additionalProperties", "title", "description", "enum", "const", "format", "pattern", "anyOf",
    "oneOf", "allOf", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "default",
}

sys.path.insert(0, str(ROOT))
import smcdecode as sd  # noqa: E402
from smcdecode.structured import generate_json  # noqa: E402


def sample_schemas(per_subset: int, max_chars: int, seed: int, data: Path = DATA) -> list[tuple[str, str, dict]]:
    """``per_subset`` schemas of each subset after a seeded shuffle, among those of at most
    ``max_chars`` characters that compile."""
    out = []
    for subset in SUBSETS:
        rows = [json.loads(line) for line in open(data / f"jsonschemabench_{subset}.jsonl")]
        random.Random(seed).shuffle(rows)
        taken = 0
        for r in rows:
            if taken == per_subset:
                break
            if len(json.dumps(r["schema"])) > max_chars:
                continue
            try:
                sd.JSONSchema(r["schema"])
            except sd.SMCDecodeError:
                continue
            out.append((subset, r["id"], r["schema"]))
            taken += 1
    return out


def echoes_schema(value, schema: dict) -> bool:
    """A top-level key of ``value`` that is a JSON Schema keyword the schema does not declare."""
    if not isinstance(value, dict):
        return False
    declared = set(schema.get("properties", {}))
    return any(k in KEYWORDS and k not in declared for k in value)


def run_one(model, schema: dict, strategy: str, particles: int, max_new_tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    out = generate_json(
        model, USER, schema, strategy=strategy, particles=particles, max_new_tokens=max_new_tokens, seed=seed
    )
    seconds = time.perf_counter() - t0
    r = out.result
    raw = None if out.value is None else json.loads(out.text)
    return {
        "seconds": seconds,
        "valid": out.value is not None,
        "text": out.text,
        "echo": raw is not None and echoes_schema(raw, schema),
        "tokens": [len(t) for t in r.tokens],
        "zero_weight": int(sum(1 for w in r.weights.tolist() if w == 0)),
        "rounds": r.rounds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-subset", type=int, default=3)
    p.add_argument("--max-schema-chars", type=int, default=1200)
    p.add_argument("--particles", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--label", default="run")
    p.add_argument("--data", default=str(DATA), help="the folder of the JSONSchemaBench files")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = sd.load_model()
    schemas = sample_schemas(args.per_subset, args.max_schema_chars, args.seed, Path(args.data))
    rows = []
    for k, (subset, sid, schema) in enumerate(schemas):
        row = {"subset": subset, "id": sid}
        for strategy, n in (("smc", args.particles), ("masked", 1)):
            row[strategy] = run_one(model, schema, strategy, n, args.max_new_tokens, args.seed + k)
        rows.append(row)
        print(
            f"[{k + 1}/{len(schemas)}] {subset}/{sid}: "
            + "  ".join(
                f"{s} {row[s]['seconds']:.1f}s {'valid' if row[s]['valid'] else 'none'}{' echo' if row[s]['echo'] else ''}"
                f" max {max(row[s]['tokens'])} tok"
                for s in ("smc", "masked")
            ),
            file=sys.stderr,
        )
    summary = {}
    for s in ("smc", "masked"):
        runs = [r[s] for r in rows]
        summary[s] = {
            "runs": len(runs),
            "median_seconds": statistics.median(r["seconds"] for r in runs),
            "total_seconds": sum(r["seconds"] for r in runs),
            "valid": sum(r["valid"] for r in runs),
            "echo": sum(r["echo"] for r in runs),
        }
        print(
            f"{s:>6} (N={args.particles if s == 'smc' else 1}): {summary[s]['valid']}/{len(runs)} valid, "
            f"{summary[s]['echo']} echo the schema, median {summary[s]['median_seconds']:.1f} s, "
            f"total {summary[s]['total_seconds']:.0f} s"
        )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"json_speed_{args.label}.json"
    meta = {
        "label": args.label,
        "args": vars(args),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": torch.get_num_threads(),
    }
    path.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
