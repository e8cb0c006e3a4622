"""Interleaved A/B, in one process, of exact speculative decoding and autoregressive sampling run by
their dedicated loops against the same programs on the request loop (exact-only rounds, exact.py).

    PYTHONPATH=$PWD python benchmarks/loop_programs_ab.py --out benchmarks/results/engine_general/loop_programs_ab.json
    PYTHONPATH=$PWD python benchmarks/loop_programs_ab.py --tiny --out /tmp/ab.json   # tiny random shapes (CPU)

Random-weight Llama-3.1-8B (target) / Llama-3.2-1B (draft) shapes in bf16 on one NVIDIA GPU (``--tiny``:
a tiny random pair, on the GPU if there is one, else the CPU), prompts of ``--prompt-len`` random
tokens, fixed-length outputs (no EOS), 1 and 8 requests:

    AR dedicated   autoregressive._run (its own step loop)         AR loop   Engine.autoregressive
    SD dedicated   Engine.speculative (speculative.py, K = 4)       SD loop   batch.run_speculative

Each repeat times every case once, in an order that alternates between repeats; the table gives
medians over repeats (tok/s of all requests) and loop / dedicated. Raw times go to --out as JSON.
``--profile``: after the timed repeats, one more call of each case under torch.profiler: its wall time,
the device's busy time (kernels summed) and its kernel count, to tell a gap in device work from one
in the host's launches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from smcdecode.backends.engine import PRESETS, Engine, Llama, LlamaConfig, batch
from smcdecode.backends.engine import autoregressive as dedicated_ar
from smcdecode.backends.engine.exact import launches

TINY = {"target": LlamaConfig(512, 64, 2, 4, 2, 128, rope_theta=10000.0),
        "draft": LlamaConfig(512, 32, 1, 2, 1, 64, rope_theta=10000.0)}


def cases(engine: Engine, prompts: list, ar_len: int, sd_len: int, K: int) -> dict:
    """name -> (call, tokens it generates)."""
    G = len(prompts)

    def ar_dedicated():
        with torch.inference_mode(), launches():
            dedicated_ar._run(engine, prompts, max_new_tokens=ar_len)

    def sd_loop():
        with torch.inference_mode(), launches():
            batch.run_speculative(engine, prompts, block_size=K, max_new_tokens=sd_len)

    return {
        "AR dedicated": (ar_dedicated, G * ar_len),
        "AR loop": (lambda: engine.autoregressive(prompts, max_new_tokens=ar_len), G * ar_len),
        "SD dedicated": (lambda: engine.speculative(prompts, block_size=K, max_new_tokens=sd_len), G * sd_len),
        "SD loop": (sd_loop, G * sd_len),
    }


def profiled(fn) -> dict:
    """Wall seconds, device-busy seconds (every kernel's time summed) and kernels of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"wall_s": wall, "device_busy_s": sum(e.device_time_total for e in kernels) / 1e6, "kernels": len(kernels)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random models (a CPU check of the script)")
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--ar-out-len", type=int, default=256)
    ap.add_argument("--sd-out-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="also profile one call of each case (GPU)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_general/loop_programs_ab.json"))
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and dev.type != "cuda":
        raise SystemExit("the full-size A/B needs an NVIDIA GPU (--tiny runs on the CPU)")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = TINY if args.tiny else {"target": PRESETS["llama-3.1-8b"], "draft": PRESETS["llama-3.2-1b"]}
    target = Llama.random(shapes["target"], device=dev, dtype=dtype, seed=1)
    draft = Llama.random(shapes["draft"], device=dev, dtype=dtype, seed=2)
    requests = [int(g) for g in args.requests.split(",")]
    K, PS, Gmax = args.block_size, 16, max(requests)
    longest = args.prompt_len + max(args.ar_out_len, args.sd_out_len) + K + 16
    engine = Engine(target, draft, num_pages=4 * Gmax * (-(-longest // PS) + 2) + 64, page_size=PS,
                    max_context=longest)
    gen = torch.Generator().manual_seed(0)
    V = shapes["target"].vocab_size
    prompts = torch.randint(0, V, (Gmax, args.prompt_len), generator=gen).tolist()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict = {}
    profiles: dict = {}
    for G in requests:
        calls = cases(engine, prompts[:G], args.ar_out_len, args.sd_out_len, K)
        for name in calls:  # capture and compile: a short call of each (the same graphs as the timed ones)
            fn = cases(engine, prompts[:G], 8, 8, K)[name][0]
            fn()
        order = list(calls)
        for r in range(args.repeats):
            for name in order if r % 2 == 0 else order[::-1]:
                fn, _ = calls[name]
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times.setdefault(f"{name}|{G}", []).append(time.perf_counter() - t0)
        if args.profile and dev.type == "cuda":
            for name, (fn, _) in calls.items():
                profiles[f"{name}|{G}"] = profiled(fn)
        engine.clear_graphs()
    rows = []
    for key, ts in times.items():
        name, G = key.split("|")
        n = cases(engine, prompts[: int(G)], args.ar_out_len, args.sd_out_len, K)[name][1]
        rows.append({"case": name, "requests": int(G), "seconds": ts, "tok_s": n / statistics.median(ts),
                     **({"profile": profiles[key]} if key in profiles else {})})
    res = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shapes": {k: v.__dict__ for k, v in shapes.items()}, "dtype": str(dtype),
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"{res['device']}, {res['date']}; medians of {args.repeats} interleaved repeats (tok/s, all requests)")
    print(f"{'case':<16}{'requests':>9}{'dedicated':>12}{'loop':>10}{'loop/ded.':>11}")
    by = {(x["case"], x["requests"]): x["tok_s"] for x in rows}
    for G in requests:
        for kind in ("AR", "SD"):
            a, b = by[(f"{kind} dedicated", G)], by[(f"{kind} loop", G)]
            print(f"{kind:<16}{G:>9}{a:>12.1f}{b:>10.1f}{b / a:>11.3f}")
    for x in rows:
        if "profile" in x:
            p = x["profile"]
            print(f"profile {x['case']} G={x['requests']}: wall {p['wall_s']:.3f} s, device busy "
                  f"{p['device_busy_s']:.3f} s, {p['kernels']} kernels")
    print(f"raw: {args.out}")


if __name__ == "__main__":
    main()
