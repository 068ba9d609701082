"""Streaming reader for safetensors checkpoints (one file or sharded with an index).

Opening a checkpoint reads only shard *headers* (names, shapes, dtypes), validating every shard, so a
truncated or corrupt file is reported before any work starts. Tensors are read on demand with
``safe_open``; each call opens the shards it needs, copies the tensors out and closes the shards again,
so no memory map (and none of the pages read through it) stays resident between reads and the whole
model is never in memory. Read in small groups to keep the transient peak small: while a group is
being read, its bytes are held twice (mapped pages and copies).

Every shard stays inside the checkpoint directory: an index entry with ``..``, an absolute path, or a
symlink whose target leaves the directory (a Hub cache snapshot's links into its repo's ``blobs/`` are
inside, see :func:`moecompress.io.hub.allowed_roots`) is a :class:`CheckpointError` before any file
is opened.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open

from moecompress.errors import CheckpointError
from moecompress.io.hub import allowed_roots

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}  # fmt: skip
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")


def is_confined(path: Path, roots: list[Path]) -> bool:
    """Whether ``path``, with every symlink resolved, lies inside one of the resolved ``roots``."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return False
    return any(real == r or r in real.parents for r in roots)


def unsafe_name(name: str) -> str | None:
    """Why ``name`` is not a relative path inside a directory (``None`` when it is one)."""
    if not name or "\0" in name or "\\" in name:
        return "an empty name, a NUL byte or a backslash"
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive:
        return "an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "a '..' component"
    return None


class ShardReader:
    """Index of every tensor of a checkpoint directory, and on-demand reads."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._roots = allowed_roots(self.directory)
        self._shard_of: dict[str, str] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        for shard, names in self._shards_from_index().items():
            self._scan_shard(shard, names)

    # -- opening ---------------------------------------------------------------------------------
    def _confined(self, path: Path, what: str) -> Path:
        """``path`` when it resolves inside the directory; a :class:`CheckpointError` before it is opened."""
        if not is_confined(path, self._roots):
            try:
                target = f"resolves to {path.resolve()}"
            except (OSError, RuntimeError, ValueError):
                target = "cannot be resolved (a symlink loop?)"
            raise CheckpointError(
                f"{what} {path} {target}, outside the checkpoint directory {self.directory}; "
                "copy the file into the directory instead of linking to it"
            )
        return path

    def _shards_from_index(self) -> dict[str, set[str] | None]:
        """Shard file -> tensor names the index promises (``None``: no index, take what is there)."""
        index = self.directory / INDEX_NAME
        if index.is_file():
            return _parse_index(self._confined(index, "index"))
        if (self.directory / SINGLE_NAME).is_file():
            return {SINGLE_NAME: None}
        found = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if len(found) == 1:
            return {found[0]: None}
        pickles = [n for n in PICKLE_WEIGHTS if (self.directory / n).exists()]
        if pickles:
            raise CheckpointError(
                f"{self.directory}: only pickle weights ({', '.join(pickles)}); moecompress never unpickles. "
                "Convert the checkpoint to safetensors first (e.g. load it yourself and save_pretrained)."
            )
        raise CheckpointError(
            f"{self.directory}: no {SINGLE_NAME} and no {INDEX_NAME}"
            + (f" (found {len(found)} loose .safetensors files without an index)" if found else "")
        )

    def _scan_shard(self, shard: str, promised: set[str] | None) -> None:
        what = "shard" if promised is None else f"shard {shard!r} listed in {INDEX_NAME}:"
        path = self._confined(self.directory / shard, what)
        if not path.is_file():
            raise CheckpointError(
                f"missing shard {path} (listed in {INDEX_NAME}); re-download the checkpoint"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                for name in names:
                    sl = f.get_slice(name)
                    self._shape[name] = tuple(int(d) for d in sl.get_shape())
                    self._dtype[name] = sl.get_dtype()
        except (SafetensorError, OSError, RuntimeError) as err:  # RuntimeError: safetensors cannot map it
            raise CheckpointError(
                f"corrupt or truncated shard {path}: {err}; re-download or re-save this file"
            ) from None
        if promised is not None:
            missing = sorted(promised - set(names))
            if missing:
                raise CheckpointError(
                    f"shard {path} lacks {len(missing)} tensor(s) its index lists, e.g. {missing[0]!r}"
                )
        for name in names:
            if name in self._shard_of and self._shard_of[name] != shard:
                raise CheckpointError(f"tensor {name!r} is stored twice: {self._shard_of[name]} and {shard}")
            if promised is None or name in promised:
                self._shard_of[name] = shard

    # -- queries ---------------------------------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        """Every tensor name, in index order."""
        return list(self._shard_of)

    def __contains__(self, name: object) -> bool:
        return name in self._shard_of

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[self._require(name)]

    def dtype(self, name: str) -> str:
        """safetensors dtype string (``"F32"``, ``"BF16"``, ...)."""
        return self._dtype[self._require(name)]

    def torch_dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES.get(self.dtype(name), torch.uint8)

    def meta(self, name: str) -> torch.Tensor:
        """A ``meta`` tensor with the stored shape and dtype (dry runs, inspection)."""
        return torch.empty(self.shape(name), dtype=self.torch_dtype(name), device="meta")

    def nbytes(self, name: str) -> int:
        size = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}
        n = 1
        for d in self.shape(name):
            n *= d
        return n * size.get(self.dtype(name), 1)

    @property
    def shards(self) -> list[str]:
        return sorted(set(self._shard_of.values()))

    def _require(self, name: str) -> str:
        if name not in self._shard_of:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.directory}")
        return name

    # -- reading ---------------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read the named tensors (owned copies), opening each shard once and closing it afterwards."""
        by_shard: dict[str, list[str]] = {}
        for name in names:
            by_shard.setdefault(self._shard_of[self._require(name)], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard, shard_names in by_shard.items():
            path = self.directory / shard
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in shard_names:
                        # get_tensor returns a view into the shard's memory map; one surviving view pins
                        # the whole map and every page read through it. An owned copy lets the map go
                        # when the shard is closed, so a layer costs its own bytes only.
                        out[name] = f.get_tensor(name).clone()
            except (SafetensorError, OSError, RuntimeError) as err:  # RuntimeError: safetensors cannot map it
                raise CheckpointError(f"cannot read from shard {path}: {err}") from None
        return out

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the first dimension of ``name`` (an owned copy); only those bytes are
        read (one expert of a fused ``[E, ...]`` tensor)."""
        path = self.directory / self._shard_of[self._require(name)]
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return f.get_slice(name)[start:stop].clone()
        except (SafetensorError, OSError, RuntimeError) as err:  # RuntimeError: safetensors cannot map it
            raise CheckpointError(f"cannot read from shard {path}: {err}") from None


def _parse_index(index: Path) -> dict[str, set[str]]:
    """Shard file -> tensor names of a safetensors index; every shard name a plain relative path."""
    fix = "re-download the checkpoint or re-save it with save_pretrained"
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        raise CheckpointError(f"{index}: not a valid safetensors index ({err}); {fix}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: not a valid safetensors index (it must be a JSON object whose 'weight_map' maps "
            f"every tensor name to its shard file); {fix}"
        )
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(name, str) or not name or not isinstance(shard, str):
            raise CheckpointError(
                f"{index}: weight_map entry {name!r}: {shard!r} is not a tensor name mapped to a shard "
                f"file name (both non-empty strings); {fix}"
            )
        why = unsafe_name(shard)
        if why is not None:
            raise CheckpointError(
                f"{index}: weight_map entry {name!r} names shard {shard!r}, {why}; shards must be files "
                f"inside the checkpoint directory {index.parent}, named relative to it; {fix}"
            )
        shards.setdefault(shard, set()).add(name)
    return shards


COPY_GROUP_BYTES = 256 * 2**20
"""The most bytes :func:`moecompress.engine.layer_loop.stream_layers` reads at once to copy (one tensor
when it is larger): while a group is read its bytes are held twice (mapped pages and copies), so a DeepSeek-V3 embedding table and
head read together would cost 7.4 GB instead of 3.7 GB (measured: RESULTS.md, issue 18 estimate gap)."""


def read_groups(keys: Sequence[str], nbytes: Callable[[str], int], limit: int = COPY_GROUP_BYTES) -> list[list[str]]:
    """``keys`` in order, cut into consecutive groups of at most ``limit`` bytes (a larger tensor alone)."""
    out: list[list[str]] = []
    size = 0
    for k in keys:
        n = nbytes(k)
        if not out or (size + n > limit and out[-1]):
            out.append([])
            size = 0
        out[-1].append(k)
        size += n
    return out
