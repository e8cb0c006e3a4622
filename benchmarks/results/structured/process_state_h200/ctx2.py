"""Scratch: full structured_engine run; before loading SmolLM2: report what of the random models' run is still alive, and (CLEAN=1) empty torch's caches (device and pinned host)."""
import collections
import gc
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
import structured_engine as se


def report(tag):
    gc.collect()
    objs = gc.get_objects()
    c = collections.Counter(str(type(o).__dict__.get("__module__", "")) + "." + type(o).__name__ for o in objs
                            if str(type(o).__dict__.get("__module__", "")).startswith("smcdecode"))
    dev = collections.Counter()
    for o in objs:
        try:
            if isinstance(o, torch.Tensor):
                dev["pinned" if (o.device.type == "cpu" and o.is_pinned()) else o.device.type] += 1
        except Exception:  # (an object isinstance or is_pinned fails on while the process tears down: not counted)
            pass
    graphs = sum(1 for o in objs if isinstance(o, torch.cuda.CUDAGraph))
    print(f"ALIVE {tag}: {dict(c.most_common(25))} tensors={dict(dev)} graphs={graphs} "
          f"cuda allocs={torch.cuda.memory_stats().get('allocation.all.current')} "
          f"host active={torch.cuda.host_memory_stats().get('active_bytes.current')}", flush=True)

orig = se.smollm2_models
def patched(args, device, dtype):
    report("before SmolLM2")
    if os.environ.get("CLEAN") == "1":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        (getattr(torch._C, '_host_emptyCache', None) or torch._C._accelerator_emptyHostCache)()
        report("after emptying caches")
    return orig(args, device, dtype)
se.smollm2_models = patched
sys.argv = ["structured_engine.py", "--smollm2-gguf", "/tmp/model.gguf", "--models", "random,smollm2", "--repeats", "5",
            "--out", os.environ["OUT"] + "/ctx2_se.json"]
try:
    se.main()
except SystemExit as e:
    print("exit:", e)
report("end")
