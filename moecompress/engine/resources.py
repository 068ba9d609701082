"""Memory and disk a run will need, estimated from the recipe and the shard headers before any work.

Calibration keeps every batch's hidden states of one decoder layer twice (its inputs and outputs),
``samples × seq_len × hidden`` values each, plus the token ids and one materialised layer (about three
copies of its weights: the module, the canonical layer and its compute-dtype cast). The streamed
backward adds the stored inputs of every decoder layer (in RAM unless ``offload`` puts them on disk),
one gradient of the hidden states and, per batch, the logits at the head with their gradient. A run
whose estimate exceeds the memory available (``MemAvailable``) or ``calibration.memory_limit`` is
refused with the figure; so is an output whose estimated size exceeds the free disk.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from moecompress.calibration.catalogue import ALWAYS, backward_needed
from moecompress.calibration.sweep import OFFLOAD_AUTO_BYTES
from moecompress.engine.recipe import Recipe
from moecompress.errors import RecipeError
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.writer import parse_size
from moecompress.methods.attribution import ATTRIB_TOKENS, trace_bytes

GiB = 1024**3


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
    layer_bytes = max((sum(ckpt.reader.nbytes(k) for k in keys) for keys in layers), default=0)
    mem = 2 * act + tokens * 8 + 3 * layer_bytes
    disk = 0
    if backward_needed(set(recipe.needs) | ALWAYS):
        store = n_layers * act
        on_disk = c.offload == "disk" or (c.offload == "auto" and store > OFFLOAD_AUTO_BYTES)
        disk = store if on_disk else 0
        mem += (0 if on_disk else store) + act + 3 * min(c.batch_size, c.samples) * c.seq_len * vocab * 4
    out = {"calibration_memory_bytes": mem, "backward_disk_bytes": disk}
    if "route_attrib" in set(recipe.needs):  # the routing-attribution trace (calibration/trace.py)
        trace = trace_bytes(n_layers, len(ckpt.moe_layer_indices), min(ATTRIB_TOKENS, tokens), hidden,
                            int(cfg.get("num_experts_per_tok") or 1))  # fmt: skip
        out.update(calibration_memory_bytes=mem + trace, route_attrib_trace_bytes=trace)
    return out


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
    if limit is not None and need > limit:
        where = "calibration.memory_limit" if c.memory_limit is not None else "available on this machine"
        raise RecipeError(
            f"calibration needs about {need / GiB:.1f} GiB of memory ({c.samples} samples × {c.seq_len} tokens of "
            f"activations, one decoder layer{', the streamed backward' if plan['backward'] else ''}) but "
            f"{limit / GiB:.1f} GiB are {where}; lower calibration.samples, seq_len or batch_size"
            + (" or use calibration.offload: disk" if plan["backward"] else "")
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
