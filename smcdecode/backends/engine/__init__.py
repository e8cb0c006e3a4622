"""The GPU engine: native Llama-family models over a paged, particle-shared KV cache, with
Triton attention and CUDA-graph rounds. See docs/engine.md."""

from .attention import PagedBatch, paged_attention, reference_paged_attention
from .engine import Engine, EngineOutput, sample_exponential_race
from .kv_cache import KVPool, PageTable
from .model import PRESETS, Llama, LlamaConfig
from .scheduler import Finished, Request, Scheduler
from .smc import EngineTarget

__all__ = ["Engine", "EngineOutput", "EngineTarget", "Finished", "KVPool", "Llama", "LlamaConfig", "PRESETS",
           "PageTable", "PagedBatch", "Request", "Scheduler", "paged_attention", "reference_paged_attention",
           "sample_exponential_race"]
