"""Under ``torchrun``, how many of a layer's units rank 0 works itself (:func:`moecompress.engine.shard.layer_chunks`).

Rank 0 does more per unit than the other ranks: it consumes every unit (the error parts, the skeletons, the
writers' bookkeeping) and writes its own units' tensors, while another rank writes its units' tensors to a file
and sends a message. With unit ``k`` on rank ``k mod N`` rank 0 was the slowest rank of the layer loop, and the
others waited for it (heapr at Qwen3-30B widths, 2 ranks: rank 1 idle 1.2 s per layer). So rank 0 times each
layer's units (:class:`Balance`: its own, from the unit's start to its last part consumed; a received one, from
its arrival to its last part consumed; the other ranks' as they report them) and gives the next layer the split
that makes the slowest rank fastest: rank 0 works ``m`` of the ``U`` units, ``m`` minimising

    max(m · own + (U − m) · took, ceil((U − m) / (N − 1)) · other),

keeping the default ``ceil(U / N)`` unless that saves at least :data:`MIN_GAIN` of the layer's time and
:data:`MIN_SECONDS`. Which units: :func:`owners`. The split changes no byte of the output: rank 0 consumes the
units in order, whoever worked them.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_GAIN = 0.1
"""The least fraction of the slowest rank's time per layer a new split must save."""
MIN_SECONDS = 0.25
"""The least seconds per layer a new split must save: a small layer (every test model) keeps the default split."""


def default_share(units: int, world: int) -> int:
    """Rank 0's units when unit ``k`` goes to rank ``k mod N``."""
    return -(-units // world)


def owners(units: int, world: int, mine: int) -> list[int]:
    """The rank of each of ``units`` units when rank 0 works ``mine`` of them: ``k mod N`` for the default
    share; otherwise rank 0's spread evenly from unit 0 on, the rest round robin over ranks ``1..N-1``."""
    if world == 1:
        return [0] * units
    if mine == default_share(units, world):
        return [k % world for k in range(units)]
    out, r = [], 0
    for k in range(units):
        if -(-k * mine // units) < -(-(k + 1) * mine // units):
            out.append(0)
        else:
            out.append(1 + r % (world - 1))
            r += 1
    return out


@dataclass
class Balance:
    """Rank 0's seconds per unit in the last layer by units: ``own`` (one of its own), ``took`` (consuming a
    received one), ``other`` (another rank's, as it reports them). ``None``: not seen yet."""

    own: float | None = None
    took: float | None = None
    other: float | None = None

    def slowest(self, units: int, world: int, mine: int) -> float:
        """The slowest rank's seconds for a layer of ``units`` units when rank 0 works ``mine``."""
        assert self.own is not None and self.took is not None and self.other is not None
        rest = units - mine
        return max(mine * self.own + rest * self.took, -(-rest // max(world - 1, 1)) * self.other)

    def share(self, units: int, world: int) -> int:
        """How many of ``units`` units rank 0 works (module docstring)."""
        default = default_share(units, world)
        if world == 1 or self.own is None or self.took is None or self.other is None:
            return default
        best = min(range(units + 1), key=lambda m: (self.slowest(units, world, m), abs(m - default)))
        before, after = self.slowest(units, world, default), self.slowest(units, world, best)
        return best if before - after >= max(MIN_SECONDS, MIN_GAIN * before) else default

    def observe(self, own: list[float], took: list[float], other: list[float]) -> None:
        """A layer's times (each a list of per-unit seconds; an empty one keeps the last figure)."""
        if own:
            self.own = sum(own) / len(own)
        if took:
            self.took = sum(took) / len(took)
        if other:
            self.other = sum(other) / len(other)
