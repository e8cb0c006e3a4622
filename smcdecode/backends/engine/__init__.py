"""The GPU engine: native Llama-family models over a paged, particle-shared KV cache, with
Triton kernels and CUDA-graph rounds. See docs/engine.md; the layout is in engine.py's docstring."""

from .attention import PagedBatch, paged_attention, reference_paged_attention
from .config import EngineConfig
from .engine import Engine
from .kv_cache import KVPool, PageTable
from .model import PRESETS, Llama, LlamaConfig
from .output import EngineOutput
from .scheduler import Finished, Request, Scheduler
from .targets import EngineTarget

__all__ = ["Engine", "EngineConfig", "EngineOutput", "EngineTarget", "Finished", "KVPool", "Llama", "LlamaConfig",
           "PRESETS", "PageTable", "PagedBatch", "Request", "Scheduler", "paged_attention",
           "reference_paged_attention"]
