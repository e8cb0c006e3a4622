"""What a host point adds to a draft step on the device: a round on llguidance's path waits for the
host's masks before each draft step's sampling (``HostMasks.await_masks``: the wait kernel, then the
packed masks uploaded), samples with them (the fused sampler given ``mask_bits``, its dead-row
check, the step's unmasked log q), and hands the drafted column over to the host (a copy into
pinned memory and an event). This times a draft step with and without each of those parts, with
the host's count already posted (the wait passes at once: what is left is its cost, not waiting).

Each variant is a CUDA graph of ``--steps`` draft steps (a stand-in for the draft's forward, the
LM head's matmul [R, D] x [D, V], then the step's parts), replayed ``--replays`` times; the variants
are timed in turn, rotating their order, ``--repeats`` times; the table gives the median µs a step
and each variant's difference from the plain step.

    python benchmarks/host_point_costs.py            # one NVIDIA GPU, ~30 s
    python benchmarks/host_point_costs.py --rows 64 --vocab 49152 --hidden 576
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from smcdecode.backends.engine.kernels.host import wait_for_host
from smcdecode.backends.engine.sampling import sample_and_score
from smcdecode.potentials.constraint import pack_bits

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))

from sampler_ab import graph_of, replayed_us, write_results  # noqa: E402  (graph_of: warmed up, then captured)

PARTS = ("wait", "upload", "masked", "hand_over")
VARIANTS = {  # name -> the parts a step has
    "plain": (),
    "+wait": ("wait",),
    "+upload": ("upload",),
    "+masked sampler": ("masked",),
    "+hand-over": ("hand_over",),
    "host point (all)": PARTS,
}


def steps_of(R: int, V: int, D: int, K: int):
    """(the draft steps of each variant as functions of the step index, the buffers they use)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(R + V)
    x = torch.randn(R, D, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, D, device=dev, generator=g) / D**0.5).to(torch.bfloat16)
    logits = torch.empty(R, V, device=dev, dtype=torch.bfloat16)
    temperature = torch.ones(R, device=dev)
    seeds = torch.randint(0, 2**62, (K,), device=dev, generator=g)
    mask = torch.rand(R, V, device=dev, generator=g) < 0.05
    mask[0] = True  # (a row inside a string: most tokens)
    pinned_bits = pack_bits(mask).cpu().pin_memory()
    host_bits = torch.empty_like(pinned_bits, device=dev)
    posted = torch.zeros(2, dtype=torch.long, pin_memory=True)
    posted[0] = 2**62  # (every wait passes: its own cost remains)
    seen = torch.zeros(1, dtype=torch.long, device=dev)
    handed = torch.zeros(K, R, dtype=torch.long, pin_memory=True)
    events = [torch.cuda.Event(external=True) for _ in range(K)]
    drafts = torch.zeros(R, K, dtype=torch.long, device=dev)
    log_q = torch.zeros(R, K, device=dev)
    log_q_all = torch.zeros(R, K, device=dev)

    def step(i: int, parts: tuple) -> None:
        torch.matmul(x, w.t(), out=logits)  # (the draft's forward, its LM head alone)
        if "wait" in parts:
            wait_for_host(posted, seen)
        if "upload" in parts:
            host_bits.copy_(pinned_bits, non_blocking=True)
        masks = {"mask_bits": host_bits} if "masked" in parts else {}
        d, log_q[:, i], log_mass, _ = sample_and_score(logits, temperature, seeds[i], triton=True, **masks)
        drafts[:, i] = d
        if masks:  # (the round's statistic: log q(d) of the unmasked draft)
            log_q_all[:, i] = torch.where(torch.isfinite(log_mass), log_q[:, i] + log_mass, 0.0)
        else:
            log_q_all[:, i] = log_q[:, i]
        if "hand_over" in parts:
            handed[i].copy_(d, non_blocking=True)
            events[i].record()

    return {name: (lambda parts=parts: [step(i, parts) for i in range(K)]) for name, parts in VARIANTS.items()}


def timed_case(R: int, V: int, D: int, K: int, repeats: int, replays: int) -> dict:
    fns = steps_of(R, V, D, K)
    graphs = {name: graph_of(fn, 1) for name, fn in fns.items()}
    names = list(graphs)
    times: dict = {name: [] for name in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            times[name].append(replayed_us(graphs[name], replays, K))
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"rows": R, "vocab": V, "hidden": D, "steps": K, "us_per_step": med,
            "over_plain_us": {name: med[name] - med["plain"] for name in names}, "times_us": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,8", help="rows a step (particles x requests), comma-separated")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's: 49152)")
    ap.add_argument("--hidden", type=int, default=576, help="the draft's hidden size (SmolLM2-135M's: 576)")
    ap.add_argument("--steps", type=int, default=8, help="draft steps a graph (a round's K)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", type=Path, default=RESULTS / "host_point_costs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU")
    rows = []
    for R in map(int, args.rows.split(",")):
        row = timed_case(R, args.vocab, args.hidden, args.steps, args.repeats, args.replays)
        rows.append(row)
        print(f"R={R} V={args.vocab} D={args.hidden}: µs a draft step (median of {args.repeats})", flush=True)
        for name, us in row["us_per_step"].items():
            print(f"  {name:18s} {us:7.2f}  ({row['over_plain_us'][name]:+6.2f} over plain)", flush=True)
    write_results(args.out, rows, repeats=args.repeats, replays=args.replays)


if __name__ == "__main__":
    main()
