"""The mask worker processes' side of mask_workers.py: the layout of the shared memory (the control
lines, the bell, the step record, the mailboxes), the futex the processes sleep on, and the process
itself (``serve``). A process holds requests' llguidance states, in ``RequestMasks`` over
constraints rebuilt from their grammars (``_rebuilt``), and runs the pickled batches posted to its
mailbox and its items of each step record."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import pickle
import signal
import sys
import time
import traceback

import numpy as np
import torch

# a process's mailbox: its control words (one 64-byte line each, so no two processes write one line):
# batches posted, taken, done, a batch's byte length, its answer's; the last step record done, failed;
# whether the process is asleep on the bell (``MaskWorkers._ring`` wakes the bell only then)
POSTED, TAKEN, DONE, LENGTH, ANSWER, STEP_DONE, STEP_FAIL, ASLEEP = range(8)
LINE = 8  # int64 words a process's control line
# the step record (int64 words, after the control lines and the bell's line): its sequence number (odd
# while written), the step buffer it fills, the bonus column, its items, the host points it spans (0: a
# step; else a round's plan, ``_Worker.plan``), the count of points before them, whether the engine's
# process called the plan off (its sequence number), then each process's batches before it; then per
# item: the process that holds the request, its slot (-1: rows that allow every token), first and last
# column consumed, first row, bonus consumed, the request's rows this process fills (from, to: none if
# equal), and the host point of a plan it belongs to
SEQ, TURN, BONUS, ITEMS, POINTS, BASE, ABORT, PRE = range(8)
ITEM = 9
IN_CAP, OUT_CAP = 1 << 20, 1 << 16  # mailbox bytes (in, answers); a longer message goes through the pipe
SPIN = 0.002  # seconds a worker watches for work after a batch or step before it sleeps on the bell
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # (x86-64 Linux)
_WOKEN = (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR)  # (a futex wait's ordinary ends besides a wake-up)


class _Timespec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def sleep_on(address: int, value: int, seconds: float) -> None:
    """Sleep until the int32 at ``address`` is woken (``wake_all``), at most ``seconds``; at once if
    it no longer holds ``value`` (checked by the kernel as the sleep begins: no wake-up is lost)."""
    ts = _Timespec(int(seconds), int(seconds % 1 * 1e9))
    if _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(value), ctypes.byref(ts),
                     None, 0) == -1 and ctypes.get_errno() not in _WOKEN:
        time.sleep(0.001)  # (futexes refused here, by a sandbox say: poll instead of spinning)


def wake_all(address: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(0x7FFFFFFF), None, None, 0)

def area_start(processes: int, items: int) -> int:
    """Where the mailboxes' byte areas begin: after the control lines, the bell's line and the record
    (of at most ``items`` items)."""
    return (processes + 1) * LINE * 8 + (PRE + processes + ITEM * items) * 8


def views(box, processes: int, items: int) -> tuple:
    """The control lines [processes, LINE], the bell [1] (int32) and the step record of ``box``."""
    ctrl = np.frombuffer(box, dtype=np.int64, count=processes * LINE).reshape(processes, LINE)
    bell = np.frombuffer(box, dtype=np.int32, count=1, offset=processes * LINE * 8)
    record = np.frombuffer(box, dtype=np.int64, count=PRE + processes + ITEM * items, offset=(processes + 1) * LINE * 8)
    return ctrl, bell, record


def sync_words(processes: int) -> int:
    """int64 words of the device's sync lines (``HostMasks``: pinned, in shared memory where there are
    mask workers): line 0 the engine's process's count of host points (word 1: the device gave up
    waiting), line 1 + w worker w's count (a round the workers serve: ``_Worker.plan``), line
    processes + 1 the drafted column handed over last (the device's count of points passed then)."""
    return (processes + 2) * LINE


def flag_word(processes: int) -> int:
    return (processes + 1) * LINE


class _NoModel:
    """The model of a constraint rebuilt in a worker (``_rebuilt``): none; only the engine's
    host-mask operations (start, advance, fill, fork, accepting) apply to it."""

    def __repr__(self) -> str:
        return "no model (a mask worker's copy)"


def _rebuilt(spec: tuple, tok, words: int, keys, texts: list):
    """The llguidance path of a constraint (``LLGuidanceConstraint.worker_spec``: its class, grammar, key
    rule, slices' classes and the schema of its string automata) compiled for the llguidance tokenizer
    ``tok`` (with those slices) in a worker, over the vocabulary's token bytes ``texts``: its states,
    masks and key rule are those of the bound constraint it came from. It has no
    executor: its masks are filled in the worker's thread, one row after another, and its rows all
    come from one lane."""
    from ...potentials.json_strings import StringMasks
    from ...potentials.token_bytes import _llguidance

    cls, grammar, key_rule, classes, strings = spec
    c = cls.__new__(cls)
    c._classes = classes
    c._grammar, c.key_rule, c.threads, c.path = grammar, key_rule, 1, "llguidance"
    c._what, c._header_lines = f"{cls.__name__} (in a mask worker)", 0
    template = _llguidance().LLMatcher(tok, grammar, log_level=0)
    if template.is_error():
        raise c._error(template.get_error())
    c._tok, c._template, c._lanes = tok, template, [template]
    c._executor, c._keys, c._words = None, keys if key_rule else None, words
    c._strings = None if strings is None else StringMasks.of(json.loads(strings), texts, words, grammar)
    c._outline_masks = {}
    c.model = _NoModel()
    return c


def serve(w: int, ours: int, conn, box, processes: int, mem, rows: int, words: int, tok, texts: list, columns,
          parent: int, items: int, sync) -> None:
    """A worker process: run the batches posted to its mailbox and its part of each step record until
    told to stop (or until the main process ``parent`` is gone). ``ours``: the main process's end of
    the pipe, closed here; ``items``: the step record's capacity; ``sync``: the device's sync lines
    (``sync_words``; None: no round is served by the workers)."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the main process's to handle)
        os.close(ours)
        _Worker(w, conn, box, processes, mem, rows, words, tok, texts, columns, items, sync, parent).run()
    except BaseException:  # noqa: BLE001 - reported on stderr; the main process sees the exit code
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)  # (no atexit handlers, no CUDA teardown: this process shares the parent's state)


class _Worker:
    """A worker process: its requests (``RequestMasks`` over rebuilt constraints) and its views of the
    shared memory."""

    def __init__(self, w: int, conn, box, processes: int, mem, rows: int, words: int, tok, texts: list, columns,
                 items: int, sync, parent: int):
        torch.set_num_threads(1)
        self.w, self.conn, self.P, self.rows, self.parent = w, conn, processes, rows, parent
        self.tok, self.texts, self.words = tok, texts, words
        whole = torch.frombuffer(mem, dtype=torch.int32)
        self.bits = [whole[t * rows * words: (t + 1) * rows * words].view(rows, words) for t in (0, 1)]
        self.packed = [b.numpy() for b in self.bits]  # (the same memory as numpy: checked once, not per fill)
        self.ctrl, self.bell, self.record = views(box, processes, items)
        # (the device's sync lines: this process's count of points served, the column handed over last)
        self.sync = None if sync is None else np.frombuffer(sync, dtype=np.int64, count=sync_words(processes))
        self.done_at, self.flag_at = (1 + w) * LINE, flag_word(processes)
        self.columns = np.frombuffer(columns, dtype=np.int64).reshape(-1, rows)
        start = area_start(processes, items) + w * (IN_CAP + OUT_CAP)
        self.inbox = memoryview(box)[start: start + IN_CAP]
        self.outbox = memoryview(box)[start + IN_CAP: start + IN_CAP + OUT_CAP]
        self.keys = []  # the vocabulary's KeyTracker, built when a constraint first needs it
        self.built: dict = {}  # worker_spec -> the rebuilt constraint
        self.sliced: dict = {}  # the slices' classes -> the tokenizer with those slices
        self.held: dict = {}  # slot -> RequestMasks
        self.error = None  # an error not yet reported
        self.seen = self.steps = 0  # batches taken; the last record looked at (its SEQ)

    def run(self) -> None:
        ctrl, w, record, P = self.ctrl, self.w, self.record, self.P
        idle = time.perf_counter()
        while True:
            ring = int(self.bell[0])  # (read before looking for work: a ring after it wakes the sleep below)
            posted = int(ctrl[w, POSTED])
            if posted < 0:
                return
            if posted > self.seen:
                self.batch()
                idle = time.perf_counter()
                continue
            seq = int(record[SEQ])
            if seq > self.steps and seq % 2 == 0:
                n, before = int(record[ITEMS]), int(record[PRE + w])
                turn, bonus, points, base = int(record[TURN]), int(record[BONUS]), int(record[POINTS]), int(record[BASE])
                items = record[PRE + P: PRE + P + ITEM * n].tolist()
                if int(record[SEQ]) != seq or before > self.seen:  # (rewritten meanwhile; batches first)
                    continue
                self.steps = seq
                mine = [items[i + 1: i + ITEM] for i in range(0, len(items), ITEM) if items[i] == w]
                if mine and points:  # (a round's host points: ``plan``)
                    self.plan(mine, points, base, seq)
                    idle = time.perf_counter()
                elif mine:  # (a record names this process only where it has taken every batch before it)
                    self.step(mine, turn, bonus, seq)
                    idle = time.perf_counter()
                continue
            # the next step comes within a draft forward: watch a while before sleeping (a busy wait, on
            # purpose: a sleeping process would wake later than the step comes)
            if time.perf_counter() - idle > SPIN:
                # (the flag is stored before the kernel reads the bell, behind the futex's own barrier: a
                # ring after ``ring`` was read either sees the flag and wakes, or changed the bell)
                ctrl[w, ASLEEP] = 1
                sleep_on(self.bell.ctypes.data, ring, 1.0)
                ctrl[w, ASLEEP] = 0
                if os.getppid() != self.parent:
                    return

    def constraint(self, spec):
        from ...potentials.json_keys import KeyTracker
        from ...potentials.token_bytes import remembered, with_slices

        if spec not in self.built:
            if spec[2] and not self.keys:
                self.keys.append(KeyTracker(self.texts))
            tok = remembered(self.sliced, spec[3], lambda: with_slices(self.tok, spec[3]))
            self.built[spec] = _rebuilt(spec, tok, self.words, self.keys[0] if self.keys else None, self.texts)
        return self.built[spec]

    def step(self, mine: list, turn: int, bonus: int, seq: int) -> None:
        """This process's part of a step record: (slot, first, last, row, bonus?, fill from, fill to,
        point) each: every row consumes, the rows from … to − 1 of the request fill."""
        self.work(mine, turn, bonus)
        if self.error is not None:
            self.ctrl[self.w, STEP_FAIL] = seq
        self.ctrl[self.w, STEP_DONE] = seq

    def plan(self, mine: list, points: int, base: int, seq: int) -> None:
        """This process's part of a round's host points (``MaskWorkers.plan``), in order: before point
        i > 0 it waits for draft column i − 1, which the device hands over once past point i − 1
        (it writes its count of points passed, base + i, into the flag line after the column); after
        point i it counts base + i + 1 in its sync line, which the device waits for with the others'
        (kernels/host.py). A failed point still counts, so the device goes on; the error comes with
        the record's end. Called off (the record's ABORT): it stops counting at once."""
        at: list[list] = [[] for _ in range(points)]
        for item in mine:
            at[item[7]].append(item)
        sync, record, done = self.sync, self.record, self.done_at
        for i, todo in enumerate(at):
            if todo:
                if i and not self._handed(base + i, seq):
                    break
                self.work(todo, 0, 0)
            if record[ABORT] == seq:
                break
            sync[done] = base + i + 1  # (after the masks' stores: x86 keeps stores in order)
        if self.error is not None:
            self.ctrl[self.w, STEP_FAIL] = seq
        self.ctrl[self.w, STEP_DONE] = seq

    def _handed(self, target: int, seq: int) -> bool:
        """Wait until the device's flag line reaches ``target`` (a busy wait: the column comes within a
        draft forward); False if the plan was called off or the engine's process is gone."""
        sync, record, at, i = self.sync, self.record, self.flag_at, 0
        while sync[at] < target:
            if record[ABORT] == seq:
                return False
            i += 1
            if i % 100000 == 0 and os.getppid() != self.parent:
                return False
        return True

    def work(self, mine: list, turn: int, bonus: int) -> None:
        """Items (slot, first, last, row, bonus?, fill from, fill to, point) run: the rows consume, fill
        (slot -1: rows row + from … row + to − 1 allow every token); an error is kept for the answer."""
        from .request_masks import advance_requests, fill_requests

        if self.error is not None:
            return
        try:
            for slot, _, _, row, _, a, end, _ in mine:
                if slot < 0:
                    self.packed[turn][row + a: row + end] = -1
            mine = [(self.held[slot], *rest) for slot, *rest in mine if slot >= 0]
            if not mine:
                return
            cols = self.columns
            for j in range(min(m[1] for m in mine), max(m[2] for m in mine)):
                advance_requests([(m, cols[j, row: row + m.n].tolist())
                                  for m, first, last, row, *_ in mine if first <= j < last])
            due = [(m, cols[bonus, row: row + m.n].tolist()) for m, _, _, row, b, *_ in mine if b]
            if due:
                advance_requests(due)
            fills = [(m.part(a, end), slice(row + a, row + end)) for m, _, _, row, _, a, end, _ in mine if end > a]
            if fills:
                fill_requests(fills, self.bits[turn], self.rows, self.packed[turn])
        except Exception as e:  # noqa: BLE001 - reported to the main process with the next answer
            self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"

    def batch(self) -> None:
        """Take the next batch from the mailbox (or the pipe), run it, answer it if it asks."""
        from .request_masks import RequestMasks

        ctrl, w = self.ctrl, self.w
        self.seen += 1
        n = int(ctrl[w, LENGTH])
        data = self.conn.recv_bytes() if n < 0 else bytes(self.inbox[:n])
        ctrl[w, TAKEN] = self.seen
        ops, answer = pickle.loads(data)
        answers = []
        if ops and ops[0][0] == "reset":  # (a new scheduler: every request and a past error forgotten)
            self.held.clear()
            self.error = None
        if self.error is None:
            try:
                for op in ops:
                    kind, slot = op[0], op[1]
                    if kind == "add":
                        self.held[slot] = RequestMasks([self.constraint(s) for s in op[2]], op[3], 0, 0, lane=op[4],
                                                       checks=False)
                    elif kind == "remove":
                        self.held.pop(slot, None)
                    elif kind == "fork":
                        self.held[slot].fork(torch.tensor(op[2], dtype=torch.long))
                    elif kind == "accepting":
                        answers.append((slot, self.held[slot].accepting().tolist()))
                    elif kind == "check":
                        answers.append((slot, self.held[slot].check(op[2])))
            except Exception as e:  # noqa: BLE001 - reported to the main process with the next answer
                self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        if answer:
            reply = pickle.dumps((self.error, answers), protocol=pickle.HIGHEST_PROTOCOL)
            if len(reply) <= OUT_CAP:
                self.outbox[: len(reply)] = reply
                ctrl[w, ANSWER] = len(reply)
            else:
                ctrl[w, ANSWER] = -1
            self.error = None
        ctrl[w, DONE] = self.seen
        if answer and ctrl[w, ANSWER] < 0:  # (after DONE: this process reads the pipe once it sees it)
            self.conn.send_bytes(reply)
