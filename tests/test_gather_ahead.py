"""GatherAhead: all-gathers in flight while the caller computes, settled in start order."""

from __future__ import annotations

import threading

import pytest

from moecompress.calibration.gather_ahead import GatherAhead
from moecompress.errors import Interrupted


class Fake:
    """A group of two ranks whose other rank echoes this rank's blob reversed; ``gate``: each gather waits for it."""

    rank, world_size = 0, 2

    def __init__(self, gate: threading.Event | None = None, fail_at: int = 0):
        self.calls: list[bytes] = []
        self.threads: list[str] = []
        self.opened: list[bool] = []
        self.gate, self.fail_at = gate, fail_at

    def all_gather_buffers(self, blob: bytes) -> list[bytes]:
        self.calls.append(blob)
        self.threads.append(threading.current_thread().name)
        if self.gate is not None:
            self.opened.append(self.gate.wait(10))
        if len(self.calls) == self.fail_at:
            raise Interrupted("rank 0 of 2: all_gather failed, another rank stopped")
        return [blob, blob[::-1]]


def test_callbacks_run_in_start_order_once_a_later_gather_has_started():
    group, seen = Fake(), []
    with GatherAhead(group, ahead=1) as ahead:
        ahead.start(b"ab", seen.append)
        assert seen == []  # in flight: the caller goes on
        ahead.start(b"cd", seen.append)
        assert seen == [[b"ab", b"ba"]]
        ahead.start(b"ef", seen.append)
        assert seen == [[b"ab", b"ba"], [b"cd", b"dc"]]
    assert seen == [[b"ab", b"ba"], [b"cd", b"dc"], [b"ef", b"fe"]]  # drained on leaving the block
    assert group.calls == [b"ab", b"cd", b"ef"]
    assert set(group.threads) == {"moecompress-gather-ahead"}


def test_ahead_0_settles_each_gather_before_start_returns():
    seen: list = []
    with GatherAhead(Fake(), ahead=0) as ahead:
        ahead.start(b"x", seen.append)
        assert seen == [[b"x", b"x"]]


def test_the_gather_runs_while_the_caller_computes():
    """The gather waits for something the caller does only after ``start`` returns: a gather made on the
    caller's thread would wait its full 10 s and see the gate closed."""
    gate = threading.Event()
    group, seen = Fake(gate), []
    with GatherAhead(group) as ahead:
        ahead.start(b"ab", seen.append)
        gate.set()  # the caller's next piece of work
    assert group.opened == [True]
    assert seen == [[b"ab", b"ba"]]


def test_a_failed_gather_is_raised_when_settled_and_no_later_gather_is_issued():
    gate = threading.Event()
    group, seen = Fake(gate, fail_at=1), []
    with pytest.raises(Interrupted, match="another rank stopped"), GatherAhead(group, ahead=5) as ahead:
        for blob in (b"a", b"b", b"c"):
            ahead.start(blob, seen.append)
        gate.set()
    assert group.calls == [b"a"]
    assert seen == []


def test_an_error_of_the_caller_drops_the_gathers_not_yet_issued():
    gate = threading.Event()
    group, seen = Fake(gate), []
    with pytest.raises(ValueError, match="the caller's own error"), GatherAhead(group, ahead=5) as ahead:
        for blob in (b"a", b"b", b"c"):
            ahead.start(blob, seen.append)
        for _ in range(1000):  # until the first gather is in flight
            if group.calls:
                break
            threading.Event().wait(0.01)
        raise ValueError("the caller's own error")
    gate.set()
    ahead._thread.join(10)
    assert not ahead._thread.is_alive()
    assert group.calls == [b"a"]  # the one in flight ends; the others are never issued
    assert seen == []
