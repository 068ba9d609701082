"""The one loop over an MoE layer's units: a recipe run's layer, whole, by chunks of experts or across ranks.

A layer's work is a list of *units* (ranges of experts) that :func:`moecompress.engine.units.unit_size`
decides: the whole layer is one unit; chunking is smaller units; under ``torchrun`` unit ``k`` is worked
by rank ``k mod N`` (:mod:`moecompress.engine.shard`). :func:`run_layer` takes each unit's parts in unit
order, whichever rank worked it, into the same books (:class:`Books`), then finishes the layer: report
rows, infos, the reconstruction error, the writers' whole-layer records.

A unit's own work is :mod:`moecompress.engine.unit_work`:

- the whole layer (:func:`~moecompress.engine.whole_work.whole_parts`): read whole, every step with every
  rule it has (cross-expert steps, router or shared-expert changes, statistics that follow the layer);
  each step's part carries its report row and its tensors, written as the part is taken;
- a unit of experts ``[a, b)`` (:func:`~moecompress.engine.unit_work.chunk_parts`): the layer's shell is
  read once and the ``select`` steps (:class:`~moecompress.engine.spec.Chunking`) decide on it, with the
  layer's whole statistics, which experts survive (:func:`~moecompress.engine.unit_work.prepare`); the
  unit's experts are read (:meth:`Checkpoint.read_experts`), taken through every step in order, and each
  written step's writer receives the unit's tensors at once: per-expert names under their new ids, fused
  ``[E, ...]`` tensors as segments (:meth:`ShardWriter.append`). At the end the whole output layer, on the
  ``meta`` device (:func:`moecompress.engine.chunks.join_bank`), gives the router tensors, the index
  vectors, the description, the shapes and the report rows, as the whole unit records them. The
  reconstruction error on the held-back tokens is a sum over the units (the router and the shared expert
  once). A quantised input's layer that only selections touched is written in its on-disk encoding
  (:func:`moecompress.io.raw.raw_selection`);
- units of groups of a merging step (``Chunking('group')``, :func:`_grouped_layer`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moecompress.engine import chunks
from moecompress.engine.group_work import trial as trial_info
from moecompress.engine.group_work import unit_parts
from moecompress.engine.journal import UNITS
from moecompress.engine.resources import release_freed, rss_mb
from moecompress.engine.shard import (
    blocked,
    grouped_units,
    layer_chunks,
    send_command,
    send_prepare,
    share_choice,
)
from moecompress.engine.unit_work import ErrPart, StepPart, prepare
from moecompress.engine.units import memory_limit as units_memory_limit
from moecompress.engine.units import unit_size
from moecompress.engine.whole_work import whole_parts
from moecompress.engine.wire import FileBytes
from moecompress.errors import PassError
from moecompress.io.format import encode_layer, encode_routing, layer_shape
from moecompress.io.quantized import check_stock_output
from moecompress.io.raw import raw_selection, write_raw
from moecompress.io.routing import stored_policy
from moecompress.ir import ExpertBank, MoELayer
from moecompress.methods.metrics import relative_error, sqnr_db
from moecompress.report.write import json_safe

RecipeRun = Any
"""The run's state (:class:`moecompress.engine.run.RecipeRun`, which calls this module: not imported here)."""


@dataclass
class Books:
    """What the loop keeps of a layer until its last unit is consumed: per step, the units' skeleton banks,
    infos and bounds, whether it changed the layer, its seconds; the written steps, the chunks' on-disk
    form, the error sums, the steps written raw; a whole-layer unit's rows (``whole``)."""

    shells: list
    infos: dict
    secs: list[float]
    written: list[int]
    changed: list[bool]
    err: Any = None
    raw: dict = field(default_factory=dict)
    parts: list[list[ExpertBank]] = field(default_factory=list)
    chunk_infos: list[list[dict]] = field(default_factory=list)
    bnds: list[list[tuple[int, int]]] = field(default_factory=list)
    stock: dict[int, bool] = field(default_factory=dict)
    whole: dict[int, dict] | None = None


def run_layer(run: RecipeRun, idx: int) -> None:
    """MoE layer ``idx`` of ``run``: its units (:func:`moecompress.engine.units.unit_size`), worked in order by
    whichever rank owns each, their parts consumed here (module docstring)."""
    steps = run.rec.steps
    plans = [run.plans.get(s.number, {}).get(idx) for s in steps]
    size = unit_size(run.rec, run.ckpt, run.ctx, idx)
    if size is None:  # one unit: the whole layer, each step with every rule it has
        written = [s for s, step in enumerate(steps) if step.number in run.writers]
        books = Books([], {}, [0.0] * len(steps), written, [False] * len(steps), whole={})
        units: Iterable[Iterable] = [
            whole_parts(run.ckpt, run.rec, run.entry, plans, run.ctx, idx, set(written), run.dequantize)
        ]
    else:
        grouped = [s for s, step in enumerate(steps) if step.spec.chunking.mode == "group"]
        if grouped:  # the other ranks decide the groups as rank 0 does, at the same time
            written = [s for s, step in enumerate(steps) if step.number in run.writers]
            early = [s for s in written if s < grouped[0]]
            if early:
                raise PassError(f"{steps[early[0]].label}, layer {idx}: a step written before a merge by chunks of "
                                "experts; write the merge's output only, or expert_chunk: off")  # fmt: skip
            send_command(run.ctx.ranks, list(steps), idx, size, written)
        elif blocked(steps):  # every rank gathers its blocks of the layer as rank 0 prepares it
            send_prepare(run.ctx.ranks, list(steps), idx, size)
        lp = prepare(run.ckpt, steps, run.entry, plans, run.ctx, idx, size)
        if grouped:
            return _grouped_layer(run, lp, size, grouped[0])
        books, read = _chunk_books(run, idx, lp)
        units = layer_chunks(run.ctx.ranks, lp, size, set(books.written), run.balance) if read else []
    for unit in units:
        for part in unit:  # in unit order, whichever rank worked the unit
            _take(run, idx, books, part)
            del part
        del unit
        release_freed()  # the unit's memory back to the system before the next unit is read
    if books.whole is not None:
        for s, step in enumerate(steps):
            run.rows[step.number].append(books.whole[s])
        return
    _finish(run, idx, books.shells, books.parts, books.infos, books.chunk_infos, books.bnds, books.changed,
            books.secs, books.written, books.stock, books.err, books.raw)  # fmt: skip


def _chunk_books(run: RecipeRun, idx: int, lp) -> tuple[Books, bool]:
    """A layer by units of experts before its first unit: the steps written raw (selections only, on a
    quantised input) written now; whether any unit must be read (``False``: only selections, nothing
    written or measured: the shell's bank, taken, is the output)."""
    steps, shells = run.rec.steps, lp.shells
    raw = _raw_writes(run, idx, steps, shells, lp.kept_of)
    for s, writes in raw.items():
        write_raw(run.writers[steps[s].number], writes)
    written = [s for s, step in enumerate(steps) if step.number in run.writers and s not in raw]
    changed = [shells[s + 1] is not shells[s] for s in range(len(steps))]
    books = Books(shells, lp.infos, lp.secs, written, changed, lp.err, raw, [[] for _ in steps],
                  [[] for _ in steps], [[] for _ in steps])  # fmt: skip
    if lp.err is None and not written and all(step.spec.chunking.mode == "select" for step in steps):
        bank = shells[0].experts
        for s, kept in enumerate(lp.kept_of):
            bank = bank if kept is None else chunks.take(bank, list(kept))
            books.parts[s].append(bank)
        return books, False
    return books, True


def _take(run: RecipeRun, idx: int, books: Books, part: ErrPart | StepPart) -> None:
    """One part of a unit, in unit order."""
    if isinstance(part, ErrPart):
        books.err.add(part)
        return
    s, step = part.s, run.rec.steps[part.s]
    if part.whole is not None:
        return _take_whole(run, idx, step, part, books.whole)  # type: ignore[arg-type]
    books.secs[s] += part.secs
    if part.bound is not None:  # an ``expert`` step
        books.changed[s] = books.changed[s] or part.changed
        books.chunk_infos[s].append(part.info)  # type: ignore[arg-type]
        books.bnds[s].append(part.bound)
    if part.skeleton is not None:
        books.parts[s].append(part.skeleton)
        if s in books.written:
            _write_chunk(run, idx, step.number, part, books.stock)
    run.peak[step.number] = max(run.peak[step.number], rss_mb())


def _take_whole(run: RecipeRun, idx: int, step, part: StepPart, rows: dict[int, dict]) -> None:
    """A whole-layer unit's step: its row and info, and for a written step its tensors to the writer now
    (the layer is not held for the end) with the layer's records."""
    w, number = part.whole, step.number
    assert w is not None
    rows[part.s] = w.row
    run.infos[number][idx] = json_safe(part.info)
    if number in run.writers:
        if w.sel is not None:
            write_raw(run.writers[number], w.sel)
            run.kept_raw[number].add(idx)
        if w.encoded:
            check_stock_output(run.ckpt, idx, w.desc, run.dequantize)
        run.descs[number][idx] = w.desc
        run.shapes[number][idx] = w.shape
        if w.protected:
            run.protected[number][str(idx)] = w.protected
        if w.routing:
            run.routing[number][str(idx)] = w.routing
        run.writers[number].add_many(w.tensors or {})
        w.tensors = None
    run.seconds[number] += part.secs
    run.peak[number] = max(run.peak[number], rss_mb())


def _unit_overrun(run: RecipeRun, lp, size: int, g: int) -> dict | None:
    """A merging step's units, once its groups are decided, against the dry run's unit of ``size``
    members (``Chunking.workspace``: its planned group size): ``None`` when every unit fits that plan; else
    the unit that needs the most (a group larger than the plan's, or larger than ``size``, which a unit
    holds alone: Ward groups are not size-limited), its members and the bytes beyond the plan (the report
    warns). Refused here, before any member is read, in one line, when that unit alone would not fit the
    memory limit."""
    step, dec, shell = lp.steps[g], lp.preludes[g], lp.shells[g]
    work = step.spec.chunking.workspace
    read = -(-shell.experts.nbytes() // max(shell.experts.num_experts, 1))  # one input expert as read
    planned = work(shell, step.config, size) + size * read
    worst, members = planned, size
    for lo, hi in dec.units(size):
        k = len(dec.members(lo, hi))
        need = work(shell, step.config, k, groups=[len(m) for m in dec.plan.groups[lo:hi]]) + k * read
        if need > worst:
            worst, members = need, k
    if worst <= planned:
        return None  # (the report warns when it is over by more than a tenth: expert_merging.summarize_merging)
    limit = units_memory_limit(run.rec)
    if limit is not None and worst > limit:
        raise PassError(
            f"{step.label}, layer {lp.idx}: a unit of {members} experts (its groups merged at once) needs "
            f"about {worst / 2**30:.1f} GiB, over the memory limit of {limit / 2**30:.1f} GiB (Ward groups are "
            "not size-limited); use a smaller ratio, linkage: average, or a machine with more memory"
        )
    return {"members": members, "chunk": size, "extra_bytes": int(worst - planned), "planned_bytes": int(planned)}


def _grouped_layer(run: RecipeRun, lp, size: int, g: int) -> None:
    """A layer whose merging step (``Chunking('group')``, step ``g``) runs by units of groups: the earlier
    steps only protect, the later ones only report (:func:`unit_work.prepare` checks). Each unit
    (:mod:`moecompress.engine.group_work`, worked here or on rank ``k mod N``) gives its members' and its
    output experts' error contributions, added in unit order, and its output experts, written."""
    steps, idx, ranks = run.rec.steps, lp.idx, run.ctx.ranks
    written = [s for s, step in enumerate(steps) if step.number in run.writers]
    step, mode, dec, shells, err = steps[g], steps[g].spec.chunking, lp.preludes[g], lp.shells, lp.err
    secs, stock = lp.secs, {}
    parts: list[list[ExpertBank]] = [[shells[0].experts] for _ in steps]
    parts[g], infos, bnds = [], [], []
    units = dec.units(size)
    # a unit over the dry run's plan: reported (and refused over the memory limit) where the run was planned
    # by chunks; a layer planned whole (shared out by units under torchrun) holds less in any unit
    big = _unit_overrun(run, lp, size, g) if idx in run.ctx.expert_chunks else None
    if dec.sweeps == 2:  # a choice on the whole layer's held-back error first (namex's refinement): unwritten
        t0 = time.perf_counter()
        trial = []
        for info in grouped_units(ranks, lp, units, lambda lo, hi: [StepPart(g, lo, None, 0.0, trial_info(lp, g, lo, hi))]):
            dec.fold(info[0].info)
            trial.append(info[0].info)
            release_freed()
        dec.choose(trial)
        share_choice(ranks, dec)
        secs[g] += time.perf_counter() - t0
    for unit in grouped_units(ranks, lp, units, lambda lo, hi: unit_parts(lp, g, lo, hi, g in written)):
        for part in unit:
            if isinstance(part, ErrPart):
                err.add(part)
                continue
            dec.fold(part.info)
            parts[g].append(part.skeleton)
            infos.append({**part.info, "largest_unit": big} if big is not None and not infos else part.info)
            bnds.append(units[len(bnds)])
            if g in written:
                _write_chunk(run, idx, step.number, part, stock)
            secs[g] += part.secs
        run.peak[step.number] = max(run.peak[step.number], rss_mb())
        del unit
        release_freed()  # the unit's output and its encoded tensors: gone before the next unit is read
    for s in range(g + 1, len(steps)):
        parts[s] = parts[g]
    lp.infos[g] = mode.merge(infos, bnds, dec)
    changed = [shells[s + 1] is not shells[s] for s in range(len(steps))]
    _finish(run, idx, shells, parts, lp.infos, [[] for _ in steps], [[] for _ in steps], changed, secs,
            written, stock, err, {})  # fmt: skip


def _raw_writes(run: RecipeRun, idx: int, steps, shells, kept_of) -> dict[int, list]:
    """The written steps whose layer only selections made, on a quantised input: its on-disk tensors."""
    if run.dequantize or not run.ckpt.quantization:
        return {}
    out, kept = {}, list(range(shells[0].router.num_experts))
    for s, step in enumerate(steps):
        if step.spec.chunking.mode != "select":
            break
        if kept_of[s] is not None:
            kept = [kept[k] for k in kept_of[s]]
        if step.number in run.writers:
            writes = raw_selection(run.ckpt, idx, kept, shells[s + 1])
            if writes is not None:
                out[s] = writes
    return out


def _write_chunk(run: RecipeRun, idx: int, number: int, part: StepPart, stock: dict[int, bool]) -> None:
    """One chunk's encoded routed experts of a written step (:func:`unit_work.encode_chunk`) to its writer:
    per-expert names under their ids in the layer, fused ``[E, ...]`` tensors as segments."""
    w = run.writers[number]
    if stock.setdefault(number, bool(part.stock)) != part.stock:
        raise PassError(
            f"layer {idx}: the chunks' outputs do not share one on-disk form; use expert_chunk: off"
        )
    adopted: list[Path] = []
    for how, name, t in part.writes:
        if isinstance(t, FileBytes):  # another rank wrote its bytes (wire.unit_files): the writer adopts them
            path = run.staging / UNITS / t.file
            if path not in adopted:
                w.adopt(path)
                adopted.append(path)
            if how == "add":
                w.add_from(name, t.dtype, t.shape, path, t.offset)
            else:
                w.append_from(name, t.dtype, path, t.offset, t.nbytes)
        elif how == "add":
            w.add(name, t)
        else:
            w.append(name, t)
    for path in adopted:
        w.release(path)
    part.writes = []


def _finish(
    run, idx, shells, parts, infos, chunk_infos, bnds, changed, secs, written, stock, err, raw
) -> None:
    """Report rows, infos and the written layers' whole-layer bookkeeping (module docstring)."""
    steps = run.rec.steps
    before = shells[0]
    errors = {"rel_error": 0.0, "sqnr_db": float("inf"), "massive_ratio": 1.0}
    hy = err.output(0) if err is not None else None
    for s, step in enumerate(steps):
        if step.spec.report_only:
            new = before
        else:
            new = shells[s + 1].replace(experts=chunks.join_bank(parts[s]))
        if s not in infos:
            infos[s] = step.spec.chunking.merge(chunk_infos[s], bnds[s], step.config)
        row = {
            "layer": idx, "params_before": before.num_params(), "params_after": new.num_params(),
            "bytes_before": before.nbytes(), "bytes_after": new.nbytes(), "seconds": round(secs[s], 4),
            "changed": changed[s],
        }  # fmt: skip
        if err is not None:
            if changed[s]:
                approx = err.output(s + 1)
                top0, top = err.tops[0].value, err.tops[s + 1].value
                errors = {"rel_error": relative_error(hy, approx), "sqnr_db": sqnr_db(hy, approx),
                          "massive_ratio": top / top0 if top0 > 0 else 1.0}  # fmt: skip
            row.update(errors)
        run.rows[step.number].append(row)
        run.infos[step.number][idx] = json_safe(infos[s])
        if step.number in run.writers:
            _record(run, idx, step.number, new, s in raw, stock.get(step.number))
        run.seconds[step.number] += secs[s]
        before = new


def _record(run, idx: int, number: int, new: MoELayer, raw: bool, stock: bool | None) -> None:
    """The whole layer's part of a written step: router, index vectors, description, shapes."""
    ad, w = run.ckpt.adapter, run.writers[number]
    if raw:
        run.descs[number][idx] = None
        run.kept_raw.setdefault(number, set()).add(idx)
    else:
        tensors, desc = encode_layer(ad, new)
        if stock is not None and (desc is None) != stock:
            raise PassError(
                f"layer {idx}: the chunks' on-disk form disagrees with the layer's; use expert_chunk: off"
            )
        if desc is None:
            tensors = {**ad.layer_tensors(new), **encode_routing(ad, new)}
        for name, t in tensors.items():
            if t.device.type != "meta":
                w.add(name, t)
            elif name in w.pending:
                w.end(name, t.shape)
            elif not w.written(name):
                raise PassError(f"layer {idx}: tensor {name!r} of the layer was not written by its chunks")
        check_stock_output(run.ckpt, idx, desc, run.dequantize)
        run.descs[number][idx] = desc
    run.shapes[number][idx] = layer_shape(new)
    if new.protected:
        run.protected[number][str(idx)] = sorted(new.protected)
    if new.routing:
        run.routing[number][str(idx)] = stored_policy(new)
