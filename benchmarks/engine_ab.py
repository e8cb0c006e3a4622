"""Interleaved A/B of the engine between two source trees (e.g. a change against the commit before it).

    python benchmarks/engine_ab.py --a /path/to/old/checkout --b . --passes 3   # one NVIDIA GPU

Each pass runs one process per tree, in alternating order (A B, then B A, …), each importing
``smcdecode`` from its own tree and timing, on random-weight Llama-3.1-8B / Llama-3.2-1B shapes in
bf16: SMC-SD N×K for 1 and G requests (fixed-length outputs; ``--programs``: the plain round, α = 2, a
regex over a synthetic vocabulary, mixed per-request K), the engine's autoregressive decoding and
(``--sd``) exact speculative decoding.
Only the public engine API (``Engine``, ``Llama.random``, ``PRESETS``) is used, so both trees run the
same measurement. Raw results (every pass) go to --out as JSON; the table printed gives medians over
passes of each process's median run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, statistics, sys, time
import torch
sys.path.insert(0, json.loads(sys.argv[1])["bench_dir"])
from engine_programs import program
from smcdecode.backends.engine import PRESETS, Engine, Llama
import smcdecode
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
target = Llama.random(PRESETS["llama-3.1-8b"], device="cuda", seed=1)
draft = Llama.random(PRESETS["llama-3.2-1b"], device="cuda", seed=2)
G_max = max(cfg["requests"])
P = torch.randint(0, 128000, (G_max, cfg["prompt_len"])).tolist()
N, K, L = cfg["particles"], cfg["block_size"], cfg["out_len"]
num_pages = 8 * (N + 4) * (-(-(L + 16) // 16) + 1) + G_max * (-(-cfg["prompt_len"] // 16)) + 64
engine = Engine(target, draft, num_pages=num_pages, page_size=16, max_context=cfg["prompt_len"] + L + 16)

generated = []  # tokens of the last timed call: the longest particle of each request, summed

def timed(fn):
    out = []
    for _ in range(cfg["repeats"]):
        torch.cuda.synchronize(); t0 = time.perf_counter(); r = fn(); torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    generated[:] = [int(r.lengths.max(1).values.sum())] if hasattr(r, "lengths") else [None]
    return out

def rate(G, s):  # tokens generated per second (all requests)
    n = generated[0] if generated and generated[0] is not None else G * L
    return n / statistics.median(s)

rows = []
for G in cfg["requests"]:
    for name in cfg["programs"]:
        if name == "mixed":  # half the requests at K, half at K/2; and the two halves in calls of their own
            ks = [K if g % 2 == 0 else K // 2 for g in range(G)]
            engine.smc_sd(P[:G], particles=N, block_size=ks, max_new_tokens=3 * (K + 1))
            s = timed(lambda: engine.smc_sd(P[:G], particles=N, block_size=ks, max_new_tokens=L))
            rows.append({"system": f"SMC-SD N={N} K={K}|{K // 2} mixed", "requests": G, "seconds": s,
                         "tok_s_total": rate(G, s)})
            if G > 1:
                def apart():
                    engine.smc_sd(P[:G:2], particles=N, block_size=K, max_new_tokens=L)
                    engine.smc_sd(P[1:G:2], particles=N, block_size=K // 2, max_new_tokens=L)
                    generated[:] = [None]
                engine.smc_sd(P[1:G:2], particles=N, block_size=K // 2, max_new_tokens=3 * (K + 1))
                s = timed(apart)
                rows.append({"system": f"SMC-SD N={N} K={K}|{K // 2} apart", "requests": G, "seconds": s,
                             "tok_s_total": G * L / statistics.median(s)})
            engine.clear_graphs()
            continue
        kw, label = program(name)
        engine.smc_sd(P[:G], particles=N, block_size=K, max_new_tokens=3 * (K + 1), **kw)
        s = timed(lambda: engine.smc_sd(P[:G], particles=N, block_size=K, max_new_tokens=L, **kw))
        rows.append({"system": f"SMC-SD N={N} K={K}" + ("" if label == "plain" else f" {label}"), "requests": G,
                     "seconds": s, "tok_s_total": rate(G, s)})
        engine.clear_graphs()
    if cfg["ar"]:
        engine.autoregressive(P[:G], max_new_tokens=8)
        s = timed(lambda: engine.autoregressive(P[:G], max_new_tokens=L))
        rows.append({"system": "AR", "requests": G, "seconds": s, "tok_s_total": G * L / statistics.median(s)})
        engine.clear_graphs()
    if cfg["sd"]:  # exact speculative decoding, K = 4 (random weights accept almost nothing: ~1 token a round)
        Lsd = cfg["sd_out_len"]
        engine.speculative(P[:G], block_size=4, max_new_tokens=8)
        s = timed(lambda: engine.speculative(P[:G], block_size=4, max_new_tokens=Lsd))
        rows.append({"system": "exact SD K=4", "requests": G, "seconds": s, "tok_s_total": G * Lsd / statistics.median(s)})
        engine.clear_graphs()
print("RESULT " + json.dumps({"smcdecode": smcdecode.__file__, "rows": rows}))
"""


def save_ab(out: Path, table: list, raw: list) -> None:
    """Write an A/B's table and raw results to ``out`` (JSON, with the date and the CPU count)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                               "cpu_count": os.cpu_count(), "table": table, "raw": raw}, indent=1))


def run_tree(tree: Path, cfg: dict, worker: str = WORKER, **env_extra: str) -> dict:
    """Run ``worker`` (Python source printing one ``RESULT {json}`` line) in a process that imports
    smcdecode from ``tree``; ``env_extra``: more environment variables."""
    extra = os.environ.get("PYTHONPATH", "")  # (other paths after the tree: e.g. wheels installed elsewhere)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tree.resolve()), extra) if p), **env_extra)
    p = subprocess.run([sys.executable, "-c", worker, json.dumps(cfg)], env=env, capture_output=True, text=True,
                       cwd=tree)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker for {tree} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, type=Path, help="source tree A (the baseline)")
    ap.add_argument("--b", required=True, type=Path, help="source tree B (the change)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per process and case")
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--out-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--no-ar", action="store_true", help="skip the autoregressive runs")
    ap.add_argument("--sd", action="store_true", help="also time exact speculative decoding (K = 4)")
    ap.add_argument("--sd-out-len", type=int, default=128)
    ap.add_argument("--programs", default="plain",
                    help="comma-separated SMC-SD programs: plain, alpha2, regex, mixed (K and K/2 per request, "
                         "and the two halves run apart)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_ab.json"))
    args = ap.parse_args()
    import torch

    cfg = {"particles": args.particles, "block_size": args.block_size, "out_len": args.out_len,
           "prompt_len": args.prompt_len, "requests": [int(g) for g in args.requests.split(",")],
           "repeats": args.repeats, "ar": not args.no_ar, "sd": args.sd, "sd_out_len": args.sd_out_len,
           "programs": args.programs.split(","),
           "bench_dir": str(Path(__file__).resolve().parent)}  # (both trees run this tree's programs)
    trees = {"A": args.a, "B": args.b}
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "trees": {k: str(v) for k, v in trees.items()}, "config": cfg, "passes": []}
    for p in range(args.passes):
        order = ["A", "B"] if p % 2 == 0 else ["B", "A"]
        for name in order:
            r = run_tree(trees[name], cfg)
            res["passes"].append({"pass": p, "tree": name, **r})
            print(f"pass {p} {name}: " + ", ".join(f"{x['system']} G={x['requests']} {x['tok_s_total']:.1f} tok/s"
                                                   for x in r["rows"]), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))  # after every process: a cut-off run keeps its passes
    print(f"\n{res['device']}, {res['date']}; medians over {args.passes} passes (tok/s, all requests)")
    print(f"{'case':<28}{'A':>10}{'B':>10}{'B/A':>8}")
    cases = [(x["system"], x["requests"]) for x in res["passes"][0]["rows"]]
    for system, G in cases:
        med = {}
        for name in trees:
            med[name] = statistics.median(x["tok_s_total"] for q in res["passes"] if q["tree"] == name
                                          for x in q["rows"] if (x["system"], x["requests"]) == (system, G))
        print(f"{system + f' G={G}':<28}{med['A']:>10.1f}{med['B']:>10.1f}{med['B'] / med['A']:>8.3f}")
    print(f"raw: {args.out}")


if __name__ == "__main__":
    main()
