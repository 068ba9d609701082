"""The safetensors file format as :class:`~moecompress.io.writer.ShardWriter` writes it: the dtype order of a
shard's tensors, the header block, and the byte ranges of a shard's data file (a tensor written in one
piece or in segments, ``ShardWriter.append``) copied into the shard in the kernel."""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import TensorSpec

from moecompress.errors import CheckpointError

# safetensors' ``Dtype`` enum in declaration order; a shard's tensors are laid out by descending dtype,
# then by name (its ``prepare``), which keeps every tensor aligned to its element size.
_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
_RANK = {code: i for i, code in enumerate(_DTYPE_ORDER)}


OWN = -1
"""A byte range's file: the shard's own data file (else an adopted file's descriptor, ``ShardWriter.adopt``)."""


@dataclass
class _Entry:
    name: str
    dtype: str  # safetensors' code, e.g. "BF16"
    shape: list[int]  # the header's (logical) shape
    ranges: list[tuple[int, int, int]]
    """the byte ranges ``(start, end, fd)`` holding the tensor, in order: ``fd`` is :data:`OWN` (the shard's
    data file) or an adopted file's; several for a tensor written in segments (:meth:`ShardWriter.append`)"""

    @property
    def size(self) -> int:
        return sum(b - a for a, b, _ in self.ranges)


@dataclass
class _Pending:
    """A tensor being written in segments: its dtype, the byte ranges written so far."""

    dtype: torch.dtype
    ranges: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class _Part:
    """The unfinished shard: its data file (open for appending), what it holds, and the bytes it holds in
    adopted files (``extra``; ``files``: their descriptors)."""

    data: Path
    fd: int
    entries: list[_Entry] = field(default_factory=list)
    size: int = 0
    extra: int = 0
    files: set[int] = field(default_factory=set)


def _header_entry(name: str, dtype: torch.dtype, shape: Iterable[int], nbytes: int) -> tuple[str, list[int]]:
    """safetensors' dtype code and logical shape (the library's own mapping, via ``TensorSpec``)."""
    try:
        spec = TensorSpec(dtype=str(dtype).split(".")[-1], shape=list(shape), data_ptr=0, data_len=nbytes)
    except Exception as err:
        raise CheckpointError(f"tensor {name!r}: safetensors cannot store dtype {dtype} ({err})") from None
    if spec.dtype not in _RANK:
        raise CheckpointError(f"tensor {name!r}: dtype {spec.dtype} is not in the writer's dtype table")
    return spec.dtype, list(spec.shape)


def _pwrite(fd: int, t: torch.Tensor, offset: int) -> int:
    """Write the tensor's bytes (copied only when it is not contiguous) at ``offset``; their count."""
    view = memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):  # a write may be short (size caps, a filling disk): write the rest
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def safetensors_header(entries: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> bytes:
    """The header block (length prefix, JSON, space padding to 8 bytes) of a safetensors file whose
    tensors ``(name, dtype code, shape, nbytes)`` are laid out in the given order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, code, shape, nbytes in entries:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


_VIEWABLE = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
             torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)  # fmt: skip


def _torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors' code -> torch dtype for the dtypes a byte buffer can be viewed as (the library's own
    mapping, through :func:`_header_entry`)."""
    return {_header_entry("x", dt, [1], dt.itemsize)[0]: dt for dt in _VIEWABLE}


def load_buffer(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes held in a uint8 host tensor ``buf``, as views into it (no copy):
    what a rank receives (:meth:`moecompress.engine.distributed.Ranks.recv_buffer`). safetensors' ``load``
    takes ``bytes`` and copies every tensor out of them, which for a chunk's message on the rank that writes
    is two copies of its bytes (0.16 s per 256 MB each, measured). A dtype it cannot view (a sub-byte
    one) or an unaligned tensor falls back to ``load``."""
    raw = buf.numpy()
    n = int(struct.unpack("<Q", raw[:8].tobytes())[0])
    header = json.loads(raw[8 : 8 + n].tobytes())
    header.pop("__metadata__", None)
    codes, base, out = _torch_dtypes(), 8 + n, {}
    for name, info in header.items():
        dt = codes.get(info["dtype"])
        a, b = info["data_offsets"]
        if dt is None or (buf.storage_offset() + base + a) % dt.itemsize:
            from safetensors.torch import load

            return load(raw.tobytes())
        out[name] = buf[base + a : base + b].view(dt).reshape(info["shape"])
    return out


_COPY_CHUNK = 64 << 20


def _copy_range(src: int, dst: int, start: int, count: int, dst_off: int) -> None:
    """Copy ``count`` bytes from ``src`` at ``start`` to ``dst`` at ``dst_off`` (in the kernel if it can)."""
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, min(count, _COPY_CHUNK), start, dst_off)
        except OSError as err:  # no copy_file_range across these files: plain reads and writes
            if err.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            n = 0
        if n == 0:
            block = os.pread(src, min(count, _COPY_CHUNK), start)
            if not block:
                raise CheckpointError("a shard's data file is shorter than its tensors")
            n = os.pwrite(dst, block, dst_off)
        start, dst_off, count = start + n, dst_off + n, count - n


_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)


@functools.cache
def _fallocate():
    """libc's ``fallocate`` (Linux; ``None`` elsewhere): Python's ``os`` has only ``posix_fallocate``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def _punch(fd: int, start: int, count: int) -> bool:
    """Drop bytes ``[start, start + count)`` of the scratch file ``fd`` (they read as zeros after); whether
    the file system did. A shard's data file and adopted files are copied into the shard, then deleted: their
    dirty pages, punched as soon as they are copied, are never written back. Without this, finishing a shard
    dirtied its bytes twice (source and shard) and the kernel throttled the copy to the disk's speed when the
    sources were still dirty: 2.4 GB copied in 2.6-4.8 s against 1.2-1.6 s with punching (ext4, this VM's
    400 MB/s disk; benchmarks/RESULTS.md, seventh session)."""
    fn = _fallocate()
    return fn is not None and count > 0 and fn(fd, _PUNCH_HOLE, start, count) == 0


def _extend(pend: _Pending, a: int, b: int, fd: int) -> None:
    """A segment ``[a, b)`` of file ``fd`` onto a pending tensor (one range with the last when contiguous)."""
    if pend.ranges and pend.ranges[-1][1] == a and pend.ranges[-1][2] == fd:
        pend.ranges[-1] = (pend.ranges[-1][0], b, fd)
    else:
        pend.ranges.append((a, b, fd))
