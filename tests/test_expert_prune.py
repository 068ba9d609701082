"""expert_prune: whole-expert pruning writes a stock checkpoint equal to routing over the kept experts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_tiny
from transformers import AutoConfig, AutoModelForCausalLM

import moecompress as mc
from moecompress.calibration.cache import load_layer
from moecompress.engine.protection import protection_violations
from moecompress.engine.spec import LayerStats
from moecompress.errors import PassError
from moecompress.passes.expert_prune import STAT, ExpertPruneConfig, _summarize, expert_prune

CAL = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny checkpoints saved once, plus one statistics cache shared by the module's runs."""
    root = tmp_path_factory.mktemp("expert_prune")
    cache: dict[str, tuple] = {}

    def get(model_type: str, **kw):
        key = model_type + json.dumps(kw, sort_keys=True)
        if key not in cache:
            path = root / f"m{len(cache)}"
            cache[key] = (path, save_tiny(model_type, path, **kw))
        return cache[key]

    get.root = root
    return get


def _run(models, model, out, steps):
    rec = {
        "model": str(model),
        "output": str(models.root / out),
        "calibration": {**CAL, "cache_dir": str(models.root / "cache")},
        "steps": steps,
    }
    res = mc.apply(rec, progress=False)
    return res, models.root / out


def _infos(out, step):
    rep = json.loads(next((out / "steps").glob(f"{step:02d}-*/report.json")).read_text())
    return rep, {r["layer"]: r["info"] for r in rep["layers"]}


def _oracle_logits(model, ckpt_dir, removed: dict[int, list[int]]):
    """The original transformers model whose MoE blocks route over the kept experts only: removed
    experts get a -inf bias (selection bias for sigmoid routers), through the reference forward."""
    ckpt = mc.open_checkpoint(ckpt_dir)
    for i in ckpt.moe_layer_indices:
        layer = ckpt.read_layer(i)
        mask = torch.zeros(layer.router.num_experts)
        mask[removed[i]] = float("-inf")
        name = "score_bias" if layer.score_bias is not None else "router_bias"
        base = getattr(layer, name)
        masked = layer.replace(**{name: mask if base is None else base + mask})

        def fwd(h, masked=masked, tup=ckpt.adapter.module_returns_tuple):
            y = mc.moe_forward(masked, h.reshape(-1, h.shape[-1])).reshape(h.shape)
            return (y, None) if tup else y

        getattr(model.model.layers[i], ckpt.adapter.module_attr).forward = fwd
    with torch.no_grad():
        return model(IDS).logits


def _check_stock_output(model, src, out, removed, count_attr, n_after):
    assert getattr(AutoConfig.from_pretrained(out), count_attr) == n_after
    pruned = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = pruned(IDS).logits
    want = _oracle_logits(model, src, removed)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.parametrize(
    "model_type,count_attr", [("mixtral", "num_local_experts"), ("qwen3_moe", "num_experts")]
)
@pytest.mark.parametrize("method", ["frequency", "reap", "random"])
def test_methods_write_a_stock_checkpoint_equal_to_routing_over_kept_experts(
    models, model_type, count_attr, method
):
    src, model = models(model_type)
    res, out = _run(models, src, f"{model_type}-{method}", [{"expert_prune": {"method": method}}])
    rep, infos = _infos(out, 1)
    removed = {i: info["removed_experts"] for i, info in infos.items()}
    assert all(len(r) == 2 for r in removed.values()), "default ratio 0.25 of 8 experts, in every layer"
    assert rep["summary"]["experts_after"] == 18 and rep["summary"]["fraction_removed"] == 0.25
    for i, info in infos.items():
        s = torch.tensor(info["scores"])
        assert max(s[info["removed_experts"]]) <= min(s[info["kept_experts"]])
        if method != "random":  # the scores are the calibration statistic of the layer
            stat = load_layer(res.cache_entry, i)[STAT[method]]
            assert info["scores"] == [float(v) for v in stat]
    _check_stock_output(model, src, out, removed, count_attr, 6)


def test_ratio_zero_is_byte_identical(models):
    src, _ = models("qwen3_moe")
    _, out = _run(models, src, "zero", [{"expert_prune": {"ratio": 0.0}}])
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert AutoConfig.from_pretrained(out).num_experts == 8


def test_gpt_oss_router_bias_and_expert_biases(models):
    src, model = models("gpt_oss")
    _, out = _run(models, src, "gpt_oss", [{"expert_prune": {"ratio": 0.5, "method": "random", "seed": 3}}])
    _, infos = _infos(out, 1)
    ckpt, new = mc.open_checkpoint(src), mc.open_checkpoint(out)
    for i, info in infos.items():
        keep = info["kept_experts"]
        a, b = ckpt.read_layer(i), new.read_layer(i)
        assert len(keep) == 4 and torch.equal(b.router_bias, a.router_bias[keep])
        for name, bias in a.experts.biases.items():
            assert torch.equal(b.experts.biases[name], bias[keep])
    _check_stock_output(
        model, src, out, {i: x["removed_experts"] for i, x in infos.items()}, "num_local_experts", 4
    )


def test_deepseek_v3_removes_equally_per_group(models):
    src, model = models("deepseek_v3", n_routed_experts=16, num_hidden_layers=2)  # 4 groups of 4, top-3
    _, out = _run(models, src, "dsv3", [{"expert_prune": {"ratio": 0.25, "method": "reap"}}])
    _, infos = _infos(out, 1)
    for info in infos.values():
        assert sorted(e // 4 for e in info["removed_experts"]) == [0, 1, 2, 3]
    layer = mc.open_checkpoint(out).read_layer(1)
    assert layer.router.num_experts == 12 and layer.router.n_group == 4 and layer.score_bias.shape == (12,)
    assert layer.shared is not None
    removed = {i: x["removed_experts"] for i, x in infos.items()}
    _check_stock_output(model, src, out, removed, "n_routed_experts", 12)


@pytest.mark.parametrize(
    "model_type,kw,ratio,match",
    [
        ("deepseek_v3", {}, 0.25, r"2 experts, fewer than top_k=3; this router cannot lose experts"),
        ("deepseek_v3", {"n_routed_experts": 16, "num_hidden_layers": 2}, 0.75, r"use ratio <= 0\.5"),
        ("mixtral", {}, 0.9, r"removes 7 of 8 experts, leaving fewer than top_k=2; use ratio <= 0\.75"),
    ],
)
def test_impossible_ratios_fail_in_the_dry_run(models, model_type, kw, ratio, match):
    src, _ = models(model_type, **kw)
    rec = {"model": str(src), "output": str(models.root / "never"), "calibration": CAL,
           "steps": [{"expert_prune": {"ratio": ratio}}]}  # fmt: skip
    with pytest.raises(PassError, match=r"step 1 \(expert_prune\), layer \d+: .*" + match):
        mc.apply(rec, dry_run=True, progress=False)


def test_protected_experts_survive_renumbered(models):
    src, _ = models("mixtral")
    protect = {
        "protect_super_experts": {"auto": False, "manual": [{"layer": i, "experts": [7]} for i in range(3)]}
    }
    _, out = _run(
        models, src, "protected", [protect, {"expert_prune": {"ratio": 0.5, "method": "frequency"}}]
    )
    _, infos = _infos(out, 2)
    assert all(7 in x["kept_experts"] and len(x["removed_experts"]) == 4 for x in infos.values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["moecompress"]["protected"] == {str(i): [3] for i in range(3)}  # 4 lower ids were removed
    assert mc.open_checkpoint(out).read_layer(0).protected == frozenset({3})
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    for i in range(3):
        p = f"model.layers.{i}.block_sparse_moe"
        for w in ("w1", "w2", "w3"):
            assert torch.equal(a[f"{p}.experts.7.{w}.weight"], b[f"{p}.experts.3.{w}.weight"])
        assert torch.equal(a[f"{p}.gate.weight"][7], b[f"{p}.gate.weight"][3])

    too_many = {
        "protect_super_experts": {"auto": False, "manual": [{"layer": 0, "experts": [0, 1, 2, 3, 4, 5]}]}
    }
    with pytest.raises(PassError, match=r"step 2 \(expert_prune\), layer 0: .*only 2 are unprotected"):
        _run(models, src, "too-many", [too_many, {"expert_prune": {"ratio": 0.5}}])


def test_frequency_ranking_ties_and_protection_on_a_known_case(models):
    src, _ = models("mixtral")
    layer = mc.open_checkpoint(src).read_layer(0)
    counts = torch.tensor([5.0, 0, 9, 3, 3, 7, 1, 2])
    cfg = ExpertPruneConfig(ratio=0.5, method="frequency")
    new, info = expert_prune(layer, LayerStats(0, {"expert_counts": counts}), cfg)
    assert info["removed_experts"] == [1, 4, 6, 7]  # fewest tokens; the 3-3 tie keeps the lower id 3
    assert info["kept_experts"] == [0, 2, 3, 5] and new.router.num_experts == 4
    assert torch.equal(new.experts.down.weight, layer.experts.down.weight[[0, 2, 3, 5]])
    assert torch.equal(new.router_weight, layer.router_weight[[0, 2, 3, 5]])

    guarded = layer.replace(protected=frozenset({1, 6}))
    new, info = expert_prune(guarded, LayerStats(0, {"expert_counts": counts}), cfg)
    assert info["removed_experts"] == [0, 3, 4, 7]  # protected 1 and 6 are kept despite few tokens
    assert new.protected == frozenset({0, 3})  # old 1 -> 0, old 6 -> 3
    assert protection_violations(guarded, new, info["kept_experts"]) == []
    assert protection_violations(guarded, new) != [], "without the renumbering the ids do not line up"
    with pytest.raises(PassError, match=r"statistic 'expert_counts' covers 8 experts but the layer has 4"):
        expert_prune(new, LayerStats(0, {"expert_counts": counts}), cfg)

    half = ExpertPruneConfig(ratio=0.3125, method="frequency")  # 2.5 experts: halves round up, to 3
    _, info = expert_prune(layer, LayerStats(0, {"expert_counts": counts}), half)
    assert info["removed_experts"] == [1, 6, 7] and info["fraction_removed"] == 0.375
    summary = _summarize({0: info}, half)
    assert summary["summary"]["fraction_removed"] == 0.375 and "halves up" in summary["warnings"][0]
    with pytest.raises(PassError, match="merged experts"):
        expert_prune(layer.replace(expert_map=torch.arange(8)), LayerStats(0, {"expert_counts": counts}), cfg)

    rnd = ExpertPruneConfig(ratio=0.5, method="random", seed=1)
    picks = [expert_prune(layer, LayerStats.view(0, {}, ["expert_counts"]), rnd)[1]["removed_experts"] for _ in range(2)]
    assert picks[0] == picks[1] and len(picks[0]) == 4, "seeded: deterministic"
