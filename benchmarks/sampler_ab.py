"""A/B of the fused Triton sampler: the kernel before the per-row/α/mask extension (``--base``, a
file or a git revision) against the current one, on the shapes of an SMC-SD round of the 8B target
(vocabulary 128,256, bf16 logits): verify ([G·N·9, V], every 9th row draws, gathered log-probs) and
draft steps ([G·N, V], every row draws), for 1 and 8 requests × N = 8.

Each case is captured as a CUDA graph of ``--calls`` launches; the two kernels run interleaved,
``--repeats`` times, and the medians are compared. Correctness is checked as it goes: on the plain
cases the two kernels must give the same tokens and log-probs for the same seed (the noise is
unchanged), and the new kernel must equal the torch function (samplers.steps) draw for draw under
the same noise bits. The new kernel's general path (per-row T, α, a token mask: the general round's
bonus) and its per-row temperature (the general round's verify) are timed too, against the old
kernel's plain case of the same shape.

    python benchmarks/sampler_ab.py [--base 67446e9 | --base path/to/old_sampling.py]

Writes benchmarks/results/sampler_ab.json and prints a table."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KERNEL = "smcdecode/backends/engine/kernels/sampling.py"
V = 128_256


def load_base(base: str):
    """The old kernel module: from a file, or ``git show base:KERNEL``; loaded inside the kernels package
    (its relative imports resolve there)."""
    path = Path(base)
    if not path.is_file():
        source = subprocess.run(["git", "show", f"{base}:{KERNEL}"], cwd=ROOT, check=True, capture_output=True,
                                text=True).stdout
        path = Path(tempfile.mkdtemp()) / "sampling_base.py"
        path.write_text(source)
    spec = importlib.util.spec_from_file_location("smcdecode.backends.engine.kernels._sampling_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph_of(fn, calls: int):
    fn()  # compile / warm up
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def time_graph(g, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls  # µs per call


def replayed_us(g, replays: int, per: int = 1) -> float:
    """µs a call: the graph ``g`` replayed ``replays`` times (``per`` calls a replay), timed by events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * per)


def write_results(out: Path, rows: list, **meta) -> None:
    """``rows`` with the device, torch's version, the date and ``meta``, as JSON into ``out``."""
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **meta, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


def check_same(old, new, what: str) -> None:
    ot, olp = old[0], old[1]
    assert torch.equal(ot, new.token), f"{what}: the old and new kernels drew different tokens for the same seed"
    ok = ~torch.isnan(olp)
    assert torch.allclose(olp[ok], new.log_prob[ok], atol=1e-5), f"{what}: log-probs differ"
    if len(old) > 2 and old[2] is not None:
        assert torch.allclose(old[2], new.gathered, atol=1e-5), f"{what}: gathered log-probs differ"


def check_torch(new_fn, logits, temperature, **kw) -> int:
    """Tokens where the kernel and the torch function differ under the same noise bits (must be 0 but
    for float32 near-ties, which the caller reports)."""
    from smcdecode.samplers.steps import sample_and_score

    bits = torch.randint(-(2**31), 2**31 - 1, logits.shape, device=logits.device, dtype=torch.int32)
    a = new_fn(logits, temperature, torch.tensor(0, device=logits.device), bits=bits, **kw)
    b = sample_and_score(logits, temperature, bits=bits, **kw)
    return int((a.token != b.token).sum())


def measure(old, new, kind: str, requests: int, R: int, calls: int, repeats: int, seed) -> list[dict]:
    """The cases of one shape: checked, then timed interleaved; one row of results per case."""
    dev, rows = seed.device, []
    logits = (torch.randn(R, V, device=dev) * 3).to(torch.bfloat16)
    logits[0, ::3] = float("-inf")
    gather = torch.randint(0, V, (R,), device=dev)
    T = torch.rand(R, device=dev) + 0.5
    alpha = torch.full((R,), 2.0, device=dev)
    mask = torch.rand(R, V, device=dev) < 0.5
    plain = dict(sample_every=9) if kind == "verify" else {}
    g_ = gather if kind == "verify" else None
    check_same(old(logits, 0.8, seed, g_, **plain), new(logits, 0.8, seed, g_, **plain), f"{kind} R={R}")
    near_ties = check_torch(new, logits, 0.8, gather=g_, **plain)
    near_ties += check_torch(new, logits, T, alpha=alpha, mask=mask)
    cases = {"old": lambda: old(logits, 0.8, seed, g_, **plain),
             "new": lambda: new(logits, 0.8, seed, g_, **plain)}
    if kind == "verify":  # the general round's verify: per-row T, no draws
        cases["new, per-row T, no draw"] = lambda: new(logits, T, seed, gather, draw=False)
    else:  # the general round's bonus (and a masked draft step): per-row T, α, mask
        cases["new, per-row T, α, mask"] = lambda: new(logits, T, seed, alpha=alpha, mask=mask)
    graphs = {name: graph_of(fn, calls) for name, fn in cases.items()}
    times = {name: [] for name in cases}
    for _ in range(repeats):  # interleaved
        for name, g in graphs.items():
            times[name].append(time_graph(g, calls))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in cases:
        rows.append(dict(kind=kind, requests=requests, rows=R, vocab=V, case=name, median_us=med[name],
                         ratio_to_old=med[name] / med["old"], samples_us=times[name],
                         torch_near_tie_mismatches=near_ties))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="67446e9", help="the old kernel: a file, or a git revision")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sampler_ab.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from smcdecode.backends.engine.kernels.sampling import triton_sample_and_score as new

    old = load_base(args.base).triton_sample_and_score
    torch.manual_seed(0)
    seed = torch.tensor(1234, device="cuda")
    rows = []
    for requests in (1, 8):
        B = requests * 8
        for kind, R in (("verify", B * 9), ("draft", B)):
            rows += measure(old, new, kind, requests, R, args.calls, args.repeats, seed)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, calls_per_graph=args.calls, repeats=args.repeats,
                  base=args.base, rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['device']}  (medians of {args.repeats} interleaved graphs of {args.calls} calls)")
    print(f"{'shape':>22}  {'case':<26}{'µs/call':>9}{'vs old':>8}  torch mismatches")
    for r in rows:
        shape = f"{r['kind']} [{r['rows']}, {r['vocab']}]"
        print(f"{shape:>22}  {r['case']:<26}{r['median_us']:9.2f}{r['ratio_to_old']:8.3f}  "
              f"{r['torch_near_tie_mismatches']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
