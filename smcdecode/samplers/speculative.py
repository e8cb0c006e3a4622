"""Exact speculative decoding (rejection sampling): the output is distributed exactly as p_T.

Per round: draft d_1..d_k ~ q; accept d_i with probability min(1, p(d_i)/q(d_i)); at the first
rejection draw from the residual (p − q)+ and stop the round; if every draft is accepted draw a
bonus token from p. Each sequence runs on its own (batch 1) because acceptance lengths differ;
the caches are cropped back after a rejection.
"""

from __future__ import annotations

import torch

from .smc_sd import SMCOutput
from .steps import race


def speculative(
    target, draft, prompt_ids: list[int], *, batch: int, block_size: int, max_new_tokens: int,
    generator=None, progress=None,
) -> SMCOutput:
    lm = target.lm
    model = lm.model
    eos = model.eos_token_id
    stats = {"drafted": 0, "accepted": 0, "rounds": 0}
    seqs = []
    for _ in range(batch):
        seqs.append(_one_sequence(lm, draft, prompt_ids, block_size, max_new_tokens, generator, stats, progress))
        if progress is not None:  # the bar counts max_new_tokens a sequence, however early it ended
            progress.update(max_new_tokens - len(seqs[-1]))
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    tokens = torch.full((batch, int(lengths.max())), eos, dtype=torch.long)  # EOS-padded to the longest
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    out = SMCOutput(
        tokens[None], lengths[None], torch.ones(1, batch, dtype=torch.bool),
        torch.zeros(1, batch, dtype=torch.float64), torch.full((1,), float("nan")),
    )
    out.draft_tokens = stats["drafted"]
    out.accepted_tokens = stats["accepted"]
    out.rounds = stats["rounds"]
    return out


class _Tracked:
    """A batch-1 runner that remembers what it has fed, so it can be rolled back to a context."""

    def __init__(self, model, prompt_ids):
        self.runner = model.start(prompt_ids[:-1], 1)
        self.base = len(prompt_ids) - 1
        self.fed: list[int] = []

    def logits_after(self, context: list[int], extra: list[int] = ()) -> torch.Tensor:
        """Feed so the runner has consumed ``context`` (+ ``extra``); logits [len(extra)+1, V]
        after context[-1] and after each extra token."""
        c = 0
        while c < min(len(self.fed), len(context) - 1) and self.fed[c] == context[c]:
            c += 1
        self.runner.crop(self.base + c)
        feed = context[c:] + list(extra)
        self.fed = context[:c] + feed
        logits = self.runner.extend(torch.tensor([feed], dtype=torch.long))[0].cpu()
        return logits[len(context) - c - 1 :]


def _one_sequence(lm, draft, prompt_ids, K, max_new_tokens, generator, stats, progress) -> list[int]:
    eos = lm.model.eos_token_id
    target_run = _Tracked(lm.model, prompt_ids)
    draft_run = _Tracked(draft.model, prompt_ids)
    context = [prompt_ids[-1]]  # the last prompt token, then the generated ones
    while len(context) - 1 < max_new_tokens:
        k = min(K, max_new_tokens - (len(context) - 1))
        logits = draft_run.logits_after(context)[-1:]
        drafts, qs = [], []
        for i in range(k):
            q = torch.softmax(logits[-1].double() / draft.temperature, -1)
            d = int(race(torch.log(q)[None], generator)[0])
            drafts.append(d)
            qs.append(q)
            if d == eos:
                break
            if i < k - 1:
                logits = draft_run.logits_after(context + drafts)[-1:]
        stats["drafted"] += len(drafts)
        stats["rounds"] += 1
        log_p = lm.log_probs(target_run.logits_after(context, drafts)).double()  # [len(drafts)+1, V]
        p = torch.exp(log_p)
        new: list[int] = []
        for i, d in enumerate(drafts):
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(qs[i][d]) < float(p[i, d]):  # accept with probability min(1, p/q)
                new.append(d)
                stats["accepted"] += 1
                continue
            residual = (p[i] - qs[i]).clamp(min=0)
            dist = residual if float(residual.sum()) > 0 else p[i]
            new.append(int(race(torch.log(dist)[None], generator)[0]))
            break
        else:
            if len(context) - 1 + len(new) < max_new_tokens and (not new or new[-1] != eos):
                new.append(int(race(log_p[len(drafts)][None], generator)[0]))
        if eos in new:
            new = new[: new.index(eos) + 1]
        context.extend(new)
        if progress is not None:
            progress.update(len(new))
        if new and new[-1] == eos:
            break
    return context[1:]
