"""The device cost of the host's masks at a draft step: the fused sampler given the packed masks as
uploaded (``mask_bits``: it reads a bit a token) against the same masks unpacked to bytes first
(``unpack_bits``, then ``mask``: what a round did before), with the rows' dead check each way.

Each variant is captured in a CUDA graph and replayed; the variants alternate (A B, B A, …) and the
table gives the median µs a step over ``--repeats`` timings of ``--replays`` replays each. Both
variants must draw the same tokens (checked).

    python benchmarks/sampling_masks.py            # one NVIDIA GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from smcdecode.backends.engine.kernels import triton_sample_and_score
from smcdecode.potentials.constraint import pack_bits, unpack_bits

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))

from sampler_ab import graph_of, replayed_us, write_results  # noqa: E402  (graph_of: warmed up on a side stream, captured)


def timed_case(R: int, V: int, repeats: int, replays: int) -> dict:
    """One (rows, vocabulary) case: both variants captured, then timed alternately."""
    g = torch.Generator(device="cuda").manual_seed(R + V)
    logits = torch.randn(R, V, device="cuda", generator=g).to(torch.bfloat16)
    mask = torch.rand(R, V, device="cuda", generator=g) < 0.05
    mask[0] = True  # (a row inside a string: most tokens)
    bits = pack_bits(mask)
    seed = torch.tensor(7, device="cuda")
    outs = {}

    def unpacked():
        outs["unpacked"] = triton_sample_and_score(logits, 1.0, seed, mask=unpack_bits(bits, V))

    def packed():
        outs["packed"] = triton_sample_and_score(logits, 1.0, seed, mask_bits=bits)

    graphs = {name: graph_of(fn, 1) for name, fn in (("unpacked", unpacked), ("packed", packed))}
    times: dict = {"unpacked": [], "packed": []}
    for i in range(repeats):
        for name in (("unpacked", "packed") if i % 2 == 0 else ("packed", "unpacked")):
            times[name].append(replayed_us(graphs[name], replays))
    same = torch.equal(outs["unpacked"].token, outs["packed"].token) and torch.equal(
        outs["unpacked"].log_norm, outs["packed"].log_norm)
    return {"rows": R, "vocab": V, "unpacked_us": statistics.median(times["unpacked"]),
            "packed_us": statistics.median(times["packed"]), "same_draws": same, "times_us": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,64,512", help="rows a step (particles × requests), comma-separated")
    ap.add_argument("--vocab", default="49152,128256", help="vocabulary sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", type=Path, default=RESULTS / "sampling_masks.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU")
    rows = []
    for V in map(int, args.vocab.split(",")):
        for R in map(int, args.rows.split(",")):
            row = timed_case(R, V, args.repeats, args.replays)
            rows.append(row)
            print(f"R={R:4d} V={V:6d}: unpacked then masked {row['unpacked_us']:7.1f} µs, packed "
                  f"{row['packed_us']:7.1f} µs a step (same draws: {row['same_draws']})", flush=True)
    write_results(args.out, rows, repeats=args.repeats, replays=args.replays)


if __name__ == "__main__":
    main()
