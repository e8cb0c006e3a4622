"""The round of a request loop whose rows are all exact samples of the target (a ``Scheduler`` with
``exact_only=True``): exact speculative decoding (K_max >= 1) and autoregressive sampling (K_max = 0,
no draft). Its rows are independent: no weights, no statistics, no resampling, no page forks (each
row's pages for its whole output are reserved when its request joins), so a round is only

  K_max >= 1  K_max draft steps d_i ~ q (logits / T_d), one target pass over [last, d_1..d_K_max],
              the leading drafts accepted with probability min(1, p/q) (up to the row's K), at the
              first rejection a draw from (p − q)+, after K acceptances the bonus from p;
  K_max = 0   one target forward on ``last`` and a draw from p (logits / T_t);

then the tokens, EOS and budget bookkeeping, the rows' positions, and the flags the host reads.
Temperatures, K and budgets are per row (buffers), as in the SMC-SD round of smc.py.
"""

from __future__ import annotations

import contextlib

import torch

from ...samplers import steps
from .attention import PagedBatch
from .sampling import sample_and_score


def launches():
    """The context exact-only rounds are captured and launched in: without PDL
    (``kernels.common.pdl_off``), which measured slower for autoregressive decoding and for exact
    speculative decoding's one-request round."""
    try:
        from .kernels.common import pdl_off
    except ImportError:  # no Triton: no PDL either
        return contextlib.nullcontext()
    return pdl_off()


def round_code(engine, b: dict, eos: int, pad: int, drafts: bool):
    """(propose, finish) of the exact-only round over the static buffers ``b`` (smc.build_round's,
    or a bucket's views of them); ``drafts`` False: K_max = 0 (autoregressive sampling)."""
    G = b["n"].shape[0]
    B, Kmax = b["drafts"].shape
    dev, PS, fused = b["ar"].device, engine.page_size, engine.config.triton
    rows = torch.arange(B, device=dev)
    tokens, n_gen, finished, T, last = b["tokens"], b["n_gen"], b["finished"], b["seq"], b["last"]

    def advance(block, n_new, active) -> None:
        """Write each row's first ``n_new`` tokens of ``block`` [B, k+1] (cut at the first EOS here)."""
        ar = b["ar"]
        if eos >= 0:
            is_eos = (block == eos) & (ar[None] < n_new[:, None])
            hit = is_eos.any(1)
            n_new = torch.where(hit, is_eos.long().argmax(1) + 1, n_new)
        n_new = torch.where(active, n_new, 0)
        tokens.scatter_(1, n_gen[:, None] + ar, torch.where(ar[None] < n_new[:, None], block, pad))
        n_gen.add_(n_new)
        ended = n_gen >= b["budget"]
        finished.logical_or_(active & (ended | hit) if eos >= 0 else ended)
        return n_new

    def propose_ar() -> None:
        seed = torch.randint(0, 2**62, (1,), device=dev)
        logits = engine.target(last[:, None], engine.kv_t, PagedBatch.build(T[:, None], b["pt"], PS))[:, 0]
        t = sample_and_score(logits, b["T_target"], seed[0], triton=fused).token
        active = ~finished
        advance(t[:, None], active.long(), active)
        last.copy_(t)  # (a finished row's last token is never read again: its position stays)
        T.add_(active.long())

    pair = torch.arange(2, device=dev)  # (the draft's first forward: positions T−1, T)

    def propose_sd() -> None:
        # NOTE: the same random draws, in the same order, as the general round's exact rows (smc.py)
        seeds = torch.randint(0, 2**62, (Kmax + 2,), device=dev)
        pt, K_row, drafts_, log_q, draft_logits = b["pt"], b["K_row"], b["drafts"], b["log_q"], b["draft_logits"]
        batch = PagedBatch.build((T - 1)[:, None] + pair, pt, PS)
        logits = engine.draft(b["pending"], engine.kv_d, batch, last_only=True)[:, 0]  # [B, V]
        for i in range(Kmax):
            d, log_q[:, i], _, _ = sample_and_score(logits, b["T_draft"], seeds[i], triton=fused)
            drafts_[:, i] = d
            draft_logits[:, i] = logits
            if i < Kmax - 1:
                batch = PagedBatch.build((T + 1 + i)[:, None], pt, PS)
                logits = engine.draft(d[:, None], engine.kv_d, batch)[:, 0]
        ar = b["ar"]
        feed = torch.cat([last[:, None], drafts_], dim=1)
        logits_t = engine.target(feed, engine.kv_t, PagedBatch.build(T[:, None] + ar, pt, PS))  # [B, Kmax+1, V]
        V = logits_t.shape[-1]
        gather = torch.cat([drafts_, drafts_[:, :1]], dim=1).reshape(-1)
        log_p = sample_and_score(logits_t.view(B * (Kmax + 1), V),
                                 b["T_target"][:, None].expand(B, Kmax + 1).reshape(-1), seeds[Kmax], gather,
                                 draw=False, triton=fused).gathered.view(B, Kmax + 1)[:, :Kmax]
        bonus = sample_and_score(logits_t[rows, K_row], b["T_target"], seeds[Kmax + 1], triton=fused).token
        n_acc = steps.accept_prefix(log_p, log_q, K_row, torch.rand(B, Kmax, device=dev, dtype=torch.float64))
        j = n_acc.clamp(max=Kmax - 1)
        res = steps.residual(logits_t[rows, j], draft_logits[rows, j], b["T_target"], b["T_draft"])
        c = torch.where(n_acc >= K_row, bonus, steps.race(res))
        block = torch.cat([drafts_, c[:, None]], dim=1).scatter(1, n_acc[:, None], c[:, None])
        active = ~finished
        remaining = b["budget"] - n_gen
        n_new = advance(block, torch.minimum(n_acc + 1, remaining), active)
        b["drafted"].add_(torch.where(active, torch.minimum(K_row, remaining), 0))
        b["accepted"].add_(torch.minimum(n_acc, n_new))  # (n_new is 0 on the rows that had finished)
        # the draft's next feed [token at T'−1, next]: the last accepted draft, or (none) the last token
        # (a finished row's feed and position are never read again: they stay where it finished)
        d_last = torch.where(n_acc > 0, drafts_.gather(1, (n_acc - 1).clamp(min=0)[:, None])[:, 0], last)
        b["pending"].copy_(torch.stack([d_last, c], 1))
        last.copy_(c)
        T.add_(torch.where(active, n_acc + 1, 0))

    def finish() -> None:
        """What the host reads after the round (``Scheduler._read``): every row its own ancestor,
        positions, finished flags, no resampling, ESS = N, all finished."""
        packed = b["packed"]
        packed[:B].copy_(rows)
        packed[B : 2 * B].copy_(T)
        packed[2 * B : 3 * B].copy_(finished)
        packed[3 * B : 3 * B + G].zero_()
        packed[3 * B + G : 3 * B + 2 * G].copy_(b["n"])
        b["done"].copy_(finished.all()[None])
        packed[3 * B + 2 * G :].copy_(b["done"])

    return (propose_sd if drafts else propose_ar), finish
