"""Rank 0's share of a layer's units under ``torchrun`` (``engine/balance.py``): the default ``k mod N`` split,
the split that makes the slowest rank fastest, and no change for a gain too small to matter."""

from __future__ import annotations

from itertools import pairwise

import pytest

from moecompress.engine.balance import Balance, default_share, owners


@pytest.mark.parametrize(("units", "world"), [(4, 2), (5, 2), (3, 2), (8, 3), (1, 2), (7, 4)])
def test_the_default_share_is_k_mod_n(units, world):
    assert owners(units, world, default_share(units, world)) == [k % world for k in range(units)]


@pytest.mark.parametrize(("units", "world", "mine"), [(8, 2, 3), (8, 2, 0), (8, 2, 8), (8, 3, 1), (16, 2, 5)])
def test_rank_0_gets_its_share_spread_and_the_others_the_rest_round_robin(units, world, mine):
    who = owners(units, world, mine)
    assert len(who) == units and who.count(0) == mine
    rest = [r for r in who if r != 0]
    assert rest == [1 + k % (world - 1) for k in range(len(rest))]
    if 0 < mine < units:
        assert who[0] == 0  # rank 0 starts at once: it works unit 0
        mine_at = [k for k, r in enumerate(who) if r == 0]
        gaps = [b - a for a, b in pairwise(mine_at)]
        assert max(gaps, default=0) - min(gaps, default=0) <= 1  # evenly spread


def test_a_slower_rank_0_gives_the_others_more_units():
    """Rank 0: 0.6 s per own unit and 0.1 s per received one; rank 1: 0.45 s per unit (heapr at Qwen3-30B
    widths, 8 units per layer). The default 4/4 takes max(2.8, 1.8) = 2.8 s; 3/5 takes max(2.3, 2.25)."""
    b = Balance()
    assert b.share(8, 2) == 4  # nothing seen yet: the default
    b.observe([0.6] * 4, [0.1] * 4, [0.45] * 4)
    assert b.share(8, 2) == 3
    assert b.slowest(8, 2, 3) == pytest.approx(2.3)
    b.observe([], [], [2.0] * 5)  # rank 1 became slow: rank 0 takes more (its own figure is kept)
    assert b.share(8, 2) > 4


def test_a_small_gain_keeps_the_default():
    tiny = Balance(own=0.011, took=0.0, other=0.005)  # 33 ms against 44 ms: a quarter, under MIN_SECONDS
    assert tiny.slowest(8, 2, 3) < tiny.slowest(8, 2, 4) and tiny.share(8, 2) == 4
    close = Balance(own=0.5, took=0.02, other=0.44)  # 3.96 s against 4.16 s: under MIN_GAIN
    assert close.slowest(16, 2, 7) < close.slowest(16, 2, 8) and close.share(16, 2) == 8
    assert Balance(own=5.0, took=0.0, other=1.0).share(8, 1) == 8  # one process: every unit
