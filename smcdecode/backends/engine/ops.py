"""The layer operations of the Llama forward: each a torch reference and, with ``triton``, its Triton
kernel (kernels/): residual add + RMSNorm, RoPE + KV-page write, paged attention, SiLU·mul, and the
weight products (cuBLAS, cuBLASLt, W·xᵀ, the skinny and split-K kernels) by measured shape, with
the RMSNorms after wo and w2 folded into those products where that measured faster (``Normed``).

``triton`` is the KV pool's choice (``KVPool.triton``, from the engine's ``EngineConfig``); every
other choice here is a module constant chosen by measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import paged_attention


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, L, h, D]; cos/sin: [B, L, 1, D/2]  (HF's rotate-half convention)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h)) with h = x + delta (the residual stream after a block's branch)."""
    h = x if delta is None else x + delta
    return h, rms_norm(h, weight, eps)


def rope_kv_write_reference(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor,
                            v_pool: Tensor, pages: Tensor, offsets: Tensor, H: int, Hkv: int) -> Tensor:
    """Split the fused projection [B, L, (H + 2Hkv)·D], rotate q and k (tables cos/sin [max_pos, D/2]),
    write k and v into pools [num_pages, Hkv, PS, D] at (pages, offsets) [B·L]; return q [B, L, H, D]."""
    B, L, _ = qkv.shape
    D = k_pool.shape[-1]
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    c, s = cos[positions][:, :, None], sin[positions][:, :, None]  # [B, L, 1, D/2]
    q = apply_rope(q.reshape(B, L, H, D), c, s)
    k = apply_rope(k.reshape(B, L, Hkv, D), c, s)
    # NOTE: (page, offset) pairs must be distinct
    k_pool[pages, :, offsets] = k.reshape(-1, Hkv, D)
    v_pool[pages, :, offsets] = v.reshape(-1, Hkv, D)
    return q


def silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class SplitSum:
    """A product's float32 partial sums over K splits, ``parts`` [S, ..., N], not yet added up: the
    next residual add + RMSNorm adds them (one launch fewer than a split-K reduce; see
    ``linear_to_residual``). ``total`` is the product itself (the reference)."""

    parts: Tensor

    def total(self, dtype: torch.dtype) -> Tensor:
        return self.parts.sum(0).to(dtype)

    def __getitem__(self, idx) -> SplitSum:  # indexes the product's own dims, e.g. s[:, -1:]
        return SplitSum(self.parts[(slice(None), *(idx if isinstance(idx, tuple) else (idx,)))])


@dataclass
class Normed:
    """The residual stream after a product was added, with the next RMSNorm folded into that
    product's epilogue instead of a launch of its own: ``h`` the stream, ``gh`` = γ ⊙ h (rounded;
    the input of the norm's products) and ``sumsq`` [rows, T] float32, partial sums of h² over T
    column blocks. rms_norm(h) · Wᵀ = rstd · (γ ⊙ h) · Wᵀ row by row, so the products take ``gh``
    and their consumers scale the rows by ``rstd`` (the attention kernel, SiLU·mul)."""

    h: Tensor
    gh: Tensor
    sumsq: Tensor | None  # None: ``gh`` is rms_norm(h) itself (no row scale left to apply)
    eps: float

    def rstd(self) -> Tensor:
        """1 / rms(h) of each row, float32 [rows] (reference of kernels.common.row_rstd)."""
        return torch.rsqrt(self.sumsq.sum(-1) / self.h.shape[-1] + self.eps)

    def rowscale(self) -> tuple[Tensor, float, int]:
        """The kernels' form: (sumsq, eps, dim)."""
        return self.sumsq, self.eps, self.h.shape[-1]

    def scale(self, y: Tensor) -> Tensor:
        """y [..., n] (a product of ``gh``, same rows) with each row times rstd, in y's dtype."""
        return (y.float() * self.rstd().reshape(*y.shape[:-1], 1)).to(y.dtype)


def linear_add_norm_reference(x: Tensor, weight: Tensor, resid: Tensor, gamma: Tensor, eps: float) -> Normed:
    """resid + x · Wᵀ as a ``Normed`` for the RMSNorm of weight ``gamma`` (one column block)."""
    h = resid + F.linear(x, weight)
    hf = h.float()
    return Normed(h, (hf * gamma.float()).to(h.dtype), hf.pow(2).sum(-1).reshape(-1, 1), eps)


def add_rms_norm(x: Tensor, delta: Tensor | SplitSum | None, weight: Tensor, eps: float, triton: bool = False
                 ) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h)) with h = x + delta; ``triton``: one launch (kernels.triton_add_rms_norm)."""
    split = isinstance(delta, SplitSum)
    if triton:
        from .kernels.norms import triton_add_rms_norm

        if split:
            return triton_add_rms_norm(x, None, weight, eps, parts=delta.parts)
        return triton_add_rms_norm(x, delta, weight, eps)
    return add_rms_norm_reference(x, delta.total(x.dtype) if split else delta, weight, eps)


def embed_norm(tokens: Tensor, table: Tensor, weight: Tensor, eps: float, triton: bool = False) -> Tensor | Normed:
    """The embedding lookup of ``tokens``; with ``triton``, with the first layer's RMSNorm (weight
    ``weight``) in the same launch, as a ``Normed`` without a row scale (kernels.triton_embed_rms_norm)."""
    if triton:
        from .kernels.norms import triton_embed_rms_norm

        return Normed(*triton_embed_rms_norm(tokens, table, weight, eps), None, eps)
    return F.embedding(tokens, table)


def rope_kv_write(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                  pages: Tensor, offsets: Tensor, H: int, Hkv: int, triton: bool = False) -> Tensor:
    if triton:
        from .kernels.norms import triton_rope_kv_write

        return triton_rope_kv_write(qkv.contiguous(), positions.reshape(-1), cos, sin, k_pool, v_pool, pages,
                                    offsets, H, Hkv)
    return rope_kv_write_reference(qkv, positions, cos, sin, k_pool, v_pool, pages, offsets, H, Hkv)


def rope_attention(qkv: Tensor, batch, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor, H: int, Hkv: int,
                   triton: bool = False, normed: Normed | None = None) -> Tensor:
    """RoPE on the fused projection qkv [B, L, (H + 2Hkv)·D], the new keys/values written to the
    pools, and paged attention of the L new queries of each row -> [B, L, H, D].

    With ``triton``, for L <= 16 (decode and verify) and D >= 32, one kernel does all three
    (``kernels.triton_rope_paged_attention``); otherwise the RoPE + KV-write step and the attention
    run separately (reference: rope_kv_write_reference, then attention.reference_paged_attention).
    ``normed``: qkv is the product of a folded norm's γ ⊙ h, its rows still to be scaled by
    1 / rms(h) (done in the fused kernel, else first)."""
    L, D = qkv.shape[1], k_pool.shape[-1]
    if triton and L <= 16 and D >= 32:
        from .kernels.attention import triton_rope_paged_attention

        return triton_rope_paged_attention(qkv, cos, sin, k_pool, v_pool, batch, H,
                                           rowscale=normed.rowscale() if normed is not None else None)
    if normed is not None:
        qkv = normed.scale(qkv)
    q = rope_kv_write(qkv, batch.positions, cos, sin, k_pool, v_pool, batch.slot_pages, batch.slot_offsets, H, Hkv,
                      triton)
    return paged_attention(q, k_pool, v_pool, batch, backend="triton" if triton else "torch")


def fused_silu_mul(gate_up: Tensor, normed: Normed | None = None, triton: bool = False) -> Tensor:
    if triton:
        from .kernels.norms import triton_silu_mul

        return triton_silu_mul(gate_up.contiguous(), rowscale=normed.rowscale() if normed is not None else None)
    return silu_mul(gate_up if normed is None else normed.scale(gate_up))


def use_skinny(x: Tensor, weight: Tensor, triton: bool, silu: bool = False) -> bool:
    """The Triton skinny product (kernels.triton_skinny_linear) where it measured faster than cuBLAS
    (kernels.skinny_wins: few rows, some shapes)."""
    if not triton or x.dtype != weight.dtype or weight.dtype not in (torch.bfloat16, torch.float16):
        return False  # (float32 stays on cuBLAS: tl.dot would round its inputs to tf32)
    from .kernels.linear import skinny_wins

    N, K = weight.shape
    return skinny_wins(x.numel() // K, N // 2 if silu else N, K, weight.numel() * weight.element_size(), silu)


# Products where cuBLASLt measured faster than cuBLAS (both through torch; H200, bf16, every layer's
# own weights, CUDA-graph replay): (rows, N, K), with µs for all layers, cuBLAS -> cuBLASLt.
CUBLASLT_SHAPES = {
    (72, 4096, 14336),  # 8B w2 in the verify pass of 8 particles × 9 tokens: 1,144 -> 1,034
    (576, 4096, 4096),  # 8B wo, verify pass of 8 requests: 1,014 -> 900
    (576, 128256, 4096),  # 8B head, the same: 1,051 -> 934
    (128, 2048, 8192),  # 1B w2, first draft step of 8 requests (2 tokens a particle): 277 -> 254
}


def cublaslt_wins(M: int, N: int, K: int, capability: tuple[int, int]) -> bool:
    """Whether an [M, K] · [N, K]ᵀ product goes to cuBLASLt: the measured shapes of
    ``CUBLASLT_SHAPES`` on Hopper (sm_90, where they were measured)."""
    return capability[0] == 9 and (M, N, K) in CUBLASLT_SHAPES


def dense(x: Tensor, layer: nn.Linear) -> Tensor:
    """``layer(x)`` through torch's BLAS: cuBLASLt where ``cublaslt_wins``, else the default library."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        N, K = layer.weight.shape
        if cublaslt_wins(x.numel() // K, N, K, torch.cuda.get_device_capability(x.device)):
            prev = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                return layer(x)
            finally:
                torch.backends.cuda.preferred_blas_library(prev)
    return layer(x)


def linear(x: Tensor, layer: nn.Linear, triton: bool = False) -> Tensor:
    if layer.bias is None and use_skinny(x, layer.weight, triton):
        from .kernels.linear import triton_skinny_linear

        return triton_skinny_linear(x, layer.weight)
    return dense(x, layer)


def split_config(x: Tensor, weight: Tensor, triton: bool, rows: int | None = None):
    """(skinny config, K splits) where a product feeding a residual add + RMSNorm runs split-K on the
    skinny kernel (kernels.splitk_config: few rows), else None. ``rows``: of the product (default:
    x's)."""
    if not triton or x.dtype != weight.dtype or weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    from .kernels.linear import splitk_config

    N, K = weight.shape
    return splitk_config(x.numel() // K if rows is None else rows, N, K, x.device)


# Products read only by the next residual add + RMSNorm where cuBLAS on the transposed problem W · xᵀ
# measured faster than x · Wᵀ by either library (H200: µs for all layers, cuBLAS -> transposed):
# (rows, N, K).
TRANSPOSED_SHAPES = {
    (576, 4096, 14336),  # 8B w2, verify pass of 8 requests × 8 particles × 9 tokens: 3,373 -> 3,155
}


def transposed_wins(M: int, N: int, K: int, capability: tuple[int, int]) -> bool:
    """Whether ``linear_to_residual`` runs [M, K] · [N, K]ᵀ as W · xᵀ (its output then transposed in
    memory, which the add + RMSNorm reads as such): the measured shapes of ``TRANSPOSED_SHAPES`` on
    Hopper (sm_90)."""
    return capability[0] == 9 and (M, N, K) in TRANSPOSED_SHAPES


def linear_to_residual(x: Tensor, layer: nn.Linear, triton: bool = False) -> Tensor | SplitSum:
    """``linear`` for a product whose only reader is the next residual add + RMSNorm (a block's wo and
    w2): at few rows its K is split over more programs (the 1B's 2048-column products have only 64
    column blocks of 32 for 132 SMs) and the float32 partials go to the norm as a ``SplitSum``; where
    ``transposed_wins`` it is computed as W · xᵀ and returned as the transposed view of that (unit
    stride between rows), which ``kernels.triton_add_rms_norm`` reads without a copy."""
    if layer.bias is None:
        cfg = split_config(x, layer.weight, triton)
        if cfg is not None:
            from .kernels.linear import triton_skinny_linear

            y = triton_skinny_linear(x, layer.weight, config=cfg[0], split=cfg[1])
            return SplitSum(y) if y.dim() == x.dim() + 1 else y
        N, K = layer.weight.shape
        if (triton and x.is_cuda and x.dtype == layer.weight.dtype and not use_skinny(x, layer.weight, triton)
                and transposed_wins(x.numel() // K, N, K, torch.cuda.get_device_capability(x.device))):
            return torch.mm(layer.weight, x.reshape(-1, K).t()).t().reshape(*x.shape[:-1], N)
    return linear(x, layer, triton)


def linear_silu_mul(x: Tensor, layer: nn.Linear, normed: Normed | None = None, triton: bool = False) -> Tensor:
    """silu(x·gateᵀ) · (x·upᵀ) for the fused [gate; up] projection ``layer`` (no bias). ``normed``:
    x is its ``gh`` and the products' rows are scaled by its rstd before SiLU·mul."""
    if use_skinny(x, layer.weight, triton, silu=True):
        from .kernels.linear import triton_skinny_linear

        return triton_skinny_linear(x, layer.weight, silu=True,
                                    rowscale=normed.rowscale() if normed is not None else None)
    return fused_silu_mul(dense(x, layer), normed, triton)


FOLD_MAX_ROWS = 16  # most rows whose norms ``fold_norms`` folds


def fold_norms(x: Tensor, block: nn.Module, triton: bool) -> bool:
    """Whether a block's two RMSNorms after it (its ffn norm, and the next block's attention norm) fold
    into the epilogues of its wo and w2 (``linear_add_norm``): where both products run split-K on the
    skinny kernel (few rows, Triton; see ``split_config``), at most ``FOLD_MAX_ROWS`` rows, and the
    projections have no bias (a bias would have to be added after the row scale). Saves a norm
    launch for each (2 of a layer's 7).

    Measured on an H200 (SMC-SD N=8 K=8, 512-token outputs): 1 request (the draft at 8 and 16 rows)
    14.34 -> 14.03 ms a round (interleaved A/B); 8 requests (64 rows, where the last split's epilogue
    costs more than the norm launch it saves) 28.67 -> 28.99, hence the limit."""
    if block.cfg.attention_bias or not triton:
        return False
    rows = x.numel() // x.shape[-1]
    return (rows <= FOLD_MAX_ROWS and split_config(x, block.wo.weight, triton, rows) is not None
            and split_config(x, block.w2.weight, triton, rows) is not None)


def linear_add_norm(x: Tensor, layer: nn.Linear, resid: Tensor, gamma: Tensor, eps: float, triton: bool = False
                    ) -> Normed:
    """resid + x · Wᵀ with the next RMSNorm (weight ``gamma``) folded in: a ``Normed``. With Triton one
    launch (kernels.triton_skinny_linear_add_norm, split-K as ``linear_to_residual``); reference:
    linear_add_norm_reference."""
    cfg = split_config(x, layer.weight, triton)
    if cfg is not None:
        from .kernels.linear import triton_skinny_linear_add_norm

        h, gh, ss = triton_skinny_linear_add_norm(x, layer.weight, resid, gamma, cfg[0], cfg[1])
        return Normed(h, gh, ss, eps)
    return linear_add_norm_reference(x, layer.weight, resid, gamma, eps)
