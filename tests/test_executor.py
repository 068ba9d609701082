"""End-to-end recipe runs on tiny checkpoints: identity is lossless, reports, cache, emit, propagate."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.engine.spec import PassConfig, PassSpec
from moecompress.errors import PassError
from moecompress.ir import ExpertBank
from moecompress.layouts.dense import Dense

CAL = {"source": "random", "samples": 6, "seq_len": 16, "batch_size": 3}


class _FailCfg(PassConfig):
    layer: int = 1


def _fail(layer, stats, cfg):
    """Test-only: fails on one layer."""
    if layer.index == cfg.layer:
        raise PassError("deliberate failure")
    return layer, {}


class _ZeroCfg(PassConfig):
    pass


def _zero(layer, stats, cfg):
    """Test-only: zeroes expert 0's down projection (a lossy step with a visible error)."""
    w = layer.experts.down.weight.clone()
    w[0] = 0
    bank = ExpertBank(layer.experts.gate, layer.experts.up, Dense(w))
    return layer.replace(experts=bank), {"act_sq_sum": float(stats["act_sq_mean"].sum())}


# test-only steps, given to apply() as plugins (nothing is registered process-wide)
PASSES = [
    PassSpec("test_fail_at_layer", _FailCfg, _fail),
    PassSpec("test_zero_expert0", _ZeroCfg, _zero, needs={"act_sq_mean"}),
]


def _apply(recipe, **kw):
    return mc.apply(recipe, passes=PASSES, **kw)


@pytest.fixture
def model_dir(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model")
    return tmp_path / "model"


def _recipe(model_dir, out, steps, **kw):
    return {"model": str(model_dir), "output": str(out), "calibration": dict(CAL), "steps": steps, **kw}


def test_identity_recipe_is_byte_identical_and_loads(tmp_path, model_dir):
    out = tmp_path / "out"
    res = _apply(_recipe(model_dir, out, [{"analyze": {}}, {"identity": {}}]), progress=False)
    assert res.output_dir == out
    a, b = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    ids = torch.tensor([[1, 5, 9, 33, 17, 100]])
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits
        lb = AutoModelForCausalLM.from_pretrained(out)(ids).logits
    assert torch.equal(la, lb)
    run = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in run["steps"]] == ["analyze", "identity"]
    step = json.loads((out / "steps" / "02-identity" / "report.json").read_text())
    assert [r["layer"] for r in step["layers"]] == [0, 1, 2]
    assert all(r["rel_error"] == 0.0 and r["params_before"] == r["params_after"] for r in step["layers"])
    assert (out / "recipe.yaml").read_text().startswith("model:")
    assert not (tmp_path / ".out.partial").exists()


def test_analyze_report_counts_tokens(tmp_path, model_dir):
    out = tmp_path / "out"
    _apply(_recipe(model_dir, out, [{"analyze": {"top": 2}}]), progress=False)
    assert not (out / "model.safetensors").exists(), "a report-only recipe writes no checkpoint"
    rep = json.loads((out / "steps" / "01-analyze" / "report.json").read_text())
    stats_tokens = (CAL["samples"] - max(1, CAL["samples"] // 8)) * CAL["seq_len"]
    for row in rep["layers"]:
        info = row["info"]
        assert sum(info["tokens_per_expert"]) == stats_tokens * 2  # top-2
        assert len(info["most_used"]) == 2 and 0 <= info["router_entropy_normalised"] <= 1
    assert (out / "steps" / "01-analyze" / "tokens_per_expert.png").stat().st_size > 0


def test_lossy_step_reports_error_and_cache_is_reused(tmp_path, model_dir):
    rec = _recipe(model_dir, tmp_path / "a", [{"test_zero_expert0": {}}])
    first = _apply(rec, progress=False)
    rows = json.loads((tmp_path / "a" / "steps" / "01-test_zero_expert0" / "report.json").read_text())[
        "layers"
    ]
    assert all(r["rel_error"] > 0 for r in rows)
    assert not first.report["calibration"]["cached"]
    second = _apply({**rec, "output": str(tmp_path / "b")}, progress=False)
    assert second.report["calibration"]["cached"]
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert float(a["model.layers.0.mlp.experts.0.down_proj.weight"].abs().sum()) == 0


def test_emit_every_step_writes_each_checkpoint(tmp_path, model_dir):
    out = tmp_path / "out"
    _apply(
        _recipe(model_dir, out, [{"test_zero_expert0": {}}, {"identity": {}}], emit="every_step"),
        progress=False,
    )
    first = out / "steps" / "01-test_zero_expert0" / "checkpoint"
    assert (first / "model.safetensors").exists() and (first / "config.json").exists()
    assert (out / "model.safetensors").exists()


def test_propagate_compressed_with_identity_matches_original(tmp_path, model_dir):
    base = _recipe(model_dir, tmp_path / "a", [{"analyze": {}}, {"identity": {}}])
    _apply(base, progress=False)
    comp = {**base, "output": str(tmp_path / "b"), "calibration": {**CAL, "propagate": "compressed"}}
    _apply(comp, progress=False)
    ra = json.loads((tmp_path / "a" / "steps" / "01-analyze" / "report.json").read_text())["layers"]
    rb = json.loads((tmp_path / "b" / "steps" / "01-analyze" / "report.json").read_text())["layers"]
    assert [r["info"]["tokens_per_expert"] for r in ra] == [r["info"]["tokens_per_expert"] for r in rb]


def test_propagate_compressed_changes_later_layers(tmp_path, model_dir):
    steps = [{"test_zero_expert0": {}}, {"analyze": {}}]
    _apply(_recipe(model_dir, tmp_path / "a", steps), progress=False)
    comp = _recipe(model_dir, tmp_path / "b", steps)
    comp["calibration"]["propagate"] = "compressed"
    _apply(comp, progress=False)
    ra = json.loads((tmp_path / "a" / "steps" / "02-analyze" / "report.json").read_text())["layers"]
    rb = json.loads((tmp_path / "b" / "steps" / "02-analyze" / "report.json").read_text())["layers"]
    assert (
        ra[0]["info"]["tokens_per_expert"] == rb[0]["info"]["tokens_per_expert"]
    )  # layer 0 sees the same input
    assert ra[2]["info"]["router_prob_mean"] != rb[2]["info"]["router_prob_mean"]


def test_dry_run_writes_nothing(tmp_path, model_dir):
    res = _apply(_recipe(model_dir, tmp_path / "out", [{"identity": {}}]), dry_run=True, progress=False)
    assert res.dry_run and res.report["dry_run"]["moe_layers"] == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_pass_failure_names_step_and_layer_and_keeps_output_absent(tmp_path, model_dir):
    with pytest.raises(PassError, match=r"step 2 \(test_fail_at_layer\), layer 1: deliberate failure"):
        _apply(
            _recipe(model_dir, tmp_path / "out", [{"identity": {}}, {"test_fail_at_layer": {}}]),
            progress=False,
        )
    assert not (tmp_path / "out").exists()


def test_api_keyword_overrides(tmp_path, model_dir):
    rec = _recipe(model_dir, tmp_path / "out", [{"analyze": {}}])
    res = _apply(rec, dry_run=True, progress=False, calibration__samples=4, emit="every_step")
    assert res.report["dry_run"]["calibration_tokens"] == 4 * CAL["seq_len"]


def test_bf16_checkpoint_identity(tmp_path):
    from moecompress.testing import tiny_model

    tiny_model("mixtral", dtype=torch.bfloat16).save_pretrained(tmp_path / "m")
    _apply(_recipe(tmp_path / "m", tmp_path / "out", [{"identity": {}}]), progress=False)
    a, b = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) and b[k].dtype == a[k].dtype for k in a)
