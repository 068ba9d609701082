"""``--resume``: what an interrupted or finished run of a recipe left, and whether it can be continued.

A run writes into ``.<output>.partial/`` beside the output. After each shard flush (all writers flush
together, at a decoder-layer boundary) ``journal.json`` records the flushed shards and the per-layer
report rows; the finished output's ``report.json`` records the recipe's fingerprint. With ``--resume``:

- the output exists and was made by the same recipe (same fingerprint): nothing to do, exit 0, nothing
  is rewritten; made by another recipe (or not by moecompress): refused;
- a journal of the same recipe exists: continue after its last durable layer (byte-identical output);
  of another recipe: refused;
- nothing durable yet (killed during calibration, or before the first flush): start over.

So a job script may retry a crashed run with ``--resume`` as often as it likes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moecompress.engine.recipe import Recipe
from moecompress.errors import ResumeError
from moecompress.report.write import json_safe

JOURNAL = "journal.json"
UNITS = "units"
"""In the staging directory under ``torchrun``: the files in which ranks ``1..N-1`` write their units' encoded
tensors for rank 0's writers to adopt (:func:`moecompress.engine.wire.unit_files`); removed before the rename."""


def staging_dir(output: str | Path) -> Path:
    out = Path(output)
    return out.parent / f".{out.name}.partial"


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(json_safe(obj), allow_nan=False))
    os.replace(tmp, path)


def finished(rec: Recipe) -> dict | None:
    """The run report of a finished output of this recipe, ``None`` when there is no output yet;
    :class:`ResumeError` when the output belongs to something else."""
    out = Path(rec.output)
    if not out.exists():
        return None
    report = out / "report.json"
    try:
        run = json.loads(report.read_text())
    except (OSError, json.JSONDecodeError):
        raise ResumeError(
            f"output {out} exists but has no readable report.json, so it was not finished by moecompress; "
            "choose another output or pass --overwrite instead of --resume"
        ) from None
    if not isinstance(run, dict) or run.get("recipe_hash") != rec.fingerprint():
        raise ResumeError(
            f"output {out} was made by a different recipe (fingerprint {run.get('recipe_hash') if isinstance(run, dict) else None}"
            f" vs {rec.fingerprint()}); choose another output or pass --overwrite instead of --resume"
        )
    return run


def resumable(rec: Recipe) -> dict | None:
    """The journal of an interrupted run of this recipe, or ``None`` when nothing durable was left
    (start over); :class:`ResumeError` when the journal belongs to another recipe or is damaged."""
    journal = staging_dir(rec.output) / JOURNAL
    if not journal.is_file():
        return None
    try:
        j = json.loads(journal.read_text())
    except json.JSONDecodeError:
        raise ResumeError(f"{journal} is damaged; run without --resume (it starts over)") from None
    if not isinstance(j, dict) or j.get("recipe") != rec.fingerprint():
        raise ResumeError(
            f"{journal.parent} belongs to a different recipe; run without --resume (it starts over) or use "
            "the recipe it was started with"
        )
    return j
