"""A recipe's pass over the checkpoint: the steps per MoE layer, one writer per emitted checkpoint, the
journal, then reports and the atomic rename.

Everything is written into ``.<output>.partial/`` beside the output directory and renamed onto it only
at the end (:mod:`moecompress.engine.journal` says how ``--resume`` continues). The loop itself is
:func:`moecompress.engine.layer_loop.stream_layers`, each MoE layer by
:func:`moecompress.engine.layer_run.run_layer` (its units; :class:`RecipeRun` holds the state); every computation is deterministic, so a resumed
output is byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import math
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from moecompress._version import __version__
from moecompress.engine.balance import Balance
from moecompress.engine.context import RunContext
from moecompress.engine.journal import JOURNAL, UNITS, staging_dir, write_json_atomic
from moecompress.engine.layer_loop import stream_layers
from moecompress.engine.layer_run import run_layer
from moecompress.engine.protection import MASSIVE_RATIO_WARNING
from moecompress.engine.recipe import Recipe
from moecompress.hub.card import public_path, public_recipe, write_model_card
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.format import config_with_layers
from moecompress.io.outputs import move_into_place
from moecompress.io.quantized import output_quantization_config
from moecompress.io.writer import ShardWriter
from moecompress.report.write import write_run_report, write_step_report


def _checkpoint_dirs(rec: Recipe, staging: Path) -> dict[int, Path]:
    emitted = [s for s in rec.steps if not s.spec.report_only]
    if rec.emit == "final":
        emitted = emitted[-1:]
    dirs = {s.number: staging / "steps" / s.dirname / "checkpoint" for s in emitted}
    if emitted:
        dirs[emitted[-1].number] = staging
    return dirs


class RecipeRun:
    """The state of one run: writers, per-layer report rows and infos, what the journal records."""

    def __init__(
        self, rec: Recipe, ckpt: Checkpoint, entry: Path, plans: dict, ctx: RunContext, journal: dict | None,
        *, dequantize: bool = False,
    ) -> None:  # fmt: skip
        """``dequantize``: a quantised input's tensors are all written in the compute dtype (the dry run's
        ``dequantize_output``, :func:`moecompress.io.quantized.dequantized_output`)."""
        self.rec, self.ckpt, self.entry, self.plans, self.ctx = rec, ckpt, entry, plans, ctx
        self.dequantize = dequantize
        self.out = Path(rec.output)
        self.staging = staging_dir(rec.output)
        self.dirs = _checkpoint_dirs(rec, self.staging)
        self.rows: dict[int, list[dict]] = {s.number: [] for s in rec.steps}
        self.infos: dict[int, dict[int, dict]] = {s.number: {} for s in rec.steps}
        self.seconds = {s.number: 0.0 for s in rec.steps}
        self.peak = {s.number: 0.0 for s in rec.steps}
        self.start_group = 0
        self.balance = Balance()
        """rank 0's share of each layer's units under ``torchrun`` (:mod:`moecompress.engine.balance`)"""
        if journal is None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging.mkdir(parents=True)
        self.writers = {
            n: ShardWriter(d, max_shard_size=rec.max_shard_size, staged=True) for n, d in self.dirs.items()
        }
        self.descs: dict[int, dict[int, dict | None]] = {n: {} for n in self.writers}
        self.shapes: dict[int, dict[int, list[int]]] = {n: {} for n in self.writers}
        self.protected: dict[int, dict[str, list[int]]] = {n: {} for n in self.writers}
        self.routing: dict[int, dict[str, dict]] = {n: {} for n in self.writers}
        self.kept_raw: dict[int, set[int]] = {n: set() for n in self.writers}
        """per written step, the MoE layers written in the quantised input's encoding with experts selected"""
        if journal is not None:
            self._restore(journal)

    def _restore(self, j: dict) -> None:
        for n, w in self.writers.items():
            w.restore(j["writers"][str(n)])
        self.rows = {int(k): v for k, v in j["rows"].items()}
        self.infos = {int(k): {int(i): x for i, x in v.items()} for k, v in j["infos"].items()}
        self.start_group = int(j["done_group"]) + 1
        self.descs = {int(n): {int(i): d for i, d in v.items()} for n, v in j["descs"].items()}
        self.shapes = {int(n): {int(i): d for i, d in v.items()} for n, v in j["shapes"].items()}
        self.protected = {int(n): v for n, v in j["protected"].items()}
        self.routing = {int(n): v for n, v in j.get("routing", {}).items()} or {n: {} for n in self.writers}
        self.kept_raw = {n: set(j.get("kept_raw", {}).get(str(n), [])) for n in self.writers}

    def save_journal(self, done_group: int) -> None:
        write_json_atomic(
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
                "routing": {str(n): v for n, v in self.routing.items()},
                "kept_raw": {str(n): sorted(v) for n, v in self.kept_raw.items()},
            },
        )

    def _changed(self, idx: int, upto: int) -> bool:
        """Whether a step numbered ``<= upto`` changed MoE layer ``idx`` (from the report rows)."""
        return any(r["changed"] for n, rows in self.rows.items() if n <= upto for r in rows if r["layer"] == idx)

    def loop(self) -> None:
        stream_layers(
            self.ckpt, list(self.writers.values()), partial(run_layer, self), start_group=self.start_group,
            on_flush=self.save_journal, progress=self.ctx.progress, desc="compress", raw=not self.dequantize,
        )  # fmt: skip

    def _write_checkpoint_files(self) -> None:
        for n, w in self.writers.items():
            w.commit()
            for f in self.ckpt.non_weight_files(self.rec.copy_extra):
                if f.name != "README.md":  # the base model's card describes the base, not this output
                    shutil.copy2(f, self.dirs[n] / f.name)
            for name in self.ckpt.adapter_files():  # attention adapters: no MoE step changes what they wrap
                (self.dirs[n] / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.ckpt.path / name, self.dirs[n] / name)
            (self.dirs[n] / "recipe.yaml").write_text(self.rec.to_yaml())
            provenance = {
                "version": __version__,
                "recipe_hash": self.rec.fingerprint(),
                "steps": [s.name for s in self.rec.steps if s.number <= n],
            }
            if self.protected[n]:
                provenance["protected"] = self.protected[n]
            if self.routing[n]:
                provenance["routing"] = self.routing[n]
            cfg = config_with_layers(
                self.ckpt.raw_config, self.descs[n], self.shapes[n], adapter=self.ckpt.adapter,
                provenance=provenance,
            )  # fmt: skip
            changed = [i for i in self.ckpt.moe_layer_indices if self._changed(i, n) and i not in self.kept_raw[n]]
            cfg = output_quantization_config(self.ckpt, cfg, changed, self.dequantize)
            write_json_atomic(self.dirs[n] / "config.json", cfg)

    def _step_reports(self) -> tuple[list[dict], list[str]]:
        steps, warnings = [], []
        model_params = sum(math.prod(self.ckpt.reader.shape(k)) for k in self.ckpt.reader.keys)  # whole model
        for step in self.rec.steps:
            rows = self.rows[step.number]
            delta = sum(r["params_before"] - r["params_after"] for r in rows)
            extra = step.spec.summarize(self.infos[step.number], step.config) if step.spec.summarize else {}
            step_warnings = [*extra.get("warnings", []), *_massive_warnings(rows)]
            report = {
                "step": step.number,
                "name": step.name,
                "config": step.config.model_dump(mode="json"),
                "layers": [{**r, "info": self.infos[step.number].get(r["layer"], {})} for r in rows],
                "seconds": round(self.seconds[step.number], 3),
                "peak_rss_mb": round(self.peak[step.number], 1),
                "model_params_before": model_params,
                "model_params_after": model_params - delta,
                "summary": extra.get("summary", {}),
                "warnings": step_warnings,
                "plots": extra.get("plots", []),
                "checkpoint": str(self.dirs[step.number].relative_to(self.staging))
                if step.number in self.dirs
                else None,
            }
            write_step_report(self.staging / "steps" / step.dirname, report)
            warnings += [f"{step.label}: {w}" for w in step_warnings]
            steps.append(
                {
                    "step": step.number,
                    "name": step.name,
                    "report": f"steps/{step.dirname}/report.md",
                    **{k: sum(r[k] for r in rows) for k in ("params_before", "params_after", "bytes_before", "bytes_after")},
                    "seconds": report["seconds"],
                    "model_params_before": model_params,
                    "model_params_after": model_params - delta,
                }
            )
            model_params -= delta
        return steps, warnings

    def finish(self, calib: dict, started: float, dry: dict) -> dict:
        # The shards' copies run in the kernel without the GIL: a thread finishes them while this one draws
        # the step reports' plots (heapr, 2 Qwen3-30B layers: 0.6-1.4 s of copying, 0.8 s of reports).
        with ThreadPoolExecutor(1, thread_name_prefix="moecompress-commit") as pool:
            shards = pool.submit(self._write_checkpoint_files)
            try:
                steps, warnings = self._step_reports()
            finally:
                shards.result()  # waits; a failed commit (a full disk) is the error to report
        calib = {**calib, "entry": Path(calib["entry"]).name} if "entry" in calib else calib
        run = {  # no local absolute paths: reports and cards travel (push)
            "recipe": public_recipe(self.rec.to_dict()),
            "recipe_hash": self.rec.fingerprint(),
            "model": public_path(self.rec.model),
            "output": public_path(str(self.out)),
            "moecompress_version": __version__,
            "steps": steps,
            "calibration": calib,
            "dry_run": dry,
            "total_seconds": round(time.perf_counter() - started, 3),
            "peak_rss_mb": round(max(self.peak.values(), default=0.0), 1),
            "warnings": warnings,
            "checkpoint": bool(self.writers),
            "base_card": _base_card(self.ckpt),  # its license passes to this output's card, also at push time
            "input_files_skipped": self.ckpt.skipped_files(self.rec.copy_extra),
        }
        if not self.writers:
            (self.staging / "recipe.yaml").write_text(self.rec.to_yaml())
        write_run_report(self.staging, run)
        if self.writers:
            final = max(self.writers)
            write_model_card(self.staging, **_card_kwargs(run, self.ckpt, self.descs[final], self.out.name))
        (self.staging / JOURNAL).unlink(missing_ok=True)
        shutil.rmtree(self.staging / UNITS, ignore_errors=True)  # empty: rank 0's writers adopted every file
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


def _base_card(ckpt: Checkpoint) -> str | None:
    readme = ckpt.path / "README.md"
    return readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else None


def _card_kwargs(run: dict, ckpt: Checkpoint, descs: dict, name: str) -> dict:
    return {
        "run": run,
        "base_config": ckpt.raw_config,
        "base_card": run["base_card"],
        "loadability": "moecompress" if any(descs.values()) else "stock",
        "name": name,
    }
