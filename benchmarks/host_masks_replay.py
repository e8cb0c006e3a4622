"""The host's work on the engine's host-mask path, replayed from real rounds: record the calls the
engine makes into ``HostMasks`` during real SmolLM2 SMC-SD calls with a JSON Schema on llguidance's
path, then replay them against one source tree or two (A/B) and time them.

    python benchmarks/host_masks_replay.py record --schema open          # CPU, ~1 minute a schema
    python benchmarks/host_masks_replay.py replay --b .                  # this tree
    python benchmarks/host_masks_replay.py replay --a /path/to/old --b . # A/B, alternating order
    python benchmarks/host_masks_replay.py replay --b . --workers 0,4    # mask worker processes

``record`` runs the default model with the shipped draft on the CPU engine (N = 8, K = 8, 1 and 8
requests, two seeded calls each, up to 256 new tokens, the structured_engine.py prompts) and writes
every ``HostMasks`` call of those calls, in order, with its arguments (the drafted columns, the
bonus tokens, the resampling ancestors, the requests admitted and released) to --trace, a JSON file.
Where ``benchmarks/host_masks_speed.py`` draws tokens from random logits, these are the tokens the
real model drew, with its resamplings: the particles share states as they do in the engine.

``replay`` runs, for each pass and tree (alternating order: A B, then B A, …), a process that imports
smcdecode from that tree, binds the trace's schema to the default model's vocabulary, and makes the
same calls on a CPU ``HostMasks`` (the drafted columns handed over with ``hand_over``, as the
engine's round does, where the tree has it; else with ``drafted``; the bonus with ``drafted``), timing them
(wall clock and the calling thread's CPU time, per round; the first replay of a trace warms up and is
not timed: lanes compile, mask workers start). ``--workers`` replays each tree with each number of
mask worker processes (``HostMasks(workers=...)``; a tree from before them takes 0 only). Each
process also digests every step's masks: every variant must give the same digest (the same masks),
or the table says they differ. Raw results go to --out; the table gives medians over passes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

WORKER = r"""
import hashlib, json, statistics, sys, time, inspect
sys.path.insert(0, json.loads(sys.argv[1])["bench"])
from replay_calls import replay_call, start
import torch
import smcdecode as sd
from smcdecode.backends.engine.host_masks import HostMasks, RequestMasks
from smcdecode.potentials.json_schema import JSONSchema
cfg, model = start()
trace = json.load(open(cfg["trace"]))
V = model.vocab_size
W = (V + 31) // 32
lanes = "lane" in inspect.signature(RequestMasks).parameters
workers = "workers" in inspect.signature(HostMasks).parameters
handed = {"handed": True} if "handed" in inspect.signature(HostMasks.begin).parameters else {}
if cfg["workers"] and not workers:
    raise SystemExit("this tree's HostMasks has no mask workers")
out = []
for part in trace["parts"]:
    c = JSONSchema(part["schema"], path="llguidance", threads=cfg["threads"]).bind(model)
    per_round, cpu_round, digest = [], [], None
    rows = part["particles"] * part["requests"]
    kw = {"rows": rows, "k_max": 64, "workers": cfg["workers"]} if workers else {}
    host = HostMasks(part["particles"], V, "cpu", **kw)
    for rep in range(cfg["repeats"] + 1):  # (the first: a warm-up, untimed; workers start, lanes compile)
        if workers:
            host.clear()
        else:
            host = HostMasks(part["particles"], V, "cpu")
        bits = torch.empty(rows, W, dtype=torch.int32)
        h = hashlib.md5()
        wall = cpu = 0.0
        rounds = 0
        for name, a in part["events"]:
            if name == "add":
                slot, n, K, budget = a
                kw = {"lane": slot * part["particles"]} if lanes else {}
                host.add(slot, RequestMasks([c], n, K, budget, **kw))
                continue
            t0, c0 = time.perf_counter(), time.thread_time()
            replay_call(host, name, a, bits, handed)
            rounds += name == "begin"
            wall += time.perf_counter() - t0
            cpu += time.thread_time() - c0
            if name == "mask" and rep == 0:
                h.update(bits[: host.rows].numpy().tobytes())
        if rep == 0:
            digest = h.hexdigest()
        else:
            per_round.append(1e3 * wall / rounds)
            cpu_round.append(1e3 * cpu / rounds)
    if workers:
        host.close()
    out.append({"schema_name": part["schema_name"], "requests": part["requests"], "rounds": rounds,
                "median_round_ms": statistics.median(per_round), "median_cpu_ms": statistics.median(cpu_round),
                "masks_md5": digest})
print("RESULT " + json.dumps({"smcdecode": sd.__file__, "parts": out}))
"""


def record(args) -> None:
    """Run the real SmolLM2 pair on the CPU engine and write every HostMasks call to args.trace."""
    import torch

    sys.path.insert(0, str(BENCH))
    import structured_engine as se

    import smcdecode as sd
    import smcdecode.backends.engine.host_masks as hm
    from smcdecode.backends.engine import Engine
    from smcdecode.backends.engine.targets import EngineTarget
    from smcdecode.models import _smollm2_dir
    from smcdecode.potentials.json_schema import JSONSchema

    gguf = _smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"  # (the default model's file)
    requests = [int(x) for x in args.requests.split(",")]

    class Args:
        smollm2_gguf = str(gguf)

    Args.requests = requests
    _, target, draft, model, prompts, eos = se.smollm2_models(Args, "cpu", torch.float32)
    L = args.max_new_tokens
    ctx = max(len(p) for p in prompts) + L + 16
    engine = Engine(target, draft, num_pages=8 * 12 * (-(-ctx // 16) + 1) + 64, page_size=16, max_context=ctx)
    log: list | None = None
    H = hm.HostMasks

    depth = [0]  # (calls inside a recorded call, as add's own remove, are not the engine's: not recorded)

    def recorded(name, args_of):
        method = getattr(H, name)

        def call(self, *a, **k):
            if log is not None and not depth[0]:
                log.append([name, args_of(self, *a)])
            depth[0] += 1
            try:
                return method(self, *a, **k)
            finally:
                depth[0] -= 1

        return call

    H.add = recorded("add", lambda s, slot, m: [slot, m.n, m.K, m.budget])
    H.remove = recorded("remove", lambda s, slot: slot)
    seen: set = set()  # (the columns of the round in progress already recorded)

    def begun(self, rows, k_max, drafts, handed=False):
        seen.clear()
        return [rows, k_max]

    H.begin = recorded("begin", begun)
    H.mask = recorded("mask", lambda s, i, out: i)
    # (the round hands its columns over inside its graph part: recorded where the host reads them)
    column = H._column
    H._column = lambda self, j: column(self, j) if log is None else _logged_column(self, j, column)

    def _logged_column(self, j, read):
        col = read(self, j)
        if j not in seen:
            seen.add(j)
            log.append(["drafted", [j, col.tolist()]])
        return col

    H.end = recorded("end", lambda s, bonus, buffers=None: bonus[: s.rows].tolist())
    H.fork = recorded("fork", lambda s, index: torch.as_tensor(index).tolist())
    H.rejects = recorded("rejects", lambda s, rows: rows)
    schema = {"small": se.DEFAULT_SCHEMA, "pattern": se.PATTERN_SCHEMA, "open": se.OPEN_SCHEMA,
              "contact": se.CONTACT_SCHEMA}[args.schema]
    c = JSONSchema(schema, path="llguidance").bind(model)
    program = EngineTarget.of(sd.LM(model) * c)
    parts = []
    for G in requests:
        log = []
        for seed in range(args.calls):
            torch.manual_seed(seed)
            out = engine.smc_sd(prompts[:G], max_new_tokens=L, particles=args.particles, block_size=args.block_size,
                                target=program, eos_token_id=eos)
            print(f"{args.schema} G={G} call {seed}: {out.rounds} rounds", flush=True)
        parts.append({"schema_name": args.schema, "schema": schema, "requests": G, "particles": args.particles,
                      "block_size": args.block_size, "events": _in_round_order(log)})
        log = None
    trace = Path(args.trace or RESULTS / f"host_masks_trace_{args.schema}.json")
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                 "model": "SmolLM2-135M-Instruct + shipped draft (CPU engine)", "parts": parts}))
    print(f"wrote {trace}")


def _in_round_order(log: list) -> list:
    """The recorded calls with each drafted column placed before the host call that first read it
    (it was recorded inside that call)."""
    out: list = []
    for event in log:
        if event[0] == "drafted":  # (logged while the last call ran: it belongs before that call)
            out.insert(len(out) - 1, event)
        else:
            out.append(event)
    return out


def replay(args) -> None:
    from engine_ab import run_tree, save_ab  # (benchmarks/ is on sys.path when run as a script)

    traces = [Path(t) for t in args.trace] if args.trace else sorted(RESULTS.glob("host_masks_trace_*.json"))
    if not traces:
        raise SystemExit("no trace: run `python benchmarks/host_masks_replay.py record` first")
    trees = {"B": args.b} if args.a is None else {"A": args.a, "B": args.b}
    counts = [int(w) for w in args.workers.split(",")]
    # the variants: each tree with each number of mask workers (named "B", or "B 8w" with several)
    variants = {(t if len(counts) == 1 else f"{t} {w}w"): (trees[t], w) for t in sorted(trees) for w in counts}
    trees = {name: tree for name, (tree, _) in variants.items()}
    raw = []
    for trace in traces:
        for p in range(args.passes):
            for name in (sorted(variants) if p % 2 == 0 else sorted(variants, reverse=True)):
                tree, w = variants[name]
                cfg = {"trace": str(trace.resolve()), "repeats": args.repeats, "threads": args.threads, "workers": w,
                       "bench": str(BENCH)}
                r = run_tree(tree, cfg, WORKER, OMP_NUM_THREADS="1")
                for part in r["parts"]:
                    raw.append({"tree": name, "path": str(tree), "workers": w, "pass": p, "trace": trace.name, **part})
                    print(f"{trace.name} G={part['requests']} pass {p} {name}: {part['median_round_ms']:.2f} ms per round",
                          flush=True)
    table = []
    for key in sorted({(r["schema_name"], r["requests"]) for r in raw}):
        row = {"schema": key[0], "requests": key[1]}
        for name in trees:
            runs = [r for r in raw if r["tree"] == name and (r["schema_name"], r["requests"]) == key]
            row[f"{name}_round_ms"] = statistics.median(r["median_round_ms"] for r in runs)
            row[f"{name}_cpu_ms"] = statistics.median(r["median_cpu_ms"] for r in runs)
            row["rounds"] = runs[0]["rounds"]
        row["same_masks"] = len({r["masks_md5"] for r in raw if (r["schema_name"], r["requests"]) == key}) == 1
        table.append(row)
    save_ab(args.out, table, raw)
    names = sorted(trees)
    print("host calls, ms per round (wall; the calling thread's CPU), medians over passes:")
    print("| schema | requests × 8 | rounds | " + " | ".join(f"{n} wall | {n} CPU" for n in names) + " | same masks |")
    print("|---|---|---|" + "---|---|" * len(names) + "---|")
    for r in table:
        print(f"| {r['schema']} | {r['requests']} | {r['rounds']} | "
              + " | ".join(f"{r[f'{n}_round_ms']:.2f} | {r[f'{n}_cpu_ms']:.2f}" for n in names)
              + f" | {'yes' if r['same_masks'] else 'NO'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record real rounds' host calls (CPU, the default model)")
    rec.add_argument("--schema", choices=("small", "pattern", "open", "contact"), default="open",
                     help="structured_engine.py's schema (small closed object, pattern keys, open object, contact record)")
    rec.add_argument("--requests", default="1,8")
    rec.add_argument("--particles", type=int, default=8)
    rec.add_argument("--block-size", type=int, default=8)
    rec.add_argument("--max-new-tokens", type=int, default=256)
    rec.add_argument("--calls", type=int, default=2, help="seeded calls per number of requests")
    rec.add_argument("--trace", default=None, help="output (default benchmarks/results/host_masks_trace_SCHEMA.json)")
    rep = sub.add_parser("replay", help="time the recorded calls against one or two source trees")
    rep.add_argument("--a", type=Path, help="source tree A (the baseline; leave out to time --b alone)")
    rep.add_argument("--b", required=True, type=Path, help="source tree B (the change)")
    rep.add_argument("--trace", action="append", help="a recorded trace (default: every one in benchmarks/results)")
    rep.add_argument("--passes", type=int, default=3)
    rep.add_argument("--repeats", type=int, default=3, help="replays of a trace per process")
    rep.add_argument("--threads", type=int, default=None,
                     help="the constraint's threads: None or 1 fill masks in the calling thread (the default), n >= 2 in llguidance's pool of n threads and n lanes")
    rep.add_argument("--workers", default="0",
                     help="mask worker processes (HostMasks' workers), comma-separated: each tree with each")
    rep.add_argument("--out", type=Path, default=RESULTS / "host_masks_replay.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    record(args) if args.command == "record" else replay(args)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
