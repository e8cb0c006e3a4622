"""Triton kernels of the engine, by kind. Each has a pure-torch reference (named in its docstring)
and a test against it: on the GPU (tests/test_engine_kernels.py) and on the CPU in Triton's
interpreter (tests/test_engine_ops.py); the references run the CPU tests.

    common     programmatic dependent launch (PDL), SM count, split counters, dot precision
    attention  paged attention (split-KV), fused with RoPE and the KV-page write for decode/verify
    norms      add + RMSNorm, embedding + RMSNorm, SiLU·mul, RoPE + KV-page write
    linear     skinny products (few rows), split-K, SiLU·mul and folded-norm epilogues
    sampling   exponential-race sampling with log-sum-exp and gathered log-probs
    pages      copy-on-write page copies

Tile sizes and the choice between measured variants are module constants (``ATTN_CONFIGS``,
``TNORM_CONFIG``, ``SPLITK_CONFIGS``, ...); the launchers take an explicit ``config`` where a test
exercises other tiles. Importing this package needs triton.
"""

from .attention import merge_splits_reference, triton_paged_attention, triton_rope_paged_attention
from .common import pdl_enabled, pdl_mode, pdl_off
from .linear import skinny_config, skinny_wins, splitk_config, triton_skinny_linear, triton_skinny_linear_add_norm
from .norms import triton_add_rms_norm, triton_embed_rms_norm, triton_rope_kv_write, triton_silu_mul
from .pages import triton_copy_pages
from .sampling import triton_sample_and_score

__all__ = ["merge_splits_reference", "pdl_enabled", "pdl_mode", "pdl_off", "skinny_config", "skinny_wins",
           "splitk_config", "triton_add_rms_norm", "triton_copy_pages", "triton_embed_rms_norm",
           "triton_paged_attention", "triton_rope_kv_write", "triton_rope_paged_attention", "triton_sample_and_score",
           "triton_silu_mul", "triton_skinny_linear", "triton_skinny_linear_add_norm"]
