"""Tensor-parallel benchmark of the engine: a random-weight Llama-3.1-8B (2 GPUs) or Llama-3.1-70B
(4 GPUs) target sharded over the GPUs, a replicated Llama-3.2-1B draft, bf16: SMC-SD N=8 K=8 against
our tensor-parallel autoregressive decoding and exact speculative decoding, 1 and 8 requests, with
the sharded round's GEMM floor (each rank's weight products in a CUDA graph) and its collectives
(NCCL all-reduces and the logits' all-gather, in a CUDA graph) measured in the same run.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --target llama-3.1-8b --out DIR
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_tp.py --target llama-3.1-70b --out DIR
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_tp.py --target llama-3.1-8b --out DIR

(from the repository root with PYTHONPATH=$PWD). In order:

1. correctness: the sharded forward of a 2-layer model at the target's widths (prefill of 8 rows,
   then a 9-token and a 1-token extension through the paged cache) against the whole model from
   the same weights, in float32 (max |Δ| / max |logit| < 1e-4) and in the run's dtype (< 0.05), and
   every rank's logits the same bytes. A failure stops the run before any timing.
2. one untimed call of every system at the timed lengths (Triton compilation, CUDA-graph capture:
   ``first_call_s``), its output checked (lengths; every rank's output the same, ``parallel.agree``).
3. ``--repeats`` rounds over all systems in turn (interleaved), each call timed with the ranks
   starting together; medians. Every timed output is checked across ranks too.
4. GEMM floors and collectives of each system's rounds, in CUDA graphs.

With one process (TP = 1) it also times SMC-SD (one request) on the single-GPU engine's own model
(``Llama.random``) in the same rotation, so TP = 1 is compared with the single-GPU path. Rank 0
writes ``<--out>/tp_<target>_tp<N>.json`` after every stage and prints a table. Defaults:
256-token prompts, 1024-token outputs (AR, SMC-SD), 256 for exact SD (random weights accept almost
no drafted token, so it decodes about one token a round), 3 repeats; on 2 H100s the 8B run takes
about 3-4 minutes, most of it loading and the first calls.

Errors: a system that fails on every rank is dropped from the rotation and reported (the others
go on); a stage that exceeds ``--timeout`` seconds on a rank (a collective waiting for a rank that
failed) prints what it was doing and every thread's stack, and exits, so torchrun stops the other
ranks instead of hanging. The exit status is 1 whenever an error was recorded. ``--tiny`` is a
few-second smoke test on the CPU with gloo (tiny shapes; no GEMM floors)."""
# ruff: noqa: B023  (the lambdas run before the loop advances)

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from smcdecode.backends.engine import PRESETS, Engine, KVPool, Llama, LlamaConfig, PagedBatch, parallel  # noqa: E402
from smcdecode.backends.engine.shards import RandomReader  # noqa: E402

TARGETS = {
    "llama-3.1-8b": PRESETS["llama-3.1-8b"],
    "llama-3.1-70b": LlamaConfig(128256, 8192, 80, 64, 8, 28672, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "tiny": LlamaConfig(512, 128, 2, 8, 4, 256, rope_theta=10000.0),
}
DRAFTS = {"llama-3.2-1b": PRESETS["llama-3.2-1b"], "tiny": LlamaConfig(512, 64, 1, 4, 2, 128, rope_theta=10000.0)}
PAGE = 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def deadline(seconds: float, what: str, rank: int):
    """End this process if ``what`` is still running after ``seconds``: a line saying so, every
    thread's stack, exit status 1 (faulthandler's own dump 30 s later, should the GIL be held)."""

    def expire():
        print(f"bench_tp rank {rank}: {what!r} still running after {seconds:.0f} s (another rank failed, or a "
              "collective hangs): exiting", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def on_every_rank(tp, what: str, fn: Callable, timeout: float):
    """``fn()`` on this rank, then every rank's error (None where it succeeded): (fn's value or
    None, ["rank r: what: traceback", ...])."""
    value, error = None, None
    with deadline(timeout, what, tp.rank):
        try:
            value = fn()
        except Exception:  # noqa: BLE001 - reported by rank 0, with the other ranks' errors
            error = f"{what}: {traceback.format_exc()[-2500:]}"
        every = [None] * tp.world
        dist.all_gather_object(every, error, group=tp.control)
    return value, [f"rank {r}: {e}" for r, e in enumerate(every) if e]


def timed_call(fn: Callable, tp) -> tuple[float, object]:
    """(seconds, output) of one call, the ranks starting it together."""
    dist.barrier(group=tp.control)
    sync(tp.device)
    t0 = time.perf_counter()
    out = fn()
    sync(tp.device)
    return time.perf_counter() - t0, out


@torch.inference_mode()
def check_forward(cfg: LlamaConfig, tp, dtype: torch.dtype) -> dict:
    """Max |Δ logit| / max |logit| and argmax agreement of the sharded forward of a 2-layer model at
    ``cfg``'s widths against the whole model (the same random weights): 8 rows, a 55-token prefill,
    then 9 tokens (a verify pass) and 1 (a decode step) through the paged cache; every rank's
    logits must be the same bytes (``parallel.agree`` raises otherwise)."""
    small = dataclasses.replace(cfg, n_layers=2)
    whole = parallel.build(RandomReader(small, 7, tp.device), parallel.TensorParallel(0, 1, tp.device), dtype)
    shard = parallel.random(small, tp, dtype, seed=7)
    rows, pages = 8, 5  # 80 positions a row
    tokens = torch.randint(0, cfg.vocab_size, (rows, 65), generator=torch.Generator().manual_seed(0)).to(tp.device)
    pt = torch.arange(1, 1 + rows * pages, dtype=torch.int32, device=tp.device).view(rows, pages)
    got = []
    for m in (shard, whole):
        pool = KVPool.for_model(m.cfg, rows * pages + 1, PAGE, dtype, tp.device)
        outs = []
        for a, b in ((0, 55), (55, 64), (64, 65)):
            batch = PagedBatch.build(torch.arange(a, b, device=tp.device)[None].repeat(rows, 1), pt, PAGE)
            outs.append(m(tokens[:, a:b], pool, batch).float())
        got.append(torch.cat(outs, 1))
    del whole, shard
    parallel.agree(tp, got[0])
    err = float((got[0] - got[1]).abs().max() / got[1].abs().max())
    top = float((got[0].argmax(-1) == got[1].argmax(-1)).float().mean())
    return {"dtype": str(dtype).removeprefix("torch."), "max_abs_err_over_max_logit": err, "argmax_agreement": top,
            "ranks_agree": True}


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


@dataclasses.dataclass
class System:
    name: str
    requests: int
    tokens: int  # per request
    call: Callable
    check: Callable  # output -> None (raises when wrong)
    floor: Callable  # output -> (GEMM floor s, collectives s) of the whole call, or (None, None)
    info: Callable = lambda out: {}  # output -> extra fields
    first_call_s: float | None = None
    seconds: list = dataclasses.field(default_factory=list)
    out: object = None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="llama-3.1-8b", choices=sorted(TARGETS))
    ap.add_argument("--draft", default="llama-3.2-1b", choices=sorted(DRAFTS))
    ap.add_argument("--out", "--out-dir", dest="out", default=str(Path(__file__).resolve().parent / "results"),
                    help="directory of the JSON result (rank 0 writes it)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=1024, help="output tokens of AR and SMC-SD (EOS ignored)")
    ap.add_argument("--sd-out-len", type=int, default=256,
                    help="output length of exact speculative decoding (random weights accept ~nothing)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds over all systems (medians)")
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--sd-block", type=int, default=4, help="K of exact speculative decoding")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds one stage (or one collective) may take on a rank before the run is ended")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, gloo, few tokens")
    args = ap.parse_args(argv)
    if args.tiny:
        args.target = args.draft = "tiny"
        args.prompt_len, args.out_len, args.sd_out_len, args.repeats = 16, 18, 8, 2
    for name in ("prompt_len", "out_len", "sd_out_len", "repeats", "particles", "block_size", "sd_block"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        args.requests = sorted({int(g) for g in args.requests.split(",")})
    except ValueError:
        ap.error(f"--requests must be comma-separated integers such as 1,8, got {args.requests!r}")
    if min(args.requests) < 1:
        ap.error(f"--requests must be >= 1, got {args.requests}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    tp = parallel.init("gloo" if args.tiny else None, timeout=args.timeout)
    rank0, cuda = tp.rank == 0, tp.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    out_path = Path(args.out) / f"tp_{args.target}_tp{tp.world}.json"
    if cuda:
        from bench_engine import copy_bandwidth, gemm_graph_time, graph_time, weight_bytes
    cfg_t, cfg_d = TARGETS[args.target], DRAFTS[args.draft]
    dev_name = torch.cuda.get_device_name(tp.device) if cuda else "cpu"
    N, K, Ks, L, Lsd = args.particles, args.block_size, args.sd_block, args.out_len, args.sd_out_len
    res: dict = {"device": dev_name, "gpus": tp.world, "torch": torch.__version__,
                 "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "shapes": {"target": args.target, "draft": args.draft, "dtype": str(dtype).removeprefix("torch."),
                            "prompt_len": args.prompt_len, "out_len": L, "sd_out_len": Lsd, "page_size": PAGE,
                            "particles": N, "block_size": K, "sd_block_size": Ks, "requests": args.requests,
                            "weights": "random (normal 0, 0.02)", "eos": "ignored (fixed-length outputs)",
                            "draft_placement": "replicated on every rank",
                            "head": "vocab-parallel, logits all-gathered" if tp.world > 1 else "whole"},
                 "repeats": args.repeats, "order": "interleaved: each repeat calls every system once, in turn",
                 "runs": [], "errors": []}

    def save():
        if rank0:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(res, indent=1, default=float))

    def stage(what: str, fn: Callable):
        value, errors = on_every_rank(tp, what, fn, args.timeout)
        if errors:
            res["errors"] += errors
            if rank0:
                print("\n".join(errors), file=sys.stderr, flush=True)
            save()
        return value, not errors

    def finish() -> int:
        save()
        if rank0:
            print(f"wrote {out_path}" + (f"; {len(res['errors'])} error(s)" if res["errors"] else ""), flush=True)
        code = 1 if res["errors"] else 0
        # NOTE: the ranks meet here, then leave without interpreter teardown. With NCCL, teardown
        # hung on 2 H200s (8B and 70B, result already written: communicators still held by captured
        # CUDA graphs); with gloo, a rank's exit after destroy_process_group aborted now and then
        # ("terminate called without an active exception", about 1 run in 12 on a loaded 2-core CPU).
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if not cuda:
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # --- 1. correctness first
    checks = [torch.float32] + ([dtype] if dtype != torch.float32 else [])
    res["forward_check"], ok = stage("forward check", lambda: [check_forward(cfg_t, tp, d) for d in checks])
    if ok:
        for c in res["forward_check"]:
            bound = 1e-4 if c["dtype"] == "float32" else 0.05
            if not c["max_abs_err_over_max_logit"] < bound:
                res["errors"].append(f"forward check: the sharded forward differs from the whole one in {c['dtype']}: "
                                     f"max |Δ| / max |logit| = {c['max_abs_err_over_max_logit']:.3g} >= {bound}")
        if rank0:
            print("forward check", res["forward_check"], flush=True)
    if res["errors"]:
        return finish()
    if cuda:
        res["copy_bandwidth_TBps"] = copy_bandwidth() / 1e12

    # --- the models and engines
    t0 = time.perf_counter()
    target = parallel.random(cfg_t, tp, dtype, seed=1)
    draft = Llama.random(cfg_d, dtype=dtype, device=tp.device, seed=2)  # replicated: the same seed everywhere
    res["load_s"] = time.perf_counter() - t0
    tb, db = (weight_bytes(target), weight_bytes(draft)) if cuda else (None, None)
    res["weight_bytes_per_rank"] = {"target": tb, "draft": db}
    vocab_parallel = tp.world > 1 and cfg_t.vocab_size % tp.world == 0
    max_ctx = args.prompt_len + max(L, 2 * Lsd) + 2 * (K + 1) + PAGE
    per_row = -(-max_ctx // PAGE) + 2
    num_pages = max(args.requests) * N * per_row + 64
    engine = Engine(target, draft, num_pages=num_pages, page_size=PAGE, max_context=max_ctx)
    res["kv"] = {"num_pages": num_pages, "bytes_per_page_target_plus_draft_per_rank":
                 engine.kv_t.bytes_per_page + engine.kv_d.bytes_per_page}
    prompts = torch.randint(0, cfg_t.vocab_size, (max(args.requests), args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()

    def gemm(model, rows: list[int]) -> float | None:
        return gemm_graph_time(model, rows) if cuda else None

    def comm(rows: int) -> float | None:
        if not cuda:
            return None
        return collective_graph_time(tp, target.cfg, rows, vocab_parallel, graph_time) if tp.world > 1 else 0.0

    def floors(model, draft_rows: list[int], verify_rows: int, rounds: int):
        """(GEMM floor, collectives) of ``rounds`` rounds: the draft's passes at ``draft_rows`` tokens
        (none: AR) and one pass of ``model`` at ``verify_rows``."""
        if not cuda:
            return None, None
        draft_s = gemm(draft, draft_rows) if draft_rows else 0.0
        return (draft_s + gemm(model, [verify_rows])) * rounds, comm(verify_rows) * rounds

    def ar_check(G):
        def check(out):
            if tuple(out[0].shape) != (G, L):
                raise RuntimeError(f"AR returned tokens of shape {tuple(out[0].shape)}, not ({G}, {L})")
        return check

    def run_check(G, length):
        def check(o):
            if not ((o.lengths == length).all() and torch.isfinite(o.log_evidence).all()):
                raise RuntimeError(f"lengths {o.lengths.flatten()[:8].tolist()} (want {length}) or log Ẑ not finite")
        return check

    def sd_check(G):
        def check(o):
            if not (o.lengths == Lsd).all():
                raise RuntimeError(f"exact SD lengths {o.lengths.flatten()[:8].tolist()}, not {Lsd}")
        return check

    def smc_info(o):
        return {"rounds": o.rounds, "mean_ess": float(np.mean([np.mean(e) for e in o.ess])),
                "host_ms_per_round": 1e3 * o.host_s / o.rounds}

    systems: list[System] = []
    for G in args.requests:
        systems.append(System(f"engine TP={tp.world} AR", G, L,
                              lambda G=G: engine.autoregressive(prompts[:G], max_new_tokens=L), ar_check(G),
                              lambda out, G=G: floors(target, [], G, L)))
    for G in args.requests:
        B = G * N
        systems.append(System(f"engine TP={tp.world} SMC-SD N={N} K={K}", G, L,
                              lambda G=G: engine.smc_sd(prompts[:G], particles=N, block_size=K, max_new_tokens=L),
                              run_check(G, L), lambda o, B=B: floors(target, [2 * B] + [B] * (K - 1), B * (K + 1),
                                                                       o.rounds), smc_info))
    for G in args.requests:
        systems.append(System(f"engine TP={tp.world} exact SD K={Ks}", G, Lsd,
                              lambda G=G: engine.speculative(prompts[:G], block_size=Ks, max_new_tokens=Lsd),
                              sd_check(G), lambda o, G=G: floors(target, [2 * G] + [G] * (Ks - 1), G * (Ks + 1),
                                                                    o.rounds), lambda o: {"rounds": o.rounds}))
    if tp.world == 1:  # the single-GPU engine's own model, one request, in the same rotation
        single = Llama.random(cfg_t, dtype=dtype, device=tp.device, seed=1)
        eng1 = Engine(single, draft, num_pages=N * per_row + 64, page_size=PAGE, max_context=max_ctx)
        G = args.requests[0]
        systems.append(System(f"single-GPU engine SMC-SD N={N} K={K}", G, L,
                              lambda: eng1.smc_sd(prompts[:G], particles=N, block_size=K, max_new_tokens=L),
                              run_check(G, L), lambda o: floors(single, [2 * G * N] + [G * N] * (K - 1),
                                                                G * N * (K + 1), o.rounds), smc_info))

    def warm(s: System):
        t = time.perf_counter()
        out = s.call()
        sync(tp.device)
        s.first_call_s = time.perf_counter() - t
        s.check(out)
        parallel.agree(tp, out)

    def one(s: System):
        t, out = timed_call(s.call, tp)
        parallel.agree(tp, out)
        s.seconds.append(t)
        s.out = out

    # --- 2. first calls; 3. interleaved timed repeats
    live = [s for s in systems if stage(f"first call: {s.name} G={s.requests}", lambda s=s: warm(s))[1]]
    for rep in range(args.repeats):
        live = [s for s in live if stage(f"repeat {rep}: {s.name} G={s.requests}", lambda s=s: one(s))[1]]

    # --- 4. GEMM floors and collectives; the records
    for s in live:
        measured, ok = stage(f"floors: {s.name} G={s.requests}", lambda s=s: (*s.floor(s.out), s.info(s.out)))
        floor_s, comm_s, info = measured if ok else (None, None, {})
        t = statistics.median(s.seconds)
        r = {"system": s.name, "requests": s.requests, "tokens_per_request": s.tokens,
             "tok_s_per_request": s.tokens / t, "tok_s_total": s.requests * s.tokens / t, "seconds": s.seconds,
             "first_call_s": s.first_call_s, **info}
        if "SMC-SD" in s.name:
            r.update(N=N, K=K)
        if "rounds" in r:
            r["ms_per_round"] = 1e3 * t / r["rounds"]
        if " AR" in s.name and cuda:
            r["roofline_tok_s_per_request"] = res["copy_bandwidth_TBps"] * 1e12 / tb
        if floor_s is not None:
            r.update(gemm_floor_s=floor_s, frac_of_gemm_floor=floor_s / t, collectives_s=comm_s,
                     frac_of_gemm_plus_collectives=(floor_s + comm_s) / t)
            if "rounds" in r:
                r["gemm_floor_ms_per_round"] = 1e3 * floor_s / r["rounds"]
        res["runs"].append(r)
        save()

    ar = {r["requests"]: r for r in res["runs"] if r["system"].endswith(" AR")}
    sd = {r["requests"]: r for r in res["runs"] if "exact SD" in r["system"]}
    tp_smc = {r["requests"]: r for r in res["runs"] if r["system"].startswith("engine") and "SMC-SD" in r["system"]}
    for r in res["runs"]:
        if "SMC-SD" in r["system"]:
            if r["requests"] in ar:
                r["speedup_over_tp_ar"] = r["tok_s_total"] / ar[r["requests"]]["tok_s_total"]
            if r["requests"] in sd:
                r["speedup_over_exact_sd"] = r["tok_s_total"] / sd[r["requests"]]["tok_s_total"]
        if r["system"].startswith("single-GPU") and r["requests"] in tp_smc:
            r["tp1_over_single"] = tp_smc[r["requests"]]["tok_s_total"] / r["tok_s_total"]
    if rank0:
        print(f"\n{args.target} on {tp.world} × {dev_name}; {args.prompt_len} -> {L} tokens (exact SD {Lsd}); "
              f"medians of {args.repeats} interleaved repeats")
        print("system | G | tok/s/req | tok/s total | of GEMM floor | of GEMM+collectives | x TP AR | x exact SD")
        for r in res["runs"]:
            g = lambda k: f"{r[k]:.2f}" if r.get(k) is not None else "-"  # noqa: E731
            print(f"{r['system']} | {r['requests']} | {r['tok_s_per_request']:.1f} | {r['tok_s_total']:.1f} | "
                  f"{g('frac_of_gemm_floor')} | {g('frac_of_gemm_plus_collectives')} | {g('speedup_over_tp_ar')} | "
                  f"{g('speedup_over_exact_sd')}", flush=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
