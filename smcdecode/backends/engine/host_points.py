"""The host points of a round launched whole on a GPU (``HostMasks``, which this mixin is part of): the
round's code that hands draft columns over and waits on the device for each point's masks, and the
host's side, which writes each point's masks and counts it.

Two ways to serve a round's points:

- **by the engine's process** (``_post``): at each point it waits for the drafted column, has the
  masks computed (by itself, or by the mask workers through a step record) and raises its count;
- **by the mask workers** (``_plan``), where every masked request of the round is theirs: the engine's
  process writes one record with all the round's points (their items are known before any token:
  each request's bookkeeping), and each worker serves its items point after point on its own. The
  device writes each drafted column into host memory and then, behind a system-wide fence, its count
  of points passed into a flag line (``kernels.host.hand_over``); a worker waits for that flag
  instead of the engine's process waiting on an event and posting a record, and after each point
  it raises its own count, which the device waits for with the others (``kernels.host.wait_for_host``
  with one count per party). So the engine's process is off the path between a column and the next
  point's masks; it waits for the last point (the bonus masks say whether a row goes on).

The counts: line 0 holds the engine's process's (and the word the device sets when it gave up),
line 1 + w worker w's; the engine's process writes every count when it serves a round itself, its
own and the other workers' when the workers serve it (``mask_process.sync_words``).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError
from .graphs import no_collection
from .mask_process import LINE, flag_word, sync_words
from .mask_workers import _SERVING, shared_buffer, unpin_deferred


def _runs(free: np.ndarray) -> list[tuple[int, int]]:
    """The runs of True in the bool vector ``free``: (first, end) each."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], free.view(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


class HostPoints:
    """The host points of ``HostMasks`` (see the module docstring)."""

    def _init_points(self, pin: bool = True) -> None:
        """The sync lines (pinned, ``pin`` False: for a test that plays the device on the CPU; shared with
        the mask workers where there are any), the device's count."""
        P = self.workers
        if P:
            self._syncmem = shared_buffer(8 * sync_words(P), pin, self)
            self._posted = torch.frombuffer(self._syncmem, dtype=torch.long)
        else:
            self._posted = torch.zeros(sync_words(0), dtype=torch.long, pin_memory=pin)
        self._posted_np = self._posted.numpy()  # (written as plain stores, in order after the masks)
        self._counts = self._posted_np[: (P + 1) * LINE: LINE]  # every party's count of points
        self._flag = self._posted[flag_word(P):]  # the column the device handed over last (its count then)
        self._seen = torch.zeros(1, dtype=torch.long, device=self.device)  # points the device passed
        self._count = 0
        self._fence = threading.Lock()
        self._releasing = False

    def hand_over(self, i: int, tokens: Tensor) -> None:
        """The round's code (captured into its graph): draft step i's column ``tokens`` [rows] copied to
        the host's buffer without blocking, and step i's event recorded after the copy; on a GPU on
        the side stream, so that the device's next forward does not wait for the copy. With mask
        workers, the copy also raises the flag they watch (``kernels.host.hand_over``)."""
        if self._side is None:
            self._handed[i, : tokens.shape[0]].copy_(tokens)
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        tokens.record_stream(self._side)  # (its memory is not reused before the side stream has read it)
        with torch.cuda.stream(self._side):
            if self._syncmem is not None:
                from .kernels.host import hand_over

                hand_over(tokens, self._handed[i], self._flag, self._seen)
            else:
                self._handed[i, : tokens.shape[0]].copy_(tokens, non_blocking=True)
            self._handed_events[i].record()

    def fetch(self, out: Tensor) -> None:
        """The round's code when it ``waits`` (captured into its graph), once the step before has read
        ``out``: on the side stream, wait for the host's next point (every party's count), then
        upload host buffer 0 into ``out`` (int32 [rows, ⌈V/32⌉]). The device's own work goes on
        meanwhile, up to the point that uses the masks (``await_masks``): where the host is ahead,
        the wait and the upload cost the round nothing."""
        from .kernels.host import wait_for_host  # (the kernels need triton: on a GPU only)

        if self._mem is None:  # (a buffer that ``begin`` may grow would leave the graph a stale address)
            raise SMCDecodeError("a round that waits for the host's masks needs a HostMasks made with rows > 0")
        if self._fetching:
            raise SMCDecodeError("fetch() twice without await_masks() between: a host point's masks not used")
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            wait_for_host(self._posted, self._seen, parties=len(self._counts), stride=LINE)
            out.copy_(self._bits[0][: out.shape[0]], non_blocking=True)
        self._fetching = True

    def await_masks(self) -> None:
        """The round's code at a host point when the round ``waits``: the device's work from here
        waits for the masks ``fetch`` uploaded."""
        if not self._fetching:
            raise SMCDecodeError("await_masks() without fetch() before it: no host point's masks on their way")
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._fetching = False

    def serve(self) -> None:
        """The host points of a round that ``waits``, launched whole: for each draft step and the
        bonus, its masks written into host buffer 0 and the point counted (the device waits for the
        counts); by the mask workers where every masked request is theirs (``_plan``). The caller
        releases the device on anything raised (``release``). Point 0 writes the buffer at once: the
        round before must have copied its last masks up (the scheduler has read it: its resampling
        is over)."""
        with self.serving():
            masked = [m for m in self.requests.values() if not m.checked]
            if self._syncmem is not None and self._pool is not None and masked and all(m.remote for m in masked):
                self._plan()
            else:
                for i in range(self.k_max + 1):
                    self._post(i)
        self._gave_up()

    @contextlib.contextmanager
    def serving(self):
        """Inside: a round that waits for the host's masks may be launched and not yet served, so
        nothing may wait for the device: a pinned buffer freed inside is unpinned after it
        (``mask_workers._unpin``), and no garbage collection runs (a finalizer's CUDA call could wait)."""
        _SERVING[0] += 1
        try:
            with no_collection():
                yield
        finally:
            _SERVING[0] -= 1
            if not _SERVING[0]:
                unpin_deferred()

    def _gave_up(self) -> None:
        """Raise if a wait of the device gave up (a point came later than it waits: it went on without it)."""
        if self._posted_np[1]:
            self.release()
            raise SMCDecodeError("the device gave up waiting for the host's masks at a host point (kernels/host.py's "
                                 "GIVE_UP_S): that round's tokens are not valid")

    def _post(self, i: int) -> None:
        """Host point i of a round that ``waits``: its masks in host buffer 0, then the counts raised."""
        if i:  # (the device has copied point i − 1's masks up once it hands draft column i − 1 over)
            self._column(i - 1)
        bits = self._fill(i, 0)
        self._seen_masks(i, bits)
        if bits is None:
            self._bits[0][: self.rows].numpy().fill(-1)
        self._count += 1
        # a fence: taking and releasing a lock orders the masks' stores before the count's, on any CPU
        self._fence.acquire()
        self._fence.release()
        self._counts[:] = self._count

    def _plan(self) -> None:
        """The round's host points served by the mask workers: each point's items (what each request
        consumes and fills, and the rows no request constrains) in one plan record, step 0's rows
        filled by the round before gathered here first; then this process's count and the counts of
        the workers the plan leaves out raised past the round, and the workers waited for."""
        base, rows, K = self._count, self.rows, self.k_max
        bits = self._bits[0][:rows]
        items, bonus = [], False
        for i in range(K + 1):
            counted = self._counted(i)
            prefilled, self._prefilled = self._prefilled, None
            bonus = bool(counted)  # (the last point's: the bonus)
            if i == 0 and counted and prefilled is not None and prefilled[0] == 0:
                counted = self._gather(counted, prefilled[1], bits.numpy())  # (its other rows: every token)
            else:
                covered = np.zeros(rows, dtype=bool)
                for _, _, r in counted:
                    covered[r] = True
                items += [(-1, 0, 0, a, 0, b - a, i) for a, b in _runs(~covered)]
            fills = {m.slot for m, _, _ in counted}
            items += [(*item, i) for item in self._items(counted, fill=fills, handed=True)]
        asked = set(self._pool.plan(base, K + 1, items))
        final = base + K + 1
        self._fence.acquire()  # (step 0's gathered rows stored before the counts)
        self._fence.release()
        self._counts[[p for p in range(len(self._counts)) if p == 0 or p - 1 not in asked]] = final
        self._pool.step_wait()
        self._count = final
        self._seen_masks(K, bits if bonus else None)

    def _seen_masks(self, i: int, bits: Tensor | None) -> None:
        if i == self.k_max:  # (the bonus masks: ``continuing``)
            self.continuing = bits is not None and self._goes_on(bits.numpy())

    def _goes_on(self, bits) -> bool:
        """Do the bonus masks ``bits`` (int32 [rows, W]) leave a row some token but not EOS?"""
        if self.eos < 0:
            return True
        word, bit = divmod(self.eos, 32)
        for r in np.flatnonzero((bits[:, word] >> bit) & 1 == 0):
            if bits[r].any():
                return True
        return False

    @contextlib.contextmanager
    def open_gate(self):
        """Every wait of the device passes while inside, on masks that allow every token (a round's
        graph capture runs its code once); the counts start from 0 after it."""
        torch.cuda.synchronize(self.device)  # (no round still reads the masks' buffer)
        if self._pool is not None:  # (the capture's first run rewrites the columns the workers read)
            self._pool.step_wait()
        self._counts[:] = 2**62
        self._bits[0].numpy().fill(-1)
        self._prefilled, self._fetching = None, False
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """Let the device past every wait it is in or has queued, wait for it, and start the counts
        again from 0 (after an error between host points: the round's outputs are not used). A plan
        the workers are serving is called off first (they count no more)."""
        if not self.pinned:
            return
        self._releasing = True  # (until it is through: ``begin`` finishes a release an interrupt cut short)
        self._prefilled = None
        if self._pool is not None:
            self._pool.abort()
        self._counts[:] = 2**62
        torch.cuda.synchronize(self.device)
        self._seen.zero_()
        torch.cuda.synchronize(self.device)
        self._posted_np[:] = 0  # (the counts, the word that says the device gave up, the handed flag)
        self._count = 0
        self._releasing = False
