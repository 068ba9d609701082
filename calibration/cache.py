"""Statistics cache: per-layer safetensors files keyed by (model, calibration settings).

Layout: ``<root>/<model key>-<calibration key>-<stats key>/`` holding ``meta.json`` (what was
collected, for which model and calibration, complete or not), ``layer-NNN.safetensors`` (forward
statistics) and ``layer-NNN.grad.safetensors`` (gradient statistics). A later run or step needing a
subset of what an existing entry holds reuses it. A directory becomes visible only when complete
(written as ``*.partial`` and renamed), so a crash never leaves a half cache that looks finished.

The model key hashes ``config.json`` and each shard's name, size and modification time: a checkpoint
rewritten in place gets a new key (copying a checkpoint does too, which only costs a recomputation).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STATS_VERSION = 1


def model_key(ckpt) -> str:
    h = hashlib.sha256((ckpt.path / "config.json").read_bytes())
    for shard in ckpt.reader.shards:
        st = (ckpt.path / shard).stat()
        h.update(f"{shard}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


class StatsCache:
    """Find or fill the cache entry for one (model, calibration) pair."""

    def __init__(self, root: str | Path, model: str, calibration: dict) -> None:
        self.root = Path(root)
        self.prefix = f"{model}-{_digest({'v': STATS_VERSION, **calibration})}"
        self.calibration = calibration

    def find(self, needs: set[str] | frozenset[str]) -> Path | None:
        """A complete entry holding at least ``needs``, or ``None``."""
        if not self.root.is_dir():
            return None
        for entry in sorted(self.root.glob(f"{self.prefix}-*")):
            meta = entry / "meta.json"
            if entry.suffix == ".partial" or not meta.is_file():
                continue
            try:
                have = set(json.loads(meta.read_text())["stats"])
            except (json.JSONDecodeError, KeyError):
                continue
            if set(needs) <= have:
                return entry
        return None

    def begin(self, needs: set[str] | frozenset[str]) -> Path:
        """A fresh ``.partial`` directory to fill; :meth:`finish` publishes it."""
        final = self.root / f"{self.prefix}-{_digest(sorted(needs))}"
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return partial

    def finish(self, partial: Path, needs: set[str] | frozenset[str], summary: dict) -> Path:
        meta = {
            "stats": sorted(needs),
            "calibration": self.calibration,
            "summary": summary,
            "version": STATS_VERSION,
        }
        (partial / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        final = partial.with_name(partial.name.removesuffix(".partial"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        return final


def save_layer(entry: Path, i: int, stats: dict[str, torch.Tensor], grad: bool = False) -> None:
    name = f"layer-{i:03d}{'.grad' if grad else ''}.safetensors"
    tmp = entry / (name + ".tmp")
    save_file({k: v.contiguous() for k, v in stats.items()}, str(tmp))
    os.replace(tmp, entry / name)


def load_layer(entry: Path, i: int) -> dict[str, torch.Tensor]:
    """Every statistic tensor of layer ``i`` in a cache entry (forward and gradient files); a step sees
    only the part it declared (:meth:`moecompress.engine.spec.LayerStats.view`)."""
    out: dict[str, torch.Tensor] = {}
    for suffix in ("", ".grad"):
        path = entry / f"layer-{i:03d}{suffix}.safetensors"
        if path.is_file():
            out.update(load_file(str(path)))
    return out
