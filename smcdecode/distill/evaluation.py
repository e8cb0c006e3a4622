"""The distillation loss KL(p_T || q_T) and the held-out figures of a draft (acceptance Σ min(p, q),
χ², KL), over the response positions of (prompt, response) sequences."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..drafts import draft_info
from ..drafts.feature import FeatureDraftModel, head_logits, target_hidden
from ..errors import SMCDecodeError
from ..models import HFModel
from .config import progress_bar


def response_logits(hf: torch.nn.Module, input_ids: Tensor, positions: Tensor) -> Tensor:
    """Next-token logits [P, V] at the selected ``positions`` ([B, T] bool) only."""
    hidden = hf.model(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, T, H]
    return head_logits(hf, hidden[positions])


def kl_loss(target_logits: Tensor, draft_logits: Tensor, temperatures: Sequence[float]) -> Tensor:
    """Mean over positions and temperatures of KL(p_T || q_T); logits [P, V]."""
    total = draft_logits.new_zeros(())
    for t in temperatures:
        log_p = torch.log_softmax(target_logits / t, dim=-1)
        log_q = torch.log_softmax(draft_logits / t, dim=-1)
        total = total + (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return total / len(temperatures)


def response_batch(seqs: Sequence[tuple[list[int], list[int]]], device) -> tuple[Tensor, Tensor]:
    """input ids [B, T] (right-padded) and the positions [B, T] that predict a response token."""
    width = max(len(p) + len(r) - 1 for p, r in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    positions = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, (p, r) in enumerate(seqs):
        full = (p + r)[:-1]  # the last token predicts nothing we train on
        ids[b, : len(full)] = torch.tensor(full)
        positions[b, len(p) - 1 : len(full)] = True
    return ids.to(device), positions.to(device)


@torch.no_grad()
def evaluate_draft(
    target: HFModel,
    draft: HFModel,
    corpus: Sequence[tuple[list[int], list[int]]],
    *,
    temperature: float = 0.7,
    draft_temperature: float | None = None,
    batch_size: int = 16,
    progress: bool = False,
    unroll: int | None = None,
) -> dict:
    """Held-out figures of ``draft`` against ``target`` at ``temperature`` over the response
    positions of ``corpus``: mean acceptance Σ min(p, q), χ² = Σ p²/q − 1 (mean, median, and the
    mean of log(1 + χ²)), KL(p || q), and the positions counted. Runs in float32. q is the draft at
    ``draft_temperature`` (default: ``temperature``): the proposal SMC-SD / SD would use with it.

    A feature draft is evaluated as SMC-SD runs it: at drafted position s = 1..``unroll`` (default:
    its training unroll) of a round, reading the target's feature s positions back and its own
    outputs since; ``by_draft_step`` has the figures per s, the headline figures average them."""
    if draft_temperature is None:
        draft_temperature = temperature
    if not (draft_temperature > 0 and math.isfinite(draft_temperature)):
        raise SMCDecodeError(f"draft_temperature must be a finite number > 0, got {draft_temperature!r}")
    device = target.device
    feature = isinstance(draft, FeatureDraftModel)
    steps = (unroll or draft_info(draft).get("config", {}).get("training", {}).get("config", {}).get("unroll", 4)) \
        if feature else 1
    acc, chi, kl = [[] for _ in range(steps)], [[] for _ in range(steps)], [[] for _ in range(steps)]
    bar = progress_bar(progress, len(corpus), "evaluating", "seq")
    for start in range(0, len(corpus), batch_size):
        seqs = corpus[start : start + batch_size]
        ids, pos = response_batch(seqs, device)
        if feature:
            hidden, z_t = target_hidden(target.hf, ids, use_cache=False)
            log_p = torch.log_softmax(z_t[pos] / temperature, -1)
            z_ds = [draft.net.logits(h)[pos] for h in draft.net.unrolled(ids, hidden, steps)]
        else:
            log_p = torch.log_softmax(response_logits(target.hf, ids, pos) / temperature, -1)
            z_ds = [response_logits(draft.hf, ids, pos)]
        for s, z_d in enumerate(z_ds):
            log_q = torch.log_softmax(z_d / draft_temperature, -1)
            acc[s].append(torch.minimum(log_p, log_q).exp().sum(-1).double().cpu())
            chi[s].append(torch.logsumexp(2 * log_p - log_q, -1).double().cpu())  # log(1 + χ²)
            kl[s].append((log_p.exp() * (log_p - log_q)).sum(-1).double().cpu())
        if bar is not None:
            bar.update(len(seqs))
    if bar is not None:
        bar.close()
    if not acc[0]:
        raise SMCDecodeError("the evaluation corpus is empty")
    report = {
        "temperature": temperature,
        **({"draft_temperature": draft_temperature} if draft_temperature != temperature else {}),
        **_figures(torch.cat([torch.cat(a) for a in acc]), torch.cat([torch.cat(c) for c in chi]),
                   torch.cat([torch.cat(k) for k in kl])),
        "sequences": len(corpus),
    }
    if feature:  # the headline figures average the drafted positions 1..unroll of a round
        report["by_draft_step"] = [_figures(torch.cat(a), torch.cat(c), torch.cat(k)) for a, c, k in zip(acc, chi, kl)]
        report["positions"] = report["by_draft_step"][0]["positions"]
    return report


def _figures(a: Tensor, log1p_chi2: Tensor, k: Tensor) -> dict:
    chi2 = torch.expm1(log1p_chi2)
    return {
        "acceptance": float(a.mean()),
        "chi2_mean": float(chi2.mean()),
        "chi2_median": float(chi2.median()),
        "log1p_chi2_mean": float(log1p_chi2.mean()),
        "kl": float(k.mean()),
        "positions": int(a.numel()),
    }
