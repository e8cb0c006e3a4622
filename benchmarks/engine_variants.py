"""Development measurements for the engine's kernels on one GPU (not the published benchmark:
that is bench_engine.py). Times, in one process:

1. the weight products of whole forwards (every layer's own weights, so nothing stays in L2),
   cuBLAS through torch against the Triton skinny product (kernels.triton_skinny_linear) at the
   row counts the strategies use, with a few block configurations at the draft's decode shape;
2. SMC-SD / AR end to end under kernel variants switched by environment flags
   (SMCDECODE_FUSED_ROPE, SMCDECODE_ATTN_MERGE, SMCDECODE_ATTN_PROGRAMS_PER_SM,
   SMCDECODE_ATTN_GROUP, SMCDECODE_SKINNY, SMCDECODE_SKINNY_SILU_ROWS, SMCDECODE_SPLITK), each after a fresh graph capture ("--sections sweep":
   each attention setting alone, then the ones that helped together; the best goes to best_env.txt);
3. a torch.profiler table of a graph-replayed SMC-SD call (per-round device time by kernel).

    PYTHONPATH=$PWD python benchmarks/engine_variants.py --out /tmp/variants

Writes variants.json and profile_*.txt into --out and prints compact tables.
"""

# ruff: noqa: B023  (the closures run before their loop advances)
from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_engine import graph_time, with_env  # benchmarks/ is on sys.path when run as a script

from smcdecode.backends.engine import PRESETS, Engine, Llama, kernels
from smcdecode.backends.engine.model import silu_mul


def gemm_section(target: Llama, draft: Llama, res: dict) -> None:
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    alt = [(16, bn, bk, 4, 4) for bn in (16, 32, 64) for bk in (128, 256, 512)] + [(16, bn, 512, 8, 3) for bn in (16, 32, 64)]
    for name, model, Ms in (("draft", draft, (8, 16, 64, 128)), ("target", target, (1, 8, 72))):
        cfg = model.cfg
        for M in Ms:
            x = torch.randn(M, cfg.dim, device="cuda", dtype=torch.bfloat16)
            xo = torch.randn(M, cfg.n_heads * cfg.head_dim, device="cuda", dtype=torch.bfloat16)
            xi = torch.randn(M, cfg.intermediate_size, device="cuda", dtype=torch.bfloat16)
            classes = {
                "wqkv": ([b.wqkv.weight for b in model.layers], x, False),
                "wo": ([b.wo.weight for b in model.layers], xo, False),
                "w13": ([b.w13.weight for b in model.layers], x, False),
                "w13+silu": ([b.w13.weight for b in model.layers], x, True),
                "w2": ([b.w2.weight for b in model.layers], xi, False),
                "head": ([model.output.weight], x, False),
            }
            for cls, (ws, inp, silu) in classes.items():
                try:
                    def cub():
                        for w in ws:
                            y = F.linear(inp, w)
                            if silu:
                                silu_mul(y)

                    t_cub = graph_time(cub)
                    configs = [None] + (alt if (name == "draft" and M == 8 and cls != "head") else [])
                    best = None
                    for c in configs:
                        def sk():
                            for w in ws:
                                kernels.triton_skinny_linear(inp, w, silu=silu, config=c)
                        try:
                            t = graph_time(sk)
                        except Exception as e:  # a configuration that does not compile
                            print("config", c, "failed:", repr(e)[:200], flush=True)
                            continue
                        if c is None:
                            t_default = t
                        if best is None or t < best[0]:
                            best = (t, c)
                    nbytes = sum(w.numel() * 2 for w in ws)
                    dflt = kernels.skinny_config(M, ws[0].shape[0] // (2 if silu else 1), ws[0].shape[1],
                                                 torch.device("cuda"), silu)
                    row = {"model": name, "M": M, "class": cls, "cublas_us": 1e6 * t_cub,
                           "skinny_default_us": 1e6 * t_default, "default_cfg": dflt,
                           "skinny_best_us": 1e6 * best[0], "best_cfg": best[1] or dflt,
                           "cublas_TBps": nbytes / t_cub / 1e12, "skinny_best_TBps": nbytes / best[0] / 1e12}
                    rows.append(row)
                    print(f"{name:6s} M={M:4d} {cls:9s} cublas {row['cublas_us']:8.1f} us ({row['cublas_TBps']:.2f} TB/s)"
                          f"  skinny {row['skinny_default_us']:8.1f} us  best {row['skinny_best_us']:8.1f} us "
                          f"({row['skinny_best_TBps']:.2f} TB/s) {row['best_cfg']}", flush=True)
                except Exception:
                    print(traceback.format_exc()[-1500:], flush=True)
    res["gemm"] = rows
    res["sms"] = sms


def run_variant(engine: Engine, env: dict, fn, repeats: int) -> float:
    def measure() -> float:
        try:
            engine.clear_graphs()
            fn(short=True)  # capture (and compile) outside the timing
            ts = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(short=False)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        finally:
            engine.clear_graphs()

    return with_env(env, measure)


_EXTRA_VARIANTS: list[tuple[str, dict]] = []  # --extra-variants
# the attention launch table before session 10 (decode:64 on 4 warps)
_S9_ATTN = json.dumps({"decode:64": [64, 4, 3, 2.0, 1], "decode:128": [128, 4, 2, 2.0, 0],
                       "verify:128": [64, 4, 3, 1.0, 1], "group": [128, 4, 3, 4.0, 0]})


def _variants() -> list[tuple[str, dict]]:
    """(name, settings) of the end-to-end variants (and those of --extra-variants)."""
    return _EXTRA_VARIANTS + [
        ("default", {}),
        ("no fused rope", {"SMCDECODE_FUSED_ROPE": "0"}),
        ("merge kernel", {"SMCDECODE_ATTN_MERGE": "kernel"}),
        ("attn per_sm=2", {"SMCDECODE_ATTN_PROGRAMS_PER_SM": "2"}),
        ("attn per_sm=8", {"SMCDECODE_ATTN_PROGRAMS_PER_SM": "8"}),
        ("attn per_sm=16", {"SMCDECODE_ATTN_PROGRAMS_PER_SM": "16"}),
        ("no skinny", {"SMCDECODE_SKINNY": "0"}),
        ("pipeline off", {"SMCDECODE_PIPELINE": "0"}),
        ("grouped attention", {"SMCDECODE_ATTN_GROUP": "auto"}),
        ("default attention config", {"SMCDECODE_ATTN_CONFIG": "{}"}),
        ("skinny SiLU <=64 rows", {"SMCDECODE_SKINNY_SILU_ROWS": "64"}),
        ("pdl", {"SMCDECODE_PDL": "1"}),
        ("pdl off", {"SMCDECODE_PDL": "0"}),
        ("transposed off", {"SMCDECODE_TRANSPOSED": "0"}),
        ("pdl wait-only", {"SMCDECODE_PDL": "2"}),
        ("skinny all", {"SMCDECODE_SKINNY_ALL": "1"}),
        ("pdl + skinny all", {"SMCDECODE_PDL": "1", "SMCDECODE_SKINNY_ALL": "1"}),
        ("split-K off", {"SMCDECODE_SPLITK": "0"}),
        ("split-K <=16 rows", {"SMCDECODE_SPLITK_ROWS": "16"}),
        ("fold norm off", {"SMCDECODE_FOLD_NORM": "0"}),
        ("sample chunk 8192", {"SMCDECODE_SAMPLE_CHUNK": "8192"}),
        ("fold+chunk off", {"SMCDECODE_FOLD_NORM": "0", "SMCDECODE_SAMPLE_CHUNK": "8192"}),
        ("fold wo unsplit", {"SMCDECODE_SPLITK_CONFIG": json.dumps({"2048x2048": [16, 256, 4, 4, 1]})}),
        ("fold unsplit", {"SMCDECODE_SPLITK_CONFIG": json.dumps({"2048x2048": [16, 256, 4, 4, 1],
                                                                  "2048x8192": [16, 256, 4, 4, 1]})}),
        ("cublaslt off", {"SMCDECODE_CUBLASLT": "0"}),
        ("silu <=16 rows", {"SMCDECODE_SKINNY_SILU_ROWS": "16"}),
        ("session 8 products", {"SMCDECODE_CUBLASLT": "0", "SMCDECODE_SKINNY_SILU_ROWS": "16"}),
        ("sample noise 1x", {"SMCDECODE_SAMPLE_NOISE": "1x"}),
        ("sample race gumbel", {"SMCDECODE_SAMPLE_RACE": "gumbel"}),
        ("session 9 attention", {"SMCDECODE_ATTN_CONFIG": _S9_ATTN}),
        ("session 9 sampler and attention", {"SMCDECODE_SAMPLE_RACE": "gumbel", "SMCDECODE_ATTN_CONFIG": _S9_ATTN}),
    ]


def e2e_section(engine: Engine, prompts: list[list[int]], res: dict, out_len: int, repeats: int,
                only: list[str] | None = None, skip_ar: bool = False, extra_env: dict | None = None) -> None:
    extra_env = extra_env or {}
    variants = _variants()
    variants = [(n, {**extra_env, **e}) for n, e in variants]
    if only:
        variants = [v for v in variants if v[0] in only]
    rows = []
    for G, N, K, names in ((1, 8, 8, None), (8, 8, 8, ("default", "attn per_sm=2", "attn per_sm=8", "attn per_sm=16",
                                                          "no skinny", "grouped attention", "merge kernel",
                                                          "pipeline off", "default attention config",
                                                          "skinny SiLU <=64 rows", "pdl", "pdl wait-only",
                                                          "skinny all", "pdl + skinny all", "split-K off",
                                                          "split-K <=16 rows", "fold norm off", "fold unsplit"))):
        for name, env in variants:
            if names is not None and name not in names:
                continue
            P = prompts[:G]

            def fn(short: bool):
                engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=3 * (K + 1) if short else out_len)

            try:
                t = run_variant(engine, env, fn, repeats)
                r = {"strategy": f"SMC-SD {G}x N={N} K={K}", "variant": name, "env": env, "s": t,
                     "tok_s_total": G * out_len / t, "ms_per_round": 1e3 * t / -(-out_len // (K + 1))}
            except Exception:
                r = {"strategy": f"SMC-SD {G}x N={N} K={K}", "variant": name, "error": traceback.format_exc()[-1500:]}
            rows.append(r)
            print(r, flush=True)
    for G in () if skip_ar else (1, 8):
        for name, env in (("default", {}), ("no skinny", {"SMCDECODE_SKINNY": "0"}),
                          ("no fused rope", {"SMCDECODE_FUSED_ROPE": "0"}), ("merge kernel", {"SMCDECODE_ATTN_MERGE": "kernel"}),
                          ("pdl", {"SMCDECODE_PDL": "1"}),
        ("pdl off", {"SMCDECODE_PDL": "0"}),
        ("transposed off", {"SMCDECODE_TRANSPOSED": "0"}),
                          ("pdl + skinny all", {"SMCDECODE_PDL": "1", "SMCDECODE_SKINNY_ALL": "1"}),
                          ("split-K off", {"SMCDECODE_SPLITK": "0"}), ("fold norm off", {"SMCDECODE_FOLD_NORM": "0"}),
                          ("sample chunk 8192", {"SMCDECODE_SAMPLE_CHUNK": "8192"})):
            if only and name not in only:
                continue
            env = {**extra_env, **env}
            P = prompts[:G]

            def fn(short: bool):
                engine.autoregressive(P, max_new_tokens=8 if short else out_len // 2)

            try:
                t = run_variant(engine, env, fn, repeats)
                r = {"strategy": f"AR {G}x", "variant": name, "env": env, "s": t, "tok_s_total": G * (out_len // 2) / t,
                     "ms_per_step": 1e3 * t / (out_len // 2)}
            except Exception:
                r = {"strategy": f"AR {G}x", "variant": name, "error": traceback.format_exc()[-1500:]}
            rows.append(r)
            print(r, flush=True)
    res["e2e"] = rows


def interleaved_section(target: Llama, draft: Llama, prompts: list[list[int]], res: dict, out_len: int,
                        repeats: int, names: list[str], groups: tuple[int, ...] = (1,), strategy: str = "smc") -> None:
    """SMC-SD N=8 K=8 (``strategy`` "smc") or autoregressive decoding ("ar") under the variants
    ``names`` (the e2e table's settings), measured interleaved: one Engine per variant (each captures
    its own graphs under its settings), then ``repeats`` passes that run every variant once in turn,
    so slow drifts of the machine hit all variants alike. Reports each variant's median and the
    median of its per-pass difference from the first variant, in ms a round (SMC-SD) or a token (AR)."""
    table = dict(_variants())
    rows = []
    for G in groups:
        P = prompts[:G]
        pages = G * 12 * (-(-(out_len + 16) // 16) + 1) + G * 16 + 64
        engines = []
        for name in names:
            env = table[name]
            eng = Engine(target, draft, num_pages=pages, page_size=16, max_context=256 + out_len + 16)

            def fn(eng=eng, short=True):
                if strategy == "ar":
                    return eng.autoregressive(P, max_new_tokens=27 if short else out_len)
                return eng.smc_sd(P, particles=8, block_size=8, max_new_tokens=3 * 9 if short else out_len)

            with_env(env, lambda: (fn(), fn(short=False)))  # capture, then one full run
            engines.append((name, env, fn))
        times = {name: [] for name in names}
        for _ in range(repeats):
            for name, env, fn in engines:
                def timed(fn=fn):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn(short=False)
                    torch.cuda.synchronize()
                    return time.perf_counter() - t0
                times[name].append(with_env(env, timed))
        rounds = out_len if strategy == "ar" else -(-out_len // 9)
        base = times[names[0]]
        for name in names:
            ts = times[name]
            what = "AR" if strategy == "ar" else "SMC-SD"
            r = {"strategy": f"{what} {G}x" + ("" if strategy == "ar" else " N=8 K=8") + " (interleaved)",
                 "variant": name, "env": table[name],
                 "ms_per_round": 1e3 * statistics.median(ts) / rounds,
                 "ms_per_round_all": [1e3 * t / rounds for t in ts],
                 "diff_vs_first_ms": 1e3 * statistics.median([a - b for a, b in zip(ts, base)]) / rounds}
            rows.append(r)
            print(f"interleaved {what} G={G} {name:28s} {r['ms_per_round']:7.3f} ms/round  "
                  f"diff vs {names[0]}: {r['diff_vs_first_ms']:+.3f} ms", flush=True)
        del engines
        torch.cuda.empty_cache()
    res["interleaved"] = rows


def sweep_section(engine: Engine, prompts: list[list[int]], res: dict, out: Path, no_group: bool = False) -> None:
    """Attention settings on SMC-SD N=8 K=8 (1 request, 1024 tokens; 8 requests, 512 tokens) and AR
    (1 request, 256 tokens): each knob alone against the defaults, then all knobs that helped
    together; writes the best setting's environment (the defaults when none helps) to best_env.txt."""
    A = "SMCDECODE_ATTN_"
    base = {}
    singles = [{A + "GROUP": "auto"}, {A + "PROGRAMS_PER_SM": "1"}, {A + "PROGRAMS_PER_SM": "4"},
               {A + "MERGE": "kernel"}]
    if no_group:
        singles = singles[1:]

    def measure(env: dict) -> dict:
        r = {"env": env}
        try:
            r["smc1_s"] = run_variant(engine, env, lambda short: engine.smc_sd(
                prompts[:1], particles=8, block_size=8, max_new_tokens=27 if short else 1024), 1)
            r["smc8_s"] = run_variant(engine, env, lambda short: engine.smc_sd(
                prompts, particles=8, block_size=8, max_new_tokens=27 if short else 512), 1)
            r["ar_s"] = run_variant(engine, env, lambda short: engine.autoregressive(
                prompts[:1], max_new_tokens=8 if short else 256), 1)
        except Exception:
            r["error"] = traceback.format_exc()[-1500:]
        print(r, flush=True)
        return r

    rows = [measure(base)]
    b0 = rows[0]
    score = lambda r: r["smc1_s"] / b0["smc1_s"] + r["smc8_s"] / b0["smc8_s"] + r["ar_s"] / b0["ar_s"]  # noqa: E731
    helped = {}
    for env in singles:
        r = measure({**base, **env})
        rows.append(r)
        if "error" not in r and score(r) < 3 * 0.99:
            k = next(iter(env))
            if k not in helped or score(r) < helped[k][0]:
                helped[k] = (score(r), env[k])
    if len(helped) > 1:
        rows.append(measure({**base, **{k: v for k, (_, v) in helped.items()}}))
    ok = [r for r in rows if "error" not in r]
    best = min(ok, key=score)
    for r in ok:
        r["score"] = score(r)
    res["sweep"] = rows
    (out / "best_env.txt").write_text("".join(f"{k}={v}\n" for k, v in best["env"].items()))
    print("best", best, flush=True)


def profile_section(engine: Engine, prompts: list[list[int]], out: Path, res: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    for G in (1, 8):
        P = prompts[:G]
        engine.smc_sd(P, particles=8, block_size=8, max_new_tokens=27)  # capture
        rounds = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.smc_sd(P, particles=8, block_size=8, max_new_tokens=rounds * 9)
            torch.cuda.synchronize()
        ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        lines = [f"SMC-SD {G} request(s) N=8 K=8, {rounds} graph rounds (+ prefill): device time per round",
                 f"{'kernel':90s} {'ms/round':>9s} {'calls/round':>11s} {'us/call':>8s}"]
        total = 0.0
        for e in ev:
            if e.device_time_total <= 0:
                continue
            total += e.device_time_total
        for e in ev[:40]:
            if e.device_time_total <= 0:
                continue
            lines.append(f"{e.key[:90]:90s} {e.device_time_total / 1e3 / rounds:9.3f} {e.count / rounds:11.1f} "
                         f"{e.device_time_total / max(e.count, 1):8.2f}")
        lines.append(f"{'total device time':90s} {total / 1e3 / rounds:9.3f}")
        (out / f"profile_smc_{G}.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:30]), flush=True)
        res[f"profile_smc_{G}"] = lines
        engine.clear_graphs()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/variants")
    ap.add_argument("--out-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sections", default="gemm,e2e,profile")
    ap.add_argument("--only", default="", help="comma-separated e2e variant names (default: all; names have no commas)")
    ap.add_argument("--skip-ar", action="store_true", help="e2e: SMC-SD variants only")
    ap.add_argument("--groups", default="1", help="interleave: request counts (comma-separated), e.g. 1,8")
    ap.add_argument("--strategy", default="smc", choices=("smc", "ar"),
                    help="interleave: SMC-SD N=8 K=8 (ms a round) or autoregressive decoding (ms a token)")
    ap.add_argument("--no-group", action="store_true", help="leave the opt-in grouped attention out of the sweep")
    ap.add_argument("--extra-env", default="", help="a JSON file of settings added to every e2e variant "
                    "(e.g. pdl_bench.py's best_env.json)")
    ap.add_argument("--extra-variants", default="", help="a JSON file {name: {setting: value}} of variants added "
                    "to the table (values that are not strings are written as JSON)")
    args = ap.parse_args()
    if args.extra_variants:
        for name, env in json.loads(Path(args.extra_variants).read_text()).items():
            _EXTRA_VARIANTS.append((name, {k: v if isinstance(v, str) else json.dumps(v) for k, v in env.items()}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(0)}
    target = Llama.random(PRESETS["llama-3.1-8b"], device="cuda", seed=1)
    draft = Llama.random(PRESETS["llama-3.2-1b"], device="cuda", seed=2)
    secs = args.sections.split(",")
    t0 = time.perf_counter()
    if "gemm" in secs:
        try:
            gemm_section(target, draft, res)
        except Exception:
            print(traceback.format_exc(), flush=True)
        (out / "variants.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"[gemm section done at {time.perf_counter() - t0:.0f} s]", flush=True)
    torch.manual_seed(0)
    prompts = [p.tolist() for p in torch.randint(0, 128000, (8, 256))]
    max_ctx = 256 + 1024 + 16
    num_pages = 8 * 12 * (-(-(1024 + 16) // 16) + 1) + 8 * 16 + 64
    engine = Engine(target, draft, num_pages=num_pages, page_size=16, max_context=max_ctx)
    if "e2e" in secs:
        try:
            e2e_section(engine, prompts, res, args.out_len, args.repeats,
                        only=args.only.split(",") if args.only else None, skip_ar=args.skip_ar,
                        extra_env=json.loads(Path(args.extra_env).read_text()) if args.extra_env else None)
        except Exception:
            print(traceback.format_exc(), flush=True)
        (out / "variants.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"[e2e section done at {time.perf_counter() - t0:.0f} s]", flush=True)
    if "interleave" in secs:
        try:
            interleaved_section(target, draft, prompts, res, args.out_len, args.repeats, args.only.split(","),
                                tuple(int(g) for g in args.groups.split(",")), args.strategy)
        except Exception:
            print(traceback.format_exc(), flush=True)
        (out / "variants.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"[interleaved section done at {time.perf_counter() - t0:.0f} s]", flush=True)
    if "sweep" in secs:
        try:
            sweep_section(engine, prompts, res, out, no_group=args.no_group)
        except Exception:
            print(traceback.format_exc(), flush=True)
        (out / "variants.json").write_text(json.dumps(res, indent=1, default=str))
    if "profile" in secs:
        try:
            profile_section(engine, prompts, out, res)
        except Exception:
            print(traceback.format_exc(), flush=True)
        (out / "variants.json").write_text(json.dumps(res, indent=1, default=str))
    print("\nSUMMARY")
    for r in res.get("e2e", []):
        if "error" in r:
            print(r["strategy"], r["variant"], "ERROR", r["error"][-300:])
        else:
            print(f"{r['strategy']:22s} {r['variant']:34s} {r['tok_s_total']:8.1f} tok/s "
                  f"{r.get('ms_per_round', r.get('ms_per_step')):7.2f} ms")


if __name__ == "__main__":
    main()
