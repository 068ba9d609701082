"""The recipe executor: dry run on ``meta``, layer-major calibration, plans, the streaming layer loop.

``apply(recipe)`` runs, in order (nothing is written before step 3):

1. load and validate the recipe (:mod:`moecompress.engine.recipe`) against the pass table (the
   built-in passes plus ``passes=``); settle what exists at the output (``--resume``,
   :mod:`moecompress.engine.journal`);
2. open the checkpoint (headers only) and **dry-run** the whole chain on ``meta`` layers
   (:mod:`moecompress.engine.dry_run`); check the calibration source (tokenizer present, enough text);
3. **calibrate** (or reuse the statistics cache): :mod:`moecompress.calibration.sweep`; with
   ``calibration.source: none`` (data-free steps only) nothing is calibrated: no token is read, no
   statistic collected or cached, and no reconstruction error measured (the reports say so: ``null``);
4. run cross-layer **plans**;
5. the **layer loop** (:mod:`moecompress.engine.run`): per decoder layer, read it, run the steps,
   write each emitted step's checkpoint, copy non-MoE tensors, free; journal for ``--resume``; under
   ``torchrun`` the other ranks work chunks of experts for rank 0 (:mod:`moecompress.engine.shard`);
6. reports, then the staging directory is renamed onto the output.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from moecompress.calibration.cache import (
    StatsCache,
    load_layer,
    model_key,
    save_experts,
    save_layer,
    tokens_key,
)
from moecompress.calibration.catalogue import ALWAYS
from moecompress.calibration.skeleton import Skeleton
from moecompress.calibration.sources import load_token_ids, source_fingerprint
from moecompress.calibration.stats import SPILLED
from moecompress.calibration.sweep import RANK_0_ALONE, Batches, run_calibration
from moecompress.engine import distributed, resources, segments, shard, wire
from moecompress.engine.context import RunContext, resolve_device
from moecompress.engine.distributed import Launch
from moecompress.engine.dry_run import dry_run
from moecompress.engine.journal import JOURNAL, finished, resumable, staging_dir
from moecompress.engine.lock import RunLock
from moecompress.engine.recipe import NO_CALIBRATION, Recipe, load_recipe, pass_table
from moecompress.engine.run import RecipeRun
from moecompress.engine.spec import PassSpec
from moecompress.engine.steps import compress_for_propagation, step_stats
from moecompress.errors import (
    CacheError,
    Interrupted,
    MoecompressError,
    OutputExistsError,
    RecipeError,
    WriteError,
)
from moecompress.io.checkpoint import Checkpoint, open_checkpoint

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_dir: Path
    report: dict = field(default_factory=dict)
    dry_run: bool = False
    resumed_finished: bool = False
    """``--resume`` found the output already finished by the same recipe: nothing was done."""
    cache_entry: Path | None = None
    """The statistics-cache entry the run used (reports name only its key, no local path)."""


def _open(recipe: Recipe) -> Checkpoint:
    try:
        return open_checkpoint(recipe.model)
    except MoecompressError as err:
        raise type(err)(f"recipe field 'model': {err}") from None


def _cache_root(recipe: Recipe) -> Path:
    c = recipe.calibration
    return Path(c.cache_dir) if c.cache_dir else Path(recipe.output).resolve().parent / ".moecompress-cache"


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _check_output(recipe: Recipe, ckpt: Checkpoint) -> None:
    """Before any work: the output may not be, hold or lie inside the input checkpoint or the statistics
    cache (``--overwrite`` would replace what the run reads; symlinks are resolved), may not be a mount
    point or the root (it is renamed into place), and its parent must be writable."""
    out = Path(recipe.output).resolve()
    for what, path in (("the input checkpoint", ckpt.path), ("the statistics cache", _cache_root(recipe))):
        if _overlaps(out, path.resolve()):
            raise RecipeError(
                f"recipe field 'output': {recipe.output} overlaps {what} {path}; choose an output directory "
                "outside it"
            )
    if out == out.parent or os.path.ismount(out):
        raise RecipeError(
            f"recipe field 'output': {recipe.output} is a mount point or the root, which cannot be renamed into "
            "place; choose a directory inside it"
        )
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    try:
        tempfile.TemporaryDirectory(dir=parent, prefix=f".{out.name}.probe-").cleanup()
    except OSError as err:
        raise RecipeError(
            f"recipe field 'output': cannot write in {parent} ({err.strerror}); choose a writable location"
        ) from None


def _check_calibration_source(recipe: Recipe, ckpt: Checkpoint) -> str:
    """Fail in the dry run on a bad source, a missing tokenizer or an unusable cache directory;
    returns the source fingerprint (the statistics cache key)."""
    c = recipe.calibration
    if c.data_free:  # nothing is read: no source, no tokenizer
        return NO_CALIBRATION
    fingerprint = source_fingerprint(
        c.source, model_dir=ckpt.path, samples=c.samples, seq_len=c.seq_len, seed=c.seed
    )
    if c.cache_dir is not None and Path(c.cache_dir).exists() and not Path(c.cache_dir).is_dir():
        raise RecipeError(f"calibration.cache_dir: {c.cache_dir!r} exists and is not a directory")
    return fingerprint


def _token_ids(recipe: Recipe, ckpt: Checkpoint) -> torch.Tensor:
    c = recipe.calibration
    return load_token_ids(c.source, model_dir=ckpt.path, samples=c.samples, seq_len=c.seq_len, seed=c.seed)


def calibrate_stats(
    recipe: Recipe,
    ckpt: Checkpoint,
    ids: torch.Tensor,
    fingerprint: str,
    ctx: RunContext,
    *,
    on_layer=None,
    cache_key_extra: str = "",
) -> tuple[Path, dict]:
    """Find or compute the statistics every step needs; returns (cache entry, summary)."""
    c = recipe.calibration
    needs = set(recipe.needs) | ALWAYS
    root = _cache_root(recipe)
    key = {
        "source": fingerprint,
        "samples": c.samples,
        "seq_len": c.seq_len,
        "seed": c.seed,
        "holdout": c.holdout_samples,
        "batch_size": c.batch_size,
        "sample_tokens": c.sample_tokens,
        "dtype": str(ctx.dtype),
        "propagate": c.propagate,
        "tokens": tokens_key(ids),
        "extra": cache_key_extra,
        **StatsCache.chunk_key(needs, ctx.expert_chunks),  # only when the chunking changes the statistics' bits
        **({"device": torch.device(ctx.device).type} if ctx.device != "cpu" else {}),  # other arithmetic
    }
    cache = StatsCache(root, model_key(ckpt), key)
    found = cache.find(needs) if on_layer is None else None
    ranks = ctx.ranks
    if ranks.from_writer(found is not None):  # rank 0 decides for every rank
        log.info("reusing calibration statistics from %s", found)
        return found, {"cached": True, "entry": str(found)}  # type: ignore[arg-type]
    writer = ranks.is_writer  # only rank 0 locks, writes and finishes the cache entry
    alone = ranks.world_size > 1 and bool(needs & RANK_0_ALONE)
    if alone and on_layer is not None:
        raise RecipeError(f"{', '.join(sorted(needs & RANK_0_ALONE))} under calibration.propagate: compressed is not "
                          "collected under torchrun; run one process")  # fmt: skip
    if alone and not writer:  # rank 0 calibrates alone; this rank waits until its entry is finished
        t0 = time.perf_counter()
        ranks.barrier()
        return cache.entry_path(needs), {"seconds": round(time.perf_counter() - t0, 3), "cached": False, "rank_0_alone": True}
    lock = RunLock(cache.entry_path(needs), f"statistics cache entry {cache.entry_path(needs)}") if writer else None
    with lock or nullcontext():
        entry = cache.begin(needs) if writer else None
        t0 = time.perf_counter()
        try:
            summary = run_calibration(
                Skeleton(ckpt, ctx.dtype, ctx.device),
                Batches.make(ids, c.holdout_samples, c.batch_size),
                needs,
                sample_tokens=c.sample_tokens,
                offload=c.offload,
                save_forward=lambda i, s: save_layer(entry, i, s) if writer else None,
                save_backward=lambda i, s: save_layer(entry, i, s, grad=True) if writer else None,
                save_experts=lambda i, a, s: save_experts(entry, i, a, s) if writer else None,
                on_layer=on_layer,
                progress=ctx.progress,
                expert_chunks=ctx.expert_chunks,
                ranks=None if alone else ranks,
                shard_experts=c.parallel == "auto",
            )
        except BaseException:
            if entry is not None:
                cache.abort(entry)  # a failed calibration leaves no partial entry behind
            raise
        summary = {**summary, "seconds": round(time.perf_counter() - t0, 3), "cached": False}
        if alone:
            summary["rank_0_alone"] = True
        if entry is None:  # a rank other than 0: its share is merged into rank 0's entry
            return cache.entry_path(needs), summary
        final = cache.finish(entry, needs, summary)
    if alone:
        ranks.barrier()  # the entry is complete: the other ranks go on
    return final, {**summary, "entry": str(final)}


def run_plans(recipe: Recipe, ckpt: Checkpoint, entry: Path | None) -> dict[int, dict[int, Any]]:
    """``{step number: {layer: decision}}`` for the steps that declare a cross-layer plan (``entry``
    ``None``: a data-free run, no statistics)."""
    plans: dict[int, dict[int, Any]] = {}
    protected = {i: set(ckpt.protected.get(i, ())) for i in ckpt.moe_layer_indices}
    for step in recipe.steps:
        if not step.spec.plans_for(step.config):  # no plan, or this configuration decides nothing across layers
            continue
        all_stats = {
            i: step_stats(step, i, load_layer(entry, i, experts=bool(set(SPILLED) & step.needs)) if entry is not None else {},
                          protected=frozenset(protected[i]))
            for i in ckpt.moe_layer_indices
        }
        plans[step.number] = step.spec.plan(all_stats, step.config)
        if step.spec.protects is not None:
            for i, decision in plans[step.number].items():
                protected[i] |= set(step.spec.protects(decision))
    return plans


def _coerce(recipe_or_path, overrides, passes: Iterable[PassSpec]) -> Recipe:
    if isinstance(recipe_or_path, Recipe):
        if overrides:
            raise RecipeError("overrides need a recipe path or dict, not a loaded Recipe")
        return recipe_or_path
    return load_recipe(recipe_or_path, overrides, passes=pass_table(passes))


def apply(
    recipe: str | Path | Mapping[str, Any] | Recipe,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    *,
    passes: Iterable[PassSpec] = (),
    dry_run_only: bool = False,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    launch: Launch | None = None,
) -> RunResult:
    """Run a recipe; see the module docstring. ``passes``: extra steps (plugins) besides the built-in
    ones. ``launch``: this process among ``torchrun``'s ranks (``docs/distributed.md``; rank 0 writes).
    Returns the output directory and the run report."""
    rec = _coerce(recipe, overrides, passes)
    launch = launch or Launch()
    ready = _prepare(rec, resume=resume, overwrite=overwrite, dry_run_only=dry_run_only, launch=launch)
    if isinstance(ready, RunResult):
        return ready
    if launch.world_size > 1:
        _check_stages_distributed(rec)
    ranks = distributed.start(launch, resolve_device(rec.calibration.device))
    try:
        return _run(rec, *ready, resume=resume, overwrite=overwrite, progress=progress, ranks=ranks)
    finally:
        distributed.stop(ranks)


def _check_stages_distributed(rec: Recipe) -> None:
    """Under ``torchrun`` a stage trains with FSDP2 (``training/fsdp.py``); refuse what that does not cover."""
    from moecompress.training.fsdp import unsupported

    for step in rec.steps:
        why = unsupported(step.config) if step.spec.stage is not None else None
        if why is not None:
            raise RecipeError(f"{step.label}: {why} does not run under torchrun yet; run one process")


def _prepare(rec: Recipe, *, resume: bool, overwrite: bool, dry_run_only: bool, launch: Launch | None = None):
    """Steps 1-2 of the module docstring on every rank: a finished ``--resume`` or a dry run as its
    :class:`RunResult`, else ``(checkpoint, dry-run plan, source fingerprint, journal)``."""
    out = Path(rec.output)
    journal = None
    if resume:
        done = finished(rec)
        if done is not None:
            log.info("%s is already finished by this recipe; nothing to resume", out)
            return RunResult(out, done, resumed_finished=True)
    elif out.exists() and not overwrite and not dry_run_only:
        raise OutputExistsError(f"output directory {out} already exists; pass --overwrite (overwrite=True)")
    ckpt = _open(rec)
    _check_output(rec, ckpt)
    plan = dry_run(rec, ckpt, launch)
    resources.check(rec, plan, out.parent, memory=resources.available_memory(), disk_free=resources.free_disk(out))
    fingerprint = _check_calibration_source(rec, ckpt)
    if resume:
        journal = resumable(rec)
        if journal is None:
            log.info("nothing durable to resume in %s; starting over", out)
    if dry_run_only:
        return RunResult(out, {"dry_run": plan}, dry_run=True)
    return ckpt, plan, fingerprint, journal


def _segment(rec: Recipe, resume: bool, progress: bool, ranks: distributed.Ranks) -> dict:
    """A per-layer segment of a segmented run, over the run's ranks (the process group stays open)."""
    ready = _prepare(rec, resume=resume, overwrite=True, dry_run_only=False)
    if isinstance(ready, RunResult):
        return ready.report
    return _run(rec, *ready, resume=resume, overwrite=True, progress=progress, ranks=ranks).report


def _run(rec: Recipe, ckpt: Checkpoint, plan: dict, fingerprint: str, journal: dict | None, *, resume: bool,
         overwrite: bool, progress: bool, ranks: distributed.Ranks) -> RunResult:  # fmt: skip
    """Steps 3-6 on ``ranks`` (started by the caller, who stops them)."""
    out = Path(rec.output)
    ranks.barrier()  # every rank has checked the output before rank 0 may write it
    with RunLock(out, f"output {out}") if ranks.is_writer else nullcontext():
        if not resume and out.exists() and not overwrite and ranks.is_writer:  # it may have appeared meanwhile
            raise OutputExistsError(f"output directory {out} already exists; pass --overwrite (overwrite=True)")
        try:
            if segments.segmented(rec):  # stages or recalibration: the recipe runs as segments, on every rank
                sub = lambda r, again: _segment(r, again, progress, ranks)  # noqa: E731
                report = segments.run_segments(rec, ckpt, plan, resume=resume, progress=progress and ranks.is_writer,
                                               run_layers=sub, ranks=ranks)  # fmt: skip
                return RunResult(out, report)
            if not ranks.is_writer:
                return _compress(rec, ckpt, plan, fingerprint, None, False, ranks)
            return _compress(rec, ckpt, plan, fingerprint, journal, progress, ranks)
        except MoecompressError as err:
            if ranks.is_writer:
                raise _with_note(err, _leftover(rec, keep=isinstance(err, CacheError))) from None
            raise _with_note(err, f"rank {ranks.rank} writes nothing") from None
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted; {_left(rec, ranks)}") from None
        except OSError as err:
            raise WriteError(f"cannot write {err.filename or rec.output}: {err.strerror}; {_left(rec, ranks)}") from None
        except SafetensorError as err:
            raise WriteError(f"cannot write the output ({err}); {_left(rec, ranks)}") from None


DATA_FREE_NOTE = "calibration.source: none: no calibration tokens were read and no statistics collected"
NOT_MEASURED = "reconstruction errors were not measured (calibration.source: none): null, not 0"


def _compress(rec: Recipe, ckpt: Checkpoint, plan: dict, fingerprint: str, journal: dict | None, progress: bool,
              ranks: distributed.Ranks = distributed.SINGLE):  # fmt: skip
    ctx = RunContext.for_recipe(rec, ckpt, progress=progress, plan=plan, ranks=ranks)
    t0 = time.perf_counter()
    entry: Path | None
    if rec.calibration.data_free:  # no tokens, no sweep, no cache entry; nothing to compare against
        entry, calib = None, {"source": NO_CALIBRATION, "note": DATA_FREE_NOTE, "reconstruction_errors": None,
                              "reconstruction_note": NOT_MEASURED, "seconds": 0.0, "cached": False}  # fmt: skip
    else:
        if plan.get("data_free_steps"):
            log.info("no step needs calibration statistics; calibration.source: none would skip calibration "
                     "(reconstruction errors are then not measured)")  # fmt: skip
        ids = _token_ids(rec, ckpt)
        compressed = rec.calibration.propagate == "compressed"
        entry, calib = calibrate_stats(
            rec, ckpt, ids, fingerprint, ctx,
            on_layer=compress_for_propagation(rec, ctx.device) if compressed else None,
            cache_key_extra=rec.fingerprint() if compressed else "",
        )  # fmt: skip
    if not ranks.is_writer:  # its calibration share is done; it works the chunks of experts rank 0 hands out
        files = wire.unit_files(ranks, staging_dir(rec.output))
        work = shard.follow(ranks, ckpt, list(rec.steps), entry, ctx, lambda: run_plans(rec, ckpt, entry),
                            needs_stats=not rec.calibration.data_free, files=files)  # fmt: skip
        report = {"rank": ranks.rank, "calibration": calib, "layer_loop": work}
        return RunResult(Path(rec.output), report, cache_entry=entry)
    plans = run_plans(rec, ckpt, entry)
    run = RecipeRun(rec, ckpt, entry, plans, ctx, journal, dequantize=plan.get("dequantize_output", False))
    wire.unit_files(ranks, run.staging)  # the other ranks learn whether they write their units' tensors there
    run.loop()
    shard.release(ranks, list(rec.steps))  # before the rename: a rank lost by now fails the run
    if entry is None:  # every row says that its error is unknown, not zero
        for rows in run.rows.values():
            for row in rows:
                row.update(rel_error=None, sqnr_db=None)
    return RunResult(Path(rec.output), run.finish(calib, t0, plan), cache_entry=entry)


def _with_note(err: MoecompressError, note: str) -> MoecompressError:
    """``err`` with ``note`` appended, as the same type where its constructor takes one message."""
    try:
        return type(err)(f"{err}; {note}")
    except TypeError:
        out = MoecompressError(f"{err}; {note}")
        out.exit_code = err.exit_code
        return out


def _left(rec: Recipe, ranks: distributed.Ranks) -> str:
    """:func:`_leftover` on the writing rank; the other ranks never touch the output."""
    return _leftover(rec) if ranks.is_writer else f"rank {ranks.rank} writes nothing"


def _leftover(rec: Recipe, keep: bool = True) -> str:
    """After a failed run: keep the staging directory when ``--resume`` can use it (a journal of
    durable layers exists and the failure was not the recipe's), else remove it; say which."""
    staging = staging_dir(rec.output)
    kept = segments.leftover_note(rec)
    if kept:
        shutil.rmtree(staging, ignore_errors=True)
        return kept
    if keep and (staging / JOURNAL).is_file():
        return f"the durable layers are kept in {staging}: run the same command with --resume to continue"
    shutil.rmtree(staging, ignore_errors=True)
    return "nothing was written"


def calibrate(recipe, overrides=(), *, passes: Iterable[PassSpec] = (), progress: bool = True) -> Path:
    """Statistics only (``moecompress calibrate``): returns the cache entry directory."""
    rec = _coerce(recipe, overrides, passes)
    if rec.calibration.data_free:
        raise RecipeError(
            "calibration.source: none collects no statistics, so there is nothing to calibrate; use a calibration "
            "source (builtin, file:PATH, hf:NAME, random)"
        )
    ckpt = _open(rec)
    plan = dry_run(rec, ckpt)
    fingerprint = _check_calibration_source(rec, ckpt)
    ctx = RunContext.for_recipe(rec, ckpt, progress=progress, plan=plan)
    entry, _ = calibrate_stats(rec, ckpt, _token_ids(rec, ckpt), fingerprint, ctx)
    return entry
