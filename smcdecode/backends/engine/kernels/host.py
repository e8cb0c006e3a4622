"""A kernel that makes the device wait for the host: the engine's round with host masks is launched
whole (one CUDA graph) and, at each host point, waits inside the graph until the host has written
that step's masks (``host_masks.HostMasks``: the host then raises a counter in pinned memory).

The counter ``posted`` lives in pinned host memory (int64: the host's count of points, then a
word the kernel sets when it gave up; where the mask workers serve a round, each worker's count a
line further on); ``seen`` (int64 [1], on the device) counts the points the device has passed. The
kernel waits until every count exceeds seen, polling them with volatile loads (each reads host memory
over the bus), then raises ``seen``. ``hand_over`` writes a drafted column into host memory and then,
behind a system-wide fence, the device's count into a flag the workers watch. It has no torch reference (torch cannot
wait on the host inside a stream); tests/test_engine_kernels.py checks it on the GPU.

A kernel's first launch in a process loads its module, which waits for the device: each is launched
once while every wait passes (the round's capture, ``HostMasks.open_gate``) before a wait can hold the
device.

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
def _wait_kernel(posted_ptr, seen_ptr, LIMIT_NS: tl.constexpr, PARTIES: tl.constexpr, BLOCK: tl.constexpr,
                 STRIDE: tl.constexpr):
    target = tl.load(seen_ptr) + 1
    j = tl.arange(0, BLOCK)
    at, live = posted_ptr + j * STRIDE, j < PARTIES
    low = tl.min(tl.load(at, mask=live, other=target, volatile=True), axis=0)
    # the time waited, summed from the global timer's steps, each counted as 1 ms at most (a poll takes
    # about 1 µs): a jump of the timer cannot end a wait early
    before = globaltimer()
    waited = before - before
    while (low < target) & (waited < LIMIT_NS):
        low = tl.min(tl.load(at, mask=live, other=target, volatile=True), axis=0)
        now = globaltimer()
        waited += tl.minimum(tl.maximum(now - before, 0), 1000000)
        before = now
    tl.store(seen_ptr, target)
    if low < target:
        tl.store(posted_ptr + 1, 1)


def wait_for_host(posted: Tensor, seen: Tensor, give_up_s: float = GIVE_UP_S, parties: int = 1, stride: int = 8) -> None:
    """Enqueue a wait of the current stream until ``posted[0]`` (pinned int64 on the host) exceeds
    ``seen[0]`` (int64 [1] on the device), then ``seen[0]`` += 1 (captured into a graph, each replay
    waits for the next count). With ``parties`` > 1, until every count ``posted[p · stride]``
    (p < parties) exceeds it: the engine's process's and each mask worker's (a round the workers
    serve). Giving up sets ``posted[1]``."""
    if posted.device.type != "cpu" or not posted.is_pinned() or posted.dtype != torch.int64 or posted.numel() < 2:
        raise ValueError("posted must be a pinned int64 CPU tensor of at least 2 elements")
    if parties < 1 or (parties - 1) * stride >= posted.numel():
        raise ValueError(f"{parties} parties' counts every {stride} words do not fit posted's {posted.numel()}")
    if seen.device.type != "cuda" or seen.dtype != torch.int64:
        raise ValueError("seen must be an int64 CUDA tensor")
    _wait_kernel[(1,)](posted, seen, LIMIT_NS=int(give_up_s * 1e9), PARTIES=parties,
                       BLOCK=max(2, triton.next_power_of_2(parties)), STRIDE=stride, num_warps=1)


@triton.jit
def _hand_over_kernel(tokens_ptr, out_ptr, flag_ptr, seen_ptr, n, BLOCK: tl.constexpr):
    j = tl.arange(0, BLOCK)
    live = j < n
    tl.store(out_ptr + j, tl.load(tokens_ptr + j, mask=live), mask=live)
    # each thread's stores ordered before the flag for every observer (the host's processes), then the
    # flag: the device's count of points passed, which names this round's column
    count = tl.load(seen_ptr) + tl.zeros([BLOCK], dtype=tl.int64)
    count = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [count], dtype=tl.int64,
                                      is_pure=False, pack=1)
    tl.debug_barrier()
    count = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [count], dtype=tl.int64,
                                      is_pure=False, pack=1)
    tl.store(flag_ptr + j, count, mask=j == 0)


def hand_over(tokens: Tensor, out: Tensor, flag: Tensor, seen: Tensor) -> None:
    """Enqueue: ``out[:n] = tokens`` (int64 [n] on the device; ``out`` in host memory the device
    writes), then ``flag[0] = seen[0]`` once those stores are visible to the host (a system-wide
    fence): the host's processes that watch ``flag`` read the column without waiting on an event."""
    n = tokens.shape[0]
    if tokens.dtype != torch.int64 or out.dtype != torch.int64 or flag.dtype != torch.int64 or out.numel() < n:
        raise ValueError("hand_over takes int64 tokens, and int64 out (at least as long) and flag")
    _hand_over_kernel[(1,)](tokens, out, flag, seen, n, BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)
