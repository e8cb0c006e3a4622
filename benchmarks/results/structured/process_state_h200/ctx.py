"""Scratch: host_point_timeline --schemas contact in a fresh process (alone) or after a full structured_engine run in the same process (after)."""
import gc
import os
import runpy
import sys
from pathlib import Path

import torch

mode, out = sys.argv[1], os.environ["OUT"]

def facts(tag):
    st = Path("/proc/self/status").read_text()
    thr = [line for line in st.splitlines() if line.startswith(("Threads", "VmRSS"))]
    ms = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    h = {}
    try:
        h = {k: v for k, v in torch.cuda.host_memory_stats().items() if "allocations" in k or "segment" in k or "reserved" in k or "active" in k}
    except Exception as e:
        h = {"err": str(e)}
    print(f"FACTS {tag}: {thr} gc_objects={len(gc.get_objects())} cuda reserved={torch.cuda.memory_reserved()/2**20:.0f}MiB "
          f"segments={ms.get('segment.all.current')} allocs={ms.get('allocation.all.current')} host={h}", flush=True)

if mode == "after":
    sys.argv = ["structured_engine.py", "--smollm2-gguf", "/tmp/model.gguf", "--models", os.environ.get("MODELS", "random,smollm2"),
                "--repeats", "5", "--out", f"{out}/ctx_se.json"]
    try:
        runpy.run_path("benchmarks/structured_engine.py", run_name="__main__")
    except SystemExit as e:
        print("se exit:", e, flush=True)
    gc.collect()
facts(mode + " before timeline")
sys.argv = ["host_point_timeline.py", "--smollm2-gguf", "/tmp/model.gguf", "--schemas", "contact", "--out", f"{out}/tl_{mode}.json"]
runpy.run_path("benchmarks/host_point_timeline.py", run_name="__main__")
facts(mode + " after timeline")
