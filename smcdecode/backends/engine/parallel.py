"""Tensor parallelism for the engine's target: one Llama sharded over the GPUs of one host with
torch.distributed (NCCL on CUDA, gloo on CPU), applied to the plain modules after they are built
(gpt-fast's way), so model.py stays one model.

Each of the ``world`` ranks holds:

    wqkv   column-parallel: its H/world query heads and Hkv/world key/value heads (q, k, v rows)
    wo     row-parallel: the input columns of those heads; partial sums, all-reduced (one a layer)
    w13    column-parallel: its I/world rows of gate and of up (kept [gate; up])
    w2     row-parallel: those I/world input columns; partial sums, all-reduced (one a layer)
    output vocab-parallel: V/world rows of the head; the logits all-gathered, so every rank has the
           identical full [B, L, V] (replicated when world does not divide V)
    embedding, norms: replicated

so the target's KV pool (``KVPool.for_model(model.cfg, ...)``: the model's ``cfg`` is its shard's)
holds Hkv/world heads on each rank. The draft is replicated: every rank runs it in full. Sampling,
weights and resampling run on every rank from the same seed over the same full logits, so every
rank keeps the same particles without exchanging them; ``Lockstep`` checks that after each call.

Why an all-gathered vocab-parallel head rather than a replicated one: the head is the largest
single product of the verify pass (Llama-3.1-70B: 2.1 GB of weights; 8B: 1.05 GB); sharding it
reads 1/world of it, and the gather moves only the rows' logits (72 rows × 128,256 in bf16 =
18 MB for N=8, K=8), which takes less time than reading the rest of the head.

Loading reads each rank's slices only (``shards.py``: safetensors slices, GGUF rows dequantised
alone, or random weights); ``shard`` applies the same split to a model already in memory.

Launch, under torchrun (one process a GPU)::

    tp = parallel.init()                                    # RANK, WORLD_SIZE, LOCAL_RANK from torchrun
    target = parallel.load("Llama-3.1-70B/", tp)            # this rank's shard, on cuda:LOCAL_RANK
    draft = Llama.from_safetensors("Llama-3.2-1B/", device=tp.device)
    engine = Engine(target, draft, num_pages=..., max_context=...)
    if tp.rank == 0:
        with Lockstep(engine, tp) as lock:
            out = lock.smc_sd(prompts, particles=8, block_size=8, max_new_tokens=256)
    else:
        follow(engine, tp)

or from one process with ``launch(world, build, *args)`` (it spawns ranks 1..world-1 and returns
rank 0's ``Lockstep``; ``smcdecode serve --tensor-parallel N`` is this call).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...errors import SMCDecodeError
from . import ops
from .model import Llama, LlamaConfig, rope_inv_freq
from .shards import StateDictReader, reader_for

_ALL = slice(None)
# (torch 2.13 renamed all_gather_into_tensor; the GPU machines' 2.11 has only the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``world``, its ``device``, the
    process ``group`` of the model's collectives (None: the default group) and ``control``, a gloo
    group for host messages (``Lockstep``)."""

    rank: int
    world: int
    device: torch.device
    group: object = None
    control: object = None

    def all_reduce(self, partial: Tensor | ops.SplitSum, dtype: torch.dtype) -> Tensor:
        """The sum over ranks of a row-parallel product's partial sums (a block's wo or w2), in ``dtype``."""
        y = partial.total(dtype) if isinstance(partial, ops.SplitSum) else partial.contiguous()
        dist.all_reduce(y, group=self.group)
        return y

    def gather_vocab(self, logits: Tensor) -> Tensor:
        """Each rank's vocabulary shard of the logits [..., V/world] -> the full logits [..., V], the
        same bytes on every rank."""
        parts = logits.new_empty((self.world * logits.shape[0], *logits.shape[1:]))  # ranks' shards along dim 0
        _all_gather(parts, logits.contiguous(), group=self.group)
        return parts.view(self.world, *logits.shape).movedim(0, -2).reshape(*logits.shape[:-1], -1)


def init(backend: str | None = None, *, rank: int | None = None, world: int | None = None,
         init_method: str | None = None, timeout: float | None = None) -> TensorParallel:
    """This process's ``TensorParallel``, starting the default process group if none is.

    Under torchrun every argument comes from its environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); ``launch`` passes them. ``backend``: "nccl" (one GPU a rank,
    cuda:LOCAL_RANK) where CUDA is available, else "gloo" (CPU). ``timeout``: seconds a collective
    may wait for the other ranks before it fails (torch's default: 10 minutes for NCCL, 30 for
    gloo); it applies to the control group too. The communicators are created here, outside any
    CUDA-graph capture."""
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise SMCDecodeError(f"timeout must be a positive number of seconds, got {timeout!r}")
    limit = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend not in ("nccl", "gloo"):
            raise SMCDecodeError(f"tensor-parallel backend {backend!r}: use 'nccl' (GPUs) or 'gloo' (CPU)")
        kw = {}
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
            if local >= torch.cuda.device_count():
                raise SMCDecodeError(f"rank {local} has no GPU ({torch.cuda.device_count()} visible): run at most "
                                     "one rank a GPU (--nproc-per-node <= the GPU count)")
            torch.cuda.set_device(local)
            kw["device_id"] = torch.device("cuda", local)  # eager communicator (capturable collectives)
        dist.init_process_group(backend, init_method=init_method, rank=-1 if rank is None else rank,
                                world_size=-1 if world is None else world, **kw, **limit)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    control = dist.new_group(backend="gloo", **limit) if backend == "nccl" else None
    tp = TensorParallel(dist.get_rank(), dist.get_world_size(), device, None, control)
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)
    if int(warm.item()) != tp.world:
        raise SMCDecodeError(f"tensor-parallel all-reduce of ones gave {warm.item()} on rank {tp.rank}, not "
                             f"{tp.world}: the process group is broken")
    return tp


# ----------------------------------------------------------------------------------------------
# sharded models


def check_shardable(cfg: LlamaConfig, world: int) -> None:
    """SMCDecodeError unless ``world`` ranks split the heads and the MLP evenly."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise SMCDecodeError(f"tensor_parallel must be a positive integer (GPUs of the target), got {world!r}")
    for what, n in (("attention heads", cfg.n_heads), ("key/value heads", cfg.n_kv_heads),
                    ("MLP width (intermediate_size)", cfg.intermediate_size)):
        if n % world:
            ok = [d for d in range(1, min(cfg.n_heads, 8) + 1)
                  if cfg.n_heads % d == 0 and cfg.n_kv_heads % d == 0 and cfg.intermediate_size % d == 0]
            raise SMCDecodeError(f"tensor_parallel={world} does not divide the target's {n} {what}: use one of {ok}")


def local_config(cfg: LlamaConfig, world: int) -> LlamaConfig:
    """The config of one rank's shard: H/world heads, Hkv/world KV heads, I/world MLP width; the
    model width, head dim and (gathered) vocabulary unchanged."""
    check_shardable(cfg, world)
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // world, n_kv_heads=cfg.n_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world,
                               extra={**cfg.extra, "tensor_parallel": world})


def build(reader, tp: TensorParallel, dtype: torch.dtype = torch.bfloat16, device=None) -> Llama:
    """This rank's shard of the model ``reader`` reads (``shards.py``), with the collectives attached
    (none at world 1: then it is the plain model, as ``Llama.from_state_dict`` builds it)."""
    cfg, w, r = reader.config, tp.world, tp.rank
    device = torch.device(device) if device is not None else tp.device
    lc = local_config(cfg, w)
    vocab_parallel = w > 1 and cfg.vocab_size % w == 0
    with torch.device("meta"):
        model = Llama(lc)
        if vocab_parallel:
            model.output = nn.Linear(cfg.dim, cfg.vocab_size // w, bias=False)
    model = model.to(dtype).to_empty(device=device)
    H, Hkv, D, F, V = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size

    def mine(n: int) -> slice:  # this rank's share of n rows (or columns)
        return slice(r * n // w, (r + 1) * n // w)

    def read(name: str, rows: slice = _ALL, cols: slice = _ALL) -> Tensor:
        return reader.read(name, rows, cols).to(device=device, dtype=dtype)

    qr, kvr, ir = mine(H * D), mine(Hkv * D), mine(F)
    with torch.no_grad():
        emb = model.tok_embeddings.weight
        emb.copy_(read("model.embed_tokens.weight"))
        model.norm.weight.copy_(read("model.norm.weight"))
        vr = mine(V) if vocab_parallel else _ALL
        if cfg.tie_embeddings:
            model.output.weight = emb if vr == _ALL else nn.Parameter(emb.detach()[vr], requires_grad=False)
        else:
            head = "lm_head.weight" if reader.has("lm_head.weight") else "model.embed_tokens.weight"
            model.output.weight.copy_(read(head, vr))
        for i, blk in enumerate(model.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            blk.wqkv.weight.copy_(torch.cat([read(a + "q_proj.weight", qr), read(a + "k_proj.weight", kvr),
                                             read(a + "v_proj.weight", kvr)]))
            if cfg.attention_bias:
                blk.wqkv.bias.copy_(torch.cat([read(a + "q_proj.bias", qr), read(a + "k_proj.bias", kvr),
                                               read(a + "v_proj.bias", kvr)]))
            blk.wo.weight.copy_(read(a + "o_proj.weight", _ALL, qr))
            blk.w13.weight.copy_(torch.cat([read(m + "gate_proj.weight", ir), read(m + "up_proj.weight", ir)]))
            blk.w2.weight.copy_(read(m + "down_proj.weight", _ALL, ir))
            blk.attention_norm.weight.copy_(read(f"model.layers.{i}.input_layernorm.weight"))
            blk.ffn_norm.weight.copy_(read(f"model.layers.{i}.post_attention_layernorm.weight"))
    model.inv_freq = rope_inv_freq(cfg).to(device)
    model.tensor_parallel = tp
    if w > 1:
        for blk in model.layers:
            blk.reduce = functools.partial(tp.all_reduce, dtype=dtype)
        if vocab_parallel:
            model.register_forward_hook(lambda module, args, logits: tp.gather_vocab(logits))
    return model.eval()


def shard(model: Llama, tp: TensorParallel) -> Llama:
    """This rank's shard of a whole ``Llama`` already in memory (same dtype; on ``tp.device``). The
    caller drops the whole model afterwards to free it."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise SMCDecodeError("the model is already sharded (parallel.shard / load): shard the whole model once")
    return build(StateDictReader.of_llama(model), tp, dtype=next(model.parameters()).dtype)


def from_hf(hf_model, tp: TensorParallel, dtype: torch.dtype = torch.bfloat16) -> Llama:
    """This rank's shard of a loaded ``transformers`` Llama-family model (or ``smcdecode.models.HFModel``)."""
    hf_model = getattr(hf_model, "hf", hf_model)
    return build(StateDictReader(LlamaConfig.from_hf(hf_model.config), hf_model.state_dict()), tp, dtype)


def load(path: str, tp: TensorParallel, dtype: torch.dtype = torch.bfloat16) -> Llama:
    """This rank's shard of a Hugging Face directory (config.json + *.safetensors) or a .gguf file,
    reading only its slices of each weight (and the replicated embedding and norms)."""
    return build(reader_for(path), tp, dtype)


def random(cfg: LlamaConfig, tp: TensorParallel, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Llama:
    """This rank's shard of a random-weight model at ``cfg``'s shapes (``shards.RandomReader``: the
    same model for every world size)."""
    from .shards import RandomReader

    return build(RandomReader(cfg, seed, tp.device), tp, dtype)


# ----------------------------------------------------------------------------------------------
# running an Engine on every rank


def digest(value) -> str:
    """A hash of the tensors, arrays, integers and strings in a result (nested dataclasses, lists,
    tuples, dicts), bit for bit: equal on every rank when the ranks agree. Python floats are left
    out (they hold timings, e.g. ``EngineOutput.host_s``)."""
    h = hashlib.sha256()

    def walk(v):
        if isinstance(v, Local):  # rank 0's objects inside stay out: the key is what every rank has
            h.update(f"Local{v.key}".encode())
        elif isinstance(v, Tensor):
            h.update(f"{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, np.ndarray):
            h.update(f"{v.dtype}{v.shape}".encode() + np.ascontiguousarray(v).tobytes())
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (int, str, bytes)):
            h.update(repr(v).encode())

    walk(value)
    return h.hexdigest()


def agree(tp: TensorParallel, value) -> None:
    """SMCDecodeError on every rank unless every rank's ``value`` has the same ``digest``."""
    mine = digest(value)
    every = [None] * tp.world
    dist.all_gather_object(every, mine, group=tp.control)
    if len(set(every)) > 1:
        raise SMCDecodeError(f"tensor-parallel ranks disagree on a result (digests by rank: "
                             f"{[d[:12] for d in every]}): the ranks' particles diverged")


class Local(tuple):
    """A tuple that stays on rank 0: sent to the other ranks (pickled) it arrives empty, with only its
    integer ``key``; it compares and hashes by ``key``, and ``digest`` sees only the key. Request ids
    that hold rank 0's objects (a server's job) travel with ``Lockstep`` calls this way."""

    key: int

    def __new__(cls, key: int, items=()):
        self = super().__new__(cls, items)
        self.key = key
        return self

    def __reduce__(self):
        return (Local, (self.key,))

    def __eq__(self, other) -> bool:
        return isinstance(other, Local) and other.key == self.key

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((Local, self.key))


def _exchange(tp: TensorParallel, message=None):
    box = [message]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]


def _call(engine, state: dict, message):
    name, args, kwargs = message
    if callable(name):  # Lockstep.run: a module-level function of (engine, state, ...)
        return name(engine, state, *args, **kwargs)
    return getattr(engine, name)(*args, **kwargs)


class Lockstep:
    """Rank 0's handle on an :class:`~.engine.Engine` whose target is sharded: every call is sent to
    the other ranks (which run ``follow``) and run on all of them at once, with the same arguments
    (seeds included); each returns rank 0's result after checking (``check``, default on) that every
    rank's result is bit for bit the same (``agree``). Arguments must pickle.

    ``smc_sd``, ``speculative``, ``autoregressive``, ``serve`` and ``clear_graphs`` are the Engine's;
    ``run(fn, *args)`` calls a module-level ``fn(engine, state, *args)`` on every rank, ``state`` a
    dict each rank keeps between calls (a ``Scheduler`` for a server: ``state["sched"] =
    Scheduler(engine, ...)``, then ``submit`` / ``step`` through ``run``). ``close`` (or leaving a
    ``with`` block) releases the other ranks."""

    def __init__(self, engine, tp: TensorParallel, check: bool = True, processes: list | None = None):
        if tp.rank != 0:
            raise SMCDecodeError(f"Lockstep runs on rank 0 (this is rank {tp.rank}): the other ranks call follow()")
        self.engine, self.tp, self.check = engine, tp, check
        self.state: dict = {}
        self._processes = processes or []
        self._open = True

    def _send(self, name, args, kwargs):
        if not self._open:
            raise SMCDecodeError("this Lockstep is closed: start the ranks again (launch / torchrun)")
        _exchange(self.tp, (name, args, kwargs))
        try:
            out = _call(self.engine, self.state, (name, args, kwargs))
        except Exception as e:
            if self.check:
                agree(self.tp, repr(type(e)).encode().hex())  # the others fail alike, or the check names it
            raise
        if self.check:
            agree(self.tp, out)
        return out

    def run(self, fn, *args, **kwargs):
        return self._send(fn, args, kwargs)

    def smc_sd(self, *args, **kwargs):
        return self._send("smc_sd", args, kwargs)

    def speculative(self, *args, **kwargs):
        return self._send("speculative", args, kwargs)

    def autoregressive(self, *args, **kwargs):
        return self._send("autoregressive", args, kwargs)

    def serve(self, *args, **kwargs):
        return self._send("serve", args, kwargs)

    def clear_graphs(self):
        return self._send("clear_graphs", (), {})

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                _exchange(self.tp, None)
            except RuntimeError:  # a rank is gone already (killed): end the others
                for p in self._processes:
                    p.terminate()
            for p in self._processes:
                p.join(timeout=60)
            if self._processes:
                dist.destroy_process_group()

    def __enter__(self) -> Lockstep:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _on_held(engine, state: dict, key: str, method: str, *args, **kwargs):
    return getattr(state[key], method)(*args, **kwargs)


class Replica:
    """Rank 0's handle on an object that every rank keeps in its ``Lockstep`` state under ``key``
    (made there by a ``Lockstep.run`` call): the methods named in ``calls`` run on every rank with the
    same arguments (through ``Lockstep.run``, checked by ``agree``); every other attribute is read
    from rank 0's own copy, which is the same as the others' (reads change nothing)."""

    def __init__(self, lock: Lockstep, key: str, calls: tuple[str, ...]):
        self._lock, self._key, self._calls = lock, key, frozenset(calls)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # (not set yet, e.g. during copying: no lookup through the state)
            raise AttributeError(name)
        if name in self._calls:
            return functools.partial(self._lock.run, _on_held, self._key, name)
        return getattr(self._lock.state[self._key], name)


class SharedScheduler(Replica):
    """Rank 0's handle on the :class:`~.scheduler.Scheduler` every rank keeps under ``key``: submit,
    step and cancel run on every rank; a request's ``id`` (a server's job, say) stays on rank 0 and
    reaches the other ranks as a number (``Local``)."""

    def __init__(self, lock: Lockstep, key: str):
        super().__init__(lock, key, ("step", "cancel"))
        self._ids = 0

    def submit(self, request) -> None:
        self._ids += 1
        request = dataclasses.replace(request, id=Local(self._ids, request.id))
        return self._lock.run(_on_held, self._key, "submit", request)


def follow(engine, tp: TensorParallel, check: bool = True) -> None:
    """Ranks 1..world-1: run the calls rank 0 makes through its ``Lockstep`` until it closes. A call
    that raises here raised on rank 0 as well (same code, same arguments); its error is rank 0's to
    report, and this rank waits for the next call."""
    state: dict = {}
    while True:
        message = _exchange(tp)
        if message is None:
            return
        try:
            out = _call(engine, state, message)
        except Exception as e:
            out = repr(type(e)).encode().hex()
            if not check:
                continue
        if check:
            agree(tp, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)  # rank 0 is gone (killed): nothing will send this rank another call


def _rank_main(rank: int, world: int, address: str, backend: str | None, build_engine, args, check: bool,
               timeout: float | None) -> None:
    # NOTE: Ctrl-C (or a signal to the process group) reaches every rank; only rank 0 shuts down,
    # releasing this one (close), and this rank exits by itself should rank 0 die instead
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    tp = init(backend, rank=rank, world=world, init_method=address, timeout=timeout)
    try:
        follow(build_engine(tp, *args), tp, check)
    finally:
        dist.destroy_process_group()
    # NOTE: no interpreter teardown after a clean close: a gloo rank's exit after
    # destroy_process_group aborted now and then ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(world: int, build_engine, *args, backend: str | None = None, check: bool = True,
           timeout: float | None = None) -> Lockstep:
    """Start a tensor-parallel group of ``world`` ranks on this host from one process: this process
    is rank 0 and ``world - 1`` processes are spawned (one a GPU: cuda:0 .. cuda:world-1 under NCCL).
    Every rank builds its engine with ``build_engine(tp, *args)`` (a module-level function, so it
    pickles: e.g. ``parallel.load`` the target, load the draft, return ``Engine(...)``). Returns rank
    0's ``Lockstep``; ``close()`` ends the other ranks and the process group, and a spawned rank
    exits by itself when this process dies. ``timeout``: as ``init``'s; the other ranks wait for
    rank 0's next call under it, so an idle rank 0 sends one (``Lockstep.run`` of a no-op) more
    often than that."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise SMCDecodeError(f"tensor_parallel must be a positive integer (GPUs of the target), got {world!r}")
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        if world > torch.cuda.device_count():
            raise SMCDecodeError(f"tensor_parallel={world} needs {world} GPUs; {torch.cuda.device_count()} are "
                                 "visible: lower it or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    import torch.multiprocessing as mp

    address = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    processes = [ctx.Process(target=_rank_main, args=(r, world, address, backend, build_engine, args, check,
                                                      timeout), daemon=True) for r in range(1, world)]
    for p in processes:
        p.start()
    tp = init(backend, rank=0, world=world, init_method=address, timeout=timeout)
    return Lockstep(build_engine(tp, *args), tp, check, processes)
