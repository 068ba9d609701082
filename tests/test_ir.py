"""The canonical IR and reference forward: validation, widths, expert maps, meta tensors."""

from __future__ import annotations

import pytest
import torch

import moecompress as mc
from moecompress.ir import Act, ExpertBank, Gating, GroupScore, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.reference import expert_forward


def _layer(e=6, i=16, h=12, k=2, seed=0, **kw) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    bank = ExpertBank(*(Dense(torch.randn(s, generator=g) * 0.3) for s in ((e, i, h), (e, i, h), (e, h, i))))
    spec = kw.pop("router", RouterSpec(num_experts=e, top_k=k, gating=Gating.SOFTMAX_TOPK, norm_topk=True))
    return MoELayer(index=0, router=spec, router_weight=torch.randn(e, h, generator=g), experts=bank, **kw)


def test_router_spec_validation():
    with pytest.raises(mc.LayoutError, match="top_k=9 must be in"):
        RouterSpec(num_experts=8, top_k=9, gating=Gating.SOFTMAX_TOPK)
    with pytest.raises(mc.LayoutError, match="not divisible by n_group"):
        RouterSpec(8, 2, Gating.SIGMOID, n_group=3, topk_group=1, group_score=GroupScore.TOP2_SUM)
    with pytest.raises(mc.LayoutError, match="top_k=5 cannot be met"):
        RouterSpec(8, 5, Gating.SIGMOID, n_group=4, topk_group=2, group_score=GroupScore.TOP2_SUM)


def test_bank_and_layer_shape_validation():
    w = torch.zeros(4, 8, 6)
    with pytest.raises(mc.LayoutError, match="down shape"):
        ExpertBank(Dense(w), Dense(w), Dense(torch.zeros(4, 6, 7)))
    with pytest.raises(mc.LayoutError, match="Dense layout needs a 3-D"):
        Dense(torch.zeros(4, 8))
    layer = _layer()
    with pytest.raises(mc.LayoutError, match="router weight"):
        layer.replace(router_weight=torch.zeros(5, 12))
    with pytest.raises(mc.LayoutError, match="protected ids"):
        layer.replace(protected=frozenset({6}))
    with pytest.raises(mc.LayoutError, match="expert_map"):
        layer.replace(expert_map=torch.tensor([0, 1, 2, 3, 4, 9]))
    with pytest.raises(ValueError, match=r"expects x of shape \[T, 12\]"):
        mc.moe_forward(layer, torch.zeros(3, 11))


def test_widths_equal_zeroed_down_columns():
    layer = _layer()
    widths = torch.tensor([16, 3, 9, 16, 1, 12])
    down = layer.experts.down.weight.clone()
    for e, w in enumerate(widths.tolist()):
        down[e, :, w:] = 0
    pruned = layer.replace(
        experts=ExpertBank(layer.experts.gate, layer.experts.up, layer.experts.down, widths=widths)
    )
    zeroed = layer.replace(experts=ExpertBank(layer.experts.gate, layer.experts.up, Dense(down)))
    x = torch.randn(40, 12)
    torch.testing.assert_close(mc.moe_forward(pruned, x), mc.moe_forward(zeroed, x), rtol=0, atol=1e-6)
    assert not torch.allclose(mc.moe_forward(pruned, x), mc.moe_forward(layer, x))


def test_expert_map_equals_duplicated_experts():
    layer = _layer()
    ex = layer.experts
    keep = [0, 2, 3, 4, 5]  # logical 1 runs physical 0 (expert 0's weights)
    mapped = layer.replace(
        experts=ExpertBank(*(Dense(lay.weight[keep]) for lay in (ex.gate, ex.up, ex.down))),
        expert_map=torch.tensor([0, 0, 1, 2, 3, 4]),
    )
    dup = [0, 0, 2, 3, 4, 5]
    copied = layer.replace(experts=ExpertBank(*(Dense(lay.weight[dup]) for lay in (ex.gate, ex.up, ex.down))))
    x = torch.randn(50, 12)
    torch.testing.assert_close(mc.moe_forward(mapped, x), mc.moe_forward(copied, x), rtol=1e-6, atol=1e-6)
    identity = layer.replace(expert_map=torch.arange(6))
    torch.testing.assert_close(mc.moe_forward(identity, x), mc.moe_forward(layer, x), rtol=0, atol=0)


def test_route_semantics():
    layer = _layer(k=3)
    x = torch.randn(20, 12)
    ids, w = mc.route(layer, x)
    assert ids.shape == (20, 3) and torch.allclose(w.sum(-1), torch.ones(20))
    probs = (x @ layer.router_weight.T).softmax(-1)
    assert torch.equal(ids.sort(-1).values, probs.topk(3).indices.sort(-1).values)
    sig = _layer(
        router=RouterSpec(6, 2, Gating.SIGMOID, norm_topk=False, routed_scale=2.0),
        score_bias=torch.tensor([9.0, 0, 0, 0, 0, 0]),
    )
    ids, w = mc.route(sig, x)
    assert (ids == 0).any(-1).all(), "the selection-only bias forces expert 0 into every top-k"
    assert torch.allclose(w[ids == 0], 2.0 * torch.sigmoid(x @ sig.router_weight[0]))


def test_shared_expert_and_gate():
    layer = _layer()
    g = torch.Generator().manual_seed(5)
    shared = ExpertBank(*(Dense(torch.randn(s, generator=g)) for s in ((1, 8, 12), (1, 8, 12), (1, 12, 8))))
    gate = torch.randn(1, 12, generator=g)
    x = torch.randn(10, 12)
    with_shared = mc.moe_forward(layer.replace(shared=shared, shared_gate=gate), x)
    expect = mc.moe_forward(layer, x) + torch.sigmoid(x @ gate.T) * expert_forward(shared, 0, x)
    torch.testing.assert_close(with_shared, expect, rtol=1e-5, atol=1e-6)


def test_clamped_swiglu():
    layer = _layer()
    ex = layer.experts
    clamped = ExpertBank(ex.gate, ex.up, ex.down, act=Act.SWIGLU_CLAMPED, alpha=1.702, limit=0.5)
    x = torch.randn(5, 12) * 4
    g, u = x @ ex.gate.weight[1].T, x @ ex.up.weight[1].T
    g, u = g.clamp(max=0.5), u.clamp(-0.5, 0.5)
    want = ((u + 1) * g * torch.sigmoid(1.702 * g)) @ ex.down.weight[1].T
    torch.testing.assert_close(expert_forward(clamped, 1, x), want, rtol=1e-5, atol=1e-6)


def test_meta_tensors_build_a_layer_for_dry_runs():
    e, i, h = 4, 8, 6
    bank = ExpertBank(*(Dense(torch.empty(s, device="meta")) for s in ((e, i, h), (e, i, h), (e, h, i))))
    spec = RouterSpec(e, 2, Gating.SOFTMAX_TOPK)
    layer = MoELayer(
        0,
        spec,
        torch.empty(e, h, device="meta"),
        bank,
        expert_map=torch.empty(e, dtype=torch.long, device="meta"),
    )
    assert layer.num_params() == e * h + 3 * e * i * h
    assert layer.experts.gate.nbytes() == e * i * h * 4


def test_layout_dense_round_trip_through_tensors_and_meta():
    d = Dense(torch.randn(3, 4, 5))
    again = Dense.from_tensors(d.tensors(), d.meta())
    assert torch.equal(again.weight, d.weight)
    assert d.meta() == {"kind": "dense", "shape": [3, 4, 5], "dtype": "float32"}
