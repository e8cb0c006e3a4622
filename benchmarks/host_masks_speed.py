"""The host's work per round on the engine's host-mask path (llguidance constraints), on the CPU,
for one source tree or between two (A/B: e.g. the commit before a change, and the change).

    python benchmarks/host_masks_speed.py --b .                        # this tree
    python benchmarks/host_masks_speed.py --a /path/to/old/tree --b .  # A/B, alternating order
    python benchmarks/host_masks_speed.py --b . --profile              # + cProfile of the host calls

A process binds one JSON Schema (``--schema``: one of the engine benchmark's, ``structured_engine.py``,
default its small closed object; ``--eval``: the first schemas of two JSONSchemaBench subsets instead) to the default
model's vocabulary (SmolLM2, 49,152 tokens) on the llguidance path, shared by G requests of N
particles, and drives the engine's ``HostMasks`` exactly as ``Scheduler._launch`` and
``smc.round_code`` do: ``begin``, then for each of the K draft steps ``handle(("mask", i))`` and, once
the round has sampled the column, ``handle(("drafted", i))``; ``handle(("mask", K))`` for the bonus;
``end``; ``rejects``; and ``fork`` after a resampling (every ``--fork-every`` rounds, random ancestors
within each request). A request whose particles have all finished their document, or whose budget
is spent, is replaced by a fresh one (a request admitted in its slot).

The drafted tokens are the argmax of random logits under each row's mask (EOS only where nothing
else is allowed), so every particle follows a valid path and documents progress. ``--agree p``: a row
takes its request's logits (the same for all its particles) with probability p and its own
otherwise, as a peaked model makes particles in the same state pick the same token; p = 0 (default)
gives particles that diverge at once, the host's worst case. Sampling is outside the timing.

Timed: the host calls (wall clock, ms per round and per draft step, K + 1 steps a round), split
into llguidance's parallel mask fill (the part that its threads share) and the rest (Python work,
matcher advances, key rule, copies), and the CPU time of those calls (all threads: on a shared
machine steadier than wall time); with ``--profile`` also cProfile's split by function. llguidance's mask threads are its
default (80 % of the cores); ``--threads`` sets them. Raw results go to --out; with two trees the
table gives medians over passes.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

WORKER = r"""
import cProfile, inspect, io, json, pstats, statistics, sys, time
import torch
import smcdecode as sd
from smcdecode.backends.engine.host_masks import HostMasks, RequestMasks
from smcdecode.potentials.constraint import unpack_bits
from smcdecode.potentials.json_schema import JSONSchema
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["bench_dir"])
torch.set_num_threads(1)
model = sd.load_model()
V, eos = model.vocab_size, model.eos_token_id
if cfg["sources"]:
    schemas = []
    for name in cfg["sources"]:
        with open(name) as f:
            schemas += [json.loads(line)["schema"] for line in f][: cfg["schemas"]]
else:
    import structured_engine as se
    schemas = [{"small": se.DEFAULT_SCHEMA, "pattern": se.PATTERN_SCHEMA, "open": se.OPEN_SCHEMA}[cfg["schema"]]]
N, K, G, rounds, budget = cfg["particles"], cfg["block_size"], cfg["requests"], cfg["rounds"], cfg["budget"]
R = G * N
W = (V + 31) // 32
g = torch.Generator().manual_seed(0)
prof = cProfile.Profile() if cfg["profile"] else None
cpu = [0.0]  # CPU seconds of the host calls (all threads: less sensitive than wall time to other load)


def timed(fn, *a):
    if prof is not None:
        prof.enable()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*a)
    dt = time.perf_counter() - t0
    cpu[0] += time.process_time() - c0
    if prof is not None:
        prof.disable()
    return out, dt


def draw(mask):
    # the argmax of random logits under each row's mask; EOS only where nothing else is allowed
    m = mask.clone()
    m[:, eos] = False
    m[:, eos] |= ~m.any(1)  # (a finished document, or a dead row: EOS)
    own = torch.rand(R, V, generator=g)
    shared = torch.rand(G, V, generator=g).repeat_interleave(N, 0)
    take = (torch.rand(R, 1, generator=g) < cfg["agree"])
    logits = torch.where(take, shared, own)
    return torch.where(m, logits, -1.0).argmax(1)


class FillTimer:  # the constraint's llguidance executor, timing its mask fills
    def __init__(self, executor):
        self.executor, self.s = executor, 0.0

    def unsafe_compute_mask_ptr(self, *a):
        t0 = time.perf_counter()
        self.executor.unsafe_compute_mask_ptr(*a)
        self.s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.executor, name)


per_schema = []
for schema in schemas:
    try:
        c = JSONSchema(schema, path="llguidance", threads=cfg["threads"]).bind(model)
    except sd.SMCDecodeError:
        continue
    c._executor = fill = FillTimer(c._executor)
    host = HostMasks(N, V, "cpu")
    admitted = [0]

    # (a tree whose requests take lanes, as its Scheduler gives them: each slot its own, or, where a
    # request's rows start from lanes lane … lane + N − 1 (distinct matchers), lane = slot · N)
    lanes = "lane" in inspect.signature(RequestMasks).parameters
    per_row = lanes and len(set(map(id, c.start(2).matchers))) == 2

    def admit(slot):
        host.add(slot, RequestMasks([c], N, K, budget, **({"lane": slot * N if per_row else slot} if lanes else {})))
        admitted[0] += 1

    for slot in range(G):
        admit(slot)
    buffers = {"host_bits": torch.empty(R, W, dtype=torch.int32), "drafts": torch.zeros(R, K, dtype=torch.long)}
    round_s, fill_s, cpu_s = [], [], []
    for r in range(rounds):
        t, fill.s, cpu[0] = 0.0, 0.0, 0.0
        _, dt = timed(host.begin, R, K, buffers["drafts"]); t += dt
        for i in range(K + 1):
            _, dt = timed(host.handle, ("mask", i), buffers); t += dt
            mask = unpack_bits(buffers["host_bits"], V)
            d = draw(mask)
            if i < K:
                buffers["drafts"][:, i] = d
                _, dt = timed(host.handle, ("drafted", i), buffers); t += dt
        _, dt = timed(host.end, d); t += dt
        finished = (d == eos).view(G, N).all(1)
        _, dt = timed(host.rejects, R); t += dt
        if cfg["fork_every"] and r % cfg["fork_every"] == cfg["fork_every"] - 1:
            index = torch.multinomial(torch.rand(G, N, generator=g), N, replacement=True, generator=g)
            index = (index + torch.arange(G)[:, None] * N).reshape(-1)
            _, dt = timed(host.fork, index); t += dt
        round_s.append(t)
        fill_s.append(fill.s)
        cpu_s.append(cpu[0])
        for slot in range(G):  # a request done (documents finished or budget spent): a new one in its slot
            m = host.requests[slot]
            if bool(finished[slot]) or m.position + K + 1 > budget:
                host.remove(slot)
                admit(slot)
    warm, fills = round_s[cfg["warmup"]:], fill_s[cfg["warmup"]:]
    rest = [a - b for a, b in zip(warm, fills)]
    per_schema.append({"median_round_ms": 1e3 * statistics.median(warm), "mean_round_ms": 1e3 * statistics.mean(warm),
                       "median_step_ms": 1e3 * statistics.median(warm) / (K + 1),
                       "median_fill_ms": 1e3 * statistics.median(fills), "median_rest_ms": 1e3 * statistics.median(rest),
                       "median_cpu_ms": 1e3 * statistics.median(cpu_s[cfg["warmup"]:]),
                       "requests_admitted": admitted[0]})
profile = None
if prof is not None:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(cfg.get("sort", "tottime")).print_stats(cfg["profile_lines"])
    profile = s.getvalue()
print("RESULT " + json.dumps({"smcdecode": sd.__file__, "schemas": per_schema, "profile": profile,
                              "rounds_timed": rounds - cfg["warmup"]}))
"""


def run_tree(tree: Path, cfg: dict) -> dict:
    from engine_ab import run_tree as run_in_tree  # (benchmarks/ is on sys.path when run as a script)

    return run_in_tree(tree, cfg, WORKER, OMP_NUM_THREADS="1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, help="source tree A (the baseline; leave out to time --b alone)")
    ap.add_argument("--b", required=True, type=Path, help="source tree B (the change)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2, help="first rounds left out of the timing")
    ap.add_argument("--budget", type=int, default=128, help="a request's max new tokens")
    ap.add_argument("--fork-every", type=int, default=2, help="resample every this many rounds (0: never)")
    ap.add_argument("--agree", type=float, default=0.0, help="how often a row takes its request's logits")
    ap.add_argument("--threads", type=int, default=None, help="llguidance's mask threads (default: its own)")
    ap.add_argument("--schema", choices=("small", "pattern", "open"), default="small",
                    help="structured_engine.py's schema: the small closed object (DEFAULT_SCHEMA), the pattern-keys "
                         "object (PATTERN_SCHEMA) or the open object (OPEN_SCHEMA)")
    ap.add_argument("--eval", action="store_true", help="JSONSchemaBench schemas instead of --schema")
    ap.add_argument("--schemas", type=int, default=5, help="with --eval: schemas from each source file")
    ap.add_argument("--profile", action="store_true", help="cProfile the host calls (B's first pass)")
    ap.add_argument("--profile-lines", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/host_masks_speed.json"))
    args = ap.parse_args()
    from engine_ab import save_ab  # (benchmarks/ is on sys.path when run as a script)

    data = Path(__file__).resolve().parents[2] / "shared/data/eval"
    sources = [str(data / f"jsonschemabench_{s}.jsonl") for s in ("Glaiveai2K", "Github_easy")] if args.eval else []
    trees = {"B": args.b} if args.a is None else {"A": args.a, "B": args.b}
    raw = []
    for G in [int(x) for x in args.requests.split(",")]:
        cfg = {"particles": args.particles, "block_size": args.block_size, "requests": G, "rounds": args.rounds,
               "warmup": args.warmup, "budget": args.budget, "fork_every": args.fork_every, "agree": args.agree,
               "threads": args.threads, "schemas": args.schemas, "sources": sources, "schema": args.schema,
               "bench_dir": str(Path(__file__).resolve().parent), "profile_lines": args.profile_lines}
        for p in range(args.passes):
            for name in (sorted(trees) if p % 2 == 0 else sorted(trees, reverse=True)):
                r = run_tree(trees[name], {**cfg, "profile": args.profile and p == 0 and name == "B"})
                raw.append({"tree": name, "path": str(trees[name]), "pass": p, **cfg, **r})
                print(f"G={G} pass {p} {name}: {statistics.median(s['median_round_ms'] for s in r['schemas']):.2f} "
                      "ms per round", flush=True)
                if r["profile"]:
                    print(r["profile"], flush=True)
    table = []
    for G in sorted({r["requests"] for r in raw}):
        row = {"requests": G, "rows": G * args.particles}
        for name in trees:
            runs = [r for r in raw if r["tree"] == name and r["requests"] == G]
            row[f"{name}_round_ms"] = statistics.median(
                statistics.median(s["median_round_ms"] for s in r["schemas"]) for r in runs)
            row[f"{name}_step_ms"] = row[f"{name}_round_ms"] / (args.block_size + 1)
            for part in ("fill", "rest", "cpu"):
                row[f"{name}_{part}_ms"] = statistics.median(
                    statistics.median(s[f"median_{part}_ms"] for s in r["schemas"]) for r in runs)
        table.append(row)
    save_ab(args.out, table, raw)
    names = sorted(trees)
    print("ms per round (K + 1 steps); of it, llguidance's mask fill and the rest; CPU ms per round (all threads):")
    print("| requests × N | " + " | ".join(f"{n} round | {n} step | {n} fill | {n} rest | {n} CPU" for n in names) + " |")
    print("|---|" + "---|---|---|---|---|" * len(names))
    for r in table:
        print(f"| {r['requests']} × {args.particles} | " + " | ".join(
            " | ".join(f"{r[f'{n}_{k}_ms']:.2f}" for k in ("round", "step", "fill", "rest", "cpu"))
            for n in names) + " |")


if __name__ == "__main__":
    main()
