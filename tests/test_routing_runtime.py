"""Routing policies end to end: recipe steps -> config.json + tensors -> loaded model applies them."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import MODEL_TYPES, save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.errors import CheckpointError, MoecompressError, RoutingError
from moecompress.runtime.routing import policies
from moecompress.tools.inspect import format_report, inspect_checkpoint

CAL = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}


def run(model, out, steps, **kw):
    return mc.apply({"model": str(model), "output": str(out), "calibration": CAL, "steps": steps}, progress=False, **kw)


def tokens(b=2, s=12, seed=0):
    return torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(seed))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    save_tiny("qwen3_moe", root / "base")
    run(root / "base", root / "policy", [{"capacity_drop": {"gamma": 0.75}}, {"sere": {"select_top": 1, "threshold": 0.0}}])
    return root


def record(model):
    mods = policies(model)
    for m in mods.values():
        m.record = True
        m.reset_counts()
    return mods


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_capacity_policy_every_architecture(model_type, tmp_path):
    save_tiny(model_type, tmp_path / "base")
    run(tmp_path / "base", tmp_path / "out", [{"capacity_drop": {"gamma": 0.5}}])
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "moecompress"
    assert set(cfg["moecompress"]["routing"]) == {str(i) for i in mc.open_checkpoint(tmp_path / "base").moe_layer_indices}
    ids = tokens()
    base = logits(mc.load(tmp_path / "base"), ids)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # `import moecompress` is enough
    mods = record(model)
    dropped = logits(model, ids)
    assert mods and sum(m.counts["dropped"] for m in mods.values()) > 0
    assert torch.isfinite(dropped).all() and not torch.equal(dropped, base)
    for gamma in (math.inf, 1e9):  # no capacity: the original logits, bit for bit
        mc.set_routing(model, {"capacity_drop": {"gamma": gamma}})
        assert torch.equal(logits(model, ids), base), gamma
    mc.set_routing(model, "off")
    assert torch.equal(logits(model, ids), base)


def test_dropped_slots_are_the_same_in_every_experts_implementation(qwen):
    """transformers' grouped_mm leaves a dropped slot's rows uninitialised: the runtime must not hand it one."""
    ids = tokens(4, 16)
    outs = []
    for impl in ("eager", "grouped_mm", "batched_mm"):
        model = mc.load(qwen / "policy", routing={"sere": None})
        model.set_experts_implementation(impl)
        outs.append(logits(model, ids))
    assert all(torch.isfinite(o).all() for o in outs)
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], atol=1e-5, rtol=1e-5)


def test_sere_decode_oracles_and_simulated_decode(qwen):
    ids = tokens(4, 7, seed=1)
    base = mc.load(qwen / "base")
    model = mc.load(qwen / "policy", routing={"capacity_drop": None})
    assert torch.equal(logits(model, ids), logits(base, ids)), "SERE never touches a prefill"

    def decoded(m):  # teacher-forced decode of 4 sequences with the KV cache: each step is one decode batch
        past, out = None, []
        with torch.no_grad():
            for s in range(ids.shape[1]):
                r = m(ids[:, s : s + 1], cache=past, use_cache=True)
                past, out = r.cache, [*out, r.logits]
        return torch.cat(out, dim=1)

    mods = record(model)
    real = decoded(model)
    assert sum(m.counts["rerouted_slots"] for m in mods.values()) > 0
    assert not torch.allclose(real, logits(base, ids), atol=1e-4)
    mc.set_routing(model, {"sere": {"simulate_decode": True}})
    assert torch.allclose(logits(model, ids), real, atol=1e-5, rtol=1e-5), "simulation == real decode"
    top_k = base.config.num_experts_per_tok
    for knobs in ({"select_top": top_k}, {"select_top": 1, "threshold": 1.01}):  # identities
        mc.set_routing(model, {"sere": {**knobs, "simulate_decode": False}})
        assert torch.allclose(decoded(model), decoded(base), atol=1e-6, rtol=0), knobs


def test_policy_survives_save_load_generate_and_inspect(qwen):
    model = AutoModelForCausalLM.from_pretrained(qwen / "policy")
    stored = {i: m.policy for i, m in policies(model).items()}
    assert stored and all(set(p) == {"capacity_drop", "sere"} for p in stored.values())
    sim = load_file(str(qwen / "policy" / "model.safetensors"))["model.layers.0.mlp.routing.similarity"]
    assert torch.equal(policies(model)[0].stored_similarity, sim)
    record(model)
    out = model.generate(tokens(8, 4), max_new_tokens=5, do_sample=False)
    assert out.shape == (8, 9)
    assert sum(m.counts["batches"] for m in policies(model).values()) > 0, "decode steps were re-routed"
    report = inspect_checkpoint(qwen / "policy")
    assert report["ok"] and report["layers"][0]["routing"]["sere"]["select_top"] == 1
    assert "routing policy capacity_drop: gamma=0.75" in format_report(report)
    card = (qwen / "policy" / "README.md").read_text()
    assert "## Routing policies" in card and "`sere` (select_top=1, threshold=0.0" in card
    assert "MoE layers 0, 1, 2" in card
    assert "not servable (quant_method 'moecompress' (routing policies)" in card  # vLLM would ignore them


def test_policy_on_a_compressed_layout(qwen, tmp_path):
    run(qwen / "base", tmp_path / "pruned", [{"heapr": {"ratio": 0.5}}])
    run(tmp_path / "pruned", tmp_path / "both", [{"capacity_drop": {"gamma": 0.5, "strategy": "first"}}])
    ids = tokens()
    pruned = logits(mc.load(tmp_path / "pruned"), ids)
    model = mc.load(tmp_path / "both")
    mods = record(model)
    out = logits(model, ids)
    assert torch.isfinite(out).all() and sum(m.counts["dropped"] for m in mods.values()) > 0
    mc.set_routing(model, {"capacity_drop": {"gamma": math.inf}})
    assert torch.equal(logits(model, ids), pruned)


def test_later_steps_keep_the_policy_and_expert_removal_after_sere_is_refused(qwen, tmp_path):
    run(qwen / "policy", tmp_path / "rtn", [{"rtn": {"bits": 8}}])
    cfg = json.loads((tmp_path / "rtn" / "config.json").read_text())
    assert set(cfg["moecompress"]["routing"]["0"]) == {"capacity_drop", "sere"}
    assert policies(mc.load(tmp_path / "rtn"))[0].stored_similarity is not None
    with pytest.raises(MoecompressError, match="sere") as err:
        run(qwen / "base", tmp_path / "bad", [{"sere": {}}, {"expert_prune": {"ratio": 0.25}}], dry_run=True)
    assert "\n" not in str(err.value) and not (tmp_path / "bad").exists()
    run(qwen / "base", tmp_path / "ok", [{"expert_prune": {"ratio": 0.25}}, {"sere": {}}], dry_run=True)


def test_routing_report(qwen, tmp_path):
    res = run(qwen / "policy", tmp_path / "rep", [{"routing_report": {"batch_sizes": [1, 4, 8]}}])
    step = json.loads((tmp_path / "rep" / "steps" / "01-routing_report" / "report.json").read_text())
    layer = step["layers"][0]["info"]
    assert [r["batch"] for r in layer["decode"]] == [1, 4, 8]
    one, four = layer["decode"][0], layer["decode"][1]
    assert one["distinct_experts"] == pytest.approx(2.0)  # top-2 routing, one token per batch
    assert four["distinct_experts_policy"] <= four["distinct_experts"] <= 8
    assert layer["prefill"]["straggler_ratio_policy"] <= layer["prefill"]["straggler_ratio"]
    assert 0 < layer["prefill"]["dropped_fraction"] < 1
    assert (tmp_path / "rep" / "steps" / "01-routing_report" / "distinct_experts.png").is_file()
    assert res.report["steps"][0]["name"] == "routing_report"


def test_bad_routing_requests_are_one_line(qwen):
    model = mc.load(qwen / "base")
    for bad, needle in (({"capacity_drop": {"gamma": -1}}, "gamma"), ({"sere": {}}, "similarity"),
                        ({"capacity": {}}, "capacity_drop"), ("sometimes", "off")):  # fmt: skip
        with pytest.raises(RoutingError, match=needle) as err:
            mc.set_routing(model, bad)
        assert "\n" not in str(err.value)


def test_damaged_routing_in_config_or_shards_is_one_line(qwen, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(qwen / "policy", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moecompress"]["routing"]["1"]["sere"]["select_top"] = "two"
    (bad / "config.json").write_text(json.dumps(cfg))
    for call in (lambda: mc.load(bad), lambda: mc.open_checkpoint(bad)):
        with pytest.raises(CheckpointError, match=r"routing\.1\.sere\.select_top") as err:
            call()
        assert "\n" not in str(err.value)
    shutil.copy(qwen / "policy" / "config.json", bad / "config.json")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.2.mlp.routing.similarity"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="similarity") as err:
        mc.load(bad)
    assert "\n" not in str(err.value)
    assert not inspect_checkpoint(bad)["ok"]


def test_protected_experts_keep_every_token_at_run_time(qwen, tmp_path):
    ids = tokens(4, 16, seed=3)
    probe = mc.load(qwen / "base", routing={"capacity_drop": {"gamma": 0.5}})
    mods = record(probe)
    logits(probe, ids)
    busiest = int(mods[0].loads_before.argmax())
    assert int(mods[0].loads_after[busiest]) < int(mods[0].loads_before[busiest])  # it overflows unprotected
    steps = [{"protect_super_experts": {"manual": [{"layer": 0, "experts": [busiest]}], "auto": False}},
             {"capacity_drop": {"gamma": 0.5}}]  # fmt: skip
    run(qwen / "base", tmp_path / "prot", steps)
    model = mc.load(tmp_path / "prot")
    mods = record(model)
    logits(model, ids)
    assert int(mods[0].loads_after[busiest]) == int(mods[0].loads_before[busiest])
    assert mods[0].counts["dropped"] > 0


def test_evaluate_with_routing_reports_the_policies_in_force(qwen, capsys):
    from moecompress.cli import main as cli_main

    ev = {"token_source": "random", "max_tokens": 128, "seq_len": 32}
    stored = mc.evaluate(qwen / "policy", **ev)
    off = mc.evaluate(qwen / "policy", routing="off", **ev)
    base = mc.evaluate(qwen / "base", **ev)
    assert set(stored["routing"]["0"]) == {"capacity_drop", "sere"} and "routing" not in off
    assert off["perplexity"] == base["perplexity"] != stored["perplexity"]
    capsys.readouterr()  # the loads' progress bars
    assert cli_main(["eval", str(qwen / "policy"), "--routing", "{bad", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --routing '{bad'") and err.count("\n") == 1
