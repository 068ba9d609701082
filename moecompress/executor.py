"""The recipe executor: dry run on ``meta``, layer-major calibration, plans, the streaming layer loop.

``apply(recipe)`` runs, in order (nothing is written before step 3):

1. load and validate the recipe (:mod:`moecompress.recipe`); refuse an existing output directory;
2. open the checkpoint (headers only) and **dry-run** every step's ``check`` on ``meta`` layers built
   from the shard headers; load the calibration token ids (tokenizer present, enough text);
3. **calibrate** (or reuse the statistics cache): :mod:`moecompress.calibration.sweep`;
4. run cross-layer **plans**;
5. the **layer loop** (:mod:`moecompress.layer_loop`): per decoder layer, read it, run the steps,
   write each emitted step's checkpoint, copy non-MoE tensors, free; journal for ``--resume``;
6. reports, then the staging directory is renamed onto the output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moecompress.calibration.cache import StatsCache, load_layer, model_key, save_layer
from moecompress.calibration.stats import ALWAYS, backward_needed
from moecompress.errors import MoecompressError, OutputExistsError, PassError, RecipeError
from moecompress.io.checkpoint import Checkpoint, open_checkpoint
from moecompress.ir import MoELayer
from moecompress.recipe import Recipe, load_recipe
from moecompress.registry import LayerStats

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_dir: Path
    report: dict = field(default_factory=dict)
    dry_run: bool = False


def _open(recipe: Recipe) -> Checkpoint:
    try:
        return open_checkpoint(recipe.model)
    except MoecompressError as err:
        raise type(err)(f"recipe field 'model': {err}") from None


def meta_layer(ckpt: Checkpoint, i: int) -> MoELayer:
    """MoE layer ``i`` built from shard headers only (``meta`` tensors): the dry run's input."""
    r = ckpt.reader

    def fetch(names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: r.meta(n) for n in names}

    return ckpt.read_layer_with(i, fetch)


def compute_dtype(recipe: Recipe, ckpt: Checkpoint) -> torch.dtype:
    name = recipe.calibration.dtype
    if name != "auto":
        return getattr(torch, name)
    first = ckpt.moe_keys(ckpt.moe_layer_indices[0])[0]
    dtype = ckpt.reader.torch_dtype(first)
    return dtype if dtype.is_floating_point else torch.float32


def dry_run(recipe: Recipe, ckpt: Checkpoint) -> dict[str, Any]:
    """Check every step on shapes; raise before any weight or token is touched."""
    needs = set(recipe.needs) | ALWAYS
    if recipe.calibration.propagate == "compressed":
        if backward_needed(needs):
            raise RecipeError(
                "calibration.propagate: 'compressed' cannot be combined with gradient statistics "
                f"(needed by {[s.label for s in recipe.steps if backward_needed(s.needs)]}); use 'original'"
            )
        planned = [s.label for s in recipe.steps if s.spec.plan is not None]
        if planned:
            raise RecipeError(
                f"calibration.propagate: 'compressed' cannot be combined with cross-layer plans ({planned})"
            )
    if not ckpt.moe_layer_indices:
        raise RecipeError(f"recipe field 'model': {ckpt.path} has no MoE layers")
    for i in ckpt.moe_layer_indices:
        layer = meta_layer(ckpt, i)
        for step in recipe.steps:
            if step.spec.check is not None:
                try:
                    step.spec.check(layer, step.config)
                except PassError as err:
                    raise PassError(f"{step.label}, layer {i}: {err}") from None
    in_bytes = sum(ckpt.reader.nbytes(k) for k in ckpt.reader.keys)
    emitted = [s for s in recipe.steps if not s.spec.report_only]
    return {
        "model_type": ckpt.model_type,
        "moe_layers": ckpt.moe_layer_indices,
        "steps": [s.label for s in recipe.steps],
        "statistics": sorted(needs),
        "backward": backward_needed(needs),
        "input_bytes": in_bytes,
        "checkpoints": len(emitted) if recipe.emit == "every_step" else min(len(emitted), 1),
        "estimated_output_bytes_per_checkpoint": in_bytes if emitted else 0,
        "calibration_tokens": recipe.calibration.samples * recipe.calibration.seq_len,
    }


def _check_calibration_source(recipe: Recipe, ckpt: Checkpoint) -> str:
    """Fail in the dry run on a bad source, a missing tokenizer or an unusable cache directory;
    returns the source fingerprint (the statistics cache key)."""
    from moecompress.calibration.sources import source_fingerprint

    c = recipe.calibration
    fingerprint = source_fingerprint(
        c.source, model_dir=ckpt.path, samples=c.samples, seq_len=c.seq_len, seed=c.seed
    )
    if c.cache_dir is not None and Path(c.cache_dir).exists() and not Path(c.cache_dir).is_dir():
        raise RecipeError(f"calibration.cache_dir: {c.cache_dir!r} exists and is not a directory")
    return fingerprint


def _token_ids(recipe: Recipe, ckpt: Checkpoint) -> torch.Tensor:
    from moecompress.calibration.sources import load_token_ids

    c = recipe.calibration
    return load_token_ids(c.source, model_dir=ckpt.path, samples=c.samples, seq_len=c.seq_len, seed=c.seed)


def calibrate_stats(
    recipe: Recipe,
    ckpt: Checkpoint,
    ids: torch.Tensor,
    fingerprint: str,
    *,
    progress: bool = True,
    on_layer=None,
    cache_key_extra: str = "",
) -> tuple[Path, dict]:
    """Find or compute the statistics every step needs; returns (cache entry, summary)."""
    from moecompress.calibration.sweep import Batches, run_calibration
    from moecompress.skeleton import Skeleton

    c = recipe.calibration
    needs = set(recipe.needs) | ALWAYS
    dtype = compute_dtype(recipe, ckpt)
    root = Path(c.cache_dir) if c.cache_dir else Path(recipe.output).resolve().parent / ".moecompress-cache"
    key = {
        "source": fingerprint,
        "samples": c.samples,
        "seq_len": c.seq_len,
        "seed": c.seed,
        "holdout": c.holdout_samples,
        "batch_size": c.batch_size,
        "sample_tokens": c.sample_tokens,
        "dtype": str(dtype),
        "propagate": c.propagate,
        "extra": cache_key_extra,
    }
    cache = StatsCache(root, model_key(ckpt), key)
    found = cache.find(needs) if on_layer is None else None
    if found is not None:
        log.info("reusing calibration statistics from %s", found)
        return found, {"cached": True, "entry": str(found)}
    entry = cache.begin(needs)
    t0 = time.perf_counter()
    summary = run_calibration(
        Skeleton(ckpt, dtype),
        Batches.make(ids, c.holdout_samples, c.batch_size),
        needs,
        sample_tokens=c.sample_tokens,
        offload=c.offload,
        save_forward=lambda i, s: save_layer(entry, i, s),
        save_backward=lambda i, s: save_layer(entry, i, s, grad=True),
        on_layer=on_layer,
        progress=progress,
    )
    summary = {**summary, "seconds": round(time.perf_counter() - t0, 3), "cached": False}
    final = cache.finish(entry, needs, summary)
    return final, {**summary, "entry": str(final)}


def run_plans(recipe: Recipe, ckpt: Checkpoint, entry: Path) -> dict[int, dict[int, Any]]:
    """``{step number: {layer: decision}}`` for the steps that declare a cross-layer plan."""
    plans: dict[int, dict[int, Any]] = {}
    protected = {i: set(ckpt.protected.get(i, ())) for i in ckpt.moe_layer_indices}
    for step in recipe.steps:
        if step.spec.plan is None:
            continue
        all_stats = {
            i: LayerStats(i, load_layer(entry, i, step.needs), protected=frozenset(protected[i]))
            for i in ckpt.moe_layer_indices
        }
        plans[step.number] = step.spec.plan(all_stats, step.config)
        if step.spec.protects is not None:
            for i, decision in plans[step.number].items():
                protected[i] |= set(step.spec.protects(decision))
    return plans


def _coerce(recipe_or_path, overrides) -> Recipe:
    if isinstance(recipe_or_path, Recipe):
        if overrides:
            raise RecipeError("overrides need a recipe path or dict, not a loaded Recipe")
        return recipe_or_path
    return load_recipe(recipe_or_path, overrides)


def apply(
    recipe: str | Path | Mapping[str, Any] | Recipe,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    *,
    dry_run_only: bool = False,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> RunResult:
    """Run a recipe; see the module docstring. Returns the output directory and the run report."""
    from moecompress.layer_loop import run_layer_loop

    rec = _coerce(recipe, overrides)
    out = Path(rec.output)
    if out.exists() and not overwrite and not dry_run_only:
        raise OutputExistsError(f"output directory {out} already exists; pass --overwrite (overwrite=True)")
    ckpt = _open(rec)
    plan = dry_run(rec, ckpt)
    fingerprint = _check_calibration_source(rec, ckpt)
    if resume:
        from moecompress.layer_loop import check_resumable

        check_resumable(rec)
    if dry_run_only:
        return RunResult(out, {"dry_run": plan}, dry_run=True)
    ids = _token_ids(rec, ckpt)
    t0 = time.perf_counter()
    extra = rec.fingerprint() if rec.calibration.propagate == "compressed" else ""
    on_layer = None
    if rec.calibration.propagate == "compressed":
        from moecompress.layer_loop import compress_for_propagation

        on_layer = compress_for_propagation(rec)
    entry, calib = calibrate_stats(
        rec, ckpt, ids, fingerprint, progress=progress, on_layer=on_layer, cache_key_extra=extra
    )
    plans = run_plans(rec, ckpt, entry)
    report = run_layer_loop(
        rec,
        ckpt,
        entry,
        plans,
        calib=calib,
        resume=resume,
        overwrite=overwrite,
        progress=progress,
        started=t0,
        dry=plan,
    )
    return RunResult(out, report)


def calibrate(recipe, overrides=(), *, progress: bool = True) -> Path:
    """Statistics only (``moecompress calibrate``): returns the cache entry directory."""
    rec = _coerce(recipe, overrides)
    ckpt = _open(rec)
    dry_run(rec, ckpt)
    fingerprint = _check_calibration_source(rec, ckpt)
    ids = _token_ids(rec, ckpt)
    entry, _ = calibrate_stats(rec, ckpt, ids, fingerprint, progress=progress)
    return entry
