"""Where a round's time goes on llguidance's path: the host's timeline of pipelined rounds with
host masks, on one NVIDIA GPU, with the real SmolLM2 pair and eight requests (N = 8, K = 8, up to
256 new tokens, the prompts of ``structured_engine.py``).

    python benchmarks/host_point_timeline.py --smollm2-gguf PATH            # ~1 minute
    python benchmarks/host_point_timeline.py --smollm2-gguf PATH --schemas tree

Each schema (``tree``: the recursive tree, ``held``: the tree with held strings, both on the path
``auto`` chooses, llguidance's; ``small``: the small closed object insisted on llguidance) runs three
warm-up calls, then three timed calls whose host calls are stamped (wall clock, from wrappers around
the scheduler's and ``HostMasks``' methods: they add a few microseconds a call). For each round
launched while another was in flight (a pipelined round r + 1), with ``launch`` the moment its
graph is launched:

- ``launch->readsync``: until the host sees round r end on the device (``Scheduler._read``'s wait);
- ``end``: the host's end of round r (its last drafts and bonus token consumed by the llguidance states);
- ``readsync->post0``: from round r's end on the device until round r + 1's first masks are posted
  (round r read: page bookkeeping, its resampling applied to the llguidance states, then round
  r + 1's first masks filled); meanwhile the device runs round r + 1's first draft forward and waits;
- ``post{j}->col{j}``: from the host posting point j until draft column j reaches the host (the
  device's wait noticing the count, the masks' upload, the draft step's sampling, the copy back);
- ``col{j}->post{j+1}``: from draft column j reaching the host until point j + 1's masks are posted
  (the host's and the mask workers' work of a step; the device runs the next draft forward meanwhile);
- ``round``: launch to the next launch.

Prints medians and 10th / 90th percentiles over the rounds; --out writes them as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structured_engine as se  # noqa: E402

import smcdecode as sd  # noqa: E402
from smcdecode.backends.engine import Engine  # noqa: E402
from smcdecode.backends.engine import host_masks as HM  # noqa: E402
from smcdecode.backends.engine import mask_workers as MW  # noqa: E402
from smcdecode.backends.engine import scheduler as S  # noqa: E402
from smcdecode.backends.engine.config import EngineConfig  # noqa: E402
from smcdecode.backends.engine.targets import EngineTarget  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

SCHEMAS = {"tree": (se.TREE_SCHEMA, "auto"), "held": (se.HELD_TREE_SCHEMA, "auto"),
           "small": (se.DEFAULT_SCHEMA, "llguidance")}
LOG: list = []  # (tag, argument, start, end)
ON = [False]
IN_READ = [False]


def stamp(owner, attr: str, tag: str, arg: bool = False, inside: list | None = None) -> None:
    """Wrap ``owner.attr`` so that, while ``ON``, each call appends (tag, its first argument if ``arg``, start, end)."""
    f = getattr(owner, attr)

    @functools.wraps(f)
    def wrapped(*args, **kw):
        if not ON[0]:
            return f(*args, **kw)
        t0 = time.perf_counter()
        if inside is not None:
            inside[0] = True
        try:
            return f(*args, **kw)
        finally:
            if inside is not None:
                inside[0] = False
            LOG.append((tag, args[1] if arg else None, t0, time.perf_counter()))

    setattr(owner, attr, wrapped)


def install() -> None:
    stamp(S.Scheduler, "_launch", "launch")
    stamp(S.Scheduler, "_read", "read", inside=IN_READ)
    stamp(HM.HostMasks, "end", "end")
    stamp(HM.HostMasks, "begin", "begin")
    stamp(HM.HostMasks, "_post", "post", arg=True)
    stamp(HM.HostMasks, "_column", "col", arg=True)
    stamp(MW.MaskWorkers, "step_wait", "stepwait")
    synchronize = torch.cuda.Event.synchronize

    def sync(self):
        t0 = time.perf_counter()
        synchronize(self)
        if ON[0] and IN_READ[0]:
            LOG.append(("readsync", None, t0, time.perf_counter()))

    torch.cuda.Event.synchronize = sync


def first(evs: list, tag: str, end: bool = True) -> float | None:
    """The end (or start) of the first event ``tag`` among ``evs``, or None."""
    return next((e[3] if end else e[2] for e in evs if e[0] == tag), None)


def rounds_of(log: list, K: int, stats: dict) -> int:
    """Add each pipelined round's intervals (ms) to ``stats``; returns the number of launches."""
    log = sorted(log, key=lambda e: e[2])
    launches = [e for e in log if e[0] == "launch"]

    def put(key, v):
        if v is not None:
            stats.setdefault(key, []).append(1e3 * v)

    for li in range(1, len(launches)):
        lo = launches[li][2]
        hi = launches[li + 1][2] if li + 1 < len(launches) else float("inf")
        evs = [e for e in log if lo <= e[2] < hi]

        readsync, e0, e1 = first(evs, "readsync"), first(evs, "end", end=False), first(evs, "end")
        post = {e[1]: e[3] for e in evs if e[0] == "post"}
        col: dict = {}
        for e in evs:
            if e[0] == "col":
                col.setdefault(e[1], e[3])
        if readsync is not None:
            put("launch->readsync", readsync - lo)
        if e0 is not None and e1 is not None:
            put("end", e1 - e0)
        if readsync is not None and 0 in post:
            put("readsync->post0", post[0] - readsync)
        for j in range(K):
            if j in post and j in col:
                put(f"post{j}->col{j}", col[j] - post[j])
            if j + 1 in post and j in col:
                put(f"col{j}->post{j + 1}", post[j + 1] - col[j])
        if li + 1 < len(launches):
            put("round", launches[li + 1][2] - lo)
    return len(launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2-gguf", required=True, help="SmolLM2-135M-Instruct GGUF (structured_engine.py)")
    ap.add_argument("--schemas", default="tree,small,held", help=f"comma-separated, of {', '.join(SCHEMAS)}")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write the statistics as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU: the rounds that wait for the host's masks run on one only")
    unknown = set(args.schemas.split(",")) - set(SCHEMAS)
    if unknown:
        raise SystemExit(f"--schemas takes {', '.join(SCHEMAS)}, got {', '.join(sorted(unknown))}")
    ns = argparse.Namespace(smollm2_gguf=args.smollm2_gguf, requests=[args.requests])
    _, target, draft, model, prompts, eos = se.smollm2_models(ns, "cuda", torch.bfloat16)
    engine = Engine(target, draft, EngineConfig(num_pages=args.requests * 12 * 30 + 64, page_size=16,
                                                max_context=max(len(p) for p in prompts) + 272))
    install()
    N, K, L = 8, 8, 256
    P = prompts[: args.requests]
    engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=2 * (K + 1))
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": torch.cuda.get_device_name(),
           "host_workers": engine.config.host_workers, "requests": args.requests, "N": N, "K": K,
           "max_new_tokens": L, "schemas": {}}
    for name in args.schemas.split(","):
        schema, path = SCHEMAS[name]
        c = JSONSchema(schema, path=path).bind(model)
        kw = {"particles": N, "block_size": K, "target": EngineTarget.of(sd.LM(model) * c), "eos_token_id": eos}
        for _ in range(3):
            engine.smc_sd(P, max_new_tokens=L, **kw)
        stats: dict = {}
        calls = []
        for _ in range(3):
            LOG.clear()
            torch.cuda.synchronize()
            ON[0] = True
            t0 = time.perf_counter()
            engine.smc_sd(P, max_new_tokens=L, **kw)
            torch.cuda.synchronize()
            ON[0] = False
            calls.append(1e3 * (time.perf_counter() - t0))
            launches = rounds_of(LOG, K, stats)
        print(f"{name} G={args.requests} ({c.path}): calls {[round(t, 1) for t in calls]} ms, {launches} rounds a call")
        table = {}
        for key, v in stats.items():
            v = sorted(v)
            table[key] = {"median_ms": statistics.median(v), "p10_ms": v[len(v) // 10],
                          "p90_ms": v[9 * len(v) // 10], "n": len(v)}
            print(f"  {key:18s} median {table[key]['median_ms']:7.3f} ms  p10 {table[key]['p10_ms']:7.3f}  "
                  f"p90 {table[key]['p90_ms']:7.3f}  n={len(v)}")
        res["schemas"][name] = {"path": c.path, "call_ms": calls, "rounds": launches, "intervals": table}
        engine.clear_graphs()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
