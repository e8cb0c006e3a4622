"""What the request loop (scheduler.py) keeps per request and per round: a :class:`Request`, a
:class:`Finished` request, a launched round not read yet, a released request whose outputs are on
their way to the host, and the settings of rows no request holds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from .smc import NEG_INF, Round
from .targets import DeviceAutomaton, EngineTarget


@dataclass
class Request:
    """One SMC-SD request: a prompt (token ids, at least 2; at least 1 in a scheduler without a
    draft) and its own settings."""

    prompt: list[int]
    particles: int
    block_size: int
    max_new_tokens: int
    draft_temperature: float = 1.0
    target_temperature: float = 1.0
    id: object = None
    target: EngineTarget | None = None  # one of the scheduler's programs (default: its first)
    # exact speculative decoding (a Scheduler(speculative=True)): its ``particles`` rows are
    # independent samples of the target, never resampled
    exact: bool = False


@dataclass
class Finished:
    """A finished request: its particles ([N, max_new_tokens] EOS-padded tokens), weights, log Ẑ and
    per-round ESS / resampling flags (of the rounds it was in)."""

    request: Request
    tokens: Tensor
    lengths: Tensor
    log_weights: Tensor
    log_evidence: float
    ess: list = field(default_factory=list)
    resampled: list = field(default_factory=list)
    rounds: int = 0
    joined_round: int = 0
    drafted: Tensor | None = None  # [N] tokens drafted in each row slot while unfinished
    weights: list = field(default_factory=list)  # per round, normalised [N_max] (record_weights)
    block_sizes: list = field(default_factory=list)  # per round, the K it ran with
    survivors: list = field(default_factory=list)  # per round, distinct ancestors kept (N: not resampled)
    accepted: Tensor | None = None  # [N] drafts accepted (exact speculative decoding)


@dataclass
class Flight:
    """A launched round: where its packed flags land on the host, its shape, the requests in it (by
    slot), their K, the pages set aside for its end (None: none), its recorded weights, and whether
    the host's end of it is still due."""

    parity: int
    bucket: int
    k: int
    groups: list
    requests: dict
    K: dict
    held: np.ndarray | None
    event: object
    weights: Tensor | None
    ends: Tensor | None = None  # its bonus buffer, where the host's end of it waits for its read (``HostMasks.end``)

    def record(self, history: dict, g: int, ess: float, resampled: bool, parents: np.ndarray | None) -> None:
        """Slot g's statistics of this round into its ``history`` (``parents``: its rows' ancestors;
        None: never resampled, rows of exact speculative decoding)."""
        n = self.requests[g].particles
        history["ess"].append(ess)
        history["resampled"].append(resampled)
        history["block_sizes"].append(self.K[g])
        history["survivors"].append(n if parents is None else len(np.unique(parents[:n])))
        if self.weights is not None:
            history["weights"].append(self.weights[g])


@dataclass
class Leaving:
    """A released request whose outputs are being copied to ``host`` (done when ``event`` is)."""

    request: Request
    history: dict
    host: Tensor
    event: object
    step: int

    @classmethod
    def start(cls, b: dict, g: int, N: int, request: Request, history: dict, step: int, pinned: bool) -> Leaving:
        """Slot g's outputs (rows g·N …, buffers ``b``) on their way to the host in one copy."""
        T, r = request.max_new_tokens, slice(g * N, g * N + request.particles)
        pack = torch.cat([b["tokens"][r, :T].reshape(-1).double(), b["n_gen"][r].double(), b["drafted"][r].double(),
                          b["log_w"][r], b["accepted"][r].double(), b["log_Z"][g : g + 1]])
        host = torch.empty(pack.shape, dtype=torch.float64, pin_memory=pinned)
        host.copy_(pack, non_blocking=True)
        event = None
        if pinned:
            event = torch.cuda.Event()
            event.record()
        return cls(request, history, host, event, step)

    def finished(self) -> Finished:
        """The request's outputs, once copied (``host``: tokens, lengths, drafted, log w, accepted, log Z)."""
        if self.event is not None:
            self.event.synchronize()
        req, h, x = self.request, self.history, self.host
        n, T = req.particles, req.max_new_tokens
        lw = x[n * T + 2 * n : n * T + 3 * n].clone()
        return Finished(req, x[: n * T].view(n, T).long(), x[n * T : n * T + n].long(), lw,
                        float(x[-1] + torch.logsumexp(lw, 0) - math.log(n)), h["ess"], h["resampled"], len(h["ess"]),
                        h["joined"], drafted=x[n * T + n : n * T + 2 * n].long(), weights=h["weights"],
                        block_sizes=h["block_sizes"], survivors=h["survivors"],
                        accepted=x[n * T + 3 * n : n * T + 4 * n].long())


def idle_settings(b: dict, rows: slice, groups: slice) -> None:
    """Rows no request holds (``groups``: their request slots): the round still runs over them, dead
    (never chosen, as if finished), with a block size that fits every round shape (0: also the K = 0
    rounds of a scheduler without drafts) and finite temperatures, power and budget."""
    b["valid"][rows] = False
    b["finished"][rows] = True
    b["log_w"][rows] = NEG_INF
    b["seq"][rows] = 1
    for name in ("T_draft", "T_target", "alpha", "budget"):
        b[name][rows] = 1
    b["K_row"][rows] = 0
    b["exact"][rows] = False
    b["n"][groups] = 1


def request_settings(b: dict, rows: slice, g: int, req: Request, alpha: float, pad: int) -> None:
    """The rows of request ``req`` in slot g (``rows``: all N_max of them; its first ``particles``
    live): its prompt's last tokens, budget, K, temperatures and power, fresh weights and evidence."""
    ids, dev = list(req.prompt), b["seq"].device
    valid = torch.arange(rows.stop - rows.start, device=dev) < req.particles
    b["seq"][rows] = len(ids) - 1
    b["pending"][rows] = torch.tensor(ids[-2:] if len(ids) > 1 else ids * 2, device=dev)  # (no draft: unread)
    b["last"][rows] = ids[-1]
    b["tokens"][rows] = pad
    for name in ("n_gen", "drafted", "accepted"):
        b[name][rows] = 0
    b["budget"][rows] = req.max_new_tokens
    b["K_row"][rows] = req.block_size
    b["exact"][rows] = req.exact
    b["T_draft"][rows] = float(req.draft_temperature)
    b["T_target"][rows] = float(req.target_temperature)
    b["alpha"][rows] = alpha
    b["valid"][rows] = valid
    b["finished"][rows] = ~valid
    b["log_w"][rows] = torch.where(valid, 0.0, NEG_INF).double()
    b["n"][g] = req.particles
    b["log_Z"][g] = 0.0


def bucket_of(n: int, slots: int) -> int:
    return min(slots, 1 << max(0, (n - 1).bit_length()))


@dataclass
class Rounds:
    """The full buffers of one scheduler shape and its captured rounds, by bucket."""

    full: Round
    by_bucket: dict = field(default_factory=dict)
    host: object = None  # the host-mask constraints' HostMasks, when the scheduler has any


def bucket_views(full: dict, bucket: int, k: int, N: int) -> dict:
    """Views of a scheduler's round buffers ``full`` for a round over its first ``bucket`` slots (N
    rows each) with ``k`` draft steps."""
    R = bucket * N
    view = {}
    for name, v in full.items():
        if name == "states":
            view[name] = [s[:R] for s in v]
        elif name in ("n", "log_Z", "do", "ess", "W", "group_base"):
            view[name] = v[:bucket]
        elif name == "ar":
            view[name] = v[: k + 1]
        elif name == "done":
            view[name] = v
        elif name == "packed":
            view[name] = v[: 3 * R + 2 * bucket + 1]
        elif name in ("drafts", "log_q", "log_q_all"):
            view[name] = v[:R, :k]
        else:
            view[name] = v[:R]
    return view


def check_exact(request: Request, program: EngineTarget, speculative: bool, exact_only: bool = False,
                max_block_size: int = 1) -> None:
    """Refuse an exact speculative decoding request its scheduler cannot run (or, ``exact_only``, any
    other); a scheduler with ``max_block_size`` 0 runs exact requests of K = 0 (autoregressive sampling)."""
    if not request.exact:
        if exact_only:
            raise SMCDecodeError("this scheduler runs exact speculative decoding only (exact_only=True): "
                                 "submit Request(..., exact=True)")
        return
    if not speculative:
        raise SMCDecodeError("exact=True needs a Scheduler(speculative=True)")
    if request.block_size < 1 and max_block_size > 0:
        raise SMCDecodeError(f"exact speculative decoding needs block_size >= 1, got block_size={request.block_size} "
                             "(autoregressive sampling: a Scheduler with max_block_size=0)")
    if program.alpha != 1.0 or program.constraints or program.rewards:
        raise SMCDecodeError("exact speculative decoding samples the target alone: give it a program without "
                             "power, constraints or rewards")


def rows_of(groups, N: int) -> np.ndarray:
    """The rows of request slots ``groups`` (N rows each)."""
    return (np.concatenate([np.arange(g * N, (g + 1) * N) for g in groups]) if len(groups)
            else np.zeros(0, dtype=np.int64))


def check_fits(request: Request, extra: int, max_context: int, least: int = 2) -> None:
    """Refuse a prompt shorter than ``least`` tokens (2 where a draft reads the last two), or one that
    with ``extra`` positions overflows the context."""
    need = len(request.prompt) + extra
    if len(request.prompt) < least or need > max_context:
        raise SMCDecodeError(f"prompt ({len(request.prompt)} tokens) must have at least {least} tokens and, with "
                             f"max_new_tokens and a block, fit the engine's max_context ({max_context}; needs {need})")


def program_constraints(programs: list, vocab_size: int, device) -> tuple[dict, dict]:
    """({program id: its device automata}, {program id: its host-mask constraints}) of a scheduler's
    ``programs`` (EngineTargets), each checked, over an engine vocabulary of ``vocab_size``."""
    own, hosted = {}, {}
    for t in programs:
        if not isinstance(t, EngineTarget):
            raise SMCDecodeError(f"target must be an EngineTarget or a list of them, got {type(t).__name__}")
        t.check()
        own[id(t)], hosted[id(t)] = [], []
        for c in t.constraints:
            if c.model.vocab_size != vocab_size:
                raise SMCDecodeError(f"constraint {c!r} is over a vocabulary of {c.model.vocab_size} tokens, "
                                     f"the engine's model has {vocab_size}: bind it to the model the engine runs")
            a = None if t.host_masks else DeviceAutomaton.of(c, device)
            if a is not None:
                own[id(t)].append(a)
            if a is None or c.path == "superset":  # (the superset path: llguidance checks on the host)
                hosted[id(t)].append(c)
    return own, hosted
