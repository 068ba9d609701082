"""Whitening's linear algebra (``methods/whitening.py``) and the whitened SVD (``methods/svd.py``): products
with a triangular whitener by blocks equal the full product, triangular solves equal the general solve,
the blocked Gram equals ``z zᵀ``, and the Gram-eigenvector SVD equals LAPACK's SVD of the whitened
matrix; all to tolerances derived from float64's epsilon, the sizes and the conditioning."""

from __future__ import annotations

import pytest
import torch

from moecompress.engine.spec import LayerStats
from moecompress.methods.svd import factorize, whitened_svd
from moecompress.methods.whitening import (
    Whitener,
    chol,
    clamp_psd,
    gram_lower,
    inv_sqrt,
    projection_whiteners,
    tri_matmul,
    triangle,
)

EPS = torch.finfo(torch.float64).eps


def _spd(n: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 2 * n, generator=g, dtype=torch.float64)
    d = torch.logspace(-spread / 2, spread / 2, n, dtype=torch.float64)
    return d[:, None] * (z @ z.T / (2 * n)) * d[None, :]


def test_triangle_kinds():
    m = torch.randn(5, 5, dtype=torch.float64)
    assert triangle(m.tril()) == "lower" and triangle(m.triu()) == "upper" and triangle(m) is None
    assert triangle(torch.eye(3)) == "lower" and triangle(None) is None and triangle(torch.ones(2, 3)) is None
    wh = Whitener(chol(_spd(6, 0)).T, chol(_spd(7, 1)))
    assert (wh.left_kind, wh.right_kind) == ("upper", "lower")
    assert Whitener(right=inv_sqrt(_spd(7, 1))).right_kind is None  # the inverse form is dense


@pytest.mark.parametrize("kind", ["lower", "upper"])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("block", [4, 7, 64])
def test_tri_matmul_equals_the_full_product(kind, left, block):
    n, k = 19, 6
    g = torch.Generator().manual_seed(0)
    t = torch.randn(n, n, generator=g, dtype=torch.float64)
    t = t.tril() if kind == "lower" else t.triu()
    x = torch.randn(3, n, k, generator=g, dtype=torch.float64)  # a batch
    x = x if left else x.transpose(1, 2).contiguous()
    got = tri_matmul(t, x, kind, left, block)
    want = t @ x if left else x @ t
    # only the summation order differs: |error| <= n·eps·(|t|·|x|) elementwise
    bound = n * EPS * ((t.abs() @ x.abs()) if left else (x.abs() @ t.abs()))
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(tri_matmul(t, x, None, left, block), tri_matmul(t.T, x, None, left, block))


def test_gram_lower_is_the_lower_triangle_of_z_zt():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(13, 9, generator=g, dtype=torch.float64)
    acc = torch.ones(13, 13, dtype=torch.float64)  # added to, below the diagonal
    out = gram_lower(z, acc.clone(), block=4)
    want = z @ z.T + 1
    bound = 9 * EPS * (z.abs() @ z.abs().T + 1)
    lower = torch.ones(13, 13, dtype=torch.bool).tril()
    assert ((out - want).abs() <= bound)[lower].all()
    blk = torch.arange(13) // 4
    above = blk[:, None] < blk[None, :]  # the blocks above the diagonal blocks: left as they were
    assert torch.equal(out[above], acc[above]) and not (out == acc)[~above].any()
    # eigh reads only the lower triangle: what is above it does not change the eigenpairs
    lam, _ = torch.linalg.eigh(out)
    assert torch.allclose(lam, torch.linalg.eigvalsh(want), rtol=0, atol=13 * float(bound.max()))


def test_triangular_unwhitening_equals_the_general_solve():
    a, b = chol(_spd(12, 2, spread=2)).T, chol(_spd(17, 3, spread=2))
    wh = Whitener(a, b)
    g = torch.Generator().manual_seed(4)
    u, v = (
        torch.randn(12, 5, generator=g, dtype=torch.float64),
        torch.randn(17, 5, generator=g, dtype=torch.float64),
    )
    for got, want, m in (
        (wh.unwhiten_out(u), torch.linalg.solve(a, u), a),
        (wh.unwhiten_in(v), torch.linalg.solve(b.T, v), b),
    ):
        cond = float(torch.linalg.cond(m))
        # backward-stable solves: relative forward error <= c·n·eps·cond each
        assert (got - want).norm() <= 4 * m.shape[0] * EPS * cond * want.norm()
    assert (wh.whiten(wh.unwhiten_out(u) @ wh.unwhiten_in(v).T) - u @ v.T).norm() <= 1e-10 * (u @ v.T).norm()
    assert (wh.transpose_out(u) - a.T @ u).norm() <= 12 * EPS * (a.abs().T @ u.abs()).norm()
    assert (wh.right_mul(v) - b @ v).norm() <= 17 * EPS * (b.abs() @ v.abs()).norm()


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
@pytest.mark.parametrize("form", ["chol", "inverse", "both", "none"])
def test_whitened_svd_equals_lapacks_svd_of_the_whitened_matrix(shape, form):
    out, inn = shape
    g = torch.Generator().manual_seed(5)
    w = torch.randn(out, inn, generator=g, dtype=torch.float64)
    c_in, c_out = _spd(inn, 6, spread=2), _spd(out, 7, spread=2)
    wh = {"chol": Whitener(right=chol(c_in)), "inverse": Whitener(right=inv_sqrt(c_in)),
          "both": Whitener(chol(c_out).T, chol(c_in)), "none": Whitener()}[form]  # fmt: skip
    keep = 9
    u, v, s = whitened_svd(w, wh, keep)
    uu, ss, vh = torch.linalg.svd(wh.whiten(w), full_matrices=False)
    assert (s - ss).abs().max() <= 8 * max(shape) * EPS * float(ss[0]) ** 2 / float(ss[keep])  # Gram accuracy
    want = wh.whiten(w).new_zeros(out, inn)
    want = (uu[:, :keep] * ss[:keep]) @ vh[:keep]  # the whitened truncation
    got = wh.whiten(u @ v)
    # the kept subspace's rotation is ~eps·s1²/(s_k² − s_{k+1}²) in the Gram, far below 1e-9 here
    gap = float(ss[keep - 1] ** 2 - ss[keep] ** 2)
    assert (got - want).norm() <= 100 * max(shape) * EPS * float(ss[0]) ** 2 / gap * want.norm()
    assert (got - want).norm() <= 1e-9 * want.norm()


def test_factorize_handles_rank_deficient_experts():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(2, 10, 3, generator=g, dtype=torch.float64) @ torch.randn(
        3, 16, generator=g, dtype=torch.float64
    )
    w[1] = 0  # an all-zero expert
    pairs, err = factorize(w, Whitener(right=chol(_spd(16, 9))), 5)
    for (u, v), x in zip(pairs, w):
        assert torch.isfinite(u).all() and torch.isfinite(v).all()
        assert (u @ v - x).norm() <= 1e-10 * max(float(x.norm()), 1.0)
    assert float(err[0]) <= 1e-7 and float(err[1]) == 0


def test_gate_and_up_share_one_whitener():
    stats = LayerStats(0, {"input_cov": _spd(8, 10), "down_in_cov_pooled": _spd(5, 11)})
    wh = projection_whiteners(stats, "input")
    assert wh["gate"] is wh["up"] and wh["down"] is not wh["gate"]


def test_chol_skips_the_eigendecomposition_only_when_nothing_is_clamped(monkeypatch):
    well = _spd(30, 12)  # eigenvalues near their mean: none under the floor (1e-3 of the mean)
    g = torch.Generator().manual_seed(13)
    z = torch.randn(30, 5, generator=g, dtype=torch.float64)
    low = z @ z.T  # rank 5: 25 eigenvalues clamped
    want_well, want_low = torch.linalg.cholesky(clamp_psd(well)), torch.linalg.cholesky(clamp_psd(low))
    assert torch.equal(chol(low), want_low)  # the clamped path, as before

    def boom(*a, **k):
        raise AssertionError("eigh called")

    monkeypatch.setattr(torch.linalg, "eigh", boom)
    got = chol(well)
    # the same matrix up to eigh's recomposition rounding (~n·eps·‖C‖), through the Cholesky factor
    cond = float(torch.linalg.cond(well))
    assert (got - want_well).norm() <= 10 * 30 * EPS * cond * want_well.norm()
    with pytest.raises(AssertionError, match="eigh called"):
        chol(low)
