"""Quantised layouts (``codebook``, ``rtn``) prepared for serving.

An expert with at most :data:`NATIVE_ROWS` routed rows runs on the packed-code CPU kernel
(:mod:`moecompress.runtime.cpu_lut`): the stored bytes are read as they are and nothing is decoded. Other
experts (more rows, no kernel on this machine, or CUDA without a Triton kernel) are decoded, only the hit
ones, in one gather (codebook) or one affine (rtn) per few experts, in the compute dtype, from codes
unpacked once, on first need, to one byte per weight (a per-call unpack costs more than the matmul it
feeds). :func:`decoded_dense` is the memory-for-speed alternative behind
``moecompress.load(..., dequantize=)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError
from moecompress.layouts.base import Layout
from moecompress.layouts.bitpack import unpack_bits
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.dense import Dense
from moecompress.layouts.rtn import RTN
from moecompress.methods.scalar_quant import dequantize
from moecompress.runtime import cpu_lut

NATIVE_ROWS = 256
"""Routed rows up to which an expert runs on the packed-code CPU kernel; above, decoding the expert and
one GEMM is as fast (``benchmarks/cpu_lut.py``, one thread, Qwen3-30B experts: the kernel is 0.75–1.1x
the dense fp32 GEMM at 1–64 rows, 1.4–2.2x faster than decoding at 128, even at 256)."""


class Unpacked(Layout):
    """A quantised layout (``codebook`` or ``rtn``) with its codes unpacked once to ``uint8``; decodes one
    expert's (live) rows per call. Exact experts (``members == -1``) read the layout's own dense copy."""

    kind = "unpacked"

    def __init__(self, layout: Codebook | RTN, *, native: bool | None = None) -> None:
        """``native``: use the packed-code CPU kernel for experts with few rows (``None``: when it builds
        on this machine, :func:`moecompress.runtime.cpu_lut.available`; ``False``: always decode)."""
        self.layout = layout
        self._codes: torch.Tensor | None = None
        self.members = layout.members.tolist()
        if native is None:
            native = layout.codes.device.type == "cpu" and cpu_lut.available()
        self.native = native
        if isinstance(layout, Codebook):  # the centroids in the compute dtype, once (float16 -> it is exact)
            self.centroids = layout.centroids.to(layout.logical_dtype)

    @property
    def codes(self) -> torch.Tensor:
        """The codes unpacked to one ``uint8`` per weight ``[M, out_s, in_s]``, on first use: only the
        decoding path needs them (the packed-code kernel reads the stored bytes)."""
        if self._codes is None:
            lay = self.layout
            self._codes = unpack_bits(lay.codes, lay.bits, lay.in_features)
        return self._codes

    @property
    def shape(self):
        return self.layout.shape

    @property
    def dtype(self):
        return self.layout.dtype

    def tensors(self):  # pragma: no cover - never written
        raise LayoutError("a prepared bank is not written; write the layout it was prepared from")

    def meta(self):  # pragma: no cover - never written
        raise LayoutError("a prepared bank is not written; write the layout it was prepared from")

    @classmethod
    def from_tensors(cls, tensors, meta):  # pragma: no cover - never read
        raise LayoutError("a prepared bank is never read from tensors")

    def _rows(self, m: int, rows: int | None) -> torch.Tensor:
        """Quantised expert ``m``'s decoded ``[rows, in_s]`` weight in the logical dtype."""
        lay, q = self.layout, self.codes[m, :rows]
        if isinstance(lay, Codebook):
            cb = self.centroids[m, :rows]  # [r, G, K]
            r, g, _ = cb.shape
            return cb.gather(2, q.view(r, g, -1).long()).view(r, -1)
        z = None if lay.zeros is None else lay.zeros[m, :rows]
        return dequantize(q, lay.scales[m, :rows], z, lay.bits).to(lay.logical_dtype)

    def expert(self, e: int) -> torch.Tensor:
        return self.layout.expert(e)

    def _stored(self) -> tuple[int, int]:
        lay = self.layout
        return lay.stored if isinstance(lay, Codebook) else (lay.shape[1], lay.in_features)

    def decodes(self, width: int | None, axis: str) -> bool:
        """Whether :meth:`decode_experts` yields the live ``[out, in]`` weights at ``width``: the stored
        part must cover them (a narrower stored codebook only at its own live width)."""
        (_, out, inn), (out_s, in_s) = self.shape, self._stored()
        want = (width or out, inn) if axis == "out" else (out, width or inn)
        return out_s >= want[0] and in_s >= want[1] and (out_s, in_s) != (0, 0)

    def decode_experts(self, hit: list[int], rows: int | None, cols: int | None) -> torch.Tensor:
        """The dense ``[len(hit), rows, cols]`` weights of experts ``hit`` in the logical dtype, decoded
        together (one gather or affine over their codes) when all of them are quantised."""
        lay = self.layout
        m = [self.members[e] for e in hit]
        if min(m) < 0:
            return torch.stack([lay.expert(e)[:rows, :cols] for e in hit])
        q = self.codes[m, :rows]
        if isinstance(lay, Codebook):
            cb = self.centroids[m, :rows]  # [n, r, G, K]
            n, r, g, _ = cb.shape
            w = cb.gather(3, q.view(n, r, g, -1).long()).view(n, r, -1)
        else:
            z = None if lay.zeros is None else lay.zeros[m, :rows]
            w = dequantize(q, lay.scales[m, :rows], z, lay.bits).to(lay.logical_dtype)
        return w[:, :, :cols]

    def apply(self, x: torch.Tensor, e: int, *, rows: int | None = None, cols: int | None = None):
        lay = self.layout
        m = self.members[e]
        out_s, in_s = lay.stored if isinstance(lay, Codebook) else (lay.shape[1], lay.in_features)
        if m < 0 or (rows is not None and rows > out_s) or (cols is not None and cols > in_s):
            return lay.apply(x, e, rows=rows, cols=cols)  # exact experts, or a cut past the stored part
        want = lay.shape[1] if rows is None else rows
        if self.native and x.shape[0] <= NATIVE_ROWS and x.device.type == "cpu":
            y = self._native(x, m, rows, in_s)
        else:
            w = self._rows(m, rows)[:, :cols]
            if cols is None and w.shape[1] < lay.shape[2]:
                x = x[:, : w.shape[1]]  # inputs past the stored columns meet zero weights
            y = F.linear(x.to(w.dtype), w)
        return y if y.shape[1] == want else F.pad(y, (0, want - y.shape[1]))

    def _native(self, x: torch.Tensor, m: int, rows: int | None, in_s: int) -> torch.Tensor:
        """Quantised expert ``m`` on ``x`` by the packed-code CPU kernel (:mod:`moecompress.runtime.cpu_lut`):
        no weight is decoded into memory. ``x``'s columns are fitted to the stored inputs (a cut down
        projection reads zeros past its live width; inputs past the stored part meet zero weights)."""
        lay = self.layout
        x32 = x.float()
        if x32.shape[1] != in_s:
            x32 = F.pad(x32, (0, in_s - x32.shape[1])) if x32.shape[1] < in_s else x32[:, :in_s]
        codes = lay.codes[m, :rows]
        if isinstance(lay, Codebook):
            y = cpu_lut.codebook_matmul(x32, codes, lay.centroids[m, :rows], lay.bits)
        else:
            z = None if lay.zeros is None else lay.zeros[m, :rows]
            y = cpu_lut.rtn_matmul(x32, codes, lay.scales[m, :rows], z, lay.bits)
        return y.to(lay.logical_dtype)


def decoded_dense(layout: Codebook | RTN, dtype: torch.dtype) -> Dense:
    """Every expert of a quantised layout decoded once into a dense ``[E, out, in]`` of ``dtype``."""
    return Dense(torch.stack([layout.expert(e).to(dtype) for e in range(layout.num_experts)]))
