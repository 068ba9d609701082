"""The ``codebook`` layout: per-row (or per row-group) scalar codebooks with bit-packed indices.

Each output row of each expert's projection is split into ``G`` groups of ``in / G`` consecutive input
channels; every group has ``K = 2^bits`` centroids and each weight stores the index of its centroid::

    W[e][i, j] = centroids[m, i, j // gs, codes[m, i, j]]      m = members[e],  gs = in / G

``codes`` are bit-packed per row with :mod:`moecompress.layouts.bitpack` (``uint8`` ``[M, out, ceil(in·bits/8)]``),
``centroids`` are stored in float16 ``[M, out, G, K]``. Experts with ``members[e] = -1`` (protected
super experts) are stored bit-identically in ``exact`` ``[P, out, in]`` (expert-id order). The forward
decodes one expert at a time (:meth:`Codebook.expert`), never the whole bank.

Bytes per weight: ``bits / 8`` for the codes plus ``2·K / gs`` for the centroids (``gs = in`` per row):
4 bits at ``in = 2048`` is 0.5156 B (4.125 bits); at ``in = 128`` it is 0.75 B (6 bits).

The clustering that fills it is :func:`moecompress.methods.kmeans.kmeans_1d`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError
from moecompress.layouts.base import Layout, member_slots, meta_members, meta_tensor
from moecompress.layouts.bitpack import pack_bits, packed_size, unpack_bits

_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, eq=False)
class Codebook(Layout):
    """Packed codes ``[M, out_s, ceil(in_s·bits/8)]``, float16 centroids ``[M, out_s, G, 2^bits]``,
    ``members`` ``[E]`` (index into the quantised experts, or -1), ``exact`` ``[P, out, in]``.

    The quantised experts may be stored narrower than the logical ``(out, in)`` (``out_s ≤ out``,
    ``in_s = in_features ≤ in``): neuron-pruned experts of one live width keep only their live rows
    (gate/up) or columns (down); the rest of the logical weight is zero. ``logical_dtype`` is the dtype
    the forward decodes to."""

    codes: torch.Tensor
    centroids: torch.Tensor
    members: torch.Tensor
    exact: torch.Tensor
    bits: int
    in_features: int
    logical_dtype: torch.dtype = torch.float32
    logical: tuple[int, int] | None = None
    kind: ClassVar[str] = "codebook"

    def __post_init__(self) -> None:
        c, cb, m, ex = self.codes, self.centroids, self.members, self.exact
        if c.dim() != 3 or cb.dim() != 4 or m.dim() != 1 or ex.dim() != 3:
            raise LayoutError(
                f"Codebook needs codes [M, out, bytes], centroids [M, out, G, K], members [E], exact [P, out, in]; "
                f"got {tuple(c.shape)}, {tuple(cb.shape)}, {tuple(m.shape)}, {tuple(ex.shape)}"
            )
        out, g = int(cb.shape[1]), int(cb.shape[2])
        if self.logical is None:
            object.__setattr__(self, "logical", (out, self.in_features))
        lo, li = self.logical  # type: ignore[misc]
        if (
            cb.shape[3] != 1 << self.bits
            or tuple(c.shape[:2]) != (cb.shape[0], out)
            or c.shape[2] != packed_size(self.in_features, self.bits)
            or self.in_features % g
            or tuple(ex.shape[1:]) != (lo, li)
            or out > lo
            or self.in_features > li
        ):
            raise LayoutError(
                f"Codebook parts do not fit: codes {tuple(c.shape)}, centroids {tuple(cb.shape)}, exact "
                f"{tuple(ex.shape)} for {self.bits} bits, {self.in_features} stored inputs, logical {[lo, li]}"
            )
        object.__setattr__(self, "_slot", member_slots(m, c.shape[0], ex.shape[0], "Codebook"))

    @classmethod
    def build(
        cls,
        codes: dict[int, torch.Tensor],
        centroids: dict[int, torch.Tensor],
        exact: dict[int, torch.Tensor],
        bits: int,
        like: torch.Tensor,
    ) -> Codebook:
        """From per-expert codes ``[out_s, in_s]`` (ints) and centroids ``[out_s, G, K]``, and exact experts
        ``{e: W [out, in]}``; ``like`` ``[..., out, in]`` gives the logical shape and dtype."""
        out, inn = (int(v) for v in like.shape[-2:])
        ids, rest = sorted(codes), sorted(exact)
        n = len(ids) + len(rest)
        if set(ids) | set(rest) != set(range(n)) or set(ids) & set(rest):
            raise LayoutError("Codebook.build: every expert must be either quantised or exact, once")
        members = torch.full((n,), -1, dtype=torch.int64)
        members[ids] = torch.arange(len(ids))
        out_s, in_s = codes[ids[0]].shape if ids else (out, inn)
        g = centroids[ids[0]].shape[1] if ids else 1
        if ids:
            packed = torch.stack([pack_bits(codes[e], bits) for e in ids])
            cents = torch.stack([centroids[e] for e in ids]).to(torch.float16)
        else:
            packed = torch.zeros(0, out_s, packed_size(in_s, bits), dtype=torch.uint8, device=like.device)
            cents = torch.zeros(0, out_s, g, 1 << bits, dtype=torch.float16, device=like.device)
        ex = torch.stack([exact[e] for e in rest]) if rest else like.new_zeros(0, out, inn)
        return cls(packed, cents, members, ex, bits, int(in_s), like.dtype, (out, inn))

    @classmethod
    def meta_like(
        cls, experts: int, out: int, inn: int, *, bits: int, groups: int, stored: tuple[int, int], exact: int,
        dtype: torch.dtype,
    ) -> Codebook:
        """Shapes only (``meta``): what :meth:`build` stores for ``experts - exact`` quantised experts of
        stored size ``stored`` (``(out_s, in_s)``), ``groups`` codebooks per row."""
        m, (out_s, in_s) = experts - exact, stored
        return cls(
            meta_tensor(m, out_s, packed_size(in_s, bits), dtype=torch.uint8),
            meta_tensor(m, out_s, groups, 1 << bits, dtype=torch.float16), meta_members(experts),
            meta_tensor(exact, out, inn, dtype=dtype), bits, in_s, dtype, (out, inn),
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int, int]:
        return (int(self.members.shape[0]), *self.logical)  # type: ignore[return-value]

    @property
    def dtype(self) -> torch.dtype:
        return self.logical_dtype

    @property
    def group_size(self) -> int:
        return self.in_features // int(self.centroids.shape[2])

    @property
    def stored(self) -> tuple[int, int]:
        """``(out_s, in_s)``: the stored size of a quantised expert."""
        return int(self.centroids.shape[1]), self.in_features

    def indices(self, e: int) -> torch.Tensor | None:
        """Centroid indices ``[out_s, in_s]`` (uint8) of expert ``e``, or ``None`` when it is stored exactly."""
        m = int(self.members[e])
        return None if m < 0 else unpack_bits(self.codes[m], self.bits, self.in_features)

    def _decoded(self, e: int) -> torch.Tensor | None:
        idx = self.indices(e)
        if idx is None:
            return None
        cb = self.centroids[int(self.members[e])]
        out, g, _ = cb.shape
        w = cb.to(self.logical_dtype).gather(2, idx.long().view(out, g, self.group_size))
        return w.view(out, self.in_features)

    def expert(self, e: int) -> torch.Tensor:
        w = self._decoded(e)
        if w is None:
            return self.exact[int(self._slot[e])]  # type: ignore[attr-defined]
        lo, li = self.logical  # type: ignore[misc]
        return F.pad(w, (0, li - w.shape[1], 0, lo - w.shape[0])) if (lo, li) != tuple(w.shape) else w

    def apply(
        self, x: torch.Tensor, e: int, *, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor:
        w = self._decoded(e)
        if w is None or (rows not in (None, w.shape[0]) or cols not in (None, w.shape[1])):
            w = self.expert(e)[:rows, :cols]
        elif cols is None and w.shape[1] != self.logical[1]:  # type: ignore[index]
            w = self.expert(e)[:rows]
        elif rows is None and w.shape[0] != self.logical[0]:  # type: ignore[index]
            w = self.expert(e)[:, :cols]
        return F.linear(x.to(w.dtype), w)

    def cast(self, dtype: torch.dtype) -> Codebook:
        if dtype == self.logical_dtype:
            return self
        return dataclasses.replace(self, logical_dtype=dtype, exact=self.exact.to(dtype))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"codes": self.codes, "centroids": self.centroids, "members": self.members}
        if self.exact.shape[0]:
            out["exact"] = self.exact
        return out

    def meta(self) -> dict[str, Any]:
        meta = {
            "kind": self.kind,
            "shape": list(self.shape),
            "bits": self.bits,
            "group_size": self.group_size,
            "dtype": str(self.logical_dtype).removeprefix("torch."),
        }
        if self.stored != tuple(self.logical):  # type: ignore[arg-type]
            meta["stored"] = list(self.stored)
        return meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Codebook:
        need = {"codes", "centroids", "members"}
        if not need <= set(tensors) or not set(tensors) <= need | {"exact"}:
            raise LayoutError(
                f"Codebook layout needs 'codes', 'centroids', 'members' (and 'exact'), got {sorted(tensors)}"
            )
        _, out, inn = (int(v) for v in meta["shape"])
        in_s = int(meta.get("stored", [out, inn])[1])
        dtype = _DT.get(str(meta.get("dtype", "float32")), torch.float32)
        exact = tensors.get("exact")
        if exact is None:
            exact = torch.zeros(0, out, inn, dtype=dtype, device=tensors["codes"].device)
        members = tensors["members"].to(torch.int64)
        return cls(
            tensors["codes"], tensors["centroids"], members, exact, int(meta["bits"]), in_s, dtype, (out, inn)
        )
