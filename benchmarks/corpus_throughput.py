"""Throughput of distillation-corpus generation: ``smcdecode.distill.generate_corpus`` with
``generator="hf"`` (transformers' ``generate``, static cache on CUDA) and ``generator="engine"``
(smcdecode's engine: prompts prefilled together, each prompt's samples sharing its KV pages, one
CUDA graph per step) on the same prompts, the same samples per prompt and the same lengths.

    # GPU (the SmolLM2-135M target; < 4 minutes on an H200):
    python benchmarks/corpus_throughput.py --target /tmp/g/smollm2.gguf \\
        --prompts /tmp/g/sharegpt_500.json /tmp/g/alpaca_eval_instructions.json --out corpus_throughput.json
    # CPU smoke test (tiny random model, seconds):
    python benchmarks/corpus_throughput.py --tiny

Reports, per generator: the first call (cold: Triton compilation, graph capture, cuBLAS set-up)
and the median of ``--repeats`` further calls: sequences/s, answer tokens/s (tokens kept, i.e. up to
and including the first EOS) and row-steps/s (sequences × max_new_tokens / s: the engine decodes
every row to max_new_tokens, EOS or not); with the mean answer length and the share of answers
that end in EOS (both generators sample the same p_T, so these should agree up to noise; the
engine runs the target in bfloat16 on CUDA, ``generate`` in the loaded dtype).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from smcdecode import HFModel  # noqa: E402
from smcdecode.distill import chat_prompts, generate_corpus, load_prompts  # noqa: E402


def tiny_target() -> HFModel:
    """A random 2-layer Llama over a 64-word vocabulary (EOS = 1), for a CPU smoke test."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return HFModel(transformers.LlamaForCausalLM(cfg).eval(), None, name="tiny-random-llama")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(target: HFModel, prompts: list[list[int]], generator: str, args, seed: int) -> dict:
    sync(target.device)
    t0 = time.perf_counter()
    corpus = generate_corpus(target, prompts, samples=args.samples, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, batch_size=args.batch_size, seed=seed, progress=False,
                             generator=generator)
    sync(target.device)
    s = time.perf_counter() - t0
    n = len(corpus)
    tokens = sum(len(r) for _, r in corpus)
    eos = sum(1 for _, r in corpus if r and r[-1] == target.eos_token_id)
    return {"seconds": round(s, 3), "sequences": n, "sequences_per_s": round(n / s, 2),
            "answer_tokens_per_s": round(tokens / s, 1),
            "row_steps_per_s": round(n * args.max_new_tokens / s, 1),
            "mean_answer_tokens": round(tokens / max(n, 1), 2), "eos_share": round(eos / max(n, 1), 4)}


def median_of(runs: list[dict]) -> dict:
    keys = ("seconds", "sequences_per_s", "answer_tokens_per_s", "row_steps_per_s")
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="model for smcdecode.models.load_model (a .gguf file, ...)")
    ap.add_argument("--prompts", nargs="*", default=[], help="prompt files (distill's formats)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model and random prompts (CPU smoke test)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=1024, help="rows per batch (both generators)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per generator after the first")
    ap.add_argument("--generators", nargs="+", default=["engine", "hf"], choices=["engine", "hf"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        target = tiny_target().to(device) if device != "cpu" else tiny_target()
        g = random.Random(0)
        prompts = [[g.randrange(2, 64) for _ in range(g.randrange(2, 40))] for _ in range(args.num_prompts)]
    else:
        from smcdecode.models import load_model

        if not args.prompts:
            ap.error("--prompts is required without --tiny")
        target = load_model(args.target, device=device)
        texts = load_prompts(args.prompts)
        items = chat_prompts(target, texts, args.max_prompt_tokens)
        random.Random(0).shuffle(items)
        prompts = [ids for _, ids in items[: args.num_prompts]]
    lengths = sorted(map(len, prompts))
    dev = target.device
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        "torch": torch.__version__, "target": target.name,
        "target_dtype": str(next(target.hf.parameters()).dtype),
        "prompts": len(prompts), "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2],
                                                   "max": lengths[-1]},
        "samples_per_prompt": args.samples, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
        "temperature": args.temperature, "repeats": args.repeats, "generators": {},
    }
    for gen in args.generators:
        first = run_once(target, prompts, gen, args, seed=0)
        runs = [run_once(target, prompts, gen, args, seed=1 + r) for r in range(args.repeats)]
        result["generators"][gen] = {"first_call": first, "median": median_of(runs) if runs else None,
                                     "runs": runs}
        m = result["generators"][gen]["median"] or first
        print(f"{gen:6s} first call {first['seconds']:8.2f} s | median of {args.repeats}: {m['seconds']:8.2f} s, "
              f"{m['sequences_per_s']:9.1f} seq/s, {m['answer_tokens_per_s']:10.0f} answer tok/s, "
              f"{m['row_steps_per_s']:10.0f} row-steps/s | mean answer {first['mean_answer_tokens']:.1f} tok, "
              f"EOS share {first['eos_share']:.3f}", flush=True)
    g = result["generators"]
    if "engine" in g and "hf" in g and g["engine"]["median"] and g["hf"]["median"]:
        result["engine_over_hf_sequences_per_s"] = round(
            g["engine"]["median"]["sequences_per_s"] / g["hf"]["median"]["sequences_per_s"], 2)
        print(f"engine / hf (sequences/s, medians): {result['engine_over_hf_sequences_per_s']}x")
    print(f"{result['device']}, {result['date']}, {result['prompts']} prompts × {args.samples} samples, "
          f"≤ {args.max_new_tokens} new tokens")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
