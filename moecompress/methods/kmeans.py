"""Scalar (1-D) k-means of many rows at once: k-means++ seeding, Lloyd iterations, exact 1-D assignment
by binary search between sorted centroids. What every codebook row of ``codequant`` goes through."""

from __future__ import annotations

import torch


def nearest(values: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid for each value: ``values`` ``[N, n]``, ``centroids`` ``[N, K]``
    (any order) -> int64 ``[N, n]``. Exact (binary search between sorted centroids' midpoints)."""
    c, order = centroids.sort(dim=-1)
    mids = (c[:, 1:] + c[:, :-1]) / 2
    pos = torch.searchsorted(mids.contiguous(), values.contiguous())
    return order.gather(1, pos)


def kmeans_1d(
    values: torch.Tensor, k: int, *, iters: int = 300, tol: float = 1e-6, seed: int = 42
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar k-means of every row of ``values`` ``[N, n]`` into ``k`` centroids: k-means++ seeding
    (D² sampling from a generator seeded with ``seed``), then Lloyd iterations until no centroid moves
    by more than ``tol`` times the row's range. Returns ``(centroids [N, k], assignment [N, n] int64)``.
    A row with at most ``k`` distinct values is reproduced exactly."""
    v = values.double()
    n_rows, n = v.shape
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(n_rows)
    first = torch.randint(0, n, (n_rows,), generator=g)
    cents = [v[rows, first]]
    d2 = (v - cents[0][:, None]) ** 2
    for _ in range(1, k):
        w = d2.clone()
        done = w.sum(1) <= 0  # every value already a centroid: any pick is a duplicate
        w[done] = 1.0
        pick = torch.multinomial(w.float(), 1, generator=g)[:, 0]
        c = v[rows, pick]
        cents.append(c)
        d2 = torch.minimum(d2, (v - c[:, None]) ** 2)
    c = torch.stack(cents, 1)
    scale = (v.amax(1) - v.amin(1)).clamp_min(1e-30)
    for _ in range(iters):
        a = nearest(v, c)
        sums = torch.zeros_like(c).scatter_add_(1, a, v)
        counts = torch.zeros_like(c).scatter_add_(1, a, torch.ones_like(v))
        new = torch.where(counts > 0, sums / counts.clamp_min(1), c)
        moved = float(((new - c).abs().amax(1) / scale).max()) if n_rows else 0.0
        c = new
        if moved <= tol:
            break
    return c.to(values.dtype), nearest(v, c)
