"""What every quantised-input format shares (:mod:`moecompress.io.quantized` is the view and the table)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moecompress.io.reader import ShardReader

FIX = (
    "dequantize it first (load it with transformers and save_pretrained in bfloat16) or start from the "
    "bf16 release"
)


@dataclass(frozen=True)
class QEntry:
    """One quantised tensor of the logical view."""

    shape: tuple[int, ...]
    raw: tuple[str, ...]
    """its on-disk tensors, the quantised payload first (then scales, zero points, shapes)."""
    info: Any = field(default=None, compare=False)
    """what the format needs to decode it (a compressed-tensors scheme, ...)."""


class QuantFormat(Protocol):
    method: str

    def scan(self, raw: ShardReader) -> dict[str, QEntry]:
        """Logical name -> entry for every quantised tensor, validated from the headers."""

    def decode(self, name: str, entry: QEntry, raw: ShardReader, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised tensor ``name`` in ``dtype``."""

    def without(self, qc: dict, modules: list[str]) -> dict:
        """``quantization_config`` that no longer claims the modules under ``modules`` (name prefixes)."""
