"""All-gathers that run while this rank computes: a rank starts the gather of a piece of work and goes on to
the next piece; the gathered bytes are handed to a callback later, in the order the gathers were started.

Expert-sharded calibration (:mod:`~moecompress.calibration.expert_sharded`) gathers each round's expert terms.
A round's work differs by rank (the tokens each rank's experts receive), so a gather that waits at once makes
each rank wait for the slower one round by round; with the gather of round ``j`` in flight while round ``j + 1``
is computed, a rank waits only for what the other rank is behind over both rounds. Measured (heapr, Qwen3-30B
widths, 2 layers, 2 ranks on 2 cores, ``benchmarks/RESULTS.md``): a rank's time in the gathers 1.5–2.0 s ->
0.5–1.8 s, calibration's wall unchanged within the machine's noise (the chunk reads beside the transfers got
slower: two ranks already use both cores). Where a gather's transfer is wall time (between hosts, NCCL), it
overlaps the next round's compute.

One background thread issues the gathers, one at a time, in the order they were started: every rank issues the
same collectives in the same order, as the ranks' single thread did. The caller issues no other collective while
gathers are in flight (:meth:`GatherAhead.drain` first). gloo and NCCL wait without the GIL, so the thread's
waits cost the computing thread nothing. The callbacks run on the caller's thread, in start order: whatever they
add up is added in the order of one process, bit for bit.

A failed gather (a rank stopped: :class:`~moecompress.errors.Interrupted`) is raised by the call that settles
it; if the caller fails, the gathers not yet issued are dropped (the thread is a daemon: it never keeps the
process alive).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

AHEAD = 1
"""Gathers in flight while the next piece of work is computed (each holds its pieces' bytes from every rank)."""


class GatherAhead:
    """``with GatherAhead(group) as ahead:`` then ``ahead.start(blob, then)``: ``then(parts)`` (every rank's
    ``blob``, in rank order, as ``group.all_gather_buffers``: uint8 tensors) is called once at most ``ahead``
    later gathers have started, or at :meth:`drain` (also on leaving the block without an error)."""

    def __init__(self, group, ahead: int = AHEAD):
        self._group, self._ahead = group, max(int(ahead), 0)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: deque[tuple[Future, Callable[[list], None]]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moecompress-gather-ahead", daemon=True)
        self._thread.start()

    def start(self, blob: bytes, then: Callable[[list], None]) -> None:
        """Start gathering ``blob``; settle the oldest gathers beyond ``ahead`` (their callbacks run now)."""
        fut: Future = Future()
        self._pending.append((fut, then))
        self._todo.put((blob, fut))
        while len(self._pending) > self._ahead:
            self._settle()

    def drain(self) -> None:
        """Settle every gather started: their callbacks have run when this returns."""
        while self._pending:
            self._settle()

    def _settle(self) -> None:
        fut, then = self._pending.popleft()
        then(fut.result())

    def _run(self) -> None:
        device = torch.device(getattr(self._group, "device", "cpu"))
        if device.type == "cuda":  # a new thread starts on CUDA device 0: this rank's collectives use its own
            torch.cuda.set_device(device)
        while True:
            job = self._todo.get()
            if job is None:
                return
            blob, fut = job
            if self._stop.is_set():
                fut.cancel()
                continue
            try:
                fut.set_result(self._group.all_gather_buffers(blob))
            except BaseException as err:  # raised again by the caller's settle; no collective after a failed one
                self._stop.set()
                fut.set_exception(err)

    def close(self) -> None:
        """Let the thread end once the gather it is in ends; gathers not yet issued are dropped."""
        self._stop.set()
        self._todo.put(None)

    def __enter__(self) -> GatherAhead:
        return self

    def __exit__(self, kind, err, tb) -> None:
        if kind is not None:
            self.close()
            return
        try:
            self.drain()
        except BaseException:
            self.close()
            raise
        self.close()
        self._thread.join()
