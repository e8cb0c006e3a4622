"""Distilled drafts: a few decoder layers of the target's width on top of the target's own token
embeddings and LM head.

A draft for target ``T`` runs ``L`` decoder layers of its own (initialised from layers of ``T``
and trained by :mod:`smcdecode.distill`), then its own final norm, then ``T``'s LM head. The
embeddings and head are ``T``'s modules (shared, not copied), so a saved draft holds only the
``L`` layers and the norm, and a loaded draft costs ``L`` layers of extra memory.

A saved draft is a directory::

    draft.json         {"format": "smcdecode-draft", "version": 1, "target": {...fingerprint...},
                        "num_layers": L, "init_layers": [...], "weights": "int8" | "bfloat16",
                        "training": {...recipe...}, "eval": {...held-out figures...}}
    draft.safetensors  "layers.{j}.{param}" and "norm.weight"; with "int8" weights each matrix
                       W [out, in] is stored as "{name}.q" (int8) and "{name}.scale" (float32
                       [out, 1]), W ≈ q · scale with scale = max_in |W| / 127 (per output row).

The default draft for the built-in model (SmolLM2-135M-Instruct) ships in this package:
:func:`load_default_draft`. See docs/drafts.md for its recipe and figures.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..errors import SMCDecodeError
from ..models import HFModel

FORMAT = "smcdecode-draft"
VERSION = 2  # 2: feature drafts ("kind": "feature"); layer drafts are still written as 1
CONFIG_FILE = "draft.json"
WEIGHTS_FILE = "draft.safetensors"
WEIGHT_FORMATS = ("int8", "bfloat16", "float32")

# target fingerprint -> directory of the shipped draft (under this package)
DEFAULT_DRAFTS = {"SmolLM2-135M-Instruct": Path(__file__).parent / "smollm2-135m-instruct"}


def default_init_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """Evenly spaced target layers, first and last included: 30 layers, L=4 -> [0, 10, 19, 29]."""
    if num_layers == 1:
        return [num_target_layers - 1]
    step = (num_target_layers - 1) / (num_layers - 1)
    return [round(j * step) for j in range(num_layers)]


def _decoder(hf: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(hf, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise SMCDecodeError(
            f"{type(hf).__name__} has no .model.layers / .model.norm: distilled drafts support decoder-only "
            "models laid out like Llama, Qwen2/3, Mistral or Gemma (…ForCausalLM with .model.layers)"
        )
    return inner


def build_draft(target: HFModel, num_layers: int = 4, init_layers: Sequence[int] | None = None) -> HFModel:
    """A draft with ``num_layers`` decoder layers copied from the target's layers ``init_layers``
    (default: evenly spaced), its own copy of the final norm, and the target's embeddings, rotary
    tables and LM head (shared modules). The new layers are trainable; nothing of the target is."""
    if not isinstance(target, HFModel):
        raise SMCDecodeError(f"target must be an HFModel (load_model(...)), got {type(target).__name__}")
    base = target.hf
    inner_base = _decoder(base)
    n = len(inner_base.layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < n:
        raise SMCDecodeError(f"num_layers must be an integer in [1, {n - 1}] for a {n}-layer target, got {num_layers!r}")
    init = list(default_init_layers(n, num_layers) if init_layers is None else init_layers)
    if len(init) != num_layers or not all(isinstance(i, int) and 0 <= i < n for i in init):
        raise SMCDecodeError(
            f"init_layers must list {num_layers} target layer indices in [0, {n - 1}], got {init!r}"
        )
    layers = []
    for j, i in enumerate(init):
        layer = copy.deepcopy(inner_base.layers[i])
        for m in layer.modules():  # the KV cache is indexed by layer_idx
            if hasattr(m, "layer_idx"):
                m.layer_idx = j
        layers.append(layer)
    config = copy.deepcopy(base.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in init]
    hf = copy.copy(base)  # shallow: shares embeddings, rotary tables and head with the target
    hf._modules = dict(base._modules)
    inner = copy.copy(inner_base)
    inner._modules = dict(inner_base._modules)
    inner._modules["layers"] = torch.nn.ModuleList(layers)
    inner._modules["norm"] = copy.deepcopy(inner_base.norm)
    inner.config = config
    hf.config = config
    hf._modules["model"] = inner
    hf.smcdecode_draft = {"init_layers": init, "target": target_fingerprint(target)}
    for p in own_parameters(hf):
        p.requires_grad_(True)
    return HFModel(hf, target.tokenizer, name=f"{target.name}-draft{num_layers}")


def grown_layout(init_layers: Sequence[int], num_layers: int) -> tuple[list[int], list[bool]]:
    """Where :func:`grow_draft` puts ``num_layers - len(init_layers)`` new layers: each into a gap
    between two of the draft's layers (gaps spread evenly), initialised from the target layer
    midway between the two. Returns the grown draft's init layers and which positions are new."""
    old = list(init_layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise SMCDecodeError(f"num_layers must be an integer, got {num_layers!r}")
    m, gaps = num_layers - len(old), len(old) - 1
    if gaps == 0:
        raise SMCDecodeError("cannot grow a 1-layer draft (new layers go between its layers): distil one with "
                             f"--layers {num_layers} from the target's layers instead")
    if not 1 <= m <= gaps:
        raise SMCDecodeError(
            f"num_layers must be in [{len(old) + 1}, {len(old) + gaps}] to grow a {len(old)}-layer draft "
            f"(one new layer per gap between its layers), got {num_layers}: grow in several steps for more"
        )
    chosen = {int((i + 0.5) * gaps / m) for i in range(m)}  # m distinct gaps: steps of gaps/m >= 1
    init, new = [], []
    for i, layer in enumerate(old):
        init.append(layer)
        new.append(False)
        if i in chosen:
            init.append((old[i] + old[i + 1]) // 2)
            new.append(True)
    return init, new


def grow_draft(target: HFModel, draft: HFModel, num_layers: int) -> HFModel:
    """A layer draft with ``num_layers`` layers that computes exactly what ``draft`` computes: the
    draft's layers and norm, with new layers between them (:func:`grown_layout`) copied from the
    target but with their attention and MLP output projections at zero, so each new layer starts
    as the identity on the residual stream. Training then uses the extra depth (``smcdecode.distill
    --init-draft DIR --layers L`` with L above the draft's)."""
    info = draft_info(draft)
    if not info or info.get("kind", "layers") != "layers":
        raise SMCDecodeError(f"draft must be a layer draft (build_draft / load_draft), got {draft!r}")
    init, new = grown_layout(info["init_layers"], num_layers)
    grown = build_draft(target, num_layers, init)
    old_layers, layers = _decoder(draft.hf).layers, _decoder(grown.hf).layers
    sources = iter(old_layers)
    with torch.no_grad():
        for layer, is_new in zip(layers, new):
            if not is_new:
                layer.load_state_dict(next(sources).state_dict())
                continue
            outputs = [m for name, m in layer.named_modules() if name.endswith(("o_proj", "down_proj"))]
            if len(outputs) != 2:
                raise SMCDecodeError(
                    f"cannot grow a {type(target.hf).__name__} draft: its decoder layers have no o_proj / "
                    "down_proj output projections to start at zero"
                )
            for m in outputs:
                m.weight.zero_()
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        _decoder(grown.hf).norm.load_state_dict(_decoder(draft.hf).norm.state_dict())
    grown.hf.smcdecode_draft["grown_from"] = list(info["init_layers"])
    return grown


def own_parameters(draft) -> list[torch.nn.Parameter]:
    """The parameters a draft owns (its layers and final norm, and a feature draft's ``fc``); the
    rest are the target's. ``draft``: a draft model, or a layer draft's ``.hf`` module."""
    from .feature import FeatureDraftModel

    if isinstance(draft, FeatureDraftModel):
        return list(draft.net.parameters())
    inner = _decoder(draft.hf if isinstance(draft, HFModel) else draft)
    return [*inner.layers.parameters(), *inner.norm.parameters()]


def own_state(draft) -> dict[str, Tensor]:
    """The draft's own weights by saved name: ``layers.{j}.{param}``, ``norm.{param}`` (and a
    feature draft's ``fc.weight``)."""
    from .feature import FeatureDraftModel

    if isinstance(draft, FeatureDraftModel):
        return dict(draft.net.state_dict())
    inner = _decoder(draft.hf)
    state = {f"layers.{k}": v for k, v in inner.layers.state_dict().items()}
    state.update({f"norm.{k}": v for k, v in inner.norm.state_dict().items()})
    return state


def draft_info(draft) -> dict:
    """What a distilled draft records about itself (kind, init layers, target, saved config); {} for
    any other model."""
    from .feature import FeatureDraftModel

    if isinstance(draft, FeatureDraftModel):
        return draft.smcdecode_draft
    return getattr(getattr(draft, "hf", None), "smcdecode_draft", None) or {}


def load_own_state(draft, state: dict[str, Tensor]) -> None:
    from .feature import FeatureDraftModel

    if isinstance(draft, FeatureDraftModel):
        try:
            with torch.no_grad():
                draft.net.load_state_dict({k: v.to(draft.net.fc.weight.dtype) for k, v in state.items()}, strict=True)
        except RuntimeError as e:
            raise SMCDecodeError(
                f"feature-draft weights do not fit this target's shapes ({str(e).splitlines()[0][:200]}): "
                "the draft was distilled from a different target architecture"
            ) from None
        return
    inner = _decoder(draft.hf)
    layers = {k[len("layers."):]: v for k, v in state.items() if k.startswith("layers.")}
    norm = {k[len("norm."):]: v for k, v in state.items() if k.startswith("norm.")}
    try:
        with torch.no_grad():
            inner.layers.load_state_dict(layers, strict=True)
            inner.norm.load_state_dict(norm, strict=True)
    except RuntimeError as e:
        raise SMCDecodeError(
            f"draft weights do not fit the target's layer shapes ({str(e).splitlines()[0][:200]}): "
            "the draft was distilled from a different target architecture"
        ) from None


def target_fingerprint(target: HFModel) -> dict:
    """What a draft must match: architecture, sizes, EOS, and the norms of 16 embedding rows
    (tells apart two targets that share a tokenizer; robust to float32 vs bfloat16 loading)."""
    cfg = target.hf.config
    emb = target.hf.get_input_embeddings().weight
    rows = torch.linspace(0, emb.shape[0] - 1, 16).round().long().to(emb.device)
    norms = emb.detach()[rows].float().norm(dim=1).cpu().tolist()
    return {
        "name": target.name,
        "model_type": getattr(cfg, "model_type", None),
        "vocab_size": int(target.vocab_size),
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "eos_token_id": int(target.eos_token_id),
        "embedding_row_norms": [round(x, 5) for x in norms],
    }


def check_target(saved: dict, target: HFModel, where: str = "draft") -> None:
    """Raise a clear :class:`SMCDecodeError` when a draft made for ``saved`` cannot serve ``target``."""
    now = target_fingerprint(target)
    if saved.get("vocab_size") != now["vocab_size"]:
        raise SMCDecodeError(
            f"{where} vocabulary ({saved.get('vocab_size')}) differs from target vocabulary ({now['vocab_size']}): "
            "use a draft distilled from this target (python -m smcdecode.distill --target ...)"
        )
    for key in ("model_type", "hidden_size"):  # NOTE: not eos_token_id: the draft shares the target's tokenizer
        if saved.get(key) != now[key]:
            raise SMCDecodeError(
                f"{where} was distilled for a target with {key}={saved.get(key)!r}, but this target has "
                f"{key}={now[key]!r}: distil a draft for this target (python -m smcdecode.distill)"
            )
    a, b = saved.get("embedding_row_norms") or [], now["embedding_row_norms"]
    if len(a) != len(b) or any(abs(x - y) > 2e-2 * max(abs(x), abs(y), 1e-6) for x, y in zip(a, b)):
        raise SMCDecodeError(
            f"{where} was distilled from a different target ({saved.get('name')!r}; its token embeddings differ "
            f"from those of {now['name']!r}): distil a draft for this target (python -m smcdecode.distill)"
        )


# ----------------------------------------------------------------------------------------------
# Saving and loading


def _quantize(state: dict[str, Tensor], weights: str) -> dict[str, Tensor]:
    out = {}
    for k, v in state.items():
        v = v.detach().float().cpu()
        if weights == "int8" and v.dim() == 2:
            scale = (v.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)  # [out, 1]
            out[f"{k}.q"] = torch.round(v / scale).clamp(-127, 127).to(torch.int8)
            out[f"{k}.scale"] = scale
        elif weights == "float32":
            out[k] = v.contiguous()
        else:
            out[k] = v.to(torch.bfloat16).contiguous()
    return out


def _dequantize(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for k, v in tensors.items():
        if k.endswith(".q"):
            name = k[:-2]
            out[name] = v.float() * tensors[f"{name}.scale"].float()
        elif not k.endswith(".scale"):
            out[k] = v.float()
    return out


def save_draft(draft: HFModel, path: str | Path, *, weights: str = "int8", metadata: dict | None = None) -> Path:
    """Write ``draft`` (from :func:`build_draft` / :func:`load_draft`) to the directory ``path``:
    only its own layers and norm, as int8 (per-row scales), bfloat16 or float32."""
    from safetensors.torch import save_file

    info = draft_info(draft)
    if not info:
        raise SMCDecodeError(f"model {draft.name!r} is not a distilled draft: make one with build_draft(target, ...)")
    if weights not in WEIGHT_FORMATS:
        raise SMCDecodeError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_quantize(own_state(draft), weights), str(path / WEIGHTS_FILE))
    feature = info.get("kind") == "feature"
    config = {
        "format": FORMAT,
        "version": VERSION if feature else 1,  # readers before version 2 know only layer drafts
        "kind": "feature" if feature else "layers",
        "target": info["target"],
        "num_layers": len(draft.net.layers) if feature else len(_decoder(draft.hf).layers),
        "init_layers": info["init_layers"],
        "weights": weights,
        **(metadata or {}),
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path


def read_draft_config(path: str | Path) -> dict:
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise SMCDecodeError(f"no draft at {str(path)!r}: expected a directory with {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise SMCDecodeError(f"{str(file)!r} is not valid JSON ({e})") from None
    if config.get("format") != FORMAT:
        raise SMCDecodeError(f"{str(file)!r} is not a smcdecode draft (format {config.get('format')!r})")
    if config.get("version", 0) > VERSION:
        raise SMCDecodeError(
            f"{str(file)!r} has draft format version {config['version']}; this smcdecode reads up to {VERSION}: upgrade"
        )
    return config


def load_draft(target: HFModel, path: str | Path):
    """Load a draft saved by :func:`save_draft` onto ``target`` (it shares the target's embeddings
    and head, and takes the target's dtype and device): an :class:`HFModel` for a layer draft, a
    :class:`~smcdecode.drafts.feature.FeatureDraftModel` for a feature draft. A draft made for
    another target — another vocabulary, width or embedding table — is a :class:`SMCDecodeError`."""
    from safetensors.torch import load_file

    if not isinstance(target, HFModel):
        raise SMCDecodeError(f"target must be an HFModel (load_model(...)), got {type(target).__name__}")
    path = Path(path)
    config = read_draft_config(path)
    check_target(config.get("target", {}), target, where=f"draft {str(path)!r}")
    kind = config.get("kind", "layers")
    if kind not in ("layers", "feature"):
        raise SMCDecodeError(f"draft {str(path)!r} has kind {kind!r}; this smcdecode knows 'layers' and 'feature'")
    init = [int(i) for i in config["init_layers"]]
    if kind == "feature":
        from .feature import build_feature_draft

        draft = build_feature_draft(target, int(config["num_layers"]), init)
    else:
        draft = build_draft(target, int(config["num_layers"]), init)
    weights = path / WEIGHTS_FILE if path.is_dir() else path.parent / WEIGHTS_FILE
    state = _dequantize(load_file(str(weights)))
    load_own_state(draft, state)
    for p in own_parameters(draft):
        p.requires_grad_(False)
    draft_info(draft)["config"] = config
    draft.name = f"{target.name}-{'feature' if kind == 'feature' else 'distilled'}{config['num_layers']}"
    return draft


def load_default_draft(target: HFModel) -> HFModel:
    """The shipped draft for the built-in model (SmolLM2-135M-Instruct); a clear error for any
    other target (distil one with ``python -m smcdecode.distill``)."""
    if not isinstance(target, HFModel):
        raise SMCDecodeError(f"target must be an HFModel (load_model(...)), got {type(target).__name__}")
    for directory in DEFAULT_DRAFTS.values():
        if not (directory / CONFIG_FILE).is_file():
            continue
        saved = read_draft_config(directory)["target"]
        try:
            check_target(saved, target, where="the default draft")
        except SMCDecodeError:
            continue
        return load_draft(target, directory)
    names = ", ".join(DEFAULT_DRAFTS)
    raise SMCDecodeError(
        f"no shipped draft fits target {target.name!r} (drafts ship for: {names}): distil one with "
        "`python -m smcdecode.distill --target ... --prompts ... --out DIR` and load it with load_draft(target, DIR)"
    )


def proposal_temperature(draft, target_temperature: float) -> float:
    """The temperature to propose from ``draft`` for a target at ``target_temperature``: the
    saved draft's ``proposal_temperature_scale`` (draft.json) times it, else the target's own.
    A distilled draft is flatter than its target (trained on KL(p‖q), it spreads mass), so the
    shipped one proposes at 5/7 of the target's temperature (0.5 for 0.7), where SMC-SD's answers
    matched the target's mean log-likelihood on held-out prompts (docs/drafts.md, "Proposal
    temperature"). Any other model: ``target_temperature``."""
    config = draft_info(draft).get("config", {})
    scale = float(config.get("proposal_temperature_scale", 1.0))
    if not (scale > 0 and math.isfinite(scale)):
        raise SMCDecodeError(f"proposal_temperature_scale in the draft's draft.json must be > 0, got {scale!r}")
    return scale * target_temperature


def size_bytes(path: str | Path) -> int:
    path = Path(path)
    return sum(f.stat().st_size for f in (path / CONFIG_FILE, path / WEIGHTS_FILE) if f.exists())


__all__ = [
    "DEFAULT_DRAFTS",
    "build_draft",
    "check_target",
    "default_init_layers",
    "draft_info",
    "grow_draft",
    "grown_layout",
    "load_default_draft",
    "load_draft",
    "own_parameters",
    "own_state",
    "proposal_temperature",
    "read_draft_config",
    "save_draft",
    "target_fingerprint",
]
