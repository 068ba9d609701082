"""Whole-model stages in a recipe: the recipe cut into *segments* (``docs/training.md``).

A step whose spec has a ``stage`` (``distill``) needs the whole model, so the recipe is cut there:
``[a, b, distill, c]`` runs as the per-layer segment ``[a, b]`` (streamed as always, with its own
calibration, into a staged checkpoint), the stage (reads that checkpoint, writes one in the same
layouts), then the segment ``[c]`` (calibrated on the stage's output). Under ``calibration.recalibrate: auto`` the
recipe is also cut before a step whose statistics cannot follow the layer through the earlier steps
(``heapr`` after ``expert_prune``: its gradients need a backward through the pruned model), so that step's
segment is calibrated afresh on the earlier segment's output (``engine/follow.py``). Staged checkpoints live in
``.<output>.segments/<n>-<last step>-<hash>/`` beside the output; the hash chains every earlier
segment's steps, so a finished segment is reused by ``--resume`` only when nothing before it changed.
At the end the last segment's checkpoint becomes the output, with every step's report (and, under
``emit: every_step``, every segment's checkpoint in ``steps/<step>/checkpoint``) and one run report.

The dry run chains a stage like any step (its ``emits``: layouts unchanged) and adds the stage's own
checks here: the teacher (same vocabulary and tokenizer), the training text and the memory estimate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from moecompress._version import __version__
from moecompress.calibration.sources import source_fingerprint
from moecompress.engine import follow, resources
from moecompress.engine.distributed import SINGLE, Launch, Ranks
from moecompress.engine.journal import staging_dir, write_json_atomic
from moecompress.engine.recipe import Recipe, Step
from moecompress.engine.spec import StageJob
from moecompress.errors import MoecompressError, RecipeError
from moecompress.hub.card import public_path, public_recipe, write_model_card
from moecompress.io.checkpoint import Checkpoint, open_checkpoint
from moecompress.io.outputs import move_into_place, parse_size
from moecompress.report.write import write_run_report, write_step_report

GiB = 1024**3
OWN_FILES = ("steps", "report.json", "report.md", "README.md")


def has_stages(rec: Recipe) -> bool:
    return any(s.spec.stage is not None for s in rec.steps)


def segmented(rec: Recipe) -> bool:
    """Whether the recipe runs as more than one segment (a stage, or a cut for recalibration)."""
    return has_stages(rec) or len(split(rec)) > 1


def split(rec: Recipe) -> list[list[Step]]:
    """The recipe's steps cut at every stage (each stage is a segment of its own) and, under
    ``calibration.recalibrate: auto``, before every step whose statistics cannot follow the layer through
    the earlier steps (:func:`moecompress.engine.follow.cuts`): that segment is calibrated afresh."""
    fresh = set(follow.cuts(rec.steps, strict=rec.recalibrates == "chunks")) if rec.recalibrates else set()
    out: list[list[Step]] = [[]]
    for n, s in enumerate(rec.steps):
        if s.spec.stage is not None:
            out += [[s], []]
        elif n in fresh:
            out.append([s])
        else:
            out[-1].append(s)
    return [seg for seg in out if seg]


def segments_dir(output: str | Path) -> Path:
    out = Path(output)
    return out.parent / f".{out.name}.segments"


def _teacher(rec: Recipe, step: Step) -> str:
    return step.config.teacher or rec.model


def _job(rec: Recipe, step: Step, src: Path, out: Path, progress: bool, device: str = "cpu",
         state: Path | None = None, teacher: Path | None = None, ranks: Ranks = SINGLE) -> StageJob:  # fmt: skip
    """``teacher``: the teacher's resolved directory (default: the step's or the recipe's model, resolved)."""
    if teacher is None:
        teacher = open_checkpoint(_teacher(rec, step)).path  # a Hub id or moecompress:quickstart -> its directory
    return StageJob(step.label, step.config, src, Path(teacher), out, rec.calibration,
                    rec.max_shard_size, device, progress, state, ranks)  # fmt: skip


def stage_plan(rec: Recipe, ckpt: Checkpoint, plan: dict, launch: Launch | None = None) -> dict:
    """Dry-run checks of every stage (teacher, text, memory); returns ``{"stage_memory_bytes": ...}``.
    Under ``torchrun`` (``launch``) the memory is one rank's (FSDP2), against ``memory_limit`` (a
    process's) or this host's memory shared by its ranks."""
    from moecompress.training.stage import check_teacher

    est: dict[str, int] = {}
    c, launch = rec.calibration, launch or Launch()
    world = launch.world_size
    limit = parse_size(c.memory_limit) if c.memory_limit is not None else resources.available_memory()
    if limit is not None and c.memory_limit is None:
        limit //= launch.ranks_here
    for n, step in enumerate(rec.steps):
        if step.spec.stage is None:
            continue
        teacher = _teacher(rec, step)
        try:
            t_ckpt = ckpt if teacher == rec.model else open_checkpoint(teacher)
        except MoecompressError as err:
            raise RecipeError(f"{step.label}: field 'teacher': {err}") from None
        check_teacher(ckpt.path, t_ckpt.path, step.label)
        cfg = step.config
        try:
            source_fingerprint(cfg.data or c.source, model_dir=t_ckpt.path, samples=cfg.samples,
                               seq_len=cfg.seq_len, seed=cfg.seed)  # fmt: skip
        except MoecompressError as err:
            raise RecipeError(f"{step.label}: field 'data': {err}") from None
        prev = rec.steps[n - 1].label if n else None
        student = plan["estimated_output_bytes"].get(prev, plan["input_bytes"]) if prev else plan["input_bytes"]
        teacher_bytes = sum(t_ckpt.reader.nbytes(k) for k in t_ckpt.reader.keys)
        job = _job(rec, step, ckpt.path, ckpt.path, False, teacher=t_ckpt.path)
        need = step.spec.stage.memory(job, student, teacher_bytes, world)
        est[step.label] = need
        if limit is not None and need > limit:
            where = "calibration.memory_limit" if c.memory_limit is not None else "available on this machine"
            if world > 1:
                where += f" per rank ({launch.ranks_here} ranks on this host)" if c.memory_limit is None else ""
            per = f" per rank of {world}" if world > 1 else ""
            raise RecipeError(
                f"{step.label}: training needs about {need / GiB:.1f} GiB of memory{per} (student and teacher weights, "
                f"gradients, AdamW state, activations of {cfg.batch} × {cfg.seq_len} tokens) but {limit / GiB:.1f} GiB "
                f"are {where}; lower batch or seq_len, or train on a larger device"
            )
    return {"stage_memory_bytes": est}


def _chain(prev: str, rec: Recipe, steps: list[Step]) -> str:
    d = {"prev": prev, "calibration": rec.calibration.model_dump(), "emit": rec.emit,
         "steps": [{s.name: s.config.model_dump(mode="json"), "number": s.number} for s in steps]}  # fmt: skip
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _sub_recipe(rec: Recipe, steps: list[Step], model: Path, output: Path, cache: Path) -> Recipe:
    cal = rec.calibration.model_copy(update={"cache_dir": str(cache)})
    return dataclasses.replace(rec, model=str(model), output=str(output), steps=tuple(steps), calibration=cal)


def _moe_size(path: Path) -> tuple[int, int]:
    ck = open_checkpoint(path)
    keys = [k for i in ck.moe_layer_indices for k in ck.moe_keys(i)]
    return sum(math.prod(ck.reader.shape(k)) for k in keys), sum(ck.reader.nbytes(k) for k in keys)


def _run_stage(rec: Recipe, step: Step, src: Path, out: Path, chain: str, progress: bool, device: str,
               ranks: Ranks = SINGLE) -> dict:  # fmt: skip
    """Train and write the stage's checkpoint (under ``torchrun`` every rank trains, rank 0 writes)."""
    staging = out.with_name(out.name + ".partial")
    if ranks.is_writer:
        shutil.rmtree(staging, ignore_errors=True)
    t0 = time.perf_counter()
    state = out.with_name(out.name + ".state") if ranks.world_size == 1 else None  # (save_every is refused)
    extra = step.spec.stage.run(_job(rec, step, src, staging, progress and ranks.is_writer, device, state,
                                     ranks=ranks))  # fmt: skip
    secs = time.perf_counter() - t0
    if not ranks.is_writer:
        return {"rank": ranks.rank, "seconds": round(secs, 3), "peak_rss_mb": extra.get("peak_rss_mb") or 0.0}
    params, nbytes = _moe_size(staging)
    total = sum(math.prod(open_checkpoint(staging).reader.shape(k)) for k in open_checkpoint(staging).reader.keys)
    report = {
        "step": step.number, "name": step.name, "config": step.config.model_dump(mode="json"), "layers": [],
        "seconds": round(secs, 3), "peak_rss_mb": extra.get("peak_rss_mb"), "model_params_before": total,
        "model_params_after": total, "summary": extra.get("summary", {}), "warnings": extra.get("warnings", []),
        "plots": extra.get("plots", []), "checkpoint": ".",
    }  # fmt: skip
    write_step_report(staging / "steps" / step.dirname, report)
    entry = {"step": step.number, "name": step.name, "report": f"steps/{step.dirname}/report.md",
             "params_before": params, "params_after": params, "bytes_before": nbytes, "bytes_after": nbytes,
             "seconds": report["seconds"], "model_params_before": total, "model_params_after": total}  # fmt: skip
    run = {"segment_hash": chain, "steps": [entry], "total_seconds": round(secs, 3),
           "peak_rss_mb": extra.get("peak_rss_mb") or 0.0,
           "warnings": [f"{step.label}: {w}" for w in report["warnings"]]}  # fmt: skip
    write_json_atomic(staging / "report.json", run)
    move_into_place(staging, out)
    if state is not None:
        shutil.rmtree(state, ignore_errors=True)
    return run


def _finished_stage(out: Path, chain: str) -> dict | None:
    try:
        run = json.loads((out / "report.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return run if isinstance(run, dict) and run.get("segment_hash") == chain else None


def run_segments(
    rec: Recipe, ckpt: Checkpoint, dry: dict, *, resume: bool, progress: bool,
    run_layers: Callable[[Recipe, bool], dict], ranks: Ranks = SINGLE,
) -> dict:  # fmt: skip
    """Run every segment (reusing finished ones under ``resume``), assemble the output; returns the run
    report. ``run_layers(sub_recipe, resume)`` runs a per-layer segment (``executor.apply``). Under
    ``torchrun`` every rank runs every segment (rank 0's ``--resume`` decision for a stage), rank 0 alone
    writes, and a barrier after each segment puts its checkpoint in place before any rank reads it; the
    other ranks return ``{"rank": r, "segments": [...]}``."""
    root = segments_dir(rec.output)
    if ranks.is_writer:
        if not resume:
            shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    cache = Path(rec.calibration.cache_dir) if rec.calibration.cache_dir else Path(rec.output).resolve().parent / ".moecompress-cache"
    t0 = time.perf_counter()
    src, chain, done = ckpt.path, "", []
    for k, steps in enumerate(split(rec), start=1):
        chain = _chain(chain, rec, steps)
        out = root / f"{k:02d}-{steps[-1].name}-{chain}"
        if steps[0].spec.stage is not None:
            kept = _finished_stage(out, chain) if resume else None
            if ranks.from_writer(kept is not None):  # rank 0's --resume decision
                run = kept or {}
            else:
                run = _run_stage(rec, steps[0], src, out, chain, progress, str(dry.get("device", "cpu")), ranks)
        else:
            run = run_layers(_sub_recipe(rec, steps, src, out, cache), resume)
        ranks.barrier()  # the segment's checkpoint is in place (rank 0's rename) before any rank reads it
        done.append((steps, out, run))
        src = out
    if not ranks.is_writer:
        return {"rank": ranks.rank, "segments": [r for _, _, r in done]}
    return _assemble(rec, ckpt, dry, done, time.perf_counter() - t0)


def _assemble(rec: Recipe, ckpt: Checkpoint, dry: dict, done: list, seconds: float) -> dict:
    """The last segment's checkpoint becomes the output, with every step's report and one run report."""
    staging, out = staging_dir(rec.output), Path(rec.output)
    shutil.rmtree(staging, ignore_errors=True)
    # the last segment that wrote a checkpoint (a segment of report-only steps writes reports only)
    base = next((k for k in range(len(done) - 1, -1, -1) if (done[k][1] / "config.json").is_file()), len(done) - 1)
    shutil.move(str(done[base][1]), str(staging))
    (staging / "steps").mkdir(exist_ok=True)
    for k, (steps, seg, _) in enumerate(done):
        if k == base:
            continue
        for d in sorted((seg / "steps").glob("*")) if (seg / "steps").is_dir() else []:
            shutil.move(str(d), str(staging / "steps" / d.name))
        if rec.emit == "every_step" and k < base:
            dst = staging / "steps" / steps[-1].dirname / "checkpoint"
            dst.mkdir(parents=True, exist_ok=True)
            for f in seg.iterdir():
                if f.name not in OWN_FILES:
                    shutil.move(str(f), str(dst / f.name))
    cfg_path = staging / "config.json"
    cfg = json.loads(cfg_path.read_text())
    block = cfg.get("moecompress")
    if isinstance(block, dict):
        block.update(version=__version__, recipe_hash=rec.fingerprint(), steps=[s.name for s in rec.steps])
        write_json_atomic(cfg_path, cfg)
    (staging / "recipe.yaml").write_text(rec.to_yaml())
    runs = [r for _, _, r in done]
    run = {
        "recipe": public_recipe(rec.to_dict()),
        "recipe_hash": rec.fingerprint(),
        "model": public_path(rec.model),
        "output": public_path(str(out)),
        "moecompress_version": __version__,
        "steps": [s for r in runs for s in r.get("steps", [])],
        "segments": [[s.label for s in steps] for steps, _, _ in done],
        "calibration": {f"segment {n}": r["calibration"] for n, r in enumerate(runs, 1) if "calibration" in r},
        "dry_run": dry,
        "total_seconds": round(seconds, 3),
        "peak_rss_mb": max((float(r.get("peak_rss_mb") or 0.0) for r in runs), default=0.0),
        "warnings": [w for r in runs for w in r.get("warnings", [])],
        "checkpoint": True,
        "base_card": (ckpt.path / "README.md").read_text(encoding="utf-8", errors="replace")
        if (ckpt.path / "README.md").is_file() else None,
        "input_files_skipped": ckpt.skipped_files(rec.copy_extra),
    }
    write_run_report(staging, run)
    final = open_checkpoint(staging)
    write_model_card(staging, run=run, base_config=ckpt.raw_config, base_card=run["base_card"],
                     loadability="moecompress" if final.layouts else "stock", name=out.name)  # fmt: skip
    move_into_place(staging, out)
    shutil.rmtree(segments_dir(rec.output), ignore_errors=True)
    return run


def leftover_note(rec: Recipe) -> str | None:
    """After a failed segmented run: where the finished segments are kept."""
    root = segments_dir(rec.output)
    if root.is_dir() and any(root.iterdir()):
        return f"finished segments are kept in {root}: run the same command with --resume to continue"
    return None


__all__ = ["has_stages", "leftover_note", "run_segments", "segmented", "split", "stage_plan"]
