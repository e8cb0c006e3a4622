"""``smcdecode serve``: load a model (and a draft) and serve it over the OpenAI API."""

from __future__ import annotations

import argparse
import sys

from ..errors import SMCDecodeError
from .protocol import Defaults, Limits


def parser() -> argparse.ArgumentParser:
    from ..cli_common import HelpFormatter, Parser

    p = Parser(
        prog="smcdecode serve",
        formatter_class=HelpFormatter,
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics). Requests choose the strategy (smc, sd, ar) and its settings in the "
        "body (the openai client's extra_body); the options below set the model, the defaults and the limits. "
        "See docs/server.md.",
    )
    p.add_argument("--model", default="smollm2",
                   help="target model: 'smollm2' (built-in SmolLM2-135M-Instruct), a local Hugging Face directory, "
                   "or a .gguf file")
    p.add_argument("--draft", default="default",
                   help="draft for smc and sd: 'default' (the built-in draft of the default model), 'truncated:L' "
                   "(the target's first L layers), 'target' (no draft: smc proposes from the target, sd is refused), "
                   "a distilled draft directory, or a model directory/.gguf sharing the target's tokenizer")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "engine"],
                   help="what runs the models: 'reference' (eager, any model, one request at a time) or 'engine' "
                   "(the GPU engine; plain SMC requests are batched by its scheduler, the others run one at a "
                   "time); 'auto' is 'engine' on a CUDA device with a Llama-family model, else 'reference'")
    p.add_argument("--device", default="auto", help="torch device: cpu, cuda, cuda:N; 'auto' is cuda when a "
                   "GPU is visible, else cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (requests' 'model', /v1/models); default: the model's own name")
    p.add_argument("--strategy", default="smc", choices=["smc", "sd", "ar"],
                   help="strategy of requests that name none")
    p.add_argument("--particles", type=int, default=4, help="particles N of SMC requests that give none")
    p.add_argument("--block-size", type=int, default=4, help="draft tokens per round K of requests that give none")
    p.add_argument("--resampler", default="systematic",
                   choices=["multinomial", "stratified", "systematic", "residual"],
                   help="resampling scheme of SMC requests that name none")
    p.add_argument("--ess-threshold", type=float, default=0.5,
                   help="resample when ESS < τ·N, for SMC requests that give none")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait to run; one more gets HTTP 429")
    p.add_argument("--max-particles", type=int, default=64, help="most particles one request may ask for")
    p.add_argument("--max-block-size", type=int, default=16, help="largest block size one request may ask for")
    p.add_argument("--max-n", type=int, default=8, help="most choices (n) one request may ask for")
    p.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens one request may ask for")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of chat requests that give none (completions: 16, as the OpenAI API)")
    p.add_argument("--slots", type=int, default=8,
                   help="SMC requests (each choice of n is one) whose rounds run together: on the engine in one "
                        "batch, on the reference backend one after another between joins and leaves; engine: also "
                        "the AR choices the AR scheduler runs together")
    p.add_argument("--engine-particles", type=int, default=8,
                   help="engine: most particles of a request the scheduler batches (more run on their own); "
                   "its KV pool holds slots x engine-particles sequences of --engine-context tokens")
    p.add_argument("--engine-context", type=int, default=2048,
                   help="engine: most tokens (prompt + output + a block) of a request the scheduler batches")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the target over N ranks of this host (one GPU each, cuda:0..N-1 over NCCL; CPU "
                   "processes over gloo with --device cpu): attention heads, KV cache and MLP split by rank, the "
                   "draft whole on every rank. N must divide the target's attention heads, key/value heads and "
                   "MLP width. The draft must then be a model directory, a .gguf file or truncated:L, and the "
                   "server answers plain requests (no constraint, seed or logprobs). See docs/engine.md")
    p.add_argument("--stream-interval", type=float, default=0.02, metavar="SECONDS",
                   help="GPU engine: a streamed choice gets new text at most this often (its first text and its "
                        "end at once); 0 sends after every round")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: as smcdecode generate)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    return p


def _check(args) -> None:
    for flag in ("particles", "block_size", "max_queue", "max_particles", "max_block_size", "max_n", "max_tokens",
                 "default_max_tokens", "slots", "engine_particles", "engine_context", "tensor_parallel"):
        if getattr(args, flag) < 1:
            raise SMCDecodeError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.port < 65536:
        raise SMCDecodeError(f"--port must lie in [0, 65536), got {args.port}")
    if not 0.0 <= args.ess_threshold <= 1.0:
        raise SMCDecodeError(f"--ess-threshold must lie in [0, 1], got {args.ess_threshold}")
    if args.particles > args.max_particles or args.block_size > args.max_block_size:
        raise SMCDecodeError("--particles and --block-size must not exceed --max-particles and --max-block-size")


def load_draft_model(spec: str, model, device):
    """The draft model for ``--draft`` (None for 'target')."""
    from pathlib import Path

    import smcdecode as sd

    if spec == "target":
        return None
    if spec == "default":
        return sd.load_default_draft(model)
    if spec.startswith("truncated:"):
        try:
            layers = int(spec.split(":", 1)[1])
        except ValueError:
            raise SMCDecodeError(f"--draft {spec!r}: write truncated:L with an integer L, e.g. truncated:8") from None
        return sd.truncated_draft(model, layers)
    if (Path(spec) / "draft.json").is_file():
        return sd.load_draft(model, spec)
    return sd.load_model(spec, device=device)


def build(args):
    """(the ASGI app, its executor) for parsed ``args``."""
    from . import require_http_stack

    require_http_stack()  # before anything imports the HTTP stack
    import torch

    import smcdecode as sd

    from .app import create_app
    from .library_executor import LibraryExecutor
    from .watch import WatchedModel

    _check(args)
    limits = Limits(max_particles=args.max_particles, max_block_size=args.max_block_size, max_n=args.max_n,
                    max_tokens=args.max_tokens, default_max_tokens=args.default_max_tokens)
    defaults = Defaults(strategy=args.strategy, particles=args.particles, block_size=args.block_size,
                        resampler=args.resampler, ess_threshold=args.ess_threshold)
    if args.tensor_parallel > 1:
        from .tensor_parallel import build_executor

        executor = build_executor(args, limits, defaults)
        executor.setup = f"the engine over {args.tensor_parallel} ranks, draft {args.draft}"
        return create_app(executor, limits=limits, defaults=defaults), executor
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
    model = sd.load_model(args.model, device=device, dtype=dtype, threads=args.threads)
    draft = load_draft_model(args.draft, model, device)
    backend = args.backend
    if backend == "auto":
        kind = getattr(getattr(model.hf, "config", None), "model_type", None)
        backend = "engine" if str(device).startswith("cuda") and kind == "llama" else "reference"
    watched = WatchedModel(model)
    name = args.served_model_name or model.name
    common = {"limits": limits, "defaults": defaults, "max_queue": args.max_queue}
    if backend == "engine" and draft is not None:
        from .engine_executor import SchedulerExecutor

        executor = SchedulerExecutor(watched, name, draft, slots=args.slots, max_particles=args.engine_particles,
                                     max_block_size=args.max_block_size, context=args.engine_context,
                                     stream_interval=args.stream_interval, **common)
    else:
        options = {"device": device} if backend != "reference" else None
        executor = LibraryExecutor(watched, name, draft, backend=backend, engine_options=options, slots=args.slots,
                                   **common)
    executor.setup = (f"the {backend} backend on {device} ({dtype}), "
                      + (f"draft {args.draft}" if draft is not None else "no draft (smc proposes from the target)"))
    return create_app(executor, limits=limits, defaults=defaults), executor


def check_port(host: str, port: int) -> None:
    """Refuse a --host / --port this process cannot listen on, before any model loads."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise SMCDecodeError(f"--host {host!r}: cannot resolve it ({e}): give an address such as 127.0.0.1") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the server's own socket: TIME_WAIT is fine)
        try:
            s.bind(address)
        except OSError as e:
            raise SMCDecodeError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}): give another "
                                 "--port, or stop what uses it") from None


def main(argv: list[str] | None = None) -> int:
    from ..cli_common import one_line

    args = parser().parse_args(argv)
    try:
        check_port(args.host, args.port)
        app, executor = build(args)
    except SMCDecodeError as e:
        print(f"smcdecode serve: error: {one_line(e)}", file=sys.stderr)
        return 2
    import uvicorn

    print(f"smcdecode serve: {executor.model_name} ({executor.setup}) on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
