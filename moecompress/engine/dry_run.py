"""The dry run: the whole recipe checked on shapes, before any weight or calibration token is read.

Per MoE layer, a layer of ``meta`` tensors is built from the shard headers; each step's ``check`` sees
the layer the *previous steps would emit* (``PassSpec.emits``), so a chain that cannot work —
``[svd_experts, codequant]``, a second neuron pruning, an ``expert_prune`` that leaves fewer experts than
``top_k`` after an earlier one — fails here with the step, the layer and the fix. Missing optional
dependencies (``pip install "moecompress[decompose]"``) fail here too. Nothing is written and no cache
entry is created.

What shapes cannot tell: the experts ``protect_super_experts`` detects automatically are known only
after calibration (``manual`` ones and those recorded in the input checkpoint are known here), so a
check that depends on them runs when the layer is compressed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from moecompress.calibration.catalogue import ALWAYS, backward_needed
from moecompress.calibration.stats import SPILLED
from moecompress.engine import follow, resources, segments, units
from moecompress.engine.context import compute_dtype, resolve_device, slow_dtype_note
from moecompress.engine.distributed import Launch
from moecompress.engine.recipe import Recipe
from moecompress.errors import MoecompressError, PassError, RecipeError
from moecompress.extras import require
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.format import is_stock
from moecompress.io.quantized import dequantized_output
from moecompress.ir import MoELayer

log = logging.getLogger(__name__)

SMALL_INDEX = 1 << 20
"""Integer tensors up to this many elements (live widths, expert maps, member indices) are read for
real in the dry run: they say what shapes alone cannot (a ragged bank's widths) and cost nothing."""


def meta_layer(ckpt: Checkpoint, i: int) -> MoELayer:
    """MoE layer ``i`` built from shard headers only (``meta`` tensors, but small integer index tensors
    read for real): the dry run's input."""
    r = ckpt.reader

    def small_index(name: str) -> bool:
        return r.torch_dtype(name) in (torch.int32, torch.int64) and r.nbytes(name) <= 8 * SMALL_INDEX

    def fetch(names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        real = r.get_many([n for n in names if small_index(n)])
        return {n: real[n] if n in real else r.meta(n) for n in names}

    return ckpt.read_layer_with(i, fetch)


def check_extras(recipe: Recipe) -> None:
    """One line naming the extra to install when a step or the calibration source needs one."""
    for step in recipe.steps:
        for extra in step.spec.extras_for(step.config):
            require(extra, step.label)
    if recipe.calibration.source.startswith("hf:"):
        require("data", f"calibration.source {recipe.calibration.source!r}")


def _check_propagation(recipe: Recipe, needs: set[str]) -> None:
    if recipe.calibration.propagate != "compressed":
        return
    if backward_needed(needs):
        raise RecipeError(
            "calibration.propagate: 'compressed' cannot be combined with gradient statistics "
            f"(needed by {[s.label for s in recipe.steps if backward_needed(s.needs)]}); use 'original'"
        )
    planned = [s.label for s in recipe.steps if s.spec.plans_for(s.config)]
    if planned:
        raise RecipeError(
            f"calibration.propagate: 'compressed' cannot be combined with cross-layer plans ({planned})"
        )


def check_data_free(recipe: Recipe) -> None:
    """``calibration.source: none``: refuse, in one line naming the step and the statistic, a step that
    needs statistics (or a training stage without its own ``data``)."""
    if not recipe.calibration.data_free:
        return
    for step in recipe.steps:
        needs = sorted(step.needs)
        if needs:
            more = f" (and {len(needs) - 1} more: {', '.join(needs[1:])})" if len(needs) > 1 else ""
            raise RecipeError(
                f"calibration.source: none, but {step.label} needs the statistic {needs[0]!r}{more}, which only "
                "calibration gives; use a calibration source (builtin, file:PATH, hf:NAME, random) or remove the step"
            )
        if step.spec.stage is not None and getattr(step.config, "data", None) is None:
            raise RecipeError(
                f"calibration.source: none, but {step.label} trains on calibration text; give the step its own "
                "'data' source or use a calibration source (builtin, file:PATH, hf:NAME, random)"
            )


def chain(recipe: Recipe, layer: MoELayer) -> list[MoELayer]:
    """Every step's check on the layer the earlier steps emit; returns the emitted layers (one per
    step). Raises :class:`PassError` naming the step and the layer."""
    out = []
    for step in recipe.steps:
        try:
            if step.spec.check is not None:
                step.spec.check(layer, step.config)
            layer = step.spec.emitted(layer, step.config)
        except MoecompressError as err:
            raise PassError(f"{step.label}, layer {layer.index}: {err}") from None
        if not isinstance(layer, MoELayer):
            raise PassError(f"{step.label}: emits must return a MoELayer, got {type(layer).__name__}")
        out.append(layer)
    return out


def _stat_dims(recipe: Recipe, layer: MoELayer) -> dict[str, int]:
    c = recipe.calibration
    return {"E": layer.experts.num_experts, "I": layer.experts.width, "H": layer.hidden_size,
            "N": min(c.sample_tokens, c.samples * c.seq_len), "NH": c.holdout_samples * c.seq_len, "S": 1,
            "T": max(c.samples - c.holdout_samples, 1) * c.seq_len}  # fmt: skip


def _stat_sizes(recipe: Recipe, ckpt: Checkpoint, needs: set[str]) -> dict[str, int]:
    """Float32 bytes of each statistic in ``needs``, of the MoE layer where it is largest."""
    dims = [_stat_dims(recipe, meta_layer(ckpt, i)) for i in ckpt.moe_layer_indices]
    return {n: max(resources.stat_bytes({n}, d) for d in dims) for n in needs} if dims else {}


def dry_run(recipe: Recipe, ckpt: Checkpoint, launch: Launch | None = None) -> dict[str, Any]:
    """Check the recipe on shapes; raise before any weight or token is touched. Returns the plan: the
    statistics to collect and the estimated bytes of each step's output. ``launch``: the ``torchrun`` ranks
    (a whole-model stage's memory is estimated per rank)."""
    check_data_free(recipe)
    c = recipe.calibration
    needs = set() if c.data_free else set(recipe.needs) | ALWAYS
    check_extras(recipe)
    device = resolve_device(recipe.calibration.device)
    if (note := slow_dtype_note(recipe, device)) is not None and (launch is None or launch.rank == 0):
        log.warning(note)
    _check_propagation(recipe, needs)
    if not ckpt.moe_layer_indices:
        raise RecipeError(f"recipe field 'model': {ckpt.path} has no MoE layers")
    try:
        ckpt.non_weight_files(recipe.copy_extra)
    except MoecompressError as err:
        raise RecipeError(f"recipe field 'copy_extra': {err}") from None
    moe_in, cache_bytes = 0, 0
    moe_out = [0] * len(recipe.steps)
    dtype = compute_dtype(recipe, ckpt)
    step_memory: dict[str, dict[str, int]] = {}
    emitted = [s for s in recipe.steps if not s.spec.report_only]
    written = emitted if recipe.emit == "every_step" else emitted[-1:]
    nonstock: tuple[str, int] | None = None
    chunked = units.fixed_chunks(recipe, ckpt)
    limit = units.memory_limit(recipe) if recipe.expert_chunk == "auto" else None
    sizes = _stat_sizes(recipe, ckpt, needs)
    cap = units.calibration_cap(recipe, ckpt, dtype, limit, sizes) if limit is not None else None
    for i in ckpt.moe_layer_indices:
        layer = meta_layer(ckpt, i)
        moe_in += layer.nbytes()
        stats = resources.stat_bytes(needs, _stat_dims(recipe, layer))
        cache_bytes += stats  # the statistics cache holds every layer's (float32)
        spilled = resources.stat_bytes(needs & set(SPILLED), _stat_dims(recipe, layer))  # read by rows when chunked
        before = layer
        entries = []
        for n, out in enumerate(chain(recipe, layer)):
            moe_out[n] += out.nbytes()
            step = recipe.steps[n]
            if ckpt.quantization and nonstock is None and step in written and not is_stock(out, ckpt.adapter):
                nonstock = (step.label, i)  # on a quantised input: write dequantised, or refuse (keep)
            work = step.spec.workspace(before, step.config) if step.spec.workspace is not None else 0
            peak = resources.step_peak(before, out, dtype, stats, work, first=n == 0, written=step in written)
            entries.append({"bytes": peak, "layer": i, "input_bytes": before.nbytes(), "output_bytes": out.nbytes(),
                            "workspace_bytes": work, "stats_bytes": stats})  # fmt: skip
            before = out
        whole = max((e["bytes"] for e in entries), default=0)
        if limit is not None:  # expert_chunk: auto, chunks for a layer that does not fit whole
            size = units.auto_chunk(recipe, ckpt, i, layer, whole, dtype, stats, written, limit, spilled)
            if size is not None:
                chunked[i] = size
            if cap is not None and cap < layer.experts.num_experts and units.chunkable(recipe, ckpt, i, layer):
                chunked[i] = min(chunked.get(i, cap), cap)  # calibration holds a chunk too
        if i in chunked:
            units.check_chunked(recipe, i, chunked[i], whole, limit, layer)
            peaks = units.chunk_peaks(recipe, layer, chunked[i], dtype, stats, written, spilled)
            share = units.chunk_stats(stats, spilled, chunked[i], layer.experts.num_experts)
            for e, p in zip(entries, peaks):
                e.update(bytes=p, chunk=chunked[i], stats_bytes=share)
        blocked = next(((s.label, why) for s in recipe.steps if (why := units.refusal(s, layer)) is not None), None)
        for step, e in zip(recipe.steps, entries):
            if blocked is not None:  # a step that cannot run by chunks holds the layer whole: which, and why
                e["whole_because"], e["whole_why"] = blocked
            if e["bytes"] > step_memory.get(step.label, {}).get("bytes", -1):
                step_memory[step.label] = e
    if not c.data_free:
        follow.verdicts(recipe.steps, recalibrate=recipe.recalibrates)  # statistics that cannot follow the layer
    in_bytes = sum(ckpt.reader.nbytes(k) for k in ckpt.reader.keys)  # in memory (dequantised)
    dequantize = dequantized_output(ckpt, recipe.quantized_input, nonstock)
    rest, scale = in_bytes - moe_in, 1.0  # on disk: what no step rewrites, and bytes per logical MoE byte
    # written in the input's encoding: its bytes, not the logical ones
    if ckpt.quantization and not dequantize:
        raw_moe = sum(ckpt.raw.nbytes(k) for i in ckpt.moe_layer_indices for k in ckpt.raw_moe_keys(i))
        rest, scale = sum(ckpt.raw.nbytes(k) for k in ckpt.raw.keys) - raw_moe, raw_moe / max(moe_in, 1)
    plan = {
        **resources.estimate(recipe, ckpt, dtype, chunks=chunked, stats=sizes),
        "written_steps": [s.label for s in written],
        "model_type": ckpt.model_type,
        "device": device,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "moe_layers": ckpt.moe_layer_indices,
        "steps": [s.label for s in recipe.steps],
        "statistics": sorted(needs),
        "backward": backward_needed(needs),
        "input_bytes": in_bytes,
        "checkpoints": len(emitted) if recipe.emit == "every_step" else min(len(emitted), 1),
        "estimated_output_bytes": {
            s.label: rest + int(moe_out[n] * scale)
            for n, s in enumerate(recipe.steps)
            if not s.spec.report_only
        },
        "calibration_tokens": 0 if c.data_free else c.samples * c.seq_len,
        # source: none could skip calibration
        "data_free_steps": not recipe.needs and not segments.has_stages(recipe),
        "step_memory": step_memory,
        "expert_chunk": {str(i): n for i, n in sorted(chunked.items())},
        "statistics_cache_bytes": cache_bytes,
        "dequantize_output": dequantize,
    }
    plan["copy_memory_bytes"], plan["copy_largest_tensor"] = resources.copy_peak(ckpt, raw=not dequantize)
    cut = segments.split(recipe)
    if len(cut) > 1:  # segments: each calibrated on the previous one's output
        plan["segments"] = [[s.label for s in seg] for seg in cut]
    if not segments.has_stages(recipe):
        return plan
    return {**plan, **segments.stage_plan(recipe, ckpt, plan, launch)}
