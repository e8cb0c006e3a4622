"""Launch-configuration sweep of the paged-attention kernels at the benchmark's shapes (one GPU).

Times the fused RoPE + KV-write + attention launch (kernels.triton_rope_paged_attention: what decode
and verify run) alone, at the shapes of an SMC-SD / AR round on Llama-3.2-1B (draft: H 32, Hkv 8,
D 64) and Llama-3.1-8B (target: H 32, Hkv 8, D 128), page size 16:

    draft decode L=1 and the draft's first step L=2, B = 8 rows (1 request × 8 particles) and 64
    (8 requests), plain and grouped (SMCDECODE_ATTN_GROUP, 8 rows a program);
    target verify L=9, B = 8 and 64; AR L=1, B = 1 and 8;

at cached contexts of 256, 768 and 1280 tokens. Pages are scattered over the pool as in the engine
(the particles of a request share the prompt's 16 pages, the rest are private), and every layer has
its own pools (16 draft / 32 target), so L2 does not hold one layer's keys for the next. Each time is
a CUDA-graph replay of one launch per layer, median of ``--repeats`` replays, divided by the layers.

A configuration is [BLOCK_N, num_warps, num_stages, programs per SM, prefetch] (kernels.ATTN_CONFIGS).
Phase 1 sweeps the grid (--block-n × --warps × --stages × --programs-per-sm, no prefetch; the grouped
kernel, slow to compile, --group-block-n × --group-warps); phase 2 tries each class's two best with
the page-id prefetch and with 3 stages. Each configuration is first
checked against the torch references (rope_kv_write_reference + reference_paged_attention) once per
shape; one that fails to compile or mismatches is recorded and skipped. Kernels are compiled ahead in
``--jobs`` worker processes (into Triton's on-disk cache). The best configuration of each shape class
(decode:64 — the draft, weighted 7:1 for L=1:L=2 as in a K=8 round; decode:128 — AR; verify:128;
group — the grouped draft kernel) minimises the weighted mean time over its shapes and contexts.
No configuration is started after --budget-s.

    PYTHONPATH=$PWD python benchmarks/attention_sweep.py --out /tmp/attn     # ~3 minutes
    PYTHONPATH=$PWD python benchmarks/attention_sweep.py --smoke              # CPU, Triton's interpreter

Writes attention_sweep.json and attention_env.sh into --out; the last line printed is the
environment (``SMCDECODE_ATTN_CONFIG='{...}'``, plus ``SMCDECODE_ATTN_GROUP='auto'`` where the grouped
kernel beats the plain one by 3 %) that selects the best configurations: ``eval "export $(tail -1 log)"``
or ``source attention_env.sh``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_KEYS = ("SMCDECODE_ATTN_CONFIG", "SMCDECODE_ATTN_PROGRAMS_PER_SM", "SMCDECODE_ATTN_BLOCK_N",
            "SMCDECODE_ATTN_GROUP", "SMCDECODE_ATTN_MERGE")
DEFAULT = (64, 4, 2, 2.0, 0)  # kernels._attention_params without a table entry
PROMPT_PAGES = 16  # the prompt's pages (256 tokens), shared by a request's particles


@dataclass(frozen=True)
class Shape:
    name: str
    cls: str  # key of kernels.ATTN_CONFIGS
    B: int
    L: int
    H: int
    Hkv: int
    D: int
    layers: int
    weight: float  # launches of this shape per round, relative (the class objective's weights)
    particles: int  # consecutive rows of one request (sharing the prompt's pages)
    group: int = 1  # rows per program (the grouped kernel) or 1


def shapes(smoke: bool) -> list[Shape]:
    if smoke:
        return [Shape("draft L=1 B=4", "decode:32", 4, 1, 4, 2, 32, 2, 7, 4),
                Shape("draft L=2 B=4", "decode:32", 4, 2, 4, 2, 32, 2, 1, 4),
                Shape("verify L=5 B=4", "verify:32", 4, 5, 4, 2, 32, 2, 1, 4),
                Shape("draft L=1 B=4 grouped", "group", 4, 1, 4, 2, 32, 2, 7, 4, group=4)]
    out = []
    for B in (8, 64):  # (the order of measuring: the published round's shapes first)
        for L, w in ((1, 7), (2, 1)):
            out.append(Shape(f"draft L={L} B={B}", "decode:64", B, L, 32, 8, 64, 16, w, 8))
        out.append(Shape(f"verify L=9 B={B}", "verify:128", B, 9, 32, 8, 128, 32, 1, 8))
    for B in (1, 8):
        out.append(Shape(f"AR L=1 B={B}", "decode:128", B, 1, 32, 8, 128, 32, 1, 1))
    for B in (8, 64):
        for L, w in ((1, 7), (2, 1)):
            out.append(Shape(f"draft L={L} B={B} grouped", "group", B, L, 32, 8, 64, 16, w, 8, group=8))
    return out


def config_grid(args, grouped: bool = False) -> list[tuple]:
    """Phase 1's configurations (no prefetch), today's default first; the grouped kernel (slow to
    compile: its blocks are unrolled per row) gets --group-block-n × --group-warps."""
    block_n, warps = (args.group_block_n, args.group_warps) if grouped else (args.block_n, args.warps)
    grid = [(bn, w, st, ps, 0) for bn, w, st, ps in itertools.product(block_n, warps, args.stages,
                                                                       args.programs_per_sm)]
    grid.sort(key=lambda c: c != DEFAULT)  # today's default first (always measured)
    if DEFAULT not in grid:
        grid.insert(0, DEFAULT)
    return grid


def refinements(best: dict, all_shapes, measured: set) -> dict:
    """Phase 2: per class, its two best configurations with the page-id prefetch (not the grouped
    kernel: it has none) and with 3 stages; those not measured yet."""
    out = {}
    for cls, b in best.items():
        new = []
        for cfg, _ in b["ranking"][:2]:
            bn, w, st, ps, pf = cfg
            for var in ((bn, w, st, ps, 1), (bn, w, 3, ps, pf), (bn, w, 3, ps, 1)):
                if (cls == "group" and var[4]) or var in new or var in measured:
                    continue
                new.append(var)
        out[cls] = new
    return out


def config_env(shape: Shape, cfg: tuple) -> dict:
    env = {"SMCDECODE_ATTN_CONFIG": json.dumps({shape.cls: list(cfg)})}
    if shape.group > 1:
        env["SMCDECODE_ATTN_GROUP"] = str(shape.group)
    return env


def shared_pages(args) -> int:
    """The prompt's pages, shared by a request's particles: never one the shortest context writes."""
    return min(PROMPT_PAGES, min(args.contexts) // 16)


def set_env(env: dict) -> None:
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(env)


class Case:
    """One shape's inputs: per layer the fused projection qkv [B, L, (H + 2Hkv)·D] and K/V pools
    [pages, Hkv, 16, D]; one page table [B, P] (scattered pages, a request's particles sharing the
    prompt's pages); positions per context; RoPE tables."""

    def __init__(self, shape: Shape, max_context: int, shared_pages: int, layers: int, device, dtype, seed: int = 0):
        import torch

        PS = 16
        self.shape, self.P = shape, -(-max_context // PS) + 1  # the engine's page-table width
        g = torch.Generator(device="cpu").manual_seed(seed)
        B, P, D = shape.B, self.P, shape.D
        num_pages = B * P + 1
        pt = (torch.randperm(num_pages - 1, generator=g)[: B * P].view(B, P) + 1).to(torch.int32)
        for r in range(B):  # the prompt's pages are the request's first row's
            pt[r, :shared_pages] = pt[r - r % shape.particles, :shared_pages]
        self.page_table = pt.to(device)
        self.pools = [(torch.randn(num_pages, shape.Hkv, PS, D, device=device, dtype=dtype),
                       torch.randn(num_pages, shape.Hkv, PS, D, device=device, dtype=dtype)) for _ in range(layers)]
        self.pools0 = tuple(x.clone() for x in self.pools[0])  # (timed launches write new keys into the pools)
        self.qkv = [torch.randn(B, shape.L, (shape.H + 2 * shape.Hkv) * D, device=device, dtype=dtype)
                    for _ in range(layers)]
        inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        freqs = torch.arange(max_context + 2 * PS, dtype=torch.float64)[:, None] * inv
        self.cos, self.sin = freqs.cos().float().to(device), freqs.sin().float().to(device)
        self.device = device

    def batch(self, context: int):
        import torch

        from smcdecode.backends.engine.attention import PagedBatch

        s = self.shape
        positions = torch.full((s.B, 1), context, device=self.device) + torch.arange(s.L, device=self.device)
        return PagedBatch.build(positions, self.page_table, 16, group=s.group)

    def launches(self, context: int):
        """The function that runs one launch per layer at ``context`` cached tokens."""
        from smcdecode.backends.engine import kernels

        batch, s = self.batch(context), self.shape

        def run():
            for qkv, (kp, vp) in zip(self.qkv, self.pools):
                kernels.triton_rope_paged_attention(qkv, self.cos, self.sin, kp, vp, batch, s.H)

        return run

    def reference(self, context: int):
        """Layer 0's output by the torch references (its pools: copies with the new keys written)."""
        from smcdecode.backends.engine.attention import reference_paged_attention
        from smcdecode.backends.engine.model import rope_kv_write_reference

        batch, s = self.batch(context), self.shape
        kp, vp = (x.clone() for x in self.pools0)
        q = rope_kv_write_reference(self.qkv[0], batch.positions, self.cos, self.sin, kp, vp, batch.slot_pages,
                                    batch.slot_offsets, s.H, s.Hkv)
        return reference_paged_attention(q.double(), kp.double(), vp.double(), batch)

    def check(self, context: int, ref) -> float:
        """Relative error of layer 0's kernel output (from its initial pools) against ``ref``."""
        from smcdecode.backends.engine import kernels

        kp, vp = self.pools[0]
        kp.copy_(self.pools0[0])
        vp.copy_(self.pools0[1])
        out = kernels.triton_rope_paged_attention(self.qkv[0], self.cos, self.sin, kp, vp, self.batch(context),
                                                  self.shape.H)
        err = float((out.double() - ref).norm() / ref.norm())
        return err if math.isfinite(err) else float("inf")


def time_per_launch(fn, layers: int, repeats: int, cuda: bool) -> float:
    """µs per launch: median over ``repeats`` of one CUDA-graph replay of ``fn`` (eager on the CPU)."""
    if not cuda:
        fn()
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / layers * 1e6
    from bench_engine import graph_time  # benchmarks/ is on sys.path when run as a script

    return graph_time(fn, repeats) / layers * 1e6


def _compile_worker(job):
    """Runs each (shape, config) once on one layer (compiling into Triton's on-disk cache); errors are
    left for the main process to record."""
    shape_dict, cfgs, max_context, shared_pages, deadline, device = job
    import torch

    shape = Shape(**shape_dict)
    try:
        case = Case(shape, max_context, shared_pages, 1, device, torch.bfloat16 if device == "cuda" else torch.float32)
        run = case.launches(max_context - 64)
    except Exception:  # noqa: BLE001
        return 0
    done = 0
    for cfg in cfgs:
        if time.time() > deadline:
            break
        set_env(config_env(shape, cfg))
        try:
            run()
            if device == "cuda":
                torch.cuda.synchronize()
            done += 1
        except Exception:  # noqa: BLE001
            # NOTE: this worker only warms Triton's on-disk cache; a configuration that fails here is
            # tried again in the main process, which records its error in the JSON and skips it
            continue
    return done


def precompile(grids: dict, args, deadline, device) -> None:
    """Compiles every (shape, configuration) of ``grids`` {Shape: [config]} in --jobs processes."""
    import multiprocessing as mp

    order = sorted(grids, key=lambda s: (s.group == 1, s.D == 64))  # the slowest to compile first
    jobs = [(asdict(s), grids[s][i : i + args.chunk], args.max_context, shared_pages(args), deadline, device)
            for s in order for i in range(0, len(grids[s]), args.chunk)]
    total = sum(len(g) for g in grids.values())
    t0 = time.time()
    try:
        n = 0
        with mp.get_context("spawn").Pool(args.jobs) as pool:  # (leaving the block ends the workers)
            results = pool.imap_unordered(_compile_worker, jobs)
            for _ in jobs:
                try:
                    n += results.next(timeout=max(1.0, deadline + 20 - time.time()))
                except mp.TimeoutError:
                    print("precompile: past its deadline, the workers are stopped", flush=True)
                    break
        print(f"precompiled {n} of {total} launches in {args.jobs} workers "
              f"({time.time() - t0:.0f} s)", flush=True)
    except Exception:  # noqa: BLE001
        print(f"precompile failed ({time.time() - t0:.0f} s); compiling in this process:\n{traceback.format_exc()}",
              flush=True)


def best_configs(all_shapes, times, contexts):
    """Per class: the configuration with the least weighted mean time over the class's shapes and
    contexts (only configurations measured at all of them), and today's default's."""
    best = {}
    for cls in sorted({s.cls for s in all_shapes}):
        members = [s for s in all_shapes if s.cls == cls]
        totals = {}
        for cfg in sorted({k[1] for k in times}):
            ts = [times.get((s.name, cfg, c)) for s in members for c in contexts]
            if all(t is not None for t in ts):
                ws = [s.weight for s in members for _ in contexts]
                totals[cfg] = sum(w * t for w, t in zip(ws, ts)) / sum(ws)
        if not totals:
            continue
        cfg = min(totals, key=totals.get)
        d = totals.get(DEFAULT)
        best[cls] = {"config": list(cfg), "mean_us": round(totals[cfg], 3),
                     "default_mean_us": round(d, 3) if d is not None else None,
                     "speedup_vs_default": round(d / totals[cfg], 3) if d is not None else None,
                     "ranking": [[list(c), round(t, 3)] for c, t in sorted(totals.items(), key=lambda x: x[1])[:5]]}
    return best


def env_line(best: dict, group_gain: float, min_gain: float) -> dict:
    """The environment selecting, per class, its best configuration where it beats today's default by
    ``min_gain`` (else the default stays), and the grouped kernel where it beats the plain one by 3 %."""
    table = {cls: b["config"] for cls, b in best.items()
             if tuple(b["config"]) != DEFAULT and (b["speedup_vs_default"] or 0) >= min_gain}
    env = {"SMCDECODE_ATTN_CONFIG": json.dumps(table, separators=(",", ":"))}
    if group_gain > 1.03:
        env["SMCDECODE_ATTN_GROUP"] = "auto"
    return env


def measure(shape: Shape, grid: list, args, device, dtype, cuda: bool, deadline: float, times: dict,
            res: dict) -> None:
    """Checks and times ``grid`` at ``shape`` (into ``times`` {(shape, config, context): µs} and ``res``)."""
    import torch

    print(f"\n{shape.name} ({shape.cls}, H {shape.H}, Hkv {shape.Hkv}, D {shape.D}, {shape.layers} layers; "
          f"{time.time() - res['t0']:.0f} s)", flush=True)
    try:
        set_env({})
        case = Case(shape, args.max_context, shared_pages(args), shape.layers, device, dtype)
        ref = case.reference(args.contexts[-1])
    except Exception:  # noqa: BLE001
        res["errors"][shape.name] = traceback.format_exc(limit=3)
        print(f"  could not build the case: {res['errors'][shape.name]}", flush=True)
        return
    print(f"  {'config':>28} " + " ".join(f"{c:>8}" for c in args.contexts) + "   (µs per launch)", flush=True)
    for cfg in grid:
        key = f"{shape.name} {list(cfg)}"
        if time.time() > deadline and cfg != DEFAULT:
            res["skipped"].append(key)
            continue
        set_env(config_env(shape, cfg))
        try:
            err = case.check(args.contexts[-1], ref)
            res["checks"][key] = err
            if not err < args.tol:
                raise AssertionError(f"relative error {err:.3g} against the reference (> {args.tol})")
            row = []
            for c in args.contexts:
                t = time_per_launch(case.launches(c), shape.layers, args.repeats, cuda)
                times[(shape.name, cfg, c)] = t
                res["us_per_launch"].append({"shape": shape.name, "class": shape.cls, "config": list(cfg),
                                             "context": c, "us": round(t, 3)})
                row.append(f"{t:8.2f}")
            print(f"  {str(list(cfg)):>28} " + " ".join(row), flush=True)
        except Exception as e:  # noqa: BLE001  (a config that fails is recorded and skipped)
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            res["errors"][key] = msg
            print(f"  {str(list(cfg)):>28} skipped: {msg}", flush=True)
    del case, ref
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/attention_sweep")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in Triton's interpreter")
    ap.add_argument("--budget-s", type=float, default=180.0, help="no configuration is started after this")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 768, 1280])
    ap.add_argument("--max-context", type=int, default=1312, help="sets the page-table width, as the engine's")
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--programs-per-sm", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--group-block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--group-warps", type=int, nargs="+", default=[4])
    ap.add_argument("--no-refine", action="store_true", help="skip phase 2 (prefetch, 3 stages)")
    ap.add_argument("--repeats", type=int, default=15, help="graph replays timed per measurement")
    ap.add_argument("--jobs", type=int, default=max(0, min(15, (os.cpu_count() or 1) - 1)),
                    help="compile-ahead worker processes (0: none)")
    ap.add_argument("--chunk", type=int, default=2, help="configurations per compile job")
    ap.add_argument("--min-gain", type=float, default=1.02,
                    help="a class keeps today's default unless its best is this much faster")
    ap.add_argument("--tol", type=float, default=1e-2, help="relative error allowed against the reference")
    args = ap.parse_args()
    t_start = time.time()
    saved_env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.contexts = [24, 56]
        args.max_context = 80
        args.block_n = args.group_block_n = [16]
        args.warps = args.group_warps = [4]
        args.programs_per_sm = [0.05, 2.0]
        args.repeats = 1
        args.jobs = 2  # (the interpreter compiles nothing: this only runs the workers' code)
    import torch
    import triton

    from smcdecode.backends.engine import kernels  # noqa: F401  (decorates the kernels)

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("attention_sweep.py needs a CUDA GPU (or --smoke for the CPU interpreter)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    all_shapes = shapes(args.smoke)
    grid, group_grid = config_grid(args), config_grid(args, grouped=True)
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (Triton interpreter)",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "args": vars(args), "env_before": saved_env,
           "page_size": 16, "page_table_width": -(-args.max_context // 16) + 1,
           "config_fields": ["block_n", "num_warps", "num_stages", "programs_per_sm", "prefetch"],
           "default": list(DEFAULT), "shapes": [asdict(s) for s in all_shapes], "configs": [list(c) for c in grid],
           "configs_group": [list(c) for c in group_grid],
           "checks": {}, "errors": {}, "us_per_launch": [], "skipped": [], "t0": t_start}
    print(f"{res['device']}: {len(all_shapes)} shapes × {len(grid)} configs × contexts {args.contexts}", flush=True)
    times: dict = {}
    phases = [("phase 1", {s: group_grid if s.group > 1 else grid for s in all_shapes},
               t_start + (1.0 if args.no_refine else 0.75) * args.budget_s)]
    if not args.no_refine:
        phases.append(("phase 2", None, t_start + args.budget_s))
    for name, grids, deadline in phases:
        if grids is None:  # phase 2: from phase 1's ranking
            extra = refinements(best_configs(all_shapes, times, args.contexts), all_shapes, {k[1] for k in times})
            grids = {s: extra.get(s.cls, []) for s in all_shapes if extra.get(s.cls)}
            res["configs_phase2"] = {cls: [list(c) for c in v] for cls, v in extra.items()}
            if time.time() > deadline or not grids:
                res["skipped"].append(f"{name}: {sum(len(g) for g in grids.values())} configs (no time left)")
                continue
        print(f"\n== {name}: {sum(len(g) for g in grids.values())} (shape, config) pairs", flush=True)
        if args.jobs > 0 and sum(len(g) for g in grids.values()) > len(grids):
            now = time.time()  # (compiles may take phase 1's first 65 %, phase 2's first half)
            precompile(grids, args, now + (0.65 if name == "phase 1" else 0.5) * (deadline - now), device)
        for shape, g in grids.items():
            measure(shape, g, args, device, dtype, cuda, deadline, times, res)

    set_env(saved_env)
    best = best_configs(all_shapes, times, args.contexts)
    per_shape = {}
    for s in all_shapes:
        ts = {cfg: sum(times[(s.name, cfg, c)] for c in args.contexts) / len(args.contexts)
              for cfg in {k[1] for k in times} if all((s.name, cfg, c) in times for c in args.contexts)}
        if ts:
            b = min(ts, key=ts.get)
            per_shape[s.name] = {"config": list(b), "mean_us": round(ts[b], 3),
                                 "default_mean_us": round(ts[DEFAULT], 3) if DEFAULT in ts else None}
    draft_cls = next((s.cls for s in all_shapes if s.group == 1 and s.cls.startswith("decode")), None)
    group_gain = 0.0
    if "group" in best and draft_cls in best:  # the grouped kernel against the plain one at the draft's shapes
        group_gain = best[draft_cls]["mean_us"] / best["group"]["mean_us"]
    env = env_line(best, group_gain, args.min_gain)
    res.pop("t0")
    res.update(best=best, best_per_shape=per_shape, group_speedup_vs_plain_best=round(group_gain, 3), env=env,
               wall_s=round(time.time() - t_start, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_sweep.json").write_text(json.dumps(res, indent=1))
    line = " ".join(f"{k}='{v}'" for k, v in env.items())
    (out / "attention_env.sh").write_text(f"export {line}\n")
    print("\nbest per class (weighted mean µs per launch over its shapes and contexts):")
    for cls, b in best.items():
        print(f"  {cls:>11}: {b['config']} {b['mean_us']:.2f} µs; default {b['default_mean_us']} µs; "
              f"speed-up {b['speedup_vs_default']}")
    if group_gain:
        print(f"  grouped draft kernel vs the best plain one: {group_gain:.3f}×")
    for name, b in per_shape.items():
        print(f"  {name:>24}: best {b['config']} {b['mean_us']:.2f} µs (default {b['default_mean_us']})")
    if res["errors"]:
        print(f"  {len(res['errors'])} configurations failed (see errors in the JSON)")
    if res["skipped"]:
        print(f"  {len(res['skipped'])} not measured: the --budget-s ({args.budget_s:.0f} s) ran out")
    print(f"wrote {out / 'attention_sweep.json'} and {out / 'attention_env.sh'} ({res['wall_s']:.0f} s)")
    print(line, flush=True)


if __name__ == "__main__":
    main()
