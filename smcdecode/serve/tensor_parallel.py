"""``smcdecode serve --tensor-parallel N``: the target sharded over N ranks of this host.

The server's process is rank 0 and spawns ranks 1 … N−1 (``parallel.launch``: one GPU a rank under
NCCL, cuda:0 … cuda:N−1; CPU processes under gloo). Every rank reads only its shard of the target
(``parallel.load``: safetensors slices, GGUF rows) and the whole draft, then builds the same
engines and schedulers (``engine_executor.build_device``). Rank 0 serves HTTP; each scheduler
call it makes (submit, step, cancel, a batched exact-SD call) runs on every rank with the same
arguments and seeds, so every rank keeps the same particles, and the results are checked to agree
bit for bit (``parallel.Lockstep``). Rank 0 holds the tokenizer, not a Hugging Face model, so the
server answers plain requests (no constraint, seed or logprobs: those run through the public API on
a whole model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import SMCDecodeError
from ..models import HFModel


class TokenizerModel(HFModel):
    """What the HTTP layer needs of a model whose weights live on the ranks: its tokenizer (prompt
    ids, chat template, decoding), vocabulary, EOS token, context and name. It runs nothing."""

    def __init__(self, tokenizer, vocab_size: int, max_context: int, name: str, eos_token_id: int | None = None):
        self.hf, self.tokenizer, self.name = None, tokenizer, name
        self.vocab_size, self.max_context = int(vocab_size), int(max_context)
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            raise SMCDecodeError(f"model {name!r} defines no EOS token (neither its tokenizer nor "
                                 "generation_config.json): set eos_token_id in its tokenizer_config.json")
        self.eos_token_id = int(eos)

    @property
    def device(self):
        raise SMCDecodeError(f"model {self.name!r} is sharded over tensor-parallel ranks: rank 0 holds its "
                             "tokenizer only")

    def start(self, prefix_ids: list[int], batch: int):
        raise SMCDecodeError(f"model {self.name!r} is sharded over tensor-parallel ranks: it runs on the "
                             "engine's schedulers only (plain requests)")


def model_file(spec: str) -> str:
    """The weights behind ``--model``: 'smollm2' -> its GGUF file; a directory or .gguf as given."""
    from ..models import SMOLLM2_GGUF, _smollm2_dir

    if spec in ("smollm2", "default", "SmolLM2-135M-Instruct"):
        return str(_smollm2_dir() / SMOLLM2_GGUF)
    path = Path(spec).expanduser()
    if not (path.is_dir() or (path.suffix == ".gguf" and path.is_file())):
        raise SMCDecodeError(f"--model {spec!r} with --tensor-parallel: give 'smollm2', a Hugging Face model "
                             "directory (config.json + *.safetensors) or a .gguf file")
    return str(path)


def tokenizer_model(spec: str, reader) -> TokenizerModel:
    """The ``TokenizerModel`` of ``--model spec`` (``reader``: its ``shards`` reader, for the config)."""
    import json

    from transformers import AutoTokenizer

    from ..models import _quiet_loading, chatml_eos

    path = Path(model_file(spec))
    name = "SmolLM2-135M-Instruct" if spec in ("smollm2", "default", "SmolLM2-135M-Instruct") else path.stem \
        if path.suffix == ".gguf" else path.name
    gguf = path if path.suffix == ".gguf" else getattr(reader, "path", None)
    eos = None
    with _quiet_loading():
        if gguf is not None:
            gguf = Path(gguf)
            tok = chatml_eos(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
        else:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            gen = path / "generation_config.json"
            if tok.eos_token_id is None and gen.is_file():
                eos = json.loads(gen.read_text()).get("eos_token_id")
                eos = eos[0] if isinstance(eos, list) else eos
    cfg = reader.config
    return TokenizerModel(tok, cfg.vocab_size, cfg.max_position, name, eos)


class _FirstLayers:
    """A ``shards`` reader of a model's first ``n`` layers (with its final norm and head)."""

    def __init__(self, reader, n: int):
        self.reader, self.config = reader, dataclasses.replace(reader.config, n_layers=n)

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def read(self, name: str, *slices):
        return self.reader.read(name, *slices)


def draft_reader(spec: str, target_file: str, target_layers: int):
    """The ``shards`` reader of ``--draft spec`` under tensor parallelism (every rank reads it whole)."""
    from ..backends.engine.shards import reader_for

    if spec.startswith("truncated:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise SMCDecodeError(f"--draft {spec!r}: write truncated:L with an integer L, e.g. truncated:8") from None
        if not 1 <= n < target_layers:
            raise SMCDecodeError(f"--draft {spec!r}: L must be in [1, {target_layers - 1}] for a "
                                 f"{target_layers}-layer target")
        return _FirstLayers(reader_for(target_file), n)
    path = Path(spec).expanduser()
    if spec in ("default", "target") or (path / "draft.json").is_file():
        raise SMCDecodeError(f"--draft {spec!r} with --tensor-parallel: every rank loads the draft whole from a model "
                             "directory (config.json + *.safetensors), a .gguf file, or the target's first L layers "
                             "(truncated:L); the shipped and distilled drafts and 'target' are not supported with "
                             "tensor parallelism")
    if not (path.is_dir() or path.suffix == ".gguf"):
        raise SMCDecodeError(f"--draft {spec!r}: no such model directory or .gguf file")
    return reader_for(path)


def rank_llamas(tp, target_file: str, draft_spec: str, dtype_name: str, threads: int | None):
    """One rank's (target shard, whole draft): run on every rank by ``parallel.launch``."""
    import torch

    from ..backends.engine import parallel
    from ..backends.engine.shards import reader_for

    if threads is not None and tp.device.type == "cpu":
        torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    reader = reader_for(target_file)
    target = parallel.build(reader, tp, dtype)
    one = parallel.TensorParallel(0, 1, tp.device)
    draft = parallel.build(draft_reader(draft_spec, target_file, reader.config.n_layers), one, dtype)
    return target, draft


def build_executor(args, limits, defaults):
    """The ``SchedulerExecutor`` over ``args.tensor_parallel`` ranks (see the module docstring)."""
    import torch

    from ..backends.engine import parallel
    from ..backends.engine.shards import reader_for
    from ..devices import check_dtype
    from .engine_executor import SchedulerExecutor

    world = args.tensor_parallel
    if args.backend == "reference":
        raise SMCDecodeError("--tensor-parallel runs the engine: drop --backend reference (or use --backend engine)")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise SMCDecodeError(f"--device {device!r} with --tensor-parallel: use 'cuda' (rank r on cuda:r; choose the "
                             "GPUs with CUDA_VISIBLE_DEVICES) or 'cpu' (gloo)")
    if device == "cuda" and world > torch.cuda.device_count():
        raise SMCDecodeError(f"--tensor-parallel {world} needs {world} GPUs; {torch.cuda.device_count()} are visible: "
                             "lower it or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    dtype = check_dtype(args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    target_file = model_file(args.model)
    reader = reader_for(target_file)  # the config and tokenizer only: the weights stay on disk here
    parallel.check_shardable(reader.config, world)
    draft_reader(args.draft, target_file, reader.config.n_layers)  # the draft's errors before any rank starts
    model = tokenizer_model(args.model, reader)
    lock = parallel.launch(world, rank_llamas, target_file, args.draft, str(dtype).removeprefix("torch."),
                           args.threads, backend="nccl" if device == "cuda" else "gloo")
    try:
        return SchedulerExecutor(model, args.served_model_name or model.name, None, limits=limits,
                                 defaults=defaults, max_queue=args.max_queue, slots=args.slots,
                                 max_particles=args.engine_particles, max_block_size=args.max_block_size,
                                 context=args.engine_context, lockstep=lock,
                                 stream_interval=getattr(args, "stream_interval", 0.02))
    except BaseException:
        lock.close()
        raise
