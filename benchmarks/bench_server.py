"""The OpenAI-compatible server on the GPU engine against the engine's offline figure, same run.

Random-weight Llama-3.1-8B (target) / Llama-3.2-1B (draft) shapes in bf16 (``--target`` /
``--draft`` pick other presets), prompts of random token ids, outputs of a fixed length (EOS
ignored). For SMC-SD, exact speculative decoding (SD) and autoregressive sampling (AR), with 8 and
32 concurrent clients (``--clients``), each sending ``--rounds`` streamed requests one after
another through HTTP (the ``openai`` client), it measures

- throughput through HTTP (tokens of all returned choices / wall time; each client runs in a
  process of its own (``--clients-per-process``), as independent applications' would; the median
  of three passes, ``--variants``: passes differ by up to 6 points in our runs) against two offline
  figures for the same requests:
  the engine's dedicated call (``Engine.serve`` with as many slots as clients for SMC-SD; batched
  ``Engine.speculative`` / ``Engine.autoregressive`` calls of ``clients`` prompts for SD / AR) and
  the server's own request loop without HTTP (``same_loop``: a Scheduler with the settings of the
  executor's lane, sharing its engine and captured rounds, driven directly with ``clients``
  requests in flight). HTTP / same loop is the cost of the HTTP layer and the executor; same loop /
  dedicated is the cost of requests joining one by one against calls of ``clients`` requests
  submitted at once (the same exact-only request loop for SD and AR);
- where the executor's device thread spent the HTTP pass (``device_thread_s``: the schedulers'
  steps, streaming, finishing choices, handing events over, waiting for requests) and its waits for
  work (``idle_waits``: the one the first request ended, the later ones);
- p50 / p99 time to the first streamed token, and p50 / p99 per-request tokens per second.

Every response is checked as it comes: status 200, exactly ``--max-tokens`` completion tokens,
finish_reason "length", streamed pieces that concatenate to a text of that many tokens. Before each
timed pass an untimed warm-up meets the round shapes it will meet (``warm_up``); the JSON records the
round shapes first met inside each timed pass (``new_round_shapes_in_timed_pass``: 0 when no CUDA
graph was captured inside the measurement) and a warning is printed otherwise.

    python benchmarks/bench_server.py          # one NVIDIA GPU, no network; writes benchmarks/results/server.json
    python benchmarks/bench_server.py --tiny --out /tmp/server.json   # a 2-layer toy on the CPU (a smoke test)

Needs, besides torch / triton / transformers: starlette, uvicorn, h11, anyio, sniffio, idna,
typing_extensions, click (uvicorn) and openai, httpx2, httpcore2, certifi, distro, jiter, pydantic,
pydantic_core, annotated_types, typing_inspection (the client).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import socket
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smcdecode.backends.engine import PRESETS, EngineTarget, Llama, LlamaConfig, Request, Scheduler  # noqa: E402
from smcdecode.models import Model  # noqa: E402
from smcdecode.serve.app import create_app  # noqa: E402
from smcdecode.serve.engine_executor import SchedulerExecutor  # noqa: E402
from smcdecode.serve.protocol import Defaults, Limits  # noqa: E402


class Vocabulary(Model):
    """Token ids as text ("<17>"): enough of a tokenizer to serve models with random weights
    (prompts are sent as token ids). No token ends a sequence: outputs run to max_tokens."""

    def __init__(self, vocab_size: int, max_context: int):
        self.name, self.vocab_size, self.max_context = "random-llama", vocab_size, max_context
        self.eos_token_id = -1  # (no token id: EOS is ignored)

    def decode(self, ids) -> str:
        return "".join(f"<{i}>" for i in ids if i != self.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.replace("<", " ").replace(">", " ").split()]


# the HTTP passes ``--variants`` can ask for: "streamed" (``stream``: text as it becomes final, the
# figures of the table) and "unstreamed" (the whole text in one response at the end)
VARIANTS = {"streamed": True, "unstreamed": False}

TINY = LlamaConfig(512, 64, 2, 4, 2, 128)  # --tiny: target and draft, on the CPU


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_clients(base: str, model: str, prompts: list[list[int]], ks: list[int], rounds: int, body: dict,
                       max_tokens: int, stream: bool, ready) -> dict:
    """Clients ``ks``, each sending ``rounds`` requests one after another, once every process of
    the pass waits at ``ready`` (a barrier shared by them) with its client built."""
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=3600)
    ttft, rate, errors = [], [], []

    async def one(k: int) -> None:
        for r in range(rounds):
            prompt = prompts[(k * rounds + r) % len(prompts)]
            t0 = time.perf_counter()
            first, pieces, reason, usage = None, [], None, None
            if not stream:  # (the whole text at the end: its time to the first token is the request's)
                out = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                      extra_body=body)
                pieces, reason, usage = [out.choices[0].text], out.choices[0].finish_reason, out.usage
            else:
                chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                         stream=True, stream_options={"include_usage": True},
                                                         extra_body=body)
                async for chunk in chunks:
                    if chunk.choices:
                        c = chunk.choices[0]
                        if c.text:
                            first = first or time.perf_counter()
                            pieces.append(c.text)
                        reason = c.finish_reason or reason
                    elif chunk.usage:
                        usage = chunk.usage
            t1 = time.perf_counter()
            text = "".join(pieces)
            n = text.count("<")
            if usage is None or usage.completion_tokens != max_tokens or n != max_tokens or reason != "length":
                errors.append(f"client {k} round {r}: {usage} tokens in text {n} finish {reason}")
            ttft.append((first or t1) - t0)
            rate.append(max_tokens / (t1 - t0))

    ready.wait(120)  # (every process of the pass is here, its imports done, before any request goes)
    start = time.perf_counter()
    await asyncio.gather(*(one(k) for k in ks))
    end = time.perf_counter()
    await client.close()
    return {"start": start, "end": end, "ttft": ttft, "rate": rate, "errors": errors}


@dataclasses.dataclass
class ClientPool:
    """The load generator's processes (spawned, each runs the clients of one task at a time) and the
    manager of the barriers they meet at before a pass."""

    workers: concurrent.futures.ProcessPoolExecutor
    manager: object


def clients_run(pool: ClientPool, base: str, prompts: list[list[int]], clients: int, rounds: int, body: dict,
                max_tokens: int, stream: bool = True, per_process: int = 1) -> dict:
    """``clients`` clients in processes of their own (``pool``: spawned workers, ``per_process``
    clients each), as independent applications' clients would run: they take no host time from
    the server's process, and one process does not build every client's requests in turn (in our
    runs a process of 32 clients sent its first request 0.13-0.33 s after the start, a process of 8
    0.03-0.06 s). The processes meet at a barrier before their first request (a worker the pool
    just spawned imports for seconds, and a pass timed from a fixed moment counted that wait); the
    pass runs from the first process leaving the barrier to the last response."""
    processes = -(-clients // per_process)
    ready = pool.manager.Barrier(processes)
    futures = [pool.workers.submit(_http_clients_sync, base, "random-llama", prompts, list(range(p, clients, processes)),
                           rounds, body, max_tokens, stream, ready) for p in range(processes)]
    parts = [f.result() for f in futures]
    # (perf_counter is the system's monotonic clock on Linux: every process reads the same)
    start_at = min(p["start"] for p in parts)
    wall = max(p["end"] for p in parts) - start_at
    ttft, rate = [t for p in parts for t in p["ttft"]], [r for p in parts for r in p["rate"]]
    return {"wall_s": wall, "started_at": start_at, "client_processes": processes,
            "tok_s": clients * rounds * max_tokens / wall, "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99), "req_tok_s_p50": pct(rate, 0.5), "req_tok_s_p99": pct(rate, 0.01),
            "errors": [e for p in parts for e in p["errors"]]}


def _http_clients_sync(*args) -> dict:
    return asyncio.run(http_clients(*args))


def offline(executor: SchedulerExecutor, strategy: str, prompts: list[list[int]], clients: int, rounds: int,
            args) -> dict:
    """The engine's own figure for the same requests: SMC-SD through Engine.serve (slots = clients),
    SD / AR as batched calls of ``clients`` prompts."""
    T, total = args.max_tokens, clients * rounds
    todo = [prompts[i % len(prompts)] for i in range(total)]
    sync(args.device)
    t0 = time.perf_counter()
    if strategy == "smc":
        reqs = [Request(p, particles=args.particles, block_size=args.block_size, max_new_tokens=T,
                        draft_temperature=1.0, target_temperature=1.0) for p in todo]
        out = executor.engine.serve(reqs, slots=clients, eos_token_id=None)
        assert all(int(f.lengths.min()) == T for f in out), "an offline SMC-SD request ended early"
    else:
        for i in range(0, total, clients):
            chunk = todo[i: i + clients]
            if strategy == "sd":
                o = executor.batch_engine.speculative(chunk, block_size=args.sd_block_size, max_new_tokens=T)
                assert o.tokens.shape[-1] == T
            else:
                tokens, _ = executor.batch_engine.autoregressive(chunk, max_new_tokens=T)
                assert tokens.shape == (len(chunk), T)
    sync(args.device)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tok_s": total * T / wall}


def same_loop(executor: SchedulerExecutor, strategy: str, prompts: list[list[int]], clients: int, rounds: int,
              args, max_tokens: int | None = None) -> dict:
    """The server's request loop for the same requests, without HTTP: a Scheduler with the settings of
    the executor's lane for ``strategy`` (its engine, so its captured rounds), stepped here with
    ``clients`` requests in flight (a request joins as soon as one leaves). The executor is idle
    meanwhile (the HTTP pass before has ended), so its scheduler holds no rows of the shared buffers."""
    lane = {"smc": executor.sched, "sd": executor.sd, "ar": executor.ar}[strategy]
    while any(s.busy for s in executor.schedulers) or executor.live:
        time.sleep(0.01)
    sched = Scheduler(lane.engine, slots=lane.slots, max_particles=lane.Nmax, max_block_size=lane.Kmax,
                      target=EngineTarget(), eos_token_id=None, resampler=lane.resampler, ess_threshold=lane.tau,
                      use_graphs=lane.use_graphs, seed=3, exact_only=lane.exact_only)
    T, total = max_tokens or args.max_tokens, clients * rounds
    particles = args.particles if strategy == "smc" else 1
    K = {"smc": args.block_size, "sd": args.sd_block_size, "ar": 0}[strategy]
    todo = [Request(list(prompts[i % len(prompts)]), particles=particles, block_size=K, max_new_tokens=T,
                    draft_temperature=1.0, target_temperature=1.0, exact=strategy != "smc") for i in range(total)]
    sync(args.device)
    t0 = time.perf_counter()
    live = 0
    while todo or sched.busy:
        while todo and live < clients:
            sched.submit(todo.pop(0))
            live += 1
        for f in sched.step():
            assert int(f.lengths.min()) == T, "a same-loop request ended early"
            live -= 1
    sync(args.device)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tok_s": total * T / wall}


def idle_waits(executor: SchedulerExecutor, start: float, end: float) -> dict:
    """The device thread's waits for work within [start, end] (the clients' clock): the one the
    first request ended, and the others (count, seconds, longest)."""
    waits = [(max(a, start), min(b, end)) for a, b in list(executor.idle_waits) if b > start and a < end]
    first = [b - a for a, b in waits if a <= start]
    later = [b - a for a, b in waits if a > start]
    return {"before_first_request_s": round(sum(first), 4), "later": len(later), "later_s": round(sum(later), 4),
            "longest_later_s": round(max(later, default=0.0), 4)}


def round_shapes(executor: SchedulerExecutor) -> int:
    """Round shapes the executor's engines hold (the speculative / autoregressive rounds, and each scheduler's rounds by bucket
    and block size): a new one is a capture (with CUDA graphs) or a new round's code (without)."""
    n = 0
    for engine in (executor.engine, executor.batch_engine, executor.ar_engine):
        for key in list(engine.graphs.keys()):
            n += len(getattr(engine.graphs[key], "by_bucket", {None: None}))
    return n


def warm_up(executor: SchedulerExecutor, pool: ClientPool, base: str, prompts: list[list[int]], strategy: str, clients: int,
            body: dict, args) -> None:
    """Meet every round shape of the timed passes untimed: the offline calls as timed (the dedicated
    calls' shapes follow the output length); through HTTP the timed pattern (same clients, same
    requests per client). The request loops' shapes (every lane) follow the occupied slots, not the
    output length: the lane's request loop with each power-of-two number of short requests submitted
    at once (every bucket: clients in processes of their own do not arrive together, so through HTTP
    a small bucket may never be met), then short outputs through HTTP from each of those numbers of
    clients (``warm_pass`` runs the full-length pattern later, after the offline figures)."""
    offline(executor, strategy, prompts, clients, 1, args)
    same_loop(executor, strategy, prompts, clients, 1, args)
    c = 1
    while c <= clients:
        same_loop(executor, strategy, prompts, c, 1, args, max_tokens=16)
        c *= 2
    c = 1
    while c < clients:
        errors = clients_run(pool, base, prompts, c, 1, body, 16, per_process=args.clients_per_process)["errors"]
        assert not errors, f"warm-up: {errors[:3]}"
        c *= 2
    errors = clients_run(pool, base, prompts, clients, args.rounds, body, 16,
                         per_process=args.clients_per_process)["errors"]
    assert not errors, f"warm-up: {errors[:3]}"


def warm_pass(pool: ClientPool, base: str, prompts: list[list[int]], clients: int, body: dict, args) -> None:
    """The timed pattern at full length through HTTP, untimed: right before the timed passes (in our
    runs the first full-length pass after the offline calls was up to 30 % slower than the next ones)."""
    errors = clients_run(pool, base, prompts, clients, args.rounds, body, args.max_tokens,
                         per_process=args.clients_per_process)["errors"]
    assert not errors, f"warm-up: {errors[:3]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--draft", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8, help="K of SMC-SD")
    ap.add_argument("--sd-block-size", type=int, default=4, help="K of exact speculative decoding")
    ap.add_argument("--clients", default="8,32")
    ap.add_argument("--rounds", type=int, default=2, help="requests each client sends, one after another")
    ap.add_argument("--strategies", default="smc,sd,ar")
    ap.add_argument("--clients-per-process", type=int, default=1,
                    help="clients that share one process of the load generator (1: each its own, as independent "
                         "applications)")
    ap.add_argument("--stream-interval", type=float, default=0.02,
                    help="the server's stream_interval (seconds between a streamed choice's texts; 0: every round)")
    ap.add_argument("--variants", default="streamed,streamed,streamed",
                    help="comma-separated HTTP passes, in this order, for each strategy and client count (repeats "
                         "allowed; the median pass of the first variant gives the row's figures): "
                         f"{', '.join(VARIANTS)}")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "server.json"))
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer toy target and draft on the CPU, 16-token prompts and outputs, 2 and 4 clients")
    args = ap.parse_args()
    import uvicorn

    args.device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.prompt_len, args.max_tokens, args.clients, args.rounds = 16, 16, "2,4", 1
    clients = [int(c) for c in args.clients.split(",")]
    tcfg, dcfg = (TINY, TINY) if args.tiny else (PRESETS[args.target], PRESETS[args.draft])
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target = Llama.random(tcfg, dtype=dtype, device=args.device, seed=1)
    draft = Llama.random(dcfg, dtype=dtype, device=args.device, seed=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tcfg.vocab_size - 1, (args.prompt_len,), generator=g).tolist() for _ in range(64)]
    context = args.prompt_len + 2 * args.max_tokens + max(args.block_size, args.sd_block_size) + 16
    vocab = Vocabulary(tcfg.vocab_size, context)
    K = max(args.block_size, args.sd_block_size)
    limits = Limits(max_particles=args.particles, max_block_size=K, max_n=1, max_tokens=args.max_tokens)
    defaults = Defaults(particles=args.particles, block_size=args.block_size)
    executor = SchedulerExecutor(vocab, "random-llama", None, limits=limits, defaults=defaults,
                                 max_queue=4 * max(clients), slots=max(clients), max_particles=args.particles,
                                 max_block_size=K, context=context, ignore_eos=True, llamas=(target, draft),
                                 stream_interval=args.stream_interval)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(executor, limits=limits, defaults=defaults), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}/v1"
    res = {"device": torch.cuda.get_device_properties(0).name if args.device == "cuda" else "cpu (--tiny)",
           "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shapes": {"target": "tiny" if args.tiny else args.target, "draft": "tiny" if args.tiny else args.draft,
                      "dtype": str(dtype).removeprefix("torch."), "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "weights": "random", "eos": "ignored (fixed-length outputs)"},
           "settings": {"particles": args.particles, "block_size": args.block_size,
                        "sd_block_size": args.sd_block_size, "rounds_per_client": args.rounds,
                        "stream_interval_s": args.stream_interval, "clients_per_process": args.clients_per_process,
                        "variants": variants},
           "runs": []}
    bodies = {"smc": {"strategy": "smc", "particles": args.particles, "block_size": args.block_size},
              "sd": {"strategy": "sd", "block_size": args.sd_block_size}, "ar": {"strategy": "ar"}}
    spawn = multiprocessing.get_context("spawn")
    pool = ClientPool(concurrent.futures.ProcessPoolExecutor(-(-max(clients) // args.clients_per_process),
                                                             mp_context=spawn), spawn.Manager())
    for strategy in args.strategies.split(","):
        for C in clients:
            warm_up(executor, pool, base, prompts, strategy, C, bodies[strategy], args)
            before = round_shapes(executor)
            off = offline(executor, strategy, prompts, C, args.rounds, args)
            mid = round_shapes(executor)
            loop = same_loop(executor, strategy, prompts, C, args.rounds, args)
            mid2 = round_shapes(executor)
            warm_pass(pool, base, prompts, C, bodies[strategy], args)
            mid3 = round_shapes(executor)
            passes = []
            for name in variants:
                seconds, t_snap = executor.device_seconds(), time.perf_counter()
                http = clients_run(pool, base, prompts, C, args.rounds, bodies[strategy], args.max_tokens,
                                   VARIANTS[name], per_process=args.clients_per_process)
                spent = {k: v - seconds[k] for k, v in executor.device_seconds().items()}
                # (idle before the clients' clock started and after it stopped is not the pass's)
                spent["idle"] -= (http["started_at"] - t_snap) + (time.perf_counter() - http["started_at"] - http["wall_s"])
                http["device_thread_s"] = {k: round(x, 4) for k, x in spent.items()}
                http["idle_waits"] = idle_waits(executor, http["started_at"], http["started_at"] + http["wall_s"])
                http["variant"] = name
                passes.append(http)
            if len(variants) > 1:
                for h in passes:
                    print(f"     {h['variant']:18s} HTTP {h['tok_s']:8.1f} tok/s ({h['tok_s'] / off['tok_s']:.1%} of offline), "
                          f"device thread {h['device_thread_s']}, waits for work {h['idle_waits']}", flush=True)
            # (the row's figures: the median pass of the first variant)
            firsts = sorted((h for h in passes if h["variant"] == variants[0]), key=lambda h: h["tok_s"])
            http = firsts[(len(firsts) - 1) // 2]
            # rounds of a shape first met in a timed pass (a CUDA graph captured inside the measurement)
            new = {"offline": mid - before, "same_loop": mid2 - mid, "http": round_shapes(executor) - mid3}
            run = {"strategy": strategy, "clients": C, "offline": off, "same_loop": loop, "http": http,
                   **({"http_variants": passes} if len(variants) > 1 else {}),
                   "ratio": http["tok_s"] / off["tok_s"], "ratio_same_loop": http["tok_s"] / loop["tok_s"],
                   "new_round_shapes_in_timed_pass": new}
            if any(new.values()):
                print(f"    warning: round shapes first met in the timed pass (captured inside it): {new}", flush=True)
            res["runs"].append(run)
            print(f"{strategy:4s} {C:3d} clients: HTTP {http['tok_s']:8.1f} tok/s, offline {off['tok_s']:8.1f} "
                  f"({run['ratio']:.1%}), same loop {loop['tok_s']:8.1f} ({run['ratio_same_loop']:.1%}); TTFT p50 {http['ttft_p50_s']:.3f} s p99 {http['ttft_p99_s']:.3f} s; "
                  f"per request p50 {http['req_tok_s_p50']:.1f} tok/s, p99 (slowest 1 %) "
                  f"{http['req_tok_s_p99']:.1f}; errors {len(http['errors'])}", flush=True)
            print(f"     device thread (s): {http['device_thread_s']} of {http['wall_s']:.3f}; waits for work: "
                  f"{http['idle_waits']}", flush=True)
            for e in http["errors"][:5]:
                print("   ", e, flush=True)
    pool.workers.shutdown()
    pool.manager.shutdown()
    server.should_exit = True
    thread.join(timeout=30)
    executor.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print("\n| strategy | clients | HTTP tok/s | offline tok/s | ratio | same-loop tok/s | ratio | "
          "TTFT p50 / p99 (s) | per-request tok/s p50 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        h = r["http"]
        print(f"| {r['strategy']} | {r['clients']} | {h['tok_s']:.1f} | {r['offline']['tok_s']:.1f} | {r['ratio']:.1%} "
              f"| {r['same_loop']['tok_s']:.1f} | {r['ratio_same_loop']:.1%} "
              f"| {h['ttft_p50_s']:.3f} / {h['ttft_p99_s']:.3f} | {h['req_tok_s_p50']:.1f} |")
    bad = sum(len(h["errors"]) for r in res["runs"] for h in r.get("http_variants", [r["http"]]))
    if bad:
        sys.exit(f"{bad} responses failed their checks (see {args.out})")


if __name__ == "__main__":
    main()
