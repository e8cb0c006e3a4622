"""Do the pinned shared buffers the host masks use (``mask_workers.shared_buffer``, SmolLM2's step
buffer: 64 rows of 1,536 words) copy to the device at different speeds, and does that follow their
physical contiguity? ``TRIALS`` buffers, each made after churning this process's heap, then CUDA's own
pinned memory, then whether CUDA's pinned memory is shared with a forked child.

    PYTHONPATH=$PWD:benchmarks/results/structured/device_gap_h200 python benchmarks/results/structured/device_gap_h200/copyprobe.py [TRIALS]
"""
import json
import os
import random
import sys

import torch
from copyprobe_lib import runs, time_copy

from smcdecode.backends.engine.mask_workers import shared_buffer


class Owner:
    """What a pinned buffer's unpinning hangs on."""


rows, W = 64, 1536
dst = torch.empty(rows, W, dtype=torch.int32, device="cuda")
junk, owners = [], []
for trial in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    for _ in range(50):  # (allocate and free anonymous memory of random sizes: fragments the free lists)
        junk.append(bytearray(random.randint(1, 64) * 4096))
    random.shuffle(junk)
    del junk[: len(junk) // 2]
    owner = Owner()
    owners.append(owner)
    owner.mem = shared_buffer(2 * rows * W * 4, True, owner)
    src = torch.frombuffer(owner.mem, dtype=torch.int32)[: rows * W].view(rows, W)
    src.fill_(7)
    present, r, frames_2m, _ = runs(src.data_ptr(), rows * W * 4)
    med, p90 = time_copy(src, dst)
    print(json.dumps({"trial": trial, "present": present, "runs": r, "frames_2m": frames_2m, "copy_us_med": med,
                      "copy_us_p90": p90}), flush=True)
pinned = torch.empty(rows, W, dtype=torch.int32, pin_memory=True).fill_(7)
_, r, frames_2m, _ = runs(pinned.data_ptr(), rows * W * 4)
print(json.dumps({"torch_pinned": True, "runs": r, "frames_2m": frames_2m, "copy": time_copy(pinned, dst)}))
q = torch.zeros(4096, dtype=torch.int64, pin_memory=True)
pid = os.fork()
if pid == 0:
    try:
        q.numpy()[0] = 42
    finally:
        os._exit(0)
os.waitpid(pid, 0)
print(json.dumps({"pinned_shared_after_fork": int(q[0])}))
