"""Host masks computed in worker processes: the llguidance states of each host-masked request live in
one of a few processes forked from this one, which advance them by the drafted tokens and write their
rows of each step's bitmask into shared memory, side by side and outside this process's GIL.

Why: with several requests on llguidance's path, a round is bound by the host. Each draft step consumes
a token per row and fills a mask per row; in the engine's process the consuming, the unique-key rule
and the Python around them run on its one thread while the device waits for the masks. Spread over
processes, a step costs a process's share of that work, plus a message to each process and its answer.

``HostMasks`` keeps every request's bookkeeping (its position, how many drafts count this round) and
sends the process that holds a request its operations, in one batch per process and point of the
round: advance the request's rows by a token each, fill its rows of shared buffer t, fork its rows
(resampling), say whether its rows accept; for a checked request (the superset path), advance its
rows by the round's tokens and say which left the documents. A batch that fills or asks is answered
when its operations ran; the others are not (an error in them comes back with the next answer). A process keeps the
request in the same ``RequestMasks`` the main process would, over constraints rebuilt from their
grammars (``LLGuidanceConstraint.worker_spec``, ``_rebuilt``), so a step's masks are those of the main
process (the tests compare them bit for bit).

The processes are forked when the first request arrives: they inherit the compiled llguidance
tokenizer and the token texts, which cannot be pickled. They never touch CUDA, and each fills its rows'
masks in its own thread, one row after another (through llguidance's thread pool a cheap mask, most
of a document's, costs several times as much: the processes are the parallelism). The two step
buffers are one anonymous shared mapping, registered with CUDA as pinned memory on a GPU, so the
round uploads the masks from there without blocking.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import pickle
import platform
import signal
import time
import traceback
import warnings
import weakref

import numpy as np
import torch

from ...errors import SMCDecodeError

# a process's mailbox: its control words (one 64-byte line each, so no two processes write one line)
POSTED, TAKEN, DONE, LENGTH, ANSWER = range(5)  # messages posted, taken, done; their byte lengths
LINE = 8  # int64 words a process's control line
IN_CAP, OUT_CAP = 1 << 20, 1 << 16  # mailbox bytes (in, answers); a longer message goes through the pipe
TIMEOUT = 300.0  # seconds a worker may take over one batch (a batch that adds a request compiles its grammar)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's MaskWorkers
MAX_LIVE = 8  # sets of workers kept at once (a set per round shape; beyond: idle ones are stopped)
SPIN = 0.002  # seconds a worker watches its mailbox after a batch before it blocks on its pipe


def _supported() -> str | None:
    """Why this host cannot run mask workers, or None."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return "needs processes forked from this one, which this platform does not offer"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # (the mailboxes are plain shared memory, read in order without fences: x86-64 keeps stores in order)
        return f"passes messages through shared memory without fences, which is sound on x86-64 only (this is {platform.machine()})"
    return None


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
    and the two shared step buffers ``bits`` (int32 [rows, words] each).

    Messages travel through shared memory: each process has a mailbox (a control line and a byte
    area) where this process writes a pickled batch of operations, raises POSTED and writes one byte
    to the process's pipe; the worker, watching POSTED for ``SPIN`` seconds after its last batch
    and then blocked reading that byte, copies the batch out, raises TAKEN, runs it, writes its
    answer and raises DONE, which this process spins on (a step's wait is short). A batch longer
    than the mailbox goes through the pipe after its byte. (Within a round the next step's batch
    comes before a worker stops watching, so it does not wait to be woken; between rounds it sleeps.)"""

    def __init__(self, processes: int, rows: int, words: int, tok, texts: list, pin: bool):
        if processes < 1 or rows < 1:
            raise SMCDecodeError(f"mask workers need at least one process and one row, got {processes} and {rows}")
        why = _supported()
        if why:
            raise SMCDecodeError(f"mask worker processes {why}: pass host_workers=0")
        live = [other for other in list(_LIVE) if not other.closed]
        idle = [other for other in live if not other.where]
        for other in idle[: max(0, len(live) - MAX_LIVE + 1)]:  # (other round shapes' idle workers)
            other.close()
        self.tok, self.rows, self.words = tok, rows, words
        size = rows * words * 4
        self._mem = mmap.mmap(-1, 2 * size)  # anonymous and shared: the forked processes write the same pages
        whole = torch.frombuffer(self._mem, dtype=torch.int32)
        self.bits = [whole[t * rows * words: (t + 1) * rows * words].view(rows, words) for t in (0, 1)]
        self._pinned = None
        if pin:  # (so the masks upload without blocking, as from a pinned tensor)
            err = torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), 2 * size, 0)
            if int(err) != 0:
                raise SMCDecodeError(f"CUDA refused to pin the mask workers' shared buffers (error {int(err)}): "
                                     "pass host_workers=0")
            self._pinned = whole.data_ptr()
        self._box = mmap.mmap(-1, processes * (LINE * 8 + IN_CAP + OUT_CAP))
        self._ctrl = np.frombuffer(self._box, dtype=np.int64, count=processes * LINE).reshape(processes, LINE)
        ctx = multiprocessing.get_context("fork")
        self._conns, self._procs = [], []
        self._finalizer = weakref.finalize(self, _close, self._box, self._ctrl, self._conns, self._procs,
                                           self._pinned)
        try:
            for w in range(processes):
                here, there = ctx.Pipe()
                self._conns.append(here)
                p = ctx.Process(target=_serve, args=(w, here.fileno(), there, self._box, processes, self._mem, rows,
                                                     words, tok, texts), daemon=True, name="smcdecode-masks")
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
        self.where: dict[int, int] = {}  # slot -> its process
        self._rows: dict[int, int] = {}  # slot -> its rows (to place requests where fewest rows are)
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
    def add(self, slot: int, constraints: list, n: int, lane: int) -> None:
        self.remove(slot)
        load = [0] * len(self._procs)
        for s, w in self.where.items():
            load[w] += self._rows[s]
        w = min(range(len(load)), key=load.__getitem__)
        self.where[slot], self._rows[slot] = w, n
        self._queued[w].append(("add", slot, [c.worker_spec() for c in constraints], n, lane))

    def remove(self, slot: int) -> None:
        if slot in self.where:
            self._queued[self.where.pop(slot)].append(("remove", slot))
            del self._rows[slot]

    def clear(self) -> None:
        """Every request dropped: operations not yet sent are dropped too, the processes forget every
        request (and an error left from a failed call), and an answer not yet collected is dropped."""
        self.where.clear()
        self._rows.clear()
        self._queued = [[("reset", None)] for _ in self._procs]
        # (an error of a call that is over is dropped; a dead process: ``usable`` says so)
        with contextlib.suppress(SMCDecodeError):
            self.wait(self.send())

    def advance(self, slot: int, tokens: list) -> None:
        self._queued[self.where[slot]].append(("advance", slot, tokens))

    def fill(self, slot: int, turn: int, row: int) -> None:
        self._queued[self.where[slot]].append(("fill", slot, turn, row))

    def fork(self, slot: int, index: list) -> None:
        self._queued[self.where[slot]].append(("fork", slot, index))

    def check(self, slot: int, seqs: list) -> None:
        """A checked request's round: row i advanced by the tokens ``seqs[i]`` (None: not in the round);
        ``checked`` collects which rows left the documents."""
        self._queued[self.where[slot]].append(("check", slot, seqs))

    def checked(self) -> dict:
        """slot -> list of bool: the rows each checked request's ``check`` found outside the documents."""
        out = {}
        for answers in self.wait(self.send()).values():
            out.update(answers)
        return out

    def accepting(self, slots: list) -> dict:
        """slot -> list of bool: does each row of the request accept (every constraint)?"""
        for s in slots:
            self._queued[self.where[s]].append(("accepting", s))
        out = {}
        for answers in self.wait(self.send()).values():
            out.update(answers)
        return {s: out[s] for s in slots}

    def send(self) -> list[int]:
        """Post every process its queued operations (without waiting for them to run); the processes
        that will answer."""
        asked = []
        for w, ops in enumerate(self._queued):
            if not ops:
                continue
            self._queued[w] = []  # (taken now: a failure below leaves no stale operation queued)
            answer = any(op[0] in ("fill", "accepting", "check", "reset") for op in ops)
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
        start = len(self._procs) * LINE * 8 + w * (IN_CAP + OUT_CAP) + (IN_CAP if answer else 0)
        return memoryview(self._box)[start: start + (OUT_CAP if answer else IN_CAP)]

    def _post(self, w: int, message) -> None:
        self._spin(w, TAKEN, self._posted[w])  # (the mailbox is free once the last message was taken)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._posted[w] += 1
        if len(data) <= IN_CAP:
            self._area(w, False)[: len(data)] = data
            self._ctrl[w, LENGTH] = len(data)
            self._ctrl[w, POSTED] = self._posted[w]
            self._wake(w)
        else:  # (posted first: the worker reads the pipe while this process writes it)
            self._ctrl[w, LENGTH] = -1
            self._ctrl[w, POSTED] = self._posted[w]
            self._wake(w)
            self._conns[w].send_bytes(data)

    def _wake(self, w: int) -> None:
        try:
            os.write(self._conns[w].fileno(), b"!")
        except OSError:
            raise self._ended(w) from None

    def _spin(self, w: int, word: int, target: int) -> None:
        """Wait until process w's control word reaches ``target`` (spinning: the wait is short; a
        process that died, or that has not answered in ``TIMEOUT`` seconds, is an error)."""
        ctrl, i, start = self._ctrl, 0, None
        while ctrl[w, word] < target:
            i += 1
            if i % 20000 == 0:
                if not self._procs[w].is_alive():
                    raise self._ended(w)
                start = start or time.monotonic()
                if time.monotonic() - start > TIMEOUT:
                    raise SMCDecodeError(f"host-mask worker process {self._procs[w].pid} has not answered in "
                                         f"{TIMEOUT:.0f} s; pass host_workers=0 in engine_options to compute the "
                                         "masks in this process")
                time.sleep(0)  # (a long wait: let this process's other threads run)

    def _ended(self, w: int) -> SMCDecodeError:
        p = self._procs[w]
        p.join(1)
        return SMCDecodeError(f"host-mask worker process {p.pid} ended (exit code {p.exitcode}); pass "
                              "host_workers=0 in engine_options to compute the masks in this process")


class _NoModel:
    """The model of a constraint rebuilt in a worker (``_rebuilt``): none; only the engine's
    host-mask operations (start, advance, fill, fork, accepting) apply to it."""

    def __repr__(self) -> str:
        return "no model (a mask worker's copy)"


def _rebuilt(spec: tuple, tok, words: int, keys):
    """The llguidance path of a constraint (``LLGuidanceConstraint.worker_spec``: its class, grammar and
    key rule) compiled for the llguidance tokenizer ``tok`` in a worker: its states, masks and key
    rule are those of the bound constraint it came from. It has no executor: its masks are filled in
    the worker's thread, one row after another, and its rows all come from one lane."""
    from ...potentials.token_bytes import _llguidance

    cls, grammar, key_rule = spec
    c = cls.__new__(cls)
    c._grammar, c.key_rule, c.threads, c.path = grammar, key_rule, 1, "llguidance"
    c._what, c._header_lines = f"{cls.__name__} (in a mask worker)", 0
    template = _llguidance().LLMatcher(tok, grammar, log_level=0)
    if template.is_error():
        raise c._error(template.get_error())
    c._tok, c._template, c._lanes = tok, template, [template]
    c._executor, c._keys, c._words = None, keys if key_rule else None, words
    c.model = _NoModel()
    return c


def _close(box, ctrl, conns, procs, pinned) -> None:
    for w, p in enumerate(procs):
        if p.is_alive():  # (a stop message: POSTED set to -1)
            ctrl[w, POSTED] = -1
            with contextlib.suppress(OSError):  # (it may have ended since: nothing to wake)
                os.write(conns[w].fileno(), b"!")
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.terminate()
    for c in conns:
        c.close()
    if pinned is not None:
        with contextlib.suppress(Exception):  # (at interpreter exit CUDA may be gone already)
            torch.cuda.synchronize()  # (no upload from the buffers still in flight)
            torch.cuda.cudart().cudaHostUnregister(pinned)


def _serve(w: int, ours: int, conn, box, processes: int, mem, rows: int, words: int, tok, texts: list) -> None:
    """A worker process: run the batches of operations posted to its mailbox until told to stop (or
    until its pipe ends: the main process is gone). ``ours``: the main process's end, closed here."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the main process's to handle)
        os.close(ours)
        _loop(w, conn, box, processes, mem, rows, words, tok, texts)
    except BaseException:  # noqa: BLE001 - reported on stderr; the main process sees the exit code
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)  # (no atexit handlers, no CUDA teardown: this process shares the parent's state)


def _loop(w: int, conn, box, processes: int, mem, rows: int, words: int, tok, texts: list) -> None:
    from ...potentials.json_keys import KeyTracker
    from .request_masks import RequestMasks, advance_requests, fill_requests

    torch.set_num_threads(1)
    whole = torch.frombuffer(mem, dtype=torch.int32)
    bits = [whole[t * rows * words: (t + 1) * rows * words].view(rows, words) for t in (0, 1)]
    ctrl = np.frombuffer(box, dtype=np.int64, count=processes * LINE).reshape(processes, LINE)
    start = processes * LINE * 8 + w * (IN_CAP + OUT_CAP)
    inbox = memoryview(box)[start: start + IN_CAP]
    outbox = memoryview(box)[start + IN_CAP: start + IN_CAP + OUT_CAP]
    keys = []  # the vocabulary's KeyTracker, built when a constraint first needs it
    built: dict = {}  # worker_spec -> the rebuilt constraint
    held: dict[int, RequestMasks] = {}
    error, seen = None, 0

    def constraint(spec):
        if spec not in built:
            if spec[2] and not keys:
                keys.append(KeyTracker(texts))
            built[spec] = _rebuilt(spec, tok, words, keys[0] if keys else None)
        return built[spec]

    fd = conn.fileno()
    while True:
        # the next step's batch comes within a draft forward: watch the mailbox a while before sleeping
        # (a batch seen there has its byte in the pipe, or on its way: the read below does not sleep)
        until = time.perf_counter() + SPIN
        while ctrl[w, POSTED] == seen and time.perf_counter() < until:
            pass  # (a busy wait, on purpose: a sleeping process would wake later than the batch comes)
        if not os.read(fd, 1) or ctrl[w, POSTED] < 0:  # (a message's byte; b"": the main process is gone)
            return
        seen += 1
        n = int(ctrl[w, LENGTH])
        data = conn.recv_bytes() if n < 0 else bytes(inbox[:n])
        ctrl[w, TAKEN] = seen
        ops, answer = pickle.loads(data)
        answers = []
        if ops and ops[0][0] == "reset":  # (a new scheduler: every request and a past error forgotten)
            held.clear()
            error = None
        if error is None:
            try:
                fills = []
                for op in ops:
                    kind, slot = op[0], op[1]
                    if kind == "add":
                        held[slot] = RequestMasks([constraint(s) for s in op[2]], op[3], 0, 0, lane=op[4],
                                                  checks=False)
                    elif kind == "remove":
                        held.pop(slot, None)
                    elif kind == "advance":
                        advance_requests([(held[slot], op[2])])
                    elif kind == "fill":
                        turn = op[2]
                        fills.append((held[slot], op[3]))
                    elif kind == "fork":
                        held[slot].fork(torch.tensor(op[2], dtype=torch.long))
                    elif kind == "accepting":
                        answers.append((slot, held[slot].accepting().tolist()))
                    elif kind == "check":
                        answers.append((slot, held[slot].check(op[2])))
                # (a batch's fills come after its advances: every request's rows in one call)
                if fills:  # (one step's: every one into the same buffer)
                    fill_requests([(m, slice(r, r + m.n)) for m, r in fills], bits[turn], rows)
            except Exception as e:  # noqa: BLE001 - reported to the main process with the next answer
                error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        if answer:
            reply = pickle.dumps((error, answers), protocol=pickle.HIGHEST_PROTOCOL)
            if len(reply) <= OUT_CAP:
                outbox[: len(reply)] = reply
                ctrl[w, ANSWER] = len(reply)
            else:
                ctrl[w, ANSWER] = -1
            error = None
        ctrl[w, DONE] = seen
        if answer and ctrl[w, ANSWER] < 0:  # (after DONE: this process reads the pipe once it sees it)
            conn.send_bytes(reply)
