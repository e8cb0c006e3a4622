"""Where a general round's time goes: SMC-SD on random-weight Llama-3.1-8B / Llama-3.2-1B shapes (bf16,
N = 8, K = 8), each target program of ``engine_programs.py`` against the plain round, 1 and 8 requests.

    python benchmarks/profile_programs.py --out DIR      # one NVIDIA GPU, ~2 minutes

For each (program, requests): wall seconds per round of a timed call (CUDA graphs, the engine's
defaults; medians of --repeats), the host's seconds per round (``EngineOutput.host_s``), and the
device time per round of replayed rounds by kernel (torch.profiler, PDL off so that kernel spans do
not include waits). Then, per program, the kernels whose device time per round differs most from
the plain round's. Writes ``DIR/profile_programs.json`` and ``DIR/profile_programs.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_programs import program  # noqa: E402

from smcdecode.backends.engine import PRESETS, Engine, Llama  # noqa: E402
from smcdecode.backends.engine.kernels.common import pdl_off  # noqa: E402


def kernels(prof, rounds: int) -> dict[str, float]:
    """ms per round of each kernel name."""
    return {e.key: e.device_time_total / 1e3 / rounds for e in prof.key_averages() if e.device_time_total > 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--programs", default="plain,regex,alpha2")
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    names = args.programs.split(",")
    if names[0] != "plain":
        names = ["plain"] + [n for n in names if n != "plain"]
    requests = [int(g) for g in args.requests.split(",")]
    N, K, L, prompt_len = 8, 8, args.out_len, 256
    n_prof = 20  # rounds profiled
    longest = max(L, n_prof * (K + 1))
    torch.manual_seed(0)
    target = Llama.random(PRESETS["llama-3.1-8b"], device="cuda", seed=1)
    draft = Llama.random(PRESETS["llama-3.2-1b"], device="cuda", seed=2)
    P = torch.randint(0, 128000, (max(requests), prompt_len)).tolist()
    num_pages = max(requests) * (N + 4) * (-(-(longest + 32) // 16) + 1) + max(requests) * (prompt_len // 16) + 64
    engine = Engine(target, draft, num_pages=num_pages, page_size=16, max_context=prompt_len + longest + 32)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shapes": {"target": "llama-3.1-8b", "draft": "llama-3.2-1b", "dtype": "bfloat16", "particles": N,
                      "block_size": K, "prompt_len": prompt_len, "out_len": L}, "rows": []}
    lines = []
    for G in requests:
        per = {}
        for name in names:
            kw, label = program(name)
            engine.smc_sd(P[:G], particles=N, block_size=K, max_new_tokens=3 * (K + 1), **kw)  # capture
            walls, hosts, rounds = [], [], []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                o = engine.smc_sd(P[:G], particles=N, block_size=K, max_new_tokens=L, **kw)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
                hosts.append(o.host_s)
                rounds.append(o.rounds)
            R = statistics.median(rounds)
            engine.clear_graphs()
            with pdl_off():
                engine.smc_sd(P[:G], particles=N, block_size=K, max_new_tokens=3 * (K + 1), **kw)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    engine.smc_sd(P[:G], particles=N, block_size=K, max_new_tokens=n_prof * (K + 1), **kw)
                    torch.cuda.synchronize()
            engine.clear_graphs()
            ks = kernels(prof, n_prof)
            per[name] = ks
            row = {"program": label, "requests": G, "rounds": R, "wall_ms_per_round": 1e3 * statistics.median(walls) / R,
                   "host_ms_per_round": 1e3 * statistics.median(hosts) / R, "device_ms_per_round": sum(ks.values()),
                   "kernels": sorted(ks.items(), key=lambda kv: -kv[1])[:40]}
            res["rows"].append(row)
            lines.append(f"G={G} {label:8s} wall {row['wall_ms_per_round']:.2f} ms/round, host {row['host_ms_per_round']:.2f}, "
                         f"device {row['device_ms_per_round']:.2f} (PDL off), {R:.0f} rounds")
            print(lines[-1], flush=True)
        for name in names[1:]:
            diff = {k: per[name].get(k, 0.0) - per["plain"].get(k, 0.0) for k in set(per[name]) | set(per["plain"])}
            top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:25]
            lines.append(f"\nG={G} {name} minus plain, device ms/round by kernel (total {sum(diff.values()):+.3f}):")
            lines += [f"  {v:+8.3f}  {per[name].get(k, 0.0):8.3f}  {k[:110]}" for k, v in top]
            print("\n".join(lines[-26:]), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_programs.json").write_text(json.dumps(res, indent=1))
        (args.out / "profile_programs.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
