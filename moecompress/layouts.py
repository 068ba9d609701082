"""Weight layouts: how one projection of a bank of experts is stored.

Every layout describes a *logical* stack of expert matrices of shape ``[E, out, in]`` (HF
``nn.Linear`` orientation, ``y = x @ W[e].T``), whatever its physical storage is. Passes replace a
projection's layout (``dataclasses.replace(bank, gate=Ragged(...))``) without touching the rest of
the layer, and the reference forward only ever calls the methods below, so it is correct for every
layout that implements them.

:class:`Dense` stores ``[E, out, in]``; :class:`Ragged` stores pruned experts compactly (each expert's
live rows only). Factorised (Tucker) and codebook layouts are added by the passes that produce them. A
new layout implements ``shape``, ``dtype``, ``expert``, ``tensors``, ``meta`` and ``from_tensors``;
``apply`` and ``dense`` have correct defaults.

**Live widths.** A bank of pruned experts keeps, per expert ``e``, only its first ``widths[e]``
intermediate neurons (gate/up rows, down columns). :meth:`Layout.apply` takes ``rows``/``cols`` so the
forward multiplies by the live part only (time proportional to the kept width).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError


def member_slots(members: torch.Tensor, stored: int, exact: int, kind: str) -> torch.Tensor:
    """Where each expert lives in a layout that compresses some experts and stores the others exactly
    (protected experts): ``members[e] ≥ 0`` indexes the ``stored`` compressed experts (numbered
    ``0..stored−1`` in expert-id order), ``−1`` marks an exact one. Returns each expert's index into its
    part (for exact experts: how many exact experts precede it); validates unless on ``meta``."""
    if members.device.type != "meta":
        q, p = int((members >= 0).sum()), int((members < 0).sum())
        if not torch.equal(members[members >= 0].cpu(), torch.arange(q)) or q != stored or p != exact:
            raise LayoutError(
                f"{kind} members {members.tolist()} do not fit {stored} compressed and {exact} exact experts"
            )
    return torch.where(members >= 0, members, (members < 0).cumsum(0) - 1)


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

    def apply(
        self, x: torch.Tensor, e: int, *, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor:
        """``x @ W[e][:rows, :cols].T`` for ``x`` of shape ``[T, cols or in]``: the live part of expert
        ``e`` (``rows``: live outputs of gate/up; ``cols``: live inputs of down). Compressed layouts
        override this to avoid materialising the dense weight."""
        w = self.expert(e)[:rows, :cols]
        return F.linear(x.to(w.dtype), w)

    # -- factorised forward: a shared input transform once per token, per-expert work in a "middle"
    # space, the shared output transform once per accumulated token (Tucker). Defaults: identity.
    def encode(self, x: torch.Tensor) -> Any:
        """Work shared by every expert on the inputs ``x`` ``[T, in]`` (done once per token)."""
        return x

    def partial(
        self, ctx: Any, e: int, tok: torch.Tensor, *, rows: int | None = None, cols: int | None = None
    ) -> tuple[str, torch.Tensor]:
        """Expert ``e`` on tokens ``tok`` of ``encode``'s result: ``(space, value [n, mid])``; values
        of one space may be summed (weighted) before :meth:`decode`."""
        return "out", self.apply(ctx[tok], e, rows=rows, cols=cols)

    def decode(self, space: str, value: torch.Tensor) -> torch.Tensor:
        """Values of ``space`` ``[n, mid]`` to the output space ``[n, out]``."""
        return value

    def cast(self, dtype: torch.dtype) -> Layout:
        """This layout with its floating-point storage in ``dtype`` (compute dtype of calibration and
        evaluation); layouts whose storage is not a plain float tensor return themselves."""
        return self

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


@dataclass(frozen=True, eq=False)
class Ragged(Layout):
    """Per-expert live widths stored without padding (the result of neuron pruning).

    ``axis="out"`` (gate/up, logical ``[E, width, H]``): ``rows`` ``[sum(widths), H]`` holds expert 0's
    live rows, then expert 1's, ... ``axis="in"`` (down, logical ``[E, H, width]``): ``rows``
    ``[sum(widths), H]`` holds the live *columns*, transposed, in the same order, so every expert's slice
    is contiguous for both projections. Neurons beyond ``widths[e]`` are zero in the logical view.
    """

    rows: torch.Tensor
    widths: torch.Tensor
    width: int
    axis: str
    kind: ClassVar[str] = "ragged"

    def __post_init__(self) -> None:
        if self.axis not in ("out", "in"):
            raise LayoutError(f"Ragged axis must be 'out' or 'in', got {self.axis!r}")
        if self.rows.dim() != 2 or self.widths.dim() != 1:
            raise LayoutError(
                f"Ragged layout needs rows [N, H] and widths [E]; got {tuple(self.rows.shape)} and "
                f"{tuple(self.widths.shape)}"
            )
        if self.widths.device.type != "meta" and self.rows.device.type != "meta":
            total, wmax = int(self.widths.sum()), int(self.widths.max()) if self.widths.numel() else 0
            if total != self.rows.shape[0] or wmax > self.width or int(self.widths.min()) < 0:
                raise LayoutError(
                    f"Ragged widths (sum {total}, max {wmax}) do not fit rows {tuple(self.rows.shape)} "
                    f"and width {self.width}"
                )
        object.__setattr__(self, "_offsets", torch.cat([self.widths.new_zeros(1), self.widths.cumsum(0)]))

    @classmethod
    def from_dense(cls, weight: torch.Tensor, keep: list[torch.Tensor], axis: str) -> Ragged:
        """Keep neurons ``keep[e]`` (indices along the width axis) of each expert of ``weight``."""
        if axis == "out":
            parts = [weight[e].index_select(0, k) for e, k in enumerate(keep)]
        else:
            parts = [weight[e].index_select(1, k).T for e, k in enumerate(keep)]
        rows = torch.cat(parts).contiguous() if parts else weight.new_zeros(0, weight.shape[-1])
        width = weight.shape[1] if axis == "out" else weight.shape[2]
        return cls(rows, torch.tensor([len(k) for k in keep], dtype=torch.int64), int(width), axis)

    @property
    def shape(self) -> tuple[int, int, int]:
        e, h = int(self.widths.shape[0]), int(self.rows.shape[1])
        return (e, self.width, h) if self.axis == "out" else (e, h, self.width)

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def cast(self, dtype: torch.dtype) -> Ragged:
        return self if self.rows.dtype == dtype else dataclasses.replace(self, rows=self.rows.to(dtype))

    def live(self, e: int) -> torch.Tensor:
        """Expert ``e``'s live neurons as stored: ``[widths[e], H]``."""
        a, b = int(self._offsets[e]), int(self._offsets[e + 1])  # type: ignore[attr-defined]
        return self.rows[a:b]

    def expert(self, e: int) -> torch.Tensor:
        part = self.live(e)
        full = part.new_zeros(self.width, part.shape[1])
        full[: part.shape[0]] = part
        return full if self.axis == "out" else full.T

    def apply(
        self, x: torch.Tensor, e: int, *, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor:
        live = int(self.widths[e])
        if (self.axis == "out" and rows == live and cols is None) or (
            self.axis == "in" and cols == live and rows is None
        ):
            part = self.live(e)
            return F.linear(x.to(part.dtype), part if self.axis == "out" else part.T)
        return super().apply(x, e, rows=rows, cols=cols)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"rows": self.rows, "widths": self.widths.to(torch.int32)}

    def meta(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "shape": list(self.shape),
            "axis": self.axis,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Ragged:
        if set(tensors) != {"rows", "widths"}:
            raise LayoutError(f"Ragged layout needs 'rows' and 'widths' tensors, got {sorted(tensors)}")
        shape, axis = meta["shape"], meta.get("axis", "out")
        width = shape[1] if axis == "out" else shape[2]
        return cls(tensors["rows"], tensors["widths"].to(torch.int64), int(width), axis)


LAYOUTS: dict[str, type[Layout]] = {Dense.kind: Dense, Ragged.kind: Ragged}
"""Layout kinds by name, for deserialisation. Passes that add layouts register them here."""
