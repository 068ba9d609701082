"""The streaming layer loop: steps per MoE layer, one writer per emitted checkpoint, journal, reports.

Everything is written into ``.<output>.partial/`` beside the output directory and renamed onto it
only at the end. After each shard flush (all writers flush together, at a decoder-layer boundary)
``journal.json`` records the flushed shards and the per-layer report rows, so ``--resume`` after a
crash (``kill -9`` included) drops any half-written part, restores the writers and continues with
the first layer that was not yet durable. Every computation is deterministic, so the resumed output
is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from moecompress.calibration.cache import load_layer
from moecompress.errors import MoecompressError, PassError, ResumeError
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.format import config_with_layers, encode_layer, layer_shape
from moecompress.io.writer import ShardWriter, move_into_place
from moecompress.ir import MoELayer
from moecompress.protection import (
    MASSIVE_RATIO_WARNING,
    RENUMBER_KEY,
    TopActivation,
    protection_violations,
)
from moecompress.recipe import Recipe, Step
from moecompress.reference import moe_forward
from moecompress.registry import LayerStats
from moecompress.report import json_safe, relative_error, sqnr_db, write_run_report, write_step_report
from moecompress.skeleton import cast_layer

JOURNAL = "journal.json"


def rss_mb() -> float:
    """Current resident memory in MB (Linux ``VmRSS``; elsewhere the peak so far)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def run_step(step: Step, layer: MoELayer, stats: LayerStats) -> tuple[MoELayer, dict]:
    """One step on one layer, with errors that name the step and the layer; enforces the protection
    contract (:mod:`moecompress.protection`)."""
    try:
        new, info = step.spec.fn(layer, stats, step.config)
    except MoecompressError as err:
        raise PassError(f"{step.label}, layer {layer.index}: {err}") from None
    if not isinstance(new, MoELayer) or not isinstance(info, dict):
        raise PassError(f"{step.label}: a pass must return (MoELayer, dict), got {type(new).__name__}")
    if step.spec.report_only:
        return layer, info
    broken = protection_violations(layer, new, info.get(RENUMBER_KEY))
    if broken:
        raise PassError(
            f"{step.label}, layer {layer.index}: {broken[0]} ({len(broken)} violation(s)); protected (super) "
            "experts must stay bit-identical: the pass must skip layer.protected"
        )
    return new, info


def compress_for_propagation(rec: Recipe):
    """``calibration.propagate: compressed``: the layer that the next layer's inputs come from."""

    def on_layer(i: int, layer: MoELayer, stats: dict[str, torch.Tensor]) -> MoELayer:
        for step in rec.steps:
            layer, _ = run_step(step, layer, LayerStats(i, stats))
        return layer

    return on_layer


def _checkpoint_dirs(rec: Recipe, staging: Path) -> dict[int, Path]:
    emitted = [s for s in rec.steps if not s.spec.report_only]
    if rec.emit == "final":
        emitted = emitted[-1:]
    dirs = {s.number: staging / "steps" / s.dirname / "checkpoint" for s in emitted}
    if emitted:
        dirs[emitted[-1].number] = staging
    return dirs


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(json_safe(obj), allow_nan=False))
    os.replace(tmp, path)


def check_resumable(rec: Recipe) -> dict:
    """The journal of an interrupted run of this recipe, or a ResumeError (before any work)."""
    out = Path(rec.output)
    staging = out.parent / f".{out.name}.partial"
    journal = staging / JOURNAL
    if not journal.is_file():
        raise ResumeError(f"nothing to resume: no journal in {staging}; run without --resume")
    try:
        j = json.loads(journal.read_text())
    except json.JSONDecodeError:
        raise ResumeError(f"{journal} is damaged; run without --resume") from None
    if j.get("recipe") != rec.fingerprint():
        raise ResumeError(f"{staging} belongs to a different recipe; run without --resume")
    return j


class _Run:
    def __init__(self, rec: Recipe, ckpt: Checkpoint, entry: Path, plans: dict, resume: bool) -> None:
        self.rec, self.ckpt, self.entry, self.plans = rec, ckpt, entry, plans
        out = Path(rec.output)
        self.out = out
        self.staging = out.parent / f".{out.name}.partial"
        self.dirs = _checkpoint_dirs(rec, self.staging)
        self.rows: dict[int, list[dict]] = {s.number: [] for s in rec.steps}
        self.infos: dict[int, dict[int, dict]] = {s.number: {} for s in rec.steps}
        self.seconds = {s.number: 0.0 for s in rec.steps}
        self.peak = {s.number: 0.0 for s in rec.steps}
        self.start_group = 0
        from moecompress.executor import compute_dtype

        self.dtype = compute_dtype(rec, ckpt)
        if resume:
            j = check_resumable(rec)
        else:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging.mkdir(parents=True)
        self.writers = {
            n: ShardWriter(d, max_shard_size=rec.max_shard_size, staged=True) for n, d in self.dirs.items()
        }
        self.descs: dict[int, dict[int, dict | None]] = {n: {} for n in self.writers}
        self.shapes: dict[int, dict[int, list[int]]] = {n: {} for n in self.writers}
        self.protected: dict[int, dict[str, list[int]]] = {n: {} for n in self.writers}
        if resume:
            for n, w in self.writers.items():
                w.restore(j["writers"][str(n)])
            self.rows = {int(k): v for k, v in j["rows"].items()}
            self.infos = {int(k): {int(i): x for i, x in v.items()} for k, v in j["infos"].items()}
            self.start_group = int(j["done_group"]) + 1
            self.descs = {int(n): {int(i): d for i, d in v.items()} for n, v in j["descs"].items()}
            self.shapes = {int(n): {int(i): d for i, d in v.items()} for n, v in j["shapes"].items()}
            self.protected = {int(n): v for n, v in j["protected"].items()}

    def save_journal(self, done_group: int) -> None:
        _write_json_atomic(
            self.staging / JOURNAL,
            {
                "recipe": self.rec.fingerprint(),
                "done_group": done_group,
                "writers": {str(n): w.state() for n, w in self.writers.items()},
                "rows": {str(k): v for k, v in self.rows.items()},
                "infos": {str(k): {str(i): x for i, x in v.items()} for k, v in self.infos.items()},
                "descs": {str(n): {str(i): d for i, d in v.items()} for n, v in self.descs.items()},
                "shapes": {str(n): {str(i): d for i, d in v.items()} for n, v in self.shapes.items()},
                "protected": {str(n): v for n, v in self.protected.items()},
            },
        )

    def moe_layer(self, idx: int) -> None:
        layer = self.ckpt.read_layer(idx)
        stats = load_layer(self.entry, idx)
        hx = stats.get("holdout_x")
        hy = None
        if hx is not None:  # the original block on the held-back tokens: the reference for every step
            hx = hx.to(self.dtype)
            top0 = TopActivation()
            hy = moe_forward(cast_layer(layer, self.dtype), hx, top0)
        for step in self.rec.steps:
            # sizes compare the step's input and output; the error is cumulative (vs the original block)
            before_params, before_bytes = layer.num_params(), layer.nbytes()
            t0 = time.perf_counter()
            st = LayerStats(idx, stats, plan=self.plans.get(step.number, {}).get(idx))
            new, info = run_step(step, layer, st)
            secs = time.perf_counter() - t0
            row = {
                "layer": idx,
                "params_before": before_params,
                "params_after": new.num_params(),
                "bytes_before": before_bytes,
                "bytes_after": new.nbytes(),
                "seconds": round(secs, 4),
            }
            if hx is not None and hy is not None:
                top = TopActivation()
                approx = moe_forward(cast_layer(new, self.dtype), hx, top)
                row["rel_error"], row["sqnr_db"] = relative_error(hy, approx), sqnr_db(hy, approx)
                row["massive_ratio"] = top.value / top0.value if top0.value > 0 else 1.0
            self.rows[step.number].append(row)
            self.infos[step.number][idx] = json_safe(info)
            if step.number in self.writers:
                tensors, self.descs[step.number][idx] = encode_layer(self.ckpt.adapter, new)
                self.shapes[step.number][idx] = layer_shape(new)
                if new.protected:
                    self.protected[step.number][str(idx)] = sorted(new.protected)
                self.writers[step.number].add_many(tensors)
                del tensors
            self.seconds[step.number] += secs
            self.peak[step.number] = max(self.peak[step.number], rss_mb())
            layer = new

    def loop(self, progress: bool) -> None:
        moe = set(self.ckpt.moe_layer_indices)
        groups = self.ckpt.key_groups()
        for g, (idx, keys) in enumerate(tqdm(groups, desc="compress", unit="layer", disable=not progress)):
            if g < self.start_group:
                continue
            need = sum(self.ckpt.reader.nbytes(k) for k in keys)
            if any(
                w.buffered_bytes and w.buffered_bytes + need > w.max_shard_size for w in self.writers.values()
            ):
                for w in self.writers.values():
                    w.flush()
                self.save_journal(g - 1)
            owned: set[str] = set()
            if idx in moe:
                self.moe_layer(idx)
                owned = set(self.ckpt.moe_keys(idx))
            rest = [k for k in keys if k not in owned]
            if rest and self.writers:
                tensors = self.ckpt.reader.get_many(rest)
                for w in self.writers.values():
                    w.add_many(tensors)

    def _write_card(self, run: dict) -> None:
        from moecompress.io.card import write_model_card

        final = max(self.writers)
        write_model_card(self.staging, **_card_kwargs(run, self.ckpt, self.descs[final], self.out.name))

    def finish(self, calib: dict, started: float, dry: dict) -> dict:
        from moecompress import __version__

        for n, w in self.writers.items():
            w.commit()
            for f in self.ckpt.non_weight_files():
                if f.name != "README.md":  # the base model's card describes the base, not this output
                    shutil.copy2(f, self.dirs[n] / f.name)
            (self.dirs[n] / "recipe.yaml").write_text(self.rec.to_yaml())
            provenance = {
                "version": __version__,
                "recipe_hash": self.rec.fingerprint(),
                "steps": [s.name for s in self.rec.steps if s.number <= n],
            }
            if self.protected[n]:
                provenance["protected"] = self.protected[n]
            cfg = config_with_layers(
                self.ckpt.raw_config,
                self.descs[n],
                self.shapes[n],
                adapter=self.ckpt.adapter,
                provenance=provenance,
            )
            _write_json_atomic(self.dirs[n] / "config.json", cfg)
        steps, warnings = [], []
        model_params = sum(math.prod(self.ckpt.reader.shape(k)) for k in self.ckpt.reader.keys)  # whole model
        for step in self.rec.steps:
            delta = sum(r["params_before"] - r["params_after"] for r in self.rows[step.number])
            extra = step.spec.summarize(self.infos[step.number], step.config) if step.spec.summarize else {}
            extra.setdefault("warnings", [])
            extra["warnings"] = [*extra["warnings"], *_massive_warnings(self.rows[step.number])]
            report = {
                "step": step.number,
                "name": step.name,
                "config": step.config.model_dump(mode="json"),
                "layers": [
                    {**r, "info": self.infos[step.number].get(r["layer"], {})} for r in self.rows[step.number]
                ],
                "seconds": round(self.seconds[step.number], 3),
                "peak_rss_mb": round(self.peak[step.number], 1),
                "model_params_before": model_params,
                "model_params_after": model_params - delta,
                "summary": extra.get("summary", {}),
                "warnings": extra.get("warnings", []),
                "plots": extra.get("plots", []),
                "checkpoint": str(self.dirs[step.number].relative_to(self.staging))
                if step.number in self.dirs
                else None,
            }
            write_step_report(self.staging / "steps" / step.dirname, report)
            warnings += [f"{step.label}: {w}" for w in report["warnings"]]
            rows = self.rows[step.number]
            steps.append(
                {
                    "step": step.number,
                    "name": step.name,
                    "report": f"steps/{step.dirname}/report.md",
                    "params_before": sum(r["params_before"] for r in rows),
                    "params_after": sum(r["params_after"] for r in rows),
                    "bytes_before": sum(r["bytes_before"] for r in rows),
                    "bytes_after": sum(r["bytes_after"] for r in rows),
                    "seconds": report["seconds"],
                    "model_params_before": model_params,
                    "model_params_after": model_params - delta,
                }
            )
            model_params -= delta
        run = {
            "recipe": self.rec.to_dict(),
            "model": self.rec.model,
            "output": str(self.out),
            "moecompress_version": __version__,
            "steps": steps,
            "calibration": calib,
            "dry_run": dry,
            "total_seconds": round(time.perf_counter() - started, 3),
            "peak_rss_mb": round(max(self.peak.values(), default=0.0), 1),
            "warnings": warnings,
            "checkpoint": bool(self.writers),
        }
        if not self.writers:
            (self.staging / "recipe.yaml").write_text(self.rec.to_yaml())
        write_run_report(self.staging, run)
        if self.writers:
            self._write_card(run)
        (self.staging / JOURNAL).unlink(missing_ok=True)
        move_into_place(self.staging, self.out)
        return run


def _massive_warnings(rows: list[dict]) -> list[str]:
    """Super-expert verification: the top massive activation on the held-back tokens must survive."""
    return [
        f"layer {r['layer']}: the top massive activation fell to {r['massive_ratio']:.2f} of the original "
        "(super experts damaged? protect them with protect_super_experts)"
        for r in rows
        if r.get("massive_ratio", 1.0) < MASSIVE_RATIO_WARNING
    ]


def _card_kwargs(run: dict, ckpt: Checkpoint, descs: dict, name: str) -> dict:
    readme = ckpt.path / "README.md"
    return {
        "run": run,
        "base_config": ckpt.raw_config,
        "base_card": readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else None,
        "loadability": "moecompress" if any(descs.values()) else "stock",
        "name": name,
    }


def run_layer_loop(
    rec: Recipe,
    ckpt: Checkpoint,
    entry: Path,
    plans: dict,
    *,
    calib: dict,
    resume: bool,
    overwrite: bool,
    progress: bool,
    started: float,
    dry: dict,
) -> dict:
    if Path(rec.output).exists() and not overwrite:
        from moecompress.errors import OutputExistsError

        raise OutputExistsError(f"output directory {rec.output} already exists; pass --overwrite")
    run = _Run(rec, ckpt, entry, plans, resume)
    run.loop(progress)
    return run.finish(calib, started, dry)
