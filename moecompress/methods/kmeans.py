"""Scalar (1-D) k-means of many rows at once: k-means++ seeding, Lloyd iterations, exact 1-D assignment.
What every codebook row of ``codequant`` goes through.

Every row is its own k-means problem, solved for all rows of a chunk at once on the device of the
input (no Python loop over rows). In one dimension a cluster of the nearest-centroid assignment is a
contiguous run of the row's *sorted* values, cut at the midpoints between sorted centroids, so each row
is sorted once and every Lloyd step only searches the ``k − 1`` midpoints in it (``O(k log n)`` per row)
and reads the cluster sums off the row's prefix sums, instead of assigning all ``n`` values
(``O(n log k)``). The last step recomputes the centroids as exact means of their values (a plain
scatter-add), so a row with at most ``k`` distinct values is reproduced exactly.
"""

from __future__ import annotations

import torch

CHUNK_VALUES = 1 << 22
"""Values clustered at once (about 10 float64 copies of a chunk are alive: ~340 MB)."""


def nearest(values: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid for each value: ``values`` ``[N, n]``, ``centroids`` ``[N, K]``
    (any order) -> int64 ``[N, n]``. Exact (binary search between sorted centroids' midpoints; a value
    on a midpoint goes to the lower centroid)."""
    c, order = centroids.sort(dim=-1)
    mids = (c[:, 1:] + c[:, :-1]) / 2
    pos = torch.searchsorted(mids.contiguous(), values.contiguous())
    return order.gather(1, pos)


def sorted_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``values`` ``[N, n]`` sorted ascending, and the permutation that sorts it."""
    return values.sort(dim=1)


def assign_sorted(
    sv: torch.Tensor, perm: torch.Tensor, centroids: torch.Tensor, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """:func:`nearest` of the values ``sv`` (rows sorted ascending; ``perm`` their original positions,
    as :func:`sorted_rows` gives) -> ``[N, n]`` of ``dtype`` in the original order; identical to
    ``nearest(values, centroids)``, in ``O(n + k log n)`` per row instead of a search per value: the
    sorted values of a cluster are a run between two cuts, so the codes in sorted order are each
    centroid's index repeated over its run, then put back in the original order (``uint8`` codes move an
    eighth of int64's bytes)."""
    c, order = centroids.sort(dim=-1)
    n_rows, n = sv.shape
    bounds = torch.searchsorted(sv, ((c[:, 1:] + c[:, :-1]) / 2).to(sv.dtype).contiguous(), right=True)
    edges = torch.cat([bounds.new_zeros(n_rows, 1), bounds, bounds.new_full((n_rows, 1), n)], 1)
    runs = order.to(dtype).flatten().repeat_interleave(edges.diff(dim=1).flatten(), output_size=n_rows * n)
    return torch.empty(n_rows, n, dtype=dtype, device=sv.device).scatter_(1, perm, runs.view(n_rows, n))


class SortedRows:
    """Rows ``[N, n]`` sorted once, for many :func:`nearest` calls against changing centroids (CodeQuant's
    reassignment after every fine-tuning step): the sorted values in their dtype and the sorting
    permutation in the narrowest integer type that holds ``n``; :meth:`assign` works ``chunk_values``
    values at a time. ``code_dtype``: the integer type of the codes :meth:`assign` and :meth:`update`
    return (``uint8`` holds up to 256 centroids in an eighth of int64's memory)."""

    def __init__(
        self, values: torch.Tensor, chunk_values: int = CHUNK_VALUES, code_dtype: torch.dtype = torch.int64
    ) -> None:
        n_rows, n = values.shape
        idx = torch.int16 if n <= torch.iinfo(torch.int16).max else torch.int32
        self.step = max(1, chunk_values // max(n, 1))
        self.code_dtype = code_dtype
        self.sv = torch.empty_like(values)
        self.perm = torch.empty(n_rows, n, dtype=idx, device=values.device)
        for a in range(0, n_rows, self.step):
            sv, perm = sorted_rows(values[a : a + self.step])
            self.sv[a : a + self.step], self.perm[a : a + self.step] = sv, perm.to(idx)

    @classmethod
    def presorted(
        cls, sv: torch.Tensor, perm: torch.Tensor, chunk_values: int = CHUNK_VALUES,
        code_dtype: torch.dtype = torch.int64,
    ) -> SortedRows:  # fmt: skip
        """From rows already sorted (``sv``, in the values' dtype) and their permutation ``perm`` (as
        :func:`kmeans_1d` ``keep_sorted`` gives): no second sort."""
        self = cls.__new__(cls)
        self.sv, self.perm, self.step = sv, perm, max(1, chunk_values // max(sv.shape[1], 1))
        self.code_dtype = code_dtype
        return self

    def assign(self, centroids: torch.Tensor) -> torch.Tensor:
        """``nearest(values, centroids)`` (bit-identical), ``[N, n]`` of ``code_dtype``; kept (with the
        cuts of ``centroids``) for :meth:`update`."""
        out = torch.empty(self.sv.shape, dtype=self.code_dtype, device=self.sv.device)
        for a in range(0, self.sv.shape[0], self.step):
            b = a + self.step
            out[a:b] = assign_sorted(self.sv[a:b], self.perm[a:b].long(), centroids[a:b], self.code_dtype)
        self.codes, (self.bounds, self.order) = out, self._cuts(centroids)
        return out

    def _cuts(self, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each row's sorted values are cut by the midpoints of its sorted centroids (the first
        position of each cluster after the first), and the centroids' sorting order."""
        c, order = centroids.sort(dim=-1)
        mids = ((c[:, 1:] + c[:, :-1]) / 2).to(self.sv.dtype).contiguous()
        return torch.searchsorted(self.sv, mids, right=True), order

    def update(self, centroids: torch.Tensor) -> torch.Tensor:
        """:meth:`assign` of new ``centroids`` (bit-identical), computed from the last one: only the values
        between a cut's old and new position change cluster (``O(k log n)`` per row plus the values that
        move), and rows whose centroids changed order (or whose moving ranges overlap) are reassigned
        whole. Updates the codes returned
        by the last :meth:`assign` in place and returns them."""
        if not hasattr(self, "codes"):
            return self.assign(centroids)
        bounds, order = self._cuts(centroids)
        n_rows, n = self.sv.shape
        lo, hi = torch.minimum(bounds, self.bounds), torch.maximum(bounds, self.bounds)
        # a row whose centroids changed order, or whose moved ranges overlap, is reassigned whole
        whole = (order != self.order).any(1) | (hi[:, :-1] > lo[:, 1:]).any(1)
        lengths = (hi - lo).masked_fill_(whole[:, None], 0).flatten()
        total = int(lengths.sum())
        if total > n_rows * n // 4:  # centroids moved far: a full pass is cheaper
            return self.assign(centroids)
        if total:  # a value between cut j's old and new position: cluster j + (new cut <= its position)
            cuts = bounds.shape[1]
            # each moving value's (row, cut) range, expanded once; the rest is read through it
            seg = torch.repeat_interleave(torch.arange(n_rows * cuts, device=lo.device), lengths, output_size=total)
            first = (lengths.cumsum(0) - lengths)[seg]
            pos = lo.flatten()[seg] + torch.arange(total, device=lo.device) - first
            row, cut = seg // cuts, seg % cuts
            rank = cut + (bounds.flatten()[seg] <= pos)
            dest = row * n + self.perm.view(-1)[row * n + pos].long()
            self.codes.view(-1)[dest] = order.view(-1)[row * (cuts + 1) + rank].to(self.code_dtype)
        redo = whole.nonzero()[:, 0]
        if len(redo):
            self.codes[redo] = assign_sorted(
                self.sv[redo], self.perm[redo].long(), centroids[redo], self.code_dtype
            )
        self.bounds, self.order = bounds, order
        return self.codes


def _seed(v: torch.Tensor, k: int, u: torch.Tensor) -> torch.Tensor:
    """k-means++ (D² sampling) of each row of ``v`` ``[N, n]`` by inverse CDF of the uniforms ``u``
    ``[k, N]``: ``[N, k]`` centroids. A pick always has positive D² unless every value is already a
    centroid (then any pick is a duplicate). D² is kept in float32 (it only draws the seeds)."""
    n = v.shape[1]
    pick = (u[0] * n).long().clamp_max(n - 1)
    c = v.gather(1, pick[:, None])
    cents = [c]
    vf = v.float()
    d2 = (vf - c.float()).square_()
    for j in range(1, k):
        cs = d2.cumsum(1)
        t = (u[j].float() * cs[:, -1])[:, None]
        pick = torch.searchsorted(cs, t, right=True).clamp_max_(n - 1)
        bad = (d2.gather(1, pick) <= 0)[:, 0]  # rounding at the top end of the CDF
        if bool(bad.any()):
            pick[bad] = d2[bad].argmax(1, keepdim=True)
        c = v.gather(1, pick)
        cents.append(c)
        torch.minimum(d2, (vf - c.float()).square_(), out=d2)
    return torch.cat(cents, 1)


def _lloyd(
    v: torch.Tensor, c: torch.Tensor, iters: int, tol: float, code_dtype: torch.dtype = torch.int64,
    presorted: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lloyd iterations of the rows of ``v`` from centroids ``c``, each row until none of its centroids
    moves by more than ``tol`` times its range; then exact means. ``(centroids, assignment, sorted
    rows, their permutation)``; ``presorted``: the rows of ``v`` already sorted and their permutation.
    Rows that converged leave the working set (compacted whenever it halves)."""
    sv, perm = sorted_rows(v) if presorted is None else presorted
    n_rows, n = sv.shape
    cs = torch.cat([sv.new_zeros(n_rows, 1), sv.cumsum(1)], 1)
    scale = (sv[:, -1] - sv[:, 0]).clamp_min(1e-30)
    c = c.sort(dim=1).values
    rows = torch.arange(n_rows, device=v.device)  # working set: rows of sv/cs/c still iterating
    w_sv, w_cs, w_c, w_scale = sv, cs, c.clone(), scale
    active = torch.ones(n_rows, dtype=torch.bool, device=v.device)
    for _ in range(iters):
        m = len(rows)
        bounds = torch.searchsorted(w_sv, ((w_c[:, 1:] + w_c[:, :-1]) / 2).contiguous(), right=True)
        lo = torch.cat([bounds.new_zeros(m, 1), bounds], 1)
        hi = torch.cat([bounds, bounds.new_full((m, 1), n)], 1)
        counts = hi - lo
        new = torch.where(counts > 0, (w_cs.gather(1, hi) - w_cs.gather(1, lo)) / counts.clamp_min(1), w_c)
        moved = (new - w_c).abs().amax(1) / w_scale > tol
        w_c = torch.where(active[:, None], new, w_c)
        if not bool((counts > 0).all()):  # means of consecutive runs of sorted values are sorted already;
            w_c = w_c.sort(dim=1).values  # an empty cluster keeps its old centroid, which may break the order
        active &= moved
        left = int(active.sum())
        if left == 0:
            break
        if 2 * left <= m:
            c[rows] = w_c
            keep = active.nonzero()[:, 0]
            rows, w_sv, w_cs, w_c, w_scale = rows[keep], w_sv[keep], w_cs[keep], w_c[keep], w_scale[keep]
            active = torch.ones(left, dtype=torch.bool, device=v.device)
    c[rows] = w_c
    # exact means of the final clusters (no prefix-sum rounding)
    a = assign_sorted(sv, perm, c, code_dtype).long()
    sums = torch.zeros_like(c).scatter_add_(1, a, v)
    counts = torch.zeros_like(c).scatter_add_(1, a, v.new_ones(()).expand_as(v))
    c = torch.where(counts > 0, sums / counts.clamp_min(1), c)
    return c, assign_sorted(sv, perm, c, code_dtype), sv, perm


def kmeans_1d(
    values: torch.Tensor, k: int, *, iters: int = 300, tol: float = 1e-6, seed: int = 42,
    chunk_values: int = CHUNK_VALUES, keep_sorted: bool = False, code_dtype: torch.dtype = torch.int64,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, SortedRows]:  # fmt: skip
    """Scalar k-means of every row of ``values`` ``[N, n]`` into ``k`` centroids: k-means++ seeding
    (D² sampling driven by uniforms from a CPU generator seeded with ``seed``, one set per row, so the
    result does not depend on the chunking or the device), then Lloyd iterations, each row until none
    of its centroids moves by more than ``tol`` times the row's range, and a last exact-mean update.
    Rows are processed ``chunk_values // n`` at a time (bounded memory), in float64, on ``values``'
    device. Returns ``(centroids [N, k] ascending, assignment [N, n] of code_dtype)``. A row with at most ``k``
    distinct values is reproduced exactly. ``keep_sorted``: also return the rows' :class:`SortedRows`
    (the sort the Lloyd steps made, kept in ``values``' dtype: no second sort for a reassignment).
    ``uniforms``: the seeding's uniforms ``[k, N]`` (float64) instead of ``seed``'s (a caller whose rows
    must not depend on which other rows share the call: :func:`expert_uniforms`)."""
    n_rows, n = values.shape
    dev = values.device
    if uniforms is not None:
        if tuple(uniforms.shape) != (k, n_rows):
            raise ValueError(f"kmeans_1d: uniforms {tuple(uniforms.shape)} != ({k}, {n_rows})")
        u = uniforms.to(dev, torch.float64)
    else:
        u = torch.rand(k, n_rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dev)
    cents = torch.empty(n_rows, k, dtype=values.dtype, device=dev)
    codes = torch.empty(n_rows, n, dtype=code_dtype, device=dev)
    step = max(1, chunk_values // max(n, 1))
    if keep_sorted:
        idx = torch.int16 if n <= torch.iinfo(torch.int16).max else torch.int32
        sv_all = torch.empty_like(values)
        perm_all = torch.empty(n_rows, n, dtype=idx, device=dev)
    for a in range(0, n_rows, step):
        # sorted in the values' own dtype (half of float64's bytes), then widened: the widening is exact and
        # monotone, so these are the float64 rows sorted (tied values may swap places: the same codes)
        sv, perm = sorted_rows(values[a : a + step])
        v, sv = values[a : a + step].double(), sv.double()
        c, codes[a : a + step], sv, perm = _lloyd(v, _seed(v, k, u[:, a : a + step]), iters, tol, code_dtype,
                                                  presorted=(sv, perm))  # fmt: skip
        cents[a : a + step] = c.to(values.dtype)
        if keep_sorted:  # float64 of float32 values: the cast back is exact
            sv_all[a : a + step], perm_all[a : a + step] = sv, perm.to(idx)
    if keep_sorted:
        return cents, codes, SortedRows.presorted(sv_all, perm_all, chunk_values, code_dtype)
    return cents, codes


def expert_uniforms(k: int, rows: int, seeds: list[int]) -> torch.Tensor:
    """k-means++ uniforms ``[k, len(seeds) * rows]`` for ``rows`` rows of each of several experts, each
    expert's from its own generator (``seeds``): an expert's k-means does not depend on which experts
    share the call (a whole layer, or a chunk of its experts)."""
    if not seeds:
        return torch.empty(k, 0, dtype=torch.float64)
    return torch.cat([torch.rand(k, rows, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                      for s in seeds], 1)  # fmt: skip
