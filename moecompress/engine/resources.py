"""Memory and disk a run will need, estimated from the recipe and the shard headers before any work.

Calibration keeps every batch's hidden states of one decoder layer twice (its inputs and outputs),
``samples × seq_len × hidden`` values each, plus the token ids and one materialised layer (its stored
tensors, half as much again while one projection's experts are stacked, and a compute-dtype copy when
that differs from the stored dtype), over what every run holds (``STEP_BASE_BYTES``). The streamed
backward holds the stored inputs of every decoder layer (in RAM unless ``offload`` puts them on disk),
one gradient of the hidden states and the LM head, with first the logits of a batch and their gradient,
then one decoder layer at a time (the larger of the two phases counts). An expert-chunked MoE layer (``expert_chunk``) counts its non-expert tensors and one chunk of
experts instead of the layer, and adds every batch's recorded MoE input and an fp32 accumulator of its
MoE output (forward) or input gradient (backward) (:mod:`moecompress.calibration.chunked`).

Compressing holds, per step and MoE layer (:func:`step_peak`), the step's input layer, the layer's
statistics, the pass's declared workspace (``PassSpec.workspace``) and its output with its encoded
tensors. The dry run takes the largest of these over steps and layers; a run whose calibration or
compression estimate exceeds the memory available (``MemAvailable``) or ``calibration.memory_limit``
is refused with the figure, naming the step and layer; so is an output whose estimated size exceeds the
free disk.
"""

from __future__ import annotations

import functools
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from moecompress.calibration.catalogue import ALWAYS, CATALOGUE, backward_needed
from moecompress.calibration.stats import SPILLED
from moecompress.calibration.sweep import OFFLOAD_AUTO_BYTES, PROPAGATE_CHUNKED
from moecompress.engine.peak import rss_bytes
from moecompress.engine.recipe import Recipe
from moecompress.errors import RecipeError
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.outputs import parse_size
from moecompress.io.reader import read_groups
from moecompress.ir import MoELayer, cast_layer
from moecompress.methods.attribution import ATTRIB_TOKENS, trace_bytes
from moecompress.methods.mixture import AUTO_TOKENS

GiB = 1024**3

STEP_BASE_BYTES = 600 * 1024**2
"""What a run holds besides the layer being compressed (the interpreter, torch, transformers, the
checkpoint's headers, one non-MoE decoder layer being copied): measured ~0.5 GiB, rounded up."""


def _layer_memory(
    ckpt: Checkpoint, keys: list[str], dtype: torch.dtype, layer: int | None = None, chunk: int | None = None
) -> int:
    """One decoder layer in calibration: its stored tensors, half as much again while the experts of one
    projection are stacked (and checked for NaN), and a compute-dtype copy when the stored dtype differs.
    An expert-chunked MoE layer (``chunk`` experts at a time, :mod:`moecompress.calibration.chunked`)
    holds its other tensors and one chunk of its routed experts so."""
    r = ckpt.reader
    size = torch.empty(0, dtype=dtype).element_size()

    def held(names: list[str]) -> int:
        stored = sum(r.nbytes(k) for k in names)
        floats = [k for k in names if r.torch_dtype(k).is_floating_point]
        cast = sum(
            r.nbytes(k) // r.torch_dtype(k).itemsize * size for k in floats if r.torch_dtype(k) != dtype
        )
        return stored * 3 // 2 + cast

    if chunk is None or layer is None:
        return held(keys)
    routed = set(ckpt.adapter.expert_keys(layer, keys))
    experts = held([k for k in keys if k in routed])
    return held([k for k in keys if k not in routed]) + -(-experts * chunk // ckpt.adapter.num_experts)


def collector_bytes(stats: Mapping[str, int], kind: str, spilled: frozenset[str] = frozenset()) -> int:
    """Peak bytes of one layer's statistics collector in calibration (``calibration/stats.py``), from the
    float32 bytes of each statistic (``stats``: name -> bytes, :func:`stat_bytes`) of ``kind`` (``forward``
    or ``backward``): the float64 sums (twice their float32 bytes), and while ``result`` converts them, the
    largest one's float64 mean and every float32 result (``3·S + 2·L``; the per-expert covariances,
    ``expert_in_cov`` and ``down_in_cov``, are converted expert by expert, so ``L`` is the largest other
    statistic). ``spilled`` (a chunk's share of the
    per-expert covariances, ``StatsCollector.spill``): their float64 sums (``2·S``), handed out and written
    one expert at a time."""
    mine = {n: b for n, b in stats.items() if n in CATALOGUE and CATALOGUE[n].kind == kind and n not in spilled}
    apart = sum(b for name, b in stats.items() if name in spilled and CATALOGUE[name].kind == kind)
    whole = [b for n, b in mine.items() if n not in SPILLED]  # means taken expert by expert
    return 3 * sum(mine.values()) + 2 * max(whole, default=0) + 2 * apart


def estimate(
    recipe: Recipe,
    ckpt: Checkpoint,
    dtype: torch.dtype,
    chunks: Mapping[int, int] | None = None,
    stats: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Estimated peak bytes of calibration in memory and of the streamed backward's inputs on disk (none
    with ``calibration.source: none``). ``chunks``: MoE layer -> experts per chunk (the dry run's
    ``expert_chunk``; default none); a chunked
    layer counts one chunk of experts, and the run every batch's recorded MoE input and its fp32 MoE
    output accumulator (forward) or input gradient (backward) besides the activations. ``stats``: the
    float32 bytes of each statistic of the largest MoE layer; its collector (:func:`collector_bytes`) is
    held with the layer, in the forward sweep and the backward's layer phase; when every MoE layer is
    chunked, its per-expert covariances (:data:`~moecompress.calibration.stats.SPILLED`) count one chunk's
    share (they are written apart chunk by chunk)."""
    if recipe.calibration.data_free:
        return {"calibration_memory_bytes": 0, "calibration_layer_bytes": 0, "backward_disk_bytes": 0}
    c, cfg = recipe.calibration, ckpt.raw_config
    hidden = int(cfg.get("hidden_size") or 0)
    vocab = int(cfg.get("vocab_size") or 0)
    size = torch.empty(0, dtype=dtype).element_size()
    tokens = c.samples * c.seq_len
    act = tokens * hidden * size
    chunks = {i: n for i, n in (chunks or {}).items() if i in set(ckpt.moe_layer_indices)}
    if chunks and c.propagate == "compressed":
        raise RecipeError(PROPAGATE_CHUNKED)
    layers = [(idx, keys) for idx, keys in ckpt.key_groups() if idx is not None]
    n_layers = len(layers)
    layer_mem = max(
        (_layer_memory(ckpt, keys, dtype, idx, chunks.get(idx)) for idx, keys in layers), default=0
    )
    # the recorded MoE inputs and the fp32 accumulators of the chunked layers' MoE outputs
    in_layer = layer_mem + (act + tokens * hidden * 4 if chunks else 0)
    sizes, apart = dict(stats or {}), frozenset()
    if chunks and set(chunks) >= set(ckpt.moe_layer_indices):  # no layer holds every expert's sums at once
        e, n = max(ckpt.adapter.num_experts, 1), max(chunks.values())
        sizes = {k: -(-b * n // e) if k in SPILLED else b for k, b in sizes.items()}
        apart = frozenset(SPILLED)
    fwd, bwd = collector_bytes(sizes, "forward", apart), collector_bytes(sizes, "backward", apart)
    if chunks:  # a chunked layer keeps every expert's outputs on the Ward tokens for its Gram (float32)
        sampled = max(ckpt.adapter.num_experts, 1) * min(AUTO_TOKENS, tokens) * hidden * 4
        fwd += sampled if "expert_out_gram" in set(recipe.needs) else 0
        bwd += sampled if "expert_out_gram_fisher" in set(recipe.needs) else 0
    mem = STEP_BASE_BYTES + 2 * act + tokens * 8 + in_layer + fwd  # the forward sweep
    disk = 0
    if backward_needed(set(recipe.needs) | ALWAYS):
        store = n_layers * act
        on_disk = c.offload == "disk" or (c.offload == "auto" and store > OFFLOAD_AUTO_BYTES)
        disk = store if on_disk else 0
        logits = 3 * min(c.batch_size, c.samples) * c.seq_len * vocab * 4
        # the LM head (the input embeddings are freed once every batch is captured), the stored inputs and
        # the gradients; then first every batch's logits and the last hidden states (the loss), later one
        # decoder layer at a time: the two phases do not overlap (calibration/sweep.py ``_backward``)
        held = STEP_BASE_BYTES + tokens * 8 + (0 if on_disk else store) + act + vocab * hidden * size
        mem = max(mem, held + max(act + logits, in_layer + act + bwd))
    out = {"calibration_memory_bytes": mem, "calibration_layer_bytes": layer_mem, "backward_disk_bytes": disk,
           "calibration_stats_bytes": max(fwd, bwd)}  # fmt: skip
    if "moe_inputs" in set(recipe.needs):  # kept (float32) for a replay of changed layers: engine/follow.py
        kept = (c.samples - c.holdout_samples) * c.seq_len * hidden * 4
        out.update(calibration_memory_bytes=out["calibration_memory_bytes"] + 2 * kept,
                   moe_inputs_cache_bytes=kept * len(ckpt.moe_layer_indices))  # fmt: skip
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
    cast = lambda lay: 0 if lay.experts.gate.dtype == dtype else cast_layer(lay, dtype).nbytes()  # noqa: E731
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


def check(
    recipe: Recipe, plan: dict, output_parent: Path, *, memory: int | None, disk_free: int | None
) -> None:
    """Refuse, with the figures and the fix, a run that will not fit in memory or on disk."""
    c = recipe.calibration
    need = plan["calibration_memory_bytes"]
    limit = parse_size(c.memory_limit) if c.memory_limit is not None else memory
    where = "calibration.memory_limit" if c.memory_limit is not None else "available on this machine"
    layer = plan.get("calibration_layer_bytes", 0)
    if limit is not None and need > limit and 2 * layer >= need:
        raise RecipeError(
            f"calibration needs about {need / GiB:.1f} GiB of memory, {layer / GiB:.1f} GiB of it for one decoder layer, "
            f"but {limit / GiB:.1f} GiB are {where}; " + _calibration_fix(recipe, plan)
        )
    if limit is not None and need > limit:
        raise RecipeError(
            f"calibration needs about {need / GiB:.1f} GiB of memory ({c.samples} samples × {c.seq_len} tokens of "
            f"activations, one decoder layer{', the streamed backward' if plan['backward'] else ''}, "
            f"{plan.get('calibration_stats_bytes', 0) / GiB:.1f} GiB of statistics) but "
            f"{limit / GiB:.1f} GiB are {where}; lower calibration.samples, seq_len or batch_size"
            + (" or use calibration.offload: disk" if plan["backward"] else "")
        )
    copy = plan.get("copy_memory_bytes", 0)
    if limit is not None and copy > limit:
        raise RecipeError(
            f"copying the tensors outside the MoE layers needs about {copy / GiB:.1f} GiB of memory (the largest, "
            f"{plan.get('copy_largest_tensor')!r}, is read whole) but {limit / GiB:.1f} GiB are {where}; "
            "run it on a machine with more memory"
        )
    worst = max(plan.get("step_memory", {}).items(), key=lambda kv: kv[1]["bytes"], default=None)
    if limit is not None and worst is not None and worst[1]["bytes"] > limit:
        label, w = worst
        chunked = f", by chunks of {w['chunk']} experts" if w.get("chunk") else ", the layer held whole"
        raise RecipeError(
            f"{label} needs about {w['bytes'] / GiB:.1f} GiB of memory on layer {w['layer']} (its input layer "
            f"{w['input_bytes'] / GiB:.1f} GiB, output {w['output_bytes'] / GiB:.1f} GiB, workspace "
            f"{w['workspace_bytes'] / GiB:.1f} GiB, statistics {w['stats_bytes'] / GiB:.1f} GiB"
            f"{chunked}) but {limit / GiB:.1f} GiB are {where}; {_step_fix(recipe, w)}"
        )
    cache = plan.get("statistics_cache_bytes", 0) if c.cache_dir is None else 0  # default: next to the output
    out = (
        sum(plan["estimated_output_bytes"].get(s, 0) for s in plan["written_steps"])
        + plan["backward_disk_bytes"] + cache
    )
    if disk_free is not None and out > disk_free:
        raise RecipeError(
            f"the run needs about {out / GiB:.2f} GiB of disk next to {output_parent} ({len(plan['written_steps'])} "
            f"checkpoint(s){' and the streamed backward inputs' if plan['backward_disk_bytes'] else ''}"
            f"{f', {cache / GiB:.2f} GiB of calibration statistics' if cache > GiB else ''}) but only "
            f"{disk_free / GiB:.2f} GiB are free; free space, choose another output"
            + (" or set calibration.cache_dir to another disk" if cache > GiB else "")
        )


def _whole(w: dict) -> str:
    """Why a layer is held whole (a step's ``step_memory`` entry with ``whole_because``), with that step's fix."""
    why = w.get("whole_why") or "needs every expert of the layer at once"
    return f"the layer is held whole because {w['whole_because']} {why}; or run it on a machine with more memory"


def _calibration_fix(recipe: Recipe, plan: dict) -> str:
    sizes = sorted(set((plan.get("expert_chunk") or {}).values()))
    blocked = [w for w in (plan.get("step_memory") or {}).values() if w.get("whole_because")]
    if not sizes and blocked and recipe.expert_chunk == "auto":
        return _whole(blocked[0])
    if sizes:
        return (f"set a smaller expert_chunk (the layers are held by chunks of {'/'.join(map(str, sizes))} experts), "
                "or run it on a machine with more memory")  # fmt: skip
    if recipe.expert_chunk == "off" or isinstance(recipe.expert_chunk, int):
        return "use expert_chunk: auto (or a number of experts per chunk) to hold a layer's experts by chunks, or run it on a machine with more memory"
    return "run it on a machine with more memory"


def _step_fix(recipe: Recipe, w: dict) -> str:
    """The fix for a step estimate over the limit (the dry run's ``step_memory`` entry ``w``)."""
    if w.get("whole_because"):
        return _whole(w)
    if w.get("chunk"):
        return ("even one expert per chunk does not fit: run it on a machine with more memory" if w["chunk"] == 1
                else "use a smaller expert_chunk (or auto), or run it on a machine with more memory")  # fmt: skip
    if recipe.expert_chunk == "off":
        return "use expert_chunk: auto to hold the layer by chunks of experts, or run it on a machine with more memory"
    return "not even one expert per chunk fits: run it on a machine with more memory"


def free_disk(path: Path) -> int | None:
    """Free bytes on the file system of ``path`` (its nearest existing parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def release_freed() -> None:
    """Hand the memory freed since the last call back to the system (glibc's ``malloc_trim``; a no-op
    elsewhere). Called after each chunk of experts and each group of copied tensors: tensors under glibc's
    dynamic mmap threshold (up to 32 MiB, e.g. one DeepSeek-V3 expert projection) live on the heap, whose
    freed pages glibc otherwise keeps, so resident memory crept up chunk by chunk (measured 2.3 -> 4.2 GiB
    over four chunks of 16 DeepSeek-V3 experts; flat at 2.8 GiB with this call: RESULTS.md, issue 18)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache  # find_library runs `ldconfig -p`: 0.25 s per call, measured (benchmarks/distributed.py --py-spy)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None


def copy_peak(ckpt: Checkpoint, raw: bool = True) -> tuple[int, str | None]:
    """Estimated peak bytes of copying the tensors outside the MoE layers (embeddings, head, dense
    layers, attention; ``raw``: in the input's encoding): what every run holds and the largest group
    :func:`moecompress.io.reader.read_groups` reads at once, twice (mapped pages and copies); with the
    name of the largest such tensor."""
    src, moe, worst, name = (ckpt.raw if raw else ckpt.reader), set(ckpt.moe_layer_indices), 0, None
    for idx, keys in ckpt.key_groups(raw=raw):
        owned = set((ckpt.raw_moe_keys if raw else ckpt.moe_keys)(idx)) if idx in moe else set()
        for group in read_groups([k for k in keys if k not in owned], src.nbytes):
            size = sum(src.nbytes(k) for k in group)
            if size > worst:
                worst, name = size, max(group, key=src.nbytes)
    return STEP_BASE_BYTES + 2 * worst, name


def rss_mb() -> float:
    """Current resident memory in MB (Linux ``VmRSS``; elsewhere the peak so far)."""
    return rss_bytes() / 2**20
