"""A kernel that makes the device wait for the host: the engine's round with host masks is launched
whole (one CUDA graph) and, at each host point, waits inside the graph until the host has written
that step's masks (``host_masks.HostMasks``: the host then raises a counter in pinned memory).

The counter ``posted`` lives in pinned host memory (int64 [2]: the host's count of points, then a
word the kernel sets when it gave up); ``seen`` (int64 [1], on the device) counts the points the
device has passed. The kernel waits until posted > seen, polling ``posted`` with volatile loads
(each reads host memory over the bus), then raises ``seen``. It has no torch reference (torch cannot
wait on the host inside a stream); tests/test_engine_kernels.py checks it on the GPU.

Should the host not post for ``GIVE_UP_S`` seconds (a process stopped between points), the kernel
gives up, sets posted[1] and lets the round go on; the host reads that word after each round's
points and raises (``HostMasks.serve``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import globaltimer

GIVE_UP_S = 60  # seconds the kernel waits at most (by the GPU's global timer, in ns)


@triton.jit
def _wait_kernel(posted_ptr, seen_ptr, LIMIT_NS: tl.constexpr):
    target = tl.load(seen_ptr) + 1
    posted = tl.load(posted_ptr, volatile=True)
    start = globaltimer()
    while (posted < target) & (globaltimer() - start < LIMIT_NS):
        posted = tl.load(posted_ptr, volatile=True)
    tl.store(seen_ptr, target)
    if posted < target:
        tl.store(posted_ptr + 1, 1)


def wait_for_host(posted: Tensor, seen: Tensor, give_up_s: float = GIVE_UP_S) -> None:
    """Enqueue a wait of the current stream until ``posted[0]`` (pinned int64 [2] on the host) exceeds
    ``seen[0]`` (int64 [1] on the device), then ``seen[0]`` += 1 (captured into a graph, each replay
    waits for the next count)."""
    if posted.device.type != "cpu" or not posted.is_pinned() or posted.dtype != torch.int64 or posted.numel() < 2:
        raise ValueError("posted must be a pinned int64 CPU tensor of at least 2 elements")
    if seen.device.type != "cuda" or seen.dtype != torch.int64:
        raise ValueError("seen must be an int64 CUDA tensor")
    _wait_kernel[(1,)](posted, seen, LIMIT_NS=int(give_up_s * 1e9), num_warps=1)

