"""Atomic, sharding safetensors writer that streams tensor bytes to disk as they are added.

Everything is written into a temporary sibling directory (``.<name>.tmp-XXXX``) that is renamed onto
the output path only by :meth:`ShardWriter.commit`; an exception (or a crash) leaves the output path
untouched. An existing output directory is refused unless ``overwrite=True``, and even then it is only
replaced once the new one is complete.

Shards follow transformers' conventions: ``model.safetensors`` when everything fits in one shard,
otherwise ``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``; every shard
carries the metadata ``{"format": "pt"}``. A shard is never held in memory: each tensor's bytes are
appended to the shard's data file (``part-NNNNN.data``) when it is added, and :meth:`ShardWriter.flush`
writes the header (known only then) into the shard file and copies the data after it in the kernel
(``os.copy_file_range``), punching each copied range out of the data file (``_punch``: its dirty pages are
dropped, not written back). So ``max_shard_size`` costs disk (a shard exists twice while it is finished), not
memory. The file is byte-identical to ``safetensors.torch.save_file`` on the same
tensors: same header, padding and tensor order (by dtype, then name; see ``_DTYPE_ORDER``).
safetensors (0.8) has no incremental writer, hence the format is written here (docs/format.md).

Bytes another process wrote need not pass through this one (another rank's unit of a layer under
``torchrun``, :mod:`moecompress.engine.shard`): :meth:`ShardWriter.adopt` takes its file, ``add_from`` and
``append_from`` refer to byte ranges in it, and finishing the shard copies them as it copies the shard's own
data file; the file is deleted once :meth:`ShardWriter.release` was called and its bytes are in a shard.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from moecompress.errors import CheckpointError
from moecompress.io.outputs import DEFAULT_MAX_SHARD_SIZE, check_output_dir, move_into_place, parse_size
from moecompress.io.reader import INDEX_NAME, SINGLE_NAME
from moecompress.io.shard_format import (
    _RANK,
    OWN,
    _copy_range,
    _Entry,
    _extend,
    _header_entry,
    _Part,
    _Pending,
    _punch,
    _pwrite,
    safetensors_header,
)

log = logging.getLogger(__name__)

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
        self._part: _Part | None = None
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self._total_size = 0
        self._pending: dict[str, _Pending] = {}
        self._files: dict[str, int] = {}
        """adopted files (path -> descriptor) whose bytes entries refer to"""
        self._released: set[int] = set()
        self._done = False

    # -- tensors ---------------------------------------------------------------------------------
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes to the current shard (finishing it first when it would overflow)."""
        if tensor.device.type == "meta":
            raise CheckpointError(f"tensor {name!r} is on the meta device; nothing to write")
        self.add_pieces(name, tensor.dtype, tensor.shape, [tensor])

    def add_pieces(
        self, name: str, dtype: torch.dtype, shape: Iterable[int], pieces: Iterable[torch.Tensor]
    ) -> None:
        """Write one tensor of ``dtype`` and ``shape`` from ``pieces`` whose bytes, in row-major order,
        make up the tensor (e.g. chunks of experts of a stacked bank), each written as it comes; the
        pieces must be of ``dtype`` and total exactly the tensor's size, else nothing is written."""
        self._check_name(name)
        shape = [int(d) for d in shape]
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        code, header_shape = _header_entry(name, dtype, shape, size)
        part = self._part_for(size)
        start = written = part.size
        try:
            for piece in pieces:
                if piece.device.type == "meta" or piece.dtype != dtype:
                    what = "on the meta device" if piece.device.type == "meta" else f"of dtype {piece.dtype}"
                    raise CheckpointError(f"tensor {name!r}: a piece is {what}, expected {dtype} data")
                n = piece.numel() * piece.element_size()
                if written + n - start > size:
                    raise CheckpointError(f"tensor {name!r}: its pieces hold more than {shape} {dtype}")
                written += _pwrite(part.fd, piece, written)
            if written - start != size:
                raise CheckpointError(
                    f"tensor {name!r}: its pieces hold {written - start} bytes, {shape} {dtype} needs {size}"
                )
        except BaseException:
            os.ftruncate(part.fd, start)  # drop what this tensor wrote; the shard stays as it was
            raise
        self._record(part, _Entry(name, code, header_shape, [(start, start + size, OWN)]))

    # -- tensors written in segments ---------------------------------------------------------------
    def append(self, name: str, piece: torch.Tensor) -> None:
        """Append ``piece`` to tensor ``name``, which is written in segments: its pieces come one at a time,
        with other tensors added in between (the experts of a fused ``[E, ...]`` tensor, chunk by chunk),
        and :meth:`end` gives its shape once every piece is written. The bytes go to the current shard's
        data file as they come; while a tensor is unfinished the shard is not finished (a shard may then
        exceed ``max_shard_size``)."""
        if piece.device.type == "meta":
            raise CheckpointError(f"tensor {name!r}: a piece is on the meta device; nothing to write")
        pend = self._pending.get(name)
        if pend is None:
            self._check_name(name)
            pend = self._pending[name] = _Pending(piece.dtype)
        elif piece.dtype != pend.dtype:
            raise CheckpointError(
                f"tensor {name!r}: a piece is of dtype {piece.dtype}, expected {pend.dtype}"
            )
        part = self._part_for(0)
        start = part.size
        n = _pwrite(part.fd, piece, start)
        part.size = start + n
        _extend(pend, start, start + n, OWN)

    def end(self, name: str, shape: Iterable[int], dtype: torch.dtype | None = None) -> None:
        """Finish tensor ``name`` (see :meth:`append`): its pieces must total exactly ``shape`` (a tensor
        with no piece at all needs ``dtype`` and an empty ``shape``)."""
        pend = self._pending.pop(name, None)
        if pend is None:
            if dtype is None:
                raise CheckpointError(f"tensor {name!r} has no pieces; give its dtype")
            self._check_name(name)
            pend = _Pending(dtype)
        shape = [int(d) for d in shape]
        size = math.prod(shape) * torch.empty((), dtype=pend.dtype).element_size()
        got = sum(b - a for a, b, _ in pend.ranges)
        if got != size:
            raise CheckpointError(
                f"tensor {name!r}: its pieces hold {got} bytes, {shape} {pend.dtype} needs {size}"
            )
        code, header_shape = _header_entry(name, pend.dtype, shape, size)
        # the shard that holds the pieces, not finished first (``make_room`` would, once no tensor is
        # pending and the shard is over ``max_shard_size``, and the entry would land in an empty shard)
        part = self._part if pend.ranges else self._part_for(0)
        assert part is not None
        part.entries.append(_Entry(name, code, header_shape, pend.ranges or [(part.size, part.size, OWN)]))
        self._names.add(name)
        self._total_size += size

    # -- tensors whose bytes another process wrote -------------------------------------------------
    def adopt(self, path: str | Path) -> None:
        """Take the file ``path`` (written and closed by another process, e.g. another rank's unit of a
        layer) as a source of tensor bytes: :meth:`add_from` and :meth:`append_from` refer to byte ranges in
        it, copied into the shard when the shard is finished, as the writer's own data file is. The writer
        deletes the file once :meth:`release` said nothing more comes from it and every range is copied."""
        key = str(path)
        if key in self._files:
            raise CheckpointError(f"{path} is adopted twice")
        try:
            try:
                self._files[key] = os.open(key, os.O_RDWR)  # writable: its copied ranges are punched (_punch)
            except PermissionError:
                self._files[key] = os.open(key, os.O_RDONLY)
        except OSError as err:
            raise CheckpointError(f"cannot read {path}, written by another process: {err.strerror}") from None

    def add_from(self, name: str, dtype: torch.dtype, shape: Iterable[int], path: str | Path, offset: int) -> None:
        """One tensor of ``dtype`` and ``shape`` whose bytes are at ``offset`` in the adopted file ``path``."""
        self._check_name(name)
        shape = [int(d) for d in shape]
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        code, header_shape = _header_entry(name, dtype, shape, size)
        fd = self._source(path, offset, size, name)
        part = self._part_for(size)
        part.entries.append(_Entry(name, code, header_shape, [(offset, offset + size, fd)]))
        part.extra += size
        part.files.add(fd)
        self._names.add(name)
        self._total_size += size

    def append_from(self, name: str, dtype: torch.dtype, path: str | Path, offset: int, nbytes: int) -> None:
        """As :meth:`append`, with the piece's ``nbytes`` at ``offset`` in the adopted file ``path``."""
        pend = self._pending.get(name)
        if pend is None:
            self._check_name(name)
            pend = self._pending[name] = _Pending(dtype)
        elif dtype != pend.dtype:
            raise CheckpointError(f"tensor {name!r}: a piece is of dtype {dtype}, expected {pend.dtype}")
        fd = self._source(path, offset, nbytes, name)
        part = self._part_for(0)
        _extend(pend, offset, offset + nbytes, fd)
        part.extra += nbytes
        part.files.add(fd)

    def release(self, path: str | Path) -> None:
        """Nothing more comes from the adopted file ``path``: it is deleted once its ranges are in a shard
        (now, if the unfinished shard holds none of them)."""
        fd = self._files.get(str(path))
        if fd is None:
            raise CheckpointError(f"{path} is not adopted")
        if self._part is None or fd not in self._part.files:
            self._close(str(path))
        else:
            self._released.add(fd)

    def _source(self, path: str | Path, offset: int, nbytes: int, name: str) -> int:
        fd = self._files.get(str(path))
        if fd is None:
            raise CheckpointError(f"tensor {name!r}: {path} is not adopted")
        if offset < 0 or offset + nbytes > os.fstat(fd).st_size:
            raise CheckpointError(f"tensor {name!r}: {path} holds no bytes {offset}..{offset + nbytes}")
        return fd

    def _close(self, path: str) -> None:
        fd = self._files.pop(path)
        self._released.discard(fd)
        os.close(fd)
        Path(path).unlink(missing_ok=True)

    def written(self, name: str) -> bool:
        """Whether tensor ``name`` was written (finished)."""
        return name in self._names

    @property
    def pending(self) -> list[str]:
        """Tensors written in segments and not finished yet."""
        return list(self._pending)

    def _check_name(self, name: str) -> None:
        if name in self._names or name in self._pending:
            raise CheckpointError(f"tensor {name!r} written twice")
        if name == "__metadata__":
            raise CheckpointError("a tensor cannot be named '__metadata__' (the safetensors header key)")

    def _part_for(self, size: int) -> _Part:
        """The shard the next ``size`` bytes go to: the current one, or a new one if they would overflow it."""
        self.make_room(size)
        if self._part is None:
            data = self.tmp_dir / f"part-{len(self._shards):05d}.data"
            self._part = _Part(data, os.open(data, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644))
        return self._part

    def _record(self, part: _Part, entry: _Entry) -> None:
        part.entries.append(entry)
        part.size = entry.ranges[-1][1]
        self._names.add(entry.name)
        self._total_size += entry.size

    def make_room(self, nbytes: int) -> None:
        """Finish the current shard now if ``nbytes`` more would not fit in it."""
        if (
            self._part is not None and self._part.entries and not self._pending
            and self._part.size + self._part.extra + nbytes > self.max_shard_size
        ):  # fmt: skip
            self.flush()

    def add_many(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.add(name, t)

    def flush(self) -> None:
        """Finish the current shard: its header, then its tensors' bytes in safetensors' order."""
        part = self._part
        if self._pending:
            raise CheckpointError(
                f"tensor {sorted(self._pending)[0]!r} is unfinished (written in segments); end it first"
            )
        if part is None:
            return
        if not part.entries and not part.size:
            self._drop_part()
            return
        order = sorted(part.entries, key=lambda e: (-_RANK[e.dtype], e.name))
        header = safetensors_header([(e.name, e.dtype, e.shape, e.size) for e in order], {"format": "pt"})
        path = self.tmp_dir / f"part-{len(self._shards):05d}.safetensors"
        dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = os.write(dst, header)
            if offset != len(header):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            for e in order:
                for a, b, fd in e.ranges:
                    src = part.fd if fd == OWN else fd
                    _copy_range(src, dst, a, b - a, offset)
                    _punch(src, a, b - a)  # copied: the scratch bytes need never reach the disk
                    offset += b - a
        finally:
            os.close(dst)
        os.close(part.fd)
        os.chmod(path, 0o644)  # whatever the umask: checkpoints are shared
        self._shards.append([e.name for e in part.entries])
        self._part = None
        part.data.unlink()
        for path, fd in list(self._files.items()):  # the released files: every byte of theirs is in a shard now
            if fd in self._released:
                self._close(path)

    def _drop_part(self) -> None:
        part, self._part = self._part, None
        self._pending.clear()
        if part is not None:
            os.close(part.fd)
            part.data.unlink(missing_ok=True)

    @property
    def buffered_bytes(self) -> int:
        """Bytes in the current, unfinished shard (on disk, not in memory)."""
        return self._part.size + self._part.extra if self._part is not None else 0

    def state(self) -> dict:
        """What is durably on disk (finished shards), for a journal."""
        return {
            "shards": [list(names) for names in self._shards],
            "total_size": self._total_size - self.buffered_bytes,
        }

    def restore(self, state: dict) -> None:
        """Continue after a crash from a :meth:`state` (staged writers only): later part files and the
        unfinished shard's data file go."""
        if not self.staged:
            raise CheckpointError("only a staged writer can be restored")
        self._drop_part()
        for path in list(self._files):
            self._close(path)
        self._shards = [list(n) for n in state["shards"]]
        self._names = {n for names in self._shards for n in names}
        self._total_size = int(state["total_size"])
        for part in self.tmp_dir.glob("part-*.safetensors"):
            if int(part.stem.split("-")[1]) >= len(self._shards):
                part.unlink()
        for data in self.tmp_dir.glob("part-*.data"):
            data.unlink()

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
        """Discard everything written so far (staged: only the unfinished shard; adopted files go)."""
        self._drop_part()
        for path in list(self._files):
            self._close(path)
        if not self._done and not self.staged:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self._done = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()
