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

from moecompress.ir import ExpertBank, MoELayer
from moecompress.methods.merging import gram_features, ward_costs
from moecompress.reference import expert_forward, route, router_logits


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


AUTO_TOKENS, AUTO_DIMS = 64, 16
"""``target_experts: auto``: fit tokens whose expert outputs form the features; principal dimensions kept."""


def choose_count(layer: MoELayer, x: torch.Tensor, outs: torch.Tensor | None = None) -> tuple[int, dict]:
    """``target_experts: auto`` (``choose_groups``): the number of groups of the unprotected experts by
    :func:`~moecompress.methods.mixture.choose_k` (tied isotropic Gaussian mixture, EM, BIC) over their
    features — each expert's outputs on the first ``AUTO_TOKENS`` fit tokens and its centred router-logit
    column, each block scaled to unit variance, reduced to ``AUTO_DIMS`` principal dimensions —
    plus one singleton per protected expert. ``K = 1`` is the mixture's null (no cluster structure):
    the layer is kept whole rather than merged into one expert (on ref-mixtral, merging every
    ``K = 1`` layer into one expert gave perplexity 411 against 38.9; benchmarks/RESULTS.md, issue 19).
    ``outs``: every expert's outputs on those tokens ``[E, T, H]`` when already computed (gathered over
    chunks of experts: the layer's routed experts are then not read)."""
    bank = layer.experts
    e = layer.router.num_experts
    free = [i for i in range(e) if i not in layer.protected]
    if len(free) < 3:
        return e, {"groups": e, "bic": {}, "why": "fewer than 3 unprotected experts: nothing merged"}
    xs = x[:AUTO_TOKENS]
    if outs is None:
        outs = torch.stack([expert_forward(bank, i, xs).float() for i in free])
    else:
        outs = outs[free]
    logits = router_logits(layer, x)
    rows = (logits - logits.mean(1, keepdim=True)).T[free]
    k, bic = choose_k(reduce_features([outs, rows], AUTO_DIMS))
    info = {"free_groups": k, "bic": {str(a): round(b, 3) for a, b in bic.items()}}
    if k == 1:  # the null: no cluster structure among the experts, so no group of them is interchangeable
        return e, {"groups": e, **info, "why": "BIC finds one component (no clusters): the layer is kept"}
    return k + e - len(free), {"groups": k + e - len(free), **info}


def fit_tokens(n: int) -> int:
    """How many of ``n`` ``io_sample`` tokens the Ward features use: the first ``AUTO_TOKENS`` of the fit
    half (the first ``⌈n/2⌉``; all of them when ``n < 2``), as the merging passes split the sample."""
    return min(AUTO_TOKENS, (n + 1) // 2 if n > 1 else n)


GRAM_BLOCK = 16
"""Tokens per block of :func:`expert_output_gram` (its float64 outputs ``[E, GRAM_BLOCK, H]`` at a time)."""


def sample_outputs(bank: ExpertBank, xs: torch.Tensor) -> torch.Tensor:
    """Every expert of ``bank`` on every token of ``xs`` ``[T, H]`` (routed or not): ``[E, T, H]`` as
    :func:`~moecompress.reference.expert_forward` gives them, computed by blocks of ``GRAM_BLOCK`` tokens as
    :func:`expert_output_gram` computes them (the same bits): a layer calibrated by chunks of experts keeps
    its chunks' rows and makes the Gram from them at the end (:func:`gram_of_outputs`)."""
    xs = xs.float()
    parts = [torch.stack([expert_forward(bank, i, xs[a : a + GRAM_BLOCK]) for i in range(bank.num_experts)])
             for a in range(0, len(xs), GRAM_BLOCK)]  # fmt: skip
    if not parts:
        return xs.new_zeros(bank.num_experts, 0, xs.shape[-1])
    return torch.cat(parts, 1)


def _basis(grad_cov: torch.Tensor | None) -> torch.Tensor | None:
    if grad_cov is None:
        return None
    lam, u = torch.linalg.eigh((grad_cov.double() + grad_cov.double().T) / 2)
    return u * lam.clamp_min(0).sqrt()  # ‖δ‖² in this basis = δᵀ G δ


def _gram_add(gram: torch.Tensor, outs: torch.Tensor, basis: torch.Tensor | None) -> None:
    """One block of tokens' outputs ``[E, t, H]`` (float64) added to ``gram``."""
    flat = (outs if basis is None else outs @ basis).flatten(1)
    gram += flat @ flat.T


def gram_of_outputs(outs: torch.Tensor, grad_cov: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`expert_output_gram` from the experts' outputs ``outs`` ``[E, T, H]`` (:func:`sample_outputs`):
    the same blocks, the same additions, the same bits."""
    basis = _basis(grad_cov)
    gram = torch.zeros(outs.shape[0], outs.shape[0], dtype=torch.float64)
    for a in range(0, outs.shape[1], GRAM_BLOCK):
        _gram_add(gram, outs[:, a : a + GRAM_BLOCK].double(), basis)
    return gram


def expert_output_gram(
    layer: MoELayer, xs: torch.Tensor, grad_cov: torch.Tensor | None = None
) -> torch.Tensor:
    """``expert_out_gram`` ``[E, E]`` (float64): ``Σ_t ⟨G^{1/2} E_i(x_t), G^{1/2} E_j(x_t)⟩`` over the tokens
    ``xs`` (every expert on every token, routed or not), ``G`` = ``grad_cov`` (``out_grad_cov``, negative
    eigenvalues clamped) or ``I``. Ward's squared distances are ``g_ii + g_jj − 2 g_ij``. Summed over
    blocks of ``GRAM_BLOCK`` tokens, so the float64 outputs held are ``E · GRAM_BLOCK · H`` values."""
    bank = layer.experts
    xs = xs.float()
    basis = _basis(grad_cov)
    gram = torch.zeros(bank.num_experts, bank.num_experts, dtype=torch.float64)
    for a in range(0, len(xs), GRAM_BLOCK):
        part = xs[a : a + GRAM_BLOCK]
        _gram_add(gram, torch.stack([expert_forward(bank, i, part).double() for i in range(bank.num_experts)]), basis)
    return gram


def route_energy(layer: MoELayer, xs: torch.Tensor) -> float:
    """``mean_t Σ_k w_tk²`` of the routing weights on ``xs`` (``= top_k · E[w²]``, the loss scale's factor)."""
    _, w = route(layer, xs.float())
    return float(w.double().pow(2).sum(1).mean())


def gram_curve(
    gram: torch.Tensor,
    counts: torch.Tensor,
    scale: str,
    tokens: int,
    energy: float | None = None,
    protected: frozenset[int] | set[int] = frozenset(),
) -> list[float]:
    """The merge-loss curve of :func:`merge_curve` from the layer's ``expert_out_gram`` on ``tokens``
    tokens (``G``-weighted for ``loss``, with ``energy`` = :func:`route_energy`): Ward
    (:func:`ward_costs`) on :func:`gram_features`, then the ``scale``'s per-token normalisation."""
    f = counts.double().flatten().clamp_min(0)
    f = f / f.sum() if float(f.sum()) > 0 else torch.full_like(f, 1 / len(f))
    costs = ward_costs(gram_features(gram), f, singletons=protected)
    if scale == "loss":
        if energy is None:
            raise ValueError("scale: loss needs the routing energy (route_energy)")
        denom = tokens / (0.5 * energy)
    elif scale == "relative":
        denom = float((f * gram.double().diagonal()).sum())
    else:
        denom = float(tokens)
    return [c / max(denom, 1e-300) for c in costs]


def merge_curve(
    layer: MoELayer,
    x: torch.Tensor,
    counts: torch.Tensor,
    scale: str = "loss",
    grad_cov: torch.Tensor | None = None,
) -> list[float]:
    """The layer's merge-loss curve: ``c[m]`` the cost of its ``(m+1)``-th merge in the order the merging
    passes' default grouping makes them (usage-weighted Ward on each expert's outputs on the first
    ``AUTO_TOKENS`` tokens of ``x``, protected experts singletons; :func:`ward_costs`), per token:

    - ``loss`` (needs ``grad_cov`` = ``E[g gᵀ]``, ``g`` the LM-loss gradient at the MoE output): the
      Fisher estimate of the loss increase, ``½ E_t Σ_i P(i routed) E[w²] ‖δ_i(x_t)‖²_G``, ``δ_i`` the
      change of expert ``i``'s output and ``E[w²]`` the mean squared routing weight of a routed slot
      (``Σ_i P(i routed) = top_k``) — in loss units, so comparable across layers;
    - ``relative``: divided by the layer's usage-weighted expert output energy on the same tokens,
      ``Σ_i f_i ‖E_i(x)‖²`` (the fraction of what the experts write that a merge loses);
    - ``absolute``: in squared output units (usage frequencies ``f`` summing to 1).

    Computed through the Gram matrix of the outputs (:func:`expert_output_gram`, :func:`gram_curve`),
    exactly as a merging pass's budget plan computes it from the ``expert_out_gram`` statistics."""
    xs = x[:AUTO_TOKENS].float()
    if scale == "loss" and grad_cov is None:
        raise ValueError("scale: loss needs the output-gradient covariance (out_grad_cov)")
    gram = expert_output_gram(layer, xs, grad_cov if scale == "loss" else None)
    energy = route_energy(layer, xs) if scale == "loss" else None
    return gram_curve(gram, counts, scale, len(xs), energy, layer.protected)
