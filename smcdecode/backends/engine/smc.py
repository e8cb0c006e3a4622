"""The engine's SMC-SD round for any target program: constraints, powers, rewards, per-request settings.

Rows are G request slots × N_max particles (request g uses its first N_g rows; the rest are padding
rows that start dead, log w = -inf, and are never chosen). Every row carries its own K ≤ K_max,
temperatures, power α and token budget as device tensors, so one captured round serves every mix of
settings of that shape. The request loop that drives it is scheduler.py.

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

Rows of exact speculative decoding (``exact``, a scheduler built with ``speculative=True``) share the
round: their drafts and target pass are the same, then they keep the leading drafts accepted with
probability min(1, p/q) and draw one token from (p − q)+ at the first rejection (or the bonus when
every draft was accepted), with weight 0, and move on by what they kept + 1 (until they finish).
The rows of one such request are independent samples: never resampled.

Each row's K_row ∈ {0..k} is a buffer, so a schedule (``samplers/adaptive.py``) can change it between
rounds without a new capture: the round drafts k tokens for every row anyway, so the draft
statistics a schedule reads (min(1, p/q) and the draft terms' spread, over every drafted position
within the budget and before an EOS) are fresh each round. K_row = 0 takes only the bonus from
p_T(· | h) (the target as proposal); the draft's cache stays consistent because its next round
re-feeds [last, bonus] at positions T−1, T.

Steps 1–4 and 6 are device tensor code. Without rewards or host-mask constraints they are captured
as one CUDA graph; with rewards as two (1–4, and 6), the host scores texts in between. Constraints
whose masks come from the host (host_masks.py) have host points in steps 1–3: before each draft step
and the bonus, where the host's packed masks of that step reach ``host_bits``. The proposal is still
one graph, launched whole: at each host point the device waits for the host's count of points
(kernels/host.py) and uploads the masks the host wrote, and each draft step copies its drafted
tokens to the host (``HostMasks.hand_over``), so the host computes the next step's masks while the
draft's next forward runs, and the device starts the step as soon as they are written.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...potentials.constraint import unpack_bits
from ...samplers import steps
from ...samplers.adaptive import row_statistics
from . import exact as exact_round
from .attention import PagedBatch
from .sampling import sample_and_score

NEG_INF = steps.NEG_INF


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
    # host points in the proposal (host masks): ``propose(meanwhile)`` runs ``meanwhile`` before the first
    hosted: bool = False


def host_terms(b: dict, rewards: list, hosted, longest_new: int) -> None:
    """Reward increments (``rewards``: (RewardTracker, its rows as a bool mask or None for all)) and
    the host constraints' verdict on cut sequences and on checked rows' tokens -> b["host_incr"]."""
    active, ended, hit_eos = b["active"].cpu(), b["ended"].cpu(), b["hit_eos"].cpu()
    B = active.shape[0]
    incr = torch.zeros(B, dtype=torch.float64)
    if hosted is not None:
        if bool((ended & ~hit_eos).any()):
            incr = steps.reject_cut(incr, ended, hit_eos, ~hosted.rejects(B))
        # (checked requests: a row whose new tokens left the documents gets weight 0)
        incr = torch.where(active & hosted.dead(B), NEG_INF, incr)
    if rewards and bool(active.any()):
        tokens, lengths = b["tokens"][:, :longest_new].cpu(), b["n_gen"].cpu()
        for tracker, mine in rewards:
            rows = active if mine is None else active & mine
            if bool(rows.any()):
                incr = incr + tracker.increment(tokens, lengths, rows, ended)
    b["host_incr"].copy_(incr)


def run_round(rnd: Round, host, rewards: list, k: int, longest_new: int, meanwhile=None) -> tuple[float, bool]:
    """Run a round (draft steps ``k``): its proposal, the host's work, its resampling; returns (the
    seconds of the host's verdicts, ``host_terms``: ``rewards`` and the host constraints ``host``;
    whether the host's end of the round is left to the caller, ``HostMasks.end``).
    With host masks alone, where no request is checked or may reach its budget
    (``HostMasks.verdicts_due``), the resampling needs no verdict: it is launched before the host
    catches up with the round's last tokens, which the caller does later (then True): with the
    next round launched, it overlaps both rounds on the device.
    ``meanwhile``: host work run once the proposal is launched, before the host reads it (a
    pipelined round's read of the round before it); with host points, before the first of them."""
    if rnd.hosted:
        rnd.propose(meanwhile)
    else:
        rnd.propose()
        if meanwhile is not None:
            meanwhile()
    # (decided after ``meanwhile``: it may have ended the round before on the host)
    if host is not None and not rewards and not host.verdicts_due():
        host.drafted(k, rnd.buffers["bonus"])  # (the bonus handed over as a column)
        rnd.finish()
        return 0.0, True
    if host is not None:
        host.end(rnd.buffers["bonus"], rnd.buffers)
    t0 = time.perf_counter()
    if rewards or host is not None:
        host_terms(rnd.buffers, rewards, host, longest_new)
    t1 = time.perf_counter()
    rnd.finish()
    return t1 - t0, False


def build_round(engine, G, Nmax, Kmax, cap, pt_start, automata, eos, pad, resampler, tau, host: bool,
                speculative: bool = False, drafts: bool = True, exact_only: bool = False) -> Round:
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
        log_q_all=z(B, Kmax, dtype=torch.float32),  # log q(d_i) of the unmasked draft (a schedule's statistic)
        accept=z(B, dtype=torch.float64), accept_n=z(B, dtype=torch.float64), draft_lw=z(B, dtype=torch.float64),
        states=[z(B) for _ in automata], index=torch.arange(B, device=dev), do=z(G, dtype=torch.bool),
        ess=z(G, dtype=torch.float64), W=z(G, Nmax, dtype=torch.float64), done=z(1, dtype=torch.bool),
        ar=torch.arange(Kmax + 1, device=dev), group_base=(torch.arange(G, device=dev) * Nmax)[:, None],
        # read by the host between the two halves of a round
        active=z(B, dtype=torch.bool), ended=z(B, dtype=torch.bool), hit_eos=z(B, dtype=torch.bool),
        host_incr=z(B, dtype=torch.float64),
        # what the host reads after the round's sync, packed in the round's graph: index, seq, finished, do, ess, done
        packed=z(3 * B + 2 * G + 1, dtype=torch.float64),
        # pages the host set aside for the round's end (pages_code): a copy-on-write page, then new ones
        fresh=z(B, 2 + (Kmax + 1) // engine.page_size),
        # positions each row moves on (K_row + 1; exact speculative decoding: its accepted drafts + 1)
        advance=z(B), exact=z(B, dtype=torch.bool), accepted=z(B),
    )
    if host:  # the host masks of the current draft step, packed (a bit a token; host_masks.py)
        b["host_bits"] = torch.full((B, (engine.target.cfg.vocab_size + 31) // 32), -1, dtype=torch.int32, device=dev)
    if speculative and Kmax > 0:  # rows of exact speculative decoding need the draft's logits at the first rejection
        b["draft_logits"] = torch.zeros(B, Kmax, engine.draft.cfg.vocab_size, dtype=engine.dtype, device=dev)
    rnd = Round(b, None, None, keep=[t for a in automata for t in (a.table, a.classes, a.accepting, a.live)])
    # (the scheduler builds each round's code over views of these buffers: ``round_code``)
    rnd.propose_code, rnd.finish_code = round_code(engine, b, automata, eos, pad, resampler, tau, None, drafts,
                                                   exact_only)
    return rnd


def round_code(engine, b: dict, automata, eos: int, pad: int, resampler: str, tau: float, host=None,
               drafts: bool = True, exact_only: bool = False):
    """(propose, finish) over the static buffers ``b``. ``propose()`` is a generator: with ``host``
    (a ``host_masks.HostMasks``: host-mask constraints) it yields ``("mask", i)`` where the host must
    write the packed masks of draft step i (i = K_max: the bonus) into ``b["host_bits"]`` (or, where
    ``host.waits``, waits there on the device for the host's masks: ``host_point``), and hands
    each draft column over to the host as soon as it is sampled (``HostMasks.hand_over``: a copy and
    an event, inside the round's graph); without, it yields nothing. ``drafts`` False leaves the draft model out (a
    loop that never drafts: autoregressive sampling); ``exact_only``: every row is one of exact
    speculative decoding or, without drafts, of autoregressive sampling: the round of exact.py."""
    if exact_only:
        return exact_round.round_code(engine, b, eos, pad, drafts)
    G, Nmax = b["W"].shape
    B, Kmax = b["drafts"].shape
    ar, PS = b["ar"], engine.page_size
    draft, fused = (engine.draft if drafts else None), engine.config.triton
    rows = torch.arange(B, device=b["ar"].device)
    pair = torch.arange(2, device=b["ar"].device)  # (the draft's first forward: positions T−1, T, whatever K_max)
    tokens, n_gen, finished, log_w = b["tokens"], b["n_gen"], b["finished"], b["log_w"]
    drafts, log_q, K_row, alpha, T = b["drafts"], b["log_q"], b["K_row"], b["alpha"], b["seq"]
    exact = b["exact"] if "draft_logits" in b else None  # rows of exact speculative decoding
    hosted = host is not None

    V = engine.target.cfg.vocab_size

    def masks(states: list[Tensor]) -> dict:
        """The sampler's mask arguments: ``mask`` (the rows' mask [B, V]) or, the host's masks alone on
        the fused kernel, ``mask_bits`` (as uploaded: the kernel reads the bits), and ``dead`` (the
        rows it leaves no token, where known here); {} where nothing masks."""
        m = None
        for a, s in zip(automata, states):
            mi = a.allowed(s)
            m = mi if m is None else m & mi
        # (one automaton: a state's row allows some token or none, known without reducing the mask)
        dead = ~automata[0].live[states[0]] if len(automata) == 1 else None
        if hosted:  # the host's masks of this step (in ``host_bits`` at the host point before it)
            if m is None and fused:
                return {"mask_bits": b["host_bits"]}
            hm = unpack_bits(b["host_bits"], V)
            m, dead = (hm if m is None else m & hm), None
        return {} if m is None else {"mask": m, "dead": dead}

    def host_point(i: int):
        """The host's masks of draft step i (i = K_max: the bonus) into ``host_bits``: yielded for the
        host to write, or, in a round that ``waits``, awaited (``HostMasks.await_masks``: the device
        has waited for them and uploaded them beside its work since ``fetch``)."""
        if not hosted:
            return
        if host.waits:
            host.await_masks()
        else:
            yield "mask", i

    def fetch() -> None:
        """In a round that ``waits``: the next host point's masks waited for and uploaded into
        ``host_bits`` on a side stream, from here (``host_bits`` read by the step before) on."""
        if hosted and host.waits:
            host.fetch(b["host_bits"])

    def propose():
        seeds = torch.randint(0, 2**62, (Kmax + 2,), device=T.device)
        remaining = b["budget"] - n_gen
        k_eff = torch.minimum(K_row, remaining)
        states = list(b["states"])
        kept = list(b["states"])  # states after the row's first min(i, k_eff) drafts
        # 1. K_max draft tokens from q' (the first forward covers the two tokens the draft has not seen;
        # no draft model: K_max = 0, the target as proposal)
        fetch()
        if draft is not None:
            batch = PagedBatch.build((T - 1)[:, None] + pair, b["pt"], PS)
            logits = draft(b["pending"], engine.kv_d, batch, last_only=True)[:, 0]  # [B, V]
        for i in range(Kmax):
            yield from host_point(i)
            m = masks(states)
            # (with a mask, a schedule's statistic too: log q(d) of the unmasked draft,
            # log q'(d) + log Σ_v q(v)·1[valid], 0 on a row the mask leaves no token)
            d, log_q[:, i], _, _ = sample_and_score(logits, b["T_draft"], seeds[i], triton=fused, **m,
                                                    unmasked_out=b["log_q_all"][:, i] if m else None)
            drafts[:, i] = d
            if exact is not None:
                b["draft_logits"][:, i] = logits
            if hosted:  # (the host computes the next step's masks while the draft's next forward runs)
                host.hand_over(i, d)
                fetch()
            if not m:
                b["log_q_all"][:, i] = log_q[:, i]
            states = [a.advance(s, d) for a, s in zip(automata, states)]
            kept = [torch.where(i < k_eff, s, k) for s, k in zip(states, kept)]
            if i < Kmax - 1:
                batch = PagedBatch.build((T + 1 + i)[:, None], b["pt"], PS)
                logits = draft(d[:, None], engine.kv_d, batch)[:, 0]
        # 2. one target pass over [last, d_1..d_Kmax]
        feed = torch.cat([b["last"][:, None], drafts], dim=1)
        batch = PagedBatch.build(T[:, None] + ar, b["pt"], PS)
        logits_t = engine.target(feed, engine.kv_t, batch)  # [B, Kmax+1, V]
        V = logits_t.shape[-1]
        if Kmax == 0:  # (a round of bonus tokens only: nothing drafted to score)
            log_p = logits_t.new_zeros(B, 0)
        else:
            gather = torch.cat([drafts, drafts[:, :1]], dim=1).reshape(-1)
            log_p = sample_and_score(logits_t.view(B * (Kmax + 1), V), b["T_target"][:, None].expand(B, Kmax + 1).reshape(-1),
                                     seeds[Kmax], gather, draw=False, triton=fused).gathered.view(B, Kmax + 1)[:, :Kmax]
        # 3. the bonus after the row's K drafts, from π_loc ∝ p^α·1[valid], and its normaliser
        yield from host_point(Kmax)
        bonus, _, log_norm, _ = sample_and_score(logits_t[rows, K_row], b["T_target"], seeds[Kmax + 1],
                                                 alpha=alpha, triton=fused, **masks(kept))
        b["bonus"].copy_(bonus)
        # 4. incremental weights up to the first EOS and the budget (a dead end: -inf)
        incr, n_new, any_eos, has_bonus = steps.weigh(log_p, log_q, drafts, alpha, k_eff, eos, log_norm,
                                                      remaining > K_row)
        # a schedule's statistics over every drafted position within the budget, up to the first EOS
        drawn = ar[None, :Kmax] < remaining[:, None]
        eos_all = (drafts == eos) & drawn
        counted = ((torch.cumsum(eos_all.long(), 1) - eos_all.long()) == 0) & drawn & ~finished[:, None]
        for name, value in zip(("accept", "accept_n", "draft_lw"),
                               row_statistics(log_p, b["log_q_all"], alpha[:, None] * log_p - log_q, counted)):
            b[name].copy_(value)
        active = ~finished
        b["drafted"].add_(torch.where(active, k_eff, 0))
        block = torch.cat([drafts, torch.full_like(bonus, pad)[:, None]], dim=1)
        block = block.scatter(1, K_row[:, None], bonus[:, None])
        nxt, used = bonus, K_row  # the next `last`, the drafts kept
        if exact is not None:  # exact speculative decoding's rows: accept a prefix, draw at the rejection
            n_acc = steps.accept_prefix(log_p, log_q, K_row, torch.rand(B, Kmax, device=T.device, dtype=torch.float64))
            j = n_acc.clamp(max=Kmax - 1)
            res = steps.residual(logits_t[rows, j], b["draft_logits"][rows, j], b["T_target"], b["T_draft"])
            c = torch.where(n_acc >= K_row, bonus, steps.race(res))
            sd_block = torch.cat([drafts, c[:, None]], dim=1).scatter(1, n_acc[:, None], c[:, None])
            sd_new = torch.minimum(n_acc + 1, remaining)
            is_eos = (sd_block == eos) & (ar[None] < sd_new[:, None])
            sd_eos = is_eos.any(1)
            sd_new = torch.where(sd_eos, is_eos.long().argmax(1) + 1, sd_new)
            block = torch.where(exact[:, None], sd_block, block)
            n_new = torch.where(exact, sd_new, n_new)
            incr = torch.where(exact, 0.0, incr)
            any_eos = torch.where(exact, sd_eos, any_eos)
            has_bonus = has_bonus & ~exact
            nxt, used = torch.where(exact, c, bonus), torch.where(exact, n_acc, K_row)
            # (positions these rows move on: what they kept + 1; the others K_row + 1)
            # (an exact row stops where it finished: its pages were reserved for its own output only)
            b["advance"].copy_(torch.where(exact, torch.where(b["valid"] & active, n_acc + 1, 0), K_row + 1))
            b["accepted"].add_(torch.where(active & exact, torch.minimum(n_acc, sd_new), 0))
        block = torch.where((ar[None] < n_new[:, None]) & active[:, None], block, pad)
        tokens.scatter_(1, n_gen[:, None] + ar, block)
        n_gen.add_(torch.where(active, n_new, 0))
        hit_eos = any_eos | (has_bonus & (bonus == eos))
        ended = active & (hit_eos | (n_gen >= b["budget"]))
        final = [torch.where(has_bonus, a.advance(k, bonus), k) for a, k in zip(automata, kept)]
        accepted = torch.ones_like(ended)
        for a, s in zip(automata, final):
            accepted = accepted & a.accepting[s]
        incr = steps.reject_cut(incr, ended, hit_eos, accepted)  # cut, and not in the language
        lw = torch.where(active, log_w + incr, log_w)
        log_w.copy_(lw)
        finished.copy_(finished | ended | torch.isneginf(lw))
        for s, f in zip(b["states"], final):
            s.copy_(torch.where(active, f, s))
        # the draft's next feed [token at T'−1, next]: the row's last kept draft, or (none) the last token
        d_last = (b["last"] if Kmax == 0 else
                  torch.where(used > 0, drafts.gather(1, (used - 1).clamp(min=0)[:, None])[:, 0], b["last"]))
        b["pending"].copy_(torch.where(active[:, None], torch.stack([d_last, nxt], 1), b["pending"]))
        b["last"].copy_(torch.where(active, nxt, b["last"]))
        b["active"].copy_(active)
        b["ended"].copy_(ended)
        b["hit_eos"].copy_(hit_eos)

    def finish() -> None:
        lw = log_w + b["host_incr"]
        finished.copy_(finished | torch.isneginf(lw))
        b["host_incr"].zero_()
        live = (~finished).view(G, Nmax).any(1)
        # (rows of exact speculative decoding are independent samples: never resampled)
        chains = live if exact is None else live & ~exact.view(G, Nmax)[:, 0]
        A, do, W, ess, log_Z_incr, lw = steps.resample(lw.view(G, Nmax), tau, resampler, n=b["n"], live=chains)
        idx = (A + b["group_base"]).flatten()
        b["log_Z"].add_(log_Z_incr)
        log_w.copy_(lw.flatten())
        b["W"].copy_(W)
        for t in (b["pending"], b["last"], tokens, n_gen, finished, log_w, *b["states"]):
            t.copy_(t[idx])
        # every row of a request with a live particle moves on by its K + 1 positions (finished rows
        # too, so a request's rows share one position and the pages a round needs are known before it)
        go = (~finished).view(G, Nmax).any(1)[:, None].expand(G, Nmax).reshape(B)
        T.add_(torch.where(go, b["advance"] if exact is not None else K_row + 1, 0))
        b["index"].copy_(idx)
        b["do"].copy_(do)
        b["ess"].copy_(ess)
        b["done"].copy_(finished.all()[None])
        b["packed"].copy_(torch.cat([idx.double(), T.double(), finished.double(), do.double(), ess,
                                     b["done"].double()]))
        pages(go)

    pools = [kv for kv in (engine.kv_t, engine.kv_d) if kv is not None]
    pages = pages_code(b, pools, PS)
    return propose, finish


def pages_code(b: dict, pools: list, page_size: int):
    """The page bookkeeping of ``PageTable`` (``fork`` then ``reserve``) at the end of a round, as
    device code over the buffers ``b`` (static shapes, no host sync), with the pages the host set
    aside in ``fresh`` [B, F] (row i: its copy-on-write page, then its new columns' pages; 0 = none).
    ``pages(go)`` runs it for the rows ``go`` (the requests still live).

    A round writes positions [T−1, T+K] of every row (T = ``seq`` before it, K = ``K_row``, the same
    for every row of a round the host sets pages aside for), so after it (T' = T + K + 1):
      * fork: pt = pt[ancestors] (a pointer exchange: every page stays where it is);
      * copy-on-write: the one page a row writes next that may be shared is the page of position
        T'−1 (the partially filled last page: fully written pages are never written again).
        A row copies it to fresh[i, 0] when a later row of its request holds it too, so the last
        holder keeps it (as ``PageTable.reserve``, which visits rows in order);
      * fresh pages fresh[i, 1:] for the columns [ceil(T'/PS), ceil((T'+K+1)/PS)) of every row.
    With ``fresh`` all zeros it only forks (the host then books and uploads the rest).
    ``PageTable.reserve(held=fresh)`` repeats this on the host with the same page ids."""
    PS = page_size
    pt, seq, fresh, K = b["pt"], b["seq"], b["fresh"], b["K_row"]
    B, P = pt.shape
    G, N = b["W"].shape
    F = fresh.shape[1]
    cols = torch.arange(P, device=pt.device)[None]  # [1, P]
    later = torch.ones(N, N, dtype=torch.bool, device=pt.device).triu(1)  # [i, j]: row j comes after row i

    def pages(go: Tensor) -> None:
        table = pt[b["index"]]  # [B, P] the fork
        last_col = (seq - 1) // PS  # [B] the page of position T'−1
        n_old = last_col + 1  # pages a row holds
        n_new = (seq + K + PS) // PS  # pages it needs for positions < T' + K + 1
        last_page = table.gather(1, last_col[:, None])[:, 0]  # [B]
        same = last_page.view(G, N)[:, :, None] == last_page.view(G, N)[:, None, :]  # [G, N, N]
        cow = (same & later).any(2).view(B) & go & (fresh[:, 0] > 0)  # a later row holds the page too
        new_page = fresh.gather(1, (cols - n_old[:, None] + 1).clamp(1, F - 1))  # [B, P]
        grows = (cols >= n_old[:, None]) & (cols < n_new[:, None]) & go[:, None] & (new_page > 0)
        new_table = torch.where(grows, new_page.to(pt.dtype), table)
        new_table = torch.where((cols == last_col[:, None]) & cow[:, None], fresh[:, :1].to(pt.dtype), new_table)
        src = torch.where(cow, last_page.long(), 0)  # rows without a copy: (0, 0), skipped
        dst = torch.where(cow, fresh[:, 0], 0)
        for pool in pools:  # one launch over all layers, keys and values
            pool.copy_pages(src, dst)
        pt.copy_(new_table)

    return pages


def drive(steps, handle=None) -> None:
    """Run the generator ``steps`` (a round's ``propose()``) to its end, ``handle(event)`` at each host point."""
    for event in steps:
        handle(event)


def capture_round(engine, rnd: Round, graphs: bool, split: bool, host=None) -> None:
    """Eager closures, or their CUDA graphs: one for the whole round, two when the host scores
    rewards between the proposal and the resampling. With ``host`` (a ``host_masks.HostMasks``) the
    proposal is one graph that waits on the device at each host point, launched whole before the
    host computes the points' masks (``HostMasks.serve``); eager, the host writes each point's masks
    as the proposal yields it (``HostMasks.mask``)."""
    propose, finish = rnd.propose_code, rnd.finish_code
    b = rnd.buffers
    # the whole proposal in one call (exact.py's rounds are plain functions: no host points)
    run = (lambda: drive(propose())) if inspect.isgeneratorfunction(propose) else propose
    if host is not None:
        if graphs:  # (the proposal launched whole; its device waits at each host point for the host's count)
            host.waits = True
            with host.open_gate():  # (the capture's first run passes every wait)
                graph = engine.graphs.capture(run, True)

            def replay(meanwhile=None) -> None:
                with host.serving():  # (from the launch on: nothing may wait for the device)
                    try:
                        graph()
                        if meanwhile is not None:
                            meanwhile()
                        host.serve()
                    except BaseException:  # (an error or an interrupt: the device let past its waits first)
                        host.release()
                        raise

            rnd.propose = replay
        else:
            def eager(meanwhile=None) -> None:
                if meanwhile is not None:
                    meanwhile()
                drive(propose(), lambda event: host.mask(event[1], b["host_bits"]))

            rnd.propose = eager
        rnd.finish = engine.graphs.capture(finish, graphs)
        rnd.hosted = True
    elif not graphs:
        rnd.propose, rnd.finish = run, finish
    elif split:
        rnd.propose = engine.graphs.capture(run, True)
        rnd.finish = engine.graphs.capture(finish, True)
    else:
        def whole() -> None:
            run()
            finish()

        rnd.propose = engine.graphs.capture(whole, True)
        rnd.finish = lambda: None
    rnd.keep.append(rnd.buffers)
