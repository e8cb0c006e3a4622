"""Prompt intersection (LMReward, prefix mode) in the SMC loop: incremental scoring vs rescoring
whole prefixes every round, on the default model (SmolLM2-135M-Instruct), the reference backend.

    python benchmarks/lm_reward_speed.py --device cpu --repeats 3 --out benchmarks/results/lm_reward_speed.json

Both variants run the same seeded program (the target as proposal, N particles, T = 0.8) and must
return the same text; the script reports the median wall time of each over --repeats runs,
interleaved, with the device, date and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--particles", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import smcdecode as sd
    from smcdecode.potentials import LMReward

    model = sd.load_model(args.model, device=args.device, threads=args.threads)
    question = [{"role": "user", "content": "Write one sentence about your favourite place."}]
    second = model.prompt_ids([{"role": "user", "content": "Write one sentence about the sea and sailing."}])
    times: dict[str, list[float]] = {"incremental": [], "whole prefixes": []}
    texts: dict[str, str] = {}
    for _ in range(args.repeats):
        for name in times:
            reward = LMReward(model, second, beta=1.0, mode="prefix", incremental=name == "incremental")
            smc = sd.SMC(sd.LM(model, temperature=0.8) * reward, particles=args.particles)
            start = time.perf_counter()
            res = smc.run(question, max_new_tokens=args.max_new_tokens, seed=0, progress=False)
            times[name].append(time.perf_counter() - start)
            texts[name] = res.text
    same = texts["incremental"] == texts["whole prefixes"]
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": args.device, "model": model.name,
        "threads": args.threads, "particles": args.particles, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "load_average": os.getloadavg(), "seconds": times, "median_seconds": med,
        "speedup": med["whole prefixes"] / med["incremental"], "same_text": same, "text": texts["incremental"],
    }
    for k, v in med.items():
        print(f"{k:15s} median {v:6.1f} s  ({', '.join(f'{t:.1f}' for t in times[k])})")
    print(f"speed-up {report['speedup']:.1f}x; same text: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
