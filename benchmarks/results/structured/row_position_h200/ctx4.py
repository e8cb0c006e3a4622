"""Scratch: structured_engine --requests 8 (all schemas, or --only contact), then the contact record on
llguidance (held strings) measured as its row is, on the run's own engine and on a new engine over
the same models, alternately (old new old new), with this process's time in garbage collection."""
import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import capture  # noqa: E402
import structured_engine as se  # noqa: E402

from smcdecode.potentials.json_schema import JSONSchema  # noqa: E402

mode, out = sys.argv[1], os.environ["OUT"]
make = capture.install(se, forget_random_engine=False)
ENG, SM = capture.ENG, capture.SM
GC = {"n": 0, "s": 0.0, "gen2": 0, "t": 0.0}


def gccb(phase, info):
    if phase == "start":
        GC["t"] = time.perf_counter()
    else:
        GC["n"] += 1
        GC["s"] += time.perf_counter() - GC["t"]
        GC["gen2"] += info["generation"] == 2


gc.callbacks.append(gccb)
extra = {"all": ["--requests", "8"], "only": ["--requests", "8", "--only", "contact"],
         "gone": ["--requests", "1,8", "--only", "contact"], "full": ["--requests", "1,8"], "rand": ["--models", "random,smollm2"]}[mode.rstrip("0123456789")]
seconds = capture.run(se, ["--smollm2-gguf", "/tmp/model.gguf", "--models", "smollm2", "--repeats", "5",
                          "--out", f"{out}/ctx4_se_{mode}.json", *extra])
print(f"SE done in {seconds:.0f} s; gc {GC}; objects {len(gc.get_objects())}", flush=True)
name, target, draft, model, prompts, eos = SM[0]
old, P = ENG[0], prompts[:8]
new = make(target, draft, old.config)
args = argparse.Namespace(particles=8, block_size=8, max_new_tokens=256, repeats=5)
c = JSONSchema(se.CONTACT_SCHEMA, path="llguidance").bind(model)
c.compile_s, c.label, c.asked, c.held_strings = 0.0, "contact", "llguidance", c._strings is not None
rows = []
for which, eng in (("old", old), ("new", new), ("old", old), ("new", new)):
    GC.update(n=0, s=0.0, gen2=0)
    r = se.measure(name, "contact", c, eng, model, P, eos, 1.0, [], args, "cuda")
    eng.clear_graphs()
    r |= {"engine": which, "gc": dict(GC)}
    rows.append(r)
    print(f"ABAB {mode} {which}: ratio_same_length {r['ratio_same_length']:.3f} ms/round {r['ms_per_round_constrained']:.2f} "
          f"vs {r['ms_per_round_plain_same_length']:.2f} main cpu {1e3 * r['main_cpu_s_per_call']:.0f} ms kids "
          f"{1e3 * r['children_cpu_s_per_constrained_call']:.0f} ms gc {GC}", flush=True)
with open(f"{out}/ctx4_abab_{mode}.json", "w") as f:
    json.dump({"mode": mode, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1, default=str)
