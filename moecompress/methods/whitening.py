"""Data-aware whitening for weight decompositions (``tdmoe``, ``svd_experts``).

A projection ``W`` ``[out, in]`` is decomposed as ``A·W·B`` (whitened), truncated, and un-whitened
(``Ŵ = A⁻¹·Ŵ_w·B⁻¹``); in factor form only the outer factors change (``U_out' = A⁻¹U_out``,
``U_in' = B⁻ᵀU_in``), so inference costs nothing extra.

- **input** (``B``): with ``Σ_in = E[x xᵀ]`` of the projection's input, ``B = L`` where ``L Lᵀ = Σ_in``
  (Cholesky; ``form: chol``, default) makes ``‖(W − Ŵ)L‖_F² = E‖(W − Ŵ)x‖²``, the output error on the
  calibration data (SVD-LLM). ``form: inverse`` uses ``B = Σ_in^{-1/2}``, the form TD-MoE's paper text
  gives.
- **output** (``A``): with ``Σ_out = E[g gᵀ]`` of the loss gradient at the projection's output,
  ``A = Lᵀ`` (``L Lᵀ = Σ_out``) weights output directions by how much the loss cares about them
  (``E[(gᵀΔW x)²] ≈ tr(Σ_out ΔW Σ_in ΔWᵀ)`` if g and x are independent).

Eigenvalues are clamped *relative* to their mean (``max(λ, eps·mean λ)``, ``eps = 1e-3``) before the
factorisation; TD-MoE's code clamps at an absolute 1e-3, which would flatten gradient covariances
(whose scale is ~1e-8) to the identity. Any square root gives the same truncation, so the choice of
Cholesky is only numerical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-3


def clamp_psd(cov: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``cov`` (symmetrised, float64) with eigenvalues clamped to ``eps · mean eigenvalue``."""
    c = cov.double()
    c = (c + c.T) / 2
    lam, q = torch.linalg.eigh(c)
    floor = eps * max(float(lam.clamp_min(0).mean()), 1e-300)
    return (q * lam.clamp_min(floor)) @ q.T


def chol(cov: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Lower-triangular ``L`` with ``L Lᵀ = clamp_psd(cov)`` (float64)."""
    return torch.linalg.cholesky(clamp_psd(cov, eps))


def inv_sqrt(cov: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Symmetric ``clamp_psd(cov)^{-1/2}`` (float64)."""
    lam, q = torch.linalg.eigh(clamp_psd(cov, eps))
    return (q * lam.rsqrt()) @ q.T


@dataclass(frozen=True)
class Whitener:
    """``left`` (``A`` ``[out, out]``) and ``right`` (``B`` ``[in, in]``) transforms; ``None`` = identity."""

    left: torch.Tensor | None = None
    right: torch.Tensor | None = None

    def whiten(self, w: torch.Tensor) -> torch.Tensor:
        """``A · w · B`` for ``w`` ``[..., out, in]`` (float64)."""
        w = w.double()
        if self.left is not None:
            w = self.left @ w
        if self.right is not None:
            w = w @ self.right
        return w

    def unwhiten_out(self, u: torch.Tensor) -> torch.Tensor:
        """Output-side factor ``[out, r]``: ``A⁻¹ u``."""
        return u if self.left is None else torch.linalg.solve(self.left, u.double())

    def unwhiten_in(self, v: torch.Tensor) -> torch.Tensor:
        """Input-side factor ``[in, r]`` (so that ``Ŵ = … vᵀ``): ``B⁻ᵀ v``."""
        return v if self.right is None else torch.linalg.solve(self.right.T, v.double())


def make_whitener(
    side: str, cov_in: torch.Tensor | None, cov_out: torch.Tensor | None, input_form: str = "chol"
) -> Whitener:
    """``side``: ``input`` | ``output`` | ``both`` | ``none``; covariances as described above."""
    right = left = None
    if side in ("input", "both"):
        if cov_in is None:
            raise ValueError("input whitening needs the input covariance")
        right = chol(cov_in) if input_form == "chol" else inv_sqrt(cov_in)
    if side in ("output", "both"):
        if cov_out is None:
            raise ValueError("output whitening needs the output-gradient covariance")
        left = chol(cov_out).T
    return Whitener(left, right)


# statistics per projection: (input covariance, output-gradient covariance). gate/up see the MoE input;
# their output gradient is approximated by the gradient at the down projection's input (TD-MoE's code).
COVARIANCES = {
    "gate": ("input_cov", "down_in_grad_cov_pooled"),
    "up": ("input_cov", "down_in_grad_cov_pooled"),
    "down": ("down_in_cov_pooled", "out_grad_cov"),
}
ALL_NEEDS = frozenset(n for pair in COVARIANCES.values() for n in pair)


def whitening_needs(side: str) -> set[str]:
    """Statistics a whitening side needs (``none`` needs nothing)."""
    use_in, use_out = side in ("input", "both"), side in ("output", "both")
    return {n for a, b in COVARIANCES.values() for n, used in ((a, use_in), (b, use_out)) if used}


def projection_whiteners(stats, side: str, input_form: str = "chol") -> dict[str, Whitener]:
    """One :class:`Whitener` per projection from a layer's statistics (``LayerStats``)."""
    use_in, use_out = side in ("input", "both"), side in ("output", "both")
    out = {}
    for proj, (cin, cout) in COVARIANCES.items():
        out[proj] = make_whitener(
            side, stats[cin] if use_in else None, stats[cout] if use_out else None, input_form
        )
    return out
