"""namex (and the shared merging machinery): oracles on synthetic layers, router remap/collapse, protection,
refinement, and checkpoints written, loaded and sized end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from tiny import save_tiny
from transformers import AutoConfig, AutoModelForCausalLM

import moecompress as mc
from moecompress.calibration.cache import load_layer
from moecompress.engine.protection import protection_violations
from moecompress.engine.spec import LayerStats
from moecompress.errors import PassError
from moecompress.ir import ExpertBank, Gating, GroupScore, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.passes.expert_merging import check_mergeable
from moecompress.passes.merge_experts import MergeExpertsConfig, merge_experts
from moecompress.passes.namex import GRID, NamexConfig, namex
from moecompress.reference import moe_forward, route

CAL = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
PROJ = ("gate", "up", "down")


def make_layer(e=8, i=16, h=12, k=2, seed=0, copies=(), router=None, **kw) -> MoELayer:
    """A random layer; experts in ``copies`` are exact copies of ``copies[0]``."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(s, generator=g) * 0.3 for s in ((e, i, h), (e, i, h), (e, h, i))]
    for w in ws:
        for c in copies[1:]:
            w[c] = w[copies[0]]
    spec = router or RouterSpec(num_experts=e, top_k=k, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, torch.randn(e, h, generator=g), ExpertBank(*map(Dense, ws)), **kw)


def make_stats(layer: MoELayer, n=64, seed=1) -> LayerStats:
    x = torch.randn(n, layer.hidden_size, generator=torch.Generator().manual_seed(seed))
    ids, _ = route(layer, x)
    counts = torch.bincount(ids.flatten(), minlength=layer.router.num_experts).float()
    return LayerStats(0, {"expert_counts": counts, "io_sample_x": x})


PASSES = {
    "namex": lambda **kw: (namex, NamexConfig(**kw)),
    "average": lambda **kw: (merge_experts, MergeExpertsConfig(method="average", **kw)),
    "frequency": lambda **kw: (merge_experts, MergeExpertsConfig(method="frequency", **kw)),
}


@pytest.mark.parametrize("name", list(PASSES))
@pytest.mark.parametrize("align", [True, False])
def test_merging_identical_experts_is_lossless(name, align):
    layer = make_layer(copies=(1, 4, 6))
    fn, cfg = PASSES[name](target_experts=6, align=align)
    new, info = fn(layer, make_stats(layer), cfg)
    assert [1, 4, 6] in info["groups"] and new.experts.num_experts == 6
    p = int(new.expert_map[1])
    assert new.expert_map[4] == p and new.expert_map[6] == p
    for proj in PROJ:  # the merged expert is bit-identical to the copies
        assert torch.equal(getattr(new.experts, proj).expert(p), getattr(layer.experts, proj).expert(1))
    x = torch.randn(50, 12, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(moe_forward(new, x), moe_forward(layer, x), rtol=0, atol=1e-6)
    assert info["rel_error_held"] < 1e-6


@pytest.mark.parametrize("name", list(PASSES))
def test_singletons_are_unchanged_and_no_grouping_is_exact(name):
    layer = make_layer()
    fn, cfg = PASSES[name](ratio=0.25)
    new, info = fn(layer, make_stats(layer), cfg)
    singles = [g for g in info["groups"] if len(g) == 1]
    assert len(info["groups"]) == 6 and singles
    for (e,) in singles:
        for proj in PROJ:
            assert torch.equal(
                getattr(new.experts, proj).expert(new.physical(e)), getattr(layer.experts, proj).expert(e)
            )
    fn, cfg = PASSES[name](target_experts=8)  # every expert its own group: the layer itself
    same, info = fn(layer, make_stats(layer), cfg)
    x = torch.randn(50, 12)
    assert torch.equal(moe_forward(same, x), moe_forward(layer, x)) and info["groups"] == [
        [e] for e in range(8)
    ]


def test_a_two_member_group_follows_the_nash_formula():
    layer = make_layer()
    new, info = namex(layer, make_stats(layer), NamexConfig(target_experts=7, align=False, refine_steps=0))
    (grp,) = info["merged_groups"]
    b, (m,) = grp["base"], [e for e in grp["members"] if e != grp["base"]]
    tau = {p: getattr(layer.experts, p).expert(m) - getattr(layer.experts, p).expert(b) for p in PROJ}
    tnorm = float(sum(t.double().pow(2).sum() for t in tau.values()).sqrt())
    assert grp["alpha"] == pytest.approx([1 / tnorm], rel=1e-9)  # one task vector: α = 1/‖τ‖
    f = grp["frequencies"]
    assert grp["gamma0"] == pytest.approx(f[1] * tnorm, rel=1e-6)  # ‖f τ‖ / ‖α τ‖
    assert grp["group_error_by_gamma"][GRID.index(grp["gamma_rel"])] == min(grp["group_error_by_gamma"])
    p = int(new.expert_map[b])
    for proj in PROJ:
        want = getattr(layer.experts, proj).expert(b) + grp["gamma"] * grp["alpha"][0] * tau[proj]
        torch.testing.assert_close(getattr(new.experts, proj).expert(p), want, rtol=0, atol=1e-6)
    assert grp["solver_residual"] < 1e-6 and info["bases"][info["groups"].index(grp["members"])] == b


@pytest.mark.parametrize("router", ["remap", "collapse"])
@pytest.mark.parametrize("name", list(PASSES))
def test_protected_experts_stay_singletons_and_identical(router, name):
    layer = make_layer(protected=frozenset({1, 4}))
    fn, cfg = PASSES[name](ratio=0.5, router=router)
    new, info = fn(layer, make_stats(layer), cfg)
    assert [1] in info["groups"] and [4] in info["groups"] and new.experts.num_experts == 4
    assert protection_violations(layer, new, info.get("kept_experts")) == []
    assert len(new.protected) == 2


def test_collapse_router_rows_follow_the_rule():
    layer = make_layer(router=RouterSpec(8, 2, Gating.SOFTMAX_TOPK), router_bias=torch.randn(8))
    stats = make_stats(layer)
    new, info = namex(layer, stats, NamexConfig(ratio=0.5, router="collapse"))
    assert new.expert_map is None and new.router.num_experts == 4 and info["kept_experts"] == info["bases"]
    assert torch.equal(new.router_weight, layer.router_weight[info["bases"]])
    assert torch.equal(new.router_bias, layer.router_bias[info["bases"]])
    mean, info2 = namex(layer, stats, NamexConfig(ratio=0.5, router="collapse", collapse_row="mean"))
    assert info2["groups"] == info["groups"]
    for g, members in enumerate(info["groups"]):
        torch.testing.assert_close(mean.router_weight[g], layer.router_weight[members].mean(0))
        torch.testing.assert_close(mean.router_bias[g], layer.router_bias[members].mean(0))
    assert info["bytes_after"] < info["bytes_before"]


def test_group_limited_collapse_keeps_routing_groups_equal():
    spec = RouterSpec(
        16, 3, Gating.SIGMOID, norm_topk=True, n_group=4, topk_group=2, group_score=GroupScore.TOP2_SUM
    )
    layer = make_layer(e=16, router=spec, score_bias=torch.randn(16) * 0.1)
    new, info = namex(layer, make_stats(layer), NamexConfig(target_experts=8, router="collapse"))
    assert all(len({m // 4 for m in grp}) == 1 for grp in info["groups"])  # never across routing groups
    assert [g[0] // 4 for g in info["groups"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert new.router.n_group == 4 and new.score_bias.shape == (8,)
    # remap: routing is unchanged, so any count and any grouping across routing groups
    remap, info = namex(layer, make_stats(layer), NamexConfig(target_experts=5))
    assert remap.router is layer.router and remap.experts.num_experts == 5
    for target, match in [(6, r"target_experts=6 keeps 6 experts, not a multiple of n_group=4"),
                          (4, r"keeps 1 experts per routing group; the topk_group=2 best groups then reach 2 < top_k=3")]:  # fmt: skip
        with pytest.raises(PassError, match=match):
            check_mergeable(layer, NamexConfig(target_experts=target, router="collapse"))


def test_impossible_settings_fail_with_the_field_named():
    layer = make_layer()
    with pytest.raises(
        PassError, match=r"target_experts=1 keeps 1 experts, fewer than top_k=2: .*router: remap"
    ):
        check_mergeable(layer, NamexConfig(target_experts=1, router="collapse"))
    with pytest.raises(PassError, match=r"target_experts=9 keeps 9 of the layer's 8 experts"):
        check_mergeable(layer, MergeExpertsConfig(target_experts=9))
    with pytest.raises(PassError, match="already merged"):
        check_mergeable(layer.replace(expert_map=torch.arange(8)), NamexConfig(ratio=0.25))
    guarded = layer.replace(protected=frozenset(range(6)))
    with pytest.raises(PassError, match=r"ratio=0.5 keeps 4 groups .* 6 of them are protected"):
        check_mergeable(guarded, NamexConfig(ratio=0.5))
    for bad in ({}, {"ratio": 0.25, "target_experts": 4}):
        with pytest.raises(ValidationError, match="exactly one of ratio"):
            NamexConfig(**bad)
    with pytest.raises(ValidationError, match="gamma_grid"):
        NamexConfig(ratio=0.25, gamma_grid=(0.5, -1.0))


def test_refinement_compares_complex_and_real_momentum():
    layer = make_layer(seed=3)
    stats = make_stats(layer, n=128)
    _, info0 = namex(layer, stats, NamexConfig(ratio=0.5))
    _, info = namex(layer, stats, NamexConfig(ratio=0.5, refine_steps=8, lr=0.02))
    assert info["rel_error_unrefined"] == pytest.approx(info0["rel_error_held"])
    assert {"rel_error_refined", "rel_error_refined_real", "refine_fit_loss"} <= set(info)
    assert info["rel_error_refined"] != info["rel_error_refined_real"]  # φ = 15° vs 0° differ
    assert info["rel_error_held"] == min(info["rel_error_unrefined"], info["rel_error_refined"])
    losses = info["refine_fit_loss"]["complex"]
    assert all(last <= first for first, last in losses.values())  # the best iterate is kept
    assert info["refined"] == (info["rel_error_refined"] < info["rel_error_unrefined"])


# ------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("namex")
    save_tiny("mixtral", root / "m")
    return root


def _apply(root: Path, out: str, step: dict, **kw):
    rec = {"model": str(root / "m"), "output": str(root / out), "steps": [step],
           "calibration": {**CAL, "cache_dir": str(root / "cache")}}  # fmt: skip
    return mc.apply(rec, progress=False, **kw), root / out


def _in_memory_logits(root: Path, res, fn, cfg):
    """The original model with each MoE block replaced by the pass's in-memory result (reference forward)."""
    ckpt = mc.open_checkpoint(root / "m")
    model = AutoModelForCausalLM.from_pretrained(root / "m").eval()
    entry = res.cache_entry
    layers = {}
    for i in ckpt.moe_layer_indices:
        layers[i], _ = fn(ckpt.read_layer(i), LayerStats(i, load_layer(entry, i)), cfg)

        def fwd(h, new=layers[i]):
            return mc.moe_forward(new, h.reshape(-1, h.shape[-1])).reshape(h.shape)

        getattr(model.model.layers[i], ckpt.adapter.module_attr).forward = fwd
    with torch.no_grad():
        return model(IDS).logits, layers


def _expert_bytes(path: Path) -> int:
    t = load_file(path / "model.safetensors")
    return sum(
        v.numel() * v.element_size() for k, v in t.items() if ".experts." in k and "expert_map" not in k
    )


def test_remap_checkpoint_loads_with_its_expert_map_and_scales_in_bytes(tiny):
    cfg = {"ratio": 0.5, "refine_steps": 2}
    res, out = _apply(tiny, "remap", {"namex": cfg})
    disk = json.loads((out / "config.json").read_text())
    assert disk["quantization_config"]["quant_method"] == "moecompress"
    want, layers = _in_memory_logits(tiny, res, namex, NamexConfig(**cfg))
    loaded = mc.open_checkpoint(out)
    for i, layer in layers.items():
        got = loaded.read_layer(i)
        assert torch.equal(got.expert_map, layer.expert_map) and got.experts.num_experts == 4
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out).eval()(IDS).logits
    assert float((logits - want).abs().max() / want.abs().max()) < 1e-5
    assert _expert_bytes(out) * 2 == _expert_bytes(tiny / "m")  # physical experts 4 of 8, stored once
    rep = json.loads(next((out / "steps").glob("01-*/report.json")).read_text())
    assert rep["summary"]["routed_fraction_removed"] == 0.5 and rep["summary"]["experts_per_layer"] == 4


def test_collapse_checkpoint_is_stock(tiny):
    cfg = {"target_experts": 5, "router": "collapse", "similarity": "router"}
    res, out = _apply(tiny, "collapse", {"namex": cfg})
    disk = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in disk and AutoConfig.from_pretrained(out).num_local_experts == 5
    want, _ = _in_memory_logits(tiny, res, namex, NamexConfig(**cfg))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out).eval()(IDS).logits
    assert float((logits - want).abs().max() / want.abs().max()) < 1e-5
    assert _expert_bytes(out) * 8 == _expert_bytes(tiny / "m") * 5


def test_impossible_recipes_fail_in_the_dry_run(tiny):
    for step, match in [
        (
            {"namex": {"target_experts": 1, "router": "collapse"}},
            r"step 1 \(namex\), layer 0: target_experts=1",
        ),
        ({"merge_experts": {"ratio": 0.95}}, r"step 1 \(merge_experts\), layer 0: ratio=0.95 keeps 0"),
    ]:
        with pytest.raises(PassError, match=match):
            _apply(tiny, "never", step, dry_run=True)


def test_a_large_group_made_again_from_the_bank_gives_the_held_groups_bits(monkeypatch):
    """A group of more than HOLD_MEMBERS members makes its task vectors again when they are needed instead
    of holding them (the Gram, the two directions): the merged experts and the report are the same bits."""
    from moecompress.passes import namex as nx

    layer = make_layer(seed=7, copies=(1, 6))
    stats = make_stats(layer, n=96)
    cfg = nx.NamexConfig(ratio=0.75, refine_steps=0)  # 8 experts -> 2 groups: one of 7
    streamed, info = nx.namex(layer, stats, cfg)
    assert max(len(g) for g in info["groups"]) > nx.HOLD_MEMBERS
    monkeypatch.setattr(nx, "HOLD_MEMBERS", 100)  # every group held
    held, info_held = nx.namex(layer, stats, cfg)
    for p in ("gate", "up", "down"):
        assert torch.equal(getattr(streamed.experts, p).dense(), getattr(held.experts, p).dense()), p
    assert info["merged_groups"] == info_held["merged_groups"]
