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

from dataclasses import dataclass, field

import torch

EPS = 1e-3

TRI_BLOCK = 512
"""Rows (columns) per block of :func:`tri_matmul`: a product with a triangular ``[n, n]`` factor skips its
zero blocks, ``(n/b + 1) / (2n/b)`` of a full product's work (0.54 at n = 7168)."""


def _symmetrised(cov: torch.Tensor) -> torch.Tensor:
    """``(cov + covᵀ) / 2`` in float64, one new matrix (``cov`` is left as it is)."""
    c = cov.double()
    return (c + c.T).mul_(0.5)  # x·0.5 == x/2 exactly


def _clamped(c: torch.Tensor, eps: float) -> torch.Tensor:
    """Symmetric float64 ``c`` with its eigenvalues clamped to ``eps · mean eigenvalue``."""
    lam, q = torch.linalg.eigh(c)
    floor = eps * max(float(lam.clamp_min(0).mean()), 1e-300)
    return (q * lam.clamp_min(floor)) @ q.T


def clamp_psd(cov: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``cov`` (symmetrised, float64) with eigenvalues clamped to ``eps · mean eigenvalue``."""
    return _clamped(_symmetrised(cov), eps)


CHOL_COPIES = 4
"""Peak ``n × n`` float64 matrices :func:`chol` allocates, its result included: 3 when the covariance is
positive definite above the floor (the symmetrised copy, the shifted copy and the trial factor), 4 when it
is clamped first (the symmetrised copy, the eigenvectors and ``eigh``'s workspace of about two more);
measured 2.98–3.00 and 4.0 at n = 1024 and 2048."""


def chol(cov: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Lower-triangular ``L`` with ``L Lᵀ = clamp_psd(cov)`` (float64). When ``cov − eps·(tr cov / n)·I``
    has a Cholesky factor, every eigenvalue is above the floor (so none is negative and their mean is
    ``tr cov / n``): the clamp changes nothing, and ``cov`` is factorised without its eigendecomposition
    (the same matrix up to rounding; the ``eigh`` of a ``7168²`` covariance is ~25x its Cholesky). At most
    :data:`CHOL_COPIES` matrices alive at once."""
    c = _symmetrised(cov)
    floor = eps * max(float(c.diagonal().sum()) / max(c.shape[0], 1), 1e-300)
    shifted = c.clone()
    shifted.diagonal().sub_(floor)  # == c - floor·I, without the identity matrix
    ok = int(torch.linalg.cholesky_ex(shifted).info) == 0
    del shifted
    if not ok:
        c = _clamped(c, eps)
    return torch.linalg.cholesky(c)


def inv_sqrt(cov: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Symmetric ``clamp_psd(cov)^{-1/2}`` (float64)."""
    lam, q = torch.linalg.eigh(clamp_psd(cov, eps))
    return (q * lam.rsqrt()) @ q.T


def triangle(m: torch.Tensor | None) -> str | None:
    """``"lower"`` / ``"upper"`` when the square matrix ``m`` is triangular (a diagonal one: ``"lower"``),
    else ``None``."""
    if m is None or m.ndim != 2 or m.shape[0] != m.shape[1] or m.device.type == "meta":
        return None
    if not bool(m.triu(1).any()):
        return "lower"
    return "upper" if not bool(m.tril(-1).any()) else None


def tri_matmul(t: torch.Tensor, x: torch.Tensor, kind: str | None, left: bool, block: int = TRI_BLOCK):
    """``t @ x`` (``left``) or ``x @ t`` for ``t`` ``[n, n]`` triangular (``kind``: ``"lower"`` /
    ``"upper"``; ``None``: a full product) and ``x`` ``[..., n, k]`` / ``[..., k, n]``, by blocks of
    ``block`` rows (columns) of the result, each a product over ``t``'s nonzero part of that block only.
    The result equals the full product up to the order of summation (the skipped terms are zeros)."""
    n = t.shape[0]
    if kind is None or n <= block:
        return t @ x if left else x @ t
    out = x.new_empty(x.shape)
    for a in range(0, n, block):
        b = min(a + block, n)
        if left:  # rows [a, b) of t @ x: t[a:b] is nonzero in columns [a, n) (upper) or [0, b) (lower)
            lo, hi = (a, n) if kind == "upper" else (0, b)
            out[..., a:b, :] = t[a:b, lo:hi] @ x[..., lo:hi, :]
        else:  # columns [a, b) of x @ t: t[:, a:b] is nonzero in rows [0, b) (upper) or [a, n) (lower)
            lo, hi = (0, b) if kind == "upper" else (a, n)
            out[..., :, a:b] = x[..., :, lo:hi] @ t[lo:hi, a:b]
    return out


def gram_lower(z: torch.Tensor, out: torch.Tensor | None = None, block: int = TRI_BLOCK) -> torch.Tensor:
    """``z zᵀ`` for ``z`` ``[d, k]`` added to ``out`` (``[d, d]``, zeros if ``None``), by blocks of
    ``block`` rows: only the blocks on and below the diagonal (``(d/b + 1) / (2d/b)`` of the work); the
    rest of ``out`` is left as it was (``torch.linalg.eigh`` reads only the lower triangle)."""
    d = z.shape[0]
    out = z.new_zeros(d, d) if out is None else out
    for a in range(0, d, block):
        b = min(a + block, d)
        out[a:b, :b].addmm_(z[a:b], z[:b].T)
    return out


@dataclass(frozen=True)
class Whitener:
    """``left`` (``A`` ``[out, out]``) and ``right`` (``B`` ``[in, in]``) transforms; ``None`` = identity.
    A triangular transform (the ``chol`` form) is found once, at construction: products with it skip its
    zero blocks (:func:`tri_matmul`) and its inverse is applied by triangular solves."""

    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    left_kind: str | None = field(default=None, init=False, repr=False, compare=False)
    right_kind: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "left_kind", triangle(self.left))
        object.__setattr__(self, "right_kind", triangle(self.right))

    @property
    def dtype(self) -> torch.dtype:
        """The transforms' dtype (float64 as made; :meth:`to` casts), in which :meth:`whiten` computes."""
        t = self.left if self.left is not None else self.right
        return torch.float64 if t is None else t.dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Whitener:
        """This whitener with its transforms on ``device`` and in ``dtype`` (``None``: unchanged; itself
        when nothing changes)."""
        ts = [t for t in (self.left, self.right) if t is not None]
        dev = None if device is None else torch.device(device)
        if all((dev is None or t.device == dev) and (dtype is None or t.dtype == dtype) for t in ts):
            return self
        return Whitener(*(None if t is None else t.to(dev, dtype) for t in (self.left, self.right)))

    def whiten_out(self, w: torch.Tensor) -> torch.Tensor:
        """``A · w`` for ``w`` ``[..., out, k]`` (in :attr:`dtype`)."""
        w = w.to(self.dtype)
        return w if self.left is None else tri_matmul(self.left, w, self.left_kind, left=True)

    def whiten_in(self, w: torch.Tensor) -> torch.Tensor:
        """``w · B`` for ``w`` ``[..., k, in]`` (in :attr:`dtype`)."""
        w = w.to(self.dtype)
        return w if self.right is None else tri_matmul(self.right, w, self.right_kind, left=False)

    def whiten(self, w: torch.Tensor) -> torch.Tensor:
        """``A · w · B`` for ``w`` ``[..., out, in]`` (in :attr:`dtype`: float64 as made)."""
        return self.whiten_in(self.whiten_out(w))

    def unwhiten_out(self, u: torch.Tensor) -> torch.Tensor:
        """Output-side factor ``[out, r]``: ``A⁻¹ u``."""
        if self.left is None:
            return u
        if self.left_kind is not None:
            return torch.linalg.solve_triangular(self.left, u.double(), upper=self.left_kind == "upper")
        return torch.linalg.solve(self.left, u.double())

    def unwhiten_in(self, v: torch.Tensor) -> torch.Tensor:
        """Input-side factor ``[in, r]`` (so that ``Ŵ = … vᵀ``): ``B⁻ᵀ v``."""
        if self.right is None:
            return v
        if self.right_kind is not None:  # Bᵀ is upper when B is lower
            return torch.linalg.solve_triangular(self.right.T, v.double(), upper=self.right_kind == "lower")
        return torch.linalg.solve(self.right.T, v.double())

    def transpose_out(self, u: torch.Tensor) -> torch.Tensor:
        """``Aᵀ u`` for ``u`` ``[out, r]`` (float64): ``Uᵀ (A W B) V = (Aᵀ U)ᵀ W (B V)``."""
        u = u.double()
        if self.left is None:
            return u
        kind = {"lower": "upper", "upper": "lower"}.get(self.left_kind)  # type: ignore[arg-type]
        return tri_matmul(self.left.T, u, kind, left=True)

    def right_mul(self, v: torch.Tensor) -> torch.Tensor:
        """``B v`` for ``v`` ``[in, r]`` (float64)."""
        v = v.double()
        return v if self.right is None else tri_matmul(self.right, v, self.right_kind, left=True)


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


def whitener_bytes(side: str, shapes: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """``(held, peak)`` bytes of :func:`projection_whiteners` for projections ``{name: (out, in)}``: the
    float64 transforms it returns, and the most alive while it makes them (those made before plus
    :data:`CHOL_COPIES` of the one being made)."""
    use_in, use_out = side in ("input", "both"), side in ("output", "both")
    held = peak = 0
    seen: set[tuple[str, str]] = set()
    for proj, pair in COVARIANCES.items():
        if pair in seen or proj not in shapes:
            continue
        seen.add(pair)
        out, inn = shapes[proj]
        for n, used in ((inn, use_in), (out, use_out)):
            if used:
                peak = max(peak, held + CHOL_COPIES * n * n * 8)
                held += n * n * 8
    return held, peak


def whitening_needs(side: str) -> set[str]:
    """Statistics a whitening side needs (``none`` needs nothing)."""
    use_in, use_out = side in ("input", "both"), side in ("output", "both")
    return {n for a, b in COVARIANCES.values() for n, used in ((a, use_in), (b, use_out)) if used}


def projection_whiteners(stats, side: str, input_form: str = "chol") -> dict[str, Whitener]:
    """One :class:`Whitener` per projection from a layer's statistics (``LayerStats``); projections that
    read the same statistics (gate and up) share one (made once)."""
    use_in, use_out = side in ("input", "both"), side in ("output", "both")
    out: dict[str, Whitener] = {}
    made: dict[tuple[str, str], Whitener] = {}
    for proj, (cin, cout) in COVARIANCES.items():
        if (cin, cout) not in made:
            made[cin, cout] = make_whitener(
                side, stats[cin] if use_in else None, stats[cout] if use_out else None, input_form
            )
        out[proj] = made[cin, cout]
    return out
