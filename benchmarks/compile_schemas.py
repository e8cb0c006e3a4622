"""Compile every JSONSchemaBench schema to a device token automaton over SmolLM2's vocabulary.

For each schema of the three subsets in ../shared/data/eval (as ``generate_json`` compiles it:
``extra_properties=False``, compact whitespace, bound to the model: a token automaton too large
falls back to llguidance there): the path ``JSONSchema`` chooses, the compile time (schema -> regex
-> character FSM -> token automaton; the superset path's automaton too), states, token classes and
device bytes, or the reason it runs on llguidance instead. Correctness as it goes: random walks through each
automaton (uniform over allowed tokens, to EOS) must decode to documents that parse without a
repeated key and validate under the schema (``JSONSchema.parse``); a failure is recorded and makes
the script exit non-zero.

    PYTHONPATH=$PWD python benchmarks/compile_schemas.py [--limit N] [--workers W] [--timeout S]

Writes benchmarks/results/schema_compile.json and prints the table in docs/constraints.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

EVAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval"
SUBSETS = ("Github_trivial", "Github_easy", "Glaiveai2K")
OUT = Path(__file__).resolve().parent / "results" / "schema_compile.json"
WALKS, WALK_TOKENS = 8, 400

_MODEL = None


def _init() -> None:
    global _MODEL
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    import smcdecode
    from smcdecode.potentials.token_bytes import token_texts

    torch.set_num_threads(1)
    _MODEL = smcdecode.load_model()
    token_texts(_MODEL)  # built once per worker, not timed per schema


class _Timeout(BaseException):
    """A schema's compile ran past --timeout (it is counted as too slow, then the next one runs; a
    BaseException, which the library's handlers of its dependencies' errors do not catch)."""


_FIRED = []  # (the alarm went off: numpy turns an exception raised inside it into a TypeError)


def _alarm(signum, frame):
    _FIRED.append(True)
    raise _Timeout


def _walks(c, model, seed: int) -> tuple[int, list[str]]:
    """(walks that reached EOS, failures) for uniform random walks through the automaton: each step
    ends at EOS where allowed (always past WALK_TOKENS / 2 tokens, else with probability 0.3), or takes
    an allowed token uniformly (a class ∝ its allowed tokens, then a token of it: the class table, not
    a [V] mask a step)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a, eos, failures, ended = c.token_automaton, model.eos_token_id, [], 0
    table, classes, dead = a.table.numpy(), a.classes.numpy().astype(np.int64), a.dead
    order = np.argsort(classes, kind="stable")
    bounds = np.searchsorted(classes[order], np.arange(table.shape[1] + 1))
    eos_class = int(classes[eos])
    counts = np.diff(bounds).astype(np.float64)
    counts[eos_class] -= 1  # EOS is decided apart
    for _ in range(WALKS):
        s, ids = a.initial, []
        for _ in range(WALK_TOKENS):
            live = table[s] != dead
            if not live.any():
                failures.append(f"dead end after {model.decode(ids)[:80]!r}")
                break
            w = live * counts
            if live[eos_class] and (len(ids) > WALK_TOKENS // 2 or rng.random() < 0.3 or not w.any()):
                ended += 1
                text = model.decode(ids)
                try:
                    c.parse(text)
                except Exception as e:  # noqa: BLE001 - SMCDecodeError, pydantic errors
                    failures.append(f"{text[:120]!r}: {e}"[:300])
                break
            k = int(rng.choice(len(w), p=w / w.sum()))
            members = order[bounds[k]: bounds[k + 1]]
            if k == eos_class:
                members = members[members != eos]
            ids.append(int(members[rng.integers(len(members))]))
            s = int(table[s, k])
    return ended, failures


def compile_one(item: tuple[str, str, dict, float]) -> dict:
    subset, sid, schema, timeout = item
    from smcdecode.errors import SMCDecodeError
    from smcdecode.potentials.json_schema import JSONSchema

    row = {"subset": subset, "id": sid}
    _FIRED.clear()
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    t0 = time.perf_counter()
    try:
        c = JSONSchema(schema, extra_properties=False, path="auto")
        if c.path in ("automaton", "superset"):  # (bound: a token automaton too large falls back to llguidance)
            c = c.bind(_MODEL)
        row["path"], row["reason"] = c.path, c.path_reason
        if c.path in ("automaton", "superset"):
            row["compile_s"] = time.perf_counter() - t0
            a = c.token_automaton if c.path == "automaton" else c.superset_automaton
            row.update(states=a.num_states, classes=a.num_classes, device_bytes=a.nbytes + 4 * _MODEL.vocab_size,
                       regex_chars=sum(map(len, c.regexes)) if c.path == "automaton" else len(c.superset_regex))
    except BaseException as e:  # (the benchmark records every failure; a KeyboardInterrupt stops it)
        if isinstance(e, _Timeout) or _FIRED:
            row.update(path="llguidance", reason=f"compile time over {timeout:.0f} s")
        elif isinstance(e, SMCDecodeError):
            row.update(path="error", reason=str(e)[:300])
        elif isinstance(e, Exception):
            row.update(path="error", reason=f"{type(e).__name__}: {e}"[:300])
        else:
            raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if row.get("path") == "automaton":
        row["walks_ended"], row["failures"] = _walks(c, _MODEL, seed=hash(sid) % 2**31)
    return row


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarise(rows: list[dict]) -> dict:
    out = {}
    for subset in (*SUBSETS, "all"):
        rs = [r for r in rows if subset in ("all", r["subset"])]
        dev = [r for r in rs if r["path"] == "automaton"]
        t = [r["compile_s"] for r in dev]
        out[subset] = dict(
            schemas=len(rs), automaton=len(dev), llguidance=sum(r["path"] == "llguidance" for r in rs),
            error=sum(r["path"] == "error" for r in rs),
            compile_s_p50=_quantile(t, 0.5), compile_s_p99=_quantile(t, 0.99), compile_s_max=max(t, default=0.0),
            states_p50=_quantile([r["states"] for r in dev], 0.5), states_max=max((r["states"] for r in dev), default=0),
            classes_p50=_quantile([r["classes"] for r in dev], 0.5),
            device_mib_p50=_quantile([r["device_bytes"] / 2**20 for r in dev], 0.5),
            device_mib_max=max((r["device_bytes"] / 2**20 for r in dev), default=0.0),
            walk_failures=sum(len(r["failures"]) for r in dev),
        )
        sup = [r["compile_s"] for r in rs if r["path"] == "superset"]
        out[subset].update(superset=len(sup), superset_compile_s_p50=_quantile(sup, 0.5),
                           superset_compile_s_p99=_quantile(sup, 0.99), superset_compile_s_max=max(sup, default=0.0))
    reasons: dict = {}
    for r in rows:
        if r["path"] not in ("automaton", "superset"):
            key = r["reason"].split(" at ")[0] if r["reason"].startswith("JSON Schema keyword") else r["reason"][:60]
            reasons[key] = reasons.get(key, 0) + 1
    out["reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="first N schemas of each subset (default: all)")
    ap.add_argument("--every", type=int, default=1, help="every N-th schema of each subset (a sample over the file)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=90.0,
                    help="seconds per schema before it counts as too slow (path='auto' gives each build 30 s itself)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    items = []
    for subset in SUBSETS:
        lines = (EVAL / f"jsonschemabench_{subset}.jsonl").read_text().splitlines()[:: args.every][: args.limit]
        items += [(subset, r["id"], r["schema"], args.timeout) for r in map(json.loads, lines)]
    t0 = time.time()
    rows = []
    with mp.get_context("fork").Pool(args.workers, initializer=_init) as pool:
        for i, row in enumerate(pool.imap(compile_one, items, chunksize=4)):
            rows.append(row)
            if (i + 1) % 200 == 0:
                print(f"{i + 1}/{len(items)} schemas, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    summary = summarise(rows)
    import platform

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), workers=args.workers,
        date=time.strftime("%Y-%m-%d"), vocabulary="SmolLM2-135M-Instruct (49,152 tokens)",
        settings=dict(extra_properties=False, whitespace="compact", timeout_s=args.timeout),
        summary=summary, schemas=rows), indent=1))
    print("| subset | schemas | automaton | superset | llguidance + refused | compile p50 / p99 / max (s) "
          "| superset compile p50 / p99 / max (s) | states p50 / max | classes p50 | device MiB p50 / max | walk failures |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in (*SUBSETS, "all"):
        s = summary[k]
        print(f"| {k} | {s['schemas']} | {s['automaton']} | {s['superset']} | {s['llguidance']} + {s['error']} | "
              f"{s['compile_s_p50']:.2f} / {s['compile_s_p99']:.2f} / {s['compile_s_max']:.1f} | "
              f"{s['superset_compile_s_p50']:.2f} / {s['superset_compile_s_p99']:.2f} / {s['superset_compile_s_max']:.1f} | "
              f"{s['states_p50']:.0f} / {s['states_max']} | {s['classes_p50']:.0f} | "
              f"{s['device_mib_p50']:.2f} / {s['device_mib_max']:.2f} | {s['walk_failures']} |")
    print("\nnot compiled, by reason:")
    for reason, n in list(summary["reasons"].items())[:25]:
        print(f"  {n:5d}  {reason}")
    if summary["all"]["walk_failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
