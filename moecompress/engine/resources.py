"""Memory and disk a run will need, estimated from the recipe and the shard headers before any work.

Calibration keeps every batch's hidden states of one decoder layer twice (its inputs and outputs),
``samples × seq_len × hidden`` values each, plus the token ids and one materialised layer (its stored
tensors, half as much again while one projection's experts are stacked, and a compute-dtype copy when
that differs from the stored dtype), over what every run holds (``STEP_BASE_BYTES``). The streamed
backward adds the stored inputs of every decoder layer (in RAM unless ``offload`` puts them on disk),
one gradient of the hidden states and, per batch, the logits at the head with their gradient.

Compressing holds, per step and MoE layer (:func:`step_peak`), the step's input layer, the layer's
statistics, the pass's declared workspace (``PassSpec.workspace``) and its output with its encoded
tensors. The dry run takes the largest of these over steps and layers; a run whose calibration or
compression estimate exceeds the memory available (``MemAvailable``) or ``calibration.memory_limit``
is refused with the figure, naming the step and layer; so is an output whose estimated size exceeds the
free disk.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from moecompress.calibration.catalogue import ALWAYS, CATALOGUE, backward_needed
from moecompress.calibration.sweep import OFFLOAD_AUTO_BYTES
from moecompress.engine.recipe import Recipe
from moecompress.errors import RecipeError
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.writer import parse_size
from moecompress.ir import MoELayer, cast_layer
from moecompress.methods.attribution import ATTRIB_TOKENS, trace_bytes

GiB = 1024**3

STEP_BASE_BYTES = 600 * 1024**2
"""What a run holds besides the layer being compressed (the interpreter, torch, transformers, the
checkpoint's headers, one non-MoE decoder layer being copied): measured ~0.5 GiB, rounded up."""


def _layer_memory(ckpt: Checkpoint, keys: list[str], dtype: torch.dtype) -> int:
    """One decoder layer in calibration: its stored tensors, half as much again while the experts of one
    projection are stacked (and checked for NaN), and a compute-dtype copy when the stored dtype differs."""
    r = ckpt.reader
    stored = sum(r.nbytes(k) for k in keys)
    floats = [k for k in keys if r.torch_dtype(k).is_floating_point]
    size = torch.empty(0, dtype=dtype).element_size()
    cast = sum(r.nbytes(k) // r.torch_dtype(k).itemsize * size for k in floats if r.torch_dtype(k) != dtype)
    return stored * 3 // 2 + cast


def estimate(recipe: Recipe, ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, int]:
    """Estimated peak bytes of calibration in memory and of the streamed backward's inputs on disk."""
    c, cfg = recipe.calibration, ckpt.raw_config
    hidden = int(cfg.get("hidden_size") or 0)
    vocab = int(cfg.get("vocab_size") or 0)
    size = torch.empty(0, dtype=dtype).element_size()
    tokens = c.samples * c.seq_len
    act = tokens * hidden * size
    layers = [keys for idx, keys in ckpt.key_groups() if idx is not None]
    n_layers = len(layers)
    layer_mem = max((_layer_memory(ckpt, keys, dtype) for keys in layers), default=0)
    mem = STEP_BASE_BYTES + 2 * act + tokens * 8 + layer_mem
    disk = 0
    if backward_needed(set(recipe.needs) | ALWAYS):
        store = n_layers * act
        on_disk = c.offload == "disk" or (c.offload == "auto" and store > OFFLOAD_AUTO_BYTES)
        disk = store if on_disk else 0
        mem += (0 if on_disk else store) + act + 3 * min(c.batch_size, c.samples) * c.seq_len * vocab * 4
    out = {"calibration_memory_bytes": mem, "calibration_layer_bytes": layer_mem, "backward_disk_bytes": disk}
    if "route_attrib" in set(recipe.needs):  # the routing-attribution trace (calibration/trace.py)
        trace = trace_bytes(n_layers, len(ckpt.moe_layer_indices), min(ATTRIB_TOKENS, tokens), hidden,
                            int(cfg.get("num_experts_per_tok") or 1))  # fmt: skip
        out.update(calibration_memory_bytes=mem + trace, route_attrib_trace_bytes=trace)
    return out




def stat_bytes(needs: set[str] | frozenset[str], dims: dict[str, int]) -> int:
    """Bytes of one layer's statistics ``needs`` (float32, shapes from the catalogue) with ``dims``:
    ``E``, ``I``, ``H``, ``N`` (sampled tokens), ``NH`` (held-back tokens), ``S`` (shared experts)."""
    total = 0
    for name in needs:
        info = CATALOGUE.get(name)
        if info is None or name == "route_attrib":  # a few small vectors per component and expert
            continue
        for group in re.findall(r"\[([^\]]*)\](?:\s*x(\d+))?", info.shape):
            n = 1
            for d in (x.strip() for x in group[0].split(",") if x.strip()):
                n *= dims["NH" if name == "holdout" and d == "N" else d] if d in dims else 1
            total += 4 * n * int(group[1] or 1)
    return total


def step_peak(
    before: MoELayer, after: MoELayer, dtype: torch.dtype, stats: int, workspace: int, first: bool,
    written: bool = True,
) -> int:  # fmt: skip
    """Estimated peak bytes of one step on one layer in the layer loop (:mod:`moecompress.engine.run`):
    the step's input layer and the statistics are held; the first step also reads the layer (one
    projection stacked at a time), loads the statistics (their file bytes and tensors) and casts the layer
    for the held-back reference, one after the other; then the pass's workspace and
    its output, and after it the larger of the output's encoded tensors (when the step writes a
    checkpoint) and its cast for the reconstruction error."""
    cast = (lambda lay: 0 if lay.experts.gate.dtype == dtype else cast_layer(lay, dtype).nbytes())  # noqa: E731
    held = STEP_BASE_BYTES + stats + before.nbytes()
    start = held + (max(before.nbytes() // 3, stats, cast(before)) if first else 0)  # read, load, reference
    encoded = after.nbytes() if written else 0
    if after is before:  # unchanged: no new layer and no reconstruction forward, only its encoded tensors
        return max(start, held + workspace + encoded)
    return max(start, held + workspace + after.nbytes() + max(encoded, cast(after)))


def available_memory() -> int | None:
    """``MemAvailable`` of this machine (Linux), ``None`` elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check(recipe: Recipe, plan: dict, output_parent: Path, *, memory: int | None, disk_free: int | None) -> None:
    """Refuse, with the figures and the fix, a run that will not fit in memory or on disk."""
    c = recipe.calibration
    need = plan["calibration_memory_bytes"]
    limit = parse_size(c.memory_limit) if c.memory_limit is not None else memory
    where = "calibration.memory_limit" if c.memory_limit is not None else "available on this machine"
    layer = plan.get("calibration_layer_bytes", 0)
    if limit is not None and need > limit and 2 * layer >= need:
        raise RecipeError(
            f"calibration needs about {need / GiB:.1f} GiB of memory, {layer / GiB:.1f} GiB of it for one decoder layer "
            f"(a layer is held whole: streaming its experts in chunks is not built yet), but {limit / GiB:.1f} GiB are "
            f"{where}; run it on a machine with more memory"
        )
    if limit is not None and need > limit:
        raise RecipeError(
            f"calibration needs about {need / GiB:.1f} GiB of memory ({c.samples} samples × {c.seq_len} tokens of "
            f"activations, one decoder layer{', the streamed backward' if plan['backward'] else ''}) but "
            f"{limit / GiB:.1f} GiB are {where}; lower calibration.samples, seq_len or batch_size"
            + (" or use calibration.offload: disk" if plan["backward"] else "")
        )
    worst = max(plan.get("step_memory", {}).items(), key=lambda kv: kv[1]["bytes"], default=None)
    if limit is not None and worst is not None and worst[1]["bytes"] > limit:
        label, w = worst
        raise RecipeError(
            f"{label} needs about {w['bytes'] / GiB:.1f} GiB of memory on layer {w['layer']} (its input layer "
            f"{w['input_bytes'] / GiB:.1f} GiB, output {w['output_bytes'] / GiB:.1f} GiB, workspace "
            f"{w['workspace_bytes'] / GiB:.1f} GiB, statistics {w['stats_bytes'] / GiB:.1f} GiB) but {limit / GiB:.1f} GiB "
            f"are {where}; run it on a machine with more memory (a layer is held whole: streaming its experts in "
            "chunks is not built yet)"
        )
    out = sum(plan["estimated_output_bytes"].get(s, 0) for s in plan["written_steps"]) + plan["backward_disk_bytes"]
    if disk_free is not None and out > disk_free:
        raise RecipeError(
            f"the run needs about {out / GiB:.2f} GiB of disk next to {output_parent} ({len(plan['written_steps'])} "
            f"checkpoint(s){' and the streamed backward inputs' if plan['backward_disk_bytes'] else ''}) but only "
            f"{disk_free / GiB:.2f} GiB are free; free space or choose another output"
        )


def free_disk(path: Path) -> int | None:
    """Free bytes on the file system of ``path`` (its nearest existing parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None
