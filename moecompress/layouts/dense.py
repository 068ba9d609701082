"""The ``dense`` layout: plain stacked expert weights ``[E, out, in]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moecompress.errors import LayoutError
from moecompress.layouts.base import Layout, meta_tensor


@dataclass(frozen=True, eq=False)
class Dense(Layout):
    """Plain stacked weights ``[E, out, in]``."""

    weight: torch.Tensor
    kind: ClassVar[str] = "dense"

    def __post_init__(self) -> None:
        if self.weight.dim() != 3:
            raise LayoutError(
                f"Dense layout needs a 3-D [E, out, in] weight, got shape {tuple(self.weight.shape)}"
            )

    @classmethod
    def meta_like(cls, experts: int, out: int, inn: int, dtype: torch.dtype) -> Dense:
        """Shapes only (``meta``): the dry run's stand-in."""
        return cls(meta_tensor(experts, out, inn, dtype=dtype))

    @property
    def shape(self) -> tuple[int, int, int]:
        e, o, i = self.weight.shape
        return (int(e), int(o), int(i))

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def expert(self, e: int) -> torch.Tensor:
        return self.weight[e]

    def cast(self, dtype: torch.dtype) -> Dense:
        return self if self.weight.dtype == dtype else Dense(self.weight.to(dtype))

    def dense(self) -> torch.Tensor:
        return self.weight

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Dense:
        if "weight" not in tensors:
            raise LayoutError(f"Dense layout needs a 'weight' tensor, got {sorted(tensors)}")
        return cls(tensors["weight"])
