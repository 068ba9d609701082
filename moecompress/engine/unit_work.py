"""The work of one unit of an MoE layer (:mod:`moecompress.engine.layer_run`), apart from what is done with it.

A layer that is one unit is :func:`moecompress.engine.whole_work.whole_parts`'s: one :class:`StepPart` per
step carrying its row and tensors (:class:`WholeStep`, defined here). This module is a unit of experts
``[a, b)`` of a layer held by chunks:

:func:`prepare` is the layer's part every rank repeats (cheap and deterministic): the shell, the
``select`` steps on it, the output kinds, the routing of the held-back tokens. :func:`chunk_parts` is a
chunk's own work (reading and dequantising its experts, every step on them, their contribution to the
reconstruction error, the encoding of every written step's tensors); it yields :class:`ErrPart` and
:class:`StepPart` values, which :mod:`moecompress.engine.layer_run` consumes in chunk order (the
accumulation, the writers, the report). In one process a chunk's parts are consumed as they are
yielded; under ``torchrun`` the chunk may be worked by another rank and its parts sent to rank 0
(:mod:`moecompress.engine.shard`). The maths of a chunk is the same either way, so the bytes are.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moecompress.calibration.cache import ExpertRows, LayerRows, load_layer
from moecompress.calibration.mapping import map_neurons
from moecompress.calibration.stats import SPILLED
from moecompress.engine import block_sweep, chunks, follow
from moecompress.engine.context import RunContext
from moecompress.engine.held_back import Errors, ErrPart
from moecompress.engine.pair_sweep import sweep_pairs
from moecompress.engine.protection import RENUMBER_KEY
from moecompress.engine.resources import release_freed
from moecompress.engine.spec import KEPT_NEURONS
from moecompress.engine.steps import run_step, step_stats
from moecompress.engine.team import Team
from moecompress.engine.units import on_team
from moecompress.errors import MoecompressError, PassError
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.format import encode_bank, is_stock
from moecompress.ir import ExpertBank, MoELayer, layer_to
from moecompress.layouts import LAYOUTS


@dataclass
class StepPart:
    """Step ``s`` on one chunk: its output bank's :func:`skeleton` (``None``: the chunk lost every expert),
    the id of its first expert in the step's output, an ``expert`` step's ``info``, ``bound`` and whether it
    changed the chunk, the seconds, and for a written step the encoded tensors (:func:`encode_chunk`)."""

    s: int
    g0: int
    skeleton: ExpertBank | None
    secs: float
    info: dict | None = None
    bound: tuple[int, int] | None = None
    changed: bool = False
    stock: bool | None = None
    writes: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)
    whole: WholeStep | None = None
    """a whole-layer unit's step (:func:`whole_parts`): its row and what it writes"""


@dataclass
class WholeStep:
    """What a step on a whole-layer unit hands the consumer beyond a chunk's part: its report row (sizes and
    the cumulative reconstruction errors on the held-back tokens), and for a written step what the writer
    receives: a quantised input's on-disk tensors (an unchanged layer: ``tensors``; only selected experts:
    ``sel``) or the encoded layer (``tensors`` with ``encoded``, ``desc``), and the layer's records."""

    row: dict
    tensors: dict[str, torch.Tensor] | None = None
    sel: list | None = None
    encoded: bool = False
    desc: dict | None = None
    shape: Any = None
    protected: list[int] | None = None
    routing: dict | None = None


@dataclass
class LayerPlan:
    """What :func:`prepare` decides for MoE layer ``idx``: ``shells[s]`` is the layer before step ``s``
    (experts on ``meta``), ``kept_of[s]`` a ``select`` step's kept experts, ``kinds[s]`` an ``expert``
    step's output kind, ``infos`` the ``select`` steps' infos, ``secs`` their seconds."""

    idx: int
    steps: list
    ckpt: Checkpoint
    ctx: RunContext
    stats: dict
    plans: list
    shells: list[MoELayer]
    kept_of: list
    kinds: list
    infos: dict[int, dict]
    secs: list[float]
    err: Errors | None
    rows: ExpertRows | LayerRows | None = None
    """the per-expert covariances a chunked calibration wrote apart, read chunk by chunk"""
    preludes: dict[int, Any] = field(default_factory=dict)
    """an ``expert`` step's ``Chunking.prelude`` result, computed once for the layer"""
    team: Any = None
    """the layer's units worked at the same time, one per rank (:class:`~moecompress.engine.team.Team`), given
    to each unit's steps as ``stats.team``; ``None``: units worked one after another"""


def skeleton(bank: ExpertBank) -> ExpertBank:
    """``bank`` on the ``meta`` device but for its small index vectors (what joining chunks needs)."""

    def light(t: torch.Tensor) -> torch.Tensor:
        return (
            t.to("cpu") if t.dim() == 1 and not t.is_floating_point() else torch.empty_like(t, device="meta")
        )

    lays = [LAYOUTS[lay.kind].from_tensors({k: light(t) for k, t in lay.tensors().items()}, lay.meta())
            for lay in (bank.gate, bank.up, bank.down)]  # fmt: skip
    return ExpertBank(
        *lays, widths=None if bank.widths is None else bank.widths.to("cpu"),
        biases={k: light(v) for k, v in bank.biases.items()}, act=bank.act, alpha=bank.alpha, limit=bank.limit,
        rotation=None if bank.rotation is None else light(bank.rotation), act_bits=bank.act_bits,
        unrotated=bank.unrotated,
    )  # fmt: skip


def _shell_step(step, shell: MoELayer, st) -> tuple[MoELayer, dict]:
    """A ``select`` step on the layer's shell, with errors naming the step and the layer."""
    try:
        new, info = step.spec.fn(shell, st, step.config)
    except MoecompressError as err:
        raise PassError(f"{step.label}, layer {shell.index}: {err}") from None
    if step.spec.report_only:
        return shell, info
    kept = info.get(RENUMBER_KEY)
    gone = sorted(p for p in shell.protected if kept is not None and p not in set(kept))
    if gone:
        raise PassError(f"{step.label}, layer {shell.index}: protected expert {gone[0]} was removed")
    return new, info


def prepare(
    ckpt: Checkpoint, steps: list, entry: Path | None, plans: list[Any], ctx: RunContext, idx: int,
    size: int | None = None,
) -> LayerPlan:  # fmt: skip
    """The layer's part of an expert-chunked run (module docstring); ``plans[s]``: step ``s``'s decision;
    ``size``: experts per chunk, for a two-phase step's first sweep (``Chunking.gather``, :func:`gather`)."""
    dev, host = torch.device(ctx.device), torch.device("cpu")
    shell0 = ckpt.read_layer_shell(idx)
    # the per-expert covariances: by rows, from the per-expert files of a chunked calibration or the layer's own
    stats = {host: load_layer(entry, idx, experts=False, skip=frozenset(SPILLED)) if entry is not None else {}}
    if dev != host:
        stats[dev] = {k: v.to(dev) for k, v in stats[host].items()}
    secs = [0.0] * len(steps)
    shells, kept_of, kinds, infos, preludes = [shell0], [], [], {}, {}
    units = idx not in ctx.expert_chunks  # shared out by units under torchrun, not chunked by request
    for s, step in enumerate(steps):  # the selections, once per layer, on the shell
        mode = step.spec.chunking
        if mode is None:
            raise PassError(
                f"{step.label}, layer {idx}: the step needs every expert at once; use expert_chunk: off"
            )
        t0 = time.perf_counter()
        st = step_stats(step, idx, stats[host], plan=plans[s])
        if mode.mode == "select":
            new, infos[s] = _shell_step(step, shells[-1], st)
            kept_of.append(infos[s].get(RENUMBER_KEY) if new is not shells[-1] else None)
            kinds.append(None)
        elif mode.mode == "group":  # the layer after it: from its first sweep's decision, below
            _check_group(steps, s, kept_of, idx)
            why = mode.refuse(step.config) if mode.refuse is not None else None
            if why is not None:
                raise PassError(f"{step.label}, layer {idx}: {why}")
            new = shells[-1]
            kept_of.append(None)
            kinds.append(None)
        else:
            new = shells[-1]
            kept_of.append(None)
            kinds.append(mode.kind(shells[-1], st, step.config) if mode.kind is not None else None)
            why = mode.refuse_layer(new, step.config) if mode.refuse_layer is not None else None
            if why is not None:
                raise PassError(f"{step.label}, layer {idx}: {why}")
            if mode.prelude is not None and not mode.phases(step.config, units):  # once per layer (a rotation of the MoE input), given to every chunk
                try:
                    preludes[s] = mode.prelude(new, st, step.config)
                except MoecompressError as e:
                    raise PassError(f"{step.label}, layer {idx}: {e}") from None
        secs[s] += time.perf_counter() - t0
        shells.append(new)
    rows = None
    if entry is not None:
        rows = ExpertRows(entry, idx)
        rows = rows if rows else LayerRows(entry, idx, frozenset(SPILLED))
    lp = LayerPlan(idx, steps, ckpt, ctx, stats, plans, shells, kept_of, kinds, infos, secs, None, rows, preludes,
                   Team(ctx.ranks) if on_team(steps, ctx, idx, size) else None)  # fmt: skip
    for s, step in enumerate(steps):
        if step.spec.chunking.phases(step.config, units):
            if size is None:
                raise PassError(f"{step.label}, layer {idx}: a two-phase step needs the chunk size to gather")
            t0 = time.perf_counter()
            preludes[s] = gather(lp, s, size)
            secs[s] += time.perf_counter() - t0
            if step.spec.chunking.mode == "group":  # the merged layer's shell, for this step and the later ones
                placeholder = shells[s + 1]
                for j in range(s + 1, len(shells)):
                    if shells[j] is placeholder:
                        shells[j] = preludes[s].shell
    hx = stats[dev].get("holdout_x")
    lp.err = Errors(shells, hx.to(ctx.dtype), dev, ctx.dtype) if hx is not None else None
    return lp


def _check_group(steps: list, s: int, kept_of: list, idx: int) -> None:
    """A merging step by chunks (``Chunking('group')``) is the first step of its segment that changes the
    layer and the last (report-only steps aside): its units are groups, not chunks of the input."""
    step = steps[s]
    for j, other in enumerate(steps):
        if j == s or other.spec.report_only or not other.spec.alters_for(other.config):
            continue
        if j < s and other.spec.chunking.mode == "select" and kept_of[j] is None:
            continue
        where = "before" if j < s else "after"
        raise PassError(f"{step.label}, layer {idx}: merges groups of experts read group by group, which "
                        f"{other.label} {where} it cannot follow on a layer held by chunks; run it in its "
                        "own recipe, or expert_chunk: off")  # fmt: skip


def gather(lp: LayerPlan, s: int, size: int) -> Any:
    """Step ``s``'s first phase (``Chunking.gather``): every chunk of ``size`` experts of the layer read, the
    earlier ``select`` steps applied, folded in chunk order; then ``Chunking.fit`` once with the layer's
    statistics: the value every chunk's step reads as ``stats.prelude`` (no chunk read when ``Chunking.reads``
    says so). With ``Chunking.pairs``, every pair
    of chunks instead (:func:`~.pair_sweep.pair_order`). With ``Chunking.take``, by fixed blocks instead
    (:mod:`~moecompress.engine.block_sweep`: under ``torchrun`` each rank gathers its blocks and every rank adds
    all of them in block order); otherwise every rank repeats it under ``torchrun`` (the same fold in the same
    order: the same value)."""
    step, mode, idx = lp.steps[s], lp.steps[s].spec.chunking, lp.idx
    where = torch.device(lp.ctx.device) if step.spec.on_device else torch.device("cpu")
    acc: Any = None
    try:
        if mode.reads is not None and not mode.reads(step.config):
            pass  # nothing to gather from the experts: fit from the shell and the statistics
        elif mode.pairs is not None and mode.pairs(step.config):
            acc = _gather_pairs(lp, s, list(chunks.bounds(lp.shells[0].router.num_experts, size)), where)
        elif mode.take is not None:  # by fixed blocks, shared out over the ranks
            def read(a: int, b: int) -> Any:
                return _gathered_chunk(lp, s, a, b, where)

            ranges = block_sweep.blocks(lp.shells[s].router.num_experts, lp.kept_of[:s])
            acc = block_sweep.sweep(step, idx, ranges, size, read, lp.ctx.ranks)
        else:
            for a, b in chunks.bounds(lp.shells[0].router.num_experts, size):
                got = _gathered_chunk(lp, s, a, b, where)
                if got is not None:
                    acc = mode.gather(got[0], got[1], step.config, acc)
                del got
                release_freed()
        st = step_stats(step, idx, lp.stats[where], plan=lp.plans[s])
        return mode.fit(acc, lp.shells[s], st, step.config)
    except PassError:
        raise
    except MoecompressError as e:
        raise PassError(f"{step.label}, layer {idx}: {e}") from None


def _gather_pairs(lp: LayerPlan, s: int, bounds: list[tuple[int, int]], where: torch.device) -> Any:
    """The first sweep over pairs of chunks (``Chunking.pair``, :func:`~.pair_sweep.sweep_pairs`: two chunks
    held at once); ``Chunking.gather`` on each chunk as it is the anchor (chunk order)."""
    step, mode = lp.steps[s], lp.steps[s].spec.chunking
    e_s, acc = lp.shells[s].router.num_experts, None

    def visit(i: int, j: int, a, b) -> None:
        nonlocal acc
        if a is not None and b is not None:
            if i == j:
                acc = mode.gather(a[0], a[1], step.config, acc)
            acc = mode.pair(a[0], b[0], step.config, (a[2], b[2]), e_s, acc)

    sweep_pairs(len(bounds), lambda k: _gathered_chunk(lp, s, *bounds[k], where), visit)
    return acc


def _gathered_chunk(lp: LayerPlan, s: int, a: int, b: int, where: torch.device):
    """Experts ``[a, b)`` of the input read, the steps before ``s`` (``select``) applied: ``(sub-layer, its
    statistics, its first expert in step ``s``'s numbering)``, or ``None`` when no expert is left."""
    step, idx, e_s = lp.steps[s], lp.idx, lp.shells[s].router.num_experts
    bank: ExpertBank | None = lp.ckpt.read_experts(idx, a, b)
    g0 = a
    for j, earlier in enumerate(lp.steps[:s]):
        if earlier.spec.chunking.mode != "select":
            if earlier.spec.report_only or not earlier.spec.alters_for(earlier.config):
                continue
            raise PassError(f"{step.label}, layer {idx}: gathers every chunk before {earlier.label} "
                            "has run on it; set calibration.recalibrate: auto or expert_chunk: off")  # fmt: skip
        local, g1 = chunks.selected(lp.kept_of[j], g0, g0 + bank.num_experts)  # type: ignore[union-attr]
        if lp.kept_of[j] is not None:
            bank = chunks.take(bank, local) if local else None  # type: ignore[arg-type]
        g0 = g1
        if bank is None:
            return None
    n = bank.num_experts
    sub = layer_to(chunks.sub_layer(lp.shells[s], bank, g0), where)
    st = step_stats(step, idx, _chunk_stats(lp, step, where, e_s, g0, g0 + n),
                    plan=chunks.slice_plan(lp.plans[s], e_s, g0, g0 + n), first=g0)  # fmt: skip
    return sub, st, g0


def _chunk_stats(
    lp: LayerPlan, step, where, e_s: int, a: int, b: int, mapped: dict[str, torch.Tensor] | None = None,
    names: set[str] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Experts ``[a, b)``'s statistics for ``step`` (or ``names``): the layer file's narrowed, and the rows
    of the per-expert covariances a chunked calibration wrote apart (read now, for this chunk only); those
    the chunk mapped through its neuron-subset steps (``mapped``) in their place."""
    out = chunks.slice_stats(lp.stats[where], e_s, a, b)
    out.update({k: v.to(where) for k, v in (mapped or {}).items()})
    want = set(step.needs if names is None else names) - set(out)
    if lp.rows and want & set(lp.rows.names):
        if e_s != lp.rows.num_experts:  # the dry run refuses statistics that would have to follow the layer
            raise PassError(f"{step.label}, layer {lp.idx}: its per-expert statistics describe "
                            f"{lp.rows.num_experts} experts, the layer has {e_s}; use expert_chunk: off")  # fmt: skip
        out.update({k: v.to(where) for k, v in lp.rows.rows(a, b, want).items()})
    return out


def _map_neurons(
    lp: LayerPlan, s: int, where, e_s: int, g0: int, n: int, mapped: dict[str, torch.Tensor], kept: list,
    width: int,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """After neuron-subset step ``s`` on a chunk of ``n`` experts (``kept``: each one's kept neurons), the
    per-expert statistics later steps read mapped (``follow.mapped_later``; :func:`follow.by_units` allowed no
    other) mapped as the whole layer maps them (:func:`~moecompress.calibration.mapping.map_neurons`)."""
    try:
        names = follow.mapped_later(lp.steps, s) & follow.UNIT_MAPPED
    except MoecompressError:
        return mapped
    if not names:
        return mapped
    src = _chunk_stats(lp, lp.steps[s], where, e_s, g0, g0 + n, mapped, names)
    got = map_neurons({k: src[k] for k in names if k in src}, kept, width, torch.ones(n))
    return {**mapped, **got}


def chunk_parts(lp: LayerPlan, a: int, b: int, written: set[int]) -> Iterator[ErrPart | StepPart]:
    """Experts ``[a, b)`` of the layer through every step (module docstring); ``written``: the steps whose
    tensors are encoded here."""
    idx, steps = lp.idx, lp.steps
    dev, host = torch.device(lp.ctx.device), torch.device("cpu")
    cur: MoELayer | None = chunks.sub_layer(lp.shells[0], lp.ckpt.read_experts(idx, a, b), a)
    g0 = a
    mapped: dict[str, torch.Tensor] = {}  # statistics this chunk mapped to its kept neurons (rows: its experts)
    if lp.err is not None:
        yield lp.err.part(0, cur.experts, g0)
    for s, step in enumerate(steps):
        if cur is None:
            break
        t0 = time.perf_counter()
        info, bound, changed = None, None, False
        if step.spec.chunking.mode == "select":
            local, g0 = chunks.selected(lp.kept_of[s], g0, g0 + cur.experts.num_experts)
            bank = (
                cur.experts if lp.kept_of[s] is None else chunks.take(cur.experts, local) if local else None
            )
            new = None if bank is None else chunks.sub_layer(lp.shells[s + 1], bank, g0)
            if mapped and lp.kept_of[s] is not None and local:
                rows = torch.as_tensor(local, dtype=torch.long)
                mapped = {k: v[rows.to(v.device)] for k, v in mapped.items()}
        else:
            where = dev if step.spec.on_device else host
            cur = layer_to(cur, where)
            n, e_s = cur.experts.num_experts, lp.shells[s].router.num_experts
            pre = lp.preludes.get(s)
            pre = pre.chunk(g0, g0 + n) if hasattr(pre, "chunk") else pre
            st = step_stats(step, idx, _chunk_stats(lp, step, where, e_s, g0, g0 + n, mapped),
                            plan=chunks.slice_plan(lp.plans[s], e_s, g0, g0 + n), prelude=pre, first=g0,
                            team=lp.team)  # fmt: skip
            new, info = run_step(step, cur, st)
            new = chunks.as_kind(cur, new, lp.kinds[s])
            if new.router_weight is not cur.router_weight or new.shared is not cur.shared:
                raise PassError(f"{step.label}, layer {idx}: the step changed the router or the shared expert, "
                                "which a layer held by chunks of experts cannot follow; use expert_chunk: off")  # fmt: skip
            changed, bound = new is not cur, (g0, g0 + n)
            if changed and info.get(KEPT_NEURONS) is not None:
                mapped = _map_neurons(lp, s, where, e_s, g0, n, mapped, info[KEPT_NEURONS], new.experts.width)
        part = StepPart(s, g0, None, time.perf_counter() - t0, info, bound, changed)
        if new is not None:
            part.skeleton = skeleton(new.experts)
            if lp.err is not None:
                yield lp.err.part(s + 1, new.experts, g0)
            if s in written:
                part.stock, part.writes = encode_chunk(lp.ckpt, idx, layer_to(new, host), g0)
        yield part
        del part
        cur = new


def encode_chunk(
    ckpt: Checkpoint, idx: int, out: MoELayer, g0: int, stock: bool | None = None
) -> tuple[bool, list[tuple[str, str, torch.Tensor]]]:
    """One chunk's routed experts of a written step, as ``(stock, [(how, name, tensor)])``: ``how`` is
    ``add`` for per-expert names under their ids in the layer, ``append`` for segments of fused ``[E, ...]``
    tensors; index vectors and the router come with the whole layer. The bank's input rotation (one
    ``[H, H]`` for the layer, the same in every chunk) and its layouts' shared tensors (``Layout.shared``:
    ``Tucker``'s factors) are added by the chunk holding the layer's first expert (``g0 == 0``). ``stock``:
    the layer's on-disk form when the chunk alone cannot tell it (merged experts: the expert map)."""
    ad = ckpt.adapter
    rotation = f"{ad.experts_key(idx)}.rotation"
    once = {rotation} | {f"{ad.experts_key(idx)}.{p}.{k}" for p in chunks.PROJ
                         for k in type(getattr(out.experts, p)).shared}  # fmt: skip
    mode = is_stock(out, ad) if stock is None else stock
    if mode:
        skip = set(ad.router_keys(idx))
        tensors = ad.layer_tensors(out)
    else:
        skip, tensors = set(), {}
        encode_bank(out.experts, ad.experts_key(idx), tensors)
    writes = []
    for name, t in tensors.items():
        if name in skip or (t.dim() == 1 and not t.is_floating_point()):
            continue
        if not mode and name in once:
            if g0 == 0:
                writes.append(("add", name, t))
            continue
        e = ad.expert_of(name)
        if mode and e is not None:
            writes.append(("add", ad.renumber_key(name, e + g0), t))
        else:
            writes.append(("append", name, t))
    return mode, writes
