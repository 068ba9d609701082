"""Whitened truncated SVD of expert matrices (the per-expert low-rank baseline's maths): the rank split
that meets a parameter budget and the chunked factorisation in float64."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from moecompress.methods.whitening import Whitener


def rank_split(out: int, inn: int, n: int, ratio: float, mode: str = "balanced") -> tuple[int, int]:
    """``(base, extra)``: every one of ``n`` experts gets rank ``base``, ``extra`` of them one more."""
    c = (1 - Fraction(repr(ratio))) * out * inn / (out + inn)  # exact: no 0.6 * x = 24.999… surprises
    if mode == "uniform" or n == 0:
        return math.floor(c), 0
    return divmod(math.floor(c * n), n)  # base = ⌊⌊c·n⌋ / n⌋ = ⌊c⌋


SVD_CHUNK = 16
"""Experts factorised at once by :func:`factorize`."""

SVD_WORKSPACE_COPIES = 5
"""float64 copies of one chunk of experts alive during :func:`factorize`'s SVD (the whitened matrices,
LAPACK's copy and work arrays, the factors before truncation): measured 4.7 at [16, 768, 2048]."""


def factorize_workspace(out: int, inn: int, experts: int) -> int:
    """Peak bytes :func:`factorize` allocates beyond its input and kept factors."""
    return SVD_WORKSPACE_COPIES * min(SVD_CHUNK, experts) * out * inn * 8


def factorize(
    w: torch.Tensor, wh: Whitener, base: int, extra: int = 0, chunk: int = SVD_CHUNK
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Whitened truncated SVD of ``w`` ``[M, out, in]``: per expert ``(u [out, r], v [r, in])`` in
    ``w``'s dtype, and the relative whitened error ``‖W_w − Ŵ_w‖_F / ‖W_w‖_F`` per expert. Works on
    ``chunk`` experts at a time in float64; only the kept factors (in ``w``'s dtype) accumulate."""
    keep = min(base + (1 if extra else 0), *w.shape[1:])
    us, vs, ss = [], [], []
    for a in range(0, w.shape[0], chunk):
        u_, s, vh = torch.linalg.svd(wh.whiten(w[a : a + chunk]), full_matrices=False)  # float64
        us.append(wh.unwhiten_out(u_[:, :, :keep] * s[:, None, :keep]).to(w.dtype))  # [m, out, keep]
        vs.append(wh.unwhiten_in(vh[:, :keep].transpose(1, 2)).transpose(1, 2).to(w.dtype))  # [m, keep, in]
        ss.append(s)
    s = torch.cat(ss)
    ranks = torch.full((w.shape[0],), min(base, keep), dtype=torch.int64, device=s.device)
    if keep > base:  # the extra ranks go where the next singular value is largest
        ranks[s[:, base].sort(descending=True, stable=True).indices[:extra]] += 1
    energy = s.pow(2)
    kept = torch.arange(s.shape[1], device=s.device)[None, :] < ranks[:, None]
    err = (energy.masked_fill(kept, 0).sum(1) / energy.sum(1).clamp_min(1e-300)).sqrt()
    u, v = torch.cat(us), torch.cat(vs)
    pairs = [(u[m, :, :r].contiguous(), v[m, :r].contiguous()) for m, r in enumerate(ranks.tolist())]
    return pairs, err
