"""Which runner is off when the reference backend and the engine runner disagree? A diagnostic.

Runs the particle filter on p² (a fork every round: multinomial resampling at τ = 1) over the runner
tests' tiny Llama (tests/conftest.py: ``tiny_llama_pair(head_std=0.3, value_scale=20)``) with both
backends and the same seed, tracks every row's context through extend / reorder / crop, and compares
the logits each ``extend`` returned with a float64 CPU forward of the row's whole context:

    python benchmarks/runner_logits_vs_truth.py --device cuda --groups 300

Prints, per round, the largest logit difference between the backends and, for the rows that differ
most (and rows 0 and 1), each backend's distance to the float64 truth; first, how many replicates
are token-identical with the same resampling history and their largest log Ẑ difference. Session 13
(H200) found the engine runner 2–4·10⁻³ off the truth at every row (HF 2·10⁻⁶): Triton's TF32
default for float32 products, since fixed (docs/engine.md).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPT = [0, 1, 2]


def record_runners(records: dict, current: list) -> None:
    """Wrap both runner classes so every extend appends (contexts, L, logits) under ``current[0]``."""
    from smcdecode.backends.engine.runner import EngineRunner
    from smcdecode.backends.reference import HFRunner

    for cls in (HFRunner, EngineRunner):
        init, extend, reorder, crop = cls.__init__, cls.extend, cls.reorder, cls.crop

        def __init__(self, model, prefix_ids, batch, *a, _init=init, **k):
            _init(self, model, prefix_ids, batch, *a, **k)
            self._ctx = [list(prefix_ids) for _ in range(batch)]
            records.setdefault(current[0], []).append([])

        def extend_(self, tokens, *a, _extend=extend, **k):
            out = _extend(self, tokens, *a, **k)
            self._ctx = [c + row for c, row in zip(self._ctx, tokens.tolist())]
            logits = out[0] if isinstance(out, tuple) else out
            records[current[0]][-1].append(([list(c) for c in self._ctx], tokens.shape[1], logits.float().cpu()))
            return out

        def reorder_(self, index, _reorder=reorder):
            _reorder(self, index)
            self._ctx = [list(self._ctx[i]) for i in index.tolist()]

        def crop_(self, length, _crop=crop):
            _crop(self, length)
            self._ctx = [c[:length] for c in self._ctx]

        cls.__init__, cls.extend, cls.reorder, cls.crop = __init__, extend_, reorder_, crop_


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--groups", type=int, default=300)
    args = p.parse_args(argv)
    from conftest import tiny_llama_pair

    import smcdecode as sd

    records: dict = {}
    current = [None]
    record_runners(records, current)
    target, _ = tiny_llama_pair(args.device, head_std=0.3, value_scale=20.0)
    truth_model = copy.deepcopy(target.hf).to("cpu").double()

    def make(**kw):
        return sd.SMC(sd.LM(target) ** 2, "target", particles=4, ess_threshold=1.0, resampler="multinomial", **kw)

    current[0] = "reference"
    ref = make().run_groups(PROMPT, args.groups, 8, seed=4)
    current[0] = "engine-runner"
    eng = make(backend="engine-runner").run_groups(PROMPT, args.groups, 8, seed=4)
    same = (ref.tokens == eng.tokens).flatten(1).all(1) & (ref.lengths == eng.lengths).all(1)
    for a, b in zip(ref.resampled, eng.resampled):
        same &= (a == b).to(same.device)
    d = (eng.log_evidence - ref.log_evidence).abs()[same]
    print(f"{args.device}: {int(same.sum())} of {args.groups} replicates token-identical with the same resampling; "
          f"max |Δ log Ẑ| among them {float(d.max()):.2e}, {int((d > 1e-3).sum())} above 1e-3")

    def truth(ctx: list[int], n: int) -> torch.Tensor:
        with torch.no_grad():
            return truth_model(input_ids=torch.tensor([ctx])).logits[0, -n:].float()

    for c, ((ctx_r, n, lr), (ctx_e, _, le)) in enumerate(zip(records["reference"][-1], records["engine-runner"][-1])):
        diff = (lr - le).abs().amax(dim=(1, 2))
        print(f"round {c}: {lr.shape[0]} rows, {sum(a == b for a, b in zip(ctx_r, ctx_e))} with equal contexts, "
              f"max |reference − engine| {float(diff.max()):.2e}")
        for r in dict.fromkeys(torch.argsort(diff, descending=True)[:2].tolist() + [0, 1]):
            print(f"  row {r}: |reference − truth| {float((lr[r] - truth(ctx_r[r], n)).abs().max()):.2e}, "
                  f"|engine − truth| {float((le[r] - truth(ctx_e[r], n)).abs().max()):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
