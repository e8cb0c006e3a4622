"""What one llguidance mask costs, by where the document stands, with and without string bounds.

The default model's tokenizer (SmolLM2, 49,152 tokens) and structured_engine.py's schema, as given
(its strings have a ``maxLength``) and with the ``maxLength`` keywords removed. For each prefix
(inside the first string, a number, inside an array's string), a fresh constraint state is
advanced over the prefix's tokens and one mask is filled (``fill_bits_together``, one row; llguidance
keeps a computed mask, so each repeat starts from a fresh state); median of ``--repeats``.

Then a step of the engine's host path: 64 particles, each at its own place inside a string value
(a random word of 1 to 20 letters), their masks filled in one call on llguidance's thread pool (1
thread, and one per CPU), for each kind of string value: unbounded, ``maxLength``
24 and 256, a ``pattern`` (bounded and unbounded), a ``format``. The particles come from one lane
(one compile of the grammar: llguidance fills their masks one after the other, as they share its
lexer) or, as the engine's eight requests of eight particles do, from eight lanes.

    python benchmarks/llguidance_mask_cost.py     # CPU; writes benchmarks/results/structured/llguidance_mask_cost.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import random
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
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402
from smcdecode.potentials.matchers import MatcherBatch, fill_bits_together  # noqa: E402

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


# the string value of {"name": ..., "age": integer}, by kind
STRING_KINDS = {"string": {"type": "string"}, "maxLength 24": {"type": "string", "maxLength": 24},
                "maxLength 256": {"type": "string", "maxLength": 256},
                "pattern ^[a-z ]{1,24}$": {"type": "string", "pattern": "^[a-z ]{1,24}$"},
                "pattern ^[a-z ]+$": {"type": "string", "pattern": "^[a-z ]+$"},
                "format email": {"type": "string", "format": "email"}}


def batch_fill(model, kind: str, value: dict, threads: int | None, repeats: int, lanes: int = 1) -> dict:
    """Median time to fill 64 fresh particles' masks in one call, each inside the string value;
    particle r from lane r // 8 (``lanes`` of them)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": value, "age": {"type": "integer"}}}
    c = JSONSchema(schema, path="llguidance", threads=threads).bind(model)
    rows = 64
    states = []
    for r in range(rows):
        rnd = random.Random(r)
        word = "".join(rnd.choice("abcdefghijklmnop") for _ in range(1 + r % 20))
        m = c._lane((r // 8) % lanes).deep_copy()
        m.consume_tokens(model.encode('{"name": "' + word))
        if m.is_error():
            raise SystemExit(f"{kind}: the prefix of particle {r} leaves the schema")
        states.append(m)
    out = torch.zeros(rows, c._words, dtype=torch.int32)
    times = []
    for _ in range(repeats):
        batch = MatcherBatch([m.deep_copy() for m in states])  # (fresh: llguidance keeps a computed mask)
        t0 = time.perf_counter()
        fill_bits_together([(c, batch, 0)], out, rows)
        times.append(time.perf_counter() - t0)
    return {"string": kind, "threads": threads, "lanes": lanes, "particles": rows,
            "ms_median": 1e3 * statistics.median(times), "path_by_default": JSONSchema(schema).path}


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
    res["batch_rows"] = []
    for kind, value in STRING_KINDS.items():
        for threads in sorted({1, os.cpu_count() or 1}):
            for lanes in (1, 8):
                row = batch_fill(model, kind, value, threads, max(3, args.repeats // 4), lanes)
                res["batch_rows"].append(row)
                print(f"64 particles inside a {kind:24s} string, {row['threads']!s:3s} threads, {lanes} lane(s): "
                      f"{row['ms_median']:7.2f} ms (path by default: {row['path_by_default']})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
