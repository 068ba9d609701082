"""The Gram matrix of experts' flattened weights, and points that have it: ``similarity: weight`` of the
merging passes without an ``[E, P]`` float32 copy of the layer (``P`` an expert's weights: 44 M at
DeepSeek-V3's widths, 45 GB for 256 experts), and on a layer held by chunks of experts, where the Gram is
made block by block from every pair of chunks (:func:`moecompress.engine.unit_work.gather`).

``G_ij = Σ_p ⟨W_p[i], W_p[j]⟩`` over the projections ``p``, each flattened; made in float32 products of
``GRAM_COLS`` columns at a time, added in float64. Pairwise cosine and Euclidean distances, and Ward's
criterion, depend only on ``G``: :func:`gram_points` returns ``[E, E]`` points ``X`` with ``X Xᵀ = G``, on
which :func:`~moecompress.methods.merging.pairwise_distance` and ``ward_linkage`` give what they give on the
flattened weights (to round-off)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

GRAM_COLS = 1 << 16
"""Columns of each float32 block product (``[n, GRAM_COLS]`` float32 per operand: 256 KB per expert)."""


def gram_block(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """``Σ_k a_k b_kᵀ`` float64 ``[n_a, n_b]``, each ``a_k`` ``[n_a, ...]`` and ``b_k`` ``[n_b, ...]``
    flattened after the first dimension (``b`` ``None``: ``a`` with itself, symmetric). Float32 products
    of :data:`GRAM_COLS` columns, added in float64."""
    same = b is None
    b = a if b is None else b
    if len(a) != len(b):
        raise ValueError(f"gram_block: {len(a)} tensors against {len(b)}")
    out = torch.zeros(a[0].shape[0], b[0].shape[0], dtype=torch.float64)
    for x, y in zip(a, b, strict=True):
        x, y = x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1)
        if x.shape[1] != y.shape[1]:
            raise ValueError(f"gram_block: {x.shape[1]} columns against {y.shape[1]}")
        for c in range(0, x.shape[1], GRAM_COLS):
            xb = x[:, c : c + GRAM_COLS].float()
            yb = xb if same else y[:, c : c + GRAM_COLS].float()
            out += (xb @ yb.T).double()
    return (out + out.T) / 2 if same else out


def gram_points(gram: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` float64 points ``X`` with ``X Xᵀ = G`` (``G`` symmetrised, its eigendecomposition, negative
    eigenvalues of round-off clamped to 0): each row's norm and every pair's inner product are ``G``'s, so
    cosine and Euclidean distances are those of the vectors ``G`` was made from."""
    g = gram.detach().double()
    lam, u = torch.linalg.eigh((g + g.T) / 2)
    return u * lam.clamp_min(0).sqrt()


def gram_bytes(n: int) -> int:
    """Bytes :func:`gram_points` and the Gram hold at once for ``n`` experts (float64: the Gram, its
    symmetrised copy, the eigenvectors and the points)."""
    return 4 * 8 * n * n
