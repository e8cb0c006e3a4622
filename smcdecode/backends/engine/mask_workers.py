"""Host masks computed in worker processes: the llguidance states of each host-masked request live in
one of a few processes forked from this one, which advance them by the drafted tokens and write their
rows of each step's bitmask into shared memory, side by side and outside this process's GIL.

Why: with several requests on llguidance's path, a round is bound by the host. Each draft step consumes
a token per row and fills a mask per row, and the consuming, the unique-key rule and the Python around
them ran on the engine's one thread, while the device waited for the masks. Spread over processes,
a step costs about one request's share of that work, plus a message to each process and its answer.

``HostMasks`` keeps every request's bookkeeping (its position, how many drafts count this round) and
sends the process that holds a request its operations, in one batch per process and point of the
round: advance the request's rows by a token each, fill its rows of shared buffer t, fork its rows
(resampling), say whether its rows accept. A batch that fills or asks is answered when its operations
ran; the others are not (an error in them comes back with the next answer). A process keeps the
request in the same ``RequestMasks`` the main process would, over constraints rebuilt from their
grammars (``LLGuidanceConstraint.rebuilt``), so a step's masks are those of the main process (the
tests compare them bit for bit).

The processes are forked when the first request arrives: they inherit the compiled llguidance
tokenizer and the token texts, which cannot be pickled. They never touch CUDA; their llguidance thread
pools are their own. The two step buffers are one anonymous shared mapping, registered with CUDA as
pinned memory on a GPU, so the round uploads the masks from there without blocking.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import traceback
import warnings
import weakref

import torch

from ...errors import SMCDecodeError


def default_workers(device) -> int:
    """How many mask processes the engine starts by default: on a GPU with four or more cores, one per
    two cores, at most 8 (a round's requests seldom number more); none on a CPU (its cores run the
    models) or where processes cannot be forked."""
    cores = os.cpu_count() or 1
    if torch.device(device).type != "cuda" or cores < 4 or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    return min(8, cores // 2)


def check_workers(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SMCDecodeError(f"engine option host_workers must be an integer >= 0 (0: masks in this process) "
                             f"or None (the default for the device), got {value!r}")
    if value and "fork" not in multiprocessing.get_all_start_methods():
        raise SMCDecodeError(f"host_workers={value} needs processes forked from this one, which this platform "
                             "does not offer: pass host_workers=0")
    return value


class MaskWorkers:
    """``processes`` forked processes that hold requests' llguidance states (see the module docstring),
    and the two shared step buffers ``bits`` (int32 [rows, words] each)."""

    def __init__(self, processes: int, rows: int, words: int, tok, texts: list, pin: bool):
        if processes < 1 or rows < 1:
            raise SMCDecodeError(f"mask workers need at least one process and one row, got {processes} and {rows}")
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
        threads = max(1, (os.cpu_count() or 1) // (2 * processes))  # (each process's llguidance pool)
        ctx = multiprocessing.get_context("fork")
        self._conns, self._procs = [], []
        for _ in range(processes):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(there, self._mem, rows, words, tok, texts, threads),
                            daemon=True, name="smcdecode-masks")
            with warnings.catch_warnings():  # (Python warns of forking a process with threads; the child
                warnings.simplefilter("ignore", DeprecationWarning)  # runs llguidance and numpy only)
                p.start()
            there.close()
            self._conns.append(here)
            self._procs.append(p)
        self._queued: list[list] = [[] for _ in range(processes)]
        self._owed = [0] * processes  # answers each process owes
        self.where: dict[int, int] = {}  # slot -> its process
        self._rows: dict[int, int] = {}  # slot -> its rows (to place requests where fewest rows are)
        self._finalizer = weakref.finalize(self, _close, self._conns, self._procs, self._pinned, self._mem)

    def close(self) -> None:
        self._finalizer()

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
        for slot in list(self.where):
            self.remove(slot)

    def advance(self, slot: int, tokens: list) -> None:
        self._queued[self.where[slot]].append(("advance", slot, tokens))

    def fill(self, slot: int, turn: int, row: int) -> None:
        self._queued[self.where[slot]].append(("fill", slot, turn, row))

    def fork(self, slot: int, index: list) -> None:
        self._queued[self.where[slot]].append(("fork", slot, index))

    def accepting(self, slots: list) -> dict:
        """slot -> list of bool: does each row of the request accept (every constraint)?"""
        for s in slots:
            self._queued[self.where[s]].append(("accepting", s))
        answers = self.wait(self.send())
        out = {}
        for s in slots:
            out[s] = answers[self.where[s]].pop(0)
        return out

    def send(self) -> list[int]:
        """Send every process its queued operations (without waiting); the processes that will answer."""
        asked = []
        for w, ops in enumerate(self._queued):
            if not ops:
                continue
            answer = any(op[0] in ("fill", "accepting") for op in ops)
            try:
                self._conns[w].send((ops, answer))
            except (BrokenPipeError, OSError):
                raise self._ended(w) from None
            self._queued[w] = []
            if answer:
                self._owed[w] += 1
                asked.append(w)
        return asked

    def wait(self, asked: list[int] | None = None) -> dict:
        """Collect the answers owed (by ``asked``, or by every process): process -> its answers."""
        out = {}
        for w in range(len(self._procs)) if asked is None else asked:
            while self._owed[w]:
                try:
                    error, answers = self._conns[w].recv()
                except (EOFError, OSError):
                    raise self._ended(w) from None
                self._owed[w] -= 1
                if error is not None:
                    raise SMCDecodeError(f"a host-mask worker process failed: {error}")
                out.setdefault(w, []).extend(answers)
        return out

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


def _rebuilt(spec: tuple, tok, words: int, keys, executor, threads: int):
    """The llguidance path of a constraint (``LLGuidanceConstraint.worker_spec``: its class, grammar and
    key rule) compiled for the llguidance tokenizer ``tok`` in a worker: its states, masks and key
    rule are those of the bound constraint it came from."""
    from ...potentials.token_bytes import _llguidance

    cls, grammar, key_rule = spec
    c = cls.__new__(cls)
    c._grammar, c.key_rule, c.threads, c.path = grammar, key_rule, threads, "llguidance"
    c._what, c._header_lines = f"{cls.__name__} (in a mask worker)", 0
    template = _llguidance().LLMatcher(tok, grammar, log_level=0)
    if template.is_error():
        raise c._error(template.get_error())
    c._tok, c._template, c._lanes = tok, template, [template]
    c._executor, c._keys, c._words = executor, keys if key_rule else None, words
    c.model = _NoModel()
    return c


def _close(conns, procs, pinned, mem) -> None:
    for c in conns:
        try:
            c.send(None)
            c.close()
        except OSError:
            pass
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.terminate()
    if pinned is not None:
        try:
            torch.cuda.cudart().cudaHostUnregister(pinned)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
            pass


def _serve(conn, mem, rows: int, words: int, tok, texts: list, threads: int) -> None:
    """A worker process: run the batches of operations it is sent until told to stop."""
    try:
        _loop(conn, mem, rows, words, tok, texts, threads)
    finally:
        os._exit(0)  # (no atexit handlers, no CUDA teardown: this process shares the parent's state)


def _loop(conn, mem, rows: int, words: int, tok, texts: list, threads: int) -> None:
    from ...potentials.grammar import fill_bits_together
    from ...potentials.json_keys import KeyTracker
    from ...potentials.token_bytes import _llguidance
    from .request_masks import RequestMasks, advance_requests

    torch.set_num_threads(1)
    executor = _llguidance().LLExecutor(threads)
    whole = torch.frombuffer(mem, dtype=torch.int32)
    bits = [whole[t * rows * words: (t + 1) * rows * words].view(rows, words) for t in (0, 1)]
    keys = []  # the vocabulary's KeyTracker, built when a constraint first needs it
    built: dict = {}  # worker_spec -> the rebuilt constraint
    held: dict[int, RequestMasks] = {}
    error = None

    def constraint(spec):
        if spec not in built:
            if spec[2] and not keys:
                keys.append(KeyTracker(texts))
            built[spec] = _rebuilt(spec, tok, words, keys[0] if keys else None, executor, threads)
        return built[spec]

    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        ops, answer = message
        answers = []
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
                        fills.append((held[slot], bits[op[2]], op[3]))
                    elif kind == "fork":
                        held[slot].fork(torch.tensor(op[2], dtype=torch.long))
                    elif kind == "accepting":
                        answers.append(held[slot].accepting().tolist())
                # (a batch's fills come after its advances: every request's rows in one call)
                for out in {id(b): b for _, b, _ in fills}.values():
                    shared = []
                    mine = [(m, slice(r, r + m.n)) for m, b, r in fills if b is out]
                    for m, r in mine:
                        m.fill(out, r, shared)
                    if shared:
                        fill_bits_together(shared, out, rows)
                    for m, r in mine:
                        if len(m.constraints) > 1:
                            m.restrict(out[r])
            except Exception as e:  # noqa: BLE001 - reported to the main process with the next answer
                error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        if answer:
            conn.send((error, answers))
            error = None
