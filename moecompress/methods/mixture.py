"""How many groups? A Gaussian mixture over expert features with the number of components chosen by a
penalised likelihood (FedGEM-style EM with an unknown number of components).

FedGEM ("federated generalized EM for mixture models with an unknown number of components", seed
abstract in ``shared/seeds/``) runs EM steps per client and infers the global ``K`` from uncertainty
sets around each component. Here there is one "client" (a layer's experts), so ``K`` is chosen the
centralised way the paper compares against: EM for every ``K`` and the Bayesian information criterion.

Model (isotropic, variance tied across components; features ``x_i ∈ ℝ^d``, ``n`` experts)::

    p(x) = Σ_k π_k N(x | μ_k, σ² I)
    E-step  r_ik ∝ π_k exp(−‖x_i − μ_k‖² / 2σ²)
    M-step  π_k = Σ_i r_ik / n,  μ_k = Σ_i r_ik x_i / Σ_i r_ik,  σ² = max(Σ_ik r_ik ‖x_i − μ_k‖² / ((n − K) d), σ²_min)
    BIC(K)  = −2 log L + (K d + K) log n          (K means, K − 1 weights, one variance)

The variance has ``(n − K)·d`` degrees of freedom (``K`` means estimated; the maximum-likelihood ``n·d``
makes one-point components look free and picks ``K`` too large on few experts); ``K`` ranges over
``1..n−1`` (``n`` would leave no residual), and ``σ²_min = floor · (total variance per dimension)``
guards exact duplicates. EM starts from k-means++ seeds (deterministic generator), ``restarts``
times; the best likelihood per ``K`` is kept. :func:`reduce_features` standardises feature blocks and
projects them on their top principal directions first (``n`` points span at most ``n − 1`` dimensions).
"""

from __future__ import annotations

import math

import torch


def reduce_features(blocks: list[torch.Tensor], dims: int) -> torch.Tensor:
    """``[n, min(dims, n−1)]``: each block ``[n, *]`` centred and scaled to unit total variance,
    concatenated, and projected on its top principal directions (float64)."""
    parts = []
    for b in blocks:
        f = b.detach().double().flatten(1)
        f = f - f.mean(0)
        parts.append(f / f.pow(2).sum().div(len(f)).sqrt().clamp_min(1e-300))
    x = torch.cat(parts, 1)
    k = max(1, min(dims, x.shape[0] - 1))
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    return u[:, :k] * s[:k]


def _kmeanspp(x: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    idx = [int(torch.randint(len(x), (1,), generator=g))]
    for _ in range(1, k):
        d = torch.cdist(x, x[idx]).min(1).values.pow(2)
        if float(d.sum()) <= 0:
            idx.append(int(torch.randint(len(x), (1,), generator=g)))
            continue
        idx.append(int(torch.multinomial(d / d.sum(), 1, generator=g)))
    return x[idx].clone()


def fit_gmm(
    x: torch.Tensor, k: int, *, floor: float = 1e-3, iters: int = 200, restarts: int = 5, seed: int = 0
) -> dict:
    """EM for the tied isotropic mixture above: ``{loglik, means [k, d], var, weights [k], resp [n, k]}``."""
    x = x.double()
    n, d = x.shape
    var_min = floor * max(float(x.var(0, unbiased=False).mean()), 1e-300)
    g = torch.Generator().manual_seed(seed)
    best: dict | None = None
    for _ in range(restarts):
        mu = _kmeanspp(x, k, g)
        pi = torch.full((k,), 1 / k, dtype=torch.float64)
        var = max(float(torch.cdist(x, mu).min(1).values.pow(2).mean()) / d, var_min)
        prev = -math.inf
        for _ in range(iters):
            sq = torch.cdist(x, mu).pow(2)
            logp = pi.clamp_min(1e-300).log() - 0.5 * d * math.log(2 * math.pi * var) - sq / (2 * var)
            ll_i = torch.logsumexp(logp, 1)
            ll = float(ll_i.sum())
            r = (logp - ll_i[:, None]).exp()
            nk = r.sum(0)
            pi = nk / n
            mu = torch.where(nk[:, None] > 0, (r.T @ x) / nk.clamp_min(1e-300)[:, None], mu)
            var = max(float((r * torch.cdist(x, mu).pow(2)).sum()) / (max(n - k, 1) * d), var_min)
            if ll - prev < 1e-10 * max(abs(ll), 1.0):
                break
            prev = ll
        if best is None or ll > best["loglik"]:
            best = {"loglik": ll, "means": mu, "var": var, "weights": pi, "resp": r}
    return best  # type: ignore[return-value]


def choose_k(x: torch.Tensor, k_max: int | None = None, **kw) -> tuple[int, dict[int, float]]:
    """``(K minimising BIC, {K: BIC})`` over ``K = 1..k_max`` (default and at most ``n − 1``) for features ``x`` ``[n, d]``;
    ties go to the smaller ``K``."""
    n, d = x.shape
    bic = {}
    for k in range(1, min(k_max or n - 1, n - 1) + 1):
        fit = fit_gmm(x, k, **kw)
        bic[k] = -2 * fit["loglik"] + (k * d + k) * math.log(max(n, 2))
    return min(bic, key=lambda k: (bic[k], k)), bic
