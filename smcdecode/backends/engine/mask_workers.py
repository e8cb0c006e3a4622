"""Host masks computed in worker processes: the llguidance states of each host-masked request live in
one of a few processes forked from this one, which advance them by the drafted tokens and write their
rows of each step's bitmask into shared memory, side by side and outside this process's GIL.

Why: with several requests on llguidance's path, a round is bound by the host. Each draft step consumes
a token per row and fills a mask per row; in the engine's process the consuming, the unique-key rule
and the Python around them run on its one thread while the device waits for the masks. Spread over
processes, a step costs a process's share of that work, plus one shared record and the answers.

``HostMasks`` keeps every request's bookkeeping (its position, how many drafts count this round). A
round's steps travel as **step records**: one record in shared memory for every process at once,
which says, for each request the step concerns, which drafted columns its rows consume (read by the
processes from the shared buffer the round hands its columns over to), whether they then consume the
bonus column, and whether they fill their rows of shared step buffer t. Nothing is pickled and one
word wakes every process. The other operations (add or remove a request, fork its rows when
resampling, say whether its rows accept, check a checked request's round on the superset path) are
pickled batches, one per process, in that process's mailbox. A batch that asks is answered when it
ran, a record when its processes are done; an error comes back with the next answer or wait. A
process keeps the request in the same ``RequestMasks`` the main process would, over constraints
rebuilt from their grammars (``LLGuidanceConstraint.worker_spec``, ``mask_process._rebuilt``), so a step's masks
are those of the main process (the tests compare them bit for bit).

The processes are forked when the first request arrives: they inherit the compiled llguidance
tokenizer and the token texts, which cannot be pickled. They never touch CUDA, and each fills its rows'
masks in its own thread, one row after another (through llguidance's thread pool a cheap mask, most
of a document's, costs several times as much: the processes are the parallelism). The two step
buffers and the columns are anonymous shared mappings, registered with CUDA as pinned memory on a
GPU, so the round uploads the masks from there and copies its columns there without blocking.
This module is the engine's side; mask_process.py is the processes' side and the memory's layout.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import pickle
import platform
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from ...errors import SMCDecodeError
from .mask_process import (
    ABORT,
    ANSWER,
    ASLEEP,
    BASE,
    BONUS,
    DONE,
    IN_CAP,
    ITEM,
    ITEMS,
    LENGTH,
    OUT_CAP,
    POINTS,
    POSTED,
    PRE,
    SEQ,
    STEP_DONE,
    STEP_FAIL,
    TAKEN,
    TURN,
    area_start,
    serve,
    views,
    wake_all,
)

TIMEOUT = 300.0  # seconds a worker may take over one batch (a batch that adds a request compiles its grammar)
ABORT_S = 5.0  # seconds a worker may take to stop serving a plan called off (it stops at its next check)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's MaskWorkers
MAX_LIVE = 8  # sets of workers kept at once (a set per round shape; beyond: idle ones are stopped)


def _supported() -> str | None:
    """Why this host cannot run mask workers, or None."""
    if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return "need Linux (processes forked from this one, woken through a futex)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # (the mailboxes are plain shared memory, read in order without fences: x86-64 keeps stores in order)
        return f"pass messages through shared memory without fences, which is sound on x86-64 only (this is {platform.machine()})"
    return None


def shared_buffer(nbytes: int, pin: bool, owner=None) -> mmap.mmap:
    """An anonymous shared mapping of ``nbytes`` (processes forked later write the same pages) and,
    with ``pin``, registered with CUDA as pinned memory (copies to and from it do not block) until
    ``owner`` (any object that takes weak references) is collected. The unpinning hangs on the owner
    and holds the mapping, so CUDA unregisters the range while it is still mapped, as CUDA asks (an
    mmap's own finalizer runs after its pages are unmapped)."""
    mem = mmap.mmap(-1, max(nbytes, 1))
    if not pin:
        return mem
    if owner is None:
        raise ValueError("shared_buffer: a pinned buffer needs an owner (its unpinning hangs on it)")
    address = torch.frombuffer(mem, dtype=torch.uint8).data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(address, len(mem), 0)
    if int(err) != 0:
        raise SMCDecodeError(f"CUDA refused to pin {len(mem)} bytes of host memory for the host masks' buffers "
                             f"(error {int(err)}): the engine's host-mask constraints need it on a GPU")
    weakref.finalize(owner, _unpin, address, mem)
    return mem


# (a round waiting on the device for the host's masks is being served: ``HostMasks.serve``; a buffer
# freed meanwhile waits to be unpinned, since waiting for the device then would wait for this host)
_SERVING = [0]
_DEFERRED: list = []  # (address, mapping): the mapping held until it is unpinned


def _unpin(address: int, mem: mmap.mmap) -> None:
    """Unregister the pinned ``mem`` at ``address`` (still mapped: this holds it) once the device is
    done with it; while a round is served, later (``unpin_deferred``)."""
    if _SERVING[0]:
        _DEFERRED.append((address, mem))
        return
    with contextlib.suppress(Exception):  # (at interpreter exit CUDA may be gone already)
        torch.cuda.synchronize()  # (no copy to or from the buffer still in flight)
    err = 0
    with contextlib.suppress(Exception):
        err = int(torch.cuda.cudart().cudaHostUnregister(address))
    if err:
        warnings.warn(f"CUDA refused to unpin {len(mem)} bytes of the host masks' buffers (error {err}); the next "
                      "CUDA call in this thread may report that error", RuntimeWarning, stacklevel=2)


def unpin_deferred() -> None:
    """Unpin the buffers freed while a round was being served (``_SERVING``)."""
    while _DEFERRED:
        _unpin(*_DEFERRED.pop())


def _cores() -> int:
    """The cores this process may run on (its affinity: a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers(device) -> int:
    """How many mask processes the engine starts by default: on a GPU host of eight or more cores, one
    per two cores, at most 8 (each uses one core; the others are left to this process and the
    device's driver); none on a CPU (its cores run the models) or where they cannot run
    (``_supported``)."""
    cores = _cores()
    if torch.device(device).type != "cuda" or cores < 8 or _supported() is not None:
        return 0
    return min(8, cores // 2)


def check_workers(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SMCDecodeError(f"engine option host_workers must be an integer >= 0 (0: masks in this process) "
                             f"or None (the default for the device), got {value!r}")
    why = _supported() if value else None
    if why:
        raise SMCDecodeError(f"host_workers={value}: mask worker processes {why}; pass host_workers=0")
    return value


class MaskWorkers:
    """``processes`` forked processes that hold requests' llguidance states (see the module docstring),
    the two step buffers ``bits`` (int32 [rows, words] each, over the shared mapping ``bits`` its owner
    gives: ``shared_buffer``), and ``columns``: a shared mapping of int64 [K + 1, rows], where the
    round's drafted columns and bonus are.

    Batches travel through shared memory: each process has a mailbox (a control line and a byte area)
    where this process writes a pickled batch of operations and raises POSTED; step records have one
    area for all. After either, this process bumps the bell, a shared word the processes sleep on (a
    futex), and wakes the processes asleep on it, if any (each flags its sleep in its control line).
    A process, watching its mailbox and the record for ``SPIN`` seconds after its last work and then
    asleep on the bell, runs a batch or its part of a record, writes its answer and raises DONE
    (STEP_DONE), which this process spins on (a step's wait is short). A batch longer than the
    mailbox goes through the pipe. The order holds both ways: a record names each process's
    batches before it, which run first, and a batch goes to a process only once the process finished
    the record before it."""

    def __init__(self, processes: int, rows: int, words: int, tok, texts: list, columns: mmap.mmap, bits: mmap.mmap,
                 sync: mmap.mmap | None = None, points: int = 1):
        if processes < 1 or rows < 1:
            raise SMCDecodeError(f"mask workers need at least one process and one row, got {processes} and {rows}")
        why = _supported()
        if why:
            raise SMCDecodeError(f"mask worker processes {why}: pass host_workers=0")
        live = [other for other in list(_LIVE) if not other.closed]
        idle = [other for other in live if not other.where and not other._pending]
        for other in idle[: max(0, len(live) - MAX_LIVE + 1)]:  # (other round shapes' idle workers)
            other.close()
        self.tok, self.rows, self.words = tok, rows, words
        if len(bits) < 2 * rows * words * 4:
            raise SMCDecodeError(f"the step buffers' mapping holds {len(bits)} bytes, less than two of {rows} rows "
                                 f"of {words} words")
        self._mem = bits  # (its owner pinned it, if at all, and unpins it)
        whole = torch.frombuffer(self._mem, dtype=torch.int32)
        self.bits = [whole[t * rows * words: (t + 1) * rows * words].view(rows, words) for t in (0, 1)]
        # (a record holds a step's items, or a round's plan: up to ``points`` host points, each with an
        # item per row at most and one for the rows no request constrains)
        self._items = (rows + 1) * max(points, 1)
        self._box = mmap.mmap(-1, area_start(processes, self._items) + processes * (IN_CAP + OUT_CAP))
        self._ctrl, self._bell, self._record = views(self._box, processes, self._items)
        self._asleep, self._fence = self._ctrl[:, ASLEEP], threading.Lock()
        ctx = multiprocessing.get_context("fork")
        self._conns, self._procs = [], []
        self._finalizer = weakref.finalize(self, _close, self._ctrl, self._bell, self._conns, self._procs)
        try:
            for w in range(processes):
                here, there = ctx.Pipe()
                self._conns.append(here)
                p = ctx.Process(target=serve, args=(w, here.fileno(), there, self._box, processes, self._mem, rows,
                                                     words, tok, texts, columns, os.getpid(), self._items, sync),
                                daemon=True, name="smcdecode-masks")
                with warnings.catch_warnings():  # (Python warns of forking a process with threads; the child
                    warnings.simplefilter("ignore", DeprecationWarning)  # runs llguidance and numpy only)
                    p.start()
                there.close()
                self._procs.append(p)
        except BaseException:
            self.close()
            raise
        self._queued: list[list] = [[] for _ in range(processes)]
        self._posted = [0] * processes
        self._owed = [0] * processes  # the message whose answer each process owes (0: none)
        self._steps, self._stepping = 0, []  # records written; the processes the last one asks, until done
        self._planning, self._planned = False, []  # is the last record a round's plan not yet over; its processes
        self.where: dict[int, list] = {}  # slot -> its processes, each with the rows it fills: (w, first, end)
        self._pending: dict[int, tuple] = {}  # slot -> (specs, n, lane, share): added, placed at the next send
        _LIVE.add(self)

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def usable(self) -> bool:
        """Not closed, and every process alive (after a Ctrl-C or a crash: start new ones)."""
        return self._finalizer.alive and all(p.is_alive() for p in self._procs)

    # -- operations (queued; ``send`` sends them, ``wait`` collects the answers) --
    def add(self, slot: int, constraints: list, n: int, lane: int, share: bool = True) -> None:
        """Hold a request of ``n`` rows (placed with the other requests added before the next send);
        ``share`` False: in one process (a request whose rows fill no masks, checked after its rounds)."""
        self.remove(slot)
        self._pending[slot] = ([c.worker_spec() for c in constraints], n, lane, share)

    def _place(self) -> None:
        """Place the requests added since the last send. Processes that hold no request are shared out
        among them: a request given k such processes is cut into k blocks of rows. A process given a
        block holds all the request's rows' states and consumes every row's tokens (cheap), but fills
        the masks (dear) of its block only. Where no process is free (or the request fills no masks),
        a request goes whole to the process that fills the fewest rows. So one request alone is shared
        by every process, eight requests on eight processes take one each, and requests that come one
        at a time do not spread over processes that are busy already."""
        if not self._pending:
            return
        P, pending = len(self._procs), self._pending
        self._pending = {}
        load, holds = [0] * P, [0] * P
        for held in self.where.values():
            for w, a, b in held:
                load[w] += b - a
                holds[w] += 1
        free = [w for w in range(P) if not holds[w]]
        shared = [slot for slot, (_, n, _, share) in pending.items() if share and n > 1][: len(free)]
        given = {slot: free[i * len(free) // len(shared): (i + 1) * len(free) // len(shared)]
                 for i, slot in enumerate(shared)}  # (slot -> the free processes it is cut over)
        for slot in [*shared, *(s for s in pending if s not in given)]:
            specs, n, lane, _ = pending[slot]
            ws = given.get(slot, [])[:n]
            if ws:
                cut = [n * k // len(ws) for k in range(len(ws) + 1)]
                blocks = [(w, cut[k], cut[k + 1]) for k, w in enumerate(ws)]
            else:
                blocks = [(min(range(P), key=lambda w: (load[w], w)), 0, n)]
            self.where[slot] = blocks
            for w, a, b in blocks:
                load[w] += b - a
                holds[w] += 1
                self._queued[w].append(("add", slot, specs, n, lane))

    def _held(self, slot: int) -> list:
        self._place()
        return self.where[slot]

    def remove(self, slot: int) -> None:
        self._pending.pop(slot, None)
        for w, _, _ in self.where.pop(slot, ()):
            self._queued[w].append(("remove", slot))

    def clear(self) -> None:
        """Every request dropped: operations not yet sent are dropped too, the processes forget every
        request (and an error left from a failed call), and an answer not yet collected is dropped.
        The reset is posted, not waited for: a new call's scheduler clears its host before its
        prefill, which the processes' reset then overlaps (its answer, owed, is collected before the
        next operation that asks for one)."""
        self.where.clear()
        self._pending.clear()
        self._queued = [[] for _ in self._procs]
        # (an error of a call that is over is dropped; a dead process: ``usable`` says so)
        with contextlib.suppress(SMCDecodeError):
            self.step_wait()  # (a record still running goes before the reset)
        self._queued = [[("reset", None)] for _ in self._procs]
        with contextlib.suppress(SMCDecodeError):
            self.send()

    def settle(self) -> None:
        """Send the operations queued and wait until the processes given requests since have added
        them (each compiles its grammar there): before a round whose device waits for the masks."""
        self._place()
        adding = [w for w, ops in enumerate(self._queued) if any(op[0] == "add" for op in ops)]
        for w in adding:
            self._queued[w].append(("report", None))
        if adding:
            self.wait(self.send())

    def fork(self, slot: int, index: list) -> None:
        for w, _, _ in self._held(slot):
            self._queued[w].append(("fork", slot, index))

    def check(self, slot: int, seqs: list) -> None:
        """A checked request's round: row i advanced by the tokens ``seqs[i]`` (None: not in the round);
        ``checked`` collects which rows left the documents (every process that holds it checks: the
        states stay the same in each)."""
        for w, _, _ in self._held(slot):
            self._queued[w].append(("check", slot, seqs))

    def checked(self) -> dict:
        """slot -> list of bool: the rows each checked request's ``check`` found outside the documents."""
        out = {}
        for answers in self.wait(self.send()).values():
            out.update(answers)
        return out

    def accepting(self, slots: list) -> dict:
        """slot -> list of bool: does each row of the request accept (every constraint)?"""
        for s in slots:  # (the first process that holds it answers: they hold the same states)
            self._queued[self._held(s)[0][0]].append(("accepting", s))
        out = {}
        for answers in self.wait(self.send()).values():
            out.update(answers)
        return {s: out[s] for s in slots}

    def step(self, turn: int, bonus: int, items: list) -> None:
        """Write a step record: for each of ``items`` (slot, first, last, row, bonus?, fill?) the
        request's rows (from ``row``) consume columns first … last − 1 of ``columns`` one by one, then,
        where ``bonus?`` is 1, column ``bonus``, then, where ``fill?`` is 1, write their masks into step
        buffer ``turn`` (each process that holds the request its block of rows). Returns at once;
        ``step_wait`` waits for it."""
        held = [(w, slot, first, last, row, b, a if fill else 0, end if fill else 0, 0)
                for slot, first, last, row, b, fill in items for w, a, end in self._held(slot)]
        self._write(turn, bonus, 0, 0, held)

    def plan(self, base: int, points: int, items: list) -> list[int]:
        """Write a round's plan: its ``points`` host points in one record, which the processes serve on
        their own (``mask_process._Worker.plan``). ``items``: (slot, first, last, row, bonus?, fill?,
        point) as for ``step`` (into step buffer 0), and (-1, 0, 0, row, 0, n, point) for the n rows
        from ``row`` that allow every token at that point (written by a process the point concerns);
        ``base``: the count of points before the round's first. Returns the processes it asks (each
        counts every point in its sync line); ``step_wait`` waits for them, ``abort`` calls it off."""
        held = [(w, slot, first, last, row, b, a if fill else 0, end if fill else 0, point)
                for slot, first, last, row, b, fill, point in items if slot >= 0 for w, a, end in self._held(slot)]
        for _, _, _, row, _, n, point in (i for i in items if i[0] < 0):
            w = next((h[0] for h in held if h[8] == point), held[0][0] if held else 0)
            held.append((w, -1, 0, 0, row, 0, 0, n, point))
        self._write(0, 0, points, base, held)
        self._planning, self._planned = True, self._stepping
        return self._stepping

    def abort(self) -> None:
        """Call off a plan in flight: its processes stop counting points (each says so at once, or has
        died; one that does neither within ABORT_S is stopped with the others: it may count no more)."""
        if not self._planning:
            return
        self._record[ABORT] = 2 * self._steps
        self._stepping, self._planning = [], False
        for w in self._planned:
            try:
                self._spin(w, STEP_DONE, 2 * self._steps, ABORT_S)
            except SMCDecodeError:
                if self._procs[w].is_alive():
                    self.close()
                    return

    def _write(self, turn: int, bonus: int, points: int, base: int, held: list) -> None:
        """Write a record of ``held`` items (process, slot, first, last, row, bonus?, from, to, point)."""
        if len(held) > self._items:
            raise SMCDecodeError(f"a step record of {len(held)} items, more than the {self._items} it holds")
        self.send()  # (the batches queued before it go first)
        self.step_wait()  # (the record's area is rewritten: the last record done)
        rec, P = self._record, len(self._procs)
        self._steps += 1
        rec[SEQ] = 2 * self._steps - 1  # (odd: being written)
        rec[TURN], rec[BONUS], rec[ITEMS], rec[POINTS], rec[BASE], rec[ABORT] = turn, bonus, len(held), points, base, 0
        rec[PRE: PRE + P] = self._posted
        rec[PRE + P: PRE + P + ITEM * len(held)] = np.asarray(held, dtype=np.int64).reshape(-1)
        rec[SEQ] = 2 * self._steps
        self._stepping = sorted({item[0] for item in held})
        self._ring()

    def step_wait(self) -> None:
        """Wait for the processes of the last step record; an error one of them met is raised here."""
        asked, self._stepping = self._stepping, []
        for w in asked:
            self._spin(w, STEP_DONE, 2 * self._steps)
        self._planning = False  # (a plan is over once every process it asks is done: not before)
        failed = [w for w in asked if self._ctrl[w, STEP_FAIL] == 2 * self._steps]
        if failed:  # (the error itself comes with an answer)
            for w in failed:
                self._queued[w].append(("report", None))
            self.wait(self.send())

    def send(self) -> list[int]:
        """Post every process its queued operations (without waiting for them to run); the processes
        that will answer."""
        self._place()
        if self._stepping and any(self._queued[w] for w in self._stepping):
            self.step_wait()  # (a batch after a record runs after it)
        asked = []
        for w, ops in enumerate(self._queued):
            if not ops:
                continue
            self._queued[w] = []  # (taken now: a failure below leaves no stale operation queued)
            answer = any(op[0] in ("accepting", "check", "reset", "report") for op in ops)
            if answer and self._owed[w]:  # (one answer at a time, its area holds one: an answer left
                self.wait([w])             # uncollected by a step that raised is collected and dropped)
            self._post(w, (ops, answer))
            if answer:
                self._owed[w] = self._posted[w]
                asked.append(w)
        return asked

    def wait(self, asked: list[int] | None = None) -> dict:
        """Collect the answers owed (by ``asked``, or by every process): process -> its answers."""
        out = {}
        for w in range(len(self._procs)) if asked is None else asked:
            if not self._owed[w]:
                continue
            self._spin(w, DONE, self._owed[w])
            self._owed[w] = 0
            n = int(self._ctrl[w, ANSWER])
            error, answers = pickle.loads(self._conns[w].recv_bytes() if n < 0 else self._area(w, True)[:n])
            if error is not None:
                raise SMCDecodeError(f"a host-mask worker process failed: {error}")
            out[w] = answers
        return out

    def _area(self, w: int, answer: bool) -> memoryview:
        start = area_start(len(self._procs), self._items) + w * (IN_CAP + OUT_CAP) + (IN_CAP if answer else 0)
        return memoryview(self._box)[start: start + (OUT_CAP if answer else IN_CAP)]

    def _post(self, w: int, message) -> None:
        self._spin(w, TAKEN, self._posted[w])  # (the mailbox is free once the last message was taken)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._posted[w] += 1
        large = len(data) > IN_CAP
        if not large:
            self._area(w, False)[: len(data)] = data
        self._ctrl[w, LENGTH] = -1 if large else len(data)
        self._ctrl[w, POSTED] = self._posted[w]
        self._ring()
        if large:  # (posted first: the worker reads the pipe while this process writes it)
            try:
                self._conns[w].send_bytes(data)
            except OSError:
                raise self._ended(w) from None

    def _ring(self) -> None:
        """Bump the bell and wake the processes asleep on it (after a batch or a record is posted), if
        any is: a process watching for work sees the post itself, and a wake-up is a system call."""
        self._bell[0] = (int(self._bell[0]) + 1) & 0x7FFFFFFF
        # a fence (a lock's atomic instruction) between the bell's store and the flags' load: a process
        # that raised its flag after this load sees the new bell in its futex and does not sleep
        self._fence.acquire()
        self._fence.release()
        if self._asleep.any():
            wake_all(self._bell.ctypes.data)

    def _spin(self, w: int, word: int, target: int, limit: float = TIMEOUT) -> None:
        """Wait until process w's control word reaches ``target`` (spinning: the wait is short; a
        process that died, or that has not answered in ``limit`` seconds, is an error)."""
        ctrl, i, start = self._ctrl, 0, None
        while ctrl[w, word] < target:
            i += 1
            if i % 20000 == 0:
                if not self._procs[w].is_alive():
                    raise self._ended(w)
                start = start or time.monotonic()
                if time.monotonic() - start > limit:
                    raise SMCDecodeError(f"host-mask worker process {self._procs[w].pid} has not answered in "
                                         f"{limit:.0f} s; pass host_workers=0 in engine_options to compute the "
                                         "masks in this process")
                time.sleep(0)  # (a long wait: let this process's other threads run)

    def _ended(self, w: int) -> SMCDecodeError:
        p = self._procs[w]
        p.join(1)
        return SMCDecodeError(f"host-mask worker process {p.pid} ended (exit code {p.exitcode}); pass "
                              "host_workers=0 in engine_options to compute the masks in this process")



def _close(ctrl, bell, conns, procs) -> None:
    for w, p in enumerate(procs):
        if p.is_alive():  # (a stop message: POSTED set to -1)
            ctrl[w, POSTED] = -1
    bell[0] = (int(bell[0]) + 1) & 0x7FFFFFFF
    wake_all(bell.ctypes.data)
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.terminate()
    for c in conns:
        c.close()
