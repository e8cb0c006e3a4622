"""Plots of a run: ESS over rounds and particle weights over rounds (matplotlib)."""

from __future__ import annotations


def plot_result(result, path: str | None = None):
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from matplotlib.ticker import MaxNLocator

    fig, (ax_ess, ax_w) = plt.subplots(1, 2, figsize=(11, 3.6))
    rounds = list(range(1, len(result.ess) + 1))
    ax_ess.plot(rounds, result.ess, marker="o", ms=3, label="ESS")
    rs = [r for r, flag in zip(rounds, result.resampled) if flag]
    ax_ess.scatter(rs, [result.ess[r - 1] for r in rs], color="C3", zorder=3, label="resampled")
    ax_ess.axhline(result.particles, color="grey", lw=0.8, ls="--")
    ax_ess.set_xlabel("round")
    ax_ess.set_ylabel("effective sample size")
    ax_ess.set_ylim(0, result.particles * 1.05)
    ax_ess.set_title("ESS before resampling")
    ax_ess.legend(loc="best", fontsize=8)
    if result.weight_history:
        W = torch.stack(result.weight_history).T.numpy()  # [N, rounds]
        im = ax_w.imshow(W, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest",
                         extent=(0.5, len(rounds) + 0.5, W.shape[0] - 0.5, -0.5))
        fig.colorbar(im, ax=ax_w, label="normalised weight")
    ax_w.set_xlabel("round")
    ax_w.set_ylabel("particle")
    ax_w.set_title("weights before resampling")
    for ax in (ax_ess, ax_w):  # rounds are whole numbers (one round: 1, not 0.96 … 1.04)
        ax.set_xlim(0.5, len(rounds) + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_w.yaxis.set_major_locator(MaxNLocator(integer=True))  # particles are whole numbers too
    proposal = f"K={result.block_size}" if result.block_size else "the target as proposal"
    fig.suptitle(f"{result.strategy}: N={result.particles}, {proposal}, log Z={result.log_evidence:.3f}")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig
