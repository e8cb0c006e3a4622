"""A host buffer's physical contiguity (from /proc/self/pagemap: needs root) and the time of a copy from
it to the device (CUDA events, median and 90th percentile in µs)."""
import struct

import torch


def runs(addr: int, n: int) -> tuple:
    """(every page present, runs of consecutive physical frames, 2 MiB frames touched, first frame) of
    the ``n`` bytes at ``addr``."""
    with open("/proc/self/pagemap", "rb") as pm:
        pm.seek((addr // 4096) * 8)
        data = pm.read(8 * ((n + 4095) // 4096))
    entries = [struct.unpack_from("<Q", data, 8 * i)[0] for i in range(len(data) // 8)]
    frames = [e & ((1 << 55) - 1) for e in entries]
    contiguous = sum(1 for a, b in zip(frames, frames[1:]) if b != a + 1)
    return (all(e >> 63 for e in entries), 1 + contiguous, len({f >> 9 for f in frames}),
            frames[0] if frames else 0)


def time_copy(src, dst, reps: int = 60) -> list:
    """[median, 90th percentile] µs of ``dst.copy_(src, non_blocking=True)`` over ``reps`` copies."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) * 1e3 for a, b in events)
    return [t[len(t) // 2], t[int(0.9 * len(t))]]
