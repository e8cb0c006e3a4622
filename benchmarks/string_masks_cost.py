"""What a mask inside a string value costs on the host, llguidance's walk against the string's automaton
(potentials/json_strings.py), and what the automata add to binding: the default model (SmolLM2), the
schemas of structured_engine.py whose strings are held to lengths, patterns and formats.

    python benchmarks/string_masks_cost.py        # the CPU, about a minute

For each prefix (a document written up to inside one of its strings): llguidance's first mask of
that state (a fresh matcher replayed to the prefix each time, so its caches do not answer), and the
string automaton's mask with the string's verdicts asked afresh and with them known; medians of
--repeats, in ms. Binding: the schema bound with and without its string automata (the automata
built afresh). Writes --out (default benchmarks/results/string_masks_cost.json).
"""

# ruff: noqa: B023  (the closures timed run before the loop advances)

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured_engine import CONTACT_SCHEMA, DEFAULT_SCHEMA, HELD_TREE_SCHEMA  # noqa: E402

import smcdecode as sd  # noqa: E402
from smcdecode.potentials import json_strings  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

CASES = [
    ("small object", DEFAULT_SCHEMA, ['{"name": "Jonathan Smithers Jr', '{"name": "A", "age": 3, "tags": ["abcdefghijklm']),
    ("contact", CONTACT_SCHEMA, ['{"name": "John Smith", "email": "john@exa', '{"name": "Jo',
                                 '{"name": "John Smith", "email": "a@b.co", "code": "AB']),
    ("tree, held strings", HELD_TREE_SCHEMA, ['{"name": "Root", "email": "root@example.c',
                                              '{"name": "Root", "email": "r@x.org", "id": "ab']),
]


class _WithoutStrings(JSONSchema):
    def _automaton_strings(self):
        return None


def _state(c, model, prefix: str):
    state = c.start(1)
    for t in model.encode(prefix):
        state = c.advance(state, torch.tensor([t]))
    return state


def _timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/string_masks_cost.json"))
    args = ap.parse_args()
    model = sd.load_model()
    JSONSchema({"type": "string"}, path="llguidance").bind(model)  # (the tokenizer and token texts, once)
    rows, binds = [], []
    for label, schema, prefixes in CASES:
        t = {}
        for name, cls in (("without", _WithoutStrings), ("with", JSONSchema)):
            json_strings._BUILT.clear()
            t0 = time.perf_counter()
            c = cls(schema, path="llguidance").bind(model)
            t[name] = time.perf_counter() - t0
        binds.append({"schema": label, "bind_s_without_strings": t["without"], "bind_s_with_strings": t["with"]})
        out = np.zeros(c._words, dtype=np.int32)
        for prefix in prefixes:
            scan = _state(c, model, prefix).scans[0]
            assert scan[1] == json_strings.AUTOMATON, prefix

            def llguidance_first():
                m = _state(c, model, prefix).matchers[0]  # (fresh: no cached mask)
                t0 = time.perf_counter()
                m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
                return time.perf_counter() - t0

            firsts = sorted(llguidance_first() for _ in range(args.repeats))
            matcher = _state(c, model, prefix).matchers[0]
            dfa, q, _ = scan[2]
            fresh = _timed(lambda: c._strings.fill((scan[0], scan[1], (dfa, q, json_strings._Verdicts())), matcher, out),
                           args.repeats)
            known = _timed(lambda: c._strings.fill(scan, matcher, out), args.repeats)
            row = {"schema": label, "prefix": prefix, "llguidance_first_mask_ms": 1e3 * firsts[len(firsts) // 2],
                   "automaton_mask_ms_verdicts_asked": fresh, "automaton_mask_ms_verdicts_known": known}
            rows.append(row)
            print(f"{label:20s} {prefix[-24:]!r:30s} llguidance {row['llguidance_first_mask_ms']:.3f} ms, "
                  f"automaton {fresh:.4f} ms (verdicts asked) / {known:.4f} ms (known)", flush=True)
        print(f"{label:20s} bind {t['without']:.2f} s without the string automata, {t['with']:.2f} s with them")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "machine": platform.processor() or
           platform.machine(), "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "masks": rows,
           "binding": binds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
