"""Speed of the adaptive block size on the GPU engine against fixed K = 8 (one NVIDIA GPU, ~4 min).

Three pairs (--pairs), N = 8 particles, 1 and 8 requests, EOS ignored (fixed-length outputs):
  * random: random-weight Llama-3.1-8B target / Llama-3.2-1B draft (bf16), 256-token prompts, --out-len tokens;
  * self: a random-weight Llama-3.2-1B drafting for itself, same shapes: a perfect draft (every weight 1,
    the adaptive K climbs to 8), so the gap to fixed K = 8 is what the schedule itself costs;
  * smollm2: SmolLM2-135M-Instruct (--smollm2-gguf) with its shipped draft at the fidelity study's
    temperatures (target 0.7, draft 0.5), ShareGPT chat prompts, --smollm2-len tokens.
Systems per pair: fixed K = 8 (pipelined rounds), ``AdaptiveBlocks()`` and fixed K = 8 through a
schedule (``schedule=FixedBlocks([8])``: rounds read one by one, what the adaptive schedule runs on).
Checks as it goes: every row reaches the output length, log Ẑ is finite, the adaptive K stays in
0..8. Goal (issue "when the draft is weak"): adaptive ≥ 80 % of fixed K = 8 where the draft is good.

    python benchmarks/adaptive_speed.py --pairs random self --budget 150 --out random.json
    python benchmarks/adaptive_speed.py --pairs smollm2 --smollm2-gguf FILE --budget 90 --out smollm2.json
    python benchmarks/adaptive_speed.py --tiny --smollm2-gguf FILE --out /tmp/x.json  # CPU check of the
                                                              # script (tiny random pairs, short SmolLM2 run)

Raw JSON at --out (default benchmarks/results/adaptive_speed.json), rewritten after every row, so a
run cut short keeps its rows; --budget stops starting new rows (listed under "skipped"); a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from smcdecode.backends.engine import PRESETS, Engine, Llama, LlamaConfig  # noqa: E402
from smcdecode.samplers.adaptive import AdaptiveBlocks, FixedBlocks  # noqa: E402

SYSTEMS = {"fixed K=8": None, "adaptive K (0..8)": AdaptiveBlocks(max_block_size=8),
           "fixed K=8 (schedule)": FixedBlocks([8])}
PAIRS = ("random", "self", "smollm2")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(engine: Engine, prompts, out_len: int, schedule, repeats: int, temps: dict) -> tuple[list[float], object]:
    engine.smc_sd(prompts, particles=8, block_size=8, max_new_tokens=3 * 9, schedule=schedule, **temps)  # capture
    times, out = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = engine.smc_sd(prompts, particles=8, block_size=8, max_new_tokens=out_len, schedule=schedule, **temps)
        sync()
        times.append(time.perf_counter() - t0)
    if not bool((out.lengths == out_len).all()):
        raise AssertionError(f"rows ended short of {out_len} tokens: {out.lengths.min()}")
    if not bool(torch.isfinite(out.log_evidence).all()):
        raise AssertionError(f"non-finite log Z: {out.log_evidence}")
    return times, out


def write(res: dict, out_path: str) -> None:
    Path(out_path).write_text(json.dumps(res, indent=1, default=float))


def pair_runs(name: str, engine: Engine, prompts: list[list[int]], out_len: int, args, res: dict,
              requests, temps: dict, deadline: float) -> None:
    """Every system at every request count, one row each in ``res["runs"]`` (the file is rewritten
    after every row); once ``deadline`` has passed the rows not started go to ``res["skipped"]``."""
    for G in requests:
        base = None
        for system, schedule in SYSTEMS.items():
            if time.perf_counter() > deadline:
                res["skipped"].append({"pair": name, "system": system, "requests": G, "why": "--budget"})
                write(res, args.out)
                continue
            times, out = timed(engine, prompts[:G], out_len, schedule, args.repeats, temps)
            tok_s = G * out_len / statistics.median(times)
            K = np.stack(out.block_sizes) if out.block_sizes else None
            if K is not None and not ((K >= 0) & (K <= 8)).all():
                raise AssertionError(f"K outside 0..8: {np.unique(K)}")
            base = tok_s if base is None else base
            r = {"pair": name, "system": system, "requests": G, "out_len": out_len, **temps,
                 "tok_s_total": tok_s, "seconds": times, "vs_fixed": tok_s / base, "rounds": out.rounds,
                 "mean_K": float(K.mean()) if K is not None else 8.0,
                 "mean_ess": float(np.mean([np.mean(e) for e in out.ess]))}
            res["runs"].append(r)
            write(res, args.out)
            print({k: v for k, v in r.items() if k != "seconds"}, flush=True)
            engine.clear_graphs()


def random_pair(args, device, dtype, self_draft: bool):
    """(name, engine, prompts, output length): random-weight 8B target / 1B draft, or (``self_draft``)
    a random 1B drafting for itself: a perfect draft (every weight 1), where the adaptive K reaches
    K_max and what it costs is the schedule alone. --tiny: tiny models of the same kind."""
    if args.tiny:
        big, small, vocab, prompt_len = LlamaConfig(512, 64, 2, 4, 2, 128), LlamaConfig(512, 64, 1, 4, 2, 128), 512, 16
    else:
        big, small, vocab, prompt_len = PRESETS["llama-3.1-8b"], PRESETS["llama-3.2-1b"], 128000, 256
    size = "tiny" if args.tiny else ("1B" if self_draft else "8B/1B")
    if self_draft:
        target = Llama.random(small, dtype=dtype, device=device, seed=2)
        draft = Llama.random(small, dtype=dtype, device=device, seed=2)  # the same weights, its own module
        name = f"random {size}, draft = itself"
    else:
        target = Llama.random(big, dtype=dtype, device=device, seed=1)
        draft = Llama.random(small, dtype=dtype, device=device, seed=2)
        name = f"random {size}"
    num_pages = 8 * 8 * (-(-(args.out_len + 32) // 16) + 2) + 8 * 16 + 64
    engine = Engine(target, draft, num_pages=num_pages, page_size=16, max_context=prompt_len + args.out_len + 32)
    prompts = torch.randint(0, vocab, (8, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    return name, engine, prompts, args.out_len


def smollm2_pair(args, device, dtype):
    from smcdecode.backends.engine.bridge import _share_modules, to_llama
    from smcdecode.drafts import load_default_draft
    from smcdecode.models import load_model

    hf = load_model(args.smollm2_gguf, dtype="float32")
    target = to_llama(hf, "target", dtype, device)
    distilled = load_default_draft(hf)
    draft = to_llama(distilled, "draft", dtype, device)
    _share_modules(hf.hf, distilled.hf, target, draft)
    prompts = []
    for item in json.loads(Path(args.prompts_json).read_text()):
        ids = hf.prompt_ids([{"role": "user", "content": item["conversations"][0]["value"]}])
        if 16 <= len(ids) <= 256:
            prompts.append(ids)
        if len(prompts) == 8:
            break
    pages = -(-(256 + args.smollm2_len + 32) // 16) + 2
    engine = Engine(target, draft, num_pages=8 * 8 * pages + 8 * 20 + 64, page_size=16,
                    max_context=256 + args.smollm2_len + 32)
    return "SmolLM2-135M + shipped draft", engine, prompts, args.smollm2_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "adaptive_speed.json"))
    ap.add_argument("--pairs", nargs="+", choices=PAIRS, default=None,
                    help="which pairs to run (default: random and self, and smollm2 when --smollm2-gguf is given)")
    ap.add_argument("--requests", nargs="+", type=int, default=None, help="request counts (default 1 8; --tiny 1 2)")
    ap.add_argument("--out-len", type=int, default=512, help="output tokens of the random pairs")
    ap.add_argument("--smollm2-len", type=int, default=256, help="output tokens of the SmolLM2 pair")
    ap.add_argument("--temperature", type=float, default=0.7, help="the SmolLM2 target's temperature")
    ap.add_argument("--draft-temperature", type=float, default=0.5,
                    help="the shipped draft's proposal temperature (its default) in the SmolLM2 pair")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="start no new timed system after this many seconds (the rows left are listed as skipped)")
    ap.add_argument("--smollm2-gguf", default=None, help="SmolLM2-135M-Instruct GGUF file (the smollm2 pair)")
    ap.add_argument("--prompts-json", default="../shared/data/eval/sharegpt_500.json")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU check of the script: tiny random pairs, short outputs, one repeat, 1 and 2 requests")
    args = ap.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget if args.budget else math.inf
    pairs = args.pairs or ["random", "self"] + (["smollm2"] if args.smollm2_gguf else [])
    if "smollm2" in pairs and not args.smollm2_gguf:
        raise SystemExit("--pairs smollm2 needs --smollm2-gguf FILE (SmolLM2-135M-Instruct GGUF)")
    if args.tiny:
        device, dtype, requests = "cpu", torch.float32, (1, 2)
        args.out_len, args.smollm2_len, args.repeats = min(args.out_len, 32), min(args.smollm2_len, 32), 1
        if args.out.endswith("results/adaptive_speed.json"):
            raise SystemExit("--tiny: give --out elsewhere (benchmarks/results/adaptive_speed.json is the GPU run's)")
    elif not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (or --tiny for the CPU check)")
    else:
        device, dtype, requests = "cuda", torch.bfloat16, (1, 8)
    requests = tuple(args.requests or requests)
    if any(g < 1 or g > 8 for g in requests):
        raise SystemExit(f"--requests: each count must be 1..8 (the prompts prepared), got {list(requests)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": "adaptive_speed", "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
           "torch": torch.__version__, "tiny": args.tiny,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "particles": 8, "K_max": 8, "repeats": args.repeats, "out_len": args.out_len,
           "smollm2_len": args.smollm2_len, "pairs": pairs, "requests": list(requests), "budget": args.budget,
           "runs": [], "skipped": []}

    for pair in pairs:
        made = None
        try:  # a pair that fails is recorded and the next one still runs
            if pair == "smollm2":
                made, temps = smollm2_pair(args, device, dtype), {
                    "target_temperature": args.temperature, "draft_temperature": args.draft_temperature}
            else:
                made, temps = random_pair(args, device, dtype, self_draft=pair == "self"), {}
            name, engine, prompts, out_len = made
            pair_runs(name, engine, prompts, out_len, args, res, requests, temps, deadline)
        except Exception:  # noqa: BLE001 - any failure of one pair is reported in the JSON
            res.setdefault("errors", []).append(f"{pair}: {traceback.format_exc()[-2000:]}")
            write(res, args.out)
            print(f"{pair} failed:\n{traceback.format_exc()}", flush=True)
        engine = made = None
        if device == "cuda":
            torch.cuda.empty_cache()

    res["seconds"] = round(time.perf_counter() - start, 1)
    write(res, args.out)
    print(f"\n{res['device']}, N = 8, K_max = 8, {res['seconds']} s")
    print(f"{'pair':30s} {'system':28s} {'req':>3s} {'tok/s':>8s} {'vs fixed K=8':>12s} {'mean K':>6s}")
    for r in res["runs"]:
        print(f"{r['pair']:30s} {r['system']:28s} {r['requests']:3d} {r['tok_s_total']:8.1f} "
              f"{r['vs_fixed']:12.2f} {r['mean_K']:6.2f}")
    for r in res["skipped"]:
        print(f"{r['pair']:30s} {r['system']:28s} {r['requests']:3d}  skipped ({r['why']})")
    if res.get("errors"):
        raise SystemExit(f"{len(res['errors'])} pair(s) failed: see 'errors' in {args.out}")


if __name__ == "__main__":
    main()
