"""When the draft is weak: does SMC-SD return the target's answer? On the CPU, default model.

For each question of benchmarks/data/factual.jsonl (a short factual question with a format regex)
the target is LM(model, temperature=1) * Regex(format). Its *reference answer* is the most frequent
answer among ``--reference-samples`` samples of the target with the constraint applied token by
token (Autoregressive: the locally masked target; with prompts that ask for the format, the mask
rarely binds). Then, for N in --particles, one run each of

    SMC, proposal = the target                       ("K=0")
    SMC, the shipped draft, K = 2, 4, 8             ("K=2", ...)
    SMC, the shipped draft, block_size="adaptive"   ("adaptive")
    exact speculative decoding, the shipped draft, K = 4, unconstrained target (it cannot take a
    constraint), its text's first match of the format counts as its answer ("exact SD", once)

and records: agreement with the reference answer, log p_T(answer | prompt) under the target at
temperature 1 (the returned sample's tokens), tokens/s of the returned sample, the collapse
diagnosis. Raw JSON to benchmarks/results/adaptive_quality.json and a table on stdout. Checks as it
goes: every SMC answer matches the format; exact SD's answer is the text it generated.

    OMP_NUM_THREADS=1 python benchmarks/adaptive_quality.py --every 2   # 20 questions, about 20 min
    # in two processes, then combined:
    ... --shard 0/2 --out a.json & ... --shard 1/2 --out b.json; ... --merge a.json b.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import smcdecode as sd  # noqa: E402
from smcdecode.drafts import proposal_temperature  # noqa: E402


def log_p(model, prompt_ids: list[int], tokens: list[int]) -> float:
    """log p_T(tokens | prompt) at temperature 1 (EOS included when generated)."""
    if not tokens:
        return 0.0
    ids = torch.tensor([prompt_ids + tokens])
    with torch.inference_mode():
        logits = model.hf(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return float(lp.sum())


CLEAR = 0.25  # a reference is "clear" when more than this share of the target's samples gave it


def per_question(rows, method, N):
    """question -> mean agreement over its seeds, for one setting."""
    by = collections.defaultdict(list)
    for r in rows:
        if (r["method"], r["N"]) == (method, N):
            by[r["question"]].append(float(r["agree"]))
    return {q: sum(v) / len(v) for q, v in by.items()}


def paired(rows, method, baseline, N):
    """method minus baseline agreement, paired by question (seeds averaged within a question): mean,
    95 % normal CI over questions, and the exact two-sided sign (McNemar) test on the discordant
    (question, seed) pairs."""
    key = {(r["question"], r["seed"]): r["agree"] for r in rows if (r["method"], r["N"]) == (method, N)}
    base = {(r["question"], r["seed"]): r["agree"] for r in rows if (r["method"], r["N"]) == (baseline, N)}
    common = sorted(set(key) & set(base))
    if not common:
        return None
    a, b = per_question(rows, method, N), per_question(rows, baseline, N)
    qs = sorted(set(a) & set(b))
    d = [a[q] - b[q] for q in qs]
    mean = sum(d) / len(d)
    sd_ = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else float("nan")
    half = 1.96 * sd_ / math.sqrt(len(d))
    wins = sum(key[c] and not base[c] for c in common)
    losses = sum(base[c] and not key[c] for c in common)
    n = wins + losses
    tail = sum(math.comb(n, k) for k in range(0, min(wins, losses) + 1)) / 2 ** n if n else 1.0
    return {"method": method, "baseline": baseline, "N": N, "questions": len(qs), "pairs": len(common),
            "difference": mean, "ci95": [mean - half, mean + half], "method_only": wins,
            "baseline_only": losses, "sign_test_p": min(1.0, 2 * tail)}


def write(out_path, meta, rows, table=True) -> None:
    summary = []
    for key in dict.fromkeys((r["method"], r["N"]) for r in rows):
        sel = [r for r in rows if (r["method"], r["N"]) == key]
        pq = per_question(rows, *key)
        n = len(pq)
        agree = sum(pq.values()) / n
        se = math.sqrt(sum((v - agree) ** 2 for v in pq.values()) / (n - 1) / n) if n > 1 else float("nan")
        clear = [r for r in sel if r["reference_share"] > CLEAR]
        lps = [r["log_p"] for r in sel if r["log_p"] is not None]
        summary.append({"method": key[0], "N": key[1], "questions": n, "runs": len(sel), "agreement": agree,
                        "agreement_se": se, "clear_questions": len({r["question"] for r in clear}),
                        "agreement_clear": sum(r["agree"] for r in clear) / len(clear) if clear else None,
                        "mean_log_p": sum(lps) / len(lps) if lps else None,
                        "answered": len(lps),
                        "tokens_per_second": sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel),
                        "collapsed": sum(bool(r.get("diagnosis")) for r in sel),
                        "mean_K": (sum(sum(r["block_sizes"]) for r in sel) / max(1, sum(len(r["block_sizes"])
                                   for r in sel))) if "block_sizes" in sel[0] else None})
    tests = [t for N in sorted({r["N"] for r in rows if r["method"] == "adaptive"})
             for t in [paired(rows, "adaptive", "K=0", N)] if t]
    Path(out_path).write_text(json.dumps({**meta, "summary": summary, "paired": tests, "rows": rows}, indent=1))
    if not table:
        return
    print(f"{'method':10s} {'N':>3s} {'qs':>3s} {'runs':>4s} {'agree':>12s} {'clear':>11s} {'mean log p':>10s} "
          f"{'tok/s':>7s} {'collapsed':>9s} {'mean K':>6s}")
    for s in summary:
        mk = f"{s['mean_K']:.2f}" if s["mean_K"] is not None else "-"
        lp = f"{s['mean_log_p']:.2f}" if s["mean_log_p"] is not None else "-"
        cl = f"{s['agreement_clear']:.2f} ({s['clear_questions']})" if s["agreement_clear"] is not None else "-"
        print(f"{s['method']:10s} {s['N']:3d} {s['questions']:3d} {s['runs']:4d} {s['agreement']:.2f} ± "
              f"{s['agreement_se']:.2f} {cl:>11s} {lp:>10s} {s['tokens_per_second']:7.1f} "
              f"{s['collapsed']:9d} {mk:>6s}")
    for t in tests:
        print(f"adaptive - K=0 at N={t['N']}: {t['difference']:+.3f} (95% CI {t['ci95'][0]:+.3f} .. "
              f"{t['ci95'][1]:+.3f}, {t['questions']} questions); discordant runs {t['method_only']} vs "
              f"{t['baseline_only']}, sign test p = {t['sign_test_p']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--every", type=int, default=1, help="use every n-th question (a smaller set of every kind)")
    ap.add_argument("--particles", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--reference-samples", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="seeds of the sampler runs (the reference uses the first)")
    ap.add_argument("--reference-seed", type=int, default=None, help="seed of the reference samples (default: the first seed)")
    ap.add_argument("--methods", nargs="+", default=None, choices=["K=0", "K=2", "K=4", "K=8", "adaptive", "exact SD"],
                    help="run only these settings (default: all)")
    ap.add_argument("--question-ids", type=int, nargs="+", default=None,
                    help="run only these questions (0-based line numbers of factual.jsonl)")
    ap.add_argument("--shard", default="0/1", help="I/S: run only the questions with index %% S == I")
    ap.add_argument("--reference-from", default=None,
                    help="take each question's reference answer from this result file instead of sampling it "
                         "again (it must hold every question run)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="FILE[:METHOD,...]",
                    help="combine these result files (shards) into --out, print the table, run nothing; "
                         "FILE:K=0,adaptive keeps only those settings' rows of FILE")
    ap.add_argument("--merge-seeds", type=int, nargs="+", default=None,
                    help="with --merge: keep only the rows of these sampler seeds")
    ap.add_argument("--out", default=str(ROOT / "results" / "adaptive_quality.json"))
    args = ap.parse_args()
    if args.merge:
        parts, rows = [], []
        for spec in args.merge:
            path, _, keep = spec.partition(":")
            part = json.loads(Path(path).read_text())
            keep = set(keep.split(",")) if keep else None
            parts.append(part)
            rows += [r for r in part["rows"] if (keep is None or r["method"] in keep)
                     and (args.merge_seeds is None or r["seed"] in args.merge_seeds)]
        write(args.out, {**parts[0], "questions": len({r["question"] for r in rows}),
                         "shard": None, "merged_from": args.merge}, rows)
        return
    shard, shards = (int(x) for x in args.shard.split("/"))
    torch.set_num_threads(1)
    model = sd.load_model(threads=1)
    draft_model = sd.load_default_draft(model)
    draft = sd.Draft(draft_model, proposal_temperature(draft_model, 1.0))
    questions = [json.loads(line) for line in (ROOT / "data" / "factual.jsonl").read_text().splitlines()]
    questions = list(enumerate(questions))[:: args.every][: args.questions]
    if args.question_ids is not None:
        bad = sorted(set(args.question_ids) - {qi for qi, _ in questions})
        if bad:
            raise ValueError(f"--question-ids {bad} are not among the selected questions "
                             f"(0..{len(questions) - 1} with --every {args.every}): give line numbers of factual.jsonl")
        questions = [(qi, q) for qi, q in questions if qi in set(args.question_ids)]
    references = None
    if args.reference_from:
        references = {r["question"]: (r["reference"], r["reference_share"])
                      for r in json.loads(Path(args.reference_from).read_text())["rows"]}
        missing = sorted({qi for qi, _ in questions} - set(references))
        if missing:
            raise ValueError(f"--reference-from {args.reference_from} has no reference for questions {missing}: "
                             "give a result file that ran them, or leave --reference-from out")
    questions = [(qi, q) for i, (qi, q) in enumerate(questions) if i % shards == shard]
    meta = {"benchmark": "adaptive_quality", "date": time.strftime("%Y-%m-%d"), "device": "cpu",
            "machine": platform.processor() or platform.machine(), "threads": 1, "model": model.name,
            "draft": draft_model.name, "target_temperature": 1.0, "draft_temperature": draft.temperature,
            "max_new_tokens": args.max_new_tokens, "reference_samples": args.reference_samples,
            "seeds": args.seeds, "reference_seed": args.reference_seed, "reference_from": args.reference_from,
            "methods": args.methods,
            "questions": len(questions), "every": args.every, "shard": args.shard}
    methods = [("K=0", "target", None), ("K=2", draft, 2), ("K=4", draft, 4), ("K=8", draft, 8),
               ("adaptive", draft, "adaptive")]
    if args.methods:
        methods = [m for m in methods if m[0] in args.methods]
    rows, started = [], time.time()
    for done, (qi, q) in enumerate(questions):
        prompt = [{"role": "user", "content": q["question"]}]
        ids = model.prompt_ids(prompt)
        fmt = re.compile(q["regex"])
        target = sd.LM(model, temperature=1.0) * sd.Regex(q["regex"])
        if references is not None:
            answer, share = references[qi]
        else:
            ref = sd.Autoregressive(target, samples=args.reference_samples).run(
                prompt, max_new_tokens=args.max_new_tokens,
                seed=args.seeds[0] if args.reference_seed is None else args.reference_seed, progress=False)
            counts = collections.Counter(t.strip() for t in ref.texts if fmt.fullmatch(t.strip()))
            answer, hits = counts.most_common(1)[0] if counts else (None, 0)
            share = hits / args.reference_samples
        base = {"question": qi, "reference": answer, "reference_share": share}
        for seed in args.seeds:
            for N in args.particles:
                for name, proposal, K in methods:
                    r = sd.SMC(target, proposal, particles=N, block_size=K).run(
                        prompt, max_new_tokens=args.max_new_tokens, seed=seed, progress=False)
                    text = r.text.strip() if r.text is not None else None
                    if text is not None and not fmt.fullmatch(text):
                        raise AssertionError(f"{name} N={N} returned {text!r}, not a match of {q['regex']!r}")
                    rows.append({**base, "seed": seed, "method": name, "N": N, "answer": text,
                                 "agree": text == answer,
                                 "log_p": log_p(model, ids, r.sample_tokens) if text is not None else None,
                                 "tokens": r.generated_tokens, "seconds": r.seconds,
                                 "tokens_per_second": r.tokens_per_second, "log_evidence": r.log_evidence,
                                 "mean_ess": r.mean_ess, "block_sizes": r.block_sizes,
                                 "diagnosis": r.diagnosis})
            if args.methods and "exact SD" not in args.methods:
                continue
            spec = sd.SpeculativeDecoding(sd.LM(model, temperature=1.0), draft, block_size=4).run(
                prompt, max_new_tokens=args.max_new_tokens, seed=seed, progress=False)
            m = fmt.search(spec.text)
            text = m.group(0) if m else None
            rows.append({**base, "seed": seed, "method": "exact SD", "N": 1, "answer": text,
                         "agree": text == answer, "log_p": log_p(model, ids, spec.sample_tokens),
                         "tokens": spec.generated_tokens, "seconds": spec.seconds,
                         "tokens_per_second": spec.tokens_per_second, "acceptance": spec.acceptance_rate})
        write(args.out, meta, rows, table=False)  # after every question: a cut-short run keeps its rows
        print(f"[{done + 1}/{len(questions)}] question {qi} {time.time() - started:.0f} s  "
              f"reference {answer!r} (share {share:.2f})", file=sys.stderr, flush=True)
    write(args.out, meta, rows)


if __name__ == "__main__":
    main()
