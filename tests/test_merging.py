"""moecompress.methods.merging: the Nash-bargaining solver, average-linkage clustering and neuron weight matching."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from moecompress.errors import MethodError
from moecompress.ir import ExpertBank
from moecompress.layouts.dense import Dense
from moecompress.methods.merging import (
    align_to,
    average_linkage,
    expert_params,
    linear_assignment,
    nash_weights,
    params_forward,
    permute,
)


def _residual(g: torch.Tensor, a: torch.Tensor) -> float:
    """max_j |((GᵀG)α)_j α_j − 1|, computed independently of the solver."""
    return float(((g.T @ g) @ a * a - 1).abs().max())


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_solver_on_random_task_vectors(n, seed):
    g = torch.randn(40, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * (seed + 0.1)
    a, res, it = nash_weights(g.T @ g)
    assert bool((a > 0).all()) and _residual(g, a) < 1e-6 and res < 1e-6 and 0 <= it <= 20


@pytest.mark.parametrize("eps", [1e-2, 1e-4, 1e-6])
def test_solver_on_nearly_collinear_task_vectors(eps):
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(200, 1, generator=gen, dtype=torch.float64)
    g = v * torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64) + eps * torch.randn(200, 4, generator=gen,
                                                                                        dtype=torch.float64)  # fmt: skip
    a, res, _ = nash_weights(g.T @ g)
    assert bool((a > 0).all()) and _residual(g, a) < 1e-6 and res < 1e-6


def test_orthogonal_task_vectors_get_inverse_norms():
    q, _ = torch.linalg.qr(
        torch.randn(30, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    )
    norms = torch.tensor([0.5, 1.0, 3.0, 40.0], dtype=torch.float64)
    a, _, _ = nash_weights((q * norms).T @ (q * norms))
    assert torch.allclose(a, 1 / norms, rtol=1e-9, atol=0)


def test_a_base_at_the_mean_of_the_members_is_rejected():
    """Base = mean of the members ⇒ the task vectors sum to zero: f is unbounded below."""
    members = torch.randn(3, 50, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g = (members - members.mean(0)).T  # τ_i = E_i − mean
    with pytest.raises(
        MethodError, match=r"no solution: the base is a non-negative combination .*\(e\.g\. their mean\)"
    ):
        nash_weights(g.T @ g)
    weighted = (members - torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64) @ members).T
    with pytest.raises(MethodError, match="unbounded below"):
        nash_weights(weighted.T @ weighted)
    with pytest.raises(MethodError, match="a task vector is zero"):
        nash_weights(torch.zeros(2, 2, dtype=torch.float64))
    assert nash_weights(torch.zeros(0, 0))[0].numel() == 0


def test_linear_assignment_is_optimal():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 4, 6):
        for _ in range(10):
            c = rng.normal(size=(n, n)).round(1)  # ties included
            perm = linear_assignment(c)
            best = min(sum(c[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
            assert sorted(perm.tolist()) == list(range(n)) and abs(c[np.arange(n), perm].sum() - best) < 1e-9


def test_alignment_undoes_a_neuron_permutation_and_keeps_the_function():
    gen = torch.Generator().manual_seed(6)
    bank = ExpertBank(Dense(torch.randn(1, 16, 8, generator=gen)), Dense(torch.randn(1, 16, 8, generator=gen)),
                      Dense(torch.randn(1, 8, 16, generator=gen)))  # fmt: skip
    base = expert_params(bank, 0)
    perm = torch.randperm(16, generator=gen)
    shuffled = permute(base, perm)
    x = torch.randn(5, 8, generator=gen)
    assert torch.allclose(params_forward(bank, shuffled, x), params_forward(bank, base, x), atol=1e-5)
    aligned, moved = align_to(base, shuffled)
    assert moved == int((perm != torch.arange(16)).sum()) > 0 and all(
        torch.equal(aligned[k], base[k]) for k in base
    )
    assert align_to(base, base)[1] == 0


def test_average_linkage_known_clusters_singletons_and_ties():
    f = torch.tensor([[1.0, 0], [0.99, 0.1], [0, 1.0], [0.1, 0.99], [-1.0, 0], [-0.98, -0.05]])
    assert average_linkage(f, 3) == [[0, 1], [2, 3], [4, 5]]
    assert average_linkage(f, 3, singletons=[1]) == [[0, 2, 3], [1], [4, 5]]
    assert average_linkage(f, 6) == [[e] for e in range(6)]
    assert average_linkage(f, 2, metric="euclidean") == [[0, 1, 2, 3], [4, 5]]
    same = torch.ones(4, 3)  # all distances 0: ties merge the lowest ids first
    assert average_linkage(same, 3) == [[0, 1], [2], [3]]
    with pytest.raises(MethodError, match=r"cannot form 1 groups from 6 experts with 1 kept as singletons"):
        average_linkage(f, 1, singletons=[0])
