"""Constraints whose token masks come from the host (llguidance matchers: JSONSchema, Grammar; any
TokenConstraint without a token automaton), for the engine's request loop.

Each request holds its own states (its first N rows). Within a request every unfinished row has
generated the same number of tokens (a round adds K + 1, or ends the row), so a request advances
in lockstep: draft step i of a round counts while i < k = min(K, budget − position), and the bonus
comes after those k drafts when the budget allows one. The round asks for the masks of draft step i
(i = K_max: the bonus) and the host answers for every request at once; rows it does not constrain
(other requests, padding, drafts past a request's k) get every token.

A step's masks travel packed: the constraints (or the mask workers) write their rows of one pinned
int32 [rows, ⌈V/32⌉] bitmask, which reaches the round's ``host_bits`` buffer, where the sampler reads
the bits (a bit a token instead of a byte: 8× fewer bytes).
Host and device overlap: the round hands each draft column over as soon as it is sampled
(``hand_over``, inside the round's graph: a copy into a pinned buffer and an event), so the host
waits for that sample only and computes the next step's masks while the device runs the draft's
next forward (or, for the bonus, the target's pass). With CUDA graphs the proposal is one graph,
launched whole before the host's first point (``waits``): on a side stream, from the moment the
step before has used its masks, the device waits for the host's count of points in pinned memory
(kernels/host.py), then copies the bitmask up, while its main stream runs on to the point that uses
them (``fetch``, ``await_masks``); the host computes the points in order (``serve``) and raises the
count after each, or, where the mask workers hold every masked request, the workers serve the points
themselves and the device waits for each worker's count (host_points.py). So the device starts a step as soon as its masks are written, with no launch
between. So nothing the host does between the launch and its last point may wait for the device
(the host constraints compute on the CPU; a pinned buffer freed then is unpinned after:
``mask_workers._unpin``); an error there lets the device past its waits before it propagates
(``release``). Eager (no graphs), the proposal yields at
each host point and the host uploads that step's masks (``mask``).

Checked requests (a JSONSchema on the superset path, a request of several particles): the round
masks their proposal with the superset's automaton on the device and has no host point for them;
after the proposal the host reads each row's new tokens once and advances its llguidance state by
them (``check``), and a row whose tokens llguidance refused gets weight 0 before the resampling
(``dead``). The same target: the proposal has every valid continuation in its support, and a
particle outside the documents carries weight 0. From the round after one of its particles left the
documents, a request takes llguidance's masks (so it is not left without a sample when all die).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from ...potentials.grammar import LLGuidanceConstraint
from ...potentials.token_bytes import token_texts
from .host_points import HostPoints
from .mask_workers import MaskWorkers, shared_buffer
from .request_masks import RequestMasks, advance_requests, fill_requests

__all__ = ["HostMasks", "RequestMasks"]


class HostMasks(HostPoints):
    """The host constraints of every request in a round (slot g: rows g·N_max … g·N_max + n_g − 1)."""

    def __init__(self, n_max: int, vocab_size: int, device, rows: int = 0, k_max: int = 0, workers: int = 0):
        self.n_max, self.V, self.device = n_max, vocab_size, torch.device(device)
        # ``workers`` > 0 (and ``rows``): the llguidance requests' states in that many worker processes
        # (mask_workers.py), started with the first such request; every such request goes there (one
        # kept here would have this process's fill compete with the workers for the cores)
        self.workers, self._pool = workers if rows else 0, None
        self.W = (vocab_size + 31) // 32
        self.pinned = self.device.type == "cuda"
        # the draft columns the round hands over (``hand_over``; ``rows``, ``k_max``: the largest round)
        # and a row for the bonus, at fixed addresses, which the captured rounds write: on a GPU pinned,
        # with an event per step; with workers in shared memory, where they read them (``_share``)
        self._shared = None
        if self.workers:
            self._shared = shared_buffer(8 * (k_max + 1) * rows, self.pinned, self)
            self._handed = torch.frombuffer(self._shared, dtype=torch.long).view(k_max + 1, rows)
        else:
            self._handed = torch.zeros(k_max + 1, rows, dtype=torch.long, pin_memory=self.pinned)
        self._in_shared: set = set()  # the columns of the round in progress in ``_handed`` (``_share``)
        self._handed_events = [torch.cuda.Event(external=True) for _ in range(k_max)] if self.pinned else None
        self.handed = False  # does the round in progress hand its columns over (``begin``)?
        self.requests: dict[int, RequestMasks] = {}
        self.drafts: Tensor | None = None  # the round's drafts (device buffer, filled step by step)
        self.rows = 0
        self.k_max = 0  # the round's K_max: mask(k_max) asks for the bonus masks
        self._columns: dict[int, tuple[Tensor, object]] = {}  # step j -> (drafts[:rows, j] on the CPU, event)
        self._pinned = torch.empty(0, 0, dtype=torch.long)  # on a GPU: the pinned host buffer of the drafted columns
        # the packed masks of a step on the host, two buffers in turn (pinned on a GPU: uploaded without
        # blocking), at fixed addresses in a shared mapping where the mask workers write them too
        if rows:
            self._mem = shared_buffer(2 * rows * self.W * 4, self.pinned, self)
            whole = torch.frombuffer(self._mem, dtype=torch.int32)
            self._bits = [whole[t * rows * self.W: (t + 1) * rows * self.W].view(rows, self.W) for t in (0, 1)]
        else:
            self._mem, self._bits = None, [torch.empty(0, self.W, dtype=torch.int32) for _ in range(2)]
        self._turn = 0
        # the next round's step-0 masks of requests in the mask workers, filled at this round's end from
        # the states before the resampling (``end``): (step buffer, slot -> its RequestMasks); and the
        # resampling's ancestors, which ``_fill`` then gathers those rows by (``fork``)
        self._prefilled: tuple[int, dict] | None = None
        self._ancestors = None
        # each buffer's upload (an event, recorded after its copy; made once: a new event costs more than the copy)
        self._upload_events = [torch.cuda.Event(), torch.cuda.Event()] if self.pinned else None
        self._uploaded = [False, False]  # has each buffer's event been recorded?
        # ``waits``: the round is one CUDA graph launched whole, which waits at each host point for the
        # host's count of points in ``_posted`` (pinned; kernels/host.py) and then uploads buffer 0
        # (``await_masks``); the host computes each point's masks into buffer 0 and counts it (``serve``)
        self.waits = False
        # a side stream for the round's copies to and from the host and its waits, beside its work
        # (``hand_over``, ``fetch``); ``_fetching``: a point's masks are on their way (``await_masks``)
        self._side = torch.cuda.Stream(self.device) if self.pinned else None
        self._fetching = False
        # does a row go on after the round (its bonus masks, in a round that ``waits``: a row left
        # tokens but not EOS)? Then the next round is launched without waiting for this one's end
        self.eos, self.continuing = -1, False
        self._syncmem = None  # (with workers on a GPU: the sync lines they share with the device)
        if self.pinned:  # the parties' counts of points, the device's (host_points.py)
            self._init_points()

    def __bool__(self) -> bool:
        return bool(self.requests)

    def add(self, slot: int, masks: RequestMasks) -> None:
        self.remove(slot)
        self.requests[slot] = masks
        masks.slot = slot
        pool = self._pool_for(masks)
        if pool is not None:
            pool.add(slot, masks.constraints, masks.n, masks.lane, share=not masks.checked)
            masks.remote, masks.states = True, None

    def _pool_for(self, masks: RequestMasks) -> MaskWorkers | None:
        """The mask workers that can hold ``masks`` (started now if none are yet), or None: no workers
        here, or a constraint that is not on llguidance's path of this vocabulary (a checked request's
        superset constraints hold llguidance states too: the workers check its tokens)."""
        if not self.workers or not all(
                isinstance(c, LLGuidanceConstraint) and c.path != "automaton" for c in masks.constraints):
            return None
        if self._pool is not None and not self._pool.usable:  # (stopped, or a process died: new ones)
            self._drop_pool()
        if self._pool is None:
            c = masks.constraints[0]
            self._pool = MaskWorkers(self.workers, self._handed.shape[1], self.W, c._base_tok,
                                     token_texts(c.model, c._base_tok), self._shared, self._mem, self._syncmem,
                                     points=self._handed.shape[0])
        return self._pool if all(c._base_tok is self._pool.tok for c in masks.constraints) else None

    def remove(self, slot: int) -> None:
        m = self.requests.pop(slot, None)
        if m is not None and m.remote:
            self._pool.remove(slot)

    def clear(self) -> None:
        """Every request removed (a new scheduler over this round's shape)."""
        self.requests.clear()
        self.continuing = False
        self._prefilled = None
        if self._pool is not None:
            if self._pool.usable:
                self._pool.clear()
            else:
                self._drop_pool()

    def close(self) -> None:
        """Stop the mask workers, if any (a later request starts them again)."""
        self.requests.clear()
        self._drop_pool()

    def _drop_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def prepare(self, rows: int, k_max: int, handed: bool = False) -> None:
        """Before a round over ``rows`` rows with ``k_max`` draft steps is launched: raise if this
        HostMasks cannot serve it, or if a wait of the device gave up; finish a release an interrupt
        cut short. (``begin`` starts the round's states, in a pipelined round after its launch.)"""
        if (handed or self._pool is not None) and (k_max >= self._handed.shape[0] or rows > self._handed.shape[1]):
            raise SMCDecodeError(f"a round of {rows} rows and {k_max} draft steps hands over more than the "
                                 f"{self._handed.shape[1]} rows and {self._handed.shape[0] - 1} steps this HostMasks holds")
        if self.waits:
            if not handed:  # (reading the drafts buffer would queue behind the waiting round)
                raise SMCDecodeError("a round that waits for the host's masks on the device must hand its draft "
                                     "columns over (begin(..., handed=True))")
            if self._releasing:
                self.release()
            self._gave_up()
        if self._pool is not None and self._pool.closed:  # (stopped for another round shape's workers)
            if any(m.remote for m in self.requests.values()):
                raise SMCDecodeError("the mask workers holding this round's requests were stopped")
            self._drop_pool()
        if self._pool is not None and rows > self._pool.rows:
            raise SMCDecodeError(f"a round of {rows} rows on mask workers sized for {self._pool.rows} rows")

    def begin(self, rows: int, k_max: int, drafts: Tensor, handed: bool = False) -> None:
        """A round over ``rows`` rows with ``k_max`` draft steps: its drafts buffer, and whether it hands
        each column over (``hand_over``; otherwise ``drafted`` or, failing that, the drafts buffer).
        The round before it must have ended on the host (``end``)."""
        self.prepare(rows, k_max, handed)
        self.rows, self.k_max, self.drafts, self.handed = rows, k_max, drafts, handed
        self.continuing = False  # (until this round's bonus masks say otherwise)
        if self._pool is not None:  # (the last round's end record read its columns: they are rewritten now)
            self._pool.step_wait()
            if self.waits:  # (requests added: compiled in the workers now; a pipelined round adds none)
                self._pool.settle()
        if self._bits[0].shape[0] < rows:
            self._bits = [torch.empty(rows, self.W, dtype=torch.int32, pin_memory=self.pinned) for _ in range(2)]
        self._columns, self._in_shared = {}, set()
        for m in self.requests.values():
            m.begin()
            m.left = None

    def _rows(self, slot: int, n: int) -> slice:
        return slice(slot * self.n_max, slot * self.n_max + n)

    def drafted(self, i: int, tokens: Tensor) -> None:
        """The round sampled draft step i (``tokens`` [≥ rows] on the device; i = K_max: the bonus):
        start its copy to the host now, before the device's next forward is queued, so ``mask(i + 1)``
        waits for this copy only."""
        if tokens.device.type == "cuda":
            if self._pinned.shape[0] <= i or self._pinned.shape[1] < self.rows or self._pinned.dtype != tokens.dtype:
                self._pinned = torch.empty(max(self.k_max, i + 1), self.rows, dtype=tokens.dtype, pin_memory=True)
            # (a column is read only after its event; a later round's copy into it follows on the same stream)
            column = self._pinned[i, : self.rows]
            column.copy_(tokens[: self.rows], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._columns[i] = (column, done)
        else:
            self._columns[i] = (tokens[: self.rows].clone(), None)

    def _column(self, j: int) -> Tensor:
        if j not in self._columns:
            if self.handed and j < self.k_max:  # (handed over by the round: wait for its copy)
                if self._handed_events is not None:
                    self._handed_events[j].synchronize()
                return self._handed[j, : self.rows]
            self._columns[j] = (self.drafts[: self.rows, j].cpu(), None)  # (read it now)
        column, done = self._columns[j]
        if done is not None:
            done.synchronize()
            self._columns[j] = (column, None)
        return column

    def mask(self, i: int, out: Tensor) -> None:
        """Write the packed masks of draft step i (i = K_max: the bonus) into ``out`` (int32 [rows, ⌈V/32⌉]
        on the device; every token allowed on the rows no request constrains), without blocking."""
        # this step's host buffer (two in turn: the other one may still be uploading)
        self._turn ^= 1
        if self._uploaded[self._turn]:
            self._upload_events[self._turn].synchronize()
        bits = self._fill(i, self._turn)
        self._seen_masks(i, bits)
        if bits is None:
            out.fill_(-1)
            return
        out.copy_(bits, non_blocking=True)
        if self.pinned:
            self._upload_events[self._turn].record()
            self._uploaded[self._turn] = True

    def _fill(self, i: int, turn: int) -> Tensor | None:
        """The packed masks of draft step i (i = K_max: the bonus) written into host buffer ``turn``
        (its first ``rows`` rows, returned; every token allowed on the rows no request constrains), or
        None where no request's masks count at this step."""
        counted = self._counted(i)
        prefilled, self._prefilled = self._prefilled, None
        if not counted:
            return None
        bits = self._bits[turn][: self.rows]
        if i == 0 and prefilled is not None and prefilled[0] == turn:
            counted = self._gather(counted, prefilled[1], bits.numpy())
        elif sum(m.n for m, _, _ in counted) < self.rows:  # (rows no request constrains: every token)
            bits.numpy().fill(-1)  # (numpy's: one thread, where torch's fill would wake its pool)
        remote = [t for t in counted if t[0].remote]
        if remote:  # (the workers fill their rows while this process fills its own)
            self._pool.step(turn, 0, self._items(remote, fill={m.slot for m, _, _ in remote}))
        local = [t for t in counted if not t[0].remote]
        self._catch_up(local)
        fill_requests([(m, r) for m, _, r in local], bits, self.rows)
        if remote:
            self._pool.step_wait()
        return bits

    def _counted(self, i: int) -> list:
        """(RequestMasks, its step, its rows) of the requests whose masks count at draft step i."""
        counted = []
        for slot, m in self.requests.items():
            # (checked requests take no masks; past a request's block its bonus comes at i = K_max)
            if m.checked or (i >= m.K and i != self.k_max):
                continue
            step = min(i, m.K)
            if m.counts(step):
                counted.append((m, step, self._rows(slot, m.n)))
        return counted

    def _gather(self, counted: list, prefilled: dict, bits) -> list:
        """Step 0's masks in ``bits`` (int32 [rows, W]) of the requests of ``counted`` ((RequestMasks,
        step, its rows)) that the last round's end filled (``prefilled``: slot -> RequestMasks) from their
        states before the resampling: each row takes its ancestor's row. The other rows allow every
        token; returns the counted requests left to fill."""
        self._pool.step_wait()  # (the end's record, which filled them)
        ancestors, self._ancestors = self._ancestors, None
        covered = np.zeros(len(bits), dtype=bool)
        rest, moved = [], []
        for t in counted:
            m, _, r = t
            if prefilled.get(m.slot) is m:
                covered[r] = True
                moved.append(np.arange(r.start, r.stop))
            else:
                rest.append(t)
        if not covered.all():
            bits[~covered] = -1
        if ancestors is not None and moved:
            rows = np.concatenate(moved)
            src = ancestors[rows]
            if (src != rows).any():
                bits[rows] = bits[src]
        return rest

    def _catch_up(self, todo: list) -> None:
        """Bring each request of ``todo`` ((RequestMasks, step i, its rows)) to draft step i: the drafted
        columns it has not consumed, each column of every request at once (``advance_requests``)."""
        while True:
            due = [(m, r) for m, step, r in todo if m.consumed < min(step, m.k)]
            if not due:
                return
            columns: dict = {}  # (each column once, as a list)
            for m, _ in due:
                if m.consumed not in columns:
                    columns[m.consumed] = self._column(m.consumed).tolist()
            advance_requests([(m, columns[m.consumed][r]) for m, r in due])
            for m, _ in due:
                m.consumed += 1

    def _items(self, todo: list, fill: set, bonus: set = frozenset(), handed: bool = False) -> list:
        """The step-record items (``MaskWorkers.step``) of the remote requests of ``todo`` ((RequestMasks,
        step i, its rows)): each request consumes the drafted columns up to draft step i (each column
        shared first: ``_share``; ``handed``: the device hands them over to the workers itself), then
        the bonus where its slot is in ``bonus``, then fills where its slot is in ``fill``."""
        items = []
        for m, step, r in todo:
            last = max(m.consumed, min(step, m.k))
            for j in range(m.consumed, last):
                if handed:
                    self._in_shared.add(j)
                else:
                    self._share(j)
            fills = m.slot in fill
            if last > m.consumed or fills or m.slot in bonus:
                items.append((m.slot, m.consumed, last, r.start, int(m.slot in bonus), int(fills)))
            m.consumed = last
        return items

    def _share(self, j: int) -> None:
        """Column j of the round (j = K_max: the bonus) in the shared ``_handed`` for the mask workers (the
        round hands its draft columns over there; another column is copied there)."""
        if j not in self._in_shared:
            column = self._column(j)
            if not (self.handed and j < self.k_max):
                self._handed[j, : self.rows] = column
            self._in_shared.add(j)

    def end(self, bonus: Tensor, buffers: dict | None = None) -> None:
        """The round's end: every request's drafts consumed, then its bonus token where its budget
        allowed one; with the round's ``buffers``, the checked requests' tokens (``check``)."""
        todo = [(m, m.K, self._rows(slot, m.n)) for slot, m in self.requests.items() if not m.checked]
        local = [t for t in todo if not t[0].remote]
        self._catch_up(local)
        due = {m.slot for m, _, _ in todo if m.budget - m.position > m.K}
        if due and self.k_max not in self._columns:  # (the bonus handed over as a column K_max
            self._columns[self.k_max] = (bonus[: self.rows].cpu(), None)  # (``drafted``), or read now)
        local_due = [(m, r) for m, _, r in local if m.slot in due]
        if local_due:
            tokens = self._column(self.k_max).tolist()
            advance_requests([(m, tokens[r]) for m, r in local_due])
        remote = [t for t in todo if t[0].remote]
        self._prefilled = None
        if remote:  # (the workers catch up while the device resamples)
            if due:
                self._share(self.k_max)
            # and fill the next round's step-0 masks of the requests that draft in it, from the states
            # before the resampling (``_gather`` takes each row's ancestor's), into the buffer that
            # step will use: so the host's reading of this round overlaps that fill
            turn = 0 if self.waits else self._turn ^ 1
            ahead = {m.slot for m, _, _ in remote if m.slot in due and min(m.K, m.budget - m.position - m.K - 1) > 0}
            if ahead and not self.waits and self._uploaded[turn]:
                self._upload_events[turn].synchronize()  # (its last upload is done)
            items = self._items(remote, fill=ahead, bonus=due)
            if items:
                self._pool.step(turn, self.k_max, items)
            if ahead:
                self._prefilled = (turn, {slot: self.requests[slot] for slot in ahead})
        self._ancestors = None
        for m, _, _ in todo:
            m.position += m.K + 1
        self._columns, self._in_shared = {}, set()
        if buffers is not None:  # (after the masked ones: a request it switches to masks is not caught up twice)
            self.check(buffers, self.rows)

    def verdicts_due(self) -> bool:
        """Does the coming round's resampling need the host's verdicts (``smc.host_terms``)? Where a
        request is checked (its tokens), or may reach its budget (a row cut there keeps its weight
        only where llguidance accepts its prefix). Otherwise not: a masked row ends early only with
        EOS, which the masks allow in accepting states alone, and a row left no token dies on the device."""
        return any(m.checked or m.budget - m.position <= m.K + 1 for m in self.requests.values())

    @property
    def masked(self) -> bool:
        """Does a request ask the round for masks (a host point at each step)?"""
        return any(not m.checked for m in self.requests.values())

    def check(self, buffers: dict, rows: int) -> None:
        """After a round's proposal: every checked request's rows advanced by their new tokens
        (``tokens[row, position : n_gen[row]]`` of the rows active in the round)."""
        todo = [(slot, m) for slot, m in self.requests.items() if m.checked]
        if not todo:
            return
        n_gen = buffers["n_gen"][:rows].tolist()
        active = buffers["active"][:rows].tolist()
        lo = min(m.position for _, m in todo)
        hi = max(n_gen) if n_gen else lo
        window = buffers["tokens"][:rows, lo:max(hi, lo)].tolist()
        seqs = {}
        for slot, m in todo:
            r0 = slot * self.n_max
            seqs[slot] = [window[r][m.position - lo : n_gen[r] - lo] if active[r] else None for r in range(r0, r0 + m.n)]
            # (a checked request's constraints are all llguidance's: the scheduler checks only those)
            if m.remote:
                self._pool.check(slot, seqs[slot])
            else:
                m.left = m.check(seqs[slot])
            m.position = max([n_gen[r] for r in range(r0, r0 + m.n) if active[r]], default=m.position)
        if any(m.remote for _, m in todo):  # (the workers check their requests side by side)
            for slot, left in self._pool.checked().items():
                self.requests[slot].left = left
        for slot, m in todo:
            # a particle left the documents: the request takes llguidance's masks from the next round
            # on (its particles all dying in one round would leave it no sample; the choice rests on
            # past rounds only, so the weights stay those of the proposal each round used)
            if any(s is not None and gone for s, gone in zip(seqs[slot], m.left)):
                m.checked, m.switched = False, True

    def dead(self, rows: int) -> Tensor:
        """bool [rows]: the rows of checked requests whose tokens left the documents (this round)."""
        out = torch.zeros(rows, dtype=torch.bool)
        for slot, m in self.requests.items():
            if m.left is not None:
                out[self._rows(slot, m.n)] = torch.tensor(m.left, dtype=torch.bool)
        return out

    def rejects(self, rows: int) -> Tensor:
        """bool [rows]: rows whose request's constraints do not accept the prefix as it stands."""
        out = torch.zeros(rows, dtype=torch.bool)
        remote = [slot for slot, m in self.requests.items() if m.remote]
        answers = self._pool.accepting(remote) if remote else {}
        for slot, m in self.requests.items():
            ok = torch.tensor(answers[slot], dtype=torch.bool) if m.remote else m.accepting()
            out[self._rows(slot, m.n)] = ~ok
        return out

    def fork(self, index) -> None:
        """Resampling: ``index`` [≥ rows] the rows' ancestors (global row numbers)."""
        index = np.asarray(index)
        if self._prefilled is not None:  # (the next step 0's rows, filled before it: ``_gather``)
            self._ancestors = index
        for slot, m in self.requests.items():
            local = index[self._rows(slot, m.n)] - slot * self.n_max
            if (local != np.arange(m.n)).any():
                if m.remote:
                    self._pool.fork(slot, local.tolist())
                else:
                    m.fork(torch.from_numpy(local))
        if self._pool is not None:
            self._pool.send()

