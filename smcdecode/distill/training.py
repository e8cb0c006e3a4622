"""Training a draft: AdamW on the draft's own parameters against KL(p_T || q_T), with checkpoints
that resume exactly, a warm-up + cosine schedule on steps or time, and model selection by
validation KL."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..drafts import load_own_state, own_parameters, own_state
from ..drafts.feature import FeatureDraftModel, target_hidden
from ..errors import SMCDecodeError
from ..models import HFModel
from .config import DistillConfig, progress_bar
from .evaluation import evaluate_draft, kl_loss, response_batch, response_logits


def _epoch_batches(corpus, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of one epoch: a seeded shuffle, lengths sorted within windows of 16 batches (less
    padding), batch order shuffled again. Deterministic in (seed, epoch), so training resumes
    exactly where it stopped."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(corpus)))
    rng.shuffle(order)
    window = 16 * batch_size
    batches = []
    for s in range(0, len(order), window):
        chunk = sorted(order[s : s + window], key=lambda i: len(corpus[i][0]) + len(corpus[i][1]))
        batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _lr_factor(step: int, progress: float, cfg: DistillConfig) -> float:
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def _unrolled_loss(target: HFModel, draft: FeatureDraftModel, ids: Tensor, pos: Tensor, config: DistillConfig) -> Tensor:
    """A feature draft's loss: the mean over unrolled steps s = 1..``config.unroll`` of the KL at
    the response positions, step s reading its own outputs of the s − 1 positions before."""
    with torch.no_grad():
        hidden, z_t = target_hidden(target.hf, ids, use_cache=False)
        z_t = z_t[pos]
    outs = draft.net.unrolled(ids, hidden, config.unroll)
    return sum(kl_loss(z_t, draft.net.logits(h)[pos], config.temperatures) for h in outs) / len(outs)


def train_draft(
    target: HFModel,
    draft: HFModel,
    corpus: Sequence[tuple[list[int], list[int]]],
    config: DistillConfig,
    *,
    checkpoint: str | Path | None = None,
    validation: Sequence[tuple[list[int], list[int]]] = (),
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Minimise KL(p_T || q_T) over ``corpus`` by AdamW on the draft's own parameters (the target
    is frozen). With ``checkpoint``, state is saved there every ``checkpoint_every`` steps and at the
    end, and a compatible checkpoint found there is resumed. With ``validation`` sequences and
    ``config.eval_every``, the draft with the lowest validation KL is the one left at the end.
    Returns {"steps", "seconds", "history", "best"}."""
    config.check()
    if not corpus:
        raise SMCDecodeError("the training corpus is empty")
    device = target.device
    for p in target.hf.parameters():
        p.requires_grad_(False)
    params = own_parameters(draft)
    feature = isinstance(draft, FeatureDraftModel)
    module = draft.net if feature else draft.hf
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, elapsed, history = 0, 0.0, []
    best: dict = {"kl": math.inf, "step": None, "state": None}
    validate = bool(config.eval_every and validation)
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        saved = {k: state["config"].get(k, DistillConfig.FIELD_DEFAULTS.get(k)) for k in DistillConfig.TRAINING_FIELDS}
        now = {k: dataclasses.asdict(config)[k] for k in DistillConfig.TRAINING_FIELDS}
        if saved != now:
            changed = {k: (saved[k], now[k]) for k in now if saved[k] != now[k]}
            raise SMCDecodeError(
                f"checkpoint {str(ckpt)!r} was made with another recipe {changed} (saved, now): "
                "use the same options to resume, or --fresh to start over"
            )
        load_own_state(draft, state["draft"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        best = state.get("best") or best
        log(f"resuming from {ckpt} at step {step} ({elapsed:.0f} s trained)")

    def progress_of(step: int, elapsed: float) -> float:
        p = step / config.steps
        if config.time_budget_s:
            p = max(p, elapsed / config.time_budget_s)
        return p

    def save() -> None:
        if ckpt is None:
            return
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"step": step, "elapsed": elapsed, "history": history, "config": dataclasses.asdict(config),
                    "draft": {k: v.detach().cpu() for k, v in own_state(draft).items()},
                    "optimizer": opt.state_dict(), "best": best}, tmp)
        tmp.replace(ckpt)

    def check_validation() -> None:
        module.eval()
        fig = evaluate_draft(target, draft, validation, temperature=config.temperatures[0], unroll=config.unroll)
        module.train()
        history.append({"step": step, "seconds": round(elapsed, 1), "validation_kl": fig["kl"],
                        "validation_acceptance": fig["acceptance"]})
        if fig["kl"] < best["kl"]:
            best.update(kl=fig["kl"], step=step,
                        state={k: v.detach().cpu().clone() for k, v in own_state(draft).items()})
        log(f"step {step}: validation KL {fig['kl']:.4f}, acceptance {fig['acceptance']:.3f} "
            f"(best KL {best['kl']:.4f} at step {best['step']})")

    use_bf16 = device.type == "cuda"
    nb = len(_epoch_batches(corpus, config.batch_size, config.seed, 0))
    module.train()
    bar = progress_bar(progress, config.steps, "distilling", "step", initial=step)
    t0, window = time.perf_counter() - elapsed, []
    epoch_seen, batches = -1, []
    try:
        while progress_of(step, elapsed) < 1.0:
            epoch, b = divmod(step, nb)
            if epoch != epoch_seen:
                epoch_seen, batches = epoch, _epoch_batches(corpus, config.batch_size, config.seed, epoch)
            rows = batches[b]
            ids, pos = response_batch([corpus[i] for i in rows], device)
            for g in opt.param_groups:
                g["lr"] = config.lr * _lr_factor(step, progress_of(step, elapsed), config)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                if feature:
                    loss = _unrolled_loss(target, draft, ids, pos, config)
                else:
                    with torch.no_grad():
                        z_t = response_logits(target.hf, ids, pos)
                    z_d = response_logits(draft.hf, ids, pos)
                    loss = kl_loss(z_t, z_d, config.temperatures)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
            step += 1
            elapsed = time.perf_counter() - t0
            window.append(float(loss.detach()))  # NOTE: one sync per step, for the progress bar
            if step % 25 == 0 or progress_of(step, elapsed) >= 1.0:
                history.append({"step": step, "seconds": round(elapsed, 1), "kl": sum(window) / len(window),
                                "lr": opt.param_groups[0]["lr"]})
                window = []
                if bar is None and (step % 100 == 0 or progress_of(step, elapsed) >= 1.0):
                    h = history[-1]
                    log(f"step {step}: KL {h['kl']:.4f}, lr {h['lr']:.2e}, {elapsed:.0f} s")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(kl=f"{float(loss.detach()):.3f}")
            if validate and (step % config.eval_every == 0 or progress_of(step, elapsed) >= 1.0):
                check_validation()
            if step % config.checkpoint_every == 0:
                save()
    finally:
        if bar is not None:
            bar.close()
        module.eval()
    save()
    if validate and best["state"] is not None and best["step"] != step:
        load_own_state(draft, best["state"])
        log(f"keeping the draft of step {best['step']} (lowest validation KL {best['kl']:.4f})")
    for p in params:
        p.requires_grad_(False)
    return {"steps": step, "seconds": round(elapsed, 1), "history": history,
            "best": {"step": best["step"], "validation_kl": best["kl"]} if validate else None}
