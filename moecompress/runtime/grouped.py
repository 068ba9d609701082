"""Grouped operands of the lean forward: one ``torch._grouped_mm`` per projection for the whole layer.

When every expert of a projection has the same shape, the stored tensor already *is* a grouped
operand ``[E, in, out]`` (a view, no copy), and the routed rows of all experts, sorted by expert, go
through one grouped GEMM (``offs`` = the running count of rows per expert) instead of a Python loop
over the experts: the path transformers itself takes for stock experts on CPU. Served this way:

- ``dense`` (all experts, or every expert cut to one live width ``w``): ``W[:, :w, :]ᵀ``;
- ``ragged`` with one width for all experts (uniform neuron pruning): ``rows.view(E, w, H)``;
- ``tucker`` with every expert factorised (no exact experts): per token ``z = x·U_in`` (one GEMM),
  per routed pair ``C_m z`` (one grouped GEMM over the cores), then ``U_out`` as one GEMM over all
  pairs (gate/up) or once per token after the weighted top-k sum in rank space (down).

The CPU kernel needs 16-byte aligned strides and base pointers (:func:`aligned`); anything else
(ragged widths, low-rank factors of mixed ranks, quantised codes, exact experts) returns ``None`` here
and takes the per-expert loop of :mod:`moecompress.runtime.lean`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from moecompress.layouts.base import Layout
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.tucker import Tucker
from moecompress.runtime.unpacked import NATIVE_ROWS


def aligned(*ts: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` accepts these operands (16-byte strides and base addresses)."""
    for t in ts:
        size = t.element_size()
        if t.data_ptr() % 16 or any(s % (16 // size) for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1):
            return False
    return hasattr(torch, "_grouped_mm")


@dataclass(frozen=True)
class Grouped:
    """One projection as grouped work: ``encode`` once per token, ``rows(x, counts, offs)`` on the
    routed rows sorted by expert (``counts`` per expert, ``offs`` their int32 running sums),
    ``decode`` on a weighted top-k sum (down projection of a factorised layout only)."""

    encode: Callable[[torch.Tensor], torch.Tensor]
    rows: Callable[[torch.Tensor, list[int], torch.Tensor], torch.Tensor]
    space: str = "out"
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None


def _gmm(b: torch.Tensor):
    """``b`` ``[E, in, out]`` as the rows function: one grouped GEMM, or a loop over the experts that
    received rows when the CPU kernel cannot take ``b``'s strides."""
    if aligned(b):
        return lambda x, counts, offs: torch._grouped_mm(x, b, offs=offs)

    def loop(x, counts, offs):
        parts = x.split(counts)
        return torch.cat([parts[e] @ b[e] for e in range(len(counts)) if counts[e]])

    return loop


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def grouped(layout: Layout, width: int | None, axis: str, *, chunk: int | None = None) -> Grouped | None:
    """``layout`` (gate/up: ``axis="out"``; down: ``"in"``) as a :class:`Grouped` at live ``width``
    (``None``: the full width), or ``None`` when it cannot be one; ``chunk``: weights a quantised layout
    decodes at once (default :data:`DECODE_CHUNK`)."""
    if isinstance(layout, Dense):
        w = layout.weight
        b = (w[:, :width, :] if axis == "out" else w[:, :, :width]).transpose(1, 2)
    elif isinstance(layout, Ragged):
        widths = layout.widths
        n = int(widths[0]) if widths.numel() else 0
        if not widths.numel() or not bool((widths == n).all()) or (width is not None and width != n):
            return None
        rows = layout.rows.view(-1, n, layout.rows.shape[1])  # [E, w, H]
        b = rows.transpose(1, 2) if axis == "out" else rows
    elif isinstance(layout, Tucker):
        return _tucker(layout, width, axis)
    elif hasattr(layout, "decode_experts"):  # quantised codes, unpacked (moecompress.runtime.lean)
        return _quantised(layout, width, axis, chunk or DECODE_CHUNK)
    else:
        return None
    return Grouped(_identity, _gmm(b))


def _tucker(layout: Tucker, width: int | None, axis: str) -> Grouped | None:
    """``W_e = U_out C_e U_inᵀ`` with per-expert cores (the expert factor is folded in by the caller)."""
    full = layout.shape[1 if axis == "out" else 2]
    if layout.exact is not None or layout.u_expert is not None or width not in (None, full):
        return None
    if not torch.equal(layout.members.cpu(), torch.arange(layout.members.numel())):
        return None
    u_in, u_out = layout.u_in, layout.u_out
    cores = _gmm(layout.core.transpose(1, 2))  # [E, r3, r2]

    def encode(x: torch.Tensor) -> torch.Tensor:
        return x.to(u_in.dtype) @ u_in

    if axis == "out":
        return Grouped(encode, lambda z, counts, offs: F.linear(cores(z, counts, offs), u_out))
    return Grouped(
        _identity,
        lambda h, counts, offs: cores(encode(h), counts, offs),
        space="rank",
        decode=lambda acc: F.linear(acc.to(u_out.dtype), u_out),
    )


DECODE_CHUNK = 1 << 22
"""Weights decoded at once by a quantised projection (4 Mi: 16 MiB of fp32 weights and their int64
indices stay near the cache instead of a whole layer's experts at prefill)."""


def _quantised(layout, width: int | None, axis: str, chunk: int) -> Grouped | None:
    """Quantised experts: an expert with at most :data:`~moecompress.runtime.unpacked.NATIVE_ROWS` rows
    runs on the packed-code CPU kernel (nothing decoded); the others are decoded a few at a time (one
    gather or affine over their unpacked codes, in the compute dtype, :data:`DECODE_CHUNK` weights at
    most), each few followed by their grouped GEMM — nothing larger than a chunk is materialised."""
    if not layout.decodes(width, axis):
        return None
    rows_, cols_ = (width, None) if axis == "out" else (None, width)
    _, out, inn = layout.shape
    per = max(1, chunk // max(1, (rows_ or out) * (cols_ or inn)))

    def rows(x, counts, offs):
        hit = [e for e in range(len(counts)) if counts[e]]
        parts = x.split([counts[e] for e in hit])
        small = {i for i, e in enumerate(hit) if layout.native and counts[e] <= NATIVE_ROWS and x.device.type == "cpu"}
        ys: list[torch.Tensor | None] = [None] * len(hit)
        for i in small:  # few rows: the packed-code kernel, nothing decoded
            ys[i] = layout.apply(parts[i], hit[i], rows=rows_, cols=cols_)
        big = [i for i in range(len(hit)) if i not in small]
        for a in range(0, len(big), per):
            chunk = big[a : a + per]
            b = layout.decode_experts([hit[i] for i in chunk], rows_, cols_).transpose(1, 2)
            sub = [counts[hit[i]] for i in chunk]
            xs = torch.cat([parts[i] for i in chunk]) if len(chunk) > 1 else parts[chunk[0]]
            y = _gmm(b)(xs, sub, torch.tensor(list(accumulate(sub)), dtype=torch.int32, device=x.device))
            for i, piece in zip(chunk, y.split(sub)):
                ys[i] = piece
        return torch.cat(ys)

    return Grouped(_identity, rows)
