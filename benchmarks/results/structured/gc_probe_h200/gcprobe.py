"""Run structured_engine.py with garbage-collection probes: the engine's process and each mask worker
log every collection (generation, duration, objects tracked) to $GCLOG/<pid>.txt."""

# ruff: noqa: E402, E401  (as run on the GPU machine: the probes are set up before the library and the script load)
import gc
import os
import runpy
import sys
import time

LOG = os.environ.get("GCLOG", "/tmp/gclog")
os.makedirs(LOG, exist_ok=True)
FREEZE = os.environ.get("GCFREEZE", "0") == "1"

_buf, _t0 = [], [0.0]
def _cb(phase, info):
    if phase == "start":
        _t0[0] = time.perf_counter()
    else:
        _buf.append(f"{time.time():.4f} {info['generation']} {(time.perf_counter() - _t0[0]) * 1e6:.0f} {info['collected']}\n")
        if len(_buf) >= 200 or (time.perf_counter() - _t0[0]) > 1e-3:
            _flush()

def _flush():
    with open(f"{LOG}/{os.getpid()}.txt", "a") as f:
        f.writelines(_buf)
    _buf.clear()

gc.callbacks.append(_cb)

from smcdecode.backends.engine import mask_process

_orig_init = mask_process._Worker.__init__
def _init(self, *a, **k):
    _buf.clear()
    with open(f"{LOG}/{os.getpid()}.txt", "a") as f:
        f.write(f"# worker forked; tracked {len(gc.get_objects())} counts {gc.get_count()} stats {gc.get_stats()}\n")
    if FREEZE:
        gc.freeze()
    _orig_init(self, *a, **k)
mask_process._Worker.__init__ = _init

_orig_batch = mask_process._Worker.batch
def _batch(self):
    _orig_batch(self)
    if _buf:
        _flush()
mask_process._Worker.batch = _batch

import atexit

atexit.register(_flush)
sys.argv = ["structured_engine.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.getcwd(), "benchmarks/structured_engine.py"), run_name="__main__")
