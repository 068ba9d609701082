"""merge_experts: the average / frequency baselines on namex's grouping (shared oracles live in test_namex)."""

from __future__ import annotations

import json

import pytest
import torch
from test_namex import CAL, IDS, PROJ, make_layer, make_stats
from tiny import save_tiny
from transformers import AutoConfig, AutoModelForCausalLM

import moecompress as mc
from moecompress.engine.spec import LayerStats
from moecompress.passes.merge_experts import MergeExpertsConfig, merge_experts
from moecompress.passes.namex import NamexConfig, namex


@pytest.mark.parametrize("method", ["average", "frequency"])
def test_weights_are_uniform_or_usage_shares(method):
    layer = make_layer(seed=4)
    stats = make_stats(layer)
    counts = torch.tensor([5.0, 0, 9, 3, 3, 7, 1, 2])
    stats = LayerStats(0, {**stats.tensors, "expert_counts": counts})
    new, info = merge_experts(layer, stats, MergeExpertsConfig(target_experts=6, method=method, align=False))
    merged = [(g, m) for g, m in enumerate(info["groups"]) if len(m) > 1]
    assert len(merged) in (1, 2) and info["weights"].keys() == {str(g) for g, _ in merged}
    for g, members in merged:
        b = info["bases"][g]
        assert b == max(members, key=lambda e: (float(counts[e]), -e))  # most used, ties to the lower id
        order = [b, *(e for e in members if e != b)]
        c = counts[order]
        want = (
            c / c.sum()
            if method == "frequency" and float(c.sum())
            else torch.full((len(order),), 1 / len(order))
        )
        assert info["weights"][str(g)] == pytest.approx(want.tolist())
        for proj in PROJ:
            w = getattr(layer.experts, proj).dense()
            expect = sum(float(a) * w[e] for a, e in zip(want, order))
            torch.testing.assert_close(getattr(new.experts, proj).expert(g), expect, rtol=0, atol=1e-6)


def test_same_grouping_as_namex():
    layer = make_layer(seed=5)
    stats = make_stats(layer)
    for kw in ({"ratio": 0.5}, {"ratio": 0.25, "similarity": "weight", "metric": "euclidean"},
               {"target_experts": 3, "similarity": "router"}):  # fmt: skip
        _, a = merge_experts(layer, stats, MergeExpertsConfig(**kw))
        _, b = namex(layer, stats, NamexConfig(**kw))
        assert a["groups"] == b["groups"] and a["bases"] == b["bases"]


def test_collapse_writes_a_stock_checkpoint(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    cfg = {"ratio": 0.25, "method": "frequency", "router": "collapse", "collapse_row": "mean"}
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "out"),
           "calibration": {**CAL, "cache_dir": str(tmp_path / "cache")}, "steps": [{"merge_experts": cfg}]}  # fmt: skip
    res = mc.apply(rec, progress=False)
    disk = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in disk and AutoConfig.from_pretrained(tmp_path / "out").num_experts == 6
    rep = json.loads(next((tmp_path / "out" / "steps").glob("01-*/report.json")).read_text())
    assert rep["summary"]["routed_fraction_removed"] == 0.25 and rep["summary"]["method"] == "frequency"
    from test_namex import _in_memory_logits

    want, _ = _in_memory_logits(tmp_path, res, merge_experts, MergeExpertsConfig(**cfg))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(IDS).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
