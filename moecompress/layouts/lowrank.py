"""The ``lowrank`` layout: each expert's projection stored as a product of two thin factors.

Written by ``svd_experts`` (per-expert truncated SVD). Expert ``e`` with ``members[e] = m >= 0`` is
factorised with rank ``ranks[m]``; its factors are contiguous slices of two packed tensors (the
factors of every factorised expert concatenated along the rank axis, in expert-id order)::

    off = exclusive cumsum of ranks;  a, b = off[m], off[m + 1]
    W[e] = u[:, a:b] @ v[a:b]          u: [out, sum(ranks)],  v: [sum(ranks), in]

so the file stores exactly ``sum(ranks) · (out + in)`` factor elements, whatever the per-expert ranks.
Both packed factors are stored with the rank axis first (``ut = uᵀ`` ``[R, out]``, ``v`` ``[R, in]``), so a
layer held by chunks of experts appends each chunk's factors to the file as they come and the bytes equal
the whole layer's; files with ``u`` ``[out, R]`` (written before 2026-12-05) are still read.
Experts with ``members[e] = -1`` (protected super experts) are stored dense and bit-identical in
``dense`` ``[P, out, in]``, in expert-id order. The forward ``(x @ v_mᵀ) @ u_mᵀ`` never builds the
dense matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError
from moecompress.layouts.base import Layout, meta_members, meta_tensor


def _on_meta(*ts: torch.Tensor) -> bool:
    return any(t.device.type == "meta" for t in ts)


@dataclass(frozen=True, eq=False)
class LowRank(Layout):
    """Per-expert low-rank factors ``u`` ``[out, R]``, ``v`` ``[R, in]`` (``R = sum(ranks)``), packed
    along the rank axis; ``ranks`` int64 ``[M]``; ``members`` int64 ``[E]`` (factor index, or -1 for an
    expert stored dense); ``dense`` ``[P, out, in]`` the P dense experts in expert-id order."""

    u: torch.Tensor
    v: torch.Tensor
    ranks: torch.Tensor
    members: torch.Tensor
    dense_experts: torch.Tensor
    kind: ClassVar[str] = "lowrank"

    def __post_init__(self) -> None:
        u, v, ranks, members, dense = self.u, self.v, self.ranks, self.members, self.dense_experts
        if u.dim() != 2 or v.dim() != 2 or dense.dim() != 3 or ranks.dim() != 1 or members.dim() != 1:
            raise LayoutError(
                f"LowRank needs u [out, R], v [R, in], ranks [M], members [E], dense [P, out, in]; got "
                f"{tuple(u.shape)}, {tuple(v.shape)}, {tuple(ranks.shape)}, {tuple(members.shape)}, "
                f"{tuple(dense.shape)}"
            )
        if u.shape[1] != v.shape[0] or tuple(dense.shape[1:]) != (u.shape[0], v.shape[1]):
            raise LayoutError(
                f"LowRank factors do not fit: u {tuple(u.shape)}, v {tuple(v.shape)}, dense {tuple(dense.shape)}"
            )
        if not _on_meta(ranks, members, u):
            m, p = int((members >= 0).sum()), int((members < 0).sum())
            ok = torch.equal(members[members >= 0].cpu(), torch.arange(m)) and m == ranks.numel()
            if not ok or p != dense.shape[0] or int(ranks.sum()) != u.shape[1] or bool((ranks < 0).any()):
                raise LayoutError(
                    f"LowRank members {members.tolist()} / ranks {ranks.tolist()} do not fit factors of "
                    f"total rank {u.shape[1]} and {dense.shape[0]} dense experts"
                )
        offsets = torch.cat([ranks.new_zeros(1), ranks.cumsum(0)])
        slot = torch.where(members >= 0, members, (members < 0).cumsum(0) - 1)  # index into dense
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_slot", slot)

    @classmethod
    def from_factors(
        cls,
        factors: dict[int, tuple[torch.Tensor, torch.Tensor]],
        dense: dict[int, torch.Tensor],
        like: torch.Tensor,
    ) -> LowRank:
        """From ``{expert: (u [out, r], v [r, in])}`` and ``{expert: W [out, in]}`` covering every expert
        once; ``like`` ``[..., out, in]`` gives the shape, dtype and device of empty parts."""
        n, (out, inn) = len(factors) + len(dense), like.shape[-2:]
        if set(factors) | set(dense) != set(range(n)) or set(factors) & set(dense):
            raise LayoutError("LowRank.from_factors: every expert must be either factorised or dense, once")
        ids, rest = sorted(factors), sorted(dense)
        members = torch.full((n,), -1, dtype=torch.int64)
        members[ids] = torch.arange(len(ids))
        u = torch.cat([like.new_zeros(out, 0), *(factors[e][0] for e in ids)], 1)
        v = torch.cat([like.new_zeros(0, inn), *(factors[e][1] for e in ids)], 0)
        stack = torch.stack([dense[e] for e in rest]) if rest else like.new_zeros(0, out, inn)
        ranks = torch.tensor([factors[e][0].shape[1] for e in ids], dtype=torch.int64)
        return cls(u.contiguous(), v.contiguous(), ranks, members, stack.contiguous())

    @classmethod
    def meta_like(
        cls, experts: int, out: int, inn: int, *, factorised: int, total_rank: int, dtype: torch.dtype
    ) -> LowRank:
        """Shapes only (``meta``): ``factorised`` experts of summed rank ``total_rank``, the rest dense."""
        return cls(
            meta_tensor(out, total_rank, dtype=dtype), meta_tensor(total_rank, inn, dtype=dtype),
            meta_tensor(factorised, dtype=torch.int64), meta_members(experts),
            meta_tensor(experts - factorised, out, inn, dtype=dtype),
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int, int]:
        return (int(self.members.shape[0]), int(self.u.shape[0]), int(self.v.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.u.dtype

    def factors(self, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(u_m [out, r], v_m [r, in])`` of expert ``e``, or ``None`` when it is stored dense."""
        m = int(self.members[e])
        if m < 0:
            return None
        a, b = int(self._offsets[m]), int(self._offsets[m + 1])  # type: ignore[attr-defined]
        return self.u[:, a:b], self.v[a:b]

    def expert(self, e: int) -> torch.Tensor:
        f = self.factors(e)
        return self.dense_experts[int(self._slot[e])] if f is None else f[0] @ f[1]  # type: ignore[attr-defined]

    def apply(
        self, x: torch.Tensor, e: int, *, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor:
        _, out, inn = self.shape
        if rows not in (None, out) or cols not in (None, inn):
            raise LayoutError(
                f"LowRank experts have no live widths (rows={rows}, cols={cols} of [{out}, {inn}]); "
                "neuron pruning cannot follow a low-rank decomposition"
            )
        f = self.factors(e)
        if f is None:
            w = self.dense_experts[int(self._slot[e])]  # type: ignore[attr-defined]
            return F.linear(x.to(w.dtype), w)
        return F.linear(F.linear(x.to(self.dtype), f[1]), f[0])

    def cast(self, dtype: torch.dtype) -> LowRank:
        if self.dtype == dtype:
            return self
        return dataclasses.replace(
            self, u=self.u.to(dtype), v=self.v.to(dtype), dense_experts=self.dense_experts.to(dtype)
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"ut": self.u.t(), "v": self.v, "ranks": self.ranks, "members": self.members}
        if self.dense_experts.shape[0]:  # empty tensors are not written
            out["dense"] = self.dense_experts
        return out

    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        if not _on_meta(self.ranks):
            meta["rank"] = int(self.ranks.max()) if self.ranks.numel() else 0  # informational
        return meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> LowRank:
        need = {"v", "ranks", "members"}
        names = set(tensors)
        if not need <= names or len(names & {"u", "ut"}) != 1 or not names <= need | {"u", "ut", "dense"}:
            raise LayoutError(
                f"LowRank layout needs 'ut' (or the older 'u'), 'v', 'ranks', 'members' (and 'dense'), got "
                f"{sorted(tensors)}"
            )
        if "ut" in tensors:  # rank axis first on disk; [out, R] in memory, contiguous for the kernels
            ut = tensors["ut"]
            u = ut.t() if ut.device.type == "meta" else ut.t().contiguous()
        else:
            u = tensors["u"]
        members = tensors["members"].to(torch.int64)
        dense = tensors.get("dense")
        if dense is None:
            _, out, inn = meta["shape"]
            dense = u.new_zeros(0, int(out), int(inn))
        return cls(u, tensors["v"], tensors["ranks"].to(torch.int64), members, dense)
