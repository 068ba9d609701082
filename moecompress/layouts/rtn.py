"""The ``rtn`` layout: round-to-nearest scalar quantisation per group of input channels.

Each output row of each expert's projection is split into ``G = in / gs`` groups of ``gs`` consecutive
input channels (``gs = in`` when ``group_size = -1``: one group per output channel). A group with
minimum ``lo`` and maximum ``hi`` is stored as ``b``-bit codes ``q``, a float16 scale ``s`` and an
integer zero point ``z``::

    asymmetric:  lo' = min(lo, 0), hi' = max(hi, 0)        (the range always holds 0)
                 s = fp16((hi' − lo') / (2^b − 1)),  z = clamp(round(−lo' / s), 0, 2^b − 1)
    symmetric:   s = fp16(max|w| / (2^(b−1) − 1)),  z = 2^(b−1)   (fixed, not stored)
    both:        q = clamp(round(w / s) + z, 0, 2^b − 1),     ŵ = (q − z) · s

``round`` is round-half-to-even, computed in float32 with the float16-rounded scale, so ``ŵ`` is the
grid point nearest ``w`` for the scale actually stored. Zero is always exactly representable (``q = z``).
A group of zeros (or one whose scale underflows float16) has ``s = 0`` and decodes to zeros. Symmetric codes
lie in ``[1, 2^b − 1]``; ``q − 2^(b−1)`` is the signed int of compressed-tensors' symmetric
``pack-quantized`` format (:mod:`moecompress.io.compressed_tensors`). Decoding is exact in float32
(``|q − z| ≤ 255`` times a float16 scale) and then cast to the layout's logical dtype.

Storage (``M`` quantised experts, ``P`` protected ones, ``M + P = E``)::

    codes    uint8   [M, out, ceil(in·b/8)]   bit-packed per row (moecompress.layouts.bitpack)
    scales   float16 [M, out, G]
    zeros    uint8   [M, out, G]              (asymmetric only)
    members  int64   [E]                      index into the quantised experts, or -1
    dense    [P, out, in]                     protected experts, bit-identical, in expert-id order

Bytes per weight: ``b/8 + 2/gs`` (symmetric) or ``b/8 + 3/gs`` (asymmetric); 4 bits with ``gs = 128``
asymmetric is 0.5234 B (4.1875 bits). The forward decodes one expert at a time, only the rows it needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError
from moecompress.layouts.base import Layout, member_slots, meta_members, meta_tensor
from moecompress.layouts.bitpack import BITS, pack_bits, packed_size, unpack_bits
from moecompress.methods.scalar_quant import dequantize, group_width, quantize

_DT = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True, eq=False)
class RTN(Layout):
    """Packed codes ``[M, out, ceil(in·bits/8)]``, float16 ``scales`` ``[M, out, G]``, uint8 ``zeros``
    ``[M, out, G]`` (``None`` when symmetric), ``members`` ``[E]`` (index into the quantised experts, or
    -1), ``dense_experts`` ``[P, out, in]``; ``logical_dtype`` is the dtype the forward decodes to."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    members: torch.Tensor
    dense_experts: torch.Tensor
    bits: int
    in_features: int
    logical_dtype: torch.dtype = torch.float32
    kind: ClassVar[str] = "rtn"

    def __post_init__(self) -> None:
        c, s, z, m, d = self.codes, self.scales, self.zeros, self.members, self.dense_experts
        if c.dim() != 3 or s.dim() != 3 or m.dim() != 1 or d.dim() != 3 or (z is not None and z.dim() != 3):
            raise LayoutError(
                f"RTN needs codes [M, out, bytes], scales/zeros [M, out, G], members [E], dense [P, out, in]; "
                f"got {tuple(c.shape)}, {tuple(s.shape)}, {None if z is None else tuple(z.shape)}, "
                f"{tuple(m.shape)}, {tuple(d.shape)}"
            )
        out, g = s.shape[1], s.shape[2]
        if (
            self.bits not in BITS
            or tuple(c.shape[:2]) != (s.shape[0], out)
            or c.shape[2] != packed_size(self.in_features, self.bits)
            or g < 1
            or self.in_features % g
            or (z is not None and z.shape != s.shape)
            or tuple(d.shape[1:]) != (out, self.in_features)
        ):
            raise LayoutError(
                f"RTN parts do not fit: codes {tuple(c.shape)}, scales {tuple(s.shape)}, dense {tuple(d.shape)} "
                f"for {self.bits} bits and {self.in_features} inputs"
            )
        object.__setattr__(self, "_slot", member_slots(m, c.shape[0], d.shape[0], "RTN"))

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor,
        bits: int,
        group_size: int,
        *,
        symmetric: bool = False,
        protected: frozenset[int] | set[int] = frozenset(),
        chunk: int = 8,
    ) -> RTN:
        """Quantise every expert of ``weight`` ``[E, out, in]`` except ``protected`` (kept bit-identical),
        ``chunk`` experts at a time (bounds the float32 temporaries)."""
        n, out, inn = weight.shape
        gs = group_width(inn, group_size)
        ids = [e for e in range(n) if e not in protected]
        rest = [e for e in range(n) if e in protected]
        members = torch.full((n,), -1, dtype=torch.int64)
        members[ids] = torch.arange(len(ids))
        codes, scales, zeros = [], [], []
        for a in range(0, len(ids), chunk):
            q, s, z = quantize(weight[ids[a : a + chunk]], bits, group_size, symmetric)
            codes.append(pack_bits(q, bits))
            scales.append(s)
            zeros.append(z)
        dev = weight.device
        codes.append(torch.zeros(0, out, packed_size(inn, bits), dtype=torch.uint8, device=dev))
        scales.append(torch.zeros(0, out, inn // gs, dtype=torch.float16, device=dev))
        zeros.append(torch.zeros(0, out, inn // gs, dtype=torch.uint8, device=dev))
        zero_t = None if symmetric else torch.cat(zeros)
        dense = weight[rest].clone() if rest else weight.new_zeros(0, out, inn)
        return cls(torch.cat(codes), torch.cat(scales), zero_t, members, dense, bits, int(inn), weight.dtype)

    @classmethod
    def meta_like(
        cls, experts: int, out: int, inn: int, *, bits: int, group_size: int, symmetric: bool, exact: int,
        dtype: torch.dtype,
    ) -> RTN:
        """Shapes only (``meta``): what :meth:`from_dense` stores with ``exact`` protected experts."""
        m, g = experts - exact, inn // group_width(inn, group_size)
        return cls(
            meta_tensor(m, out, packed_size(inn, bits), dtype=torch.uint8), meta_tensor(m, out, g, dtype=torch.float16),
            None if symmetric else meta_tensor(m, out, g, dtype=torch.uint8), meta_members(experts),
            meta_tensor(exact, out, inn, dtype=dtype), bits, inn, dtype,
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int, int]:
        return (int(self.members.shape[0]), int(self.scales.shape[1]), self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        return self.logical_dtype

    @property
    def group_size(self) -> int:
        """Inputs per group (``in`` for one group per output channel)."""
        return self.in_features // int(self.scales.shape[2])

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def quantised(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``(codes [out, in] uint8, scales [out, G], zeros [out, G] or None)`` of expert ``e``, or
        ``None`` when it is stored dense (protected)."""
        m = int(self.members[e])
        if m < 0:
            return None
        z = None if self.zeros is None else self.zeros[m]
        return unpack_bits(self.codes[m], self.bits, self.in_features), self.scales[m], z

    def _decode(self, e: int, rows: int | None = None) -> torch.Tensor:
        m = int(self.members[e])
        if m < 0:
            return self.dense_experts[int(self._slot[e])][:rows]  # type: ignore[attr-defined]
        z = None if self.zeros is None else self.zeros[m, :rows]
        q = unpack_bits(self.codes[m, :rows], self.bits, self.in_features)
        return dequantize(q, self.scales[m, :rows], z, self.bits).to(self.logical_dtype)

    def expert(self, e: int) -> torch.Tensor:
        return self._decode(e)

    def apply(
        self, x: torch.Tensor, e: int, *, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor:
        w = self._decode(e, rows)[:, :cols]
        return F.linear(x.to(w.dtype), w)

    def cast(self, dtype: torch.dtype) -> RTN:
        if dtype == self.logical_dtype:
            return self
        return dataclasses.replace(self, logical_dtype=dtype, dense_experts=self.dense_experts.to(dtype))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"codes": self.codes, "scales": self.scales, "members": self.members}
        if self.zeros is not None:
            out["zeros"] = self.zeros
        if self.dense_experts.shape[0]:  # empty tensors are not written
            out["dense"] = self.dense_experts
        return out

    def meta(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "shape": list(self.shape),
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "dtype": str(self.logical_dtype).removeprefix("torch."),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> RTN:
        need = {"codes", "scales", "members"}
        if not need <= set(tensors) or not set(tensors) <= need | {"zeros", "dense"}:
            raise LayoutError(
                f"RTN layout needs 'codes', 'scales', 'members' (and 'zeros', 'dense'), got {sorted(tensors)}"
            )
        if bool(meta.get("symmetric", False)) == ("zeros" in tensors):
            raise LayoutError(
                f"RTN layout: symmetric={meta.get('symmetric')} but 'zeros' is "
                f"{'present' if 'zeros' in tensors else 'missing'}"
            )
        _, out, inn = (int(v) for v in meta["shape"])
        dtype = _DT.get(str(meta.get("dtype", "float32")), torch.float32)
        dense = tensors.get("dense")
        if dense is None:
            dense = torch.zeros(0, out, inn, dtype=dtype, device=tensors["codes"].device)
        return cls(
            tensors["codes"], tensors["scales"], tensors.get("zeros"), tensors["members"].to(torch.int64),
            dense, int(meta["bits"]), inn, dtype,
        )  # fmt: skip
