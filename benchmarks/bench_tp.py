"""Tensor-parallel benchmark of the engine: a random-weight Llama-3.1-8B (2 GPUs) or Llama-3.1-70B
(4 GPUs) target sharded over the GPUs, a replicated Llama-3.2-1B draft, bf16: SMC-SD N=8 K=8 against
our tensor-parallel autoregressive decoding and exact speculative decoding, 1 and 8 requests, with
the sharded round's GEMM floor (each rank's weight products in a CUDA graph) and its collectives
(NCCL all-reduces and the logits' all-gather, in a CUDA graph) measured in the same run.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --target llama-3.1-8b
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_tp.py --target llama-3.1-70b
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_tp.py --target llama-3.1-8b  # TP = 1

(run from the repository root with PYTHONPATH=$PWD). Before timing, it checks that the sharded
forward of a 2-layer model of the target's widths equals the whole model's (bf16 tolerance) and
that every rank returns the same outputs (``parallel.agree``) after every timed call. With one
process it also times SMC-SD on the single-GPU engine's own model (``Llama.random``), so TP = 1 is
compared with the single-GPU path in the same run. Rank 0 writes
benchmarks/results/tp_<target>_tp<N>.json and prints a table. ``--tiny`` runs a few-second
smoke test on the CPU with gloo (tiny shapes; no GEMM floors)."""
# ruff: noqa: B023  (the lambdas passed to cuda_time run before the loop advances)

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from smcdecode.backends.engine import PRESETS, Engine, Llama, LlamaConfig, parallel  # noqa: E402
from smcdecode.backends.engine.shards import RandomReader  # noqa: E402

TARGETS = {
    "llama-3.1-8b": PRESETS["llama-3.1-8b"],
    "llama-3.1-70b": LlamaConfig(128256, 8192, 80, 64, 8, 28672, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "tiny": LlamaConfig(512, 128, 2, 8, 4, 256, rope_theta=10000.0),
}
DRAFTS = {"llama-3.2-1b": PRESETS["llama-3.2-1b"], "tiny": LlamaConfig(512, 64, 1, 4, 2, 128, rope_theta=10000.0)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, tp) -> list[float]:
    """Seconds of each of ``repeats`` calls, the ranks starting each call together."""
    out = []
    for _ in range(repeats):
        dist.barrier(group=tp.control)
        sync(tp.device)
        t0 = time.perf_counter()
        fn()
        sync(tp.device)
        out.append(time.perf_counter() - t0)
    return out


@torch.inference_mode()
def check_forward(cfg: LlamaConfig, tp, dtype: torch.dtype) -> dict:
    """The sharded forward of a 2-layer model at ``cfg``'s widths against the whole model (both from
    the same random weights), on a 64-token prompt; and every rank's logits the same bytes."""
    from smcdecode.backends.engine import KVPool, PagedBatch

    small = dataclasses.replace(cfg, n_layers=2)
    whole = parallel.build(RandomReader(small, 7, tp.device), parallel.TensorParallel(0, 1, tp.device), dtype)
    shard = parallel.random(small, tp, dtype, seed=7)
    tokens = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)).to(tp.device)
    pt = torch.arange(1, 5, dtype=torch.int32, device=tp.device)[None]
    batch = PagedBatch.build(torch.arange(64, device=tp.device)[None], pt, 16)
    got = [m(tokens, KVPool.for_model(m.cfg, 8, 16, dtype, tp.device), batch).float() for m in (shard, whole)]
    parallel.agree(tp, got[0])
    err = float((got[0] - got[1]).abs().max() / got[1].abs().max())
    top = float((got[0].argmax(-1) == got[1].argmax(-1)).float().mean())
    return {"max_abs_err_over_max_logit": err, "argmax_agreement": top, "ranks_agree": True}


def collective_graph_time(tp, cfg_local: LlamaConfig, rows: int, vocab_parallel: bool, graph_time) -> float:
    """Seconds of one forward's collectives at ``rows`` tokens in a CUDA graph: two all-reduces of
    [rows, dim] a layer and the all-gather of [rows, V/world] logits."""
    x = torch.randn(rows, cfg_local.dim, device=tp.device, dtype=torch.bfloat16)
    logits = torch.randn(rows, cfg_local.vocab_size // tp.world, device=tp.device, dtype=torch.bfloat16)

    def run():
        for _ in range(2 * cfg_local.n_layers):
            dist.all_reduce(x)
        if vocab_parallel:
            tp.gather_vocab(logits)

    return graph_time(run, 15)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="llama-3.1-8b", choices=sorted(TARGETS))
    ap.add_argument("--draft", default="llama-3.2-1b", choices=sorted(DRAFTS))
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=1024)
    ap.add_argument("--sd-out-len", type=int, default=256,
                    help="output length of exact speculative decoding (random weights accept ~nothing)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--sd-block", type=int, default=4, help="K of exact speculative decoding")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, gloo, few tokens")
    args = ap.parse_args()
    if args.tiny:
        args.target = args.draft = "tiny"
        args.prompt_len, args.out_len, args.sd_out_len, args.repeats = 16, 18, 8, 1
    tp = parallel.init("gloo" if args.tiny else None)
    rank0 = tp.rank == 0
    cuda = tp.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    out_dir = Path(args.out_dir)
    out_path = out_dir / f"tp_{args.target}_tp{tp.world}.json"
    if cuda:
        from bench_engine import copy_bandwidth, gemm_graph_time, graph_time, weight_bytes
    cfg_t, cfg_d = TARGETS[args.target], DRAFTS[args.draft]
    dev_name = torch.cuda.get_device_name(tp.device) if cuda else "cpu"
    res: dict = {"device": dev_name, "gpus": tp.world, "torch": torch.__version__,
                 "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "shapes": {"target": args.target, "draft": args.draft, "dtype": str(dtype).removeprefix("torch."),
                            "prompt_len": args.prompt_len, "out_len": args.out_len, "page_size": 16,
                            "weights": "random (normal 0, 0.02)", "eos": "ignored (fixed-length outputs)",
                            "draft_placement": "replicated on every rank",
                            "head": "vocab-parallel, logits all-gathered"},
                 "repeats": args.repeats, "runs": [], "errors": []}

    def save():
        if rank0:
            out_dir.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(res, indent=1, default=float))

    def record(r: dict):
        res["runs"].append(r)
        if rank0:
            print({k: v for k, v in r.items() if k != "seconds"}, flush=True)
        save()

    def failed(what: str):
        res["errors"].append(f"{what}: " + traceback.format_exc()[-2000:])
        if rank0:
            print(res["errors"][-1], flush=True)
        save()

    # --- correctness first: the sharded forward equals the whole one
    res["forward_check"] = check_forward(cfg_t, tp, dtype)
    assert res["forward_check"]["argmax_agreement"] >= 0.9, res["forward_check"]
    if rank0:
        print("forward check", res["forward_check"], flush=True)
    bw = copy_bandwidth() if cuda else None
    res["copy_bandwidth_TBps"] = bw / 1e12 if bw else None

    t0 = time.perf_counter()
    target = parallel.random(cfg_t, tp, dtype, seed=1)
    draft = Llama.random(cfg_d, dtype=dtype, device=tp.device, seed=2)  # replicated: the same seed everywhere
    res["load_s"] = time.perf_counter() - t0
    assert target.cfg.n_heads == cfg_t.n_heads // tp.world
    tb, db = (weight_bytes(target), weight_bytes(draft)) if cuda else (None, None)
    res["weight_bytes_per_rank"] = {"target": tb, "draft": db}
    vocab_parallel = tp.world > 1 and cfg_t.vocab_size % tp.world == 0
    N, K = args.particles, args.block_size
    requests = [int(g) for g in args.requests.split(",")]
    max_ctx = args.prompt_len + max(args.out_len, 2 * args.sd_out_len) + 2 * (K + 1) + 16
    num_pages = max(requests) * N * (-(-max_ctx // 16) + 2) + 64
    engine = Engine(target, draft, num_pages=num_pages, page_size=16, max_context=max_ctx)
    res["kv"] = {"num_pages": num_pages, "bytes_per_page_target_plus_draft_per_rank":
                 engine.kv_t.bytes_per_page + engine.kv_d.bytes_per_page}
    prompts = torch.randint(0, cfg_t.vocab_size, (max(requests), args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()

    def floor(model, rows: list[int]) -> float | None:
        return gemm_graph_time(model, rows) if cuda else None

    def comm(rows: int) -> float | None:
        return collective_graph_time(tp, target.cfg, rows, vocab_parallel, graph_time) if cuda and tp.world > 1 \
            else 0.0 if cuda else None

    def fractions(r: dict, floor_s: float | None, comm_s: float | None, t: float, units: int) -> dict:
        if floor_s is None:
            return r
        r.update({"gemm_floor_s": floor_s * units, "frac_of_gemm_floor": floor_s * units / t,
                  "collectives_s": comm_s * units, "frac_of_gemm_plus_collectives": (floor_s + comm_s) * units / t})
        return r

    # --- our tensor-parallel autoregressive decoding
    for G in requests:
        try:
            engine.autoregressive(prompts[:G], max_new_tokens=8)  # compile, capture
            outs = []
            times = timed(lambda: outs.append(engine.autoregressive(prompts[:G], max_new_tokens=args.out_len)[0]),
                          args.repeats, tp)
            parallel.agree(tp, outs[-1])
            t = statistics.median(times)
            r = {"system": f"engine TP={tp.world} AR", "requests": G, "tok_s_per_request": args.out_len / t,
                 "tok_s_total": G * args.out_len / t, "seconds": times,
                 "roofline_tok_s_per_request": bw / tb if cuda else None}
            record(fractions(r, floor(target, [G]), comm(G), t, args.out_len))
        except Exception:
            failed(f"ar G={G}")

    # --- SMC-SD N, K
    for G in requests:
        try:
            kw = dict(particles=N, block_size=K)
            t0 = time.perf_counter()
            engine.smc_sd(prompts[:G], max_new_tokens=3 * (K + 1), **kw)  # compile, capture
            sync(tp.device)
            first = time.perf_counter() - t0
            outs = []
            times = timed(lambda: outs.append(engine.smc_sd(prompts[:G], max_new_tokens=args.out_len, **kw)),
                          args.repeats, tp)
            o = outs[-1]
            parallel.agree(tp, o)
            assert (o.lengths == args.out_len).all() and torch.isfinite(o.log_evidence).all()
            t, B = statistics.median(times), G * N
            round_floor = (floor(draft, [2 * B] + [B] * (K - 1)) + floor(target, [B * (K + 1)])) if cuda else None
            r = {"system": f"engine TP={tp.world} SMC-SD N={N} K={K}", "N": N, "K": K, "requests": G,
                 "tok_s_per_request": args.out_len / t, "tok_s_total": G * args.out_len / t, "seconds": times,
                 "rounds": o.rounds, "ms_per_round": 1e3 * t / o.rounds, "first_call_s": first,
                 "mean_ess": float(torch.tensor([e.mean() for e in o.ess]).mean()),
                 "host_ms_per_round": 1e3 * o.host_s / o.rounds}
            if cuda:
                r["gemm_floor_ms_per_round"] = 1e3 * round_floor
            record(fractions(r, round_floor, comm(B * (K + 1)), t, o.rounds))
        except Exception:
            failed(f"smc G={G}")
        engine.clear_graphs()

    # --- exact speculative decoding
    Ks = args.sd_block
    for G in requests:
        try:
            engine.speculative(prompts[:G], block_size=Ks, max_new_tokens=2 * (Ks + 1))
            outs = []
            L = args.sd_out_len
            times = timed(lambda: outs.append(engine.speculative(prompts[:G], block_size=Ks, max_new_tokens=L)),
                          args.repeats, tp)
            o = outs[-1]
            parallel.agree(tp, o)
            t = statistics.median(times)
            round_floor = (floor(draft, [2 * G] + [G] * (Ks - 1)) + floor(target, [G * (Ks + 1)])) if cuda else None
            r = {"system": f"engine TP={tp.world} exact SD K={Ks}", "K": Ks, "requests": G, "out_len": L,
                 "tok_s_per_request": L / t, "tok_s_total": G * L / t, "seconds": times, "rounds": o.rounds,
                 "ms_per_round": 1e3 * t / o.rounds}
            record(fractions(r, round_floor, comm(G * (Ks + 1)), t, o.rounds))
        except Exception:
            failed(f"sd G={G}")
        engine.clear_graphs()

    # --- TP = 1: the single-GPU engine's own model, same run
    if tp.world == 1:
        try:
            assert all(b.reduce is None for b in target.layers) and not target._forward_hooks
            engine = target = None
            single = Llama.random(cfg_t, dtype=dtype, device=tp.device, seed=1)
            eng = Engine(single, draft, num_pages=num_pages, page_size=16, max_context=max_ctx)
            G = requests[0]
            eng.smc_sd(prompts[:G], particles=N, block_size=K, max_new_tokens=3 * (K + 1))
            times = timed(lambda: eng.smc_sd(prompts[:G], particles=N, block_size=K, max_new_tokens=args.out_len),
                          args.repeats, tp)
            t = statistics.median(times)
            tp1 = next(r for r in res["runs"] if r.get("N") and r["requests"] == G)
            record({"system": f"single-GPU engine SMC-SD N={N} K={K}", "N": N, "K": K, "requests": G,
                    "tok_s_per_request": args.out_len / t, "tok_s_total": G * args.out_len / t, "seconds": times,
                    "tp1_over_single": tp1["tok_s_total"] / (G * args.out_len / t)})
        except Exception:
            failed("single-GPU comparison")

    ar = {r["requests"]: r for r in res["runs"] if " AR" in r["system"]}
    sd = {r["requests"]: r for r in res["runs"] if "exact SD" in r["system"]}
    for r in res["runs"]:
        if r.get("N") and "TP=" in r["system"]:
            if r["requests"] in ar:
                r["speedup_over_tp_ar"] = r["tok_s_total"] / ar[r["requests"]]["tok_s_total"]
            if r["requests"] in sd:
                r["speedup_over_exact_sd"] = r["tok_s_total"] / sd[r["requests"]]["tok_s_total"]
    save()
    if rank0:
        print(f"\n{args.target} on {tp.world} × {dev_name}; {args.prompt_len} -> {args.out_len} tokens; "
              f"forward check {res['forward_check']}")
        print("system | G | tok/s/req | tok/s total | of GEMM floor | of GEMM+collectives | x TP AR | x exact SD")
        for r in res["runs"]:
            g = lambda k: f"{r[k]:.2f}" if r.get(k) is not None else "-"  # noqa: E731
            print(f"{r['system']} | {r['requests']} | {r['tok_s_per_request']:.1f} | {r['tok_s_total']:.1f} | "
                  f"{g('frac_of_gemm_floor')} | {g('frac_of_gemm_plus_collectives')} | {g('speedup_over_tp_ar')} | "
                  f"{g('speedup_over_exact_sd')}")
        print(f"wrote {out_path}" + (f"; errors: {len(res['errors'])}" if res["errors"] else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
