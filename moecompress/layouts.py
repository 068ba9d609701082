"""Weight layouts: how one projection of a bank of experts is stored.

Every layout describes a *logical* stack of expert matrices of shape ``[E, out, in]`` (HF
``nn.Linear`` orientation, ``y = x @ W[e].T``), whatever its physical storage is. Passes replace a
projection's layout (``dataclasses.replace(bank, gate=Ragged(...))``) without touching the rest of
the layer, and the reference forward only ever calls the methods below, so it is correct for every
layout that implements them.

Only :class:`Dense` exists today; pruned (ragged), factorised (Tucker) and codebook layouts are added
by the passes that produce them. A new layout implements ``shape``, ``dtype``, ``expert``,
``tensors``, ``meta`` and ``from_tensors``; ``apply`` and ``dense`` have correct defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError


class Layout(ABC):
    """Storage of one projection (gate, up or down) for every expert of a bank."""

    kind: ClassVar[str]

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int, int]:
        """Logical shape ``(E, out, in)``."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """Dtype of the logical (decoded) weights."""

    @abstractmethod
    def expert(self, e: int) -> torch.Tensor:
        """The dense ``[out, in]`` weight of expert ``e`` (decoded if the storage is compressed)."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors, by a short name local to this layout (e.g. ``{"weight": ...}``)."""

    @abstractmethod
    def meta(self) -> dict[str, Any]:
        """A JSON-able description: ``{"kind": ..., "shape": [...], ...}``."""

    @classmethod
    @abstractmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Layout:
        """Inverse of ``tensors()`` + ``meta()``."""

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def apply(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """``x @ W[e].T`` for ``x`` of shape ``[T, in]``. Compressed layouts override this to avoid
        materialising the dense weight."""
        w = self.expert(e)
        return F.linear(x.to(w.dtype), w)

    def dense(self) -> torch.Tensor:
        """All experts as one dense ``[E, out, in]`` tensor."""
        return torch.stack([self.expert(e) for e in range(self.num_experts)])

    def num_params(self) -> int:
        """Number of stored elements (what the layout really costs, not the logical size)."""
        return sum(t.numel() for t in self.tensors().values())

    def nbytes(self) -> int:
        """Bytes of the stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


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

    @property
    def shape(self) -> tuple[int, int, int]:
        e, o, i = self.weight.shape
        return (int(e), int(o), int(i))

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def expert(self, e: int) -> torch.Tensor:
        return self.weight[e]

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


LAYOUTS: dict[str, type[Layout]] = {Dense.kind: Dense}
"""Layout kinds by name, for deserialisation. Passes that add layouts register them here."""
