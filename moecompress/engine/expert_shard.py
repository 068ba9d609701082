"""Under ``torchrun``, the layer loop's per-expert work sharded across the ranks (``docs/distributed.md``).

Rank 0 runs the layer loop as one process does (:class:`~moecompress.engine.run.RecipeRun`): it alone
reads the non-MoE tensors, writes, journals and renames. For an MoE layer held by chunks of experts
(:mod:`moecompress.engine.chunk_loop`) it first broadcasts a *command* (the layer, the chunk size, the
written steps); chunk ``k`` is then worked (:func:`~moecompress.engine.chunk_work.chunk_parts`: reading,
dequantising, every step, the error contributions, the encoding) by rank ``k mod N``. Each other rank
sends its chunks' parts to rank 0 (:mod:`moecompress.engine.chunk_wire`: safetensors and JSON), which
consumes every chunk in chunk order exactly as it consumes its own, so the output is the one process's,
byte for byte. When rank 0 is done it broadcasts a stop; the other ranks then return.

Which layers: those the run holds by chunks anyway (``expert_chunk``), and, under ``N > 1`` ranks, every
other MoE layer whose steps can all run by chunks (each step's ``PassSpec.chunking``), split into ``N``
chunks of ``ceil(E / N)`` experts; a layer with a step that needs every expert at once (``chunking``
``None``: ``tdmoe``, ``namex``, ``codequant``, ...) is run whole by rank 0 while the others wait for the
next command. The other ranks read a layer's statistics from rank 0's statistics-cache entry (it is
complete before the first command) and compute the cross-layer plans themselves from it, as rank 0 does.
A rank that dies makes the others' next send, receive or broadcast fail: :class:`~moecompress.errors.Interrupted`;
an error a pass raises on another rank is sent to rank 0 and raised there with the same line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from moecompress.engine import chunk_wire, chunks
from moecompress.engine.chunk_plan import chunkable
from moecompress.engine.chunk_work import ErrPart, LayerPlan, StepPart, chunk_parts, prepare
from moecompress.engine.context import RunContext
from moecompress.engine.distributed import Ranks
from moecompress.engine.recipe import Recipe
from moecompress.engine.resources import release_freed, rss_mb
from moecompress.errors import MoecompressError, RecipeError
from moecompress.io.checkpoint import Checkpoint

STOP = -1
"""The layer index of the command that ends the other ranks' loop."""


def chunk_size(rec: Recipe, ckpt: Checkpoint, ctx: RunContext, idx: int) -> int | None:
    """Experts per chunk of MoE layer ``idx`` in the layer loop (``None``: the layer is run whole, on
    rank 0): the run's ``expert_chunk`` size, else under ``N > 1`` ranks ``ceil(E / N)`` when every step
    can run by chunks with the whole layer's result (``Chunking.exact``) and ``calibration.propagate`` is not
    ``compressed``."""
    if idx in ctx.expert_chunks:
        return ctx.expert_chunks[idx]
    n, e = ctx.ranks.world_size, int(ckpt.adapter.num_experts)
    if n == 1 or e < 2 or rec.calibration.propagate == "compressed" or not chunkable(rec, ckpt, idx):
        return None
    if not all(s.spec.chunking.exact is None or s.spec.chunking.exact(s.config) for s in rec.steps):
        return None  # chunks would change the bytes (codequant's fine-tuning): rank 0 runs the layer whole
    return -(-e // n)


def _command(ranks: Ranks, steps: list, values: list[int]) -> list[int]:
    length = 3 + len(steps)
    return ranks.broadcast_ints([*values, *[0] * (length - len(values))], length)


def layer_chunks(
    ranks: Ranks, lp: LayerPlan, size: int, written: set[int]
) -> Iterator[Iterable[ErrPart | StepPart]]:
    """Rank 0's view of layer ``lp.idx`` by chunks of ``size``: per chunk, in order, its parts (worked here
    for chunk ``k`` with ``k mod N == 0``, else received from rank ``k mod N``); under ``N > 1`` ranks the
    command goes out first."""
    bounds = chunks.bounds(lp.shells[0].router.num_experts, size)
    n = ranks.world_size
    if n > 1:
        _command(ranks, lp.steps, [lp.idx, size, len(written), *sorted(written)])
    for k, (a, b) in enumerate(bounds):
        yield chunk_parts(lp, a, b, written) if k % n == 0 else chunk_wire.decode(ranks.recv_bytes(k % n))


def release(ranks: Ranks, steps: list) -> None:
    """Rank 0, once the run is finished: the other ranks' loop ends (nothing at world size 1)."""
    if ranks.world_size > 1 and ranks.is_writer:
        _command(ranks, steps, [STOP])


def follow(
    ranks: Ranks, ckpt: Checkpoint, steps: list, entry: Path | None, ctx: RunContext,
    plans_of: Callable[[], dict], *, needs_stats: bool = True,
) -> dict:  # fmt: skip
    """Ranks ``1..N-1``: work the chunks rank 0 hands out until it stops; ``plans_of()``: the run's
    cross-layer plans (computed at the first command, when the statistics entry is complete);
    ``needs_stats``: the run calibrates (not ``calibration.source: none``). Returns what this rank did
    (layers, chunks, its largest resident memory in the layer loop)."""
    plans: dict | None = None
    layers = worked = 0
    peak = rss_mb()
    while True:
        cmd = _command(ranks, steps, [])
        idx, size, count = cmd[:3]
        if idx == STOP:
            return {"layers": layers, "chunks": worked, "peak_rss_mb": round(peak, 1)}
        if plans is None:
            _check_entry(ranks, entry, needs_stats)
            plans = plans_of()
        lp = prepare(ckpt, steps, entry, [plans.get(s.number, {}).get(idx) for s in steps], ctx, idx, size)
        written = set(cmd[3 : 3 + count])
        for k, (a, b) in enumerate(chunks.bounds(lp.shells[0].router.num_experts, size)):
            if k % ranks.world_size == ranks.rank:
                serve(ranks, lp, a, b, written)
                worked += 1
                peak = max(peak, rss_mb())
                release_freed()
        layers += 1
        del lp


def _check_entry(ranks: Ranks, entry: Path | None, needs_stats: bool) -> None:
    if needs_stats and (entry is None or not Path(entry).is_dir()):
        raise RecipeError(
            f"rank {ranks.rank} of {ranks.world_size}: cannot see the statistics-cache entry rank 0 uses "
            f"({entry or 'not found on this host'}); put calibration.cache_dir on a file system every host sees"
        )


def serve(ranks: Ranks, lp: LayerPlan, a: int, b: int, written: set[int]) -> None:
    """Experts ``[a, b)`` of ``lp``'s layer worked here and sent to rank 0 (an error a pass raises is sent
    too, then raised here)."""
    try:
        msg = chunk_wire.encode(chunk_parts(lp, a, b, written), lp.steps)
    except MoecompressError as err:
        ranks.send_bytes(chunk_wire.encode_error(err), 0)
        raise
    ranks.send_bytes(msg, 0)
