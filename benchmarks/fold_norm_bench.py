"""The folded draft layer (SMCDECODE_FOLD_NORM, model.Block.forward_folded) against today's layer, on
one GPU, random Llama-3.2-1B weights in bf16 (every layer's own weights, so nothing stays in L2):

1. correctness first (aborts with the failing check): the skinny NORM, NORM + SiLU·mul and RESIDUAL
   products against add + RMSNorm then torch's product in float64, in-place w2 (skinny, every block
   configuration timed, and ``addmm_``), and whole draft forwards with the fold off and on ("1",
   "addmm") against a float32 copy of the model (the folded path's error at most twice the unfused
   bf16 path's), each replayed from a CUDA graph as well as eagerly;
2. per product class over the 16 layers, replayed in a CUDA graph (medians), at M = 8, 16, 64 rows:
   add + RMSNorm launch + cuBLAS wqkv vs skinny NORM wqkv; add + RMSNorm + skinny w13·SiLU vs skinny
   NORM + SiLU w13; skinny wo vs skinny RESIDUAL wo; cuBLAS w2 vs cuBLAS addmm_ in place vs skinny
   RESIDUAL w2 (a few block configurations at M = 8 and 16);
3. one whole draft decode forward (8 rows × 1 token at position 511: 16 layers, paged attention over
   a real KV pool, final norm, head) in a CUDA graph with SMCDECODE_FOLD_NORM = 0, 1, addmm.
   ``--e2e`` adds SMC-SD 1 request × N=8, K=8 end to end (Llama-3.1-8B target; a few minutes).

    PYTHONPATH=$PWD python benchmarks/fold_norm_bench.py --out /tmp/fold

Prints a compact table and writes fold_norm.json into --out. About a minute of GPU time without --e2e.
"""

# ruff: noqa: B023  (the closures run before their loop advances)
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_engine import graph_time  # benchmarks/ is on sys.path when run as a script

from smcdecode.backends.engine import PRESETS, KVPool, Llama, PagedBatch, kernels
from smcdecode.backends.engine.model import add_rms_norm_reference, silu_mul

MODES = ("0", "1", "addmm")
DEVICE, DTYPE = "cuda", torch.bfloat16  # (a CPU smoke run of the checks swaps these)
W2_CONFIGS = [(16, bn, bk, warps, 4) for bn in (16, 32) for bk in (128, 256, 512) for warps in (4, 8)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def fail(what: str, err: float, tol: float) -> None:
    sys.exit(f"correctness check failed: {what}: relative error {err:.3g} > {tol:g}; not timing a wrong kernel")


def check(what: str, err: float, tol: float, log: dict) -> None:
    log[what] = err
    print(f"  {what:55s} rel err {err:.2e}", flush=True)
    if not err < tol:
        fail(what, err, tol)


class DraftStep:
    """A draft decode step: 8 rows (1 request × 8 particles) × 1 token at position ``pos`` over a
    KV pool of 32 pages a row (page size 16), the tokens and pages fixed (a CUDA graph replays it)."""

    def __init__(self, model: Llama, rows: int = 8, pos: int = 511, page_size: int = 16):
        cfg = model.cfg
        pages = -(-(pos + 1) // page_size)
        self.model = model
        self.pool = KVPool.for_model(cfg, rows * pages + 1, page_size, DTYPE, DEVICE)
        self.pool.kv.normal_()  # a context of random keys and values
        page_table = (torch.arange(rows * pages, device=DEVICE, dtype=torch.int32).view(rows, pages) + 1)
        positions = torch.full((rows, 1), pos, device=DEVICE, dtype=torch.long)
        self.batch = PagedBatch.build(positions, page_table, page_size, group=rows)
        self.tokens = torch.randint(0, cfg.vocab_size, (rows, 1), device=DEVICE)
        model.set_rope_cache(pos + 1)

    def __call__(self) -> torch.Tensor:
        return self.model(self.tokens, self.pool, self.batch)


def with_env(env: dict, fn):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def with_mode(mode: str, fn):
    return with_env({"SMCDECODE_FOLD_NORM": mode}, fn)


def graph_output(fn) -> torch.Tensor:
    """fn's output replayed from a CUDA graph (captured after a warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    g.replay()  # twice: a replay must not depend on state the previous one left (in-place adds)
    torch.cuda.synchronize()
    return out.clone()


@torch.no_grad()
def correctness(model: Llama, res: dict) -> None:
    print("correctness", flush=True)
    log: dict = {}
    cfg, blk = model.cfg, model.layers[0]
    torch.manual_seed(0)
    for M in (1, 8, 16):
        x = torch.randn(M, cfg.dim, device=DEVICE, dtype=DTYPE) * 3
        gamma = (torch.rand(cfg.dim, device=DEVICE) + 0.5).to(DTYPE)
        n_ref = add_rms_norm_reference(x.double(), None, gamma.double(), cfg.norm_eps)[1]
        y = kernels.triton_skinny_linear(x, blk.wqkv.weight, norm_weight=gamma, eps=cfg.norm_eps)
        ref = n_ref @ blk.wqkv.weight.double().T
        check(f"M={M} skinny NORM wqkv", rel_err(y, ref), 1e-2, log)
        if rel_err((x.double() * gamma.double()) @ blk.wqkv.weight.double().T, ref) < 0.5:
            fail("the product without 1/rms is close to the reference: the check would not catch it", 0.0, 0.5)
        y = kernels.triton_skinny_linear(x, blk.w13.weight, silu=True, norm_weight=gamma, eps=cfg.norm_eps)
        check(f"M={M} skinny NORM+SiLU w13", rel_err(y, silu_mul(n_ref @ blk.w13.weight.double().T)), 2e-2, log)
        o = torch.randn(M, cfg.n_heads * cfg.head_dim, device=DEVICE, dtype=DTYPE)
        h = torch.randn(M, cfg.dim, device=DEVICE, dtype=DTYPE)
        y = kernels.triton_skinny_linear(o, blk.wo.weight, residual=h)
        check(f"M={M} skinny RESIDUAL wo", rel_err(y, h.double() + o.double() @ blk.wo.weight.double().T), 1e-2, log)
        m = torch.randn(M, cfg.intermediate_size, device=DEVICE, dtype=DTYPE) * 0.1
        ref = h.double() + m.double() @ blk.w2.weight.double().T
        for c in [None] + (W2_CONFIGS if M == 8 else []):
            y = h.clone()
            kernels.triton_skinny_linear(m, blk.w2.weight, config=c, residual=y, out=y)
            check(f"M={M} skinny RESIDUAL w2 in place {c or 'default'}", rel_err(y, ref), 1e-2, log)
        y = h.clone()
        y.addmm_(m, blk.w2.weight.t())
        check(f"M={M} addmm_ w2 in place", rel_err(y, ref), 1e-2, log)
    # whole forwards: bf16 logits through 16 random layers differ from float32 by a few per cent
    # (rounding), so each path is measured against a float32 copy (torch references, no Triton)
    step = DraftStep(model)
    ref_model = copy.deepcopy(model).float()
    step32 = copy.copy(step)
    step32.model, step32.pool = ref_model, KVPool.for_model(cfg, step.pool.kv.shape[2], step.pool.page_size,
                                                            torch.float32, DEVICE)
    step32.pool.kv.copy_(step.pool.kv)
    ref = with_env({"SMCDECODE_TRITON": "0"}, step32)
    del ref_model, step32
    err = {}
    for mode in MODES:
        eager = with_mode(mode, step)
        err[mode] = rel_err(eager, ref)
        log[f"draft forward FOLD_NORM={mode} vs float32"] = err[mode]
        print(f"  draft forward FOLD_NORM={mode:5s} vs float32: rel err {err[mode]:.2e}", flush=True)
        # a replay that adds in place twice, or reads a stale buffer, is off by O(1), not by rounding
        check(f"draft forward FOLD_NORM={mode} CUDA graph vs eager", rel_err(with_mode(mode, lambda: graph_output(step)),
                                                                             eager), max(err["0"], 1e-2), log)
    for mode in MODES[1:]:
        check(f"draft forward FOLD_NORM={mode} vs float32 (<= 2x unfused bf16's)", err[mode], 2 * err["0"] + 1e-3, log)
    res["correctness"] = log


@torch.no_grad()
def products(model: Llama, Ms: tuple[int, ...], res: dict) -> list[dict]:
    cfg, layers = model.cfg, model.layers
    eps = cfg.norm_eps
    rows = []
    for M in Ms:
        x = torch.randn(M, cfg.dim, device=DEVICE, dtype=DTYPE)
        d = torch.randn(M, cfg.dim, device=DEVICE, dtype=DTYPE)
        o = torch.randn(M, cfg.n_heads * cfg.head_dim, device=DEVICE, dtype=DTYPE)
        m = torch.randn(M, cfg.intermediate_size, device=DEVICE, dtype=DTYPE) * 0.1
        h = torch.randn(M, cfg.dim, device=DEVICE, dtype=DTYPE)
        variants = {
            "wqkv": {
                "add+norm, cuBLAS": lambda: [F.linear(kernels.triton_add_rms_norm(x, d, b.attention_norm.weight, eps)[1],
                                                      b.wqkv.weight) for b in layers],
                "skinny NORM": lambda: [kernels.triton_skinny_linear(x, b.wqkv.weight, norm_weight=b.attention_norm.weight,
                                                                     eps=eps) for b in layers],
            },
            "w13": {
                "add+norm, skinny SiLU": lambda: [kernels.triton_skinny_linear(
                    kernels.triton_add_rms_norm(x, d, b.ffn_norm.weight, eps)[1], b.w13.weight, silu=True) for b in layers],
                "skinny NORM+SiLU": lambda: [kernels.triton_skinny_linear(x, b.w13.weight, silu=True,
                                                                          norm_weight=b.ffn_norm.weight, eps=eps)
                                             for b in layers],
            },
            "wo": {
                "skinny": lambda: [kernels.triton_skinny_linear(o, b.wo.weight) for b in layers],
                "skinny RESIDUAL": lambda: [kernels.triton_skinny_linear(o, b.wo.weight, residual=h) for b in layers],
            },
            "w2": {
                "cuBLAS": lambda: [F.linear(m, b.w2.weight) for b in layers],
                "cuBLAS addmm_ in place": lambda: [h.addmm_(m, b.w2.weight.t()) for b in layers],
                "skinny RESIDUAL in place": lambda: [kernels.triton_skinny_linear(m, b.w2.weight, residual=h, out=h)
                                                     for b in layers],
            },
        }
        if M <= 16:
            for c in W2_CONFIGS:
                variants["w2"][f"skinny RESIDUAL in place {c[1:4]}"] = (
                    lambda c=c: [kernels.triton_skinny_linear(m, b.w2.weight, config=c, residual=h, out=h)
                                 for b in layers])
        for cls, vs in variants.items():
            for name, fn in vs.items():
                try:
                    t = graph_time(fn)
                    row = {"M": M, "class": cls, "variant": name, "us_16_layers": 1e6 * t}
                except Exception as e:  # a configuration that does not compile
                    row = {"M": M, "class": cls, "variant": name, "error": repr(e)[:300]}
                rows.append(row)
                print(row, flush=True)
    res["products"] = rows
    return rows


@torch.no_grad()
def forward(model: Llama, res: dict) -> list[dict]:
    step = DraftStep(model)
    rows = []
    for mode in MODES:
        t = with_mode(mode, lambda: graph_time(step, repeats=31))
        rows.append({"FOLD_NORM": mode, "us_per_forward": 1e6 * t})
        print(rows[-1], flush=True)
    res["forward"] = rows
    return rows


def e2e(draft: Llama, res: dict) -> None:
    from engine_variants import run_variant

    from smcdecode.backends.engine import Engine

    target = Llama.random(PRESETS["llama-3.1-8b"], device=DEVICE, seed=1)
    engine = Engine(target, draft, num_pages=12 * 8 * 70 + 256, page_size=16, max_context=256 + 1024 + 16)
    torch.manual_seed(0)
    prompt = [torch.randint(0, 128000, (256,)).tolist()]
    rows = []
    for mode in MODES:
        def fn(short: bool):
            engine.smc_sd(prompt, particles=8, block_size=8, max_new_tokens=27 if short else 1024)

        t = run_variant(engine, {"SMCDECODE_FOLD_NORM": mode}, fn, 2)
        rows.append({"FOLD_NORM": mode, "s": t, "ms_per_round": 1e3 * t / -(-1024 // 9)})
        print(rows[-1], flush=True)
    res["e2e"] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/fold")
    ap.add_argument("--rows", default="8,16,64", help="M values of the per-product section")
    ap.add_argument("--e2e", action="store_true", help="also SMC-SD 1x N=8 K=8 end to end (8B target)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    t0 = time.perf_counter()
    draft = Llama.random(PRESETS["llama-3.2-1b"], device=DEVICE, seed=2)
    with torch.no_grad():  # norms that are not all ones (Llama.random fills them with ones)
        for b in draft.layers:
            b.attention_norm.weight.uniform_(0.5, 1.5)
            b.ffn_norm.weight.uniform_(0.5, 1.5)
    correctness(draft, res)
    prod = products(draft, tuple(int(r) for r in args.rows.split(",")), res)
    fwd = forward(draft, res)
    if args.e2e:
        e2e(draft, res)
    res["seconds"] = time.perf_counter() - t0
    (out / "fold_norm.json").write_text(json.dumps(res, indent=1, default=str))

    print(f"\n{res['device']}: µs for 16 Llama-3.2-1B layers (CUDA graph replay, median)")
    for M in sorted({r["M"] for r in prod}):
        for cls in ("wqkv", "w13", "wo", "w2"):
            rs = [r for r in prod if r["M"] == M and r["class"] == cls and "error" not in r]
            base = rs[0]["us_16_layers"]
            best = min(rs, key=lambda r: r["us_16_layers"])
            cells = "  ".join(f"{r['variant']} {r['us_16_layers']:.1f}" for r in rs[:3])
            print(f"M={M:3d} {cls:5s} {cells}  | best {best['variant']} {best['us_16_layers']:.1f} "
                  f"({best['us_16_layers'] - base:+.1f} vs first)")
    print("\ndraft decode forward (8 rows, 16 layers + final norm + head), µs:")
    for r in fwd:
        print(f"  SMCDECODE_FOLD_NORM={r['FOLD_NORM']:6s} {r['us_per_forward']:7.1f} "
              f"({r['us_per_forward'] - fwd[0]['us_per_forward']:+.1f})")
    for r in res.get("e2e", []):
        print(f"  SMC-SD 1x N=8 K=8 FOLD_NORM={r['FOLD_NORM']:6s} {r['ms_per_round']:.2f} ms/round")
    print(f"[{res['seconds']:.0f} s; {out / 'fold_norm.json'}]")


if __name__ == "__main__":
    main()
