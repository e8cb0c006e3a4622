"""What a host point adds to a draft step on the device. A round on llguidance's path gets each draft
step's masks from the host: the device waits for the host's count, uploads the packed masks,
samples with them (the fused sampler given ``mask_bits``: it finds the rows the mask leaves no token
and writes the step's unmasked log q itself) and hands the drafted column over to the host (a copy
into pinned memory and an event). The engine (``HostMasks.fetch`` / ``await_masks`` /
``hand_over``) runs the wait, the upload and the hand-over on a side stream, beside the draft's
forward; here the same parts on the step's own stream, and the sampler's two by-products as torch
operations, show what each would cost in the way. The host's count is posted ahead (each wait
passes at once: what is left is its cost, not waiting).

Each variant is a CUDA graph of ``--steps`` draft steps (a stand-in for the draft's forward,
``--layers`` pairs of products [R, D] x [D, 3D] x [3D, D] and the LM head [R, D] x [D, V], then the
step's parts), replayed ``--replays`` times; the variants are timed in turn, rotating their order,
``--repeats`` times; the table gives the median µs a step and each variant's difference from the
plain step.

    python benchmarks/host_point_costs.py            # one NVIDIA GPU, ~40 s
    python benchmarks/host_point_costs.py --rows 64 --vocab 49152 --hidden 576 --layers 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from smcdecode.backends.engine.host_masks import HostMasks
from smcdecode.backends.engine.kernels.host import wait_for_host
from smcdecode.backends.engine.sampling import sample_and_score
from smcdecode.potentials.constraint import no_bit_set, pack_bits

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))

from sampler_ab import graph_of, replayed_us, write_results  # noqa: E402  (graph_of: warmed up, then captured)

VARIANTS = {  # name -> (how the masks arrive and the column leaves, how the sampler's by-products are made)
    "plain": (None, None),
    "+masked sampler": (None, "fused"),
    "+masked sampler, torch by-products": (None, "torch"),
    "+host point, in the step's stream": ("inline", "fused"),
    "+host point, side stream (engine)": ("side", "fused"),
}


def steps_of(R: int, V: int, D: int, K: int, layers: int):
    """The draft steps of each variant, as functions of the step index."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(R + V)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(torch.bfloat16)

    x = rand(R, D)
    up, down = [rand(D, 3 * D, scale=D**-0.5) for _ in range(layers)], [rand(3 * D, D, scale=(3 * D)**-0.5)
                                                                         for _ in range(layers)]
    head = rand(V, D, scale=D**-0.5)
    h, mid = torch.empty(R, D, device=dev, dtype=torch.bfloat16), torch.empty(R, 3 * D, device=dev, dtype=torch.bfloat16)
    logits = torch.empty(R, V, device=dev, dtype=torch.bfloat16)
    temperature = torch.ones(R, device=dev)
    seeds = torch.randint(0, 2**62, (K,), device=dev, generator=g)
    mask = torch.rand(R, V, device=dev, generator=g) < 0.05
    mask[0] = True  # (a row inside a string: most tokens)
    host = HostMasks(R, V, dev, rows=R, k_max=K)
    host.waits = True
    host._bits[0][:R].copy_(pack_bits(mask).cpu())
    host._posted_np[0] = 2**62  # (every wait passes: its own cost remains)
    host_bits = torch.empty(R, host.W, device=dev, dtype=torch.int32)
    drafts = torch.zeros(R, K, dtype=torch.long, device=dev)
    log_q = torch.zeros(R, K, device=dev)
    log_q_all = torch.zeros(R, K, device=dev)

    def step(i: int, arrive, sampler) -> None:
        if arrive == "side" and i == 0:
            host.fetch(host_bits)
        h.copy_(x)
        for a, b in zip(up, down):  # (the draft's forward: its products alone)
            torch.matmul(h, a, out=mid)
            torch.matmul(mid, b, out=h)
        torch.matmul(h, head.t(), out=logits)
        if arrive == "inline":
            wait_for_host(host._posted, host._seen)
            host_bits.copy_(host._bits[0][:R], non_blocking=True)
        elif arrive == "side":
            host.await_masks()
        if sampler == "fused":
            d, log_q[:, i], _, _ = sample_and_score(logits, temperature, seeds[i], triton=True, mask_bits=host_bits,
                                                    unmasked_out=log_q_all[:, i])
        elif sampler == "torch":  # (the dead rows and log q(d) unmasked as separate torch operations)
            d, log_q[:, i], log_mass, _ = sample_and_score(logits, temperature, seeds[i], triton=True,
                                                           mask_bits=host_bits, dead=no_bit_set(host_bits, V))
            log_q_all[:, i] = torch.where(torch.isfinite(log_mass), log_q[:, i] + log_mass, 0.0)
        else:
            d, log_q[:, i], _, _ = sample_and_score(logits, temperature, seeds[i], triton=True)
            log_q_all[:, i] = log_q[:, i]
        drafts[:, i] = d
        if arrive == "inline":
            host._handed[i].copy_(d, non_blocking=True)
            host._handed_events[i].record()
        elif arrive == "side":
            host.hand_over(i, d)
            if i < K - 1:
                host.fetch(host_bits)
            else:  # (the graph's end waits for the side stream: in a round, the bonus point does)
                torch.cuda.current_stream().wait_stream(host._side)

    return {name: (lambda parts=parts: [step(i, *parts) for i in range(K)]) for name, parts in VARIANTS.items()}


def timed_case(R: int, V: int, D: int, K: int, layers: int, repeats: int, replays: int) -> dict:
    fns = steps_of(R, V, D, K, layers)
    graphs = {name: graph_of(fn, 1) for name, fn in fns.items()}
    names = list(graphs)
    times: dict = {name: [] for name in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            times[name].append(replayed_us(graphs[name], replays, K))
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"rows": R, "vocab": V, "hidden": D, "layers": layers, "steps": K, "us_per_step": med,
            "over_plain_us": {name: med[name] - med["plain"] for name in names}, "times_us": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,8", help="rows a step (particles x requests), comma-separated")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's: 49152)")
    ap.add_argument("--hidden", type=int, default=576, help="the draft's hidden size (SmolLM2-135M's: 576)")
    ap.add_argument("--layers", type=int, default=30, help="the draft's layers (SmolLM2-135M's: 30)")
    ap.add_argument("--steps", type=int, default=8, help="draft steps a graph (a round's K)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", type=Path, default=RESULTS / "host_point_costs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU")
    rows = []
    for R in map(int, args.rows.split(",")):
        row = timed_case(R, args.vocab, args.hidden, args.steps, args.layers, args.repeats, args.replays)
        rows.append(row)
        print(f"R={R} V={args.vocab} D={args.hidden}: µs a draft step (median of {args.repeats})", flush=True)
        for name, us in row["us_per_step"].items():
            print(f"  {name:36s} {us:7.2f}  ({row['over_plain_us'][name]:+6.2f} over plain)", flush=True)
    write_results(args.out, rows, repeats=args.repeats, replays=args.replays)


if __name__ == "__main__":
    main()
