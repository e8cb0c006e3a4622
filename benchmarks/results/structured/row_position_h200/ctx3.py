"""Scratch: structured_engine's run (MODELS), then host_point_timeline.timeline() for the contact record on
(A) the run's own SmolLM2 engine as it is (host stamps only), (B) the same engine after clear_graphs
(recaptured, device stamps), (C) a new engine over the same models in this process."""
import gc
import json
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import capture  # noqa: E402
import host_point_timeline as hpt  # noqa: E402
import structured_engine as se  # noqa: E402

mode, out = sys.argv[1], os.environ["OUT"]
make = capture.install(se, forget_random_engine=True)
ENG, SM = capture.ENG, capture.SM
models = "smollm2" if mode == "alone" else "random,smollm2"
seconds = capture.run(se, ["--smollm2-gguf", "/tmp/model.gguf", "--models", models, "--repeats", "5",
                          "--out", f"{out}/ctx3_se_{mode}.json"])
print(f"SE done in {seconds:.0f} s", flush=True)
gc.collect()


class NoStamps:
    """Stands in for ``hpt.DeviceStamps`` on an engine whose rounds were captured without the stamping
    wait kernel (A): the timeline then holds the host's stamps alone."""

    def reset(self):
        torch.cuda.synchronize()
        hpt.POSTS.clear()

    def add(self, stats):
        """No device stamps to add (the rounds were captured without them)."""


_, target, draft, model, prompts, eos = SM[0]
engine, P = ENG[0], prompts[:8]
res = {"mode": mode, "device": torch.cuda.get_device_name()}
hpt.install()
print("=== A: own engine as it is (host stamps)", flush=True)
res["A_own"] = hpt.timeline(engine, model, P, eos, "contact", NoStamps())
engine.clear_graphs()
stamps = hpt.DeviceStamps()
engine.smc_sd(P, particles=8, block_size=8, max_new_tokens=18)
print("=== B: own engine recaptured (device stamps)", flush=True)
res["B_own_recaptured"] = hpt.timeline(engine, model, P, eos, "contact", stamps)
cfg = engine.config
del engine
ENG[0] = None
gc.collect()
fresh = make(target, draft, cfg)
fresh.smc_sd(P, particles=8, block_size=8, max_new_tokens=18)
print("=== C: new engine, same models", flush=True)
res["C_new_engine"] = hpt.timeline(fresh, model, P, eos, "contact", stamps)
with open(f"{out}/tl_ctx3_{mode}.json", "w") as f:
    json.dump(res, f, indent=1)
for k in ("A_own", "B_own_recaptured", "C_new_engine"):
    r = res[k]
    print(f"SUMMARY {mode} {k}: calls {[round(t, 1) for t in r['call_ms']]} plain {[round(t, 1) for t in r['plain_same_length_call_ms']]} "
          f"ratio {sorted(p / c for c, p in zip(r['call_ms'], r['plain_same_length_call_ms']))[1]:.3f}", flush=True)
