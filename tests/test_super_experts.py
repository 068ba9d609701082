"""Super experts: profiling finds a planted one, protection is a contract of every registered pass."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.spec import PassConfig, PassSpec
from moecompress.errors import PassError
from moecompress.ir import ExpertBank
from moecompress.layouts.dense import Dense
from moecompress.passes import BUILTIN_PASSES

CAL = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}
PLANT_LAYER, PLANT_EXPERT, PLANT_CHANNEL = 1, 3, 7

# A valid configuration for every registered pass whose defaults are not runnable. A new pass without
# runnable defaults must add one here, so the protection contract below covers it.
SAMPLE_CONFIGS = {
    "ablate_experts": {"experts": [{"layer": 0, "experts": [5]}]},
    "merge_experts": {"ratio": 0.5},
    "namex": {"ratio": 0.5, "router": "collapse"},
}


class _BrokenCfg(PassConfig):
    pass


def _touch_expert0(layer, stats, cfg):
    """Test-only: scales expert 0's up projection, protected or not (a broken pass)."""
    up = layer.experts.up.weight.clone()
    up[layer.physical(0)] *= 1.5
    bank = layer.experts
    return layer.replace(experts=ExpertBank(bank.gate, Dense(up), bank.down)), {}


TOUCH = PassSpec("test_touch_expert0", _BrokenCfg, _touch_expert0)


def _plant(path):
    """Make expert PLANT_EXPERT of layer PLANT_LAYER a super expert: its down_proj row feeding channel
    PLANT_CHANNEL is scaled x100, so that channel of its output carries a massive activation."""
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    key = f"model.layers.{PLANT_LAYER}.mlp.experts.{PLANT_EXPERT}.down_proj.weight"
    tensors[key][PLANT_CHANNEL] *= 100
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.fixture
def planted(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=4)
    _plant(tmp_path / "m")
    return tmp_path / "m"


def _recipe(model, out, steps):
    return {"model": str(model), "output": str(out), "calibration": dict(CAL), "steps": steps}


def test_profiler_finds_exactly_the_planted_expert_and_records_it(planted, tmp_path):
    out = tmp_path / "out"
    mc.apply(_recipe(planted, out, [{"protect_super_experts": {}}, {"identity": {}}]), progress=False)
    rep = json.loads((out / "steps" / "01-protect_super_experts" / "report.json").read_text())
    assert rep["summary"]["super_experts"] == {str(PLANT_LAYER): [PLANT_EXPERT]}
    info = {r["layer"]: r["info"] for r in rep["layers"]}
    assert info[PLANT_LAYER]["channels"] == {str(PLANT_EXPERT): PLANT_CHANNEL}
    assert (
        len(info[PLANT_LAYER]["top"]) == 8 and info[PLANT_LAYER]["top"][0] > 10 * info[PLANT_LAYER]["top"][1]
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["moecompress"]["protected"] == {str(PLANT_LAYER): [PLANT_EXPERT]}
    assert mc.open_checkpoint(out).read_layer(PLANT_LAYER).protected == frozenset({PLANT_EXPERT})
    assert (out / "steps" / "01-protect_super_experts" / "expert_magnitudes.png").exists()


def test_layer_fraction_excludes_late_layers(planted, tmp_path):
    steps = [{"protect_super_experts": {"layer_fraction": 0.25}}, {"identity": {}}]
    mc.apply(_recipe(planted, tmp_path / "out", steps), progress=False)
    rep = json.loads((tmp_path / "out" / "steps" / "01-protect_super_experts" / "report.json").read_text())
    assert rep["summary"]["super_experts"] == {}, "layer 1 is outside the first 25% of 4 MoE layers"


def test_ablating_the_super_expert_warns_and_protected_ablation_fails(planted, tmp_path):
    ablate = {"ablate_experts": {"experts": [{"layer": PLANT_LAYER, "experts": [PLANT_EXPERT]}]}}
    rec = _recipe(planted, tmp_path / "a", [ablate])
    rec["calibration"]["holdout"] = 4  # enough held-back tokens that the planted expert is routed
    res = mc.apply(rec, progress=False)
    rows = json.loads((tmp_path / "a" / "steps" / "01-ablate_experts" / "report.json").read_text())["layers"]
    ratios = {r["layer"]: r["massive_ratio"] for r in rows}
    assert ratios[PLANT_LAYER] < 0.5 and all(v == 1.0 for i, v in ratios.items() if i != PLANT_LAYER)
    assert any(f"layer {PLANT_LAYER}: the top massive activation fell" in w for w in res.report["warnings"])
    down = load_file(tmp_path / "a" / "model.safetensors")
    assert (
        float(down[f"model.layers.{PLANT_LAYER}.mlp.experts.{PLANT_EXPERT}.down_proj.weight"].abs().sum())
        == 0
    )
    with pytest.raises(
        PassError, match=rf"step 2 \(ablate_experts\), layer {PLANT_LAYER}: down weights of protected"
    ):
        mc.apply(_recipe(planted, tmp_path / "b", [{"protect_super_experts": {}}, ablate]), progress=False)
    assert not (tmp_path / "b").exists()


def test_manual_protection_errors(planted, tmp_path):
    bad = {"protect_super_experts": {"auto": False, "manual": [{"layer": 9, "experts": [0]}]}}
    with pytest.raises(PassError, match=r"layers \[9\] are not MoE layers"):
        mc.apply(_recipe(planted, tmp_path / "out", [bad, {"identity": {}}]), progress=False)


@pytest.mark.parametrize("name", list(BUILTIN_PASSES))
def test_every_registered_pass_honours_protection(tmp_path, name):
    save_tiny("mixtral", tmp_path / "m")
    protect = {
        "protect_super_experts": {
            "auto": False,
            "manual": [{"layer": i, "experts": [0, 1]} for i in range(3)],
        }
    }
    spec = BUILTIN_PASSES[name]
    cfg = SAMPLE_CONFIGS.get(name, {})
    spec.config.model_validate(cfg)  # a pass without runnable defaults needs an entry in SAMPLE_CONFIGS
    out = tmp_path / "out"
    mc.apply(_recipe(tmp_path / "m", out, [protect, {name: cfg}, {"identity": {}}]), progress=False)
    # read through the format, whatever layout the pass wrote
    before, after = mc.open_checkpoint(tmp_path / "m"), mc.open_checkpoint(out)
    for i in range(3):
        a, b = before.read_layer(i), after.read_layer(i)
        assert b.protected == frozenset({0, 1}), name
        for e in (0, 1):
            for proj in ("gate", "up", "down"):
                want = getattr(a.experts, proj).expert(e)
                assert torch.equal(want, getattr(b.experts, proj).expert(b.physical(e))), (name, i, e, proj)
            assert b.experts.width_of(b.physical(e)) == a.experts.width
        assert torch.equal(a.router_weight[:2], b.router_weight[:2])


def test_a_pass_that_touches_a_protected_expert_fails(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    protect = {"protect_super_experts": {"auto": False, "manual": [{"layer": 2, "experts": [0]}]}}
    with pytest.raises(
        PassError, match=r"step 2 \(test_touch_expert0\), layer 2: up weights of protected expert 0"
    ):
        mc.apply(
            _recipe(tmp_path / "m", tmp_path / "out", [protect, {"test_touch_expert0": {}}]),
            passes=[TOUCH], progress=False,
        )  # fmt: skip
    # without protection the same pass runs
    mc.apply(_recipe(tmp_path / "m", tmp_path / "ok", [{"test_touch_expert0": {}}]), passes=[TOUCH], progress=False)
    assert (tmp_path / "ok" / "model.safetensors").exists()
