"""What the engine's kernels share: programmatic dependent launch (PDL), the SM count, the split
counters of kernels whose last program merges the others' partials, the dot-product precision and a
folded norm's row scale."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

try:  # grid dependency control (programmatic dependent launch; Triton >= 3.3, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off (pdl_mode() returns 0)
    gdc_launch_dependents = gdc_wait = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL)
#
# In a CUDA graph a chain of small dependent kernels (a draft step: ~7 launches a layer) pays each
# launch's set-up and ramp before any work starts. With PDL a kernel is launched while the one before
# it still runs and waits (griddepcontrol.wait) before it reads or writes anything; every Triton
# kernel of the engine takes PDL (0: off; 1: wait, then release the next kernel at once). Kernels
# that are not ours (cuBLAS, torch) are launched normally and wait for full completion, so mixing is
# safe. An L2 prefetch of the skinny product's weights before the wait measured slower.


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # everything the earlier kernels wrote is visible after this
        gdc_launch_dependents()  # the next kernel may start (it waits likewise before it reads)


@functools.lru_cache(maxsize=8)
def _pdl_capable(device_index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


_PDL_OFF = [0]  # depth of ``pdl_off()`` contexts


@contextlib.contextmanager
def pdl_off():
    """Kernels launched (and captured) within it do not take PDL: ``Engine.autoregressive`` and
    ``Engine.speculative`` run in it (PDL measured slower for autoregressive decoding)."""
    _PDL_OFF[0] += 1
    try:
        yield
    finally:
        _PDL_OFF[0] -= 1


def pdl_enabled() -> bool:
    """Whether kernels launched now take PDL where the device allows it: yes, except inside
    ``pdl_off()``."""
    return not _PDL_OFF[0]


def pdl_mode(device: torch.device) -> int:
    """The PDL constexpr of a launch on ``device``: 1 (wait for the previous kernel, then release the
    next one) where ``pdl_enabled()``, on sm_90+ (Hopper) with a Triton that has grid dependency
    control; 0 on the CPU, under Triton's interpreter, before sm_90 and inside ``pdl_off()``.
    Measured on an H200 (interleaved, 1,024-token outputs): SMC-SD N=8 K=8 0.07 ms a round faster
    with it at 1 request and 0.05-0.10 ms at 8; autoregressive decoding 0.07 ms a token slower."""
    if not pdl_enabled() or device.type != "cuda" or INTERPRET or not _pdl_capable(device.index or 0):
        return 0
    return 1


def pdl_args(device: torch.device) -> dict:
    """Launch keywords of a kernel taking PDL: {"PDL": mode} and, when on, Triton's launch_pdl."""
    mode = pdl_mode(device)
    return {"PDL": mode, "launch_pdl": True} if mode else {}


@triton.jit
def row_rstd(SS, rows, rows_ok, stride_ss, eps, T: tl.constexpr, T_P2: tl.constexpr, DIM: tl.constexpr):
    """1 / rms of the residual-stream rows ``rows`` from their float32 partial sums of squares
    SS[row, t] over T column blocks (a folded norm's ``sumsq``, written by the skinny product's
    RESID epilogue; a row's T partials are contiguous, one vector load): rsqrt(Σ_t SS[row, t] / DIM
    + eps). Reference: ops.Normed.rstd."""
    t = tl.arange(0, T_P2)
    s = tl.load(SS + rows[:, None] * stride_ss + t[None, :], mask=(t[None, :] < T) & rows_ok[:, None], other=0.0)
    return 1.0 / tl.sqrt(tl.sum(s, 1) / DIM + eps)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_COUNTERS: dict = {}


def split_counters(device: torch.device, n: int, kind: str = "attn") -> Tensor | None:
    """A zeroed int32 buffer of >= n counters, kept for the process (each merging program resets its
    counter, so it stays zero between launches), one per ``kind`` of kernel. None when it would have
    to be allocated inside a CUDA-graph capture (the caller then merges some other way)."""
    key = (device, kind)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for operands of ``dtype``: float32 operands are multiplied in
    full float32 ("ieee") unless torch allows TF32 for float32 products
    (``torch.backends.cuda.matmul.allow_tf32``), as torch's own products are; bf16/fp16 operands
    ignore it ("tf32", Triton's default). With TF32 float32 products a float32 engine differs from
    the float32 HF reference by ~3·10⁻³ in the logits of the runner tests' model (docs/engine.md)."""
    return "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


def rowscale_args(rowscale, ss_name: str = "SS") -> dict:
    """Kernel arguments of a row scale (sumsq [rows, T] float32, eps, dim): see ``row_rstd``."""
    if rowscale is None:
        return {}
    ss, eps, dim = rowscale
    if ss.dtype != torch.float32 or ss.dim() != 2 or ss.stride(1) != 1:
        raise ValueError(f"sumsq: expected float32 partial sums [rows, T], contiguous in T, got "
                         f"{ss.dtype} {tuple(ss.shape)} strides {ss.stride()}")
    return {ss_name: ss, "stride_ss": ss.stride(0), "rs_eps": float(eps), "RS_T": ss.shape[1],
            "RS_TP2": max(2, triton.next_power_of_2(ss.shape[1])), "RS_DIM": dim}
