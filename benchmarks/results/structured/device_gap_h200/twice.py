"""A full ``structured_engine.py`` run (same arguments) in which SmolLM2's eight-request contact record on
llguidance's path (the strings' automata) is measured twice in its place (the second time with a
freshly bound constraint, on the same captured rounds and mask workers) and three times at the end
(fresh, the row's own constraint object, fresh again), while every mask worker records, for each
round it serves, when it waited for each drafted column and when it worked on each point (with its
context switches, page faults and CPU). Times are perf_counter (CLOCK_MONOTONIC, shared by the
processes), so ``summarize.py`` attributes the workers' records to rows by the rows' start and end.
After each row it also records the engine process's CPU and shared mappings' NUMA nodes, and, for
each captured round with host masks, the physical runs of its mask buffer and the time of a copy
from it to the device against a fresh pinned buffer (``copyprobe_lib.py``).

    PYTHONPATH=/tmp/site:$PWD WLOG=/tmp/wlog python benchmarks/results/structured/device_gap_h200/twice.py \\
        --smollm2-gguf /tmp/model.gguf --models random,smollm2 --repeats 5 --out OUT.json

``WLOG``: where the records go (rows.json and one w<pid>.jsonl a worker). ``TWICE_ANY=1 TWICE_G=2``
with ``--tiny``: the same on tiny random models (checks the script on a CPU; no worker records there).
"""
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import structured_engine as se  # noqa: E402

from smcdecode.backends.engine import mask_process as mp  # noqa: E402
from smcdecode.backends.engine import request_masks as rm  # noqa: E402

LOGDIR = Path(os.environ.get("WLOG", "/tmp/wlog"))
LOGDIR.mkdir(parents=True, exist_ok=True)
ANY, GG = bool(os.environ.get("TWICE_ANY")), int(os.environ.get("TWICE_G", 8))
ROWS, KEEP, PTS = [], [], []
_plan, _handed, _work = mp._Worker.plan, mp._Worker._handed, mp._Worker.work
_adv, _fill = rm.advance_requests, rm.fill_requests
_measure, _run_model = se.measure, se.run_model


def this_cpu() -> int:
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def plan(self, mine, points, base, seq):
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    PTS.clear()
    t0 = time.perf_counter()
    _plan(self, mine, points, base, seq)
    t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    if not hasattr(self, "_log"):
        self._log = open(LOGDIR / f"w{os.getpid()}.jsonl", "a")
    self._log.write(json.dumps({"w": self.w, "seq": seq, "t0": t0, "t1": t1, "points": points, "n": len(mine),
                                "cpu": this_cpu(), "nivcsw": r1.ru_nivcsw - r0.ru_nivcsw,
                                "nvcsw": r1.ru_nvcsw - r0.ru_nvcsw, "minflt": r1.ru_minflt - r0.ru_minflt,
                                "pts": list(PTS)}) + "\n")
    self._log.flush()


def handed(self, target, seq):
    a = time.perf_counter()
    ok = _handed(self, target, seq)
    PTS.append(("h", a, time.perf_counter()))
    return ok


def work(self, mine, turn, bonus):
    a = time.perf_counter()
    _work(self, mine, turn, bonus)
    PTS.append(("w", a, time.perf_counter(), len(mine)))


def adv(*a, **k):
    t = time.perf_counter()
    r = _adv(*a, **k)
    PTS.append(("a", t, time.perf_counter()))
    return r


def fill(*a, **k):
    t = time.perf_counter()
    r = _fill(*a, **k)
    PTS.append(("f", t, time.perf_counter()))
    return r


rm.advance_requests, rm.fill_requests = adv, fill
mp._Worker.plan, mp._Worker._handed, mp._Worker.work = plan, handed, work


def numa_state() -> dict:
    """The engine process's CPU, and the NUMA node counts of its shared mappings (numa_maps)."""
    out = {"cpu": this_cpu()}
    try:
        out["maps"] = [line for line in Path("/proc/self/numa_maps").read_text().splitlines()
                       if "dev/zero" in line or "SYSV" in line or "shmem" in line or " shared" in line]
    except OSError as e:
        out["err"] = repr(e)
    return out


def probe_buffers(engine) -> list:
    """Each captured round's mask buffer (HostMasks): its physical runs and a copy's time to the
    device, against a fresh pinned buffer's."""
    import torch

    out = []
    try:
        from copyprobe_lib import runs, time_copy

        for key in list(engine.graphs.keys()):
            h = getattr(engine.graphs[key], "host", None)
            if h is None or getattr(h, "_mem", None) is None:
                continue
            src = h._bits[0]
            dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
            ok, r, r2m, _ = runs(src.data_ptr(), src.numel() * 4)
            ctrl = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            sync = h._syncmem
            out.append({"key": str(key)[:80], "present": ok, "runs": r, "frames_2m": r2m,
                        "copy": time_copy(src, dst), "control": time_copy(ctrl, dst),
                        "sync_runs": None if sync is None else
                        runs(torch.frombuffer(sync, dtype=torch.uint8).data_ptr(), len(sync))[1]})
    except Exception as e:  # noqa: BLE001 - recorded (on a CPU: no CUDA)
        out.append({"err": repr(e)})
    return out


def record(name, label, c, G, take, t0, row, engine) -> None:
    ROWS.append({"name": name, "label": label, "path": c.path, "held": c.held_strings, "G": G, "take": take,
                 "t0": t0, "t1": time.perf_counter(), "wall": time.time(), "numa": numa_state(),
                 "probe": probe_buffers(engine), "ratio": row["ratio_same_length"],
                 "con": row["constrained_seconds"], "same": row["plain_same_length_seconds"]})
    (LOGDIR / "rows.json").write_text(json.dumps(ROWS))


def measure(name, label, c, engine, model, P, *a, **k):
    twice = ((ANY or "SmolLM2" in name) and len(P) == GG and label == "contact" and c.path == "llguidance"
             and c.held_strings)
    if twice:
        KEEP.append(c)
    row = None
    for take in range(2 if twice else 1):
        t0 = time.perf_counter()
        cc = c if take == 0 else se.bound(model, label, se.CONTACT_SCHEMA, "llguidance", True)
        row = _measure(name, label, cc, engine, model, P, *a, **k)
        record(name, label, cc, len(P), take, t0, row, engine)
    return row


def run_model(name, engine, model, prompts, eos, schemas, args, device):
    rows = _run_model(name, engine, model, prompts, eos, schemas, args, device)
    if (ANY or "SmolLM2" in name) and KEEP:
        for take, c in (("end fresh", None), ("end original", KEEP[0]), ("end fresh 2", None)):
            c = c or se.bound(model, "contact", se.CONTACT_SCHEMA, "llguidance", True)
            t0 = time.perf_counter()
            row = _measure(name, "contact", c, engine, model, prompts[:GG], eos, 1.0, [1.0], args, device)
            record(name, "contact", c, GG, take, t0, row, engine)
    return rows


se.measure, se.run_model = measure, run_model
if __name__ == "__main__":
    se.main()
