"""A two-phase step's first sweep by fixed blocks (``moecompress.engine.block_sweep``): one process and two
ranks (threads over queues, ``tests/queue_ranks.py``) add the same partials in the same order, so their
totals are equal bit for bit where a different order of the same float32 sums is not; an error one rank's
block raises is raised on both, with the same line, and neither waits for the other."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from queue_ranks import QueueRanks

from moecompress.engine.block_sweep import sweep
from moecompress.engine.distributed import Ranks
from moecompress.errors import MethodError, PassError
from moecompress.ir import fold_blocks

E = 40
VALUES = torch.randn(E, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * torch.logspace(
    0, 6, E, dtype=torch.float32
).unsqueeze(1)


class Acc:
    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.seen: list[int] = []


def _step(fail_at: int | None = None):
    """A step whose ``gather`` adds its experts' rows one at a time (``fail_at``: the expert it refuses)."""

    def gather(sub, stats, cfg, acc):
        acc = acc or Acc()
        acc.block = torch.zeros(64) if acc.block is None else acc.block
        for e in range(*sub):
            if e == fail_at:
                raise MethodError(f"expert {e} is damaged")
            acc.block += VALUES[e]
            acc.seen.append(e)
        return acc

    def take(acc):
        if acc is None or acc.block is None:
            return {}
        out, acc.block = {"g": acc.block}, None
        return out

    def add(acc, part):
        if not part:
            return acc
        acc = acc or Acc()
        acc.total = part["g"].clone() if acc.total is None else acc.total + part["g"]
        return acc

    mode = SimpleNamespace(gather=gather, take=take, add=add)
    return SimpleNamespace(spec=SimpleNamespace(chunking=mode), config=None, label="step 1 (fake)")


def _two(step, ranges, size):
    wire, out, errs = {}, {}, {}

    def rank(r: int) -> None:
        try:
            out[r] = sweep(step, 3, ranges, size, lambda a, b: ((a, b), None, a), QueueRanks(r, 2, wire=wire))
        except PassError as err:
            errs[r] = str(err)

    t = threading.Thread(target=rank, args=(1,))
    t.start()
    rank(0)
    t.join(60)
    assert not t.is_alive()
    return out, errs


def test_two_ranks_add_one_process_partials_in_its_order():
    ranges = fold_blocks(E)
    one = sweep(_step(), 3, ranges, 3, lambda a, b: ((a, b), None, a), Ranks())
    out, errs = _two(_step(), ranges, 2)  # another piece size: the same blocks
    assert not errs
    for r in (0, 1):
        assert torch.equal(out[r].total, one.total)
    assert sorted(out[0].seen + out[1].seen) == list(range(E)) and out[0].seen and out[1].seen  # each expert once
    assert not torch.equal(VALUES.sum(0), one.total)  # another order of the same sums: other bits


def test_an_error_on_one_rank_is_raised_on_both():
    ranges = fold_blocks(E)
    out, errs = _two(_step(fail_at=7), ranges, 4)  # expert 7: block 1, rank 1's
    assert not out
    assert errs[0] == errs[1] == "step 1 (fake), layer 3: expert 7 is damaged"
    with pytest.raises(PassError, match="layer 3: expert 7 is damaged"):
        sweep(_step(fail_at=7), 3, ranges, 4, lambda a, b: ((a, b), None, a), Ranks())
