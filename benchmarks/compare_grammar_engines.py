"""Compare grammar engines for SMC constraints: llguidance, xgrammar, outlines-core.

What SMC needs from an engine (docs/constraints.md): token masks for all N particles of a round at
once, cheap forking of particle states on resampling, and coverage — a schema it cannot enforce
must fail loudly, not compile into a looser constraint. Measured here, in one run, on the default
model's tokenizer (SmolLM2, 49,152 tokens):

1. coverage: compile a fixed sample of JSONSchemaBench schemas (--data: ../shared/data/eval), and probe
   keywords an engine might silently drop (does it raise, enforce, or accept a violating document?);
2. mask time for a batch of N particle states (N = 1, 16, 64) walking through a valid document, for
   a JSON Schema, a context-free grammar and a regex, single-threaded;
3. fork time: 16 children from one ancestor (the worst case of a resampling step).

Run where all three are importable (xgrammar pulls torch/triton/transformers; a venv with
--system-site-packages on top of the project's environment works):

    python benchmarks/compare_grammar_engines.py --out benchmarks/results/grammar_engines.json

Missing engines are reported as such. Prints a markdown summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "eval"  # ../shared/data/eval beside the repository
SUBSETS = ["Github_trivial", "Github_easy", "Glaiveai2K"]

DOC_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
DOC = {
    "name": "Alice Martin",
    "age": 34,
    "email": "alice@example.org",
    "role": "editor",
    "tags": ["ops", "on-call"],
    "address": {"city": "Lyon", "zip": "69001"},
}
ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
ARITH_DOC = "(12+3)*4-5/(6+7)*(81-2)"
DATE_REGEX = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
DATE_DOC = "2024-05-17"

# keywords an engine may silently drop: (schema, a document that violates it)
PROBES = {
    "not": ({"not": {"type": "string"}}, '"x"'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]"),
    "if/then": ({"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "7"),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1}',
    ),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a"}}, '{"b": 1}'),
    "minProperties": ({"type": "object", "minProperties": 1}, "{}"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "unknown format": ({"type": "string", "format": "no-such-format"}, '"x"'),
    "pattern look-behind": ({"type": "string", "pattern": "^(?<=a)b$"}, '"b"'),
    "oneOf (overlapping)": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
}


def sample_schemas(data: str | Path, per_subset: int, seed: int = 0) -> list[tuple[str, str, dict]]:
    """A fixed sample: the first ``per_subset`` schemas of each subset after a seeded shuffle
    (the same function as benchmarks/eval_constraints.py)."""
    out = []
    for subset in SUBSETS:
        rows = [json.loads(line) for line in open(Path(data) / f"jsonschemabench_{subset}.jsonl")]
        random.Random(seed).shuffle(rows)
        out += [(subset, r["id"], r["schema"]) for r in rows[:per_subset]]
    return out


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ----------------------------------------------------------------------------------------------
# Engines: a uniform interface over each library


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, model):
        import llguidance

        from smcdecode.potentials.grammar import lark_header, llguidance_tokenizer

        self.llg = llguidance
        self.tok = llguidance_tokenizer(model)
        self.header = lark_header(False)
        self.V = model.vocab_size
        self.words = (self.V + 31) // 32
        self.executor = llguidance.LLExecutor(1)
        self.version = llguidance.__version__

    def _matcher(self, grammar: str):
        is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if is_error:
            raise ValueError(messages[0].splitlines()[0])
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def json(self, schema):
        s = {
            **schema,
            "x-guidance": {
                "whitespace_flexible": False,
                "item_separator": ", ",
                "key_separator": ": ",
                "lenient": False,
            },
        }
        return self._matcher(self.header + "start: %json " + json.dumps(s))

    def grammar(self, text):
        return self._matcher(self.header + text)

    def regex(self, pattern):
        return self._matcher(self.header + "start: /" + pattern.replace("/", "\\/") + "/")

    def states(self, compiled, n):
        return [compiled.deep_copy() for _ in range(n)]

    def masks(self, states):
        bitmask = torch.zeros(len(states), self.words, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(states)], bitmask.data_ptr(), self.words * 4, len(states)
        )
        return bitmask

    def advance(self, states, token):
        for m in states:
            if not m.consume_token(token):
                raise RuntimeError(m.get_error()[:200])
        return states

    def fork(self, states, index):
        seen, out = set(), []
        for a in index:
            out.append(states[a].deep_copy() if a in seen else states[a])
            seen.add(a)
        return out

    def accepts(self, compiled, text, encode):
        m = compiled.deep_copy()
        return m.consume_tokens(encode(text)) and m.is_accepting()


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, model):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(model.tokenizer, vocab_size=model.vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.V = model.vocab_size
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=1)
        from importlib.metadata import version

        self.version = version("xgrammar")

    def json(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def grammar(self, text):
        return self.compiler.compile_grammar(text)

    def regex(self, pattern):
        return self.compiler.compile_regex(pattern)

    def states(self, compiled, n):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def masks(self, states):
        bitmask = self.xgr.allocate_token_bitmask(len(states), self.V)
        self.batch.batch_fill_next_token_bitmask(states, bitmask)
        return bitmask

    def advance(self, states, token):
        for m in states:
            if not m.accept_token(token):
                raise RuntimeError("token rejected")
        return states

    def fork(self, states, index):
        seen, out = set(), []
        for a in index:
            out.append(states[a].fork() if a in seen else states[a])
            seen.add(a)
        return out

    def accepts(self, compiled, text, encode):
        m = self.xgr.GrammarMatcher(compiled)
        for t in encode(text):
            if not m.accept_token(t):
                return False
        return m.is_completed() if hasattr(m, "is_completed") else m.accept_token(self.V - 1)


class OutlinesCoreEngine:
    """outlines-core compiles regexes (and JSON Schema via a regex) to a token DFA; a particle
    state is one integer, so forking is a gather and masks come from a per-state lookup."""

    name = "outlines-core"

    def __init__(self, model):
        import outlines_core

        self.oc = outlines_core
        vocab = {}
        for i, s in enumerate(model.token_strings):
            if s is not None and i != model.eos_token_id:
                vocab.setdefault(s, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(model.eos_token_id, vocab)
        self.V = model.vocab_size
        from importlib.metadata import version

        self.version = version("outlines-core")

    def json(self, schema):
        return self.regex(self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?"))

    def grammar(self, text):
        raise ValueError("no context-free grammars (regular languages only)")

    def regex(self, pattern):
        return self.oc.Index(pattern, self.vocabulary)

    def states(self, compiled, n):
        self.index = compiled
        return torch.full((n,), compiled.get_initial_state(), dtype=torch.long)

    def masks(self, states):
        mask = torch.zeros(len(states), self.V, dtype=torch.bool)
        for i, s in enumerate(states.tolist()):
            allowed = self.index.get_allowed_tokens(s)
            if allowed:
                mask[i, allowed] = True
        return mask

    def advance(self, states, token):
        return torch.tensor([self.index.get_next_state(s, token) for s in states.tolist()], dtype=torch.long)

    def fork(self, states, index):
        return states[torch.as_tensor(index)]

    def accepts(self, compiled, text, encode):
        s = compiled.get_initial_state()
        for t in encode(text):
            s = compiled.get_next_state(s, t)
            if s is None:
                return False
        return compiled.is_final_state(s)


ENGINES = {"llguidance": LLGuidanceEngine, "xgrammar": XGrammarEngine, "outlines-core": OutlinesCoreEngine}


# ----------------------------------------------------------------------------------------------


def _compile_in_child(engine, schema, conn, extra_bytes: int) -> None:
    import resource

    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_bytes, vm + extra_bytes))
    t0 = time.perf_counter()
    try:
        engine.json(schema)
        conn.send(("ok", time.perf_counter() - t0))
    except MemoryError:
        conn.send(("error", "out of memory (limit)"))
    except Exception as e:  # noqa: BLE001 - engines raise many types
        conn.send(("error", str(e).strip().splitlines()[0][:90] if str(e).strip() else type(e).__name__))


def guarded_compile(engine, schema, timeout_s: float, extra_bytes: int) -> tuple[str, object]:
    """Compile in a forked child with a time and memory limit: an engine that blows up on one
    schema (outlines-core built a 15 GB index on one sampled schema) must not take the machine."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_compile_in_child, args=(engine, schema, child, extra_bytes))
    proc.start()
    child.close()
    status = ("error", f"timeout (> {timeout_s:g} s)")
    if parent.poll(timeout_s):
        try:
            status = parent.recv()
        except EOFError:
            status = ("error", "crashed (memory limit)")
    elif proc.is_alive():
        proc.kill()
    proc.join()
    if proc.exitcode not in (0, None) and status[0] == "error" and "timeout" not in str(status[1]):
        status = ("error", status[1] if status[1] != "" else "crashed")
    return status


def coverage(engine, schemas, timeout_s: float = 20.0, extra_bytes: int = 3 << 30) -> dict:
    ok, errors, times = 0, {}, []
    for _subset, _id, schema in schemas:
        status, value = guarded_compile(engine, schema, timeout_s, extra_bytes)
        if status == "ok":
            ok += 1
            times.append(value)
        else:
            errors[value] = errors.get(value, 0) + 1
    return {
        "compiled": ok,
        "total": len(schemas),
        "median_compile_ms": 1e3 * statistics.median(times) if times else None,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:8]),
    }


def probes(engine, encode) -> dict:
    out = {}
    for name, (schema, violating) in PROBES.items():
        try:
            compiled = engine.json(schema)
        except Exception:  # noqa: BLE001
            out[name] = "raises"
            continue
        try:
            out[name] = (
                "silently accepts a violating document" if engine.accepts(compiled, violating, encode) else "enforces"
            )
        except Exception as e:  # noqa: BLE001
            out[name] = f"compiles; check failed ({type(e).__name__})"
    return out


def mask_times(engine, compiled, tokens, n: int) -> dict:
    states = engine.states(compiled, n)
    per_step = []
    for t in tokens:
        t0 = time.perf_counter()
        engine.masks(states)
        per_step.append(time.perf_counter() - t0)
        states = engine.advance(states, t)
    mid = engine.states(compiled, 1)
    for t in tokens[: len(tokens) // 2]:
        mid = engine.advance(mid, t)
    index = [0] * 16
    fork_s = timed(lambda: engine.fork(mid, index), repeat=20)
    return {
        "mask_ms_mean": 1e3 * statistics.mean(per_step),
        "mask_ms_max": 1e3 * max(per_step),
        "fork16_us": 1e6 * fork_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA),
                        help="directory holding jsonschemabench_<subset>.jsonl (default: ../shared/data/eval "
                        "beside the repository)")
    parser.add_argument("--per-subset", type=int, default=100, help="schemas per JSONSchemaBench subset for coverage")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grammar_engines.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    from smcdecode import load_model

    model = load_model()
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    schemas = sample_schemas(args.data, args.per_subset)
    docs = {
        "json": encode(json.dumps(DOC, separators=(", ", ": "))),
        "grammar": encode(ARITH_DOC),
        "regex": encode(DATE_DOC),
    }
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread, engines single-threaded",
        "python": sys.version.split()[0],
        "tokenizer": f"{model.name} ({model.vocab_size} tokens)",
        "coverage_sample": f"{args.per_subset} schemas per subset x {len(SUBSETS)} subsets (seeded shuffle); "
        "each compiled in a child process limited to 20 s and 3 GiB",
        "doc_tokens": {k: len(v) for k, v in docs.items()},
        "engines": {},
    }
    for name, cls in ENGINES.items():
        try:
            engine = cls(model)
        except ImportError as e:
            report["engines"][name] = {"error": f"not installed: {e}"}
            continue
        row: dict = {"version": engine.version}
        print(f"[{name}] coverage ...", file=sys.stderr)
        row["coverage"] = coverage(engine, schemas)
        row["probes"] = probes(engine, encode)
        row["timing"] = {}
        for kind, build, arg in [
            ("json", engine.json, DOC_SCHEMA),
            ("grammar", engine.grammar, ARITH_EBNF if name == "xgrammar" else ARITH_LARK),
            ("regex", engine.regex, DATE_REGEX),
        ]:
            try:
                t0 = time.perf_counter()
                compiled = build(arg)
                compile_ms = 1e3 * (time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001
                row["timing"][kind] = {"error": str(e).splitlines()[0][:100]}
                continue
            row["timing"][kind] = {"compile_ms": compile_ms}
            for n in (1, 16, 64):
                print(f"[{name}] {kind} N={n} ...", file=sys.stderr)
                row["timing"][kind][f"N={n}"] = mask_times(engine, compiled, docs[kind], n)
        report["engines"][name] = row

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        f"Measured {report['date']} on {report['machine']}; tokenizer {report['tokenizer']}; "
        f"coverage sample: {report['coverage_sample']}.",
        "",
        "| engine | version | schemas compiled | median compile | JSON mask, N=1 / 16 / 64 | CFG mask, N=16 | regex mask, N=16 | fork 16 children |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["engines"].items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | | | | | |")
            continue
        cov = row["coverage"]
        t = row["timing"]

        def ms(kind, n, t=t):
            cell = t.get(kind, {})
            if "error" in cell:
                return "n/a"
            return f"{cell[f'N={n}']['mask_ms_mean']:.3f}"

        js = " / ".join(ms("json", n) for n in (1, 16, 64))
        fork = t.get("json", {}).get("N=16", {}).get("fork16_us")
        med = cov["median_compile_ms"]
        lines.append(
            f"| {name} | {row['version']} | {cov['compiled']}/{cov['total']} | {med:.1f} ms | {js} ms | "
            f"{ms('grammar', 16)} ms | {ms('regex', 16)} ms | {fork:.0f} µs |"
        )
    lines += ["", "Keyword probes (schema + a document violating it):", ""]
    names = list(report["engines"])
    lines.append("| keyword | " + " | ".join(names) + " |")
    lines.append("|---" * (len(names) + 1) + "|")
    for probe in PROBES:
        cells = [report["engines"][n].get("probes", {}).get(probe, "-") for n in names]
        lines.append(f"| {probe} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
