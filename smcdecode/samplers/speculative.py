"""Exact speculative decoding (rejection sampling): the output is distributed exactly as p_T.

Per round: draft d_1..d_k ~ q; accept d_i with probability min(1, p(d_i)/q(d_i)); at the first
rejection draw from the residual (p − q)+ and stop the round; if every draft is accepted draw a
bonus token from p. It is a program on the request loop (``samplers.loop``: ``loop.speculative``
submits one request with ``exact=True``): a :class:`SpeculativeRun` holds the request's independent sequences, each on its
own batch-1 runners (acceptance lengths differ, so the rows do not advance in lockstep; the
caches are cropped back after a rejection), and its round gives every unfinished sequence one
draft-and-verify round.
"""

from __future__ import annotations

import torch

from .smc_sd import SMCOutput
from .steps import race


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


class _Sequence:
    """One sequence: its runners and its context (the last prompt token, then the generated ones)."""

    def __init__(self, lm, draft, prompt_ids: list[int]):
        self.target_run = _Tracked(lm.model, prompt_ids)
        self.draft_run = _Tracked(draft.model, prompt_ids)
        self.context = [prompt_ids[-1]]
        self.done = False


class SpeculativeRun:
    """One exact speculative decoding request (``loop.Request`` with ``exact=True``): groups × particles
    independent sequences of the target, drafted ``block_size`` tokens a round."""

    def __init__(self, request):
        self.request = request
        self.lm, self.draft, self.K = request.target.lm, request.draft, request.block_size
        self.max_new_tokens, self.generator, self.progress = request.max_new_tokens, request.generator, request.progress
        self.groups = request.groups
        self.stats = {"drafted": 0, "accepted": 0, "rounds": 0}
        self.seqs = [_Sequence(self.lm, self.draft, request.prompt) for _ in range(request.groups * request.particles)]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.seqs)

    def round(self) -> None:
        """One draft-and-verify round of every unfinished sequence."""
        for s in self.seqs:
            if not s.done:
                self._round(s)

    def _round(self, s: _Sequence) -> None:
        lm, draft, generator, context = self.lm, self.draft, self.generator, s.context
        eos = lm.model.eos_token_id
        k = min(self.K, self.max_new_tokens - (len(context) - 1))
        logits = s.draft_run.logits_after(context)[-1:]
        drafts, qs = [], []
        for i in range(k):
            q = torch.softmax(logits[-1].double() / draft.temperature, -1)
            d = int(race(torch.log(q)[None], generator)[0])
            drafts.append(d)
            qs.append(q)
            if d == eos:
                break
            if i < k - 1:
                logits = s.draft_run.logits_after(context + drafts)[-1:]
        self.stats["drafted"] += len(drafts)
        self.stats["rounds"] += 1
        log_p = lm.log_probs(s.target_run.logits_after(context, drafts)).double()  # [len(drafts)+1, V]
        p = torch.exp(log_p)
        new: list[int] = []
        for i, d in enumerate(drafts):
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(qs[i][d]) < float(p[i, d]):  # accept with probability min(1, p/q)
                new.append(d)
                self.stats["accepted"] += 1
                continue
            residual = (p[i] - qs[i]).clamp(min=0)
            dist = residual if float(residual.sum()) > 0 else p[i]
            new.append(int(race(torch.log(dist)[None], generator)[0]))
            break
        else:
            if len(context) - 1 + len(new) < self.max_new_tokens and (not new or new[-1] != eos):
                new.append(int(race(log_p[len(drafts)][None], generator)[0]))
        if eos in new:
            new = new[: new.index(eos) + 1]
        context.extend(new)
        if self.progress is not None:
            self.progress.update(len(new))
        if (new and new[-1] == eos) or len(context) - 1 >= self.max_new_tokens:
            s.done = True
            if self.progress is not None:  # the bar counts max_new_tokens a sequence, however early it ended
                self.progress.update(self.max_new_tokens - (len(context) - 1))

    def output(self) -> SMCOutput:
        """The sequences as [G, N] particles of weight 1 (no evidence: nan), with the draft statistics."""
        seqs = [s.context[1:] for s in self.seqs]
        eos = self.lm.model.eos_token_id
        B, G = len(seqs), self.groups
        lengths = torch.tensor([len(x) for x in seqs], dtype=torch.long)
        tokens = torch.full((B, int(lengths.max())), eos, dtype=torch.long)  # EOS-padded to the longest
        for row, seq in enumerate(seqs):
            tokens[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        out = SMCOutput(tokens.view(G, B // G, -1), lengths.view(G, -1), torch.ones(G, B // G, dtype=torch.bool),
                        torch.zeros(G, B // G, dtype=torch.float64), torch.full((G,), float("nan")))
        out.draft_tokens = self.stats["drafted"]
        out.accepted_tokens = self.stats["accepted"]
        out.rounds = self.stats["rounds"]
        return out
