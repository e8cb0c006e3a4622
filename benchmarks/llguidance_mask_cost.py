"""What one llguidance mask costs, by where the document stands, with and without string bounds.

The default model's tokenizer (SmolLM2, 49,152 tokens) and structured_engine.py's schema, as given
(its strings have a ``maxLength``) and with the ``maxLength`` keywords removed. For each prefix
(inside the first string, a number, inside an array's string), a fresh constraint state is
advanced over the prefix's tokens and one mask is filled (``fill_bits_together``, one row; llguidance
keeps a computed mask, so each repeat starts from a fresh state); median of ``--repeats``.

    python benchmarks/llguidance_mask_cost.py     # CPU; writes benchmarks/results/structured/llguidance_mask_cost.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from structured_engine import DEFAULT_SCHEMA  # noqa: E402

import smcdecode as sd  # noqa: E402
from smcdecode.potentials.grammar import fill_bits_together  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

# (the schema's whitespace: ", " between items, ": " after keys)
PREFIXES = {"inside the name string": '{"name": "Alice Sm', "in the age number": '{"name": "Alice", "age": 4',
            "inside a tag string": '{"name": "Alice", "age": 42, "tags": ["a'}


def unbounded(schema):
    """``schema`` without its ``maxLength`` keywords."""
    if isinstance(schema, dict):
        return {k: unbounded(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [unbounded(v) for v in schema]
    return schema


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" / "structured" / "llguidance_mask_cost.json")
    args = ap.parse_args()
    model = sd.load_model()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
           "model": model.name, "vocab_size": model.vocab_size, "repeats": args.repeats, "rows": []}
    for label, schema in (("with maxLength", DEFAULT_SCHEMA), ("without maxLength", unbounded(copy.deepcopy(DEFAULT_SCHEMA)))):
        c = JSONSchema(schema, path="llguidance").bind(model)
        out = torch.zeros(1, c._words, dtype=torch.int32)
        for where, prefix in PREFIXES.items():
            ids = model.encode(prefix)
            times = []
            for _ in range(args.repeats):
                state = c.start(1)
                for t in ids:
                    state = c.advance(state, torch.tensor([t]))
                t0 = time.perf_counter()
                fill_bits_together([(c, state, 0)], out, 1)
                times.append(time.perf_counter() - t0)
            allowed = int(sum(bin(w & 0xFFFFFFFF).count("1") for w in out[0].tolist()))
            row = {"schema": label, "where": where, "prefix": prefix, "ms_median": 1e3 * statistics.median(times),
                   "allowed_tokens": allowed}
            res["rows"].append(row)
            print(f"{label:18s} {where:24s} {row['ms_median']:7.3f} ms  ({allowed} tokens allowed)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
