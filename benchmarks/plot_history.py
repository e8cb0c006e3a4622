"""Plot the engine's benchmark runs against the issue's targets, and where a round's device time goes.

Reads docs/benchmarks.json (the latest run, its chain of ``previous_run`` entries and, when present,
the latest session's extra re-runs) and writes one figure:

    python benchmarks/plot_history.py            # -> docs/img/engine_history.png

Left and middle: SMC-SD N=8 K=8 tok/s (one request; eight requests in total) of every published run,
by the run's UTC time, with the target as a line; extra re-runs of the latest engine as open
markers. Right: the latest run's profile (device time a round, by kind of kernel).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = {1: 650.0, 8: 2500.0}  # tok/s in total (issue 4)
SYSTEM = "engine SMC-SD N=8 K=8"


def runs_chain(doc: dict) -> list[dict]:
    """The published runs, oldest first (each entry's ``previous_run`` is the run before it)."""
    chain, node = [], doc
    while node:
        chain.append(node)
        node = node.get("previous_run")
    return chain[::-1]


def tok_s(run: dict, requests: int) -> float | None:
    for r in run.get("runs", []):
        if r.get("system") == SYSTEM and r.get("requests") == requests:
            return r.get("tok_s_total")
    return None


def kernel_kind(name: str) -> str:
    """A profile row's kind of kernel."""
    if name.startswith(("nvjet", "_skinny_linear", "void cublasLt", "sm90_xmma", "cutlass")) or "gemm" in name:
        return "weight products"
    if name.startswith("_paged_attn") or name.startswith("_merge_splits"):
        return "attention"
    if name.startswith(("_add_rms_norm", "_add_t_rms_norm", "_embed_rms_norm")):
        return "norms"
    if name.startswith("_silu_mul"):
        return "SiLU·mul"
    if name.startswith("_sample"):
        return "sampling"
    return "other (torch, copies, RoPE)"


def profile_by_kind(profile: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, ms, _calls, _us in profile["kernels"]:
        k = kernel_kind(name)
        out[k] = out.get(k, 0.0) + ms
    # the table lists the largest kernels only: the rest of the total is "other"
    out["other (torch, copies, RoPE)"] = out.get("other (torch, copies, RoPE)", 0.0) + max(
        0.0, profile["total_ms_per_round"] - sum(out.values()))
    return out


def extra_runs(doc: dict) -> list[dict]:
    """Re-runs of the latest engine stored under the latest session's key (``second_run``, ...)."""
    sessions = sorted((k for k in doc if k.startswith("session") and k[7:].isdigit()), key=lambda k: int(k[7:]))
    if not sessions:
        return []
    last = doc[sessions[-1]]
    return [v for k, v in last.items() if k.endswith("_run") and isinstance(v, dict) and "runs" in v]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="docs/benchmarks.json")
    ap.add_argument("--out", default="docs/img/engine_history.png")
    args = ap.parse_args()
    path = Path(args.json)
    if not path.is_file():
        raise SystemExit(f"--json {str(path)!r}: no such file (run benchmarks/bench_engine.py first)")
    doc = json.loads(path.read_text())
    chain = runs_chain(doc)
    labels = [r.get("date", "?")[11:16] for r in chain]
    extras = extra_runs(doc)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1, 1, 1.2]})
    for ax, G in zip(axes[:2], (1, 8)):
        ys = [tok_s(r, G) for r in chain]
        xs = [i for i, y in enumerate(ys) if y is not None]
        ax.plot(xs, [ys[i] for i in xs], "o-", color="tab:blue", label="benchmark run")
        for e in extras:
            y = tok_s(e, G)
            if y is not None:
                ax.plot(len(chain) - 1, y, "o", mfc="none", color="tab:blue", ms=9)
        if extras:
            ax.plot([], [], "o", mfc="none", color="tab:blue", label="re-runs of the latest engine")
        ax.axhline(TARGETS[G], color="tab:red", ls="--", label=f"target {TARGETS[G]:,.0f} tok/s")
        ax.set_xticks(range(len(chain)), labels, rotation=45)
        ax.set_xlabel("run (UTC, 2026-11-21)")
        ax.set_ylabel("tok/s in total")
        ax.set_title(f"SMC-SD N=8 K=8, {G} request{'s' if G > 1 else ''} (H200)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")

    ax = axes[2]
    kinds = ["weight products", "attention", "norms", "SiLU·mul", "sampling", "other (torch, copies, RoPE)"]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red", "tab:gray"]
    rows = [(G, doc.get(f"profile_per_round_G{G}")) for G in (1, 8)]
    rows = [(G, p) for G, p in rows if p]
    for y, (_, prof) in enumerate(rows):
        parts = profile_by_kind(prof)
        left = 0.0
        for k, c in zip(kinds, colors):
            w = parts.get(k, 0.0)
            ax.barh(y, w, left=left, color=c, label=k if y == 0 else None)
            if w > 0.6:
                ax.text(left + w / 2, y, f"{w:.1f}", ha="center", va="center", fontsize=8, color="white")
            left += w
    ax.set_yticks(range(len(rows)), [f"{G} request{'s' if G > 1 else ''}" for G, _ in rows])
    ax.set_xlabel("device time a round, ms (profile of the latest run)")
    ax.set_title("Where a round's device time goes")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
