"""Evaluate constrained generation: SMC (N = 1, 4, 16) vs locally-masked decoding.

Two parts, written to --out-md and --out-json (by default docs/evaluation_constraints.md and
benchmarks/results/evaluation.json); --skip-bench / --skip-enumeration leave a part out of both:

1. JSONSchemaBench (three subsets, from --data: by default ../shared/data/eval beside the
   repository) with the default model (SmolLM2-135M-Instruct) on the CPU: for a fixed sample of
   schemas, the fraction of outputs that parse and validate (jsonschema, formats checked), the
   schemas the library cannot compile (with the reason), the mean target log-likelihood per token
   of the outputs, log p_T(x | prompt) / |x|, and the time per output. Methods, in the same run: unconstrained sampling, locally-masked
   decoding (Autoregressive with the constraint: what greedy constrained decoders do), and SMC
   with the target as proposal and N = 1, 4, 16 particles.
2. Problems small enough to enumerate: the exact global conditional p(x | x ∈ A), the exact
   distribution of locally-masked decoding, and the distribution of SMC's returned sample (one
   draw ∝ final weights per run, estimated over many replicate runs), compared by total variation.
   Toy LMs with a JSON Schema, a grammar and a regex, and the real model with a small enum schema.

    python benchmarks/eval_constraints.py                   # the documented run
    python benchmarks/eval_constraints.py --per-subset 3 --skip-enumeration --out-md /tmp/e.md --out-json /tmp/e.json
"""

from __future__ import annotations

import argparse
import json
import math
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
USER = "Generate one realistic example object for this schema."
METHODS = ["unconstrained", "masked", "smc-1", "smc-4", "smc-16"]

sys.path.insert(0, str(ROOT))
import smcdecode as sd  # noqa: E402
from smcdecode.potentials import Grammar, JSONSchema, LMReward  # noqa: E402
from smcdecode.structured import schema_prompt  # noqa: E402
from smcdecode.testing import (  # noqa: E402
    exact_autoregressive,
    exact_target,
    particle_distributions,
    total_variation,
)


def sample_schemas(data: str | Path, per_subset: int, max_chars: int, seed: int = 0) -> list[tuple[str, str, dict]]:
    """The first ``per_subset`` schemas of each subset, after a seeded shuffle, among those whose
    JSON text has at most ``max_chars`` characters (the schema goes into the prompt)."""
    out = []
    for subset in SUBSETS:
        rows = [json.loads(line) for line in open(Path(data) / f"jsonschemabench_{subset}.jsonl")]
        random.Random(seed).shuffle(rows)
        rows = [r for r in rows if len(json.dumps(r["schema"])) <= max_chars]
        out += [(subset, r["id"], r["schema"]) for r in rows[:per_subset]]
    return out


def strategy(method: str, model, constraint, temperature: float):
    lm = sd.LM(model, temperature=temperature)
    if method == "unconstrained":
        return sd.Autoregressive(lm)
    if method == "masked":
        return sd.Autoregressive(lm * constraint)
    n = int(method.split("-")[1])
    return sd.SMC(lm * constraint, "target", particles=n, ess_threshold=0.5)


def run_bench(model, args) -> dict:
    schemas = sample_schemas(args.data, args.per_subset, args.max_schema_chars, args.seed)
    rows, compile_errors = [], []
    t_start = time.perf_counter()
    for k, (subset, sid, schema) in enumerate(schemas):
        try:
            constraint = JSONSchema(schema).bind(model)
        except sd.SMCDecodeError as e:
            compile_errors.append({"subset": subset, "id": sid, "reason": str(e)})
            print(f"[{k + 1}/{len(schemas)}] {subset}/{sid}: cannot compile: {e}", file=sys.stderr)
            continue
        prompt = schema_prompt(model, [{"role": "user", "content": USER}], constraint.schema)
        ids = model.prompt_ids(prompt)
        outputs = {}
        for method in args.methods:
            result = strategy(method, model, constraint, args.temperature).run(
                ids, max_new_tokens=args.max_new_tokens, seed=args.seed + k, progress=False
            )
            text, tokens = result.text, result.sample_tokens
            outputs[method] = {
                "text": text,
                "tokens": tokens,
                "seconds": result.seconds,
                "parses": text is not None and _parses(text),
                "valid": text is not None and constraint.is_valid(text),
                "ended": bool(tokens) and tokens[-1] == model.eos_token_id,
                "mean_ess": result.mean_ess if method.startswith("smc") else None,
            }
        scored = [m for m in args.methods if outputs[m]["tokens"]]
        if scored:
            # log p_T(x | prompt), EOS included when x ended with it: one batched forward
            scorer = LMReward(model, ids, temperature=args.temperature)
            logp = scorer.score_tokens([outputs[m]["tokens"] for m in scored]).tolist()
            for m, lp in zip(scored, logp):
                outputs[m]["logp_per_token"] = lp / len(outputs[m]["tokens"])
        for m in args.methods:
            outputs[m].pop("tokens")
        rows.append({"subset": subset, "id": sid, "outputs": outputs})
        line = "  ".join(f"{m}:{'V' if o['valid'] else 'x'}{o['seconds']:.0f}s" for m, o in outputs.items())
        print(f"[{k + 1}/{len(schemas)}] {subset}/{sid} ({time.perf_counter() - t_start:.0f}s) {line}", file=sys.stderr)
    return {"schemas": rows, "compile_errors": compile_errors, "sampled": len(schemas)}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def summarise(bench: dict, methods: list[str]) -> dict:
    out = {}
    for subset in [*SUBSETS, "all"]:
        rows = [r for r in bench["schemas"] if subset == "all" or r["subset"] == subset]
        errors = [e for e in bench["compile_errors"] if subset == "all" or e["subset"] == subset]
        per = {}
        for m in methods:
            outs = [r["outputs"][m] for r in rows]
            lps = [o["logp_per_token"] for o in outs if "logp_per_token" in o]
            per[m] = {
                "n": len(outs),
                "valid": sum(o["valid"] for o in outs) / len(outs) if outs else math.nan,
                "parses": sum(o["parses"] for o in outs) / len(outs) if outs else math.nan,
                "no_output": sum(o["text"] is None for o in outs),
                "logp_per_token": statistics.mean(lps) if lps else math.nan,
                "seconds": statistics.mean(o["seconds"] for o in outs) if outs else math.nan,
            }
            # paired with masked decoding: schemas where both returned an output
            pairs = [
                (r["outputs"][m]["logp_per_token"], r["outputs"]["masked"]["logp_per_token"])
                for r in rows
                if "logp_per_token" in r["outputs"][m]
                and "logp_per_token" in r["outputs"].get("masked", {})
                and r["outputs"][m]["text"] is not None
                and r["outputs"]["masked"]["text"] is not None
            ]
            per[m]["paired_with_masked"] = len(pairs)
            per[m]["logp_gain_vs_masked"] = statistics.mean(a - b for a, b in pairs) if pairs else math.nan
        out[subset] = {"sampled": len(rows) + len(errors), "cannot_compile": len(errors), "methods": per}
    return out


# ----------------------------------------------------------------------------------------------
# Enumerable problems


def _toy(seed: int, vocab: list[str], scale: float = 1.0) -> sd.FunctionModel:
    gen = torch.Generator().manual_seed(seed)
    table = scale * torch.randn(251, len(vocab), generator=gen)
    coef = torch.randint(1, 2**31 - 1, (64,), generator=torch.Generator().manual_seed(12345))

    def fn(ctx):
        h = ((ctx * coef[: ctx.shape[1]]).sum(1) + 7919 * ctx.shape[1]) % 251
        return table[h]

    return sd.FunctionModel(fn, vocab, eos="<eos>", name=f"toy-{seed}")


def smc_returned_distribution(target, prompt, max_new_tokens, n, groups, seed, rows_per_call=48_000):
    """The distribution of Result.text (one draw ∝ final weights per run) over ``groups`` replicate
    SMC runs, averaged over the runs that return a sample (exact_autoregressive conditions masked
    decoding on success likewise), and the fraction of runs that return none. Runs go in
    vectorised chunks of at most ``rows_per_call`` particles (the real model keeps a KV cache each)."""
    per_call = max(1, rows_per_call // n)
    dists, runs = [], 0
    for start in range(0, groups, per_call):
        g = min(per_call, groups - start)
        smc = sd.SMC(target, "target", particles=n)
        dists += particle_distributions(
            smc.run_groups(prompt, groups=g, max_new_tokens=max_new_tokens, seed=seed + start)
        )
        runs += g
    got = [d for d in dists if d]
    pooled: dict = {}
    for d in got:
        for x, w in d.items():
            pooled[x] = pooled.get(x, 0.0) + w / len(got)
    return pooled, 1.0 - len(got) / runs


def enumeration_problem(name, target, prompt, max_new_tokens, groups, ns, seed=0, rows_per_call=48_000) -> dict:
    exact = exact_target(target, prompt, max_new_tokens)
    local = exact_autoregressive(target, prompt, max_new_tokens)
    row = {
        "problem": name,
        "support": len(exact.probs),
        "tv_masked": total_variation(exact.probs, local.probs),
        "tv_smc": {},
        "no_sample": {},
        "replicates": groups,
    }
    for n in ns:
        dist, none = smc_returned_distribution(target, prompt, max_new_tokens, n, groups, seed, rows_per_call)
        row["tv_smc"][n] = total_variation(exact.probs, dist)
        row["no_sample"][n] = none
    # Monte Carlo floor: TV between the exact law and an empirical law of `groups` exact draws
    gen = torch.Generator().manual_seed(seed)
    keys = list(exact.probs)
    probs = torch.tensor([exact.probs[k] for k in keys], dtype=torch.float64)
    draws = torch.multinomial(probs, groups, replacement=True, generator=gen)
    emp = torch.bincount(draws, minlength=len(keys)).double() / groups
    row["tv_noise_floor"] = 0.5 * float((emp - probs).abs().sum())
    return row


def run_enumeration(model, args) -> list[dict]:
    rows = []
    json_vocab = ["<bos>", "{", '{"a": ', '"a"', '"b"', ": ", ", ", "1", "2", "12", "}", "<eos>"]
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2, 12]}, "b": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    arith = 'start: expr\nexpr: term ("+" term)*\nterm: NUM | "(" expr ")"\nNUM: /[12]/\n'
    arith_vocab = ["<bos>", "1", "2", "+", "(", ")", "1+", "(1", "<eos>"]
    regex_vocab = ["<bos>", "a", "b", "ab", "ba", "<eos>"]
    ns = [1, 4, 16]
    G = args.replicates
    for seed in range(3):
        m = _toy(seed, json_vocab)
        rows.append(
            enumeration_problem(f"toy JSON Schema (seed {seed})", sd.LM(m) * JSONSchema(schema), [0], 8, G, ns, seed)
        )
        m = _toy(seed, arith_vocab)
        rows.append(
            enumeration_problem(f"toy arithmetic grammar (seed {seed})", sd.LM(m) * Grammar(arith), [0], 5, G, ns, seed)
        )
        m = _toy(seed, regex_vocab)
        rows.append(
            enumeration_problem(
                f"toy regex (ab|b)*a (seed {seed})", sd.LM(m) * sd.Regex(r"(ab|b)*a"), [0], 5, G, ns, seed
            )
        )
        print(f"enumeration seed {seed} done", file=sys.stderr)
    if model is not None:
        colour = {"enum": ["red", "green", "blue", "yellow"]}
        prompt = model.prompt_ids([{"role": "user", "content": "What colour is a ripe banana? Answer with one word."}])
        target = sd.LM(model, temperature=args.temperature) * JSONSchema(colour)
        rows.append(
            enumeration_problem(
                "SmolLM2, JSON enum of 4 colours", target, prompt, 6, args.replicates_real, [1, 4, 16], 0, 400
            )
        )
        print("enumeration real model done", file=sys.stderr)
    return rows


# ----------------------------------------------------------------------------------------------
# Report: every figure and finding below is computed from the report it is given


def _smc_methods(methods) -> list[str]:
    return sorted((m for m in methods if m.startswith("smc-")), key=lambda m: int(m.split("-")[1]))


def bench_findings(report: dict) -> list[str]:
    """Plain statements computed from the JSONSchemaBench results of this report."""
    allm = report["summary"]["all"]["methods"]
    rows = report["bench"]["schemas"]
    if not rows:
        return []
    out = []
    constrained = [m for m in allm if m != "unconstrained"]
    returned = sum(1 for r in rows for m in constrained if r["outputs"][m]["text"] is not None)
    valid = sum(1 for r in rows for m in constrained if r["outputs"][m]["valid"])
    if returned and valid == returned:
        out.append(
            f"- Every output a constrained method returned parsed and validated ({valid} of {returned}): the runs "
            "counted as not valid are the runs with no output."
        )
    elif returned:
        out.append(f"- {valid} of the {returned} outputs the constrained methods returned parsed and validated.")
    smcs = _smc_methods(allm)
    if "masked" in allm and smcs:
        masked, top = allm["masked"], allm[smcs[-1]]
        n_top = smcs[-1].split("-")[1]
        line = f"- Valid outputs: masked decoding {100 * masked['valid']:.0f}%, " + ", ".join(
            f"SMC N={m.split('-')[1]} {100 * allm[m]['valid']:.0f}%" for m in smcs
        ) + "."
        if top["valid"] > masked["valid"]:
            line += (
                f" SMC N={n_top} returned more valid outputs: a particle cut inside the document has weight 0, so SMC "
                "returns one that closed it whenever any did, where a single masked sample runs out of tokens."
            )
        out.append(line)
        if top["paired_with_masked"]:
            gain = top["logp_gain_vs_masked"]
            out.append(
                f"- On the {top['paired_with_masked']} schemas where both returned an output, SMC N={n_top}'s outputs "
                f"are {'more' if gain > 0 else 'less'} likely under the model than masked decoding's, by "
                f"{abs(gain):.2f} nats per token on average."
            )
        if "smc-1" in allm:
            both = [r for r in rows if r["outputs"]["masked"]["text"] is not None or r["outputs"]["smc-1"]["text"] is not None]
            same = sum(1 for r in both if r["outputs"]["masked"]["text"] == r["outputs"]["smc-1"]["text"])
            out.append(
                f"- SMC N=1 (the same law as masked decoding, run with the same seeds) returned the same output as "
                f"masked decoding on {same} of the {len(both)} schemas where either returned one."
            )
        if masked["seconds"] > 0:
            out.append(
                "- Time per output relative to masked decoding on this CPU: "
                + ", ".join(f"N={m.split('-')[1]} {allm[m]['seconds'] / masked['seconds']:.1f}x" for m in smcs)
                + " (the particles share each forward pass)."
            )
    if "unconstrained" in allm:
        u = allm["unconstrained"]
        out.append(
            f"- Unconstrained sampling: {100 * u['valid']:.0f}% valid, {100 * u['parses']:.0f}% parse as JSON."
        )
    return ["**Findings.**", "", *out, ""]


def _by_n(row: dict) -> dict:
    """An enumeration row with integer particle counts as keys (JSON stores them as strings)."""
    return {**row, "tv_smc": {int(k): v for k, v in row["tv_smc"].items()},
            "no_sample": {int(k): v for k, v in row["no_sample"].items()}}


def enumeration_findings(rows: list[dict]) -> list[str]:
    """Plain statements computed from the enumeration rows of this report."""
    if not rows:
        return []
    rows = [_by_n(r) for r in rows]
    ns = sorted(rows[0]["tv_smc"])
    lo, hi = ns[0], ns[-1]
    out = []
    if lo == 1:
        far = [r for r in rows if abs(r["tv_smc"][1] - r["tv_masked"]) > 2 * r["tv_noise_floor"]]
        line = (
            "- SMC with N = 1 and the target as proposal has the law of locally-masked decoding: its TV is within "
            f"twice the noise floor of the masked column on {len(rows) - len(far)} of {len(rows)} problems"
        )
        if far:
            line += " (not on: " + "; ".join(
                f"{r['problem']}, difference {abs(r['tv_smc'][1] - r['tv_masked']):.3f}, floor {r['tv_noise_floor']:.3f}"
                for r in far) + ")"
        out.append(line + ".")
    if hi > lo:
        falls = sum(1 for r in rows if r["tv_smc"][hi] < r["tv_smc"][lo])
        out.append(f"- TV at N={hi} is below TV at N={lo} on {falls} of {len(rows)} problems.")
        gap = [r for r in rows if r["tv_smc"][hi] > 3 * r["tv_noise_floor"]]
        if gap:
            out.append(
                f"- At N={hi} the TV is still more than three times the noise floor on {len(gap)} of {len(rows)} "
                "problems: " + "; ".join(f"{r['problem']} {r['tv_smc'][hi]:.3f} (masked {r['tv_masked']:.3f})"
                                         for r in gap) + "."
            )
        else:
            out.append(f"- At N={hi} the TV is within three times the noise floor on every problem.")
    return ["**Findings.**", "", *out, ""]


def _bench_markdown(report: dict) -> list[str]:
    a = report["args"]
    L = [
        "## JSONSchemaBench with SmolLM2-135M-Instruct",
        "",
        f"Sample: {a['per_subset']} schemas per subset (seeded shuffle, seed {a['seed']}, schemas whose JSON text has at "
        f"most {a['max_schema_chars']} characters, since the schema goes into the prompt). Prompt: the chat template with "
        f'a system message stating the schema and the user message "{USER}". Target temperature '
        f"{a['temperature']}, at most {a['max_new_tokens']} new tokens, compact JSON layout (`, ` and `: `). "
        "SMC proposes from the target itself (one token per round, locally masked), resamples when ESS < N/2 and "
        "returns one particle drawn in proportion to its weight. `masked` = locally-masked decoding "
        "(Autoregressive with the constraint); `unconstrained` = plain sampling, no constraint. "
        "Valid = parses and validates with `jsonschema` (formats checked). log p/token = "
        "log p_T(output | prompt) / tokens (EOS counted), over the outputs returned; Δ vs masked compares the same "
        "schemas, those where both methods returned an output. Time = wall seconds per output on "
        f"{report['machine']}.",
        "",
    ]
    for subset, s in report["summary"].items():
        title = "All subsets" if subset == "all" else subset
        L += [f"### {title}: {s['sampled']} schemas sampled, {s['cannot_compile']} cannot be compiled", ""]
        L += [
            "| method | schemas | valid | parses | no output | log p/token | Δ log p/token vs masked (pairs) | s/output |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m, r in s["methods"].items():
            gain = (
                ""
                if m in ("masked", "unconstrained")
                else f"{r['logp_gain_vs_masked']:+.3f} ({r['paired_with_masked']})"
            )
            L.append(
                f"| {m} | {r['n']} | {100 * r['valid']:.0f}% | {100 * r['parses']:.0f}% | {r['no_output']} | "
                f"{r['logp_per_token']:.3f} | {gain} | {r['seconds']:.1f} |"
            )
        L.append("")
    L += bench_findings(report)
    L += ["### Schemas the library cannot compile", "", "| subset | id | reason |", "|---|---|---|"]
    for e in report["bench"]["compile_errors"]:
        L.append(f"| {e['subset']} | {e['id']} | {e['reason'].replace('|', '/')[:160]} |")
    if not report["bench"]["compile_errors"]:
        L.append("| | | none in this sample |")
    L += [
        "",
        "A constrained method returns no output when no particle completed a valid document within the token budget "
        "(SMC) or the sample ran out of tokens inside the document (masked); such runs count as not valid.",
        "",
    ]
    return L


def _enumeration_markdown(report: dict) -> list[str]:
    rows = [_by_n(r) for r in report["enumeration"]]
    ns = sorted(rows[0]["tv_smc"])
    replicates = " and ".join(sorted({f"{r['replicates']} on {'SmolLM2' if 'SmolLM2' in r['problem'] else 'the toys'}"
                                      for r in rows}))
    L = [
        "## Enumerable problems: distance to the exact global conditional",
        "",
        "Total variation between the exact global conditional p(x | x ∈ A) and (a) the exact distribution of "
        "locally-masked decoding, (b) the distribution of the sample SMC returns (one draw ∝ final weights per run, "
        f"estimated from replicate runs: {replicates}). The noise floor is the TV of that many exact draws from their "
        "own law: values at the floor are indistinguishable from exact. Toy LMs: a random logits table (standard "
        "normal) indexed by a hash of the whole context. 'No output' is the fraction of runs in which every particle "
        "failed (cut inside the language); the laws compared are conditioned on success.",
        "",
        "| problem | support | TV masked | " + " | ".join(f"TV SMC N={n}" for n in ns)
        + " | noise floor | no output N=" + " / ".join(str(n) for n in ns) + " |",
        "|---|---|---|" + "---|" * (len(ns) + 2),
    ]
    for r in rows:
        cells = [f"{r['tv_smc'][n]:.3f}" for n in ns]
        none = " / ".join(f"{100 * r['no_sample'][n]:.0f}%" for n in ns)
        L.append(
            f"| {r['problem']} | {r['support']} | {r['tv_masked']:.3f} | "
            + " | ".join(cells)
            + f" | {r['tv_noise_floor']:.3f} | {none} |"
        )
    return L + ["", *enumeration_findings(rows)]


def markdown(report: dict, json_path: str | Path) -> str:
    """The report as markdown: a section for each part that ran, naming ``json_path`` (the JSON written)."""
    json_path = Path(json_path).resolve()
    shown = json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path
    L = [
        "# Evaluation: constrained generation (SMC vs locally-masked decoding)",
        "",
        f"Generated by `benchmarks/eval_constraints.py` on {report['date']} ({report['machine']}); "
        f"{report['runtime_minutes']:.1f} minutes in all. Machine-readable: `{shown}`.",
        "",
    ]
    if report["bench"]["schemas"] or report["bench"]["compile_errors"]:
        L += _bench_markdown(report)
    if report["enumeration"]:
        L += _enumeration_markdown(report)
    if len(L) == 5:
        L += ["Nothing was run (both parts skipped).", ""]
    return "\n".join(L).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA),
                        help="directory holding jsonschemabench_<subset>.jsonl (default: ../shared/data/eval "
                        "beside the repository)")
    parser.add_argument("--per-subset", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-schema-chars", type=int, default=1500)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--replicates", type=int, default=3000, help="replicate SMC runs per toy problem")
    parser.add_argument("--replicates-real", type=int, default=200, help="replicate SMC runs on the real-model problem")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-enumeration", action="store_true")
    parser.add_argument("--out-md", default=str(ROOT / "docs" / "evaluation_constraints.md"))
    parser.add_argument("--out-json", default=str(ROOT / "benchmarks" / "results" / "evaluation.json"))
    parser.add_argument("--render-only", action="store_true", help="rewrite the markdown from --out-json, no runs")
    args = parser.parse_args(argv)
    if args.render_only:
        report = json.loads(Path(args.out_json).read_text())
        report["summary"] = summarise(report["bench"], report["args"]["methods"])
        report["enumeration"] = [_by_n(r) for r in report["enumeration"]]
        Path(args.out_json).write_text(json.dumps(report, indent=1, default=str))
        Path(args.out_md).write_text(markdown(report, args.out_json))
        return
    t0 = time.perf_counter()
    model = sd.load_model(threads=args.threads)
    empty = {"schemas": [], "compile_errors": [], "sampled": 0}
    bench = run_bench(model, args) if not args.skip_bench else empty
    enumeration = run_enumeration(model, args) if not args.skip_enumeration else []
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} CPU, {args.threads} torch thread(s), torch {torch.__version__}",
        "model": model.name,
        "args": vars(args),
        "runtime_minutes": (time.perf_counter() - t0) / 60,
        "summary": summarise(bench, args.methods),
        "bench": bench,
        "enumeration": enumeration,
    }
    Path(args.out_json).write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report, args.out_json)
    Path(args.out_md).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
