"""The mathematics shared by the expert-merging passes (``namex``, ``merge_experts``).

- :func:`nash_weights` — the Nash bargaining weights of NAMEx: the ``α > 0`` with ``(GᵀG)α = 1/α``
  (element-wise), ``G = [τ_1 … τ_n]`` the task vectors of a group's members relative to its base.
- :func:`average_linkage` — HC-SMoE's grouping: average-linkage agglomerative clustering of expert
  feature vectors, some ids kept as singletons (protected experts).
- :func:`ward_linkage` — usage-weighted Ward clustering (the first-order merge loss; ``linkage: ward``);
  :func:`ward_costs` its per-merge loss curve (:func:`gram_features`: the same curve from a Gram matrix
  of the features) and :func:`allocate_merges` a budget spent over layers (exact DP).
- :func:`linear_assignment` and :func:`align_to` — weight matching: permute a member's intermediate
  neurons to its base's (neuron order in independently trained experts is arbitrary).
- expert parameters as a small dict of float32 tensors (``gate [I, H]``, ``up [I, H]``, ``down [H, I]``
  and the bank's biases ``bias.gate``/``bias.up`` ``[I]``, ``bias.down`` ``[H]``), with the vector
  operations the merges need on them (no flattening of whole experts: a Mixtral expert is 176 M values).

Everything is deterministic and written in torch/numpy (no scipy, no cvxpy).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np
import torch

from moecompress.errors import MethodError
from moecompress.ir import ExpertBank
from moecompress.layouts.dense import Dense
from moecompress.reference import expert_forward

Params = dict[str, torch.Tensor]

UNBOUNDED = 1e6
"""Normalised Nash weights beyond this mean ``GᵀG`` is (numerically) singular along a non-negative
direction: ``cᵀ(GᵀG/‖GᵀG‖_F)c ≲ 1e-12`` for some ``c ≥ 0``, ``‖c‖ = 1``."""


# ------------------------------------------------------------------------------------ Nash bargaining
def nash_weights(
    gram: torch.Tensor, *, tol: float = 1e-10, max_iter: int = 100
) -> tuple[torch.Tensor, float, int]:
    """Solve ``(K α) ⊙ α = 1``, ``α > 0`` for a Gram matrix ``K = GᵀG`` ``[n, n]``.

    ``α`` is the unique minimiser of the strictly convex ``f(α) = ½ αᵀKα − Σ log α_i`` (``∇f = Kα − 1/α``,
    Hessian ``K + diag(α⁻²) ≻ 0``), found by damped Newton with a backtracking line search that keeps
    ``α > 0``. ``K`` is first divided by its Frobenius norm ``c`` (as Nash-MTL does); the solution of the
    normalised system is rescaled by ``c^{-1/2}``. Start: ``α_i = 1/√K_ii`` (exact for orthogonal ``τ``).

    Stops when the residual is below ``tol`` or a step no longer changes ``α`` (round-off level, for
    ill-conditioned ``K``). Returns ``(α float64 [n], residual max_i |α_i (Kα)_i − 1|, Newton steps)``. Raises
    :class:`MethodError` when ``f`` is unbounded below — some ``c ≥ 0, c ≠ 0`` has ``Gc = 0``, e.g. a base
    that is a (weighted) mean of the members, or a member equal to the base (``τ = 0``) — or when Newton
    does not converge in ``max_iter`` steps.
    """
    k = gram.detach().double()
    n = k.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.float64), 0.0, 0
    if tuple(k.shape) != (n, n) or not bool(torch.isfinite(k).all()):
        raise MethodError(f"the Gram matrix must be a finite square matrix, got shape {tuple(k.shape)}")
    k = (k + k.T) / 2
    c = float(torch.linalg.matrix_norm(k))
    if c == 0.0 or bool((k.diagonal() <= 0).any()):
        raise _unbounded("a task vector is zero (a member equals the base); leave such members out")
    kn = k / c
    a = kn.diagonal().rsqrt()

    def f(v: torch.Tensor) -> float:
        return float(0.5 * v @ kn @ v - v.log().sum())

    for it in range(max_iter + 1):
        ka = kn @ a
        res = float((a * ka - 1).abs().max())
        if res < tol:
            return a / math.sqrt(c), res, it
        if it == max_iter:
            break
        g = ka - 1 / a
        step = -torch.linalg.solve(kn + torch.diag(a.pow(-2)), g)
        slope = float(g @ step)  # = -(Newton decrement)^2 < 0
        t = 1.0
        neg = step < 0
        if bool(neg.any()):
            t = min(1.0, 0.99 * float((-a[neg] / step[neg]).min()))
        if -slope > 1e-14:  # Armijo backtracking; skipped at round-off level (quadratic convergence)
            f0 = f(a)
            while t > 1e-12 and f(a + t * step) > f0 + 1e-4 * t * slope:
                t *= 0.5
        a = a + t * step
        if float((t * step / a).abs().max()) < 1e-13:  # converged to round-off (ill-conditioned K)
            ka = kn @ a
            return a / math.sqrt(c), float((a * ka - 1).abs().max()), it + 1
        if float(a.max()) > UNBOUNDED * math.sqrt(n):
            raise _unbounded("the base is a non-negative combination of the members (e.g. their mean)")
    raise MethodError(
        f"Nash bargaining did not converge in {max_iter} Newton steps (residual {res:.3g}); the task vectors "
        "are nearly degenerate: merge fewer experts per group or use merge_experts"
    )


def _unbounded(why: str) -> MethodError:
    return MethodError(
        f"Nash bargaining has no solution: {why}, so GᵀG is singular along a non-negative direction and "
        "½αᵀGᵀGα − Σ log α is unbounded below (α diverges). Use a member as the base — NAMEx bargains over "
        "the task vectors τ_i = E_i − E_b of the other members relative to the most-used member b — and "
        "drop members with τ = 0"
    )


# ------------------------------------------------------------------------------------------ clustering
def pairwise_distance(features: torch.Tensor, metric: str) -> np.ndarray:
    """``[n, n]`` float64 distances between the rows of ``features``: ``1 − cos`` (a zero row is at
    distance 1 from everything) or Euclidean."""
    f = features.detach().double().flatten(1)
    if metric == "cosine":
        norm = f.norm(dim=1, keepdim=True)
        u = torch.where(norm > 0, f / norm.clamp_min(1e-300), torch.zeros_like(f))
        d = 1 - u @ u.T
    elif metric == "euclidean":
        d = torch.cdist(f, f)
    else:
        raise MethodError(f"unknown metric {metric!r}; use cosine or euclidean")
    d = d.clamp_min(0).numpy().copy()
    np.fill_diagonal(d, 0.0)
    return d


def average_linkage(
    features: torch.Tensor, n_groups: int, *, metric: str = "cosine", singletons: Iterable[int] = ()
) -> list[list[int]]:
    """Average-linkage agglomerative clustering of the rows of ``features`` into ``n_groups`` groups.

    ``singletons`` (protected experts) are groups of their own and never merge. Repeatedly merges the
    two closest clusters, the distance of clusters ``A``, ``B`` being the mean pairwise distance
    (Lance–Williams update); ties go to the pair with the lowest ids. Returns sorted member lists,
    ordered by their first id."""
    n = features.shape[0]
    fixed = sorted(set(int(e) for e in singletons))
    free = [e for e in range(n) if e not in set(fixed)]
    want = n_groups - len(fixed)
    if want < (1 if free else 0) or want > len(free):
        raise MethodError(
            f"cannot form {n_groups} groups from {n} experts with {len(fixed)} kept as singletons "
            f"({fixed}); choose between {len(fixed) + (1 if free else 0)} and {n} groups"
        )
    d = pairwise_distance(features[free], metric) if free else np.zeros((0, 0))
    np.fill_diagonal(d, np.inf)
    clusters: list[list[int] | None] = [[e] for e in free]
    size = np.ones(len(free))
    for _ in range(len(free) - want):
        flat = int(np.argmin(d))  # row-major: among ties the lowest (i, j); d is symmetric so i < j
        i, j = divmod(flat, d.shape[0])
        i, j = min(i, j), max(i, j)
        merged = (size[i] * d[i] + size[j] * d[j]) / (size[i] + size[j])
        d[i], d[:, i] = merged, merged
        d[i, i] = np.inf
        d[j], d[:, j] = np.inf, np.inf
        clusters[i] = sorted([*clusters[i], *clusters[j]])  # type: ignore[misc]
        clusters[j] = None
        size[i] += size[j]
    groups = [c for c in clusters if c is not None] + [[e] for e in fixed]
    return sorted(groups, key=lambda g: g[0])


def ward_linkage(
    features: torch.Tensor, n_groups: int, weights: torch.Tensor, *, singletons: Iterable[int] = ()
) -> list[list[int]]:
    """Weighted Ward clustering of the rows of ``features`` into ``n_groups`` groups.

    Merges, at every step, the two clusters whose union increases the weighted within-cluster sum of
    squares ``Σ_g Σ_{i∈g} w_i ‖x_i − μ_g‖²`` (``μ_g`` the ``w``-weighted mean) the least:
    ``Δ(a, b) = W_a W_b / (W_a + W_b) · ‖μ_a − μ_b‖²``. With ``x_i`` an expert's outputs on shared tokens
    and ``w_i`` its usage, this is the error of replacing each group by its usage-weighted average in
    function space — the merge loss to first order — so big groups of dissimilar experts cost what they
    should (average linkage chains near-equidistant experts into one group). Weights are floored at
    ``1e-6 · mean`` (unused experts merge first, at no cost). ``singletons`` as in :func:`average_linkage`;
    ties go to the pair with the lowest ids. Features are reduced to their ``n − 1`` principal
    dimensions first, which keeps every pairwise distance."""
    n = features.shape[0]
    fixed = sorted(set(int(e) for e in singletons))
    free = [e for e in range(n) if e not in set(fixed)]
    want = n_groups - len(fixed)
    if want < (1 if free else 0) or want > len(free):
        raise MethodError(
            f"cannot form {n_groups} groups from {n} experts with {len(fixed)} kept as singletons "
            f"({fixed}); choose between {len(fixed) + (1 if free else 0)} and {n} groups"
        )
    clusters, _ = _ward(features, weights, free, want)
    groups = clusters + [[e] for e in fixed]
    return sorted(groups, key=lambda g: g[0])


def ward_costs(
    features: torch.Tensor, weights: torch.Tensor, *, singletons: Iterable[int] = ()
) -> list[float]:
    """The increase ``Δ_m`` of the weighted within-cluster sum of squares at each merge ``m = 1, 2, …``
    that :func:`ward_linkage` makes (the same sequence: the groups for ``n_groups`` are the first
    ``n_free − want`` merges), down to one cluster of the non-singleton rows: ``n_free − 1`` values,
    non-decreasing (Ward's criterion is reducible). ``ward_linkage(f, n_free − m, w)`` costs
    ``Σ_{j≤m} Δ_j`` in that sum — the per-layer merge-loss curve :func:`allocate_merges` spends a
    budget on."""
    fixed = set(int(e) for e in singletons)
    free = [e for e in range(features.shape[0]) if e not in fixed]
    return _ward(features, weights, free, 1)[1] if free else []


def gram_features(gram: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` points whose pairwise squared distances are ``g_ii + g_jj − 2 g_ij`` for a Gram matrix
    ``g = F Fᵀ`` (float64): the centred Gram ``J g J`` factored by its eigendecomposition, negative
    eigenvalues (round-off) clamped to 0. :func:`ward_costs` / :func:`ward_linkage` see only pairwise
    distances, so they give on these points what they give on ``F`` itself (to round-off)."""
    g = gram.detach().double()
    g = (g + g.T) / 2
    n = g.shape[0]
    j = torch.eye(n, dtype=torch.float64) - 1.0 / max(n, 1)
    lam, u = torch.linalg.eigh(j @ g @ j)
    return u * lam.clamp_min(0).sqrt()


def _ward(
    features: torch.Tensor, weights: torch.Tensor, free: list[int], want: int
) -> tuple[list[list[int]], list[float]]:
    f = features.detach().double().flatten(1)[free] if free else torch.zeros(0, 1, dtype=torch.float64)
    if len(free) > 1:
        f = f - f.mean(0)
        u, sv, _ = torch.linalg.svd(f, full_matrices=False)
        f = u[:, : len(free) - 1] * sv[: len(free) - 1]
    w = weights.detach().double().flatten()[free] if free else torch.zeros(0, dtype=torch.float64)
    w = w.clamp_min(1e-6 * max(float(w.mean()) if len(w) else 1.0, 1e-300))
    clusters = [[e] for e in free]
    costs: list[float] = []
    mu, wt = f.clone(), w.clone()  # one row per live cluster
    sq = (mu[:, None, :] - mu[None, :, :]).pow(2).sum(-1)  # ‖μ_a − μ_b‖², all pairs; updated per merge
    while len(clusters) > want:
        m = len(clusters)
        d = wt[:, None] * wt[None, :] / (wt[:, None] + wt[None, :]) * sq
        d = d.masked_fill(~torch.ones(m, m, dtype=torch.bool).triu(1), float("inf"))
        lowest = d.min()
        costs.append(float(lowest))
        pairs = (d == lowest).nonzero().tolist()  # ties: the pair with the lowest ids
        i, j = min(pairs, key=lambda ij: (min(clusters[ij[0]]), min(clusters[ij[1]])))
        mu[i] = (wt[i] * mu[i] + wt[j] * mu[j]) / (wt[i] + wt[j])
        wt[i] += wt[j]
        clusters[i] = sorted(clusters[i] + clusters[j])
        del clusters[j]
        keep = torch.arange(m) != j
        mu, wt, sq = mu[keep], wt[keep], sq[keep][:, keep]
        i -= i > j
        sq[i] = sq[:, i] = (mu - mu[i]).pow(2).sum(-1)
    return clusters, costs


def allocate_merges(curves: dict[int, list[float]], merges: int) -> dict[int, int]:
    """Spend ``merges`` merges over layers: ``{layer: merges made there}`` minimising the summed cost,
    ``curves[l][m]`` the cost of layer ``l``'s ``(m+1)``-th merge (e.g. :func:`ward_costs` or measured
    merge errors, made comparable across layers), so ``m`` merges in layer ``l`` cost ``Σ_{j<m} c_l[j]``.
    Exact for any curves (not only convex ones): dynamic programming over layers on the cumulative
    costs, ``O(L · merges · E)``. Ties: fewer merges in the lower layer index. Raises
    :class:`MethodError` when the curves hold fewer than ``merges`` merges."""
    have = sum(len(c) for c in curves.values())
    if merges < 0 or merges > have:
        raise MethodError(f"cannot make {merges} merges: the layers allow between 0 and {have}")
    layers = sorted(curves)
    best = np.full(merges + 1, np.inf)
    best[0] = 0.0
    choice = []
    for k in layers:
        cum = np.concatenate([[0.0], np.cumsum(np.asarray(curves[k], dtype=np.float64))])
        new, arg = np.full(merges + 1, np.inf), np.zeros(merges + 1, dtype=np.int64)
        for m in range(min(len(cum) - 1, merges), -1, -1):  # ties: the smaller m wins (visited last)
            cand = np.full(merges + 1, np.inf)
            cand[m:] = best[: merges + 1 - m] + cum[m]
            better = cand <= new
            new[better], arg[better] = cand[better], m
        best = new
        choice.append(arg)
    done, left = {}, merges
    for k, arg in zip(reversed(layers), reversed(choice)):
        done[k] = int(arg[left])
        left -= done[k]
    return {k: done[k] for k in layers}


def budget_keep(total: int, ratio: float | None, total_experts: int | None) -> int:
    """Groups kept over all MoE layers: ``total_experts``, or ``total − round(ratio · total)`` (halves up)."""
    if ratio is not None:
        return total - math.floor(ratio * total + 0.5 + 1e-9)
    return int(total_experts)  # type: ignore[arg-type]


def allocate_groups(curves: dict[int, list[float]], experts: dict[int, int], keep: int) -> dict[int, int]:
    """``{layer: groups}`` keeping ``keep`` groups over the layers (``experts[l]`` each), the merges spent by
    :func:`allocate_merges`; :class:`MethodError` when the curves cannot reach ``keep``."""
    total = sum(experts.values())
    low = total - sum(len(c) for c in curves.values())
    if not low <= keep <= total:
        raise MethodError(f"the budget keeps {keep} of {total} experts; the layers allow {low} to {total}")
    done = allocate_merges(curves, total - keep)
    return {i: experts[i] - done[i] for i in sorted(curves)}


# ------------------------------------------------------------------------------- neuron weight matching
def linear_assignment(cost: np.ndarray) -> np.ndarray:
    """Minimum-cost perfect matching of a square matrix: ``perm`` with ``Σ_i cost[i, perm[i]]`` minimal.

    The Hungarian algorithm with potentials (Kuhn–Munkres, O(n³); the inner scans are vectorised), our
    own ~30 lines instead of a scipy dependency. About a second for n = 768 on one CPU core."""
    c = np.asarray(cost, dtype=np.float64)
    n = c.shape[0]
    if c.shape != (n, n):
        raise ValueError(f"linear_assignment needs a square matrix, got {c.shape}")
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    p = np.zeros(n + 1, dtype=np.int64)  # p[j]: row matched to column j (1-based; 0 = none)
    way = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        p[0], j0 = i, 0
        minv = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = p[j0]
            cur = c[i0 - 1] - u[i0] - v[1:]
            free = ~used[1:]
            better = free & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            cand = np.where(free, minv[1:], np.inf)
            j1 = int(np.argmin(cand)) + 1
            delta = cand[j1 - 1]
            u[p[used]] += delta
            v[used] -= delta
            minv[1:][free] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    perm = np.empty(n, dtype=np.int64)
    perm[p[1:] - 1] = np.arange(n)
    return perm


def neuron_features(p: Params) -> torch.Tensor:
    """``[I, 3H (+2)]``: per intermediate neuron, its gate row, up row, down column (and gate/up biases)."""
    cols = [p["gate"], p["up"], p["down"].T]
    cols += [p[k][:, None] for k in ("bias.gate", "bias.up") if k in p]
    return torch.cat(cols, dim=1)


def permute(p: Params, perm: torch.Tensor) -> Params:
    """The same expert with its intermediate neurons reordered (neuron ``i`` becomes old ``perm[i]``)."""
    out = {k: v for k, v in p.items()}
    for k in ("gate", "up", "bias.gate", "bias.up"):
        if k in p:
            out[k] = p[k][perm]
    out["down"] = p["down"][:, perm]
    return out


def match(base: Params, member: Params) -> torch.Tensor:
    """The permutation of ``member``'s neurons that matches ``base``'s (weight matching: maximise
    ``Σ_i ⟨f_b(i), f_m(π(i))⟩`` over permutations, ``f`` = :func:`neuron_features`)."""
    score = neuron_features(base).double() @ neuron_features(member).double().T
    return torch.from_numpy(linear_assignment(-score.numpy()))


def align_to(base: Params, member: Params) -> tuple[Params, int]:
    """``member`` with its neurons permuted to match ``base``'s (:func:`match`). The function the expert
    computes is unchanged. Returns the aligned member and how many neurons moved."""
    perm = match(base, member)
    return permute(member, perm), int((perm != torch.arange(len(perm))).sum())


# ------------------------------------------------------------------------------- expert parameters
def expert_params(bank: ExpertBank, e: int) -> Params:
    """Float32 copies of the parameters of physical expert ``e`` of a dense bank (copies even of a float32
    bank: :func:`sub_` may work on them in place)."""
    p = {name: getattr(bank, name).expert(e).to(torch.float32, copy=True) for name in ("gate", "up", "down")}
    p.update({f"bias.{k}": b[e].to(torch.float32, copy=True) for k, b in bank.biases.items()})
    return p


def combine(base: Params, deltas: list[Params], coeffs: Iterable[float]) -> Params:
    """``base + Σ_i c_i · delta_i`` (exactly ``base`` when every delta is zero)."""
    out = {k: v.clone() for k, v in base.items()}
    for d, c in zip(deltas, coeffs):
        if c:
            for k in out:
                out[k] += float(c) * d[k]
    return out


def sub(a: Params, b: Params) -> Params:
    return {k: a[k] - b[k] for k in a}


def sub_(a: Params, b: Params) -> Params:
    """``a − b`` in ``a``'s tensors (the bits of :func:`sub`, no second copy of ``a``)."""
    for k in a:
        a[k].sub_(b[k])
    return a


def dot(a: Params, b: Params) -> float:
    return float(sum((a[k].double().flatten() @ b[k].double().flatten()) for k in a))


def norm(a: Params) -> float:
    return math.sqrt(max(dot(a, a), 0.0))


def one_expert_bank(template: ExpertBank, p: Params) -> ExpertBank:
    """A one-expert dense bank holding ``p`` (activation and clamp settings of ``template``)."""
    return dataclasses.replace(
        template,
        gate=Dense(p["gate"][None]),
        up=Dense(p["up"][None]),
        down=Dense(p["down"][None]),
        widths=None,
        biases={k.removeprefix("bias."): v[None] for k, v in p.items() if k.startswith("bias.")},
    )


def params_forward(template: ExpertBank, p: Params, x: torch.Tensor) -> torch.Tensor:
    """Output ``[T, H]`` (float32) of the expert with parameters ``p`` on tokens ``x`` (differentiable)."""
    return expert_forward(one_expert_bank(template, p), 0, x.float()).float()
