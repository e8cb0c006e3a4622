"""How close must a draft be for SMC-SD's ESS to reach N/2? One figure from the fidelity runs.

Reads the ``draft_fidelity.py --toward-target λ`` reports (the shipped draft moved λ of the way to
the target, per token: q_λ ∝ p_T^λ q^(1−λ)) and the same runs of other drafts at λ = 0, and plots
the mean ESS after a round (of N) against the per-token acceptance Σ min(p_T, q) and KL(p_T‖q)
measured at the drafted positions of the particles' own paths:

    python benchmarks/plot_ess_closeness.py            # -> docs/img/ess_vs_closeness.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "docs" / "draft_results" / "run6"
DRAFTS = {  # label -> report at λ = 0 (own-path figures of a draft as it is)
    "shipped, 6 layers": RUN / "toward_target" / "fidelity_toward0.json",
    "grown to 11 layers": RUN / "grown11" / "fidelity_grown_toward0.json",
    "15 layers from the target's": RUN / "fresh15" / "fidelity_d15_toward0.json",
}


def point(path: Path) -> dict:
    report = json.loads(path.read_text())
    entry = report["methods"]["smc_k4"]
    return {"lam": report["settings"].get("toward_target"), "ess": entry["mean_ess_pooled_rounds"],
            "acceptance": entry["own_acceptance"], "kl": entry["own_kl"], "prompts": entry["prompts"],
            "particles": report["settings"]["particles"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "img" / "ess_vs_closeness.png"))
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = sorted((point(f) for f in (RUN / "toward_target").glob("fidelity_toward*.json")), key=lambda d: d["lam"])
    drafts = {label: point(f) for label, f in DRAFTS.items()}
    n = curve[0]["particles"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, xlabel in ((axes[0], "acceptance", "per-token acceptance Σ min(p_T, q) on the particles' paths"),
                            (axes[1], "kl", "per-token KL(p_T ‖ q) on the particles' paths (nats)")):
        ax.plot([c[key] for c in curve], [c["ess"] for c in curve], "o-", color="tab:blue",
                label="shipped draft moved λ toward the target")
        for c in curve:
            ax.annotate(f"λ={c['lam']:g}", (c[key], c["ess"]), textcoords="offset points", xytext=(4, -12), fontsize=8)
        for (label, d), marker in zip(drafts.items(), "s^D"):
            ax.plot(d[key], d["ess"], marker, markersize=8, fillstyle="none", label=label)
        ax.axhline(n / 2, color="tab:red", linestyle="--", linewidth=1, label=f"goal: ESS ≥ N/2 = {n / 2:g}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[1].invert_xaxis()
    axes[0].set_ylabel(f"mean ESS after a K=4 round (of N={n})")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("SMC-SD on SmolLM2-135M-Instruct, T=0.7, proposal at T'=0.5: "
                 f"{curve[0]['prompts']} held-out prompts, 64 tokens (H200, 2026-11-21)", fontsize=9)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
