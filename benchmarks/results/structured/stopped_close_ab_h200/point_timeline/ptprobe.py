"""structured_engine.py with the mask workers' host points timed: each worker logs, per point of a
round it serves, when it saw the device's flag and when its work began and ended (CLOCK_MONOTONIC,
comparable across processes) to $PTLOG/<pid>.txt."""

# ruff: noqa: E402, E401  (as run on the GPU machine: the probes are set up before the library and the script load)
import os
import runpy
import sys
import time

LOG = os.environ.get("PTLOG", "/tmp/ptlog")
os.makedirs(LOG, exist_ok=True)
from smcdecode.backends.engine import mask_process

_ev = []
pc = time.perf_counter
_handed0 = mask_process._Worker._handed
def _handed(self, target, seq):
    ok = _handed0(self, target, seq)
    _ev.append(f"h {target} {pc():.7f}\n")
    return ok
_work0 = mask_process._Worker.work
def _work(self, mine, turn, bonus):
    t = pc()
    _work0(self, mine, turn, bonus)
    _ev.append(f"w {len(mine)} {sum(m[6]-m[5] for m in mine)} {t:.7f} {pc():.7f}\n")
_plan0 = mask_process._Worker.plan
def _plan(self, mine, points, base, seq):
    _ev.append(f"p {seq} {points} {base} {pc():.7f}\n")
    _plan0(self, mine, points, base, seq)
    _ev.append(f"e {pc():.7f}\n")
_batch0 = mask_process._Worker.batch
def _batch(self):
    if _ev:
        with open(f"{LOG}/{os.getpid()}.txt", "a") as f:
            f.writelines(_ev)
        _ev.clear()
    _batch0(self)
mask_process._Worker._handed = _handed
mask_process._Worker.work = _work
mask_process._Worker.plan = _plan
mask_process._Worker.batch = _batch
sys.argv = ["structured_engine.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.getcwd(), "benchmarks/structured_engine.py"), run_name="__main__")
