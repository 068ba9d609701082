"""A two-phase step's first sweep by blocks (``Chunking.take``/``add``, :func:`~moecompress.ir.fold_blocks`).

The layer's experts fall into fixed blocks, whatever the chunk size and the number of ranks. Each block is
read in pieces of at most the chunk size and folded by ``Chunking.gather`` into a partial of its own, which
``Chunking.take`` hands out; ``Chunking.add`` folds the partials into the layer's total in block order.
Under ``N`` ranks block ``k`` is gathered by rank ``k mod N``, one round of ``N`` blocks at a time: each rank
sends its block's partial (safetensors, never pickle) to every other (``all_gather``) and every rank adds
the round's partials in block order. The total is then the one process's bit for bit, and so is everything
fitted from it; each rank reads and gathers ``1/N`` of the layer. An error a pass raises on one rank travels
with the round and is raised on every rank, with the same line.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save

from moecompress.engine.distributed import Ranks
from moecompress.engine.resources import release_freed
from moecompress.errors import MoecompressError, PassError
from moecompress.io.shard_format import load_buffer
from moecompress.ir import fold_blocks

Read = Callable[[int, int], Any]
"""``read(a, b)``: experts ``[a, b)`` of the step's layer, ``(sub-layer, statistics, first expert)`` or
``None`` (every expert of the range removed by an earlier selection)."""


def pieces(a: int, b: int, size: int) -> list[tuple[int, int]]:
    """Block ``[a, b)`` in ranges of at most ``size`` experts."""
    return [(x, min(x + size, b)) for x in range(a, b, max(size, 1))]


def blocks(num_input: int, kept: list[list[int] | None]) -> list[tuple[int, int]]:
    """The blocks of a step whose input has ``num_input`` experts after the selections ``kept`` (each
    earlier step's kept ids, ascending, or ``None``), as ranges of the layer's experts as read: block
    ``[a, b)`` of the step's input (:func:`~moecompress.ir.fold_blocks`) from the layer's expert
    that is its expert ``a`` to the one that is its expert ``b`` (the end of the layer for the last)."""
    ids: list[int] | None = None
    for k in kept:
        if k is not None:
            ids = list(k) if ids is None else [ids[i] for i in k]
    if ids is None:
        return fold_blocks(num_input)
    return [(ids[a], ids[b] if b < len(ids) else ids[-1] + 1) for a, b in fold_blocks(num_input)]


def sweep(step, idx: int, ranges: list[tuple[int, int]], size: int, read: Read, ranks: Ranks) -> Any:
    """The first sweep of ``step`` (its ``Chunking.gather``/``take``/``add``) over layer ``idx``'s blocks
    ``ranges`` (:func:`blocks`): the layer's total (module docstring)."""
    mode, cfg = step.spec.chunking, step.config
    n = ranks.world_size
    acc: Any = None
    for r in range(ranks.rounds(len(ranges))):
        k, error = r * n + ranks.rank, ""
        if k < len(ranges):
            try:
                for a, b in pieces(*ranges[k], size):
                    got = read(a, b)
                    if got is not None:
                        acc = mode.gather(got[0], got[1], cfg, acc)
                    del got
                    release_freed()
            except PassError as e:
                error = str(e)
            except MoecompressError as e:
                error = f"{step.label}, layer {idx}: {e}"
        part = mode.take(acc) if not error else {}
        if n == 1:
            if error:
                raise PassError(error)
            acc = mode.add(acc, part)
            continue
        blob = save({k: v.detach().cpu().contiguous() for k, v in part.items()}, metadata={"error": error})
        del part
        got = ranks.all_gather_buffers(blob)
        del blob
        first = next((e for e in map(_error, got) if e), "")
        if first:
            raise PassError(first)
        for g in got:  # rank order is block order within the round
            acc = mode.add(acc, load_buffer(g))
        del got
    return acc


def _error(buf: torch.Tensor) -> str:
    """The error line a rank sent with its round (``""``: none), from the safetensors header's metadata."""
    raw = buf.numpy()
    (length,) = struct.unpack("<Q", raw[:8].tobytes())
    return json.loads(raw[8 : 8 + length].tobytes()).get("__metadata__", {}).get("error", "")
