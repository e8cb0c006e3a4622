"""Fidelity of SMC-SD on real weights: per-token target log-likelihood of its outputs.

On held-out chat prompts (the prompts `python -m smcdecode.distill` held out: same files, same
seed, same length filter), each method generates one answer of at most --max-new-tokens tokens:

    target          plain autoregressive samples from p_T (the reference)
    smc_k4, smc_k8  SMC-SD, N=8 particles, K=4 / 8 draft tokens per round, distilled draft
    smc_adaptive    SMC-SD, N=8, block_size="adaptive" (K per round from the particles' past), distilled draft
    sd_k4           exact speculative decoding, K=4, distilled draft (exactly p_T)
    smc_trunc_k4    SMC-SD, N=8, K=4, truncated draft (the target's first --truncated layers)

All at T=0.7 (target and draft). Every answer x is scored by the target: the mean per-token
log p(x_t | prompt, x_<t) at T=1 (the model's own likelihood) and at T=0.7 (the sampled
distribution). A method that samples p_T matches `target` up to noise; a biased one does not.
Also recorded per SMC run: mean ESS per round, rounds with ESS ≥ N/2, resampling rate; per SD run
the acceptance rate.

--toward-target λ replaces the distilled draft's proposal by q_λ ∝ p_T^λ · q_T'^(1−λ): the draft moved
a fraction λ of the way to the target, per token (λ = 0: the draft itself; 1: the target). Not a
practical draft (it runs the target at every drafted token); it measures how close a draft must be
for a given ESS. Each drafted position also records Σ_v min(p_T, q_λ) and KL(p_T‖q_λ) along the
particles' own paths (own_acceptance, own_kl).

Runs the prompts in --workers processes (each loads its own models on --device); answers go to
--results-dir as JSON lines as they are made, so a run cut short by --budget can be continued.

    python benchmarks/draft_fidelity.py --target smollm2 --draft default --prompts sharegpt_500.json \\
        alpaca_eval_instructions.json --device cuda --workers 12 --out fidelity.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from smcdecode.models import Model

METHODS = ("target", "smc_k4", "smc_k8", "smc_adaptive", "sd_k4", "smc_trunc_k4")


def heldout_prompts(args, target) -> list[str]:
    from smcdecode.distill import chat_prompts, load_prompts, split_prompts

    usable = chat_prompts(target, load_prompts(args.prompts), args.max_prompt_tokens)
    _, held = split_prompts(usable, args.holdout, args.seed)
    return [text for text, _ in held][: args.limit]


class TowardTarget(Model):
    """The proposal q_λ ∝ p_T^λ · q_T'^(1−λ) as a model for ``Draft(·, T')``: its runner returns
    T'·log q_λ, which the sampler's division by T' turns back into log q_λ."""

    def __init__(self, draft, target, lam: float, temperature: float, draft_temperature: float):
        self.draft, self.target, self.lam = draft, target, lam
        self.T, self.Tq = temperature, draft_temperature
        self.name = f"{draft.name}-toward-target-{lam:g}"
        self.vocab_size, self.eos_token_id, self.max_context = draft.vocab_size, draft.eos_token_id, draft.max_context
        self.sums = [0.0, 0.0, 0]  # Σ acceptance, Σ KL(p_T‖q_λ), drafted positions (every particle)

    def start(self, prefix_ids, batch):
        return _TowardRunner(self, self.draft.start(prefix_ids, batch), self.target.start(prefix_ids, batch))

    def take_stats(self) -> dict:
        acc, kl, n = self.sums
        self.sums = [0.0, 0.0, 0]
        return {"own_acceptance_sum": acc, "own_kl_sum": kl, "own_positions": n}


class _TowardRunner:
    def __init__(self, model: TowardTarget, draft_runner, target_runner):
        self.m, self.d, self.t = model, draft_runner, target_runner

    @property
    def length(self) -> int:
        return self.d.length

    def extend(self, tokens):
        import torch

        m = self.m
        lq = torch.log_softmax(self.d.extend(tokens).double() / m.Tq, -1)
        lp = torch.log_softmax(self.t.extend(tokens).double().to(lq.device) / m.T, -1)
        mix = torch.log_softmax(m.lam * lp + (1 - m.lam) * lq, -1)
        p_last, mix_last = lp[:, -1].exp(), mix[:, -1]  # the position the next token is drafted from
        m.sums[0] += float(torch.minimum(p_last, mix_last.exp()).sum())
        m.sums[1] += float((p_last * (lp[:, -1] - mix_last)).nan_to_num(0.0, posinf=0.0).sum())
        m.sums[2] += p_last.shape[0]
        return (m.Tq * mix).float()

    def reorder(self, index) -> None:
        self.d.reorder(index)
        self.t.reorder(index)

    def crop(self, length: int) -> None:
        self.d.crop(length)
        self.t.crop(length)


def _strategies(args, target):
    from smcdecode import LM, SMC, Autoregressive, Draft, SpeculativeDecoding, truncated_draft
    from smcdecode.drafts import load_default_draft, load_draft

    T = args.temperature
    Tq = T if args.draft_temperature is None else args.draft_temperature  # the proposal's temperature
    lm = LM(target, T)
    out = {}
    if "target" in args.methods:
        out["target"] = Autoregressive(lm, samples=1)
    if {"smc_k4", "smc_k8", "smc_adaptive", "sd_k4"} & set(args.methods):  # the distilled draft, loaded only when used
        draft = load_default_draft(target) if args.draft == "default" else load_draft(target, args.draft)
        if args.toward_target is not None:
            draft = TowardTarget(draft, target, args.toward_target, T, Tq)
        made = {"smc_k4": lambda: SMC(lm, Draft(draft, Tq), particles=args.particles, block_size=4),
                "smc_k8": lambda: SMC(lm, Draft(draft, Tq), particles=args.particles, block_size=8),
                "smc_adaptive": lambda: SMC(lm, Draft(draft, Tq), particles=args.particles, block_size="adaptive"),
                "sd_k4": lambda: SpeculativeDecoding(lm, Draft(draft, Tq), block_size=4)}
        out.update({name: make() for name, make in made.items() if name in args.methods})
    if "smc_trunc_k4" in args.methods:
        trunc = truncated_draft(target, args.truncated)
        out["smc_trunc_k4"] = SMC(lm, Draft(trunc, Tq), particles=args.particles, block_size=4)
    return out


def _score(target, prompt_ids: list[int], tokens: list[int], temperature: float) -> tuple[float, float]:
    """Mean per-token log p(x_t | ·) of ``tokens`` after ``prompt_ids``, at T=1 and at ``temperature``."""
    import torch

    ids = torch.tensor([prompt_ids + tokens], device=target.device)
    with torch.inference_mode():
        logits = target.hf(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [n, V]
    idx = torch.tensor(tokens, device=logits.device)[:, None]
    ll1 = torch.log_softmax(logits, -1).gather(1, idx).mean()
    llt = torch.log_softmax(logits / temperature, -1).gather(1, idx).mean()
    return float(ll1), float(llt)


def worker(rank: int, args, jobs: list[tuple[int, str]], deadline: float) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from smcdecode import load_model

    target = load_model(args.target, device=args.device, threads=args.threads)
    strategies = _strategies(args, target)
    methods = list(args.methods)
    out = Path(args.results_dir) / f"worker{rank}-{'-'.join(methods)}.jsonl"
    done = _done(Path(args.results_dir))
    with open(out, "a") as f:
        for idx, text in jobs:
            if time.time() > deadline:
                break
            messages = [{"role": "user", "content": text}]
            prompt_ids = target.chat(messages)
            for j, name in enumerate(methods):
                if (idx, name) in done:
                    continue
                res = strategies[name].run(messages, max_new_tokens=args.max_new_tokens,
                                           seed=args.seed * 100_000 + 10 * idx + j, progress=False)
                tokens = res.sample_tokens or []
                ll1, llt = _score(target, prompt_ids, tokens, args.temperature) if tokens else (math.nan, math.nan)
                half = res.particles / 2
                rec = {
                    "prompt": idx, "method": name, "tokens": len(tokens), "ll_t1": ll1, "ll_t": llt,
                    "seconds": res.seconds, "rounds": res.rounds,
                    "finished": bool(tokens and tokens[-1] == target.eos_token_id),
                    "text": target.decode(tokens)[:160],
                }
                model = getattr(getattr(strategies[name], "proposal", None), "model", None)
                if isinstance(model, TowardTarget):
                    rec.update(model.take_stats())
                if name.startswith("smc"):
                    rec.update(mean_ess=res.mean_ess, resample_rate=res.resample_rate, ess=res.ess,
                               rounds_ess_ge_half=sum(e >= half for e in res.ess), block_sizes=res.block_sizes)
                if name.startswith("sd"):
                    rec.update(drafted=res.draft_tokens, accepted=res.accepted_tokens)
                f.write(json.dumps(rec) + "\n")
                f.flush()


def _done(results_dir: Path) -> set[tuple[int, str]]:
    done = set()
    for file in results_dir.glob("worker*.jsonl"):
        for line in file.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed run
            done.add((r["prompt"], r["method"]))
    return done


def _distinct2(text: str) -> float:
    """Distinct word bigrams / bigrams of a text (1: no repetition; degenerate loops score low)."""
    words = text.split()
    pairs = list(zip(words, words[1:]))
    return len(set(pairs)) / len(pairs) if pairs else 1.0


def _mean_ci(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, math.nan
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, 1.96 * sd / math.sqrt(n)


def aggregate(results_dir: Path, particles: int) -> dict:
    """Per-method figures over the prompts that every method present in ``results_dir`` completed
    (runs made by several invocations, e.g. one per group of methods, are pooled)."""
    recs: dict[tuple[int, str], dict] = {}
    for file in sorted(results_dir.glob("worker*.jsonl")):
        for line in file.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            recs[(r["prompt"], r["method"])] = r
    present = {m for _, m in recs}
    methods = [m for m in METHODS if m in present]
    prompts = sorted({p for p, _ in recs})
    complete = [p for p in prompts if all((p, m) in recs and math.isfinite(recs[(p, m)]["ll_t1"]) for m in methods)]
    table = {}
    for m in methods:
        rows = [recs[(p, m)] for p in complete]
        if not rows:
            continue
        entry = {"prompts": len(rows)}
        for key in ("ll_t1", "ll_t"):
            mean, ci = _mean_ci([r[key] for r in rows])
            entry[key] = {"mean": mean, "ci95": ci}
            if m != "target" and "target" in methods:
                diffs = [r[key] - recs[(p, "target")][key] for p, r in zip(complete, rows)]
                d, dci = _mean_ci(diffs)
                base = abs(sum(recs[(p, "target")][key] for p in complete) / len(complete))
                entry[key].update(diff_vs_target=d, diff_ci95=dci, rel_diff_pct=100 * d / base)
        entry["distinct2"] = sum(_distinct2(r["text"]) for r in rows) / len(rows)
        entry["mean_tokens"] = sum(r["tokens"] for r in rows) / len(rows)
        entry["finished_frac"] = sum(r["finished"] for r in rows) / len(rows)
        entry["mean_seconds"] = sum(r["seconds"] for r in rows) / len(rows)
        entry["tokens_per_second"] = sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)
        if m.startswith("smc"):
            all_ess = [e for r in rows for e in r["ess"]]
            entry["mean_ess_per_run"] = _mean_ci([r["mean_ess"] for r in rows])
            entry["mean_ess_pooled_rounds"] = sum(all_ess) / len(all_ess)
            entry["frac_rounds_ess_ge_half"] = sum(e >= particles / 2 for e in all_ess) / len(all_ess)
            entry["resample_rate"] = sum(r["resample_rate"] * r["rounds"] for r in rows) / sum(r["rounds"] for r in rows)
            entry["rounds"] = sum(r["rounds"] for r in rows)
            ks = [k for r in rows for k in r.get("block_sizes") or []]
            if ks:
                entry["mean_K"] = sum(ks) / len(ks)
        if rows[0].get("own_positions"):
            n = sum(r["own_positions"] for r in rows)
            entry["own_acceptance"] = sum(r["own_acceptance_sum"] for r in rows) / n
            entry["own_kl"] = sum(r["own_kl_sum"] for r in rows) / n
        if m.startswith("sd"):
            entry["acceptance_rate"] = sum(r["accepted"] for r in rows) / max(1, sum(r["drafted"] for r in rows))
        table[m] = entry
    return {"prompts_complete": len(complete), "prompts_started": len(prompts), "methods": table,
            "runs": {m: sum(1 for _, mm in recs if mm == m) for m in methods}}


def markdown(report: dict) -> str:
    lines = [
        "| method | prompts | mean log p (T=1) ± 95% CI | Δ vs target [95% CI] | rel. Δ | mean log p_T (T=0.7) | "
        "Δ vs target [95% CI] | distinct-2 | mean ESS / round | rounds ESS ≥ N/2 | resample rate | mean K | SD acceptance | "
        "tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, e in report["methods"].items():
        a, b = e["ll_t1"], e["ll_t"]

        def delta(x):
            if "diff_vs_target" not in x:
                return "—"
            lo, hi = x["diff_vs_target"] - x["diff_ci95"], x["diff_vs_target"] + x["diff_ci95"]
            return f"{x['diff_vs_target']:+.3f} [{lo:+.3f}, {hi:+.3f}]"

        rel = f"{a['rel_diff_pct']:+.1f}%" if "rel_diff_pct" in a else "—"
        ess = f"{e['mean_ess_pooled_rounds']:.2f}" if "mean_ess_pooled_rounds" in e else "—"
        half = f"{100 * e['frac_rounds_ess_ge_half']:.0f}%" if "frac_rounds_ess_ge_half" in e else "—"
        rr = f"{e['resample_rate']:.2f}" if "resample_rate" in e else "—"
        acc = f"{e['acceptance_rate']:.3f}" if "acceptance_rate" in e else "—"
        mean_k = f"{e['mean_K']:.2f}" if "mean_K" in e else "—"
        lines.append(f"| {m} | {e['prompts']} | {a['mean']:.3f} ± {a['ci95']:.3f} | {delta(a)} | {rel} | "
                     f"{b['mean']:.3f} ± {b['ci95']:.3f} | {delta(b)} | {e.get('distinct2', math.nan):.2f} | {ess} | "
                     f"{half} | {rr} | {mean_k} | {acc} | {e['tokens_per_second']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--draft", default="default", help="a draft directory, or 'default' (the shipped draft)")
    p.add_argument("--prompts", nargs="+", help="the prompt files given to smcdecode.distill (not needed with "
                   "--aggregate-only)")
    p.add_argument("--holdout", type=int, default=200, help="as given to smcdecode.distill")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="as given to smcdecode.distill")
    p.add_argument("--seed", type=int, default=0, help="as given to smcdecode.distill (also seeds the runs)")
    p.add_argument("--limit", type=int, default=None, help="use only the first LIMIT held-out prompts")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--particles", type=int, default=8)
    p.add_argument("--truncated", type=int, default=10, help="layers of the truncated draft")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--draft-temperature", type=float, default=None,
                   help="temperature of the drafts as proposals (default: --temperature; the target stays at --temperature)")
    p.add_argument("--toward-target", type=float, default=None, metavar="LAMBDA",
                   help="propose from q ∝ p_T^λ · q^(1-λ) instead of the draft (a study of how close a draft "
                        "must be; runs the target at every drafted token)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS", help="start no new prompt after this")
    p.add_argument("--results-dir", default="fidelity-results")
    p.add_argument("--out", default="fidelity.json")
    p.add_argument("--aggregate-only", action="store_true", help="only pool the runs already in --results-dir")
    args = p.parse_args(argv)
    if not args.prompts and not args.aggregate_only:
        p.error("--prompts is required (the prompt files given to smcdecode.distill)")

    start = time.time()
    deadline = start + args.budget if args.budget else math.inf
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    import torch

    from smcdecode import load_model

    if args.aggregate_only:
        report = aggregate(results, args.particles)
        old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        report.update({k: old[k] for k in ("date", "device", "seconds", "settings") if k in old})
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(markdown(report))
        print(f"{report['prompts_complete']} prompts complete (every method); answers per method: {report['runs']}")
        return 0
    device = args.device
    if device.startswith("cuda") and torch.cuda.is_available():
        device += f" ({torch.cuda.get_device_name()})"
    header = dict(date=time.strftime("%Y-%m-%d"), device=device,
                  settings={k: v for k, v in vars(args).items() if k not in ("results_dir", "out")})
    Path(args.out).write_text(json.dumps(header, indent=2) + "\n")  # kept by --aggregate-only after a cut run
    target = load_model(args.target, device="cpu")  # tokenizer only, for the held-out split
    prompts = heldout_prompts(args, target)
    del target
    jobs = list(enumerate(prompts))
    print(f"{len(jobs)} held-out prompts, {args.workers} workers, methods {args.methods}", flush=True)
    if args.workers > 1:
        ctx = torch.multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, args, jobs[r :: args.workers], deadline))
                 for r in range(args.workers)]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
        failed = [r for r, pr in enumerate(procs) if pr.exitcode != 0]
        if failed:
            print(f"workers {failed} failed (exit codes {[procs[r].exitcode for r in failed]})", flush=True)
    else:
        worker(0, args, jobs, deadline)
    report = aggregate(results, args.particles)
    report.update(header, seconds=round(time.time() - start, 1))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"{report['prompts_complete']} of {len(jobs)} prompts complete (every method) in {report['seconds']:.0f} s; "
          f"answers per method: {report['runs']}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
