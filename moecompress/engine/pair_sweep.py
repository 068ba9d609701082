"""The sweep over every pair of a layer's chunks of experts, holding two chunks at a time.

A step whose first phase needs every pair of experts (``Chunking.pairs``: the weight Gram of
``similarity: weight``, :mod:`moecompress.methods.weight_gram`) reads the layer by chunks in
:func:`pair_order`: each row ``i`` visits ``(i, i)`` and then ``j`` from the last chunk down to ``i + 1``, so
the next row's anchor is the chunk just read. For ``C`` chunks that is ``1 + C(C − 1)/2`` chunk reads with
two chunks held (each once for ``C ≤ 2``). :func:`sweep_pairs` takes the reading and the work on a pair as
callables (``engine/unit_work.py`` gives both), so the schedule is tested apart from any checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from moecompress.engine.resources import release_freed

T = TypeVar("T")


def pair_order(n: int) -> list[tuple[int, int]]:
    """Every pair ``i ≤ j`` of ``n`` chunks, the diagonal in chunk order (see the module docstring)."""
    return [p for i in range(n) for p in [(i, i), *((i, j) for j in range(n - 1, i, -1))]]


def sweep_pairs(n: int, read: Callable[[int], T], visit: Callable[[int, int, T, T], None]) -> int:
    """``visit(i, j, chunk i, chunk j)`` for every pair of :func:`pair_order`, each chunk read
    (``read(k)``) when it is first needed and the other one evicted, freed before the next is read: the
    anchor and one other are held, never three. Returns the number of reads."""
    held: dict[int, T] = {}
    reads = 0
    for i, j in pair_order(n):
        for k in (i, j):
            if k not in held:
                for old in [o for o in held if o != i]:
                    del held[old]
                release_freed()
                held[k] = read(k)
                reads += 1
        visit(i, j, held[i], held[j])  # the references end with the call: nothing outlives the pair
    held.clear()
    release_freed()
    return reads
