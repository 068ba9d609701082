"""The ``ragged`` layout: neuron-pruned experts stored without padding (per-expert live widths)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError
from moecompress.layouts.base import Layout, meta_tensor


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
        if self.widths.device.type == "meta":  # shapes only; a meta cumsum's first call costs 0.6-1.1 s (torch's
            # Python meta kernels load): every heapr dry run paid it, on every rank (benchmarks/distributed.py --py-spy)
            offsets = torch.empty(self.widths.shape[0] + 1, dtype=self.widths.dtype, device="meta")
        else:
            offsets = torch.cat([self.widths.new_zeros(1), self.widths.cumsum(0)])
        object.__setattr__(self, "_offsets", offsets)

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

    @classmethod
    def meta_like(
        cls, width: int, hidden: int, axis: str, dtype: torch.dtype, *, widths: torch.Tensor | None = None,
        experts: int = 0, live: int = 0,
    ) -> Ragged:
        """Shapes only (``meta`` rows): experts of allocated ``width`` with known live ``widths`` (a real
        tensor), or ``experts`` experts with ``live`` stored neurons in all whose split is data-dependent
        (``meta`` widths)."""
        if widths is None:
            widths = meta_tensor(experts, dtype=torch.int64)
        else:
            live = int(widths.sum())
        return cls(meta_tensor(live, hidden, dtype=dtype), widths.to(torch.int64), width, axis)

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
