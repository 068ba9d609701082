"""Whitened truncated SVD of expert matrices (the per-expert low-rank baseline's maths): the rank split
that meets a parameter budget and the factorisation in float64, expert by expert, through the
eigendecomposition of the smaller Gram matrix of the whitened expert (:func:`whitened_svd`)."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from moecompress.methods.whitening import Whitener, gram_lower


def rank_split(out: int, inn: int, n: int, ratio: float, mode: str = "balanced") -> tuple[int, int]:
    """``(base, extra)``: every one of ``n`` experts gets rank ``base``, ``extra`` of them one more."""
    c = (1 - Fraction(repr(ratio))) * out * inn / (out + inn)  # exact: no 0.6 * x = 24.999… surprises
    if mode == "uniform" or n == 0:
        return math.floor(c), 0
    return divmod(math.floor(c * n), n)  # base = ⌊⌊c·n⌋ / n⌋ = ⌊c⌋


def rank_share(out: int, inn: int, before: int, n: int, ratio: float) -> tuple[int, int]:
    """``(base, extra)`` of ``ranks: balanced`` for ``n`` consecutive experts of a layer preceded by
    ``before`` decomposed experts (a chunk of the layer): their total rank is ``⌊c·(before + n)⌋ −
    ⌊c·before⌋``, so the chunks' totals add up to the whole layer's ``⌊c·M⌋`` whatever the chunking
    (``before = 0, n = M``: :func:`rank_split`)."""
    c = (1 - Fraction(repr(ratio))) * out * inn / (out + inn)
    if n == 0:
        return math.floor(c), 0
    total = math.floor(c * (before + n)) - math.floor(c * before)
    base = math.floor(c)
    return base, total - base * n  # 0 <= extra <= n: ⌊c⌋·n <= ⌊c·n⌋ <= total <= ⌊c·n⌋ + 1


SVD_WORKSPACE_COPIES = 4
"""float64 copies of one expert alive during :func:`factorize` (the expert, its whitened copy and the kept
factors with their temporaries), plus ``2·min(out, in)²`` for the Gram matrix and its eigenvectors: peak
resident growth beyond the kept factors measured 4.04 / 3.87 copies in all at ``[2048, 7168]`` /
``[7168, 2048]`` (DeepSeek-V3's gate / down), under this estimate's 4.57."""


def factorize_workspace(out: int, inn: int, experts: int) -> int:
    """Peak bytes :func:`factorize` allocates beyond its input and kept factors (one expert at a time)."""
    return (SVD_WORKSPACE_COPIES * out * inn + 2 * min(out, inn) ** 2) * 8 if experts else 0


def _signed(q: torch.Tensor) -> torch.Tensor:
    """Columns of ``q`` signed so that each one's entry of largest magnitude is positive."""
    top = q.abs().argmax(0)
    sign = torch.sign(q[top, torch.arange(q.shape[1], device=q.device)])
    return q * torch.where(sign == 0, torch.ones_like(sign), sign)


def whitened_svd(w: torch.Tensor, wh: Whitener, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(u [out, keep], v [keep, in], s [min(out, in)])`` in float64 for one expert ``w`` ``[out, in]``:
    ``u·v = A⁻¹ U_k S_k V_kᵀ B⁻¹`` with ``U S Vᵀ`` the SVD of the whitened ``A·w·B`` (``s`` all its
    singular values, descending). The smaller side's singular vectors are the eigenvectors of the smaller
    Gram matrix (``X Xᵀ`` or ``Xᵀ X``, float64), the other side's follow from them without un-whitening the
    larger side: with ``out ≤ in``, ``v = S_k⁻¹ U_kᵀ A w`` (``= (B⁻ᵀ V_k)ᵀ``), else ``u = w B V_k``
    (``= A⁻¹ U_k S_k``). The kept singular values' relative accuracy is that of the Gram matrix, ``eps ·
    (s₁/s_k)²``: float64 keeps it far below the factors' storage rounding. Columns are signed (the entry of
    largest magnitude positive) on the side found by ``eigh``."""
    wide = w.shape[0] <= w.shape[1]
    a_w = wh.whiten_out(w)  # A·w: v's source when out <= in
    x = wh.whiten_in(a_w)  # A·w·B
    g = gram_lower(x if wide else x.T)  # the lower triangle of X Xᵀ or Xᵀ X
    lam, q = torch.linalg.eigh(g)  # ascending; eigh reads the lower triangle
    s = lam.flip(0).clamp_min(0).sqrt()
    q = _signed(q.flip(1)[:, :keep])
    sk = s[:keep]
    tiny = float(s[0]) * torch.finfo(torch.float64).eps * max(w.shape) if len(s) else 0.0
    if wide:  # q = U_k
        u = wh.unwhiten_out(q * sk)
        v = (q.T @ a_w) / sk.clamp_min(max(tiny, 1e-300))[:, None]
    else:  # q = V_k
        u = wh.unwhiten_out(x @ q)
        v = wh.unwhiten_in(q).T
    return u, v, s


def kept_rank(out: int, inn: int, base: int) -> int:
    """The rank every expert's factors are computed at before each is cut to its own: ``⌊c⌋ + 1`` (one more
    than ``ranks: balanced`` gives every expert), at most ``min(out, in)``. It depends on the projection's shape
    and ratio alone, not on how many experts are decomposed together, so that a unit of a layer computes every
    expert's factors with the whole layer's products (:func:`factorize`)."""
    return min(base + 1, out, inn)


def factor_experts(w: torch.Tensor, wh: Whitener, keep: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per expert of ``w`` ``[M, out, in]``: ``(u [out, keep], v [keep, in])`` in ``w``'s dtype and its whitened
    singular values ``s`` (float64, descending), one expert at a time (:func:`whitened_svd`)."""
    out = []
    for m in range(w.shape[0]):
        u, v, s = whitened_svd(w[m], wh, keep)
        out.append((u.to(w.dtype), v.to(w.dtype), s))
    return out


def greedy_ranks(nxt: torch.Tensor, base: int, extra: int, keep: int) -> torch.Tensor:
    """The ranks of ``M`` experts (int64 ``[M]``): ``min(base, keep)`` each, and one more for the ``extra`` whose
    next whitened singular value ``nxt`` (``s[base]`` of each, ``[M]``) is largest (ties: the lower expert)."""
    ranks = torch.full((nxt.shape[0],), min(base, keep), dtype=torch.int64, device=nxt.device)
    if keep > base and extra:
        ranks[nxt.sort(descending=True, stable=True).indices[:extra]] += 1
    return ranks


def cut(factors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], ranks: list[int]
        ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:  # fmt: skip
    """Each expert's factors cut to its rank, and its relative whitened error ``‖W_w − Ŵ_w‖_F / ‖W_w‖_F``
    (float64 ``[M]``) from its singular values."""
    errs = []
    for (_, _, s), r in zip(factors, ranks):
        energy = s.pow(2)
        errs.append((energy[r:].sum() / energy.sum().clamp_min(1e-300)).sqrt())
    err = torch.stack(errs) if errs else torch.zeros(0, dtype=torch.float64)
    return [(u[:, :r].contiguous(), v[:r].contiguous()) for (u, v, _), r in zip(factors, ranks)], err


def factorize(
    w: torch.Tensor, wh: Whitener, base: int, extra: int = 0
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Whitened truncated SVD of ``w`` ``[M, out, in]``: per expert ``(u [out, r], v [r, in])`` in
    ``w``'s dtype, and the relative whitened error ``‖W_w − Ŵ_w‖_F / ‖W_w‖_F`` per expert. Every expert's
    factors are computed at :func:`kept_rank` in float64, one expert at a time (:func:`factor_experts`), then
    cut to ``base``, the ``extra`` experts whose next singular value is largest to ``base + 1``
    (:func:`greedy_ranks`)."""
    keep = kept_rank(*w.shape[1:], base)
    factors = factor_experts(w, wh, keep)
    nxt = torch.stack([s[min(base, len(s) - 1)] for _, _, s in factors]) if factors else torch.zeros(0)
    return cut(factors, greedy_ranks(nxt, base, extra, keep).tolist())
