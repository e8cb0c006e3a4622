"""Weight readers for tensor-parallel loading: each returns a slice of one weight, read (and, for GGUF,
dequantised) without the rest of the tensor or the model, so a rank holds only its own shard.

A reader names weights as Hugging Face's ``LlamaForCausalLM`` does
(``model.layers.{i}.self_attn.q_proj.weight``, ``lm_head.weight``, ...) and answers
``read(name, rows, cols)`` with ``weight[rows, cols]`` as a float tensor (``rows``/``cols`` Python
slices; a vector takes ``rows`` only). ``has(name)`` says whether a weight exists (``lm_head.weight``
does not in a tied model). ``config`` is the model's :class:`~.model.LlamaConfig`.

    StateDictReader   an in-memory state dict (a loaded HF model; ``of_llama`` views an engine Llama)
    SafetensorsReader a Hugging Face directory: config.json + *.safetensors (``safe_open``'s slices)
    GGUFReader        a .gguf file (llama.cpp layout): row slices of quantised tensors are read and
                      dequantised alone; q/k rows are un-permuted from llama.cpp's RoPE order
    RandomReader      random weights at real shapes, each tensor from its own seeded generator (the
                      same model whatever the number of ranks; speed benchmarks)

``reader_for(path)`` picks the file reader.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from .model import LlamaConfig, rope_inv_freq

_ALL = slice(None)


class StateDictReader:
    def __init__(self, config: LlamaConfig, state_dict: dict[str, Tensor]):
        self.config = config
        self.sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in state_dict.items()}

    @classmethod
    def of_llama(cls, model) -> StateDictReader:
        """Views of an engine ``Llama``'s (unsharded) fused weights under Hugging Face names."""
        cfg = model.cfg
        H, Hkv, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
        sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
        if not cfg.tie_embeddings:
            sd["lm_head.weight"] = model.output.weight
        for i, blk in enumerate(model.layers):
            p = f"model.layers.{i}."
            for part, w in zip(("q", "k", "v"), blk.wqkv.weight.split([H * D, Hkv * D, Hkv * D])):
                sd[f"{p}self_attn.{part}_proj.weight"] = w
            if blk.wqkv.bias is not None:
                for part, b in zip(("q", "k", "v"), blk.wqkv.bias.split([H * D, Hkv * D, Hkv * D])):
                    sd[f"{p}self_attn.{part}_proj.bias"] = b
            sd[p + "self_attn.o_proj.weight"] = blk.wo.weight
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = blk.w13.weight.split([F, F])
            sd[p + "mlp.down_proj.weight"] = blk.w2.weight
            sd[p + "input_layernorm.weight"] = blk.attention_norm.weight
            sd[p + "post_attention_layernorm.weight"] = blk.ffn_norm.weight
        return cls(cfg, sd)

    def has(self, name: str) -> bool:
        return name in self.sd

    def read(self, name: str, rows: slice = _ALL, cols: slice = _ALL) -> Tensor:
        if name not in self.sd:
            raise SMCDecodeError(f"weight {name!r} missing from the state dict (has e.g. {sorted(self.sd)[:3]})")
        w = self.sd[name]
        return w[rows] if w.dim() == 1 else w[rows, cols]


class SafetensorsReader:
    def __init__(self, directory: str | Path):
        from safetensors import safe_open
        from transformers import AutoConfig

        path = Path(directory)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SMCDecodeError(f"no *.safetensors files in {str(path)!r}: give a Hugging Face model directory")
        self.config = LlamaConfig.from_hf(AutoConfig.from_pretrained(path))
        self._files = [safe_open(str(f), framework="pt") for f in files]  # headers only; tensors are mmapped
        self._where = {k: f for f in self._files for k in f.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, rows: slice = _ALL, cols: slice = _ALL) -> Tensor:
        if name not in self._where:
            raise SMCDecodeError(f"weight {name!r} is in none of the model's safetensors files")
        sl = self._where[name].get_slice(name)
        return sl[rows] if len(sl.get_shape()) == 1 else sl[rows, cols]


# Hugging Face name (after "model.layers.{i}.") -> llama.cpp name (after "blk.{i}.")
_GGUF_LAYER = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
               "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
               "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
               "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[1] == "layers" and parts[3] in _GGUF_LAYER:
        return f"blk.{parts[2]}.{_GGUF_LAYER[parts[3]]}"
    raise SMCDecodeError(f"no GGUF name for weight {name!r}")


class GGUFReader:
    """A llama.cpp GGUF file of a Llama-family model (``general.architecture`` llama)."""

    def __init__(self, path: str | Path):
        import gguf

        self._gguf = gguf
        self.path = str(path)
        r = gguf.GGUFReader(self.path)  # memory-mapped: nothing is read until sliced
        self._tensors = {t.name: t for t in r.tensors}
        arch = self._field(r, "general.architecture")
        if arch not in ("llama",):
            raise SMCDecodeError(f"GGUF file {self.path!r} holds a {arch!r} model: the engine's sharded loader "
                                 "reads Llama-family GGUF files (general.architecture 'llama')")

        def meta(key, default=None):
            return self._field(r, f"{arch}.{key}", default)

        n_heads = int(meta("attention.head_count"))
        vocab = meta("vocab_size")
        if vocab is None:
            vocab = len(r.fields["tokenizer.ggml.tokens"].data)
        dim = int(meta("embedding_length"))
        self.config = LlamaConfig(
            vocab_size=int(vocab), dim=dim, n_layers=int(meta("block_count")), n_heads=n_heads,
            n_kv_heads=int(meta("attention.head_count_kv", n_heads)), intermediate_size=int(meta("feed_forward_length")),
            head_dim=int(meta("rope.dimension_count", dim // n_heads)), rope_theta=float(meta("rope.freq_base", 10000.0)),
            norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in self._tensors, max_position=int(meta("context_length", 131072)),
            attention_bias="blk.0.attn_q.bias" in self._tensors)
        self.config.rope_scaling = self._rope_scaling(meta)

    @staticmethod
    def _field(r, key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    def _rope_scaling(self, meta) -> dict | None:
        kind = meta("rope.scaling.type")
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
        if kind not in (None, "none"):
            raise SMCDecodeError(f"GGUF rope scaling {kind!r} is not supported by the engine ('linear' and "
                                 "Llama-3's rope_freqs are): run this model on the reference backend")
        if "rope_freqs.weight" not in self._tensors:
            return None
        # llama.cpp stores Llama-3 scaling as per-frequency divisors: find the standard parameters that give them
        divisors = torch.from_numpy(np.array(self._tensors["rope_freqs.weight"].data, dtype=np.float32))
        base = rope_inv_freq(LlamaConfig(1, 1, 1, 1, 1, 1, head_dim=self.config.head_dim,
                                         rope_theta=self.config.rope_theta))
        for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
            s = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
            cfg = LlamaConfig(1, 1, 1, 1, 1, 1, head_dim=self.config.head_dim, rope_theta=self.config.rope_theta,
                              rope_scaling=s)
            if torch.allclose(base / divisors, rope_inv_freq(cfg), rtol=1e-4):
                return s
        raise SMCDecodeError(f"GGUF file {self.path!r} has rope_freqs that match no Llama-3 rope scaling (factor "
                             "8/16/32, low 1, high 4, original context 8192): load it from safetensors instead")

    def has(self, name: str) -> bool:
        return gguf_name(name) in self._tensors

    def read(self, name: str, rows: slice = _ALL, cols: slice = _ALL) -> Tensor:
        """``weight[rows, cols]`` in float32: only the quantisation blocks of those rows that hold those
        columns are read and dequantised (a slice that is not block aligned takes the blocks at its
        two ends whole, then drops their extra columns)."""
        gname = gguf_name(name)
        if gname not in self._tensors:
            raise SMCDecodeError(f"tensor {gname!r} (weight {name!r}) is not in GGUF file {self.path!r}")
        t = self._tensors[gname]
        qtype = t.tensor_type
        deq = self._gguf.quants.dequantize
        D = self.config.head_dim
        rope = name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"))
        if rope:  # q/k rows: whole heads, then llama.cpp's per-head permutation undone
            r0, r1, _ = rows.indices(int(t.shape[-1]))
            if r0 % D or r1 % D:
                raise SMCDecodeError(f"rows {r0}:{r1} of {name!r} do not cover whole heads of {D}")
        if len(t.data.shape) == 1:
            w = torch.from_numpy(np.array(deq(t.data[rows], qtype), dtype=np.float32))
            return w.reshape(-1, D // 2, 2).transpose(1, 2).reshape(w.shape) if rope else w
        block, type_size = self._gguf.GGML_QUANT_SIZES[qtype]
        c0, c1, _ = cols.indices(int(t.shape[0]))
        data = t.data[rows]  # [rows, bytes a row] of a quantised type, [rows, cols] of a float type
        if block == 1:
            w = np.array(deq(np.ascontiguousarray(data[:, c0:c1]), qtype), dtype=np.float32)
        else:  # the quantisation blocks that cover the columns, dequantised, then trimmed to them
            a, b = c0 // block, -(-c1 // block)
            w = deq(np.ascontiguousarray(data[:, a * type_size:b * type_size]), qtype)
            w = np.array(w[:, c0 - a * block:c1 - a * block], dtype=np.float32)
        w = torch.from_numpy(w)
        if rope:  # llama.cpp wrote each head's rows in (D/2, 2) order; Hugging Face's are (2, D/2)
            w = w.reshape(-1, D // 2, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)
        return w


class RandomReader:
    """Random weights (normal 0, 0.02; norms 1) for ``config``: each tensor drawn in full on ``device``
    from a generator seeded by (seed, its name) and then sliced, so every rank of any world size reads
    the slices of the same model."""

    def __init__(self, config: LlamaConfig, seed: int = 0, device="cpu"):
        self.config, self.seed, self.device = config, seed, torch.device(device)
        self._shapes = _hf_shapes(config)

    def has(self, name: str) -> bool:
        return name in self._shapes

    def read(self, name: str, rows: slice = _ALL, cols: slice = _ALL) -> Tensor:
        shape = self._shapes[name]
        if name.endswith("norm.weight"):
            w = torch.ones(shape, device=self.device)
        else:
            g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            w = torch.empty(shape, device=self.device).normal_(0.0, 0.02, generator=g)
        return w[rows] if w.dim() == 1 else w[rows, cols]


def _hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    H, Hkv, D, F, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (H * D, d), p + "self_attn.k_proj.weight": (Hkv * D, d),
                       p + "self_attn.v_proj.weight": (Hkv * D, d), p + "self_attn.o_proj.weight": (d, H * D),
                       p + "mlp.gate_proj.weight": (F, d), p + "mlp.up_proj.weight": (F, d),
                       p + "mlp.down_proj.weight": (d, F), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (H * D,), p + "self_attn.k_proj.bias": (Hkv * D,),
                           p + "self_attn.v_proj.bias": (Hkv * D,)})
    return shapes


def reader_for(path: str | Path):
    """The reader of a Hugging Face safetensors directory or a .gguf file."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return GGUFReader(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not list(p.glob("*.safetensors")) and len(ggufs) == 1:
            return GGUFReader(ggufs[0])
        return SafetensorsReader(p)
    raise SMCDecodeError(f"model path {str(path)!r} is neither a .gguf file nor a directory: give a Hugging Face "
                         "model directory (config.json + *.safetensors) or a .gguf file")
