"""The engine's settings: one frozen :class:`EngineConfig` per :class:`~.engine.Engine`.

Everything a user may choose about how the engine runs lives here; the kernels' tile sizes and the
choices between measured variants are module constants of ``kernels/`` and ``ops.py``. The config is
part of the key of every captured CUDA graph, so a graph never replays under other settings.

``backend="engine"`` takes the same settings as ``engine_options`` (``dtype``, ``device``,
``page_size``, ``num_pages``, ``use_graphs``, ``host_workers``; see :func:`check_options`). The one environment
variable is ``SMCDECODE_TRITON=0``, which makes ``triton=None`` (the default) mean the torch
references everywhere; it is read when a config is resolved, never by the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from ...errors import SMCDecodeError
from .mask_workers import check_workers, default_workers

OPTIONS = ("dtype", "device", "page_size", "num_pages", "use_graphs", "host_workers")


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_triton(device: torch.device | str) -> bool:
    """Whether the Triton kernels run by default on ``device``: on CUDA when triton imports, unless
    SMCDECODE_TRITON=0 (the torch references everywhere: for comparisons)."""
    return (torch.device(device).type == "cuda" and os.environ.get("SMCDECODE_TRITON", "1") != "0"
            and triton_importable())


@dataclass(frozen=True)
class EngineConfig:
    """How an :class:`~.engine.Engine` runs.

    num_pages    KV pages of each pool (target and draft); page 0 is the null page, never handed out.
    page_size    tokens per KV page.
    max_context  positions a row may reach (prompt + output + one block); fixes the page-table width,
                 so kernel launch shapes, and thus compiled kernels and captured graphs, do not
                 depend on each call's lengths. None: sized per call.
    use_graphs   capture each round as a CUDA graph (the default for calls that pass None);
                 None: on CUDA only.
    triton       run the Triton kernels (on CUDA; forced True elsewhere they run in Triton's
                 interpreter, TRITON_INTERPRET=1); None: ``default_triton(device)``.
    dtype        the models' dtype; None: the target model's.
    device       the models' device; None: the target model's.
    host_workers processes that hold the matchers of constraints on llguidance's path and compute
                 their masks (mask_workers.py); 0: in the engine's process. None: one per four
                 cores, at most 8, on a GPU host of 8 or more cores; 0 on a CPU.

    ``resolved(...)`` fills every None from the models, so an Engine's config states what it runs."""

    num_pages: int
    page_size: int = 16
    max_context: int | None = None
    use_graphs: bool | None = None
    triton: bool | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    host_workers: int | None = None

    def __post_init__(self):
        _check_int("page_size", self.page_size, 1, "tokens per KV page, e.g. 16")
        _check_int("num_pages", self.num_pages, 2, "KV pages of each pool, the null page included")
        if self.max_context is not None:
            _check_int("max_context", self.max_context, 1, "positions a row may reach, e.g. 4096")
        for name in ("use_graphs", "triton"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise SMCDecodeError(f"engine option {name} must be True, False or None, got {v!r}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.device is not None:
            object.__setattr__(self, "device", parse_device(self.device))
        check_workers(self.host_workers)

    def resolved(self, dtype: torch.dtype, device: torch.device) -> EngineConfig:
        """This config with dtype, device, use_graphs and triton filled in for models of ``dtype`` on
        ``device``; an error if the config names another dtype or device than the models'."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for name, want, have in (("dtype", self.dtype, dtype), ("device", self.device, device)):
            if want is not None and _canonical(want) != _canonical(have):
                raise SMCDecodeError(f"engine {name} {want} differs from the models' ({have}): convert the models "
                                     f"(Llama.from_hf(..., {name}=...)) or drop the {name} setting")
        return dataclasses.replace(
            self, dtype=dtype, device=device,
            use_graphs=device.type == "cuda" if self.use_graphs is None else self.use_graphs,
            host_workers=default_workers(device) if self.host_workers is None else self.host_workers,
            triton=default_triton(device) if self.triton is None else self.triton)

    @classmethod
    def from_options(cls, options: dict, rows: int, context: int) -> EngineConfig:
        """The config of ``engine_options`` (checked by :func:`check_options`) for ``rows`` sequences of
        ``context`` positions: the context rounded up to a power of two (few distinct graph shapes) and,
        unless given, enough pages for every row."""
        page_size = options.get("page_size", 16)
        context = max(64, 1 << (context - 1).bit_length())
        pages = options.get("num_pages", rows * (context // page_size + 2) + 16)
        return cls(num_pages=pages, page_size=page_size, max_context=context, use_graphs=options.get("use_graphs"),
                   dtype=options.get("dtype"), device=options.get("device"), host_workers=options.get("host_workers"))


def check_options(options: dict | None, allowed: tuple[str, ...] = OPTIONS, backend: str = "engine") -> dict:
    """``engine_options`` checked: names among ``allowed``, values of the right kind (an SMCDecodeError
    that names the option, the value and the fix)."""
    options = dict(options or {})
    bad = sorted(set(options) - set(allowed))
    if bad:
        raise SMCDecodeError(f"unknown engine option(s) {bad}: backend={backend!r} takes {list(allowed)}")
    if "page_size" in options:
        _check_int("page_size", options["page_size"], 1, "tokens per KV page, e.g. 16")
    if "num_pages" in options:
        _check_int("num_pages", options["num_pages"], 2, "KV pages of each pool, the null page included")
    if options.get("use_graphs") is not None and not isinstance(options["use_graphs"], bool):
        raise SMCDecodeError(f"engine option use_graphs must be True, False or None, got {options['use_graphs']!r}")
    check_workers(options.get("host_workers"))
    if options.get("dtype") is not None:
        parse_dtype(options["dtype"])
    if options.get("device") is not None:
        parse_device(options["device"])
    return options


def parse_dtype(value) -> torch.dtype:
    """A torch dtype, or its name ("bfloat16", "float32", ...)."""
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SMCDecodeError(f"engine option dtype must be a floating-point torch dtype or its name "
                             f"('bfloat16', 'float16', 'float32'), got {value!r}")
    return dtype


def parse_device(value) -> torch.device:
    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        raise SMCDecodeError(f"engine option device must name a torch device ('cuda', 'cuda:1', 'cpu'), "
                             f"got {value!r}") from None


def _check_int(name: str, value, least: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise SMCDecodeError(f"engine option {name} must be {kind} ({what}), got {value!r}")


def _canonical(x) -> str:
    if isinstance(x, torch.device) and x.type == "cuda" and x.index is None:
        x = torch.device("cuda", torch.cuda.current_device())
    return str(x)
