"""Programmatic dependent launch (PDL) on the draft's decode step, in isolation: the 16 Llama-3.2-1B
layers' add + RMSNorm and weight products (no attention) at 8 and 16 rows, captured in one CUDA graph
and replayed; every variant in the same process, median of repeated replays.

Variants (environment settings read by smcdecode.backends.engine.kernels at launch):
- products as the engine dispatches them today (cuBLAS wqkv and w2, the skinny Triton kernel for wo
  and w13 + SiLU·mul), without and with PDL on the Triton kernels;
- every product on the skinny kernel (SMCDECODE_SKINNY_ALL=1), without and with PDL and PDL's two
  release points (session 5's run also had an L2 prefetch of the weights before the wait, since
  removed: docs/engine_results/pdl_session5.json);
- block configurations of the skinny wqkv and w2 under the best of those;
- the cuBLAS products alone (the chain's part of the benchmark's GEMM floor).

    PYTHONPATH=$PWD python benchmarks/pdl_bench.py --out /tmp/pdl

Writes pdl.json (and best_env.json: the fastest setting found, for engine_variants.py) into --out.
"""

# ruff: noqa: B023  (the closures run before their loop advances)
from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch
from bench_engine import (  # benchmarks/ is on sys.path when run as a script
    gemm_graph_time,
    graph_time,
    products_chain,
    with_env,
)

from smcdecode.backends.engine import PRESETS, Llama, kernels

VARIANTS = [
    ("engine dispatch, no PDL", {}),
    ("engine dispatch, PDL 1", {"SMCDECODE_PDL": "1"}),
    ("skinny all, no PDL", {"SMCDECODE_SKINNY_ALL": "1"}),
    ("skinny all, PDL 1", {"SMCDECODE_SKINNY_ALL": "1", "SMCDECODE_PDL": "1"}),
    ("skinny all, PDL 2", {"SMCDECODE_SKINNY_ALL": "1", "SMCDECODE_PDL": "2"}),
]
# [BLOCK_N, BLOCK_K, warps, stages] for the skinny wqkv (3072 x 2048) and w2 (2048 x 8192)
CONFIGS = [[16, 256, 4, 4], [16, 128, 4, 6], [16, 256, 4, 6], [32, 128, 4, 4], [16, 512, 4, 3], [16, 256, 8, 4],
           [32, 256, 4, 4], [16, 128, 4, 8]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/pdl")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    draft = Llama.random(PRESETS["llama-3.2-1b"], device="cuda", seed=1)
    cfg = draft.cfg
    res = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "torch": torch.__version__, "model": "llama-3.2-1b (random bf16)", "layers": cfg.n_layers,
        "rows": [], "configs": [], "repeats": args.repeats}

    def step(x):
        return products_chain(draft, x)

    best = {}
    for M in (8, 16):
        x = torch.randn(M, cfg.dim, device="cuda", dtype=torch.bfloat16)
        floor = gemm_graph_time(draft, [M], args.repeats)
        row = {"rows": M, "cublas_products_only_us": 1e6 * floor, "variants": {}}
        ref = with_env({}, lambda: step(x))
        for name, env in VARIANTS:
            try:
                y = with_env(env, lambda: step(x))
                diff = float((y.float() - ref.float()).abs().max())
                t = with_env(env, lambda: graph_time(lambda: step(x), args.repeats))
                row["variants"][name] = {"env": env, "us": 1e6 * t, "max_abs_diff_vs_engine_dispatch": diff,
                                         "pdl_mode": with_env(env, lambda: kernels.pdl_mode(dev))}
            except Exception as e:  # a variant that fails to compile or run is reported, not fatal
                row["variants"][name] = {"env": env, "error": f"{type(e).__name__}: {e}"[:2000]}
            print(M, name, row["variants"][name], flush=True)
        ok = {k: v for k, v in row["variants"].items() if "us" in v}
        row["fastest"] = min(ok, key=lambda k: ok[k]["us"])
        res["rows"].append(row)
        if M == 8:
            best = dict(ok[row["fastest"]]["env"])
    # skinny block configurations of wqkv and w2 under the fastest variant at 8 rows
    if best.get("SMCDECODE_SKINNY_ALL") == "1":
        x = torch.randn(8, cfg.dim, device="cuda", dtype=torch.bfloat16)
        chosen = {}
        for key in (f"{(cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim}x{cfg.dim}", f"{cfg.dim}x{cfg.intermediate_size}"):
            times = {}
            for c in CONFIGS:
                env = {**best, "SMCDECODE_SKINNY_CONFIG": json.dumps({**chosen, key: c})}
                try:
                    times[json.dumps(c)] = 1e6 * with_env(env, lambda: graph_time(lambda: step(x), args.repeats))
                except Exception as e:
                    times[json.dumps(c)] = f"{type(e).__name__}: {e}"[:500]
                print(key, c, times[json.dumps(c)], flush=True)
            num = {k: v for k, v in times.items() if isinstance(v, float)}
            chosen[key] = json.loads(min(num, key=num.get))
            res["configs"].append({"shape": key, "step_us_by_config": times, "chosen": chosen[key]})
        best["SMCDECODE_SKINNY_CONFIG"] = json.dumps(chosen)
    res["best_env"] = best
    (out / "pdl.json").write_text(json.dumps(res, indent=1))
    (out / "best_env.json").write_text(json.dumps(best))
    print("\nrows | variant | µs a step (16 layers + head) | vs engine dispatch, no PDL")
    for row in res["rows"]:
        base = row["variants"]["engine dispatch, no PDL"].get("us")
        print(f"{row['rows']} | cuBLAS products only | {row['cublas_products_only_us']:.0f} |")
        for name, v in row["variants"].items():
            print(f"{row['rows']} | {name} | {v.get('us', float('nan')):.0f} | "
                  f"{base / v['us'] if 'us' in v and base else float('nan'):.3f}x")
    print("best:", best)
    print("median of all variants (sanity):", statistics.median(
        v["us"] for r in res["rows"] for v in r["variants"].values() if "us" in v))


if __name__ == "__main__":
    main()
