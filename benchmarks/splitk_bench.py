"""Split-K wo and w2 (their float32 partials summed by the next add + RMSNorm) on the decode steps,
in isolation: a whole step's norms and weight products (no attention; ``bench_engine.products_chain``)
captured in one CUDA graph and replayed, with SMCDECODE_SPLITK off and on, and a sweep of block
configurations and split counts for the two products, shape by shape, inside the chain. Models: the
Llama-3.2-1B draft at 8 and 16 rows (SMC-SD's draft steps) and the Llama-3.1-8B target at 1 and 8
rows (autoregressive decoding of 1 and 8 requests); random bf16 weights. Median of repeated replays.

    PYTHONPATH=$PWD python benchmarks/splitk_bench.py --out /tmp/splitk

--wqkv also times wqkv on the skinny kernel (SMCDECODE_SKINNY_ALL=1) under a few block configurations.
Writes splitk.json and best_env.json (the fastest SMCDECODE_SPLITK_CONFIG found at the draft's 8 rows
and the target's 1 row, for engine_variants.py --extra-env) into --out.
"""

# ruff: noqa: B023  (the closures run before their loop advances)
from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch
from bench_engine import gemm_graph_time, graph_time, products_chain, with_env

from smcdecode.backends.engine import PRESETS, Llama, kernels

# [BLOCK_N, BLOCK_K, warps, stages, splits]; splits 1 = the skinny kernel without a split
CONFIGS = [[32, 256, 4, 4, 2], [32, 256, 4, 4, 4], [32, 256, 4, 4, 8], [16, 256, 4, 4, 4], [64, 128, 4, 4, 4],
           [32, 128, 4, 4, 4], [32, 128, 4, 6, 8], [64, 256, 4, 3, 2], [16, 256, 4, 4, 8], [32, 256, 4, 4, 1]]
# [BLOCK_N, BLOCK_K, warps, stages] for wqkv on the skinny kernel
WQKV_CONFIGS = [[16, 256, 4, 4], [32, 128, 4, 4], [32, 256, 4, 4], [64, 128, 4, 4], [64, 256, 4, 3], [16, 128, 4, 6],
                [32, 256, 4, 3], [64, 128, 4, 6]]


# [BLOCK_N, BLOCK_K, warps, stages, splits] at 64 rows (BLOCK_M 64)
CONFIGS_64 = [[32, 128, 4, 4, 2], [32, 128, 4, 4, 4], [64, 128, 4, 4, 2], [64, 128, 4, 4, 4], [64, 64, 4, 4, 4],
              [128, 64, 4, 4, 2], [64, 128, 8, 3, 2], [32, 256, 4, 3, 2], [64, 128, 4, 4, 1]]
# ... at 72 rows (BLOCK_M 128: the 8B's verify pass of one request, N = 8 particles × K + 1 = 9 tokens)
CONFIGS_128 = [[64, 128, 4, 3, 2], [64, 128, 4, 3, 4], [64, 128, 8, 3, 2], [128, 64, 8, 3, 2], [64, 64, 4, 4, 2],
               [32, 128, 4, 3, 4], [128, 128, 8, 2, 2], [64, 128, 4, 3, 1], [128, 64, 8, 3, 1]]


def rows_section(args, res: dict, best_env: dict, preset: str, rows: int, configs: list, key: str) -> None:
    """A model's products at ``rows`` rows (above 16: split-K only for shapes in
    SMCDECODE_SPLITK_CONFIG), wo and w2 swept in turn (the first's best kept while sweeping the
    second); against split-K off (cuBLAS). Writes res[key]; where both chosen beat cuBLAS, adds
    them to ``best_env`` for their row block."""
    model = Llama.random(PRESETS[preset], device="cuda", seed=1)
    cfg = model.cfg
    x = torch.randn(rows, cfg.dim, device="cuda", dtype=torch.bfloat16)
    block_m = max(16, 1 << (rows - 1).bit_length())
    step = {"model": preset, "rows": rows, "cuBLAS products alone": 1e6 * gemm_graph_time(model, [rows], args.repeats),
            "split-K off": 1e6 * with_env({"SMCDECODE_SPLITK": "0"},
                                          lambda: graph_time(lambda: products_chain(model, x), args.repeats))}
    chosen: dict = {}
    for shape in (f"{cfg.dim}x{cfg.n_heads * cfg.head_dim}", f"{cfg.dim}x{cfg.intermediate_size}"):
        times = {}
        for c in configs:
            env = {"SMCDECODE_SPLITK_ROWS": "128", "SMCDECODE_SPLITK_CONFIG": json.dumps({**chosen, shape: c})}
            try:
                times[json.dumps(c)] = 1e6 * with_env(env, lambda: graph_time(lambda: products_chain(model, x),
                                                                             args.repeats))
            except Exception as e:
                times[json.dumps(c)] = f"{type(e).__name__}: {e}"[:500]
            print(rows, "rows", shape, c, times[json.dumps(c)], flush=True)
        num = {k: v for k, v in times.items() if isinstance(v, float)}
        chosen[shape] = json.loads(min(num, key=num.get))
        step[f"sweep {shape}"] = times
    env = {"SMCDECODE_SPLITK_ROWS": "128", "SMCDECODE_SPLITK_CONFIG": json.dumps(chosen)}
    ref = with_env({"SMCDECODE_SPLITK": "0"}, lambda: products_chain(model, x)).float()
    y = with_env(env, lambda: products_chain(model, x)).float()
    step["both chosen"] = 1e6 * with_env(env, lambda: graph_time(lambda: products_chain(model, x), args.repeats))
    step["chosen"] = chosen
    step["max_abs_diff_vs_off"] = float((y - ref).abs().max())
    res[key] = step
    if step["both chosen"] < step["split-K off"]:
        best_env.update({f"{block_m}:{k}": v for k, v in chosen.items()})
    print(rows, "rows:", {k: v for k, v in step.items() if not k.startswith("sweep")}, flush=True)


def copy_pages_section(res: dict, repeats: int = 20) -> None:
    """Copy-on-write page copies between rounds on the benchmark's pools (Llama-3.1-8B and -3.2-1B
    KV, 16-token pages): the 6-D advanced-indexing copy used before session 6 against
    KVPool.copy_pages (a gather and scatter of whole pages), 2 and 20 pages (1 and 8 requests)."""
    from bench_engine import cuda_time

    from smcdecode.backends.engine import KVPool

    rows = []
    for name, pages in (("llama-3.1-8b", 6500), ("llama-3.2-1b", 6500)):
        pool = KVPool.for_model(PRESETS[name], pages, 16, torch.bfloat16, "cuda")
        for n in (2, 20):
            perm = torch.randperm(pages - 1, device="cuda")[: 2 * n] + 1
            src, dst = perm[:n], perm[n:]

            def old():
                pool.kv[:, :, dst] = pool.kv[:, :, src]

            old()
            ref = pool.kv[:, :, dst].clone()
            pool.kv[:, :, dst] = 0
            pool.copy_pages(src, dst)
            ok = torch.equal(pool.kv[:, :, dst], ref)
            t_old = statistics.median(cuda_time(old, repeats))
            t_new = statistics.median(cuda_time(lambda: pool.copy_pages(src, dst), repeats))
            rows.append({"pool": name, "pages": n, "bytes_per_page": pool.bytes_per_page, "old_us": 1e6 * t_old,
                         "new_us": 1e6 * t_new, "equal": ok})
            print("copy pages", rows[-1], flush=True)
    res["copy_pages"] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/splitk")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rows64", action="store_true", help="also sweep split-K for the draft at 64 rows")
    ap.add_argument("--verify72", action="store_true",
                    help="also sweep split-K for the target's verify pass of one request (8B at 72 rows)")
    ap.add_argument("--copy-pages", action="store_true", help="also time copy-on-write page copies, old vs new")
    ap.add_argument("--skip-main", action="store_true", help="skip the 8/16-row and 1/8-row tables and sweeps")
    ap.add_argument("--wqkv", action="store_true", help="also sweep wqkv on the skinny kernel (SMCDECODE_SKINNY_ALL)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "torch": torch.__version__, "repeats": args.repeats, "rows": [], "sweeps": [], "wqkv": []}
    best_env: dict = {}
    for name, seed, rows in () if args.skip_main else (("llama-3.2-1b", 1, (8, 16)), ("llama-3.1-8b", 2, (1, 8))):
        model = Llama.random(PRESETS[name], device="cuda", seed=seed)
        cfg = model.cfg
        shapes = (f"{cfg.dim}x{cfg.n_heads * cfg.head_dim}", f"{cfg.dim}x{cfg.intermediate_size}")  # wo, w2
        for M in rows:
            x = torch.randn(M, cfg.dim, device="cuda", dtype=torch.bfloat16)
            ref = with_env({"SMCDECODE_SPLITK": "0"}, lambda: products_chain(model, x)).float()
            row = {"model": name, "rows": M, "cublas_products_only_us": 1e6 * gemm_graph_time(model, [M], args.repeats),
                   "default_splits": {s: (kernels.splitk_config(M, *map(int, s.split("x")), dev) or (None, 1))[1]
                                      for s in shapes}}
            for label, env in (("split-K off", {"SMCDECODE_SPLITK": "0"}), ("split-K on (default)", {})):
                y = with_env(env, lambda: products_chain(model, x)).float()
                row[label] = {"us": 1e6 * with_env(env, lambda: graph_time(lambda: products_chain(model, x), args.repeats)),
                              "max_abs_diff_vs_off": float((y - ref).abs().max()), "ref_abs_max": float(ref.abs().max())}
            print(name, M, row, flush=True)
            res["rows"].append(row)
            if M != rows[0]:
                continue
            chosen: dict = {}
            for shape in shapes:  # one shape at a time, the other at its best so far (default first)
                times = {}
                for c in CONFIGS:
                    env = {"SMCDECODE_SPLITK_CONFIG": json.dumps({**chosen, shape: c})}
                    try:
                        times[json.dumps(c)] = 1e6 * with_env(env, lambda: graph_time(lambda: products_chain(model, x),
                                                                                     args.repeats))
                    except Exception as e:  # a configuration that does not compile is reported, not fatal
                        times[json.dumps(c)] = f"{type(e).__name__}: {e}"[:500]
                    print(name, M, shape, c, times[json.dumps(c)], flush=True)
                num = {k: v for k, v in times.items() if isinstance(v, float)}
                chosen[shape] = json.loads(min(num, key=num.get))
                res["sweeps"].append({"model": name, "rows": M, "shape": shape, "step_us_by_config": times,
                                      "chosen": chosen[shape]})
            env = {"SMCDECODE_SPLITK_CONFIG": json.dumps(chosen)}
            res["sweeps"].append({"model": name, "rows": M, "both_chosen_us": 1e6 * with_env(
                env, lambda: graph_time(lambda: products_chain(model, x), args.repeats)), "chosen": chosen})
            best_env.update(chosen)
        if args.wqkv:  # wqkv on the skinny kernel too (SMCDECODE_SKINNY_ALL), block configs swept
            M = rows[0]
            x = torch.randn(M, cfg.dim, device="cuda", dtype=torch.bfloat16)
            key = f"{(cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim}x{cfg.dim}"
            times = {"cuBLAS (default)": 1e6 * graph_time(lambda: products_chain(model, x), args.repeats)}
            for c in WQKV_CONFIGS:
                env = {"SMCDECODE_SKINNY_ALL": "1", "SMCDECODE_SKINNY_CONFIG": json.dumps({key: c})}
                try:
                    times[json.dumps(c)] = 1e6 * with_env(env, lambda: graph_time(lambda: products_chain(model, x),
                                                                                 args.repeats))
                except Exception as e:
                    times[json.dumps(c)] = f"{type(e).__name__}: {e}"[:500]
                print(name, M, "wqkv", key, c, times[json.dumps(c)], flush=True)
            res["wqkv"].append({"model": name, "rows": M, "shape": key, "step_us_by_config": times})
    if args.rows64:
        rows_section(args, res, best_env, "llama-3.2-1b", 64, CONFIGS_64, "rows64")
    if args.verify72:
        rows_section(args, res, best_env, "llama-3.1-8b", 72, CONFIGS_128, "verify72")
    if args.copy_pages:
        copy_pages_section(res)
    res["best_env"] = {"SMCDECODE_SPLITK_CONFIG": json.dumps(best_env)}
    wqkv_best = {}
    for w in res["wqkv"]:  # the fastest configuration where it beats cuBLAS, for engine_variants --extra-env
        t = w["step_us_by_config"]
        num = {k: v for k, v in t.items() if isinstance(v, float) and k != "cuBLAS (default)"}
        if num and min(num.values()) < t["cuBLAS (default)"]:
            wqkv_best[w["shape"]] = json.loads(min(num, key=num.get))
    (out / "wqkv_env.json").write_text(json.dumps({"SMCDECODE_SKINNY_CONFIG": json.dumps(wqkv_best)}))
    (out / "splitk.json").write_text(json.dumps(res, indent=1))
    (out / "best_env.json").write_text(json.dumps(res["best_env"]))
    print("\nmodel | rows | cuBLAS products only | split-K off | split-K on (default) | µs a step")
    for r in res["rows"]:
        print(f"{r['model']} | {r['rows']} | {r['cublas_products_only_us']:.0f} | {r['split-K off']['us']:.0f} | "
              f"{r['split-K on (default)']['us']:.0f}")
    for w in res["wqkv"]:
        print(w["model"], w["rows"], "wqkv", {k: round(v) if isinstance(v, float) else "error"
                                              for k, v in w["step_us_by_config"].items()})
    for s in res["sweeps"]:
        if "both_chosen_us" in s:
            print(s["model"], s["rows"], "chosen", s["chosen"], f"{s['both_chosen_us']:.0f} us")
    print("best:", res["best_env"])


if __name__ == "__main__":
    main()
