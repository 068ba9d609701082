"""Two ``torch.distributed`` ranks as two threads of one process (a test double of the gloo group)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import torch

from moecompress.engine.distributed import Ranks, Sending


@dataclass(frozen=True)
class QueueRanks(Ranks):
    """Two ranks as two threads of this process: every collective the engine uses, and the layer loop's
    sends and receives, over queues (a test double of the gloo process group)."""

    wire: dict = field(default_factory=dict, compare=False)

    def _q(self, kind: str, src: int, dst: int) -> queue.Queue:
        return self.wire.setdefault((kind, src, dst), queue.Queue())

    def _all(self, value):
        other = 1 - self.rank
        self._q("c", self.rank, other).put(value)
        got = self._q("c", other, self.rank).get(timeout=120)
        return [value, got] if self.rank == 0 else [got, value]

    def barrier(self) -> None:
        self._all(None)

    def all_gather_bytes(self, blob: bytes) -> list[bytes]:
        return self._all(blob)

    def all_gather_buffers(self, blob: bytes) -> list[torch.Tensor]:
        return [torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
                for b in self.all_gather_bytes(blob)]  # fmt: skip

    def all_gather_f64(self, values: list[float], length: int) -> list[list[float]]:
        return self._all(list(values))

    def all_sum_int(self, value: int) -> int:
        return sum(self._all(value))

    def from_writer(self, flag: bool) -> bool:
        return self._all(flag)[0]

    def broadcast_ints(self, values: list[int], length: int) -> list[int]:
        return self._all(list(values))[0]

    def send_bytes(self, blob: bytes, dst: int) -> None:
        self._q("p", self.rank, dst).put(blob)

    def isend_bytes(self, blob: bytes, dst: int) -> Sending:
        self.send_bytes(blob, dst)  # a queue never blocks the sender
        return Sending(self, [], [])

    def recv_bytes(self, src: int) -> bytes:
        return self._q("p", src, self.rank).get(timeout=120)

    def recv_buffer(self, src: int) -> torch.Tensor:
        blob = self.recv_bytes(src)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
