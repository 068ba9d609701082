"""expert_structure, decompose: {method: auto}, tdmoe: {budget: from_structure}: oracles and decisions."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.spec import LayerStats
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.methods.structure import (
    effective_rank,
    overlap_matrix,
    projection_structure,
    singular_values,
)
from moecompress.methods.whitening import projection_whiteners
from moecompress.passes import BUILTIN_PASSES
from moecompress.testing import layer_statistics

E, W, H = 6, 16, 12
EPS64 = torch.finfo(torch.float64).eps


def _orth(n, k, g):
    return torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0]


def _low_rank_stack(r, shared: bool, seed=0, out=W, inn=H, m=E):
    """``m`` experts of rank ``r`` with unit singular values: one shared (U, V) or one each."""
    g = torch.Generator().manual_seed(seed)
    mats = []
    for e in range(m):
        if e == 0 or not shared:
            u, v = _orth(out, r, g), _orth(inn, r, g)
        mats.append(u @ v.T)
    return torch.stack(mats)


def _layer(gate, up, down, seed=0):
    g = torch.Generator().manual_seed(seed)
    bank = ExpertBank(Dense(gate.float()), Dense(up.float()), Dense(down.float()))
    spec = RouterSpec(num_experts=gate.shape[0], top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, torch.randn(gate.shape[0], gate.shape[2], generator=g), bank)


def _run(name, layer, **cfg):
    spec = BUILTIN_PASSES[name]
    c = spec.config(**cfg)
    needs = spec.needs_for(c)
    st = LayerStats.view(0, layer_statistics(layer, needs), needs)
    return spec.fn(layer, st, c), st


@pytest.mark.parametrize("r", [1, 3, 5])
def test_identical_experts_have_overlap_one_and_the_constructed_effective_rank(r):
    w = _low_rank_stack(r, shared=True)
    assert torch.equal(w[0], w[3])
    s = singular_values(w)
    tol = 1e3 * EPS64 * W  # SVD round-off of a [W, H] matrix
    assert torch.allclose(effective_rank(s), torch.full((E,), float(r), dtype=torch.float64), atol=tol * r)
    for side in ("out", "in"):
        ov = overlap_matrix(w, r, side)
        assert torch.allclose(ov, torch.ones(E, E, dtype=torch.float64), atol=tol)
    st = projection_structure(w, (0.4,))
    assert st["overlap_k"] == r and abs(st["overlap_out"] - 1) < tol and abs(st["overlap_in"] - 1) < tol


def test_independent_experts_overlap_like_random_subspaces():
    w = _low_rank_stack(2, shared=False, out=64, inn=64, m=8)
    ov = overlap_matrix(w, 2, "out")
    off = ov[~torch.eye(8, dtype=torch.bool)]
    assert float(off.mean()) < 0.2  # E[cos²] = k/d = 2/64 for random 2-planes in 64 dims
    assert torch.allclose(ov.diagonal(), torch.ones(8, dtype=torch.float64), atol=1e-10)


def test_effective_rank_follows_the_entropy_formula():
    s = torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    p = torch.tensor([0.75, 0.25], dtype=torch.float64)
    assert torch.allclose(
        effective_rank(s), torch.stack([(-(p * p.log()).sum()).exp(), torch.tensor(0.0).double()])
    )


def _shared_basis_layer(seed=0):
    """Experts sharing one input and output basis (upcycled-like), plus small noise."""
    g = torch.Generator().manual_seed(seed)

    def stack(out, inn):
        u, v = _orth(out, 4, g), _orth(inn, 4, g)
        return torch.stack(
            [u @ torch.randn(4, 4, generator=g, dtype=torch.float64) @ v.T for _ in range(E)]
        ) + 0.01 * torch.randn(E, out, inn, generator=g, dtype=torch.float64)

    return _layer(stack(W, H), stack(W, H), stack(H, W), seed)


def _random_layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    return _layer(*(torch.randn(E, *s, generator=g) for s in ((W, H), (W, H), (H, W))), seed)


def _whitened_residual(layer, new, st, members):
    wh = projection_whiteners(st, "input")
    out = {}
    for p in ("gate", "up", "down"):
        a = wh[p].whiten(getattr(layer.experts, p).dense()[members])
        b = wh[p].whiten(torch.stack([getattr(new.experts, p).expert(e) for e in members]))
        out[p] = float((a - b).pow(2).sum() / a.pow(2).sum())
    return out


@pytest.mark.parametrize("make", [_shared_basis_layer, _random_layer])
def test_predicted_residuals_equal_what_each_pass_achieves(make):
    layer = make()
    (_, info), _ = _run("expert_structure", layer, ratios=(0.4,))
    for method, name in (("tdmoe", "tdmoe"), ("svd_experts", "svd_experts")):
        (new, _), st2 = _run(name, layer, ratio=0.4)
        got = _whitened_residual(layer, new, st2, list(range(E)))
        for p, v in got.items():
            pred = info["projections"][p]["residual"]["0.4"][method]
            assert abs(pred - v) < 1e-4 * max(v, 1e-3), (method, p, pred, v)  # float32 weights stored


def test_auto_picks_the_shared_basis_where_experts_share_one_and_svd_where_not():
    (shared, info_s), _ = _run("decompose", _shared_basis_layer(), ratio=0.4)
    (indep, info_i), _ = _run("decompose", _random_layer(), ratio=0.4)
    assert info_s["method"] == "tdmoe" and shared.experts.gate.kind == "tucker"
    assert info_i["method"] == "svd_experts" and indep.experts.gate.kind == "lowrank"
    for info in (info_s, info_i):
        tot = info["predicted_residual"]
        assert tot[info["method"]] == min(tot.values())
    (forced, _), _ = _run("decompose", _random_layer(), ratio=0.4, method="tdmoe")
    (direct, _), _ = _run("tdmoe", _random_layer(), ratio=0.4)
    assert torch.equal(forced.experts.up.dense(), direct.experts.up.dense())


def test_from_structure_budget_never_stores_more_and_never_loses_whitened_energy():
    g = torch.Generator().manual_seed(3)
    # gate: shared rank-3 structure (cheap to keep); up/down: full rank (need the parameters)
    gate = _low_rank_stack(3, shared=True, seed=1).float() + 0.01 * torch.randn(E, W, H, generator=g)
    layer = _layer(gate, torch.randn(E, W, H, generator=g), torch.randn(E, H, W, generator=g))
    (uni, iu), st = _run("tdmoe", layer, ratio=0.4)
    (fs, ifs), _ = _run("tdmoe", layer, ratio=0.4, budget="from_structure")
    assert ifs["params_after"] <= iu["params_after"]
    r_u = sum(_whitened_residual(layer, uni, st, list(range(E))).values())
    r_f = sum(_whitened_residual(layer, fs, st, list(range(E))).values())
    assert r_f <= r_u + 1e-5
    assert ifs["projection_ratios"]["gate"] > 0.4  # the compressible projection gives parameters away


def test_recipe_runs_reports_and_refuses_pruned_input(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    cal = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": cal,
           "steps": [{"expert_structure": {"ratios": [0.4]}}, {"decompose": {"ratio": 0.4}}]}  # fmt: skip
    mc.apply(rec, progress=False)
    rep = json.loads(next((tmp_path / "o" / "steps").glob("02-*/report.json")).read_text())
    assert set(rep["summary"]["choice"].values()) <= {"tdmoe", "svd_experts"} and rep["summary"]["choice"]
    assert abs(rep["summary"]["routed_fraction_removed"] - 0.4) < 0.02
    mc.load(tmp_path / "o")
    bad = {**rec, "steps": [{"heapr": {"ratio": 0.25}}, {"decompose": {"ratio": 0.4}}]}
    with pytest.raises(mc.errors.MoecompressError, match="decompose"):
        mc.apply({**bad, "output": str(tmp_path / "x")}, dry_run=True)


def test_override_replaces_the_choice_in_one_layer():
    (new, info), _ = _run("decompose", _random_layer(), ratio=0.4, override={0: "tdmoe"})
    assert (
        info["predicted"] == "svd_experts" and info["method"] == "tdmoe" and new.experts.gate.kind == "tucker"
    )
