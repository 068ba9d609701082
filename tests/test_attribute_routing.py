"""attribute_routing: the sub-scores sum to the router logits, the causal check, hubs into protection."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.methods.attribution import aarv, component_stats, norm_scale, ranks, sub_scores

EPS32 = torch.finfo(torch.float32).eps
CAL = {"source": "random", "samples": 8, "seq_len": 32, "batch_size": 4}


def _stream(c=4, t=50, h=16, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(c, t, h, generator=g, dtype=torch.float64) * torch.rand(
        c, 1, 1, generator=g, dtype=torch.float64
    )
    gamma = 0.5 + torch.rand(h, generator=g, dtype=torch.float64)
    z = parts.sum(0)
    x = gamma * z / (z.pow(2).mean(1, keepdim=True) + 1e-6).sqrt()  # RMSNorm with its epsilon
    return parts, x, torch.randn(e, h, generator=g, dtype=torch.float64)


def test_sub_scores_sum_to_the_logits_without_knowing_the_norm():
    parts, x, w = _stream()
    gamma, u, fit = norm_scale(x, parts.sum(0))
    assert fit < 1e-10  # rank-1 structure of RMSNorm recovered (γ and 1/RMS up to a shared scale)
    s = sub_scores(parts, gamma, u, w)
    logits = x @ w.T
    assert float((s.sum(0) - logits).norm() / logits.norm()) < 1e-10


def test_causal_check_and_influence_on_planted_components():
    parts, x, w = _stream()
    gamma, u, _ = norm_scale(x, parts.sum(0))
    s = sub_scores(parts, gamma, u, w)
    choice = x @ w.T
    flat = torch.ones_like(s[:1]) * 3.0  # the same sub-score for every expert: changes no ranking
    big = (choice * 100)[None]  # dominating: zeroing it reverses the order (rank of -99·choice)
    st = component_stats(torch.cat([s, flat, big]), choice, 2)
    assert float(st["influence"][-2]) == 0 and float(st["aarv"][-2]) == 0
    e = choice.shape[1]
    assert float(st["aarv"][-1]) == pytest.approx(
        e - 2, abs=1e-9
    )  # top-2 ranks 0, 1 -> e-1, e-2: (e-1 + e-3)/2
    assert float(st["selected"][-1]) > 0 and float(st["aps"][-1]) > 0 > float(st["ans"][-1])
    assert torch.equal(ranks(torch.tensor([[0.1, 0.3, 0.2]])), torch.tensor([[2, 0, 1]]))
    assert float(aarv(choice, torch.zeros_like(choice), 2)) == 0.0


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_end_to_end_sum_check_components_and_hub_protection(tmp_path, model):
    save_tiny(model, tmp_path / "m")
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": CAL,
           "steps": [{"attribute_routing": {"protect": 2}}, {"heapr": {"ratio": 0.25}}]}  # fmt: skip
    dry = mc.apply(rec, dry_run=True).report["dry_run"]
    assert dry["route_attrib_trace_bytes"] > 0
    mc.apply(rec, progress=False)
    rep = json.loads(next((tmp_path / "o" / "steps").glob("01-*/report.json")).read_text())
    s = rep["summary"]
    assert s["max_sum_error"] < 1e-4  # the acceptance: sub-scores sum to the logits, relative
    assert sum(len(v) for v in s["hubs"].values()) == 2
    ckpt = mc.open_checkpoint(tmp_path / "o")
    for layer, ids in s["hubs"].items():
        assert set(ids) <= set(ckpt.protected.get(int(layer), ()))  # heapr kept them bit-identical
    kinds = set().union(*(v.keys() for v in s["aarv_by_kind"].values()))
    assert {"embed", "attn", "moe"} <= kinds and (model != "gpt_oss" or "bias" in kinds)


def test_hub_score_mean_removes_the_early_layer_advantage():
    """Layer 0's experts reach two later routers, layer 1's one: summed pulls favour layer 0 by
    construction; ``hub_score: mean`` compares the pull per later router."""
    from moecompress.engine.spec import LayerStats
    from moecompress.methods.attribution import ATTRIB_TOKENS
    from moecompress.passes.attribute_routing import AttributeRoutingConfig, _plan

    pull0, pull1 = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 5.0])  # per later router, x ATTRIB_TOKENS
    hub = {0: torch.zeros(0, 2), 1: pull0[None], 2: torch.stack([pull0, pull1])}
    stats = {i: LayerStats(i, {"route_attrib_hub_aarv": h * ATTRIB_TOKENS}) for i, h in hub.items()}
    total = _plan(stats, AttributeRoutingConfig(protect=1))
    mean = _plan(stats, AttributeRoutingConfig(protect=1, hub_score="mean"))
    assert total[0]["hubs"] == [0] and total[1]["hubs"] == []  # 3 + 3 > 5
    assert mean[0]["hubs"] == [] and mean[1]["hubs"] == [1]  # 3 < 5 per later router
