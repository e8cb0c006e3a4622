"""Where a round's time goes on llguidance's path: the host's timeline of pipelined rounds with
host masks, on one NVIDIA GPU, with the real SmolLM2 pair and eight requests (N = 8, K = 8, up to
256 new tokens, the prompts of ``structured_engine.py``).

    python benchmarks/host_point_timeline.py --smollm2-gguf PATH            # ~1 minute
    python benchmarks/host_point_timeline.py --smollm2-gguf PATH --schemas tree

Each schema (``tree``: the recursive tree, ``held``: the tree with held strings, both on the path
``auto`` chooses, llguidance's; ``small``: the small closed object and ``contact``: the contact record,
both insisted on llguidance) runs three
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

On the device (the engine's wait kernel replaced by a copy that also stamps the GPU's global timer
when a wait begins and ends): ``wait{j}``, how long the wait for host point j lasted (j = K: the
bonus), and ``busy{j}``, from the end of the wait before to the start of wait j (for j = 0: from the
round before's bonus point). The engine waits on a side stream (``HostMasks.fetch``), which starts
waiting for point j as soon as draft step j − 1 has sampled (point 0: as the round starts), while
its main stream runs the draft's forward: ``wait{j}`` is how far the host's post came after that
step's sampling, not a stall of the device's work, which stops only where a step joins the side
stream to sample (``HostMasks.await_masks``) before the masks are up.
Each timed call is paired with an unconstrained call at the same lengths (each request's
``max_new_tokens`` its longest particle's length, as ``structured_engine.py``'s same-length
comparison), whose ``round`` intervals are reported beside (``plain round``), and both calls'
times.

Where the mask workers serve a round's host points themselves (every masked request theirs:
``smcdecode/backends/engine/host_points.py``), this process posts no point: the ``post``/``col``
intervals and the device's per-point stamps are then absent, and ``round`` remains.

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
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structured_engine as se  # noqa: E402

import smcdecode as sd  # noqa: E402
from smcdecode.backends.engine import Engine  # noqa: E402
from smcdecode.backends.engine import host_masks as HM  # noqa: E402
from smcdecode.backends.engine import mask_workers as MW  # noqa: E402
from smcdecode.backends.engine import scheduler as S  # noqa: E402
from smcdecode.backends.engine.config import EngineConfig  # noqa: E402
from smcdecode.backends.engine.kernels import host as KH  # noqa: E402
from smcdecode.backends.engine.targets import EngineTarget  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

SCHEMAS = {"tree": (se.TREE_SCHEMA, "auto"), "held": (se.HELD_TREE_SCHEMA, "auto"),
           "small": (se.DEFAULT_SCHEMA, "llguidance"), "contact": (se.CONTACT_SCHEMA, "llguidance")}
LOG: list = []  # (tag, argument, start, end)
ON = [False]
IN_READ = [False]
POSTS: dict = {}  # the host's count of points after posting one -> that point's step j
STAMPS = 1 << 16  # device stamps kept (a ring)


@triton.jit
def _stamped_wait(posted_ptr, seen_ptr, stamps_ptr, n_ptr, LIMIT_NS: tl.constexpr, RING: tl.constexpr,
                  PARTIES: tl.constexpr, BLOCK: tl.constexpr, STRIDE: tl.constexpr):
    # kernels/host.py's wait (every party's count), plus (count awaited, GPU time when the wait began, when it ended)
    target = tl.load(seen_ptr) + 1
    start = globaltimer()
    j = tl.arange(0, BLOCK)
    at, live = posted_ptr + j * STRIDE, j < PARTIES
    low = tl.min(tl.load(at, mask=live, other=target, volatile=True), axis=0)
    while (low < target) & (globaltimer() - start < LIMIT_NS):
        low = tl.min(tl.load(at, mask=live, other=target, volatile=True), axis=0)
    end = globaltimer()
    tl.store(seen_ptr, target)
    if low < target:
        tl.store(posted_ptr + 1, 1)
    n = tl.load(n_ptr)
    at = stamps_ptr + 3 * (n % RING)
    tl.store(at, target)
    tl.store(at + 1, start)
    tl.store(at + 2, end)
    tl.store(n_ptr, n + 1)


class DeviceStamps:
    """The engine's host-point wait replaced (before any round is captured) by ``_stamped_wait``."""

    def __init__(self):
        self.stamps = torch.zeros(STAMPS, 3, dtype=torch.long, device="cuda")
        self.n = torch.zeros(1, dtype=torch.long, device="cuda")

        def wait(posted, seen, give_up_s=KH.GIVE_UP_S, parties=1, stride=8):
            _stamped_wait[(1,)](posted, seen, self.stamps, self.n, LIMIT_NS=int(give_up_s * 1e9), RING=STAMPS,
                                PARTIES=parties, BLOCK=max(2, triton.next_power_of_2(parties)), STRIDE=stride,
                                num_warps=1)

        KH.wait_for_host = wait  # (host_masks imports it at each capture)

    def reset(self) -> None:
        torch.cuda.synchronize()
        self.n.zero_()
        POSTS.clear()

    def add(self, stats: dict) -> None:
        """Each stamped wait of the last call by its step: ``wait{j}`` and ``busy{j}`` (ms) into ``stats``."""
        n = int(self.n.item())
        if n > STAMPS:
            raise SystemExit(f"more than {STAMPS} host points in a call")
        rows = self.stamps[:n].tolist()
        for i, (target, start, end) in enumerate(rows):
            j = POSTS.get(target)
            if j is None:
                continue
            stats.setdefault(f"wait{j}", []).append((end - start) / 1e6)
            if i:
                stats.setdefault(f"busy{j}", []).append((start - rows[i - 1][2]) / 1e6)


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
    posting = HM.HostMasks._post

    def post(self, i):  # (the count it raises: which step a device wait was for)
        posting(self, i)
        POSTS[self._count] = i

    HM.HostMasks._post = post
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


def timeline(engine, model, P: list, eos: int, name: str, device: DeviceStamps, N: int = 8, K: int = 8,
             L: int = 256) -> dict:
    """Schema ``name``'s timeline on ``engine`` (any engine whose rounds were captured after
    ``DeviceStamps`` and ``install``: a fresh one, or one that ran other calls before): three warm-up
    calls, then three constrained calls stamped, each paired with an unconstrained call at the same
    lengths. Prints the table; returns it with the calls' times."""
    schema, path = SCHEMAS[name]
    c = JSONSchema(schema, path=path).bind(model)
    kw = {"particles": N, "block_size": K, "target": EngineTarget.of(sd.LM(model) * c), "eos_token_id": eos}
    for _ in range(3):
        out = engine.smc_sd(P, max_new_tokens=L, **kw)
    same = [max(1, int(out.lengths[g].max())) for g in range(len(P))]  # (the calls draw alike)
    engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=same)  # (captures its rounds)
    stats: dict = {}
    calls, plain_calls, plain = [], [], {}
    for _ in range(3):
        for constrained in (True, False):
            LOG.clear()
            device.reset()
            ON[0] = True
            t0 = time.perf_counter()
            if constrained:
                engine.smc_sd(P, max_new_tokens=L, **kw)
            else:
                engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=same)
            torch.cuda.synchronize()
            ON[0] = False
            (calls if constrained else plain_calls).append(1e3 * (time.perf_counter() - t0))
            if constrained:
                launches = rounds_of(LOG, K, stats)
                device.add(stats)
            else:
                rounds_of(LOG, K, plain)
    stats["plain round"] = plain["round"]
    print(f"{name} G={len(P)} ({c.path}): calls {[round(t, 1) for t in calls]} ms, {launches} rounds a call; "
          f"unconstrained at the same lengths {[round(t, 1) for t in plain_calls]} ms")
    table = {}
    for key, v in stats.items():
        v = sorted(v)
        table[key] = {"median_ms": statistics.median(v), "p10_ms": v[len(v) // 10],
                      "p90_ms": v[9 * len(v) // 10], "n": len(v)}
        print(f"  {key:18s} median {table[key]['median_ms']:7.3f} ms  p10 {table[key]['p10_ms']:7.3f}  "
              f"p90 {table[key]['p90_ms']:7.3f}  n={len(v)}")
    return {"path": c.path, "call_ms": calls, "plain_same_length_call_ms": plain_calls, "same_length": same,
            "rounds": launches, "intervals": table}


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
    device = DeviceStamps()
    install()
    N, K, L = 8, 8, 256
    P = prompts[: args.requests]
    engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=2 * (K + 1))
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": torch.cuda.get_device_name(),
           "host_workers": engine.config.host_workers, "requests": args.requests, "N": N, "K": K,
           "max_new_tokens": L, "schemas": {}}
    for name in args.schemas.split(","):
        res["schemas"][name] = timeline(engine, model, P, eos, name, device, N, K, L)
        engine.clear_graphs()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
