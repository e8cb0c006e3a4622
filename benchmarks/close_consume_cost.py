"""What the token that closes a JSON document costs a particle on llguidance's path (the host's work at
a host point), with llguidance's consume and with the stand-in for its stopped parser
(``potentials.matchers.Stopped``), against the document's other tokens: the default model (SmolLM2),
structured_engine.py's schemas whose documents it writes here.

    python benchmarks/close_consume_cost.py        # the CPU, about a minute

For each document and each of its tokens: llguidance's ``consume_token`` of the token (a fresh copy
of the matcher replayed to the token before it, so no state is shared between repeats) and, for the
closing token, ``validate_tokens`` of it (what the stand-in asks llguidance) and the constraint's
``advance`` of a row with it (the engine's host path: the strings' scanner, the stand-in, or
llguidance's consume where the constraint learned that its parser does not stop) beside its
``advance`` of a row with the token before it, the median of --repeats, in µs. Writes --out (default benchmarks/results/close_consume_cost.json).
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured_engine import CONTACT_SCHEMA, DEFAULT_SCHEMA, TREE_SCHEMA  # noqa: E402

import smcdecode as sd  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402
from smcdecode.potentials.matchers import MatcherBatch, Stopped  # noqa: E402

DOCUMENTS = [
    ("small object", DEFAULT_SCHEMA, '{"name": "Ann Lee", "age": 31, "tags": ["a", "bc"]}'),
    ("contact", CONTACT_SCHEMA, '{"name": "Alice Smith", "email": "alice@example.com", "code": "ABC-1234"}'),
    ("tree", TREE_SCHEMA, '{"name": "root", "children": [{"name": "src", "size": 12}]}'),
]


def timed(fn, repeats: int) -> float:
    """The median µs of ``fn(state)`` over ``repeats`` calls, each on a state ``fn`` makes untimed
    (``fn`` returns (setup, run))."""
    out = []
    for _ in range(repeats):
        setup, run = fn()
        arg = setup()
        t = time.perf_counter()
        run(arg)
        out.append(1e6 * (time.perf_counter() - t))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "close_consume_cost.json")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    model = sd.load_model()
    rows = []
    for label, schema, text in DOCUMENTS:
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        c = JSONSchema(schema, path="llguidance").bind(model)
        template = c._lane(0).deep_copy()
        for t in ids:
            if not template.validate_tokens([t]):
                raise SystemExit(f"{label}: the example document {text!r} is not in the schema's language")
            template.consume_token(t)
        if not template.is_stopped():
            raise SystemExit(f"{label}: llguidance's parser did not stop after {text!r}")

        def replayed(n):
            m = c._lane(0).deep_copy()
            for t in ids[:n]:
                m.consume_token(t)
            return m

        consume = [timed(lambda: (lambda: replayed(i), lambda m: m.consume_token(ids[i])), args.repeats)
                   for i in range(len(ids))]
        last = len(ids) - 1
        validate = timed(lambda: (lambda: replayed(last), lambda m: m.validate_tokens([ids[last]])), args.repeats)
        state = c.start(1)
        for t in ids[:last]:
            state = c.advance(state, torch.tensor([t]))
        c.advance(MatcherBatch([state.matchers[0].deep_copy()], state.keys, state.scans), torch.tensor([ids[last]]))
        learned = c._stop_mask is not None and c._stop_mask is not False  # (the first close: for real)

        def row():
            return MatcherBatch([state.matchers[0].deep_copy()], state.keys, state.scans)

        closes = timed(lambda: (row, lambda s: c.advance(s, torch.tensor([ids[last]]))), args.repeats)
        before = c.start(1)
        for t in ids[:last - 1]:
            before = c.advance(before, torch.tensor([t]))
        ordinary = timed(lambda: (lambda: MatcherBatch([before.matchers[0].deep_copy()], before.keys, before.scans),
                                  lambda s: c.advance(s, torch.tensor([ids[last - 1]]))), args.repeats)
        stood_in = isinstance(c.advance(row(), torch.tensor([ids[last]])).matchers[0], Stopped)
        others = consume[:last]
        rows.append({"schema": label, "document": text, "tokens": len(ids),
                     "consume_us": consume, "closing_consume_us": consume[last],
                     "other_consume_us_median": statistics.median(others), "other_consume_us_max": max(others),
                     "closing_validate_us": validate, "closing_advance_us": closes,
                     "token_before_advance_us": ordinary, "stand_in_learned": learned,
                     "stood_in": stood_in})
        print(f"{label:13s} {len(ids):3d} tokens: llguidance's consume of the closing token {consume[last]:6.1f} µs, "
              f"of the others median {statistics.median(others):4.1f} (max {max(others):5.1f}); validate of the "
              f"closing token {validate:4.1f} µs; the constraint's advance of a row by it {closes:5.1f} µs "
              f"({'the stand-in' if stood_in else 'llguidance consumed it'}), by the token before it "
              f"{ordinary:5.1f} µs")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
           "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
