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

from collections.abc import Iterable
from typing import Any

import torch

from moecompress.calibration.catalogue import ALWAYS, backward_needed
from moecompress.engine import resources, segments
from moecompress.engine.context import compute_dtype, resolve_device
from moecompress.engine.recipe import Recipe
from moecompress.errors import MoecompressError, PassError, RecipeError
from moecompress.extras import require
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.format import is_stock
from moecompress.io.quantized import dequantized_output
from moecompress.ir import MoELayer

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
        for extra in step.spec.extras:
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
    planned = [s.label for s in recipe.steps if s.spec.plan is not None]
    if planned:
        raise RecipeError(f"calibration.propagate: 'compressed' cannot be combined with cross-layer plans ({planned})")


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
            "N": min(c.sample_tokens, c.samples * c.seq_len), "NH": c.holdout_samples * c.seq_len, "S": 1}  # fmt: skip


def dry_run(recipe: Recipe, ckpt: Checkpoint) -> dict[str, Any]:
    """Check the recipe on shapes; raise before any weight or token is touched. Returns the plan: the
    statistics to collect and the estimated bytes of each step's output."""
    needs = set(recipe.needs) | ALWAYS
    check_extras(recipe)
    device = resolve_device(recipe.calibration.device)
    _check_propagation(recipe, needs)
    if not ckpt.moe_layer_indices:
        raise RecipeError(f"recipe field 'model': {ckpt.path} has no MoE layers")
    try:
        ckpt.non_weight_files(recipe.copy_extra)
    except MoecompressError as err:
        raise RecipeError(f"recipe field 'copy_extra': {err}") from None
    moe_in = 0
    moe_out = [0] * len(recipe.steps)
    dtype = compute_dtype(recipe, ckpt)
    step_memory: dict[str, dict[str, int]] = {}
    emitted = [s for s in recipe.steps if not s.spec.report_only]
    written = emitted if recipe.emit == "every_step" else emitted[-1:]
    nonstock: tuple[str, int] | None = None
    for i in ckpt.moe_layer_indices:
        layer = meta_layer(ckpt, i)
        moe_in += layer.nbytes()
        stats = resources.stat_bytes(needs, _stat_dims(recipe, layer))
        before = layer
        for n, out in enumerate(chain(recipe, layer)):
            moe_out[n] += out.nbytes()
            step = recipe.steps[n]
            if ckpt.quantization and nonstock is None and step in written and not is_stock(out, ckpt.adapter):
                nonstock = (step.label, i)  # on a quantised input: write dequantised, or refuse (keep)
            work = step.spec.workspace(before, step.config) if step.spec.workspace is not None else 0
            peak = resources.step_peak(before, out, dtype, stats, work, first=n == 0, written=step in written)
            if peak > step_memory.get(step.label, {}).get("bytes", -1):
                step_memory[step.label] = {"bytes": peak, "layer": i, "input_bytes": before.nbytes(),
                                           "output_bytes": out.nbytes(), "workspace_bytes": work,
                                           "stats_bytes": stats}  # fmt: skip
            before = out
    in_bytes = sum(ckpt.reader.nbytes(k) for k in ckpt.reader.keys)
    plan = {
        **resources.estimate(recipe, ckpt, compute_dtype(recipe, ckpt)),
        "written_steps": [s.label for s in written],
        "model_type": ckpt.model_type,
        "device": device,
        "moe_layers": ckpt.moe_layer_indices,
        "steps": [s.label for s in recipe.steps],
        "statistics": sorted(needs),
        "backward": backward_needed(needs),
        "input_bytes": in_bytes,
        "checkpoints": len(emitted) if recipe.emit == "every_step" else min(len(emitted), 1),
        "estimated_output_bytes": {
            s.label: in_bytes - moe_in + moe_out[n] for n, s in enumerate(recipe.steps) if not s.spec.report_only
        },
        "calibration_tokens": recipe.calibration.samples * recipe.calibration.seq_len,
        "step_memory": step_memory,
        "dequantize_output": dequantized_output(ckpt, recipe.quantized_input, nonstock),
    }
    return {**plan, **segments.stage_plan(recipe, ckpt, plan)} if segments.has_stages(recipe) else plan
