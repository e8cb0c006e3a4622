"""Benchmark of the GPU engine: HF generate (static cache, compiled), our AR, SMC-SD at several
(N, K), 1 and 8 requests, on random-weight Llama-3.1-8B (target) / Llama-3.2-1B (draft) shapes in
bf16, with the weight-bandwidth roofline and the GEMM floor measured in the same run.

    python benchmarks/bench_engine.py      # one NVIDIA GPU, ~5 minutes

Writes benchmarks.json and benchmarks.md (and profile.txt) into --out-dir (default benchmarks/results/). Random weights at real
shapes are a fair speed benchmark: outputs run to a fixed length (EOS is ignored).
"""
# ruff: noqa: B023  (the lambdas passed to cuda_time run before the loop advances)

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from smcdecode.backends.engine import PRESETS, Engine, Llama
from smcdecode.backends.engine.kernels.common import pdl_off


def cuda_time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * n / statistics.median(times)


def weight_bytes(model: Llama, with_embedding: bool = False) -> int:
    """Bytes of the weights a forward pass reads (the embedding table is gathered, not read, unless tied)."""
    total = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name == "tok_embeddings.weight" and not model.cfg.tie_embeddings and not with_embedding:
            continue
        total += p.numel() * p.element_size()
    return total


def gemm_graph_time(model: Llama, rows: list[int], repeats: int = 20) -> float:
    """Time of the weight matrix products of forward passes at M = rows[i] tokens, replayed in one
    CUDA graph (the GEMM floor; attention, norms, sampling excluded)."""
    # inputs as wide as each weight's input dimension (a tensor-parallel shard's wo / w2 take a slice)
    blk0 = model.layers[0]
    widths = {w.shape[1] for w in (blk0.wqkv.weight, blk0.wo.weight, blk0.w13.weight, blk0.w2.weight,
                                   model.output.weight)}
    xs = {(m, d): torch.randn(m, d, device="cuda", dtype=torch.bfloat16) for m in set(rows) for d in widths}

    def run():
        for m in rows:
            for blk in model.layers:
                for w in (blk.wqkv.weight, blk.wo.weight, blk.w13.weight, blk.w2.weight):
                    F.linear(xs[m, w.shape[1]], w)
            F.linear(xs[m, model.output.weight.shape[1]], model.output.weight)

    return graph_time(run, repeats)




def graph_time(fn, repeats: int = 15) -> float:
    """Median seconds of one replay of ``fn`` captured in a CUDA graph (warmed up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del g
    return statistics.median(times)


def hf_generate(prompts: torch.Tensor, out_len: int, repeats: int) -> dict:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    c = PRESETS["llama-3.1-8b"]
    cfg = HFConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.intermediate_size,
                   num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                   rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, max_position_embeddings=131072,
                   tie_word_embeddings=False)
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    hf = hf.to_empty(device="cuda").to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    hf.model.rotary_emb.__init__(cfg, device="cuda")
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=True, cache_implementation="static",
              pad_token_id=0)
    ids = prompts[:1].cuda()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, **kw)  # compiles (static cache => torch.compile of the forward)
    first = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + out_len
    with torch.inference_mode():
        times = cuda_time(lambda: hf.generate(ids, **kw), repeats)  # noqa: F821 (deleted below)
    mem = torch.cuda.max_memory_allocated()
    del hf
    import gc

    gc.collect()  # the compiled generate keeps references until collected
    torch.cuda.empty_cache()
    t = statistics.median(times)
    return {"system": "HF generate (static cache, compiled)", "requests": 1, "tok_s_per_request": out_len / t,
            "tok_s_total": out_len / t, "seconds": times, "first_call_s": first, "peak_mem_gib": mem / 2**30}


def accepted_per_round(o) -> float:
    """Mean over rows of accepted drafts per round: each round of a row adds its accepted drafts plus
    one token (the correction or the bonus), so a row ran lengths − accepted rounds."""
    acc = o.accepted.double()
    return float((acc / (o.lengths.double() - acc).clamp(min=1)).mean())


def smollm2_runs(args) -> list[dict]:
    """The real default model: SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, bf16) as the target, with
    two drafts: the shipped distilled draft (smcdecode.drafts, sharing the target's
    embeddings and head) and the target's first 10 layers (+ final norm and head); ShareGPT prompts
    through the chat template."""
    from smcdecode.backends.engine import LlamaConfig
    from smcdecode.backends.engine.bridge import _share_modules, to_llama
    from smcdecode.drafts import load_default_draft
    from smcdecode.models import load_model

    hf = load_model(args.smollm2_gguf, dtype="float32")
    tok = hf.tokenizer if hasattr(hf, "tokenizer") else hf.tok
    target = Llama.from_hf(hf, dtype=torch.bfloat16, device="cuda")
    cfg = LlamaConfig(**{**target.cfg.__dict__, "n_layers": 10})
    drafts = {"first 10 layers": Llama.from_state_dict(cfg, hf.hf.state_dict(), dtype=torch.bfloat16, device="cuda")}
    distilled = load_default_draft(hf)
    d = to_llama(distilled, "draft", torch.bfloat16, "cuda")
    _share_modules(hf.hf, distilled.hf, target, d)
    drafts = {"distilled, shipped": d, **drafts}
    data = json.loads(Path(args.prompts_json).read_text())
    prompts = []
    for item in data:
        text = item["conversations"][0]["value"]
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if 16 <= len(ids) <= 256:
            prompts.append(ids)
        if len(prompts) == 8:
            break
    out_len = 256
    runs = []
    for j, (dname, draft) in enumerate(drafts.items()):
        engine = Engine(target, draft, num_pages=8 * 8 * 40 + 8 * 20 + 64, page_size=16, max_context=600)
        for G in (1, 8):
            P = prompts[:G]
            if j == 0:  # AR does not depend on the draft
                engine.autoregressive(P, max_new_tokens=8)
                times = cuda_time(lambda: engine.autoregressive(P, max_new_tokens=out_len), args.repeats)
                runs.append({"system": "SmolLM2 engine AR", "requests": G,
                             "tok_s_total": G * out_len / statistics.median(times), "seconds": times})
            for N, K in ((8, 8), (8, 4)):
                engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=2 * (K + 1))
                outs = []
                times = cuda_time(lambda: outs.append(engine.smc_sd(P, particles=N, block_size=K,
                                                                    max_new_tokens=out_len)), args.repeats)
                o = outs[-1]
                runs.append({"system": f"SmolLM2 engine SMC-SD N={N} K={K} (draft: {dname})", "requests": G,
                             "tok_s_total": G * out_len / statistics.median(times), "seconds": times,
                             "mean_ess": float(torch.tensor([e.mean() for e in o.ess]).mean()), "N": N, "K": K,
                             "resample_rate": float(sum(x.mean() for x in o.resampled) / o.rounds)})
                engine.clear_graphs()
            engine.speculative(P, block_size=4, max_new_tokens=10)
            outs = []
            times = cuda_time(lambda: outs.append(engine.speculative(P, block_size=4, max_new_tokens=out_len)),
                              args.repeats)
            o = outs[-1]
            runs.append({"system": f"SmolLM2 engine exact SD K=4 (draft: {dname})", "requests": G,
                         "tok_s_total": G * out_len / statistics.median(times), "seconds": times,
                         "acceptance": accepted_per_round(o), "K": 4,
                         "tokens_per_round": out_len / o.rounds})
            engine.clear_graphs()
            for r in runs[-4:]:
                print({k: v for k, v in r.items() if k != "seconds"}, flush=True)
        engine = None  # free its KV pools before the next draft
        torch.cuda.empty_cache()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--configs", default="8x8,12x8,8x4,4x8")
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--sd-blocks", default="4", help="K values of exact speculative decoding")
    ap.add_argument("--sd-out-len", type=int, default=256,
                    help="output length of the speculative-decoding runs (random weights accept ~nothing: "
                         "one token a round)")
    ap.add_argument("--smollm2-gguf", default=None, help="SmolLM2-135M-Instruct GGUF: also run the real model")
    ap.add_argument("--prompts-json", default="../shared/data/eval/sharegpt_500.json")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--skip-ar", action="store_true")
    ap.add_argument("--skip-smc", action="store_true")
    ap.add_argument("--append", action="store_true", help="add to --out-dir/benchmarks.json instead of starting anew")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    res: dict = {"device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "shapes": {"target": "llama-3.1-8b", "draft": "llama-3.2-1b", "dtype": "bfloat16",
                            "prompt_len": args.prompt_len, "out_len": args.out_len, "page_size": 16,
                            "weights": "random (normal 0, 0.02)", "eos": "ignored (fixed-length outputs)"},
                 "repeats": args.repeats, "runs": [], "errors": [],
                 # (SMCDECODE_TRITON=0, the engine's one switch, would show here)
                 "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SMCDECODE_")}}
    if args.append and (out_dir / "benchmarks.json").exists():
        res = json.loads((out_dir / "benchmarks.json").read_text())

    def save():
        (out_dir / "benchmarks.json").write_text(json.dumps(res, indent=1, default=float))

    bw = copy_bandwidth()
    res.setdefault("copy_bandwidth_TBps", bw / 1e12)
    print(f"device {dev.name}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    G_max = max(int(g) for g in args.requests.split(","))
    prompts = torch.randint(0, 128000, (G_max, args.prompt_len))

    if not args.skip_hf:
        try:
            r = hf_generate(prompts, args.out_len, args.repeats)
            res["runs"].append(r)
            print(r, flush=True)
        except Exception:
            res["errors"].append("hf: " + traceback.format_exc()[-2000:])
            print(res["errors"][-1], flush=True)
        save()

    need_engine = not (args.skip_ar and args.skip_smc and not args.sd_blocks and args.skip_profile)
    if need_engine:  # the random-weight 8B/1B runs (skipped when only the real model runs)
        target = Llama.random(PRESETS["llama-3.1-8b"], device="cuda", seed=1)
        draft = Llama.random(PRESETS["llama-3.2-1b"], device="cuda", seed=2)
        tb, db = weight_bytes(target), weight_bytes(draft)
        res["weight_bytes"] = {"target": tb, "draft": db}
        max_ctx = args.prompt_len + args.out_len + 16
        num_pages = 8 * 12 * (-(-(args.out_len + 16) // 16) + 1) + 8 * (-(-args.prompt_len // 16)) + 64
        engine = Engine(target, draft, num_pages=num_pages, page_size=16, max_context=max_ctx)
        page_bytes = engine.kv_t.bytes_per_page + engine.kv_d.bytes_per_page
        res["kv"] = {"num_pages": num_pages, "bytes_per_page_target_plus_draft": page_bytes,
                     "pool_gib": num_pages * page_bytes / 2**30}
        print(f"weights: target {tb / 2**30:.2f} GiB, draft {db / 2**30:.2f} GiB; KV pool {num_pages} pages", flush=True)
        requests = [int(g) for g in args.requests.split(",")]
        P = [p.tolist() for p in prompts]

        # --- our autoregressive decoding
        for G in ([] if args.skip_ar else requests):
            try:
                engine.autoregressive(P[:G], max_new_tokens=8)  # compile kernels, warm up
                torch.cuda.reset_peak_memory_stats()
                times = cuda_time(lambda: engine.autoregressive(P[:G], max_new_tokens=args.out_len), args.repeats)
                t = statistics.median(times)
                floor = gemm_graph_time(target, [G]) * args.out_len
                r = {"system": "engine AR", "requests": G, "tok_s_per_request": args.out_len / t,
                     "tok_s_total": G * args.out_len / t, "seconds": times, "gemm_floor_s": floor,
                     "gemm_floor_tok_s_total": G * args.out_len / floor, "frac_of_gemm_floor": floor / t,
                     "roofline_tok_s_per_request": bw / tb, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
                res["runs"].append(r)
                print({k: v for k, v in r.items() if k != "seconds"}, flush=True)
            except Exception:
                res["errors"].append(f"ar G={G}: " + traceback.format_exc()[-2000:])
                print(res["errors"][-1], flush=True)
            save()

        # --- SMC-SD
        for G in ([] if args.skip_smc else requests):
            for nk in args.configs.split(","):
                N, K = (int(x) for x in nk.split("x"))
                try:
                    kw = dict(particles=N, block_size=K)
                    t0 = time.perf_counter()
                    engine.smc_sd(P[:G], max_new_tokens=3 * (K + 1), **kw)  # compile kernels, capture the graph
                    torch.cuda.synchronize()
                    capture_call = time.perf_counter() - t0
                    torch.cuda.reset_peak_memory_stats()
                    outs = []
                    times = cuda_time(lambda: outs.append(engine.smc_sd(P[:G], max_new_tokens=args.out_len, **kw)),
                                      args.repeats)
                    t = statistics.median(times)
                    o = outs[-1]
                    rounds = o.rounds
                    B = G * N
                    round_floor = gemm_graph_time(draft, [2 * B] + [B] * (K - 1)) + gemm_graph_time(target, [B * (K + 1)])
                    floor = round_floor * rounds
                    roofline_round = (K * db + tb) / bw
                    ess = torch.tensor([e.mean() for e in o.ess])
                    r = {"system": f"engine SMC-SD N={N} K={K}", "N": N, "K": K, "requests": G,
                         "tok_s_per_request": args.out_len / t, "tok_s_total": G * args.out_len / t,
                         "seconds": times, "rounds": rounds, "ms_per_round": 1e3 * t / rounds,
                         "gemm_floor_ms_per_round": 1e3 * round_floor, "gemm_floor_tok_s_total": G * args.out_len / floor,
                         "frac_of_gemm_floor": floor / t,
                         "roofline_tok_s_per_request": (K + 1) / roofline_round,
                         "mean_ess": float(ess.mean()), "resample_rate": float(sum(x.mean() for x in o.resampled) / rounds),
                         "peak_kv_pages": o.peak_pages, "peak_kv_gib": o.peak_pages * page_bytes / 2**30,
                         "host_ms_per_round": 1e3 * o.host_s / rounds, "first_call_s": capture_call,
                         "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
                    res["runs"].append(r)
                    print({k: v for k, v in r.items() if k != "seconds"}, flush=True)
                except Exception:
                    res["errors"].append(f"smc {nk} G={G}: " + traceback.format_exc()[-2000:])
                    print(res["errors"][-1], flush=True)
                engine.clear_graphs()
                save()

        # --- exact speculative decoding (random weights: acceptance ~0, so also the tok/s a measured
        # round time gives at acceptance rates α: E[tokens a round] = (1 − α^(K+1)) / (1 − α))
        for G in requests:
            for K in (int(k) for k in args.sd_blocks.split(",") if k):
                try:
                    t0 = time.perf_counter()
                    engine.speculative(P[:G], block_size=K, max_new_tokens=2 * (K + 1))
                    torch.cuda.synchronize()
                    capture_call = time.perf_counter() - t0
                    torch.cuda.reset_peak_memory_stats()
                    outs = []
                    L = args.sd_out_len
                    times = cuda_time(lambda: outs.append(engine.speculative(P[:G], block_size=K, max_new_tokens=L)),
                                      args.repeats)
                    t = statistics.median(times)
                    o = outs[-1]
                    B = G
                    round_floor = gemm_graph_time(draft, [2 * B] + [B] * (K - 1)) + gemm_graph_time(target, [B * (K + 1)])
                    ms_round = 1e3 * t / o.rounds
                    r = {"system": f"engine exact SD K={K}", "K": K, "requests": G, "out_len": L,
                         "tok_s_per_request": L / t, "tok_s_total": G * L / t, "seconds": times, "rounds": o.rounds,
                         "ms_per_round": ms_round, "gemm_floor_ms_per_round": 1e3 * round_floor,
                         "frac_of_gemm_floor": round_floor * o.rounds / t,
                         "gemm_floor_tok_s_total": G * L / (round_floor * o.rounds),
                         "acceptance": accepted_per_round(o),
                         "tok_s_per_request_at_alpha": {a: (1 - a ** (K + 1)) / (1 - a) / (ms_round / 1e3)
                                                        for a in (0.6, 0.8, 0.9)},
                         "first_call_s": capture_call, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
                    res["runs"].append(r)
                    print({k: v for k, v in r.items() if k != "seconds"}, flush=True)
                except Exception:
                    res["errors"].append(f"sd K={K} G={G}: " + traceback.format_exc()[-2000:])
                    print(res["errors"][-1], flush=True)
                engine.clear_graphs()
                save()

        # memory per extra particle: KV pages used at N=12 vs N=8 (K=8, one request)
        by = {(r.get("N"), r.get("K"), r["requests"]): r for r in res["runs"] if "N" in r}
        if (8, 8, 1) in by and (12, 8, 1) in by:
            d = by[(12, 8, 1)]["peak_kv_pages"] - by[(8, 8, 1)]["peak_kv_pages"]
            res["kv_bytes_per_extra_particle"] = d * page_bytes / 4
            res["kv_bytes_per_token_per_particle"] = page_bytes / 16
            save()

        # --- profile: where a round's device time goes (graph replay; the round graph is captured by
        # a short call first, so the profiled call is prefill + replayed rounds, late in the output)
        try:
            if args.skip_profile:
                raise RuntimeError("profile skipped (--skip-profile)")
            from torch.profiler import ProfilerActivity, profile

            texts = []
            # NOTE: without PDL: under it a kernel starts before the previous one ends and waits on
            # the device, so each kernel's span would include that wait and the sum exceed the round
            engine.clear_graphs()
            for G in (1, max(requests)):
                rounds = 20

                def profiled(G=G, rounds=rounds):
                    engine.smc_sd(P[:G], particles=8, block_size=8, max_new_tokens=27)  # capture
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        engine.smc_sd(P[:G], particles=8, block_size=8, max_new_tokens=rounds * 9)
                        torch.cuda.synchronize()
                    return prof

                with pdl_off():
                    prof = profiled()
                engine.clear_graphs()
                ev = [e for e in prof.key_averages() if e.device_time_total > 0]
                ev.sort(key=lambda e: -e.device_time_total)
                total = sum(e.device_time_total for e in ev)
                rows = [(e.key, e.device_time_total / 1e3 / rounds, e.count / rounds,
                         e.device_time_total / max(e.count, 1)) for e in ev]
                res[f"profile_per_round_G{G}"] = {"rounds": rounds, "pdl": "off",
                                                   "total_ms_per_round": total / 1e3 / rounds,
                                                   "kernels": rows[:30]}
                lines = [f"SMC-SD N=8 K=8, {G} request(s): device time per round over {rounds} replayed rounds "
                         f"(the call's prefill included; PDL off), total {total / 1e3 / rounds:.2f} ms",
                         f"{'kernel':100s} {'ms/round':>9s} {'calls/round':>11s} {'us/call':>8s}"]
                lines += [f"{k[:100]:100s} {a:9.3f} {c:11.1f} {u:8.2f}" for k, a, c, u in rows[:40]]
                texts.append("\n".join(lines))
                engine.clear_graphs()
            (out_dir / "profile.txt").write_text("\n\n".join(texts) + "\n")
            print(texts[0], flush=True)
        except Exception:
            res["errors"].append("profile: " + traceback.format_exc()[-2000:])
        save()
        engine = target = draft = None  # free the 8B/1B before the real-model runs
    torch.cuda.empty_cache()
    if args.smollm2_gguf:
        try:
            res["smollm2"] = smollm2_runs(args)
        except Exception:
            res["errors"].append("smollm2: " + traceback.format_exc()[-2000:])
            print(res["errors"][-1], flush=True)
        save()
    write_markdown(res, out_dir / "benchmarks.md")
    print("\nsystem | G | tok/s/req | tok/s total | frac GEMM floor | peak GiB")
    for r in res["runs"]:
        print(f"{r['system']} | {r['requests']} | {r['tok_s_per_request']:.1f} | {r['tok_s_total']:.1f} | "
              f"{r.get('frac_of_gemm_floor', float('nan')):.2f} | {r['peak_mem_gib']:.1f}")


def write_markdown(res: dict, path: Path) -> None:
    s = res["shapes"]
    lines = [
        "# Engine benchmarks", "",
        f"Measured {res['date']} on **{res['device']}** ({res['sms']} SMs), torch {res['torch']}, by "
        f"`benchmarks/bench_engine.py`. Target {s['target']}, draft {s['draft']}, {s['dtype']}, random weights, "
        f"prompt {s['prompt_len']} tokens, output {s['out_len']} tokens (EOS ignored), KV page {s['page_size']} tokens. "
        f"Median of {res['repeats']} runs, each end to end (prefill and decoding). The engine captures a round's "
        f"CUDA graph once per shape, in a first, short call ('first call s': capture and any Triton compilation "
        f"included), and later calls replay it; for HF generate 'first call s' is its compiling first call.",
        f"Copy bandwidth measured in the same run: {res['copy_bandwidth_TBps']:.2f} TB/s (read + write)."
        + (f" Engine settings: {', '.join(f'{k}={v}' for k, v in res['env'].items())}." if res.get("env") else ""),
        "",
        "| system | requests | tok/s per request | tok/s total | GEMM floor tok/s total | of GEMM floor | "
        "weight-BW roofline tok/s per request | ms/round | host ms/round | first call s | mean ESS | resample rate | "
        "peak KV GiB | peak GPU mem GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda r, k, fmt: (fmt.format(r[k]) if k in r else "–")  # noqa: E731
    for r in res["runs"]:
        lines.append(f"| {r['system']} | {r['requests']} | {r['tok_s_per_request']:.1f} | {r['tok_s_total']:.1f} | "
                     f"{f(r, 'gemm_floor_tok_s_total', '{:.0f}')} | {f(r, 'frac_of_gemm_floor', '{:.0%}')} | "
                     f"{f(r, 'roofline_tok_s_per_request', '{:.0f}')} | {f(r, 'ms_per_round', '{:.2f}')} | "
                     f"{f(r, 'host_ms_per_round', '{:.2f}')} | {f(r, 'first_call_s', '{:.2f}')} | "
                     f"{f(r, 'mean_ess', '{:.2f}')} | {f(r, 'resample_rate', '{:.2f}')} | "
                     f"{f(r, 'peak_kv_gib', '{:.2f}')} | {r['peak_mem_gib']:.1f} |")
    if "kv_bytes_per_extra_particle" in res:
        lines += ["", f"KV memory per extra particle (N=12 vs N=8, K=8, one request, target + draft): "
                      f"{res['kv_bytes_per_extra_particle'] / 2**20:.1f} MiB "
                      f"({res['kv_bytes_per_token_per_particle'] / 2**10:.0f} KiB per token); the prompt's pages "
                      f"are stored once per request."]
    sd = [r for r in res["runs"] if "tok_s_per_request_at_alpha" in r]
    if sd:
        lines += ["", "Exact speculative decoding (random weights: the acceptance is whatever two unrelated random "
                      "models give, so the tok/s depend on it; the round time does not, so the last columns give "
                      "the tok/s per request that the measured round time yields at a per-draft acceptance rate α, "
                      f"E[tokens a round] = (1 − α^(K+1)) / (1 − α)); {sd[0]['out_len']}-token outputs:", "",
                  "| system | requests | output tokens | tok/s per request (measured) | ms/round | of GEMM floor | "
                  "accepted/round | α=0.6 | α=0.8 | α=0.9 |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sd:
            a = r["tok_s_per_request_at_alpha"]
            lines.append(f"| {r['system']} | {r['requests']} | {r['out_len']} | {r['tok_s_per_request']:.1f} | "
                         f"{r['ms_per_round']:.2f} | {r['frac_of_gemm_floor']:.0%} | {r['acceptance']:.2f} | "
                         + " | ".join(f"{a[k]:.0f}" for k in sorted(a)) + " |")
    if res.get("smollm2"):
        lines += ["", "Real model: SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to bf16) as target; drafts: the "
                      "shipped distilled draft (smcdecode.drafts) and the target's first 10 of 30 layers "
                      "(+ final norm and head); 8 ShareGPT prompts through the chat template, "
                      "256 output tokens (EOS ignored, so every run has the same length), median of "
                      f"{res['repeats']}:", "",
                  "| system | requests | tok/s total | mean ESS | resample rate | accepted drafts/round |",
                  "|---|---|---|---|---|---|"]
        for r in res["smollm2"]:
            lines.append(f"| {r['system']} | {r['requests']} | {r['tok_s_total']:.0f} | {f(r, 'mean_ess', '{:.2f}')} | "
                         f"{f(r, 'resample_rate', '{:.2f}')} | {f(r, 'acceptance', '{:.2f}')} |")
    if res.get("errors"):
        lines += ["", "Errors:", ""] + ["    " + e.replace("\n", "\n    ") for e in res["errors"]]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
