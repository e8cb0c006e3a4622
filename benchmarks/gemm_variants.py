"""Weight products at the row counts of the engine's strategies, each library and layout measured in
one process on one GPU (development measurements; the published benchmark is bench_engine.py):

1. w13 + SiLU·mul of the draft at 64 and 128 rows (8 requests × 8 particles, and the first draft
   step of a round, which carries two tokens a particle): cuBLAS + the engine's SiLU·mul kernel
   against the Triton skinny kernel with SiLU·mul in its epilogue, over block shapes;
2. (--sections sample) the sampler under both SMCDECODE_SAMPLE_NOISE settings;
3. every product of draft and target at the strategies' row counts through cuBLAS three ways:
   ``F.linear`` (cuBLAS), ``F.linear`` with torch's preferred BLAS library set to cuBLASLt, and the
   transposed problem ``W · xᵀ``.

Every layer's own weights (nothing stays in L2), replayed in a CUDA graph, median of 15 replays.

    PYTHONPATH=$PWD python benchmarks/gemm_variants.py --out /tmp/gemm
"""

# ruff: noqa: B023  (the closures run before their loop advances)
from __future__ import annotations

import argparse
import itertools
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_engine import graph_time  # benchmarks/ is on sys.path when run as a script

from smcdecode.backends.engine import PRESETS, Llama, kernels


def _classes(model: Llama, M: int) -> dict:
    cfg = model.cfg
    x = torch.randn(M, cfg.dim, device="cuda", dtype=torch.bfloat16)
    xo = torch.randn(M, cfg.n_heads * cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    xi = torch.randn(M, cfg.intermediate_size, device="cuda", dtype=torch.bfloat16)
    return {
        "wqkv": ([b.wqkv.weight for b in model.layers], x),
        "wo": ([b.wo.weight for b in model.layers], xo),
        "w13": ([b.w13.weight for b in model.layers], x),
        "w2": ([b.w2.weight for b in model.layers], xi),
        "head": ([model.output.weight], x),
    }


def silu_section(draft: Llama, rows: list[int], res: dict) -> None:
    out = []
    ws = [b.w13.weight for b in draft.layers]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    grid = [(bm, bn, bk, w, s) for bm in (64, 128) for bn, bk, w, s in
            itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4, 5))]
    for M in rows:
        x = torch.randn(M, draft.cfg.dim, device="cuda", dtype=torch.bfloat16)

        def cub():
            for w in ws:
                kernels.triton_silu_mul(F.linear(x, w))

        t_cub = graph_time(cub)
        ref = kernels.triton_silu_mul(F.linear(x, ws[0])).float()
        row = {"M": M, "cublas_plus_silu_us": 1e6 * t_cub, "cublas_TBps": nbytes / t_cub / 1e12, "configs": []}
        for c in grid:
            if c[0] > max(64, M):
                continue

            def sk(c=c):
                for w in ws:
                    kernels.triton_skinny_linear(x, w, silu=True, config=c)

            try:
                t = graph_time(sk)
                err = (kernels.triton_skinny_linear(x, ws[0], silu=True, config=c).float() - ref).abs().max().item()
            except Exception as e:  # a configuration that does not fit (shared memory) or compile
                row["configs"].append({"config": list(c), "error": repr(e)[:200]})
                continue
            row["configs"].append({"config": list(c), "us": 1e6 * t, "TBps": nbytes / t / 1e12, "max_abs_err": err})
        ok = [r for r in row["configs"] if "us" in r]
        ok.sort(key=lambda r: r["us"])
        row["best"] = ok[:5]
        out.append(row)
        print(f"w13+silu M={M}: cuBLAS+silu {row['cublas_plus_silu_us']:.1f} us; best skinny "
              + "; ".join(f"{r['config']} {r['us']:.1f} us" for r in ok[:5]), flush=True)
    res["w13_silu"] = out


def sample_section(res: dict) -> None:
    """The sampler (kernels.triton_sample_and_score) on 128,256-entry rows at the strategies' row
    counts, under the SMCDECODE_SAMPLE_RACE and SMCDECODE_SAMPLE_NOISE settings (ratio race / 4x noise:
    the defaults); µs a call, replayed in a CUDA graph."""
    from bench_engine import with_env

    settings = {"ratio_4x": {}, "gumbel_4x": {"SMCDECODE_SAMPLE_RACE": "gumbel"},
                "gumbel_1x": {"SMCDECODE_SAMPLE_RACE": "gumbel", "SMCDECODE_SAMPLE_NOISE": "1x"}}
    out = []
    for R, every in ((8, 1), (64, 1), (72, 9), (576, 9)):
        logits = torch.randn(R, 128256, device="cuda", dtype=torch.bfloat16) * 3
        seed = torch.tensor(7, device="cuda")
        row = {"rows": R, "sample_every": every}
        for name, env in settings.items():
            def run():
                kernels.triton_sample_and_score(logits, 0.7, seed, sample_every=every)
            row[f"{name}_us"] = 1e6 * with_env(env, lambda: graph_time(run, 30))
        out.append(row)
        print(f"sample rows={R} every={every}: " + ", ".join(f"{n} {row[n + '_us']:.1f} us" for n in settings),
              flush=True)
    res["sample"] = out


def tnorm_section(target: Llama, res: dict) -> None:
    """The 8B's w2 at the verify pass's 576 rows followed by the add + RMSNorm, all 32 layers: cuBLAS's
    x·Wᵀ + the row kernel, against W·xᵀ + the transposed-delta kernel under SMCDECODE_TNORM_CONFIG
    settings; and each norm alone (µs for 32 launches, graph replay)."""
    from bench_engine import with_env

    M, cfg = 576, target.cfg
    ws = [b.w2.weight for b in target.layers]
    xi = torch.randn(M, cfg.intermediate_size, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M, cfg.dim, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(cfg.dim, device="cuda", dtype=torch.bfloat16)
    d = F.linear(xi, ws[0])
    dt = torch.mm(ws[0], xi.t()).t()
    out = {"rows": M}

    def plain():
        for w in ws:
            kernels.triton_add_rms_norm(r, F.linear(xi, w), g, 1e-5)

    def plain_norm():
        for _ in ws:
            kernels.triton_add_rms_norm(r, d, g, 1e-5)

    out["cublas_plus_norm_us"] = 1e6 * graph_time(plain)
    out["norm_alone_us"] = 1e6 * graph_time(plain_norm)
    ref = kernels.triton_add_rms_norm(r, d, g, 1e-5)[1].float()
    for bm, warps in ((2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (8, 16), (16, 8), (16, 16)):
        env = {"SMCDECODE_TNORM_CONFIG": f"{bm},{warps}"}

        def tr():
            for w in ws:
                kernels.triton_add_rms_norm(r, torch.mm(w, xi.t()).t(), g, 1e-5)

        def tr_norm():
            for _ in ws:
                kernels.triton_add_rms_norm(r, dt, g, 1e-5)

        try:
            row = {"transposed_plus_norm_us": 1e6 * with_env(env, lambda: graph_time(tr)),
                   "norm_alone_us": 1e6 * with_env(env, lambda: graph_time(tr_norm)),
                   "max_abs_err": with_env(env, lambda: (kernels.triton_add_rms_norm(r, dt, g, 1e-5)[1].float()
                                                          - ref).abs().max().item())}
        except Exception as e:
            row = {"error": repr(e)[:200]}
        out[f"t{bm}x{warps}"] = row
        print(f"tnorm {bm} rows, {warps} warps: {row}", flush=True)
    print(f"tnorm baseline: cuBLAS + norm {out['cublas_plus_norm_us']:.1f} us, norm alone {out['norm_alone_us']:.1f} us",
          flush=True)
    res["tnorm"] = out


def cublas_section(target: Llama, draft: Llama, res: dict) -> None:
    out = []
    for name, model, Ms in (("draft", draft, (8, 16, 64, 128)), ("target", target, (1, 72, 576))):
        for M in Ms:
            for cls, (ws, inp) in _classes(model, M).items():
                nbytes = sum(w.numel() * w.element_size() for w in ws)
                row = {"model": name, "M": M, "class": cls}

                def lin():
                    for w in ws:
                        F.linear(inp, w)

                def swapped():
                    for w in ws:
                        torch.mm(w, inp.t())

                row["cublas_us"] = 1e6 * graph_time(lin)
                row["swapped_us"] = 1e6 * graph_time(swapped)
                prev = torch.backends.cuda.preferred_blas_library()
                try:
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                    row["cublaslt_us"] = 1e6 * graph_time(lin)
                except Exception as e:
                    row["cublaslt_error"] = repr(e)[:200]
                finally:
                    torch.backends.cuda.preferred_blas_library(prev)
                best = min(v for k, v in row.items() if k.endswith("_us"))
                row["cublas_TBps"] = nbytes / row["cublas_us"] / 1e6
                row["best_TBps"] = nbytes / best / 1e6
                out.append(row)
                print(f"{name:6s} M={M:4d} {cls:5s} cuBLAS {row['cublas_us']:8.1f}  swapped {row['swapped_us']:8.1f}  "
                      f"cuBLASLt {row.get('cublaslt_us', float('nan')):8.1f} us  ({row['cublas_TBps']:.2f} TB/s)",
                      flush=True)
    res["cublas"] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gemm")
    ap.add_argument("--sections", default="silu,cublas", help="comma-separated: silu, cublas, sample, tnorm")
    ap.add_argument("--silu-rows", default="64,128")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(0), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "torch": torch.__version__, "method": "each layer's own weights, CUDA-graph replay, median of 15"}
    secs = args.sections.split(",")
    target = draft = None
    if "silu" in secs or "cublas" in secs or "tnorm" in secs:
        target = Llama.random(PRESETS["llama-3.1-8b"], device="cuda", seed=1)
        draft = Llama.random(PRESETS["llama-3.2-1b"], device="cuda", seed=2)
    t0 = time.perf_counter()
    for sec, fn in (("silu", lambda: silu_section(draft, [int(m) for m in args.silu_rows.split(",")], res)),
                    ("cublas", lambda: cublas_section(target, draft, res)),
                    ("sample", lambda: sample_section(res)),
                    ("tnorm", lambda: tnorm_section(target, res))):
        if sec in secs:
            fn()
            (out / "gemm_variants.json").write_text(json.dumps(res, indent=1))
            print(f"[{sec} done at {time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
