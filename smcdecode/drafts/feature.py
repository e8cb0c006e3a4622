"""Feature drafts: a draft that reads the target's last hidden state (EAGLE-style).

A layer draft (:func:`smcdecode.drafts.build_draft`) sees only tokens. A *feature draft* also sees
the target's own final hidden state f_j (after its final norm: ``head(f_j)`` are the target's
logits) of every position the target has verified. Its input at the position of token x_j is

    z_j = W [n(f_{j-1}) ; e(x_j)]              (W: a D × 2D matrix, e: the target's embeddings,
                                                n: an RMSNorm to the embeddings' scale)

then ``L`` decoder layers of the target's shape (own weights, initialised from the target's last
layers), its own final norm and the target's LM head: q(· | x_≤j) = softmax(head(norm(h_j)) / T).
Its output h_j stands in for f_j where the target has not run yet: within an SMC-SD round the
first drafted token reads the target's true feature of the previous position, the k-th reads the
draft's own output of step k − 1. Training unrolls that (``unrolled``: step s of a position reads
the draft's outputs of the s − 1 positions before it and the target's features further back,
with the attention mask a round sees), so the draft learns to use its own estimates.

Runner contract (reference backend): ``extend(tokens [B, L], features [B, L, D]) -> (logits
[B, L, V] float32, hidden [B, L, D])`` where ``features[:, i]`` is the feature paired with
``tokens[:, i]`` (the target's, or the draft's own output, of the position before); ``reorder``,
``crop`` and ``length`` as for every runner. ``FeatureDraftModel.start(prefix, batch)`` runs the
target once over the prefix for its features and leaves the last one in ``runner.tail_feature``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends.reference import head_logits, target_hidden
from ..errors import SMCDecodeError
from ..models import HFModel, Model

# The parameter names of one decoder layer, as in Hugging Face's Llama / Mistral / Qwen2 (with or
# without q/k/v biases); the draft's layers load a target layer's state dict under these names.
_LAYER_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _Layer(nn.Module):
    """A pre-norm decoder layer (RMSNorm, grouped-query attention with rotary positions, SiLU MLP)
    whose keys and values may be prepended with earlier blocks of keys (the KV cache, or the
    earlier unrolled steps in training) under an explicit boolean mask."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, mlp: int, eps: float, bias: bool):
        super().__init__()
        self.input_layernorm = _RMSNorm(dim, eps)
        self.self_attn = _Attention(dim, heads, kv_heads, head_dim, bias)
        self.post_attention_layernorm = _RMSNorm(dim, eps)
        self.mlp = _MLP(dim, mlp)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: Sequence[tuple[Tensor, Tensor]],
                mask: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        a = self.self_attn
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q = a.q_proj(h).view(B, T, a.heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(B, T, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(B, T, a.kv_heads, a.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys = torch.cat([*(p[0] for p in past), k], dim=2) if past else k
        values = torch.cat([*(p[1] for p in past), v], dim=2) if past else v
        if a.kv_heads != a.heads:
            keys = keys.repeat_interleave(a.heads // a.kv_heads, dim=1)
            values = values.repeat_interleave(a.heads // a.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + a.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, (k, v)


def unrolled_mask(length: int, step: int, device) -> Tensor:
    """Which keys the queries of unrolled step ``step`` (0-based) see: [T, (step + 1)·T] bool over
    the key blocks of steps 0..step. Position j at step s is the (s+1)-th drafted token of a round
    that began at position j − s: it sees step-0 keys (true features) at positions ≤ j − s and the
    key of step r at position j − s + r for r = 1..s (the round's earlier drafted positions)."""
    j = torch.arange(length, device=device)
    blocks = [j[None, :] <= (j[:, None] - step)]
    blocks += [j[None, :] == (j[:, None] - step + r) for r in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class FeatureDraftNet(nn.Module):
    """The trainable part of a feature draft: ``feature_norm``, ``fc`` (D × 2D), ``layers`` and ``norm``. The
    target's embeddings, rotary tables and head are used, not owned (not in ``parameters()``)."""

    def __init__(self, target_hf: nn.Module, num_layers: int):
        super().__init__()
        cfg = target_hf.config
        dim = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or dim // heads)
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        bias = bool(getattr(cfg, "attention_bias", False)) or getattr(cfg, "model_type", "") == "qwen2"
        self.feature_norm = _RMSNorm(dim, eps)  # features at the embeddings' scale (set by build_feature_draft)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.layers = nn.ModuleList(
            [_Layer(dim, heads, kv_heads, head_dim, int(cfg.intermediate_size), eps, bias) for _ in range(num_layers)]
        )
        self.norm = _RMSNorm(dim, eps)
        self.dim = dim
        object.__setattr__(self, "target_hf", target_hf)  # shared, not a submodule

    def rope(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.target_hf.model.rotary_emb(x, positions)
        return cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [B|1, 1, T, head_dim]

    def inputs(self, features: Tensor, tokens: Tensor) -> Tensor:
        emb = self.target_hf.get_input_embeddings()(tokens)
        return self.fc(torch.cat([self.feature_norm(features.to(emb.dtype)), emb], dim=-1))

    def logits(self, hidden: Tensor) -> Tensor:
        return head_logits(self.target_hf, self.norm(hidden))

    def unrolled(self, input_ids: Tensor, features: Tensor, steps: int) -> list[Tensor]:
        """Training: the draft's hidden states [B, T, D] at unrolled steps 1..``steps`` over whole
        sequences. ``features`` [B, T, D] are the target's (``target_hidden``); step 1 reads the
        target's feature of the previous position, step s reads step s − 1's output there."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)[None]
        emb = self.target_hf.get_input_embeddings()(input_ids)
        cos, sin = self.rope(emb, positions)
        prev = F.pad(features[:, :-1], (0, 0, 1, 0))
        past: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]
        outs = []
        for s in range(steps):
            x = self.fc(torch.cat([self.feature_norm(prev.to(emb.dtype)), emb], dim=-1))
            mask = unrolled_mask(T, s, input_ids.device)
            for layer, kv in zip(self.layers, past):
                x, new = layer(x, cos, sin, kv, mask)
                kv.append(new)
            outs.append(x)
            prev = F.pad(x[:, :-1], (0, 0, 1, 0))
        return outs


class FeatureDraftRunner:
    """KV state of B rows of a feature draft (reference backend)."""

    def __init__(self, net: FeatureDraftNet, batch: int, device, dtype):
        self.net = net
        self.batch = batch
        self.cache: list[tuple[Tensor, Tensor] | None] = [None for _ in net.layers]
        self.length = 0
        self.tail_feature = torch.zeros(batch, net.dim, device=device, dtype=dtype)

    @torch.inference_mode()
    def extend(self, tokens: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        net = self.net
        device = net.fc.weight.device
        tokens, features = tokens.to(device), features.to(device)
        B, L = tokens.shape
        positions = torch.arange(self.length, self.length + L, device=device)[None]
        x = net.inputs(features, tokens)
        cos, sin = net.rope(x, positions)
        mask = torch.ones(L, self.length + L, dtype=torch.bool, device=device).tril(self.length)
        for i, layer in enumerate(net.layers):
            past = [self.cache[i]] if self.cache[i] is not None else []
            x, (k, v) = layer(x, cos, sin, past, mask)
            old = self.cache[i]
            self.cache[i] = (k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
        self.length += L
        return net.logits(x), x

    def reorder(self, index: Tensor) -> None:
        self.cache = [None if c is None else (c[0][index.to(c[0].device)], c[1][index.to(c[1].device)])
                      for c in self.cache]
        self.tail_feature = self.tail_feature[index.to(self.tail_feature.device)]

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache = [None if c is None else (c[0][:, :, :length], c[1][:, :, :length]) for c in self.cache]
            self.length = length

    def repeat(self, batch: int) -> None:
        """One row (a prefix) -> ``batch`` identical rows."""
        self.cache = [None if c is None else (c[0].expand(batch, -1, -1, -1).contiguous(),
                                              c[1].expand(batch, -1, -1, -1).contiguous()) for c in self.cache]
        self.tail_feature = self.tail_feature[:1].expand(batch, -1).contiguous()
        self.batch = batch


class FeatureDraftModel(Model):
    """A feature draft as a smcdecode :class:`Model` (its vocabulary and tokenizer are the
    target's). It can only propose for the target it reads: SMC-SD passes it the target's
    features (``uses_target_features``)."""

    uses_target_features = True

    def __init__(self, target: HFModel, net: FeatureDraftNet, name: str | None = None):
        self.target = target
        self.net = net
        self.name = name or f"{target.name}-feature{len(net.layers)}"
        self.vocab_size = target.vocab_size
        self.eos_token_id = target.eos_token_id
        self.max_context = target.max_context
        self.smcdecode_draft: dict = {}

    # the tokenizer is the target's
    def encode(self, text: str) -> list[int]:
        return self.target.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.target.decode(ids)

    @property
    def token_strings(self) -> list[str | None]:
        return self.target.token_strings

    def chat(self, messages: Sequence[dict]) -> list[int]:
        return self.target.chat(messages)

    @property
    def device(self) -> torch.device:
        return self.net.fc.weight.device

    def start(self, prefix_ids: list[int], batch: int) -> FeatureDraftRunner:
        hf = self.target.hf
        dtype = self.net.fc.weight.dtype
        runner = FeatureDraftRunner(self.net, 1, self.device, dtype)
        if prefix_ids:
            ids = torch.tensor([prefix_ids], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                feats = hf.model(input_ids=ids, use_cache=False).last_hidden_state.to(dtype)
            runner.extend(ids, F.pad(feats[:, :-1], (0, 0, 1, 0)))
            runner.tail_feature = feats[:, -1]
        runner.repeat(batch)
        return runner


def _check_layer(target_layer: nn.Module, layer: _Layer) -> None:
    theirs = {k for k in target_layer.state_dict()}
    ours = {k for k in layer.state_dict()}
    if theirs != ours:
        extra = sorted(theirs ^ ours)[:6]
        raise SMCDecodeError(
            f"feature drafts support decoder layers laid out like Llama / Mistral / Qwen2 "
            f"(q/k/v/o_proj, gate/up/down_proj, two RMSNorms); this target's layer differs in {extra}: "
            "use a layer draft (smcdecode.drafts.build_draft) for it"
        )


def build_feature_draft(target: HFModel, num_layers: int = 1, init_layers: Sequence[int] | None = None,
                        from_draft: HFModel | None = None) -> FeatureDraftModel:
    """A feature draft for ``target``: ``num_layers`` decoder layers initialised from the target's
    layers ``init_layers`` (default: its last ``num_layers``), its own copy of the final norm,
    and ``fc`` initialised to [I I] (input = f_{j-1} + e(x_j)). Trainable; the target is not.

    With ``from_draft`` (a layer draft of ``target``, e.g. the shipped one) its layers and norm are
    copied instead and ``fc`` starts at [0 I]: the new draft starts as exactly that draft (it
    ignores the features) and training teaches it to read them."""
    from . import _decoder, target_fingerprint

    if from_draft is not None:
        source = _decoder(from_draft.hf)
        if num_layers != len(source.layers):
            raise SMCDecodeError(f"num_layers ({num_layers}) must equal the layers of from_draft "
                                 f"{from_draft.name!r} ({len(source.layers)})")
        model = build_feature_draft(target, num_layers, init_layers)
        with torch.no_grad():
            for layer, theirs in zip(model.net.layers, source.layers):
                _check_layer(theirs, layer)
                layer.load_state_dict(theirs.state_dict())
            model.net.norm.weight.copy_(source.norm.weight)
            model.net.fc.weight[:, : model.net.dim].zero_()
        model.smcdecode_draft["init_from"] = from_draft.name
        return model

    if not isinstance(target, HFModel):
        raise SMCDecodeError(f"target must be an HFModel (load_model(...)), got {type(target).__name__}")
    inner = _decoder(target.hf)
    n = len(inner.layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < n:
        raise SMCDecodeError(f"num_layers must be an integer in [1, {n - 1}] for a {n}-layer target, got {num_layers!r}")
    init = list(range(n - num_layers, n) if init_layers is None else init_layers)
    if len(init) != num_layers or not all(isinstance(i, int) and 0 <= i < n for i in init):
        raise SMCDecodeError(f"init_layers must list {num_layers} target layer indices in [0, {n - 1}], got {init!r}")
    param = next(target.hf.parameters())
    net = FeatureDraftNet(target.hf, num_layers)
    with torch.no_grad():
        for layer, i in zip(net.layers, init):
            _check_layer(inner.layers[i], layer)
            layer.load_state_dict(inner.layers[i].state_dict())
        net.norm.weight.copy_(inner.norm.weight)
        # the feature input is RMS-normalised to the scale of the token embeddings (SmolLM2: final
        # hidden states ~2 per unit, embeddings ~0.14): neither input swamps the other, and a
        # zero-initialised feature weight grows on the embeddings' scale under Adam
        emb = target.hf.get_input_embeddings().weight.detach().float()
        net.feature_norm.weight.fill_(float(emb.pow(2).mean().sqrt()))
        eye = torch.eye(net.dim)
        net.fc.weight.copy_(torch.cat([eye, eye], dim=1))
    net = net.to(device=param.device, dtype=param.dtype)
    model = FeatureDraftModel(target, net)
    model.smcdecode_draft = {"kind": "feature", "init_layers": init, "target": target_fingerprint(target)}
    return model


__all__ = ["FeatureDraftModel", "FeatureDraftNet", "FeatureDraftRunner", "build_feature_draft", "target_hidden",
           "unrolled_mask"]
