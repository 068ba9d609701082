"""Statistics cache: per-layer safetensors files keyed by (model, calibration settings), verified.

Layout: ``<root>/<model key>-<calibration key>-<stats key>/`` holding ``meta.json`` (what was
collected, for which model and calibration, and the SHA-256 of every file), ``layer-NNN.safetensors``
(forward statistics), ``layer-NNN.grad.safetensors`` (gradient statistics) and, for a layer calibrated
by chunks of experts, ``layer-NNN.experts-AAAAAA-BBBBBB.safetensors`` (the per-expert covariances of
experts ``[A, B)``, :data:`~moecompress.calibration.stats.SPILLED`, written expert by expert and read back
by rows: :class:`ExpertRows`). A later run or step
needing a subset of what an existing entry holds reuses it. A directory becomes visible only when
complete (written as ``*.partial`` and renamed), so a crash never leaves a half cache that looks
finished; a failed calibration removes its ``*.partial``.

**Nothing damaged is used.** Before an entry is reused, its key (model, calibration settings, the hash
of the calibration token ids) is compared with the run's and every file's content hash is checked; a
mismatch, a missing or extra file, or unreadable metadata is reported on one line naming the file,
and the entry is removed and recomputed. Each file is hashed again when a layer is loaded, so a file
that changes during the run stops the run with one line instead of being used.

The model key hashes ``config.json`` and each shard's name, size and modification time: a checkpoint
rewritten in place gets a new key (copying a checkpoint does too, which only costs a recomputation).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from moecompress.errors import CacheError

log = logging.getLogger(__name__)

STATS_VERSION = 3
"""Bumped when a statistic's bits change: 3, ``down_in_cov_pooled`` summed by fixed blocks of experts
(``stats.POOLED_BY_BLOCK``)."""
META = "meta.json"


def model_key(ckpt) -> str:
    h = hashlib.sha256((ckpt.path / "config.json").read_bytes())
    for shard in ckpt.reader.shards:
        st = (ckpt.path / shard).stat()
        h.update(f"{shard}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def tokens_key(ids: torch.Tensor) -> str:
    """Hash of the calibration token ids (part of an entry's key)."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _layer_files(entry: Path) -> list[str]:
    return sorted(p.name for p in entry.glob("layer-*.safetensors"))


def read_meta(entry: Path) -> dict:
    """An entry's ``meta.json``; :class:`CacheError` naming it when it is unreadable."""
    try:
        meta = json.loads((entry / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CacheError(f"statistics cache entry {entry}: {META} is unreadable ({type(err).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or not isinstance(meta.get("stats"), list):
        raise CacheError(f"statistics cache entry {entry}: {META} is not a moecompress cache description")
    return meta


CHUNK_ORDERED = frozenset({"down_in_cov_pooled"})
"""Forward statistics whose float64 sums pool every expert's terms: an expert-chunked layer adds the same
terms in another order (chunk by chunk), so their last bits depend on the chunking."""


def chunk_key(needs, expert_chunks) -> dict:
    """The cache-key part of the expert chunking (``RunContext.expert_chunks``): empty, so entries are
    shared with whole-layer runs, unless a statistic in ``needs`` has bits that depend on it (the backward
    ones, whose gradients reach earlier layers as sums over chunks, and :data:`CHUNK_ORDERED`); then the
    chunk size of every chunked layer."""
    from moecompress.calibration.catalogue import backward_needed

    if not expert_chunks or not (backward_needed(set(needs)) or CHUNK_ORDERED & set(needs)):
        return {}
    return {"expert_chunks": {str(i): int(n) for i, n in sorted(expert_chunks.items())}}


class StatsCache:
    """Find or fill the cache entry for one (model, calibration) pair."""

    chunk_key = staticmethod(chunk_key)

    def __init__(self, root: str | Path, model: str, calibration: dict) -> None:
        self.root = Path(root)
        self.model = model
        self.prefix = f"{model}-{_digest({'v': STATS_VERSION, **calibration})}"
        self.calibration = calibration

    def _damage(self, entry: Path, meta: dict) -> str | None:
        """Why ``entry`` cannot be used (``None``: it is sound)."""
        if meta.get("version") != STATS_VERSION or meta.get("model") != self.model:
            return "it was made by another version or for another model"
        if json.dumps(meta.get("calibration"), sort_keys=True, default=str) != json.dumps(
            self.calibration, sort_keys=True, default=str
        ):
            return "its calibration key differs from this run's"
        files = _layer_files(entry)
        if sorted(meta["files"]) != files:
            extra, gone = sorted(set(files) - set(meta["files"])), sorted(set(meta["files"]) - set(files))
            return f"files {extra} are not in its {META}" if extra else f"files {gone} are missing"
        for name in files:
            if _file_hash(entry / name) != meta["files"][name]:
                return f"{name} changed after it was written"
        return None

    def find(self, needs: set[str] | frozenset[str]) -> Path | None:
        """A complete, verified entry holding at least ``needs``, or ``None``. Damaged entries are
        reported (one line) and removed, so the caller recomputes them."""
        if not self.root.is_dir():
            return None
        for entry in sorted(self.root.glob(f"{self.prefix}-*")):
            if entry.suffix in (".partial", ".lock") or not entry.is_dir():
                continue
            try:
                meta = read_meta(entry)
                why = self._damage(entry, meta)
            except CacheError as err:
                meta, why = None, str(err).split(": ", 1)[-1]
            if why is not None:
                log.warning("statistics cache entry %s is damaged (%s); removing it and recomputing", entry, why)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            if set(needs) <= set(meta["stats"]):  # type: ignore[index]
                return entry
        return None

    def entry_path(self, needs: set[str] | frozenset[str]) -> Path:
        return self.root / f"{self.prefix}-{_digest(sorted(needs))}"

    def begin(self, needs: set[str] | frozenset[str]) -> Path:
        """A fresh ``.partial`` directory to fill; :meth:`finish` publishes it, :meth:`abort` removes it."""
        final = self.entry_path(needs)
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return partial

    def abort(self, partial: Path) -> None:
        shutil.rmtree(partial, ignore_errors=True)

    def finish(self, partial: Path, needs: set[str] | frozenset[str], summary: dict) -> Path:
        meta = {
            "stats": sorted(needs),
            "model": self.model,
            "calibration": self.calibration,
            "summary": summary,
            "version": STATS_VERSION,
            "files": {name: _file_hash(partial / name) for name in _layer_files(partial)},
        }
        (partial / META).write_text(json.dumps(meta, indent=2, default=str))
        final = partial.with_name(partial.name.removesuffix(".partial"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        return final


def _save(entry: Path, name: str, stats: dict[str, torch.Tensor]) -> None:
    tmp = entry / (name + ".tmp")
    try:
        save_file({k: v.contiguous() for k, v in stats.items()}, str(tmp))
    except (OSError, SafetensorError) as err:
        tmp.unlink(missing_ok=True)
        raise CacheError(f"cannot write the statistics cache file {entry / name} ({err}); free disk space or "
                         "set calibration.cache_dir to another disk") from None  # fmt: skip
    os.replace(tmp, entry / name)


def save_layer(entry: Path, i: int, stats: dict[str, torch.Tensor], grad: bool = False) -> None:
    _save(entry, f"layer-{i:03d}{'.grad' if grad else ''}.safetensors", stats)


def save_experts(entry: Path, i: int, a: int, stats: dict[str, torch.Tensor]) -> None:
    """Experts ``[a, a + n)``'s per-expert statistics of layer ``i`` (every tensor ``[n, ...]``)."""
    if not stats:  # the recipe needs none of them
        return
    n = {t.shape[0] for t in stats.values()}
    if len(n) != 1:
        raise ValueError(f"save_experts: one expert count expected, got {sorted(n)}")
    _save(entry, f"layer-{i:03d}.experts-{a:06d}-{a + n.pop():06d}.safetensors", stats)


def _changed(path: Path) -> CacheError:
    return CacheError(f"statistics cache file {path} changed while this run used it; run again (the damaged "
                      "entry is then recomputed)")


def _expert_files(entry: Path, i: int) -> list[tuple[int, int, Path]]:
    pattern = re.compile(rf"layer-{i:03d}\.experts-(\d+)-(\d+)\.safetensors")
    found = [(m, p) for p in entry.glob(f"layer-{i:03d}.experts-*.safetensors") if (m := pattern.fullmatch(p.name))]
    return sorted((int(m[1]), int(m[2]), p) for m, p in found)


class LayerRows:
    """The :data:`~moecompress.calibration.stats.SPILLED` statistics of a layer calibrated whole (in its own
    file, ``[E, n, n]``) read by rows, as :class:`ExpertRows` reads a chunked calibration's: a layer worked by
    units of experts holds only each unit's rows (the file was hashed by :func:`load_layer` with ``skip``)."""

    def __init__(self, entry: Path, i: int, names: frozenset[str]) -> None:
        self.entry, self.path = entry, entry / f"layer-{i:03d}.safetensors"
        self.names: tuple[str, ...] = ()
        self.num_experts = 0
        if self.path.is_file():
            with safe_open(str(self.path), "pt") as f:
                self.names = tuple(sorted(n for n in f.keys() if n in names))
                if self.names:
                    self.num_experts = f.get_slice(self.names[0]).get_shape()[0]

    def __bool__(self) -> bool:
        return bool(self.names)

    def rows(self, a: int, b: int, names: set[str] | frozenset[str] | None = None) -> dict[str, torch.Tensor]:
        """Rows ``[a, b)`` of every statistic (or of ``names``), ``[b - a, ...]``."""
        try:
            with safe_open(str(self.path), "pt") as f:
                return {n: f.get_slice(n)[a:b].clone() for n in self.names if names is None or n in names}
        except (OSError, SafetensorError) as err:
            raise CacheError(f"statistics cache file {self.path} is damaged ({err}); delete {self.entry} and run "
                             "again") from None  # fmt: skip


class ExpertRows:
    """The per-expert statistics a chunked calibration wrote apart for layer ``i`` (``save_experts``),
    read by rows: :meth:`rows` maps only the files that overlap the asked experts (each file hashed first,
    as :func:`load_layer` does), so a step on a chunk holds its own experts' rows, not the layer's."""

    def __init__(self, entry: Path, i: int) -> None:
        self.entry, self.i = entry, i
        self.files = _expert_files(entry, i)
        self.num_experts = self.files[-1][1] if self.files else 0
        self.names: tuple[str, ...] = ()
        if self.files:
            with safe_open(str(self.files[0][2]), "pt") as f:
                self.names = tuple(sorted(f.keys()))
        self._checked: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.files)

    def _check(self, path: Path) -> None:
        if path.name in self._checked:
            return
        files = read_meta(self.entry)["files"] if (self.entry / META).is_file() else None
        if files is not None and _file_hash(path) != files.get(path.name):
            raise _changed(path)
        self._checked.add(path.name)

    def rows(self, a: int, b: int, names: set[str] | frozenset[str] | None = None) -> dict[str, torch.Tensor]:
        """Rows ``[a, b)`` of every statistic (or of ``names``), ``[b - a, ...]`` float32."""
        want = [n for n in self.names if names is None or n in names]
        parts: dict[str, list[torch.Tensor]] = {n: [] for n in want}
        for lo, hi, path in self.files:
            if hi <= a or lo >= b or not want:
                continue
            self._check(path)
            try:
                with safe_open(str(path), "pt") as f:
                    for n in want:
                        parts[n].append(f.get_slice(n)[max(a, lo) - lo : min(b, hi) - lo].clone())
            except (OSError, SafetensorError) as err:
                raise CacheError(f"statistics cache file {path} is damaged ({err}); delete {self.entry} and run "
                                 "again") from None  # fmt: skip
        return {n: torch.cat(p) for n, p in parts.items() if p}


def load_layer(entry: Path, i: int, experts: bool = True, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every statistic tensor of layer ``i`` in a cache entry (forward and gradient files, and with
    ``experts`` the per-expert files of a chunked calibration joined whole), each file checked against the
    hash its entry recorded; a step sees only the part it declared
    (:meth:`moecompress.engine.spec.LayerStats.view`). ``skip``: names left in the files (read by rows
    later: :class:`LayerRows`); the file is then hashed as it streams, not held."""
    files = read_meta(entry)["files"] if (entry / META).is_file() else None  # None: still being filled
    out: dict[str, torch.Tensor] = {}
    for suffix in ("", ".grad"):
        name = f"layer-{i:03d}{suffix}.safetensors"
        path = entry / name
        if not path.is_file():
            continue
        try:
            if skip:
                if files is not None and _file_hash(path) != files.get(name):
                    raise _changed(path)
                with safe_open(str(path), "pt") as f:
                    out.update({k: f.get_tensor(k) for k in f.keys() if k not in skip})
                continue
            data = path.read_bytes()
            if files is not None and hashlib.sha256(data).hexdigest() != files.get(name):
                raise _changed(path)
            out.update(load_bytes(data))
        except SafetensorError as err:
            raise CacheError(f"statistics cache file {path} is damaged ({err}); delete {entry} and run again") from None
    if experts:
        rows = ExpertRows(entry, i)
        if rows:
            out.update(rows.rows(0, rows.num_experts))
    return out
