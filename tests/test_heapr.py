"""HEAPr and the neuron-pruning baselines: oracles, the ragged layout end to end, options and errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.calibration.skeleton import InstrumentedMoE, Skeleton
from moecompress.calibration.sweep import Batches, run_calibration
from moecompress.errors import MethodError, PassError
from moecompress.methods.widths import Scope, select_widths, uniform_width
from moecompress.passes.heapr import HeaprConfig
from moecompress.passes.neuron_pruning import NeuronPruneOptions

CAL = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}


def _run(model, out, step, **cal):
    mc.apply({"model": str(model), "output": str(out), "calibration": {**CAL, **cal}, "steps": [step]},
             progress=False)  # fmt: skip
    name = next(iter(step))
    return json.loads((out / "steps" / f"01-{name}" / "report.json").read_text())


def _logits(path, ids):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    "step",
    [{"heapr": {"ratio": 0.0}}, {"neuron_prune": {"ratio": 0.0, "method": "wanda"}},
     {"heapr": {"ratio": 0.0, "layout": "uniform"}}],
)  # fmt: skip
def test_ratio_zero_is_lossless(tmp_path, step):
    save_tiny("qwen3_moe", tmp_path / "m")
    _run(tmp_path / "m", tmp_path / "out", step)
    before, after = (
        load_file(tmp_path / "m" / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _zero_down_columns(path, n_layers: int, experts: int, width: int, dead: int):
    """Zero the down-projection columns of the last ``dead`` neurons of every expert."""
    shard = path / "model.safetensors"
    t = load_file(shard)
    for i in range(n_layers):
        for e in range(experts):
            t[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"][:, width - dead :] = 0
    save_file(t, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_removing_zero_down_columns_is_lossless_and_loads(tmp_path, scope):
    save_tiny("qwen3_moe", tmp_path / "m")  # 3 layers, 8 experts x width 32
    _zero_down_columns(tmp_path / "m", 3, 8, 32, dead=8)
    rep = _run(tmp_path / "m", tmp_path / "out", {"heapr": {"ratio": 0.25, "scope": scope}})
    assert rep["summary"]["routed_fraction_removed"] == 0.25
    assert all(w == 24 for row in rep["layers"] for w in row["info"]["widths"])
    torch.testing.assert_close(
        _logits(tmp_path / "out", IDS), _logits(tmp_path / "m", IDS), rtol=1e-5, atol=1e-5
    )
    # the kept neurons are exactly the live ones
    orig, out = mc.open_checkpoint(tmp_path / "m"), mc.open_checkpoint(tmp_path / "out")
    kept = out.read_layer(1).experts.gate.dense()
    assert (
        torch.equal(kept[:, :24], orig.read_layer(1).experts.gate.dense()[:, :24]) and not kept[:, 24:].any()
    )


def test_ragged_layout_is_compact_on_disk_loads_and_equals_zeroed_neurons(tmp_path):
    save_tiny("gpt_oss", tmp_path / "m")  # biases and the clamped activation too
    rep = _run(tmp_path / "m", tmp_path / "out", {"heapr": {"ratio": 0.5, "scope": "global"}})
    widths = [row["info"]["widths"] for row in rep["layers"]]
    assert len({w for ws in widths for w in ws}) > 1  # really ragged
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "moecompress"
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        rows = f.get_tensor("model.layers.0.mlp.experts.gate.rows")
        assert rows.shape[0] == sum(widths[0])  # no padding stored
    # reference: the original model with the removed neurons' down columns zeroed (and biases kept)
    orig, out = mc.open_checkpoint(tmp_path / "m"), mc.open_checkpoint(tmp_path / "out")
    t = load_file(tmp_path / "m" / "model.safetensors")
    for i in orig.moe_layer_indices:
        a, b = orig.read_layer(i).experts, out.read_layer(i).experts
        for e in range(a.num_experts):
            kept = b.gate.live(e) if hasattr(b.gate, "live") else b.gate.expert(e)
            hit = (a.gate.expert(e)[:, None, :] == kept[None, :, :]).all(-1).any(1)
            assert int(hit.sum()) == widths[i][e]
            down = t[f"model.layers.{i}.mlp.experts.down_proj"]  # gpt-oss: [E, I, H]
            down[e, ~hit] = 0
    save_file(t, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    torch.testing.assert_close(
        _logits(tmp_path / "out", IDS), _logits(tmp_path / "m", IDS), rtol=1e-5, atol=1e-5
    )


def test_factorised_score_equals_the_gradient_outer_product_form(tmp_path):
    """E[h²]·E[(∂ℓ/∂h)²] from the streamed engine vs M_i = mean g gᵀ (g = ∂ℓ/∂ down output), wᵀMw."""
    save_tiny("qwen3_moe", tmp_path / "c")
    ckpt = mc.open_checkpoint(tmp_path / "c")
    ids = torch.randint(3, 128, (6, 12), generator=torch.Generator().manual_seed(0))
    got: dict = {}
    run_calibration(
        Skeleton(ckpt, torch.float32), Batches.make(ids, holdout=0, batch_size=3),
        {"act_sq_mean", "grad_sq_mean"}, save_forward=got.__setitem__,
        save_backward=lambda i, s: got[i].update(s), progress=False,
    )  # fmt: skip

    class Keep:  # records h and keeps y's gradient, per expert
        def __init__(self):
            self.h, self.y = {}, {}

        def on_input(self, x): ...
        def on_route(self, logits, ids, weights): ...
        def on_shared(self, h, y): ...
        def on_output(self, out): ...

        def on_expert(self, e, tok, slot, h, y):
            y.retain_grad()
            self.h.setdefault(e, []).append(h.detach())
            self.y.setdefault(e, []).append(y)

    full = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    obs = {}
    for i in ckpt.moe_layer_indices:
        obs[i] = Keep()
        full.model.layers[i].mlp = InstrumentedMoE(ckpt.read_layer(i), obs[i])
    full(ids, labels=ids).loss.backward()
    for i in ckpt.moe_layer_indices:
        layer = ckpt.read_layer(i)
        for e in obs[i].h:
            h = torch.cat(obs[i].h[e]).double()
            g = torch.cat([y.grad for y in obs[i].y[e]]).double()
            m = g.T @ g / g.shape[0]  # H x H
            w = layer.experts.down.expert(e).double()  # [H, I]
            original = (h**2).mean(0) * torch.einsum("hk,hj,jk->k", w, m, w)
            factorised = got[i]["act_sq_mean"][e].double() * got[i]["grad_sq_mean"][e].double()
            rel = float((factorised - original).abs().max() / original.abs().max())
            assert rel <= 1e-5, (i, e, rel)


def _opts(**kw):
    return NeuronPruneOptions(**{"ratio": 0.5, **kw})


def test_global_selection_takes_the_cheapest_neurons_across_layers():
    scores = {0: torch.full((2, 8), 10.0), 1: torch.rand(2, 8, generator=torch.Generator().manual_seed(0))}
    w = select_widths(Scope(scores, {0: {}, 1: {}}), _opts(ratio=0.5))
    assert w[0].tolist() == [8, 8] and w[1].tolist() == [0, 0]  # all removal in the cheap layer
    w = select_widths(Scope(scores, {0: {}, 1: {}}), HeaprConfig(ratio=0.25))
    assert int(sum(8 - x for ws in w.values() for x in ws.tolist())) == 8


def test_align_min_width_and_exempt_experts():
    g = torch.Generator().manual_seed(1)
    scores = {0: torch.rand(4, 30, generator=g)}
    w = select_widths(Scope(scores, {0: {}}), _opts(ratio=0.5, align=8, min_width=5))[0]
    assert all(x % 8 == 0 or x == 30 for x in w.tolist()) and all(x >= 8 for x in w.tolist())
    assert 0 <= (120 - 60) - int((30 - w).sum()) < 8 * 4  # short of the target by less than align per expert
    w = select_widths(Scope(scores, {0: {3: 30}}), _opts(ratio=0.5))[0]
    assert w[3] == 30 and int(120 - w.sum()) == 60  # the exempt expert's share moves to the others
    with pytest.raises(MethodError, match="only 0 are removable"):
        select_widths(Scope(scores, {0: {}}), _opts(ratio=0.5, min_width=30))
    assert uniform_width(768, _opts(ratio=0.25, align=128)) == 640  # 576 is 4.5 blocks: ties keep more
    assert uniform_width(64, _opts(ratio=0.25, align=1)) == 48


def test_protection_unseen_experts_and_uniform_stock_config(tmp_path):
    save_tiny("gpt_oss", tmp_path / "m")  # 3 layers, 8 experts x 80
    t = load_file(tmp_path / "m" / "model.safetensors")
    for i in range(3):
        t[f"model.layers.{i}.mlp.router.bias"][5] = -1e4  # expert 5 is never routed
    save_file(t, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    protect = {"protect_super_experts": {"auto": False, "manual": [{"layer": 1, "experts": [2]}]}}
    for unseen, want in (("typical", 60), ("keep", 80)):
        out = tmp_path / f"o-{unseen}"
        mc.apply({"model": str(tmp_path / "m"), "output": str(out), "calibration": CAL,
                  "steps": [protect, {"heapr": {"ratio": 0.25, "unseen": unseen}}]}, progress=False)  # fmt: skip
        rep = json.loads((out / "steps" / "02-heapr" / "report.json").read_text())
        assert rep["summary"]["routed_fraction_removed"] == 0.25  # the plan knew about the protection
        rows = {r["layer"]: r["info"] for r in rep["layers"]}
        assert rows[1]["widths"][2] == 80 and all(5 in rows[i]["unseen_experts"] for i in range(3))
        assert all(rows[i]["widths"][e] == want for i in range(3) for e in rows[i]["unseen_experts"])
        assert any("no calibration tokens" in w for w in rep["warnings"])
    save_tiny("mixtral", tmp_path / "x")
    rep = _run(tmp_path / "x", tmp_path / "u", {"heapr": {"ratio": 0.25, "layout": "uniform", "align": 16}})
    cfg = json.loads((tmp_path / "u" / "config.json").read_text())
    assert cfg["intermediate_size"] == 64 and "quantization_config" not in cfg  # 60 rounded to align 16
    assert (
        AutoModelForCausalLM.from_pretrained(tmp_path / "u").model.layers[0].mlp.experts.down_proj.shape[-1]
        == 64
    )
    assert rep["summary"]["width_histogram"] == {"64": 24}


def test_uniform_on_deepseek_keeps_the_shared_width_and_loads(tmp_path):
    save_tiny("deepseek_v3", tmp_path / "m")
    _run(tmp_path / "m", tmp_path / "out", {"heapr": {"ratio": 0.5, "layout": "uniform"}})
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["moe_intermediate_size"] == 32 and cfg["quantization_config"]["quant_method"] == "moecompress"
    layer = mc.open_checkpoint(tmp_path / "out").read_layer(1)
    assert layer.experts.width == 16 and layer.shared.width == 32
    assert torch.isfinite(_logits(tmp_path / "out", IDS)).all()


def test_wanda_score_matches_a_direct_computation(tmp_path):
    from moecompress.engine.spec import LayerStats
    from moecompress.passes.neuron_prune import wanda_scores

    save_tiny("olmoe", tmp_path / "m")
    layer = mc.open_checkpoint(tmp_path / "m").read_layer(0)
    g = torch.Generator().manual_seed(0)
    x2, h2 = torch.rand(8, layer.hidden_size, generator=g), torch.rand(8, layer.experts.width, generator=g)
    s = wanda_scores(layer, LayerStats(0, {"expert_in_sq_mean": x2, "act_sq_mean": h2}))
    e, k = 3, 5
    b = layer.experts
    want = (b.gate.expert(e)[k].abs() * x2[e].sqrt()).sum() + (b.up.expert(e)[k].abs() * x2[e].sqrt()).sum()
    want = want + h2[e, k].sqrt() * b.down.expert(e)[:, k].abs().sum()
    assert float(s[e, k]) == pytest.approx(float(want), rel=1e-5)


def test_errors_name_the_step_and_the_fix(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": CAL}
    with pytest.raises(
        PassError, match=r"step 1 \(heapr\), layer 0: min_width=99 exceeds the expert width 32"
    ):
        mc.apply({**rec, "steps": [{"heapr": {"min_width": 99}}]}, dry_run=True)
    _run(tmp_path / "m", tmp_path / "p", {"heapr": {"ratio": 0.25}})
    with pytest.raises(PassError, match="already neuron-pruned"):
        mc.apply({**rec, "model": str(tmp_path / "p"), "steps": [{"heapr": {"ratio": 0.25}}]}, dry_run=True)
    with pytest.raises(Exception, match="less than 1"):
        mc.apply({**rec, "steps": [{"heapr": {"ratio": 1.0}}]}, dry_run=True)
    assert not (tmp_path / "o").exists()
