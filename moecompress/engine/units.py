"""A layer's units (ranges of experts): the one place that reads the steps' per-expert rules
(``PassSpec.chunking``) to decide them. The run asks :func:`unit_size` (one unit, the whole layer; or units
of ``expert_chunk``'s size; or ``ceil(E / 4N)`` (:data:`LOOP_UNITS_PER_RANK`) under ``N`` ranks); the dry run decides which MoE layers are
held by chunks of experts, how many experts at a time, and what a step needs then (``expert_chunk: auto |
off | N``):

- ``N``: every layer with more than ``N`` routed experts, ``N`` at a time; ``off``: none;
- ``auto``: the layers whose whole-layer estimate of some step (:func:`moecompress.engine.resources.step_peak`)
  exceeds the memory limit (``calibration.memory_limit``, else what the machine has available), with the
  largest chunk whose estimate fits (balanced: ``ceil(E / chunks)``).

A chunked layer's step estimate is the same :func:`step_peak` on a chunk's sub-layer (its experts, router
rows and the shared expert), plus the rest of the shell (the router's other rows) and the running sums of
the reconstruction error. Steps that need every expert at once (no ``PassSpec.chunking``) are refused on a
chunked layer here, with the figure they need whole and the fix; so is ``calibration.propagate:
compressed``.
"""

from __future__ import annotations

import math

import torch

from moecompress.engine import chunks, follow, resources
from moecompress.engine.context import RunContext
from moecompress.engine.recipe import Recipe
from moecompress.errors import MoecompressError, RecipeError
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.outputs import parse_size
from moecompress.ir import MoELayer

GiB = resources.GiB

LOOP_UNITS_PER_RANK = 4
"""Under ``N`` ranks a layer the run does not chunk goes through the layer loop in ``N · LOOP_UNITS_PER_RANK`` units
(calibration keeps ``calibration.expert_sharded.UNITS_PER_RANK``): finer units let rank 0 give the other ranks more of them when it is the
slower one (:mod:`moecompress.engine.balance`), and each rank holds less at a time."""


def memory_limit(recipe: Recipe) -> int | None:
    """``calibration.memory_limit``, else the memory available on this machine (``None``: unknown)."""
    c = recipe.calibration
    return parse_size(c.memory_limit) if c.memory_limit is not None else resources.available_memory()


def fixed_chunks(recipe: Recipe, ckpt: Checkpoint) -> dict[int, int]:
    """``expert_chunk: N``: every layer (not stored in the moecompress format) with more than N experts."""
    n = recipe.expert_chunk
    if not isinstance(n, int):
        return {}
    return {i: n for i in ckpt.moe_layer_indices if i not in ckpt.layouts and ckpt.adapter.num_experts > n}


def auto_chunk(
    recipe: Recipe, ckpt: Checkpoint, i: int, layer: MoELayer, whole: int, dtype: torch.dtype, stats: int,
    written: list, limit: int, spilled: int = 0,
) -> int | None:  # fmt: skip
    """``auto``'s chunk size for layer ``i`` whose whole-layer estimate is ``whole`` (``None``: whole)."""
    if whole <= limit or not chunkable(recipe, ckpt, i, layer):
        return None
    size = auto_size(recipe, layer, dtype, stats, written, limit, spilled)
    return size if size is not None and size < layer.experts.num_experts else None


def chunkable(recipe: Recipe, ckpt: Checkpoint, i: int, layer: MoELayer | None = None, units: bool = False) -> bool:
    """Whether MoE layer ``i`` can be held by chunks under ``recipe`` (stock tensors, every step able);
    ``layer``: its shapes (read from the shard headers when not given); ``units``: shared out by units under
    ``torchrun``, where statistics mapped per expert follow the layer too (:func:`follow.by_units`)."""
    if i in ckpt.layouts:
        return False
    if follow.required(recipe.steps, recipe.recalibrates) and not (units and follow.by_units(recipe.steps, recipe.recalibrates)):
        return False
    if follow.gather_conflict(recipe.steps, recipe.recalibrates) is not None or group_conflict(recipe.steps, recipe.recalibrates):
        return False
    if any(refusal(s) is not None for s in recipe.steps):
        return False
    if any(s.spec.chunking.refuse_layer is not None for s in recipe.steps):
        if layer is None:  # a stock layer (the others are never chunked) from its shard headers
            layer = ckpt.read_layer_with(i, lambda names: {n: ckpt.reader.meta(n) for n in names})
        return all(refusal(s, layer) is None for s in recipe.steps)
    return True


def calibration_cap(
    recipe: Recipe, ckpt: Checkpoint, dtype: torch.dtype, limit: int, stats: dict[str, int] | None = None
) -> int | None:
    """``auto``: the number of experts per chunk, the same for every chunkable MoE layer, with which
    calibration's estimate (:func:`resources.estimate`) fits ``limit``; ``None`` when calibration fits with
    whole layers (or cannot fit even by single experts: :func:`resources.check` then refuses it). Balanced:
    the chunks of the largest size that fits, made equal (8 experts, 5 fit: 4 + 4)."""
    if recipe.calibration.data_free:
        return None
    layers = [i for i in ckpt.moe_layer_indices if chunkable(recipe, ckpt, i)]

    def need(n: int | None) -> int:
        cut = {} if n is None else {i: n for i in layers}
        return resources.estimate(recipe, ckpt, dtype, chunks=cut, stats=stats)["calibration_memory_bytes"]

    if not layers or need(None) <= limit or need(1) > limit:
        return None
    e = ckpt.adapter.num_experts
    lo, hi = 1, e
    while lo < hi:  # the estimate grows with n: the largest n that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= limit else (lo, mid - 1)
    return math.ceil(e / math.ceil(e / lo))  # balanced: as many chunks, none smaller than the others


def group_conflict(steps, recalibrate: bool | str = False) -> tuple | None:
    """``(merge, other)``: a merging step by chunks (``Chunking('group')``, its units groups of experts) with
    a step that changes the layer in the same segment (the recipe, or what ``recalibrate`` cuts of it: only
    selections of no expert, such as protection, may come before it; only reports after it); ``None``: none."""
    seg = follow.segment_of(steps, recalibrate)
    for s, step in enumerate(steps):
        if step.spec.chunking is None or step.spec.chunking.mode != "group":
            continue
        for j, other in enumerate(steps):
            if seg[j] != seg[s] or j == s or other.spec.report_only or not other.spec.alters_for(other.config):
                continue
            if j < s and other.spec.chunking is not None and other.spec.chunking.mode == "select":
                continue
            return step, other
    return None


def refusal(step, layer: MoELayer | None = None) -> str | None:
    """Why ``step`` cannot run on a layer held by chunks (``None``: it can); with ``layer`` (its shapes),
    also why it cannot on that layer (``Chunking.refuse_layer``)."""
    mode = step.spec.chunking
    if mode is None:
        return "needs every expert of the layer at once"
    why = mode.refuse(step.config) if mode.refuse is not None else None
    if why is None and layer is not None and mode.refuse_layer is not None:
        why = mode.refuse_layer(layer, step.config)
    return why


def chunk_stats(stats: int, spilled: int, n: int, num_experts: int) -> int:
    """The statistics bytes a chunk of ``n`` experts holds: the layer's ``stats`` less the per-expert
    covariances (``spilled``), plus their rows for the chunk (once: the second copy while the rows are
    joined is the first step's loading phase, :func:`~moecompress.engine.resources.step_peak`; counted here
    too it was counted three times, and gptq's estimate at 64 DeepSeek-V3 experts was 1.49x its peak)."""
    return stats - spilled + -(-spilled * n // max(num_experts, 1))


def chunk_peaks(
    recipe: Recipe, layer: MoELayer, n: int, dtype: torch.dtype, stats: int, written: list, spilled: int = 0
) -> list[int]:
    """Estimated peak bytes of every step on layer ``layer`` (``meta``) held by chunks of ``n`` experts.
    ``stats``: the layer's statistics bytes, of which ``spilled`` are per-expert covariances that a chunk
    reads by rows (:class:`~moecompress.calibration.cache.ExpertRows`): a chunk holds its share, twice
    while the rows are joined (:func:`chunk_stats`)."""
    stats = chunk_stats(stats, spilled, n, layer.experts.num_experts)
    sub = chunks.sub_layer(layer, chunks.meta_bank(layer.experts, 0, n), 0)
    rest = (layer.nbytes() - layer.experts.nbytes()) - (sub.nbytes() - sub.experts.nbytes())
    c = recipe.calibration
    sums = (
        0 if c.data_free else (len(recipe.steps) + 1) * c.holdout_samples * c.seq_len * layer.hidden_size * 4
    )
    out, before = [], sub
    for k, step in enumerate(recipe.steps):
        after = before
        if step.spec.chunking is not None and step.spec.chunking.mode == "expert":
            try:
                after = step.spec.emitted(before, step.config)
            except MoecompressError:  # a shape rule meant for a whole layer: the chunk as an upper bound
                after = before
        chunking = step.spec.chunking
        if chunking is not None and chunking.workspace is not None and chunking.mode == "group":
            out.append(_unit_peak(layer, before, step, n, dtype, stats, k == 0, step in written) + rest + sums)
            continue  # the later steps only report: the unit's input stands for their layer (an upper bound)
        if chunking is not None and chunking.workspace is not None:  # a two-phase step: both phases
            work = chunking.workspace(before, step.config)
        else:
            work = step.spec.workspace(before, step.config) if step.spec.workspace is not None else 0
        peak = resources.step_peak(before, after, dtype, stats, work, first=k == 0, written=step in written)
        out.append(peak + rest + sums)
        before = after
    return out


def _unit_peak(layer: MoELayer, unit: MoELayer, step, n: int, dtype: torch.dtype, stats: int, first: bool,
               written: bool) -> int:  # fmt: skip
    """A merging step's peak on a unit of ``n`` members (``unit``: its input, ``meta``) of ``layer``, the
    larger of two phases (``layer_run._grouped_layer``): the merges (``Chunking.workspace``: the layer's
    summaries, the unit's float32 copies, the output bank made from them), then, once they are freed, the
    unit's output (``n·t/E`` experts, ``t`` the layer's groups after the step) with its encoded tensors or
    its cast for the reconstruction error. Measured at 64 DeepSeek-V3 experts (`benchmarks/RESULTS.md`)."""
    e = layer.router.num_experts
    try:
        t = step.spec.emitted(layer, step.config).experts.num_experts
    except MoecompressError:  # the count is decided later (a budget, auto): every member kept, an upper bound
        t = e
    kept = min(n, -(-n * t // max(e, 1)))
    output = chunks.sub_layer(layer, chunks.meta_bank(layer.experts, 0, kept), 0)
    merging = resources.step_peak(unit, unit, dtype, stats, step.spec.chunking.workspace(layer, step.config, n),
                                  first=first, written=False)  # fmt: skip
    return max(merging, resources.step_peak(unit, output, dtype, stats, 0, first=first, written=written))


def auto_size(
    recipe: Recipe, layer: MoELayer, dtype: torch.dtype, stats: int, written: list, limit: int, spilled: int = 0
) -> int | None:
    """The largest balanced chunk whose every step estimate fits ``limit`` (``None``: not even one expert)."""
    e = layer.experts.num_experts

    def fits(n: int) -> bool:
        return max(chunk_peaks(recipe, layer, n, dtype, stats, written, spilled), default=0) <= limit

    if not fits(1):
        return None
    lo, hi = 1, e
    while lo < hi:  # the estimate grows with n: the largest n that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    k = math.ceil(e / lo)
    return math.ceil(e / k)


def check_chunked(
    recipe: Recipe, i: int, n: int, whole: int, limit: int | None, layer: MoELayer | None = None
) -> None:
    """Refuse, in one line naming the step and the layer, a step that cannot run on layer ``i`` (shapes:
    ``layer``) held by chunks of ``n`` experts, or a propagation of the compressed layers."""
    how = f"expert_chunk: {recipe.expert_chunk} holds it by chunks of {n} experts"
    both = follow.gather_conflict(recipe.steps, recipe.recalibrates)
    if both is not None:
        earlier, step = both
        raise RecipeError(
            f"{step.label}, layer {i}: fits what every expert shares over all the chunks before it projects each, so "
            f"{earlier.label} would have to run twice on every chunk, but {how}; set calibration.recalibrate: auto "
            f"(a new segment from {step.spec.name}), run them as two recipes, or set expert_chunk: off"
        )
    merging = group_conflict(recipe.steps, recipe.recalibrates)
    if merging is not None:
        step, other = merging
        raise RecipeError(
            f"{step.label}, layer {i}: merges groups of experts read group by group, which {other.label} cannot "
            f"follow in the same recipe, but {how}; set calibration.recalibrate: auto (a new segment there), run "
            f"{other.spec.name} in a recipe of its own, or set expert_chunk: off"
        )
    if follow.required(recipe.steps, recipe.recalibrates):
        raise RecipeError(
            f"layer {i}: a later step reads statistics that an earlier step changes, which follow the layer only "
            f"when it is held whole, but {how}; set expert_chunk: off, or run the steps as two recipes"
        )
    for step in recipe.steps:
        why = refusal(step, layer)
        if why is None:
            continue
        fit = "" if limit is None else f", {limit / GiB:.1f} GiB are available"
        fix = ("set expert_chunk: off and run it on a machine with that much memory" if recipe.expert_chunk == "auto"
               else "set expert_chunk: off (or auto: chunks only the layers that do not fit)")  # fmt: skip
        raise RecipeError(
            f"{step.label}, layer {i}: {why} (about {whole / GiB:.1f} GiB for the whole layer{fit}) but {how}; {fix}"
        )
    if recipe.calibration.propagate == "compressed":
        raise RecipeError(
            f"calibration.propagate: 'compressed' runs the steps on whole layers, but layer {i} is held by chunks of "
            f"{n} experts ({how.split(' holds')[0]}); use propagate: original or expert_chunk: off"
        )


def unit_size(rec: Recipe, ckpt: Checkpoint, ctx: RunContext, idx: int) -> int | None:
    """Experts per unit of MoE layer ``idx`` in the layer loop (``None``: one unit, the whole layer, on
    rank 0): the run's ``expert_chunk`` size, else under ``N > 1`` ranks ``ceil(E / (N · LOOP_UNITS_PER_RANK))``
    when every step can run by chunks with the whole layer's result (``Chunking.exact``), ``calibration.propagate``
    is not ``compressed`` and a merge comes first (:func:`merge_first`); ``ceil(E / N)`` when some step has that
    result only as a team (:func:`team_size`)."""
    if idx in ctx.expert_chunks:
        return ctx.expert_chunks[idx]
    n, e = ctx.ranks.world_size, int(ckpt.adapter.num_experts)
    if n == 1 or e < 2 or rec.calibration.propagate == "compressed" or not chunkable(rec, ckpt, idx, units=True):
        return None
    if not all(s.spec.chunking.exact is None or s.spec.chunking.exact(s.config) for s in rec.steps):
        return team_size(rec, n, e)  # units at once, one per rank (codequant's fine-tuning); else whole on rank 0
    if not merge_first(rec) or follow.gather_conflict(rec.steps, rec.recalibrates, units=True) is not None:
        return None  # a first sweep would read the input's experts, not the earlier step's: whole on rank 0
    return -(-e // (n * LOOP_UNITS_PER_RANK))


def team_size(rec: Recipe, world: int, experts: int) -> int | None:
    """Experts per unit of a layer whose steps are exact by chunks but for ``Chunking.team`` steps, worked
    at the same time, unit ``k`` by rank ``k`` (:mod:`moecompress.engine.team`): ``ceil(E / N)``, when that
    makes ``N`` units and no step before a team step selects experts (a rank left without one would miss
    the exchanges); ``None``: rank 0 runs the layer whole."""
    size = -(-experts // world)
    if -(-experts // size) != world or any(
        st.spec.chunking.mode == "group" or st.spec.chunking.gather is not None for st in rec.steps
    ):  # two-phase steps and merges keep their own units
        return None
    for s, step in enumerate(rec.steps):
        mode = step.spec.chunking
        if mode.exact is None or mode.exact(step.config):
            continue
        if mode.team is None or not mode.team(step.config):
            return None
        if any(o.spec.chunking.mode == "select" and not o.spec.report_only and o.spec.alters_for(o.config)
               for o in rec.steps[:s]):  # fmt: skip
            return None
    return size


def on_team(rec_steps: list, ctx: RunContext, idx: int, size: int | None) -> bool:
    """Whether layer ``idx``'s units (of ``size``) are a team's (:func:`team_size`): under ``N > 1`` ranks, not
    chunked by request, and some step exact by chunks only as a team."""
    if ctx.ranks.world_size == 1 or size is None or idx in ctx.expert_chunks:
        return False
    return any(s.spec.chunking is not None and s.spec.chunking.exact is not None
               and not s.spec.chunking.exact(s.config) for s in rec_steps)  # fmt: skip


def merge_first(rec: Recipe) -> bool:
    """Whether a merge (``Chunking('group')``) can go by units on a layer that was not chunked by request:
    nothing before it changes the layer or is written (``emit: every_step``), as its units of groups need
    (:func:`~moecompress.engine.unit_work.prepare`); otherwise rank 0 runs the layer whole, as one process."""
    for s, step in enumerate(rec.steps):
        if step.spec.chunking.mode != "group" or s == 0:
            continue
        if rec.emit == "every_step" or any(
            not o.spec.report_only and o.spec.alters_for(o.config) for o in rec.steps[:s]
        ):
            return False
    return True

