"""The output directory of a run and its sizes: ``max_shard_size`` and ``memory_limit`` parsed
(:func:`parse_size`), an existing output refused unless overwritten (:func:`check_output_dir`), a finished
directory renamed into place (:func:`move_into_place`, the one moment an old output is replaced)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from moecompress.errors import OutputExistsError

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
