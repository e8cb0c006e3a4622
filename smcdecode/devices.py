"""Where models run: the device, the dtype and torch's CPU threads, checked with clear errors."""

from __future__ import annotations

import os

import torch

from .errors import SMCDecodeError


def check_device(device, name: str = "device") -> torch.device:
    """``device`` as a torch.device that this machine can use, or an SMCDecodeError that says why
    not and what to pass instead (a malformed string, a GPU that torch cannot see, a missing index)."""
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device.strip())
        except (RuntimeError, ValueError):
            raise SMCDecodeError(
                f"{name} {device!r} is not a torch device: use 'cpu', 'cuda' or 'cuda:N' (or 'mps' on a Mac)"
            ) from None
    else:
        raise SMCDecodeError(
            f"{name} must be a string such as 'cpu' or 'cuda:0' (or a torch.device), got {type(device).__name__} {device!r}"
        )
    if dev.type == "cpu":
        return dev
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise SMCDecodeError(
            f"{name} 'mps' is not available (torch.backends.mps.is_available() is False; MPS needs a Mac with "
            "Apple silicon and a torch build for it): use 'cpu'"
        )
    if dev.type == "meta":
        raise SMCDecodeError(f"{name} 'meta' holds no weights, so a model cannot run there: use 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "torch sees no CUDA GPU"
            raise SMCDecodeError(
                f"{name} {str(dev)!r} is not available: {why} (torch {torch.__version__}, "
                "torch.cuda.is_available() is False): use 'cpu', or on a machine with an NVIDIA GPU install a "
                "CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise SMCDecodeError(
                f"{name} {str(dev)!r} does not exist: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
        return dev
    try:
        torch.empty(1, device=dev)
    except Exception as e:  # noqa: BLE001 - each backend fails in its own way (AssertionError, NotImplementedError...)
        raise SMCDecodeError(
            f"{name} {str(dev)!r} is not available in this torch build ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:100] if str(e) else 'no support'}): use 'cpu' or 'cuda'"
        ) from None
    return dev


def check_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None) if dtype.isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            dtype = None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SMCDecodeError(f"dtype must be a floating-point torch dtype, got {dtype!r}: use float32, bfloat16 or float16")
    return dtype


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask): torch's default thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_cpu_threads() -> int:
    """The thread count smcdecode picks when nobody chose one: half the usable CPUs, at least 1.

    On a 2-core machine (benchmarks/cpu_threads.py; docs/cli.md) the README job sampled 2.5-2.9x
    faster with 1 thread than with 2 whenever another process wanted a core, and 1.3x slower on an
    idle machine: torch's threads wait on each other, and one descheduled thread stalls them all.
    Half the CPUs keeps that margin on larger machines (measured on 2 CPUs only)."""
    return max(1, usable_cpus() // 2)


# NOTE: torch's thread count is process-wide; this records the count smcdecode itself set, so a later
# load_model() without ``threads`` keeps it rather than taking it for torch's untouched default.
_threads_set: int | None = None


def set_cpu_threads(threads: int | None = None) -> int:
    """Set torch's CPU threads for the models and return the count in effect.

    ``threads`` given: that many. ``None``: keep a count already chosen (``OMP_NUM_THREADS`` or
    ``MKL_NUM_THREADS`` set, an earlier ``threads=``, or ``torch.set_num_threads`` called with a
    count other than torch's default, the usable CPUs), else :func:`default_cpu_threads`. To run
    with torch's own default, pass ``threads=usable_cpus()``."""
    global _threads_set
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise SMCDecodeError(f"threads must be a positive integer (CPU threads for torch), got {threads!r}")
        torch.set_num_threads(threads)
        _threads_set = threads
        return threads
    current = torch.get_num_threads()
    chosen = any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    if not chosen and current != _threads_set and current == usable_cpus():
        _threads_set = default_cpu_threads()
        torch.set_num_threads(_threads_set)
    return torch.get_num_threads()
