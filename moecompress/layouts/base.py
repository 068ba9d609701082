"""Weight layouts: how one projection of a bank of experts is stored.

Every layout describes a *logical* stack of expert matrices of shape ``[E, out, in]`` (HF
``nn.Linear`` orientation, ``y = x @ W[e].T``), whatever its physical storage is. Passes replace a
projection's layout (``dataclasses.replace(bank, gate=Ragged(...))``) without touching the rest of
the layer, and the reference forward only ever calls the methods below, so it is correct for every
layout that implements them.

One file per layout in this package (``dense``, ``ragged``, ``lowrank``, ``tucker``, ``codebook``,
``rtn``); :data:`moecompress.layouts.LAYOUTS` is the explicit table of them by kind. A new layout
implements ``shape``, ``dtype``, ``expert``, ``tensors``, ``meta`` and ``from_tensors``; ``apply`` and
``dense`` have correct defaults — and is added to that table.

**Live widths.** A bank of pruned experts keeps, per expert ``e``, only its first ``widths[e]``
intermediate neurons (gate/up rows, down columns). :meth:`Layout.apply` takes ``rows``/``cols`` so the
forward multiplies by the live part only (time proportional to the kept width).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError


def meta_tensor(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty tensor on ``meta``: what the shapes-only constructors (``meta_like``) are built of."""
    return torch.empty(*shape, dtype=dtype, device="meta")


def meta_members(n_experts: int) -> torch.Tensor:
    """A ``members`` index ``[E]`` on ``meta`` (which experts are exact is not known on shapes alone)."""
    return meta_tensor(n_experts, dtype=torch.int64)


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
    shared: ClassVar[frozenset[str]] = frozenset()
    """Tensors every expert of the bank shares (``Tucker``'s factors), not one per expert: a bank held by
    chunks of experts (:func:`moecompress.engine.chunks.join_bank`) has them once, the same in every chunk,
    and the other tensors appended along their first (expert) axis."""

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

    def to(self, device: torch.device | str) -> Layout:
        """This layout with every stored tensor on ``device`` (itself when they already are there)."""
        device = torch.device(device)
        stored = self.tensors()
        if all(t.device == device for t in stored.values()):
            return self
        return type(self).from_tensors({k: t.to(device) for k, t in stored.items()}, self.meta())

    def dense(self) -> torch.Tensor:
        """All experts as one dense ``[E, out, in]`` tensor."""
        return torch.stack([self.expert(e) for e in range(self.num_experts)])

    def num_params(self) -> int:
        """Number of stored elements (what the layout really costs, not the logical size)."""
        return sum(t.numel() for t in self.tensors().values())

    def nbytes(self) -> int:
        """Bytes of the stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
