"""Speed of the adaptive block size on the GPU engine against fixed K = 8 (one NVIDIA GPU, ~4 min).

Two pairs, N = 8 particles, 1 and 8 requests, EOS ignored (fixed-length outputs):
  * random-weight Llama-3.1-8B target / Llama-3.2-1B draft (bf16), 256-token prompts, --out-len tokens;
  * SmolLM2-135M-Instruct (--smollm2-gguf) with its shipped draft, ShareGPT chat prompts, 256 tokens.
Systems per pair: fixed K = 8 (pipelined rounds), fixed K = 8 through a schedule
(``schedule=FixedBlocks([8])``: rounds read one by one, what the adaptive schedule runs on) and ``AdaptiveBlocks()``.
Checks as it goes: every row reaches the output length, log Ẑ is finite, the adaptive K stays in
0..8. Goal (issue "when the draft is weak"): adaptive ≥ 80 % of fixed K = 8 where the draft is good.

    python benchmarks/adaptive_speed.py --smollm2-gguf ~/smollm2/model.gguf
    python benchmarks/adaptive_speed.py --tiny --smollm2-gguf FILE   # CPU check of the script (tiny
                                                                      # random pair, short SmolLM2 run)

Raw JSON: benchmarks/results/adaptive_speed.json (written after every run, so a run cut short keeps
its rows); a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from smcdecode.backends.engine import PRESETS, Engine, Llama, LlamaConfig  # noqa: E402
from smcdecode.samplers.adaptive import AdaptiveBlocks, FixedBlocks  # noqa: E402

SYSTEMS = {"fixed K=8": None, "fixed K=8 (schedule)": FixedBlocks([8]),
           "adaptive K (0..8)": AdaptiveBlocks(max_block_size=8)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(engine: Engine, prompts, out_len: int, schedule, repeats: int) -> tuple[list[float], object]:
    engine.smc_sd(prompts, particles=8, block_size=8, max_new_tokens=3 * 9, schedule=schedule)  # capture, warm up
    times, out = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = engine.smc_sd(prompts, particles=8, block_size=8, max_new_tokens=out_len, schedule=schedule)
        sync()
        times.append(time.perf_counter() - t0)
    if not bool((out.lengths == out_len).all()):
        raise AssertionError(f"rows ended short of {out_len} tokens: {out.lengths.min()}")
    if not bool(torch.isfinite(out.log_evidence).all()):
        raise AssertionError(f"non-finite log Z: {out.log_evidence}")
    return times, out


def pair_runs(name: str, engine: Engine, prompts: list[list[int]], out_len: int, repeats: int, res: dict,
              out_path: str, requests=(1, 8)) -> list[dict]:
    runs = res["runs"]
    for G in requests:
        base = None
        for system, schedule in SYSTEMS.items():
            times, out = timed(engine, prompts[:G], out_len, schedule, repeats)
            tok_s = G * out_len / statistics.median(times)
            K = np.stack(out.block_sizes) if out.block_sizes else None
            if K is not None and not ((K >= 0) & (K <= 8)).all():
                raise AssertionError(f"K outside 0..8: {np.unique(K)}")
            base = tok_s if base is None else base
            r = {"pair": name, "system": system, "requests": G, "tok_s_total": tok_s, "seconds": times,
                 "vs_fixed": tok_s / base, "rounds": out.rounds,
                 "mean_K": float(K.mean()) if K is not None else 8.0,
                 "mean_ess": float(np.mean([np.mean(e) for e in out.ess]))}
            runs.append(r)
            Path(out_path).write_text(json.dumps(res, indent=1, default=float))
            print({k: v for k, v in r.items() if k != "seconds"}, flush=True)
            engine.clear_graphs()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "adaptive_speed.json"))
    ap.add_argument("--out-len", type=int, default=512, help="output tokens of the random pair")
    ap.add_argument("--smollm2-len", type=int, default=256, help="output tokens of the SmolLM2 pair")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smollm2-gguf", default=None, help="SmolLM2-135M-Instruct GGUF file: also run the real pair")
    ap.add_argument("--prompts-json", default="../shared/data/eval/sharegpt_500.json")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU check of the script: tiny random pair, short outputs, one repeat, 1 and 2 requests")
    args = ap.parse_args()
    if args.tiny:
        device, dtype, requests = "cpu", torch.float32, (1, 2)
        args.out_len, args.smollm2_len, args.repeats = min(args.out_len, 32), min(args.smollm2_len, 32), 1
        if args.out.endswith("results/adaptive_speed.json"):
            raise SystemExit("--tiny: give --out elsewhere (benchmarks/results/adaptive_speed.json is the GPU run's)")
    elif not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU (or --tiny for the CPU check)")
    else:
        device, dtype, requests = "cuda", torch.bfloat16, (1, 8)
    res = {"benchmark": "adaptive_speed", "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
           "torch": torch.__version__, "tiny": args.tiny,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "particles": 8, "K_max": 8, "repeats": args.repeats, "out_len": args.out_len,
           "smollm2_len": args.smollm2_len, "runs": []}

    if args.tiny:
        target = Llama.random(LlamaConfig(512, 64, 2, 4, 2, 128), dtype=dtype, device=device, seed=1)
        draft = Llama.random(LlamaConfig(512, 64, 1, 4, 2, 128), dtype=dtype, device=device, seed=2)
        name, vocab, prompt_len = "random tiny", 512, 16
    else:
        target = Llama.random(PRESETS["llama-3.1-8b"], device=device, seed=1)
        draft = Llama.random(PRESETS["llama-3.2-1b"], device=device, seed=2)
        name, vocab, prompt_len = "random 8B/1B", 128000, 256
    num_pages = 8 * 8 * (-(-(args.out_len + 32) // 16) + 2) + 8 * 16 + 64
    engine = Engine(target, draft, num_pages=num_pages, page_size=16, max_context=prompt_len + args.out_len + 32)
    prompts = torch.randint(0, vocab, (8, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    pair_runs(name, engine, prompts, args.out_len, args.repeats, res, args.out, requests)
    del engine, target, draft
    if device == "cuda":
        torch.cuda.empty_cache()

    if args.smollm2_gguf:
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
        pair_runs("SmolLM2-135M + shipped draft", engine, prompts, args.smollm2_len, args.repeats, res, args.out,
                  requests)

    Path(args.out).write_text(json.dumps(res, indent=1, default=float))
    print(f"\n{res['device']}, N = 8, K_max = 8")
    print(f"{'pair':30s} {'system':28s} {'req':>3s} {'tok/s':>8s} {'vs fixed K=8':>12s} {'mean K':>6s}")
    for r in res["runs"]:
        print(f"{r['pair']:30s} {r['system']:28s} {r['requests']:3d} {r['tok_s_total']:8.1f} "
              f"{r['vs_fixed']:12.2f} {r['mean_K']:6.2f}")


if __name__ == "__main__":
    main()
