"""Under ``torchrun``, a layer's units on the ranks (``docs/distributed.md``): unit ``k`` is worked by rank
``k mod N`` by default (:func:`moecompress.engine.units.unit_size` decides the units) and its parts travel to rank 0.

Rank 0 runs the layer loop as one process does (:class:`~moecompress.engine.run.RecipeRun`): it alone
reads the non-MoE tensors, writes, journals and renames. For an MoE layer held by chunks of experts
(:mod:`moecompress.engine.layer_run`) it first broadcasts a *command* (the layer, the chunk size, the
written steps); chunk ``k`` is then worked (:func:`~moecompress.engine.unit_work.chunk_parts`: reading,
dequantising, every step, the error contributions, the encoding) by rank ``k mod N``, or as rank 0's
:class:`~moecompress.engine.balance.Balance` shares the units out when rank 0 is the slower one. Each other rank
sends its chunks' parts to rank 0 (the wire below: safetensors and JSON), working its next chunk while rank 0
has yet to receive them (:class:`~moecompress.engine.wire.Outbox`: one message in flight); rank 0 consumes every chunk in chunk order
exactly as it consumes its own, so the output is the one process's, byte for byte. A written step's encoded
tensors (most of a chunk's bytes) go instead into a file of the other rank's in the staging directory's
``units/`` when rank 0 can read it there (:func:`~moecompress.engine.wire.unit_files`), and rank 0's
writer adopts the file (:meth:`~moecompress.io.writer.ShardWriter.adopt`): they are neither sent nor written
twice. When rank 0 is done it broadcasts a stop; the other ranks then return.

Which layers (:func:`~moecompress.engine.units.unit_size`): those the run holds by chunks anyway
(``expert_chunk``), and, under ``N > 1`` ranks, every other MoE layer whose steps can all run by chunks
with the whole layer's bytes (each step's ``PassSpec.chunking`` and ``Chunking.exact``), split into ``4N``
units of ``ceil(E / 4N)`` experts (``units.LOOP_UNITS_PER_RANK``); a merge by units of groups (``Chunking('group')``) sends its command
before rank 0 prepares it, every rank decides the groups, and unit ``k`` is worked by rank ``k mod N``
(:mod:`moecompress.engine.group_work`); any other layer is one unit, run whole by rank 0 while the others
wait for the next command. The other ranks read a layer's statistics from rank 0's statistics-cache entry (it is
complete before the first command) and compute the cross-layer plans themselves from it, as rank 0 does.
A rank that dies makes the others' next send, receive or broadcast fail: :class:`~moecompress.errors.Interrupted`;
an error a pass raises on another rank is sent to rank 0 and raised there with the same line.

The messages themselves (safetensors and JSON, the :class:`~moecompress.engine.wire.Outbox`, the unit files):
:mod:`moecompress.engine.wire`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from moecompress.engine import chunks
from moecompress.engine.balance import Balance, owners
from moecompress.engine.context import RunContext
from moecompress.engine.distributed import Ranks
from moecompress.engine.group_work import CHOICES, owned, trial, unit_parts
from moecompress.engine.resources import release_freed, rss_mb
from moecompress.engine.unit_work import ErrPart, LayerPlan, StepPart, chunk_parts, prepare
from moecompress.engine.wire import Outbox, UnitFiles, decode, decode_message, encode, receive
from moecompress.errors import RecipeError
from moecompress.io.checkpoint import Checkpoint

STOP = -1
"""The layer index of the command that ends the other ranks' loop."""

PREPARE = -1
"""The written-steps count of a command that only prepares the layer (:func:`send_prepare`)."""


def _command(ranks: Ranks, steps: list, values: list[int], mine: int = 0) -> list[int]:
    """``[layer, size, written count, written steps... (padded), mine]``: ``mine``, rank 0's share of the
    layer's units (:mod:`moecompress.engine.balance`), goes last."""
    length = 4 + len(steps)
    return ranks.broadcast_ints([*values, *[0] * (length - 1 - len(values)), mine], length)


def layer_chunks(
    ranks: Ranks, lp: LayerPlan, size: int, written: set[int], balance: Balance | None = None
) -> Iterator[Iterable[ErrPart | StepPart]]:
    """Rank 0's view of layer ``lp.idx`` by chunks of ``size``: per chunk, in order, its parts (worked here, or
    received from the rank that owns it: :func:`~moecompress.engine.balance.owners` of ``balance``'s share);
    under ``N > 1`` ranks the command goes out first, and ``balance`` sees the layer's times."""
    bounds = chunks.bounds(lp.shells[0].router.num_experts, size)
    n = ranks.world_size
    balance = None if lp.team is not None else balance  # a team's unit k is rank k's
    mine = (balance or Balance()).share(len(bounds), n)
    who = owners(len(bounds), n, mine)
    if n > 1:
        _command(ranks, lp.steps, [lp.idx, size, len(written), *sorted(written)], mine)
    own: list[float] = []
    took: list[float] = []
    other: list[float] = []
    for k, (a, b) in enumerate(bounds):
        if who[k] == 0:
            t = time.perf_counter()
            yield chunk_parts(lp, a, b, written)
            own.append(time.perf_counter() - t)
            continue
        head, blob = receive(ranks, who[k])
        t = time.perf_counter()
        msg = json.loads(head.decode())
        yield decode_message(msg, blob)
        took.append(time.perf_counter() - t)
        other.append(float(msg.get("unit_s", 0.0)))
    if balance is not None:
        balance.observe(own, took, other)


def send_command(ranks: Ranks, steps: list, idx: int, size: int, written: list[int]) -> None:
    """Rank 0, before a merge's layer by units of groups: the other ranks prepare it and work their units."""
    if ranks.world_size > 1:
        _command(ranks, steps, [idx, size, len(written), *sorted(written)])


def blocked(steps: list) -> bool:
    """Whether a layer's preparation takes every rank at once: a step gathering by blocks
    (``Chunking.take``, :mod:`~moecompress.engine.block_sweep`)."""
    return any(step.spec.chunking is not None and step.spec.chunking.take is not None for step in steps)


def send_prepare(ranks: Ranks, steps: list, idx: int, size: int) -> None:
    """Rank 0, before it prepares a layer whose first sweep is shared by blocks (:func:`blocked`): every rank
    prepares it at the same time; the layer's command follows as usual."""
    if ranks.world_size > 1:
        _command(ranks, steps, [idx, size, PREPARE])


def grouped_units(
    ranks: Ranks, lp: LayerPlan, units: list[tuple[int, int]], work: Callable[[int, int], list]
) -> Iterator[list]:
    """Rank 0's view of a merge's units (:mod:`moecompress.engine.group_work`): per unit, in order, its parts
    (``work(lo, hi)`` here for unit ``k`` with ``k mod N == 0``, else received from rank ``k mod N``)."""
    n = ranks.world_size
    for k, (lo, hi) in enumerate(units):
        yield work(lo, hi) if k % n == 0 else decode(*receive(ranks, k % n))


def share_choice(ranks: Ranks, dec) -> None:
    """A merge's whole-layer choice (``GroupDecision.choice``) from rank 0 to the others."""
    if ranks.world_size > 1:
        got = ranks.broadcast_ints([CHOICES.index(dec.choice)] if ranks.is_writer else [0], 1)
        dec.choice = CHOICES[got[0]]


def _follow_grouped(
    ranks: Ranks, lp: LayerPlan, size: int, g: int, written: set[int], files: UnitFiles | None, out: Outbox
) -> int:
    """Ranks ``1..N-1`` on a merge's layer by units of groups: their units' results to rank 0 (both passes);
    returns the units worked."""
    dec, steps, worked = lp.preludes[g], lp.steps, 0
    units = list(owned(dec.units(size), ranks.rank, ranks.world_size))
    if dec.sweeps == 2:
        for lo, hi in units:
            out.send(lambda: encode([StepPart(g, lo, None, 0.0, trial(lp, g, lo, hi))], steps))  # noqa: B023
        out.wait()
        share_choice(ranks, dec)
    for lo, hi in units:
        out.send(lambda: encode(unit_parts(lp, g, lo, hi, g in written), steps, files))  # noqa: B023
        worked += 1
        release_freed()
    return worked


def release(ranks: Ranks, steps: list) -> None:
    """Rank 0, once the run is finished: the other ranks' loop ends (nothing at world size 1)."""
    if ranks.world_size > 1 and ranks.is_writer:
        _command(ranks, steps, [STOP])


def follow(
    ranks: Ranks, ckpt: Checkpoint, steps: list, entry: Path | None, ctx: RunContext,
    plans_of: Callable[[], dict], *, needs_stats: bool = True, files: UnitFiles | None = None,
) -> dict:  # fmt: skip
    """Ranks ``1..N-1``: work the chunks rank 0 hands out until it stops; ``plans_of()``: the run's
    cross-layer plans (computed at the first command, when the statistics entry is complete);
    ``needs_stats``: the run calibrates (not ``calibration.source: none``); ``files``: where this rank writes
    its units' encoded tensors (:func:`~moecompress.engine.wire.unit_files`; ``None``: they travel in the messages). Returns what this
    rank did (layers, chunks, its largest resident memory in the layer loop)."""
    plans: dict | None = None
    ready: tuple[int, LayerPlan] | None = None  # a layer prepared on a PREPARE command, for its command
    layers = worked = 0
    peak = rss_mb()
    out = Outbox(ranks)
    while True:
        out.wait()  # rank 0 has received this layer's units before it sends the next command
        cmd = _command(ranks, steps, [])
        idx, size, count, mine = *cmd[:3], cmd[-1]
        if idx == STOP:
            return {"layers": layers, "chunks": worked, "peak_rss_mb": round(peak, 1),
                    "unit_files": files.count if files is not None else 0}  # fmt: skip
        if plans is None:
            _check_entry(ranks, entry, needs_stats)
            plans = plans_of()
        if ready is not None and ready[0] == idx:
            lp, ready = ready[1], None
        else:
            lp = prepare(ckpt, steps, entry, [plans.get(s.number, {}).get(idx) for s in steps], ctx, idx, size)
        if count == PREPARE:
            ready = (idx, lp)
            del lp
            continue
        written = set(cmd[3 : 3 + count])
        grouped = [s for s, step in enumerate(steps) if step.spec.chunking.mode == "group"]
        if grouped:  # a merge by units of groups (group_work)
            worked += _follow_grouped(ranks, lp, size, grouped[0], written, files, out)
            peak = max(peak, rss_mb())
            layers += 1
            del lp
            continue
        bounds = chunks.bounds(lp.shells[0].router.num_experts, size)
        who = owners(len(bounds), ranks.world_size, mine)
        for k, (a, b) in enumerate(bounds):
            if who[k] == ranks.rank:
                serve(lp, a, b, written, files, out)
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


def serve(lp: LayerPlan, a: int, b: int, written: set[int], files: UnitFiles | None, out: Outbox) -> None:
    """Experts ``[a, b)`` of ``lp``'s layer worked here and sent to rank 0 through ``out`` (an error a pass raises
    is sent too, then raised here); ``files``: see :func:`follow`."""
    def make() -> tuple[bytes, bytes]:
        started = time.perf_counter()
        return encode(chunk_parts(lp, a, b, written), lp.steps, files, started=started)

    out.send(make)
