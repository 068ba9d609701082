"""Low-rank structure of a layer's experts (MoLR-MoG-style diagnostics) and the TD-MoE vs per-expert SVD
prediction built on it.

MoLR-MoG ("mixture subspace of low-rank mixture of Gaussians", seed abstract in ``shared/seeds/``)
models data as a union of ``K`` linear subspaces; a layer's experts fit TD-MoE's shared basis when their
(whitened) subspaces coincide and per-expert SVD when they do not. For a stack of whitened expert
matrices ``W_e`` ``[M, out, in]`` (``W_e = A·W·B``, :mod:`moecompress.methods.whitening`):

- **effective rank** (Roy & Vetterli 2007): ``erank(W) = exp(−Σ_i p_i log p_i)``, ``p_i = σ_i / Σ_j σ_j``;
  a rank-``r`` matrix with equal singular values has ``erank = r`` exactly.
- **subspace overlap** (principal angles θ_j between the top-``k`` left, resp. right, singular
  subspaces of two experts): ``overlap = (1/k) Σ_j cos² θ_j = ‖U_eᵀU_f‖_F² / k`` ∈ [0, 1]; 1 when the
  subspaces coincide, ``k/out`` in expectation for random ones.
- **residual energy at equal parameters** (the whitened output error each method leaves, exactly):
  per-expert SVD at ``ratio`` keeps ranks ``⌊c⌋`` (+1 for the ``R mod M`` largest next singular values,
  :func:`moecompress.methods.svd.rank_split`), residual ``Σ_e Σ_{i>r_e} σ_{e,i}² / Σ_e ‖W_e‖_F²``; the
  shared Tucker basis at the ranks ``(r2, r3)`` of :func:`moecompress.methods.tucker.tucker_ranks`
  (HOSVD, expert mode not truncated) keeps ``P_out W_e P_in`` with ``P_out = U₂U₂ᵀ`` the top-``r2``
  eigenvectors of ``Σ_e W_e W_eᵀ`` and ``P_in`` the top-``r3`` of ``Σ_e W_eᵀ W_e``: residual
  ``1 − Σ_e ‖U₂ᵀ W_e U₃‖_F² / Σ_e ‖W_e‖_F²``. These equal the relative squared whitened errors the
  ``svd_experts`` and ``tdmoe`` (``method: hosvd``) passes produce (pooled over experts).

The prediction for a layer is the method with the smaller summed residual over gate, up and down.
"""

from __future__ import annotations

import math

import torch

from moecompress.errors import MethodError
from moecompress.methods.svd import rank_split
from moecompress.methods.tucker import tucker_ranks


def singular_values(w: torch.Tensor) -> torch.Tensor:
    """``[M, min(out, in)]`` singular values of each (whitened, float64) ``w[e]``."""
    return torch.linalg.svdvals(w.double())


def effective_rank(s: torch.Tensor) -> torch.Tensor:
    """``exp(entropy(σ / Σσ))`` of each row of singular values ``s`` ``[..., r]`` (0 for a zero matrix)."""
    tot = s.sum(-1, keepdim=True)
    p = s / tot.clamp_min(1e-300)
    h = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return torch.where(tot[..., 0] > 0, h.exp(), torch.zeros_like(h))


def overlap_matrix(w: torch.Tensor, k: int, side: str) -> torch.Tensor:
    """``[M, M]`` mean ``cos²`` of the principal angles between the top-``k`` ``side`` (``out`` = left,
    ``in`` = right) singular subspaces of every pair of experts of ``w`` ``[M, out, in]``."""
    u, _, vh = torch.linalg.svd(w.double(), full_matrices=False)
    basis = u[:, :, :k] if side == "out" else vh[:, :k].transpose(1, 2)  # [M, d, k]
    k = basis.shape[-1]
    rows = [torch.einsum("dk,bdl->bkl", b, basis).pow(2).sum((-1, -2)) for b in basis]  # O(M·d·k²) memory
    return torch.stack(rows) / max(k, 1)


def svd_residual(s: torch.Tensor, out: int, inn: int, ratio: float) -> float:
    """Relative residual energy of per-expert SVD with balanced ranks at ``ratio`` (``s`` ``[M, r]``)."""
    m = s.shape[0]
    base, extra = rank_split(out, inn, m, ratio)
    keep = min(base, s.shape[1])
    ranks = torch.full((m,), keep, dtype=torch.int64)
    if extra and base < s.shape[1]:
        ranks[s[:, base].sort(descending=True, stable=True).indices[:extra]] += 1
    e = s.pow(2)
    kept = torch.arange(s.shape[1])[None, :] < ranks[:, None]
    return float(e.masked_fill(kept, 0).sum() / e.sum().clamp_min(1e-300))


def tucker_residual(w: torch.Tensor, ratio: float, grams=None) -> tuple[float, tuple[int, int]]:
    """Relative residual energy of the HOSVD Tucker basis (expert mode kept) at ``ratio``, and ``(r2, r3)``.
    ``grams``: precomputed eigendecompositions of ``Σ W Wᵀ`` and ``Σ Wᵀ W`` (see :func:`mode_bases`)."""
    m, out, inn = w.shape
    _, r2, r3, _ = tucker_ranks(m, out, inn, ratio)
    u_out, u_in = grams if grams is not None else mode_bases(w)
    wd = w.double()
    kept = torch.einsum("or,moi,is->mrs", u_out[:, :r2], wd, u_in[:, :r3]).pow(2).sum()
    return float(1 - kept / wd.pow(2).sum().clamp_min(1e-300)), (r2, r3)


def mode_bases(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors (largest first) of ``Σ_e W_e W_eᵀ`` ``[out, out]`` and ``Σ_e W_eᵀ W_e`` ``[in, in]``: the
    HOSVD factors of the output and input modes."""
    wd = w.double()
    go = torch.einsum("moi,mpi->op", wd, wd)
    gi = torch.einsum("moi,moj->ij", wd, wd)
    return torch.linalg.eigh(go)[1].flip(-1), torch.linalg.eigh(gi)[1].flip(-1)


def structure_workspace(m: int, out: int, inn: int, itemsize: int) -> int:
    """Peak bytes of one projection's diagnostics (``expert_structure``) beyond the layer: the ``m`` experts
    copied in the weights' dtype (``itemsize`` bytes) and whitened in float64, then the largest of
    :func:`overlap_matrix`'s SVDs: LAPACK's float64 copy of the stack and the singular vectors ``U``
    ``[m, out, k]`` and ``Vᴴ`` ``[m, k, in]`` (``k = min(out, in)``; :func:`singular_values` and
    :func:`tucker_residual` hold less)."""
    stack, k = m * out * inn, min(out, inn)
    return stack * itemsize + 8 * (2 * stack + m * k * (out + inn))


def projection_structure(w: torch.Tensor, ratios: tuple[float, ...]) -> dict:
    """Diagnostics of one projection's whitened stack ``w`` ``[M, out, in]``: effective ranks per expert,
    mean pairwise overlaps (output and input sides, at ``k = round(mean erank)``), and per ratio the
    residual of both methods (``None`` where a method cannot meet the ratio)."""
    m, out, inn = w.shape
    s = singular_values(w)
    er = effective_rank(s)
    k = max(1, min(round(float(er.mean())), min(out, inn)))
    off = ~torch.eye(m, dtype=torch.bool)
    ov = {side: float(overlap_matrix(w, k, side)[off].mean()) if m > 1 else 1.0 for side in ("out", "in")}
    bases = mode_bases(w)
    by_ratio = {}
    for r in ratios:
        svd = svd_residual(s, out, inn, r) if rank_split(out, inn, m, r)[0] >= 1 else None
        try:
            tuck, ranks = tucker_residual(w, r, bases)
        except MethodError:
            tuck, ranks = None, None
        by_ratio[r] = {"svd_experts": svd, "tdmoe": tuck, "tucker_ranks": ranks}
    return {"effective_rank": er.tolist(), "overlap_k": k, "overlap_out": ov["out"], "overlap_in": ov["in"],
            "residual": by_ratio}  # fmt: skip


def predict(residuals: dict[str, dict], ratio: float) -> tuple[str, dict[str, float]]:
    """``(winner, {method: summed residual over projections})`` at ``ratio`` from
    :func:`projection_structure` results per projection; a method that cannot meet it scores ``inf``."""
    tot = {}
    for method in ("tdmoe", "svd_experts"):
        vals = [p["residual"][ratio][method] for p in residuals.values()]
        tot[method] = math.inf if any(v is None for v in vals) else sum(vals)
    if all(math.isinf(v) for v in tot.values()):
        raise MethodError(f"neither tdmoe nor svd_experts can meet ratio={ratio} for these shapes")
    return min(tot, key=lambda k: (tot[k], k != "tdmoe")), tot


def crossover(residuals: dict[str, dict]) -> float | None:
    """The smallest ratio of the grid at which ``svd_experts`` stops winning (``None``: never)."""
    for r in sorted(next(iter(residuals.values()))["residual"]):
        try:
            if predict(residuals, r)[0] == "tdmoe":
                return r
        except MethodError:
            continue
    return None


def allocate(costs: dict[str, dict[float, tuple[float, int]]], target: float) -> dict[str, float]:
    """Per-projection ratios minimising the summed residual with the stored parameters at most ``target``.

    ``costs[proj][ratio] = (residual, stored parameters)``; exhaustive over the (small) grid product.
    Raises :class:`MethodError` when no combination fits."""
    names = list(costs)
    best: tuple[float, float, dict[str, float]] | None = None

    def walk(i: int, chosen: dict[str, float], res: float, params: int) -> None:
        nonlocal best
        if params > target:
            return
        if i == len(names):
            cand = (res, -params, dict(chosen))
            if best is None or cand[:2] < best[:2]:
                best = cand
            return
        for r, (e, p) in sorted(costs[names[i]].items()):
            chosen[names[i]] = r
            walk(i + 1, chosen, res + e, params + p)
        chosen.pop(names[i], None)

    walk(0, {}, 0.0, 0)
    if best is None:
        raise MethodError(f"no per-projection ranks fit {target:.0f} parameters; lower the ratio")
    return best[2]
