"""Reconstruction metrics: relative error and SQNR, in float64, chunked so memory stays bounded."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

_CHUNK = 1 << 22  # elements per float64 chunk


def chunks(*tensors: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    """Aligned float64 chunks of the flattened tensors (on the first one's device): bounded memory."""
    flat = [t.detach().reshape(-1) for t in tensors]
    for start in range(0, flat[0].numel(), _CHUNK):
        yield [f[start : start + _CHUNK].to(device=flat[0].device, dtype=torch.float64) for f in flat]


def _error_sums(reference: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """``(sum(ref²), sum((ref-approx)²))`` in float64, chunked so memory stays bounded."""
    if reference.shape != approx.shape:
        raise ValueError(
            f"shapes differ: reference {list(reference.shape)}, approximation {list(approx.shape)}"
        )
    if reference.is_meta or approx.is_meta:
        raise ValueError("cannot measure errors on meta tensors (dry run); measure on real weights")
    signal = noise = 0.0
    for r, a in chunks(reference, approx):
        signal += float(r.square().sum())
        noise += float((r - a).square().sum())
    return signal, noise


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """``10·log10(Σref² / Σ(ref-approx)²)``; ``inf`` when identical, ``-inf`` when ``ref`` is zero."""
    signal, noise = _error_sums(reference, approx)
    if noise == 0.0:
        return math.inf
    ratio = signal / noise
    if math.isnan(ratio) or math.isinf(ratio):
        return ratio
    return -math.inf if ratio == 0.0 else 10.0 * math.log10(ratio)


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """``‖ref-approx‖_F / ‖ref‖_F``; 0 when identical, ``inf`` when ``ref`` is zero and ``approx`` not."""
    signal, noise = _error_sums(reference, approx)
    if noise == 0.0:
        return 0.0
    return math.inf if signal == 0.0 else math.sqrt(noise / signal)
