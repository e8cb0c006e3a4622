"""SMC-SD on the engine for any target program: constraints, powers, rewards, per-request settings.

``Engine.smc_sd`` runs this when the call uses anything beyond the plain, uniform case (which runs
the fused round of fused_smc.py). Rows are G requests × N_max particles (request g uses its first
N_g rows; the rest are padding rows that start dead, log w = -inf, and are never chosen). Every row
carries its own K ≤ K_max, temperatures, power α and token budget as device tensors, so one
captured round serves every mix of settings of that shape.

One round, per row with history h (DESIGN.md §2):
  1. K_max draft steps x_i = logits/T_d, masked by the constraints: q'(v) = q(v)·1[valid]/Z_q;
     d_i by the exponential race, log q'(d_i); automaton states advance by one table gather;
  2. one target pass over [last, d_1..d_K_max] -> log p_T(· | h, d_<i) (log_softmax of logits/T_t);
  3. bonus at position K_row from π_loc ∝ p_T^α·1[valid], normaliser log Σ_v p_T(v)^α 1[valid];
  4. log w += Σ_{i ≤ first EOS, i < min(K_row, budget)} [α·log p_T(d_i) − log q'(d_i)] + normaliser
     (when a bonus is taken); a sequence cut at its budget that a constraint does not accept: -inf;
  5. (host) rewards: β·(R(new) − R(old)) for prefix twists, β·R(x) at the end for complete ones;
     host-mask constraints' acceptance of cut sequences;
  6. per request: ESS, resample when ESS < τ·N_g (systematic, stratified, multinomial or residual
     over N_g rows), log Ẑ += logsumexp(log w) − log N_g, gather of every row field.

Steps 1–4 and 6 are device tensor code. Without rewards or host-mask constraints they are captured
as one CUDA graph; with rewards as two (1–4, and 6), the host scores texts in between. Constraints
whose masks come from the host (llguidance: JSONSchema, Grammar; any TokenConstraint without a
token automaton) run the round eagerly: one host mask per draft step and one for the bonus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from ...samplers.resampling import RESAMPLERS, counts_to_ancestors, inverse_cdf, normalise
from .attention import PagedBatch
from .output import EngineOutput
from .targets import CombinedAutomaton, DeviceAutomaton, EngineTarget, Settings

NEG_INF = float("-inf")


def segment_resample(W: Tensor, n: Tensor, scheme: str, live: Tensor) -> Tensor:
    """Ancestors A [G, M] for weights W [G, M] whose group g uses its first n[g] rows (the others
    have weight 0): the scheme over n[g] draws; rows j >= n[g] keep A = j. E[#children of i] = n_g·W_i."""
    G, M = W.shape
    dev = W.device
    j = torch.arange(M, device=dev)[None, :]
    nd = n.double()[:, None]
    Wd = W.double()
    if scheme == "systematic":
        u = (j + torch.rand(G, 1, dtype=torch.float64, device=dev)) / nd
        A = inverse_cdf(Wd, u.clamp(max=1.0 - 1e-12))
    elif scheme == "stratified":
        u = (j + torch.rand(G, M, dtype=torch.float64, device=dev)) / nd
        A = inverse_cdf(Wd, u.clamp(max=1.0 - 1e-12))
    elif scheme == "multinomial":
        A = inverse_cdf(Wd, torch.rand(G, M, dtype=torch.float64, device=dev))
    elif scheme == "residual":
        total = Wd.sum(-1, keepdim=True)
        Wn = torch.where(total > 0, Wd / total.clamp(min=1e-300), 0.0)
        counts = torch.floor(nd * Wn)
        R = nd - counts.sum(-1, keepdim=True)
        res = (nd * Wn - counts).clamp(min=0)
        res_total = res.sum(-1, keepdim=True)
        res_W = torch.where(res_total > 0, res / res_total.clamp(min=1e-300), Wn)
        extra = inverse_cdf(res_W, torch.rand(G, M, dtype=torch.float64, device=dev))
        counts = counts.long().scatter_add_(1, extra, (j < R).long())
        # a dead group (all weights 0) has no counts; its ancestors are unused (do = False)
        counts = torch.where(live[:, None], counts, (j < n[:, None]).long())
        A = counts_to_ancestors(counts)
    else:
        raise SMCDecodeError(f"unknown resampler {scheme!r}: choose one of {sorted(RESAMPLERS)}")
    return torch.where(j < n[:, None], A, j.expand(G, M))


class HostMasks:
    """Constraints whose masks come from the host (llguidance matchers, user TokenConstraints):
    their states live on the host and advance in lockstep (one K and budget for every row), so
    draft step i's mask is the constraints' ``allowed`` after the row's first i drafts."""

    def __init__(self, constraints: list, batch: int, device):
        self.constraints = constraints
        self.states = [c.start(batch) for c in constraints]
        self.device = device
        self.k = 0  # drafts that count this round: min(K, remaining budget)
        self.consumed = 0
        self.drafts: Tensor | None = None

    def begin(self, k: int, drafts: Tensor) -> None:
        self.k, self.consumed, self.drafts = k, 0, drafts

    def _advance(self, tokens: Tensor) -> None:
        self.states = [c.advance(s, tokens.cpu()) for c, s in zip(self.constraints, self.states)]

    def mask(self, i: int) -> Tensor | None:
        """Mask of draft step i (i = K_max: the bonus, after k drafts); None where nothing counts."""
        while self.consumed < min(i, self.k):
            self._advance(self.drafts[:, self.consumed])
            self.consumed += 1
        if i >= self.k and i < self.drafts.shape[1]:
            return None  # past the budget: these drafts are not used
        m = None
        for c, s in zip(self.constraints, self.states):
            mi = c.allowed(s)
            m = mi if m is None else m & mi
        return m.to(self.device)

    def end(self, bonus: Tensor, bonus_taken: bool) -> None:
        while self.consumed < self.k:  # (when no draft step needed the last masks)
            self._advance(self.drafts[:, self.consumed])
            self.consumed += 1
        if bonus_taken:
            self._advance(bonus)

    def accepting(self, batch: int) -> Tensor:
        ok = torch.ones(batch, dtype=torch.bool)
        for c, s in zip(self.constraints, self.states):
            ok = ok & c.accepting(s).cpu()
        return ok

    def fork(self, index: Tensor) -> None:
        self.states = [c.fork(s, index) for c, s in zip(self.constraints, self.states)]


@dataclass
class Round:
    """The static buffers and the device code of one round shape: ``propose`` (steps 1–4) and
    ``finish`` (resampling); after capture, their graph replays."""

    buffers: dict
    propose_code: object
    finish_code: object
    propose: object = None
    finish: object = None
    keep: list = field(default_factory=list)  # tensors the captured code reads (kept alive)


def run(engine, prompts: list[list[int]], settings: Settings, target: EngineTarget, *, eos_token_id: int | None,
        resampler: str, ess_threshold: float, use_graphs: bool, seed: int, record_weights: bool = False):
    """SMC-SD of ``prompts`` on ``engine`` with per-request ``settings`` and ``target``; returns an
    :class:`~smcdecode.backends.engine.output.EngineOutput` whose tensors are [G, N_max, ...]
    (rows j >= N_g of request g are padding: log w = -inf, length 0)."""
    from ...samplers.common import RewardTracker

    if resampler not in RESAMPLERS:
        raise SMCDecodeError(f"unknown resampler {resampler!r}: choose one of {sorted(RESAMPLERS)}")
    dev = engine.device
    G = len(prompts)
    targets = list(target) if isinstance(target, (list, tuple)) else [target] * G
    if len(targets) != G:
        raise SMCDecodeError(f"target lists {len(targets)} programs for {G} prompts: give one or one per prompt")
    for t in targets:
        if not isinstance(t, EngineTarget):
            raise SMCDecodeError(f"target must be an EngineTarget (EngineTarget.of(LM(model) * ...)), got "
                                 f"{type(t).__name__}")
        t.check()
    Nmax, Kmax = max(settings.particles), max(settings.block_size)
    B = G * Nmax
    V = engine.target.cfg.vocab_size
    eos = -1 if eos_token_id is None else eos_token_id
    pad = max(eos, 0)
    longest_new = max(settings.max_new_tokens)
    per_request, hosts = [], []  # each request's device automata and host-mask constraints
    for t in targets:
        own, host = [], []
        for c in t.constraints:
            if c.model.vocab_size != V:
                raise SMCDecodeError(f"constraint {c!r} is over a vocabulary of {c.model.vocab_size} tokens, the "
                                     f"engine's model has {V}: bind it to the model the engine runs")
            a = None if t.host_masks else DeviceAutomaton.of(c, dev)
            (own.append(a) if a is not None else host.append(c))
        per_request.append(own)
        hosts.append(host)
    host_constraints = hosts[0]
    if any(len(h) != len(host_constraints) or any(x is not y for x, y in zip(h, host_constraints)) for h in hosts):
        raise SMCDecodeError(
            "constraints whose masks come from the host (llguidance) must be the same objects for every prompt of "
            "a call: split the call by target")
    if (host_constraints or any(per_request)) and eos_token_id is None:
        raise SMCDecodeError("constraints allow EOS only in accepting states: pass eos_token_id")
    if host_constraints and (len(set(settings.block_size)) > 1 or len(set(settings.max_new_tokens)) > 1):
        raise SMCDecodeError(
            f"constraints whose masks come from the host ({host_constraints[0]!r}) need one block_size and one "
            "max_new_tokens for all prompts in a call: split the call by those settings")
    eager = bool(host_constraints)
    graphs = use_graphs and not eager
    # every request's automata in one device table; request g's c-th constraint is state slot c
    slots = max(len(a) for a in per_request)
    combined = CombinedAutomaton.of([a for own in per_request for a in own], dev) if slots else None
    automata = [combined] * slots
    initial = [[combined.initial_of(own[c]) if c < len(own) else 0 for own in per_request] for c in range(slots)]
    with_rewards = [t for t in {id(t): t for t in targets}.values() if t.rewards]

    table, pt_start = engine.start(prompts, Nmax, longest_new + Kmax + 2)
    cap = table.table.shape[1] * engine.page_size
    rows = np.arange(B)
    lens = np.repeat([len(p) - 1 for p in prompts], Nmax)
    copies = table.reserve(rows, lens + Kmax + 1, write_from=lens - 1)
    key = ("smc-general", G, Nmax, Kmax, eos, resampler, ess_threshold, table.table.shape[1], graphs,
           slots, id(combined.table) if combined else None, bool(with_rewards))
    rnd = engine.graphs.get(key) if graphs else None
    hosted = HostMasks(host_constraints, B, dev) if eager else None
    if rnd is None:
        rnd = build_round(engine, G, Nmax, Kmax, cap, pt_start, automata, eos, pad, resampler, ess_threshold,
                     hosted.mask if hosted else None)
    b = rnd.buffers
    N_of = torch.tensor(settings.particles, device=dev)
    valid = (torch.arange(Nmax, device=dev)[None] < N_of[:, None]).flatten()

    def per_row(values, dtype):
        return torch.tensor(values, dtype=dtype, device=dev).repeat_interleave(Nmax)

    def reset() -> None:
        b["seq"].copy_(torch.as_tensor(lens, device=dev))
        b["pending"].copy_(torch.tensor([p[-2:] for p in prompts], device=dev).repeat_interleave(Nmax, 0))
        b["last"].copy_(b["pending"][:, 1])
        b["tokens"].fill_(pad)
        b["n_gen"].zero_()
        b["budget"].copy_(per_row(settings.max_new_tokens, torch.long))
        b["K_row"].copy_(per_row(settings.block_size, torch.long))
        b["T_draft"].copy_(per_row(settings.draft_temperature, torch.float32))
        b["T_target"].copy_(per_row(settings.target_temperature, torch.float32))
        b["alpha"].copy_(per_row([t.alpha for t in targets], torch.float32))
        b["n"].copy_(N_of)
        b["valid"].copy_(valid)
        b["finished"].copy_(~valid)
        b["log_w"].copy_(torch.where(valid, 0.0, NEG_INF).double())
        b["log_Z"].zero_()
        b["host_incr"].zero_()
        b["drafted"].zero_()
        for s, init in zip(b["states"], initial):
            s.copy_(per_row(init, torch.long))

    engine.upload(table, b["pt"], copies)
    reset()
    if rnd.propose is None:
        capture_round(engine, rnd, graphs, split=bool(with_rewards))
        if graphs:
            engine.graphs.put(key, rnd)
            reset()  # the warm-up run advanced the state
    # NOTE: the warm-up also wrote KV entries; every entry a round reads at or after position T−1
    # is written earlier in that same round, so the first replay overwrites them.

    # rewards: one tracker per distinct target, over that target's rows
    owner = np.repeat(np.array([id(t) for t in targets], dtype=object), Nmax)
    rewards = [(RewardTracker(t.rewards, t.decoder, B), torch.from_numpy(owner == id(t))) for t in with_rewards]
    torch.manual_seed(seed)
    out = EngineOutput(b["tokens"], b["n_gen"], b["log_w"], b["log_Z"])
    pinned = dev.type == "cuda"
    host = torch.empty(3 * B + 2 * G + 1, dtype=torch.float64, pin_memory=pinned)
    position = 0  # the lockstep position (host-mask path: one K and budget for every row)
    while True:
        if hosted is not None:
            k = min(Kmax, longest_new - position)
            hosted.begin(k, b["drafts"])
            rnd.propose()
            hosted.end(b["bonus"].cpu(), longest_new - position > Kmax)
            position += Kmax + 1
        else:
            rnd.propose()
        if rewards or hosted is not None:
            t0 = time.perf_counter()
            host_terms(b, rewards, hosted, longest_new)
            out.host_s += time.perf_counter() - t0
        rnd.finish()
        if record_weights:
            out.weights.append(b["W"].clone())
        host.copy_(b["packed"], non_blocking=True)
        if pinned:
            torch.cuda.current_stream().synchronize()  # the round's one host sync
        t0 = time.perf_counter()
        h = host.numpy()
        out.rounds += 1
        out.resampled.append(h[3 * B : 3 * B + G] > 0)
        out.ess.append(h[3 * B + G : 3 * B + 2 * G].copy())
        index = h[:B].astype(np.int64)
        if not np.array_equal(index, rows):
            idx_t = torch.from_numpy(index)
            if hosted is not None:
                hosted.fork(idx_t)
            for tracker, _ in rewards:
                tracker.fork(idx_t)
        if h[-1] > 0:
            break
        lens = h[B : 2 * B].astype(np.int64)
        table.fork(index)
        table.advance(rows, lens)
        engine.upload(table, b["pt"], table.reserve(rows, lens + Kmax + 1, write_from=lens - 1))
        out.host_s += time.perf_counter() - t0
    out.peak_pages = table.peak_used
    out.tokens = b["tokens"][:, :longest_new].reshape(G, Nmax, -1).clone()
    out.lengths = b["n_gen"].view(G, Nmax).clone()
    out.finished = b["finished"].view(G, Nmax).clone()
    out.drafted = b["drafted"].view(G, Nmax).clone()
    out.log_weights = b["log_w"].view(G, Nmax).clone()
    out.log_evidence = b["log_Z"] + torch.logsumexp(out.log_weights, 1) - torch.log(N_of.double())
    out.particles = list(settings.particles)
    return out


def host_terms(b: dict, rewards: list, hosted: HostMasks | None, longest_new: int) -> None:
    """Reward increments (``rewards``: (RewardTracker, its rows as a bool mask or None for all)) and
    the host constraints' verdict on cut sequences -> b["host_incr"]."""
    active, ended, hit_eos = b["active"].cpu(), b["ended"].cpu(), b["hit_eos"].cpu()
    B = active.shape[0]
    incr = torch.zeros(B, dtype=torch.float64)
    if hosted is not None:
        cut = ended & ~hit_eos
        if bool(cut.any()):
            incr = torch.where(cut & ~hosted.accepting(B), NEG_INF, incr)
    if rewards and bool(active.any()):
        tokens, lengths = b["tokens"][:, :longest_new].cpu(), b["n_gen"].cpu()
        for tracker, mine in rewards:
            rows = active if mine is None else active & mine
            if bool(rows.any()):
                incr = incr + tracker.increment(tokens, lengths, rows, ended)
    b["host_incr"].copy_(incr)


def build_round(engine, G, Nmax, Kmax, cap, pt_start, automata, eos, pad, resampler, tau, host_mask) -> Round:
    dev = engine.device
    B = G * Nmax

    def z(*shape, dtype=torch.long):
        return torch.zeros(*shape, dtype=dtype, device=dev)

    b = dict(
        pt=pt_start.clone(), seq=z(B), pending=z(B, 2), last=z(B),
        tokens=torch.full((B, cap + Kmax + 1), pad, dtype=torch.long, device=dev), n_gen=z(B), budget=z(B),
        K_row=z(B), T_draft=z(B, dtype=torch.float32), T_target=z(B, dtype=torch.float32),
        alpha=z(B, dtype=torch.float32), n=z(G), valid=z(B, dtype=torch.bool),
        finished=z(B, dtype=torch.bool), log_w=z(B, dtype=torch.float64), log_Z=z(G, dtype=torch.float64),
        drafts=z(B, Kmax), log_q=z(B, Kmax, dtype=torch.float32), bonus=z(B), drafted=z(B),
        states=[z(B) for _ in automata], index=torch.arange(B, device=dev), do=z(G, dtype=torch.bool),
        ess=z(G, dtype=torch.float64), W=z(G, Nmax, dtype=torch.float64), done=z(1, dtype=torch.bool),
        ar=torch.arange(Kmax + 1, device=dev), group_base=(torch.arange(G, device=dev) * Nmax)[:, None],
        # read by the host between the two halves of a round
        active=z(B, dtype=torch.bool), ended=z(B, dtype=torch.bool), hit_eos=z(B, dtype=torch.bool),
        host_incr=z(B, dtype=torch.float64),
        # what the host reads after the round's sync, packed in the round's graph: index, seq, n_gen, do, ess, done
        packed=z(3 * B + 2 * G + 1, dtype=torch.float64),
    )
    rnd = Round(b, None, None, keep=[t for a in automata for t in (a.table, a.classes, a.accepting)])
    rnd.propose_code, rnd.finish_code = round_code(engine, b, automata, eos, pad, resampler, tau, host_mask)
    return rnd


def _race(x: Tensor) -> Tensor:
    """argmax_v (x_v − log E_v), E ~ Exp(1): one draw ∝ exp(x) per row; -inf entries never win."""
    e = torch.empty_like(x).exponential_().clamp_min(1e-30)
    return torch.argmax(torch.where(torch.isneginf(x), NEG_INF, x - e.log()), dim=-1)


def round_code(engine, b: dict, automata, eos: int, pad: int, resampler: str, tau: float, host_mask=None):
    """(propose, finish) over the static buffers ``b``; ``host_mask(i)`` gives the host masks of
    draft step i (i = K_max: the bonus) in the eager host-mask path."""
    G, Nmax = b["W"].shape
    B, Kmax = b["drafts"].shape
    ar, PS = b["ar"], engine.page_size
    draft = engine.draft
    tokens, n_gen, finished, log_w = b["tokens"], b["n_gen"], b["finished"], b["log_w"]
    drafts, log_q, K_row, alpha, T = b["drafts"], b["log_q"], b["K_row"], b["alpha"], b["seq"]

    def masks(states: list[Tensor], i: int) -> Tensor | None:
        m = None
        for a, s in zip(automata, states):
            mi = a.allowed(s)
            m = mi if m is None else m & mi
        if host_mask is not None:
            hm = host_mask(i)
            if hm is not None:
                m = hm if m is None else m & hm
        return m

    def propose() -> None:
        remaining = b["budget"] - n_gen
        k_eff = torch.minimum(K_row, remaining)
        states = list(b["states"])
        kept = list(b["states"])  # states after the row's first min(i, k_eff) drafts
        # 1. K_max draft tokens from q' (the first forward covers the two tokens the draft has not seen)
        batch = PagedBatch.build((T - 1)[:, None] + ar[:2], b["pt"], PS)
        logits = draft(b["pending"], engine.kv_d, batch, last_only=True)[:, 0]  # [B, V]
        for i in range(Kmax):
            x = logits.float() / b["T_draft"][:, None]
            m = masks(states, i)
            if m is not None:
                x = x.masked_fill(~m, NEG_INF)
            lse = torch.logsumexp(x, -1)
            d = _race(x)
            drafts[:, i] = d
            log_q[:, i] = torch.where(torch.isfinite(lse), x.gather(1, d[:, None])[:, 0] - lse, NEG_INF)
            states = [a.advance(s, d) for a, s in zip(automata, states)]
            kept = [torch.where(i < k_eff, s, k) for s, k in zip(states, kept)]
            if i < Kmax - 1:
                batch = PagedBatch.build((T + 1 + i)[:, None], b["pt"], PS)
                logits = draft(d[:, None], engine.kv_d, batch)[:, 0]
        # 2. one target pass over [last, d_1..d_Kmax]
        feed = torch.cat([b["last"][:, None], drafts], dim=1)
        batch = PagedBatch.build(T[:, None] + ar, b["pt"], PS)
        logits_t = engine.target(feed, engine.kv_t, batch)  # [B, Kmax+1, V]
        logp = torch.log_softmax(logits_t.float() / b["T_target"][:, None, None], -1)
        log_p = logp[:, :Kmax].gather(2, drafts[:, :, None])[:, :, 0]
        # 3. the bonus after the row's K drafts, from π_loc ∝ p^α·1[valid], and its normaliser
        lb = alpha[:, None] * logp.gather(1, K_row[:, None, None].expand(B, 1, logp.shape[-1]))[:, 0]
        m = masks(kept, Kmax)
        if m is not None:
            lb = lb.masked_fill(~m, NEG_INF)
        log_norm = torch.logsumexp(lb, -1)
        bonus = _race(lb)
        b["bonus"].copy_(bonus)
        # 4. incremental weights up to the first EOS and the budget
        in_budget = ar[None, :Kmax] < k_eff[:, None]
        is_eos = (drafts == eos) & in_budget
        keep = ((torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0) & in_budget
        term = torch.where(torch.isneginf(log_q), NEG_INF, alpha[:, None] * log_p - log_q)  # (a dead end: -inf)
        incr = torch.where(keep, term, 0.0).double().sum(1)
        any_eos = is_eos.any(1)
        n_new = torch.where(any_eos, is_eos.long().argmax(1) + 1, k_eff)
        has_bonus = ~any_eos & (remaining > K_row)
        incr = incr + torch.where(has_bonus, log_norm.double(), 0.0)
        n_new = torch.where(has_bonus, K_row + 1, n_new)
        active = ~finished
        b["drafted"].add_(torch.where(active, k_eff, 0))
        block = torch.cat([drafts, torch.full_like(bonus, pad)[:, None]], dim=1)
        block = block.scatter(1, K_row[:, None], bonus[:, None])
        block = torch.where((ar[None] < n_new[:, None]) & active[:, None], block, pad)
        tokens.scatter_(1, n_gen[:, None] + ar, block)
        n_gen.add_(torch.where(active, n_new, 0))
        hit_eos = any_eos | (has_bonus & (bonus == eos))
        ended = active & (hit_eos | (n_gen >= b["budget"]))
        final = [torch.where(has_bonus, a.advance(k, bonus), k) for a, k in zip(automata, kept)]
        accepted = torch.ones_like(ended)
        for a, s in zip(automata, final):
            accepted = accepted & a.accepting[s]
        incr = torch.where(ended & ~hit_eos & ~accepted, NEG_INF, incr)  # cut, and not in the language
        lw = torch.where(active, log_w + incr, log_w)
        log_w.copy_(lw)
        finished.copy_(finished | ended | torch.isneginf(lw))
        for s, f in zip(b["states"], final):
            s.copy_(torch.where(active, f, s))
        d_last = drafts.gather(1, (K_row - 1)[:, None])[:, 0]
        b["pending"].copy_(torch.where(active[:, None], torch.stack([d_last, bonus], 1), b["pending"]))
        b["last"].copy_(torch.where(active, bonus, b["last"]))
        T.add_(torch.where(active, K_row + 1, 0))
        b["active"].copy_(active)
        b["ended"].copy_(ended)
        b["hit_eos"].copy_(hit_eos)

    def finish() -> None:
        lw = log_w + b["host_incr"]
        finished.copy_(finished | torch.isneginf(lw))
        b["host_incr"].zero_()
        lw = lw.view(G, Nmax)
        W, ess = normalise(lw)
        n = b["n"]
        live = (~finished).view(G, Nmax).any(1)
        do = live & (ess > 0) & ((ess < tau * n) | (tau >= 1.0))
        A = segment_resample(W, n, resampler, live)
        A = torch.where(do[:, None], A, torch.arange(Nmax, device=lw.device)[None])
        idx = (A + b["group_base"]).flatten()
        b["log_Z"].add_(torch.where(do, torch.logsumexp(lw, 1) - torch.log(n.double()), 0.0))
        log_w.copy_(torch.where(do[:, None] & b["valid"].view(G, Nmax), 0.0, lw).flatten())
        b["W"].copy_(W)
        for t in (b["pending"], b["last"], tokens, n_gen, finished, log_w, T, *b["states"]):
            t.copy_(t[idx])
        b["index"].copy_(idx)
        b["do"].copy_(do)
        b["ess"].copy_(ess)
        b["done"].copy_(finished.all()[None])
        b["packed"].copy_(torch.cat([idx.double(), T.double(), n_gen.double(), do.double(), ess,
                                     b["done"].double()]))

    return propose, finish


def capture_round(engine, rnd: Round, graphs: bool, split: bool) -> None:
    """Eager closures, or their CUDA graphs: one for the whole round, two when the host scores
    rewards between the proposal and the resampling."""
    propose, finish = rnd.propose_code, rnd.finish_code
    if not graphs:
        rnd.propose, rnd.finish = propose, finish
    elif split:
        rnd.propose = engine.graphs.capture(propose, True)
        rnd.finish = engine.graphs.capture(finish, True)
    else:
        def whole() -> None:
            propose()
            finish()

        rnd.propose = engine.graphs.capture(whole, True)
        rnd.finish = lambda: None
    rnd.keep.append(rnd.buffers)
