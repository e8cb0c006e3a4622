"""Native Llama-family decoder (Llama 3.x, SmolLM2, Qwen2-style GQA) over a paged KV cache.

A plain module in the gpt-fast manner: fused QKV and gate/up projections, RoPE with Llama-3
frequency scaling, RMSNorm, SwiGLU. Its layer operations are ``ops.py``'s (the Triton kernels on
CUDA, their torch references elsewhere). The KV cache lives outside the module (``kv_cache.KVPool``);
``forward`` writes the new keys/values into the pages named by the page table and attends over them.

Shapes: B rows (requests × particles), L new tokens per row, H query heads, Hkv key/value heads,
D head dim, PS tokens per page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ...errors import SMCDecodeError
from . import ops


@dataclass
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    rope_scaling: dict | None = None
    tie_embeddings: bool = False
    max_position: int = 131072
    attention_bias: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads

    @classmethod
    def from_hf(cls, cfg) -> LlamaConfig:
        scaling = getattr(cfg, "rope_scaling", None) or None
        params = getattr(cfg, "rope_parameters", None)
        theta = getattr(cfg, "rope_theta", None)
        if isinstance(params, dict):  # transformers >= 5 keeps theta and scaling together
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", "default") != "default":
                scaling = params
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return cls(
            vocab_size=cfg.vocab_size,
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            intermediate_size=cfg.intermediate_size,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rope_theta=float(theta if theta is not None else 10000.0),
            norm_eps=cfg.rms_norm_eps,
            rope_scaling=dict(scaling) if scaling else None,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position=getattr(cfg, "max_position_embeddings", 131072),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
        )


_LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

PRESETS = {
    "llama-3.1-8b": LlamaConfig(128256, 4096, 32, 32, 8, 14336, rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}),
    "llama-3.2-1b": LlamaConfig(128256, 2048, 16, 32, 8, 8192, rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
                                tie_embeddings=True),
}


def rope_inv_freq(cfg: LlamaConfig) -> Tensor:
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv_freq / s["factor"]).float()
    if kind != "llama3":
        raise SMCDecodeError(
            f"rope scaling {kind!r} is not supported by the engine (it supports 'llama3' and 'linear'): "
            "run this model on the reference backend"
        )
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(is_mid, mid, scaled).float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return ops.add_rms_norm(x, None, self.weight, self.eps)[1]


class Block(nn.Module):
    # tensor parallelism (parallel.py): sums this rank's partial wo and w2 products over the ranks
    reduce = None

    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (H + 2 * Hkv) * D, bias=cfg.attention_bias)
        self.wo = nn.Linear(H * D, cfg.dim, bias=False)
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: Tensor | ops.Normed, delta: Tensor | ops.SplitSum | None, rope: tuple[Tensor, Tensor], kv,
                batch, next_norm: Tensor | None = None) -> tuple[Tensor | ops.Normed, Tensor | ops.SplitSum | None]:
        """Residual stream x [B, L, dim] plus the previous block's pending branch output ``delta``
        (added here, fused with the norm) -> (stream, this block's MLP output, still to be added).

        Where ``ops.fold_norms`` holds, the norms after wo and w2 are folded into those products: x
        may arrive as the previous block's ``ops.Normed`` (delta None), and with ``next_norm`` (the
        next block's attention-norm weight) the block returns its own ``ops.Normed`` and None. Not
        under tensor parallelism (``reduce`` set): the residual add waits for the all-reduce."""
        cfg = self.cfg
        eps, tri = cfg.norm_eps, kv.triton
        B, L, _ = (x.h if isinstance(x, ops.Normed) else x).shape
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if isinstance(x, ops.Normed):
            normed, x, n = (x if x.sumsq is not None else None), x.h, x.gh
        else:
            normed = None
            x, n = ops.add_rms_norm(x, delta, self.attention_norm.weight, eps, tri)
        o = ops.rope_attention(ops.linear(n, self.wqkv, tri), batch, rope[0], rope[1], kv.k(self.layer),
                               kv.v(self.layer), H, Hkv, tri, normed)
        o = o.reshape(B, L, H * D)
        if self.reduce is None and ops.fold_norms(o, self, tri):
            mid = ops.linear_add_norm(o, self.wo, x, self.ffn_norm.weight, eps, tri)
            g = ops.linear_silu_mul(mid.gh, self.w13, mid, tri)
            if next_norm is not None:
                return ops.linear_add_norm(g, self.w2, mid.h, next_norm, eps, tri), None
            return mid.h, ops.linear_to_residual(g, self.w2, tri)
        attn = ops.linear_to_residual(o, self.wo, tri)
        h, n = ops.add_rms_norm(x, attn if self.reduce is None else self.reduce(attn), self.ffn_norm.weight, eps, tri)
        mlp = ops.linear_to_residual(ops.linear_silu_mul(n, self.w13, None, tri), self.w2, tri)
        return h, mlp if self.reduce is None else self.reduce(mlp)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_cos = self.rope_sin = None
        self._old_rope: list[tuple[Tensor, Tensor]] = []

    def set_rope_cache(self, max_positions: int) -> None:
        """cos/sin tables [max_positions, D/2] (float32, computed in float64); forward needs every
        position below ``max_positions`` (the Engine sizes them to its max_context)."""
        freqs = torch.arange(max_positions, dtype=torch.float64, device=self.inv_freq.device)[:, None] \
            * rope_inv_freq(self.cfg).double().to(self.inv_freq.device)
        if self.rope_cos is not None:
            # NOTE: graphs captured by another Engine (or before a runner grew the tables) read the
            # old tables: keep them alive (a few MB at most) so their memory is never reused
            self._old_rope.append((self.rope_cos, self.rope_sin))
        self.rope_cos, self.rope_sin = freqs.cos().float(), freqs.sin().float()

    def _tie(self) -> None:
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: Tensor, kv, batch, last_only: bool = False) -> Tensor:
        """tokens [B, L] at positions ``batch.positions`` [B, L] -> logits [B, L, V] (or [B, 1, V]).

        Keys/values of the new tokens are written to the cache first; query i of row b attends to
        cache positions <= its own position (``batch`` is an ``attention.PagedBatch``). Positions must
        be below the rope tables' length (``set_rope_cache``; 4096 by default). The pool ``kv``
        decides whether the Triton kernels run (``kv.triton``)."""
        if self.rope_cos is None:
            self.set_rope_cache(min(self.cfg.max_position, 4096))
        rope, tri = (self.rope_cos, self.rope_sin), kv.triton
        x, delta = ops.embed_norm(tokens, self.tok_embeddings.weight, self.layers[0].attention_norm.weight,
                                  self.cfg.norm_eps, tri), None
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].attention_norm.weight if i + 1 < len(self.layers) else None
            x, delta = layer(x, delta, rope, kv, batch, nxt)
        if last_only:
            x, delta = x[:, -1:], delta[:, -1:]
        return ops.linear(ops.add_rms_norm(x, delta, self.norm.weight, self.cfg.norm_eps, tri)[1], self.output, tri)

    # ------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def random(cls, cfg: LlamaConfig, dtype=torch.bfloat16, device="cuda", seed: int = 0) -> Llama:
        """Random weights at real shapes (speed benchmarks: the values do not change the speed)."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        model._tie()
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)
        model.inv_freq = rope_inv_freq(cfg).to(device)
        return model.eval()

    @classmethod
    def from_state_dict(cls, cfg: LlamaConfig, sd: dict[str, Tensor], dtype=torch.bfloat16, device="cpu") -> Llama:
        """From a Hugging Face ``LlamaForCausalLM`` state dict (``model.layers.{i}.self_attn.q_proj.weight`` …)."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        model._tie()
        sd = {k.removeprefix("model."): v for k, v in sd.items()}

        def take(name: str) -> Tensor:
            if name not in sd:
                raise KeyError(f"weight {name!r} missing from the state dict (has e.g. {sorted(sd)[:4]})")
            return sd[name].to(device=device, dtype=dtype)

        with torch.no_grad():
            model.tok_embeddings.weight.copy_(take("embed_tokens.weight"))
            model.norm.weight.copy_(take("norm.weight"))
            if not cfg.tie_embeddings:
                head = sd.get("lm_head.weight", sd["embed_tokens.weight"])
                model.output.weight.copy_(head.to(device=device, dtype=dtype))
            for i, blk in enumerate(model.layers):
                p = f"layers.{i}."
                a = p + "self_attn."
                blk.wqkv.weight.copy_(torch.cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"),
                                                 take(a + "v_proj.weight")]))
                if cfg.attention_bias:
                    blk.wqkv.bias.copy_(torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"),
                                                   take(a + "v_proj.bias")]))
                blk.wo.weight.copy_(take(a + "o_proj.weight"))
                m = p + "mlp."
                blk.w13.weight.copy_(torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]))
                blk.w2.weight.copy_(take(m + "down_proj.weight"))
                blk.attention_norm.weight.copy_(take(p + "input_layernorm.weight"))
                blk.ffn_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        model.inv_freq = rope_inv_freq(cfg).to(device)
        return model.eval()

    @classmethod
    def from_hf(cls, hf_model: nn.Module, dtype=torch.bfloat16, device="cpu") -> Llama:
        """From a loaded ``transformers`` Llama-family model (or an ``smcdecode.models.HFModel``)."""
        hf_model = getattr(hf_model, "hf", hf_model)
        cfg = LlamaConfig.from_hf(hf_model.config)
        return cls.from_state_dict(cfg, hf_model.state_dict(), dtype=dtype, device=device)

    @classmethod
    def from_safetensors(cls, directory: str, dtype=torch.bfloat16, device="cpu") -> Llama:
        """From a Hugging Face model directory (config.json + *.safetensors shards)."""
        from pathlib import Path

        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(directory)
        cfg = LlamaConfig.from_hf(AutoConfig.from_pretrained(path))
        sd: dict[str, Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        if not sd:
            raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
        return cls.from_state_dict(cfg, sd, dtype=dtype, device=device)
