"""Where the time of a host-mask (llguidance) constrained call goes, on the GPU engine.

Random-weight Llama-3.1-8B / 3.2-1B shapes in bf16 (structured_engine.py's random pair), or with
``--smollm2-gguf`` the real SmolLM2-135M-Instruct and the shipped draft, and one of
structured_engine.py's schemas (``--schema``: its small closed object, the pattern keys or the open
object) with ``path="llguidance"``; SMC-SD N = 8, K = 8, up to 256 new tokens, 1 and 8 requests. For each: the call's wall time without a profiler (median of 3), then one call under
cProfile, whose cumulative times of the host-mask steps give the breakdown:

- ``llguidance mask fill``: ``unsafe_compute_mask_ptr`` (llguidance's thread pool fills every row's
  packed mask of a step);
- ``matchers advanced``: ``RequestMasks._catch_up`` (the drafted tokens consumed by the matchers);
- ``waiting for drafted tokens``: ``HostMasks._column`` (the host waits for a draft step's column);
- ``bonus and round end``: ``HostMasks.end`` (it waits for the round's bonus tokens);
- ``mask() (a step's host point)``: ``HostMasks.mask`` (the fill, the advance, the waits and the upload
  of a draft step's or the bonus's masks).

    python benchmarks/profile_host_masks.py        # one NVIDIA GPU; writes benchmarks/results/structured/host_masks_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import structured_engine as se  # noqa: E402

import smcdecode as sd  # noqa: E402
from smcdecode.backends.engine import Engine  # noqa: E402
from smcdecode.backends.engine.targets import EngineTarget  # noqa: E402
from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

PARTS = {  # name -> (file suffix, function name) in the profile
    "llguidance mask fill": ("~", "<method 'unsafe_compute_mask_ptr' of 'builtins.LLExecutor' objects>"),
    "matchers advanced": ("host_masks.py", "_catch_up"),
    "waiting for drafted tokens": ("host_masks.py", "_column"),
    "bonus and round end": ("host_masks.py", "end"),
    "mask() (a step's host point)": ("host_masks.py", "mask"),
}
SCHEMAS = {"small": se.DEFAULT_SCHEMA, "pattern": se.PATTERN_SCHEMA, "open": se.OPEN_SCHEMA}


class Counting:
    """An llguidance executor that counts the masks it fills."""

    def __init__(self, executor):
        self.executor, self.masks = executor, 0

    def unsafe_compute_mask_ptr(self, pairs, *rest):
        self.masks += len(pairs)
        return self.executor.unsafe_compute_mask_ptr(pairs, *rest)

    def __getattr__(self, name):
        return getattr(self.executor, name)


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    total = 0.0
    for (path, _, func), (_, _, _, ct, _) in stats.stats.items():
        if func == name and path.endswith(suffix):
            total += ct
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--tiny", action="store_true", help="tiny random models on the CPU (checks the script)")
    ap.add_argument("--smollm2-gguf", default=None, help="SmolLM2-135M-Instruct GGUF: the real pair instead")
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="small")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "structured" / "host_masks_profile.json")
    args = ap.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (or --tiny for the CPU check)")
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    requests = [int(g) for g in args.requests.split(",")]
    ns = argparse.Namespace(tiny=args.tiny, smollm2_gguf=args.smollm2_gguf, requests=requests, prompt_len=128)
    load = se.smollm2_models if args.smollm2_gguf else se.random_models
    name, target, draft, model, prompts, eos = load(ns, device, dtype)
    engine = Engine(target, draft, num_pages=8192, page_size=16, max_context=1024)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    schema = SCHEMAS[args.schema]
    constraint = JSONSchema(schema, path="llguidance").bind(model)
    constraint._executor = counting = Counting(constraint._executor)
    program = EngineTarget.of(sd.LM(model) * constraint)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (--tiny)", "cpus": os.cpu_count(), "model": name,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "schema": schema, "settings": {"N": 8, "K": 8, "max_new_tokens": 256}, "rows": []}
    for G in requests:
        P = prompts[:G]
        kw = dict(particles=8, block_size=8, target=program, eos_token_id=eos)
        engine.smc_sd(P, max_new_tokens=18, **kw)  # (captures the round's graphs)
        walls, rounds = [], []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            out = engine.smc_sd(P, max_new_tokens=256, **kw)
            sync()
            walls.append(time.perf_counter() - t0)
            rounds.append(out.rounds)
        counting.masks = 0
        profile = cProfile.Profile()
        sync()
        t0 = time.perf_counter()
        profile.enable()
        out = engine.smc_sd(P, max_new_tokens=256, **kw)
        sync()
        profile.disable()
        profiled = time.perf_counter() - t0
        stats = pstats.Stats(profile)
        parts = {k: cumulative(stats, *v) for k, v in PARTS.items()}
        calls = sum(n for (path, _, func), (_, n, _, _, _) in stats.stats.items()
                    if func == PARTS["llguidance mask fill"][1])
        consumed = sum(n for (path, _, func), (_, n, _, _, _) in stats.stats.items()
                       if func == "<method 'consume_token' of 'builtins.LLMatcher' objects>")
        row = {"requests": G, "wall_s_median": statistics.median(walls), "rounds": rounds,
               "profiled_wall_s": profiled, "profiled_rounds": out.rounds, "mask_fill_calls": calls,
               "matchers_filled": counting.masks, "tokens_consumed": consumed,  # (consume_token calls)
               "seconds": parts, "share_of_profiled_wall": {k: v / profiled for k, v in parts.items()}}
        res["rows"].append(row)
        print(f"{G} request(s): {statistics.median(walls) * 1e3:.1f} ms a call ({rounds[-1]} rounds); under the "
              f"profiler {profiled * 1e3:.1f} ms, of which:", flush=True)
        for k, v in parts.items():
            print(f"    {k:28s} {v * 1e3:8.1f} ms  {100 * v / profiled:5.1f} %", flush=True)
        print(f"    ({calls} mask fills: {1e3 * parts['llguidance mask fill'] / max(calls, 1):.2f} ms each; "
              f"{row['matchers_filled']} masks, {row['tokens_consumed']} consume_token calls)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
