"""Atomic, sharding safetensors writer.

Everything is written into a temporary sibling directory (``.<name>.tmp-XXXX``) that is renamed onto
the output path only by :meth:`ShardWriter.commit`; an exception (or a crash) leaves the output path
untouched. An existing output directory is refused unless ``overwrite=True``, and even then it is only
replaced once the new one is complete.

Shards follow transformers' conventions: ``model.safetensors`` when everything fits in one shard,
otherwise ``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``; every shard
carries the metadata ``{"format": "pt"}``. Tensors are buffered up to ``max_shard_size`` bytes, so
peak memory is one shard's buffer plus what the caller holds.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from moecompress.errors import CheckpointError, OutputExistsError
from moecompress.io.reader import INDEX_NAME, SINGLE_NAME

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """``5_000_000``, ``"5GB"``, ``"500MiB"`` -> bytes."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, flags=re.IGNORECASE)
        if not m:
            raise ValueError(f"cannot parse size {size!r}; use bytes or e.g. '5GB', '500MiB'")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def check_output_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """Refuse an existing output directory unless ``overwrite``; call before doing any work."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output directory {out} already exists; pass overwrite=True (--overwrite)")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output path {out} exists and is not a directory")
    return out


def move_into_place(src: Path, dst: Path) -> None:
    """Rename the finished directory ``src`` onto ``dst``; an existing ``dst`` is replaced only now."""
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, old / "x")
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor owning exactly its storage (safetensors refuses views and shared memory)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class ShardWriter:
    """Collects tensors and files for a checkpoint directory; see the module docstring."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        overwrite: bool = False,
        staged: bool = False,
    ) -> None:
        """``staged=True``: write straight into ``out_dir`` (a directory inside a run's own staging
        area, which the caller moves into place); ``commit`` then only names the shards."""
        self.staged = staged
        self.max_shard_size = parse_size(max_shard_size)
        if staged:
            self.out_dir = Path(out_dir)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.tmp_dir = self.out_dir
        else:
            self.out_dir = check_output_dir(out_dir, overwrite)
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            self.tmp_dir = Path(
                tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent)
            )
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self._total_size = 0
        self._done = False

    # -- tensors ---------------------------------------------------------------------------------
    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise CheckpointError(f"tensor {name!r} written twice")
        if tensor.device.type == "meta":
            raise CheckpointError(f"tensor {name!r} is on the meta device; nothing to write")
        tensor = _standalone(tensor.detach().cpu())
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_size:
            self.flush()
        self._names.add(name)
        self._buffer[name] = tensor
        self._buffer_bytes += size
        self._total_size += size

    def make_room(self, nbytes: int) -> None:
        """Flush now if ``nbytes`` more would not fit in the current shard. Call it *before* reading the
        next group of tensors, so the full buffer is written out before that group is in memory too."""
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_size:
            self.flush()

    def add_many(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.add(name, t)

    def flush(self) -> None:
        """Write the buffered tensors as the next shard."""
        if not self._buffer:
            return
        path = self.tmp_dir / f"part-{len(self._shards):05d}.safetensors"
        save_file(self._buffer, str(path), metadata={"format": "pt"})
        os.chmod(path, 0o644)  # safetensors creates files private to the user; checkpoints are shared
        self._shards.append(list(self._buffer))
        self._buffer = {}
        self._buffer_bytes = 0

    @property
    def buffered_bytes(self) -> int:
        return self._buffer_bytes

    def state(self) -> dict:
        """What is durably on disk (flushed shards), for a journal."""
        return {
            "shards": [list(names) for names in self._shards],
            "total_size": self._total_size - self._buffer_bytes,
        }

    def restore(self, state: dict) -> None:
        """Continue after a crash from a :meth:`state` (staged writers only): later part files go."""
        if not self.staged:
            raise CheckpointError("only a staged writer can be restored")
        self._shards = [list(n) for n in state["shards"]]
        self._names = {n for names in self._shards for n in names}
        self._total_size = int(state["total_size"])
        self._buffer, self._buffer_bytes = {}, 0
        for part in self.tmp_dir.glob("part-*.safetensors"):
            if int(part.stem.split("-")[1]) >= len(self._shards):
                part.unlink()

    # -- other files -----------------------------------------------------------------------------
    def write_text(self, name: str, text: str) -> None:
        (self.tmp_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (self.tmp_dir / name).write_text(text)

    def write_json(self, name: str, obj: object) -> None:
        self.write_text(name, json.dumps(obj, indent=2, sort_keys=False) + "\n")

    def copy_file(self, src: str | Path, name: str | None = None) -> None:
        src = Path(src)
        dst = self.tmp_dir / (name or src.name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)

    # -- finishing -------------------------------------------------------------------------------
    def _name_shards(self) -> None:
        n = len(self._shards)
        if n == 0:
            raise CheckpointError("no tensors were written; refusing to create an empty checkpoint")
        if n == 1:
            os.replace(self.tmp_dir / "part-00000.safetensors", self.tmp_dir / SINGLE_NAME)
            return
        weight_map: dict[str, str] = {}
        for k, names in enumerate(self._shards):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.tmp_dir / f"part-{k:05d}.safetensors", self.tmp_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        self.write_json(INDEX_NAME, {"metadata": {"total_size": self._total_size}, "weight_map": weight_map})

    def commit(self) -> Path:
        """Finish the shards and move the directory into place atomically."""
        self.flush()
        self._name_shards()
        if self.staged:
            self._done = True
            return self.out_dir
        move_into_place(self.tmp_dir, self.out_dir)
        self._done = True
        log.info("wrote %s (%d shard(s), %.1f MB)", self.out_dir, len(self._shards), self._total_size / 1e6)
        return self.out_dir

    def abort(self) -> None:
        """Discard everything written so far."""
        self._buffer = {}
        if not self._done and not self.staged:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self._done = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()
