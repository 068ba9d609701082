"""compressed-tensors export of rtn outputs: transformers loads it with identical expert weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny import save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.cli import main as cli_main
from moecompress.engine.layer_loop import rewrite_checkpoint
from moecompress.engine.spec import LayerStats
from moecompress.io.compressed_tensors import ExportError, export
from moecompress.methods.scalar_quant import quantize
from moecompress.passes.rtn import RtnConfig, rtn

ct = pytest.importorskip("compressed_tensors")
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def _rtn_checkpoint(src, dst, protected=(), **cfg):
    """``src`` with every MoE layer through the rtn pass (what ``mc.apply`` writes, without the run)."""
    c = RtnConfig(**cfg)

    def fn(layer):
        layer = layer.replace(protected=frozenset(protected)) if protected else layer
        return rtn(layer, LayerStats(layer.index), c)[0]

    return rewrite_checkpoint(src, dst, fn, progress=False)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    save_tiny("qwen3_moe", root / "m")
    return root


def _assert_same_experts(model, rtn_dir):
    """The loaded fused expert weights equal the rtn layout's decoded weights bit for bit."""
    ckpt = mc.open_checkpoint(rtn_dir)
    for i in ckpt.moe_layer_indices:
        bank = ckpt.read_layer(i).experts
        experts = model.model.layers[i].mlp.experts
        assert torch.equal(experts.gate_up_proj, torch.cat([bank.gate.dense(), bank.up.dense()], 1)), i
        assert torch.equal(experts.down_proj, bank.down.dense()), i


def test_int4_group_export_loads_in_transformers_with_identical_weights(qwen):
    src = _rtn_checkpoint(qwen / "m", qwen / "rtn4", bits=4, group_size=16, symmetric=True)
    out = export(src, qwen / "ct4", progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["version"] == ct.__version__
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["symmetric"], w["strategy"], w["group_size"]) == (4, True, "group", 16)
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    cfg = json.loads((out / "config.json").read_text())
    assert "layers" not in cfg["moecompress"] and cfg["moecompress"]["export"]["bits"] == 4
    key = "model.layers.1.mlp.experts.7.down_proj"
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        packed, scale = f.get_tensor(f"{key}.weight_packed"), f.get_tensor(f"{key}.weight_scale")
        assert packed.dtype == torch.int32 and packed.shape == (64, 4)  # 32 inputs · 4 bits / 32
        assert scale.dtype == torch.float32 and scale.shape == (64, 2)
        assert f.get_tensor(f"{key}.weight_shape").tolist() == [64, 32]
    assert not any(".experts." in n and n.endswith(".weight") for n in names)
    assert (
        sum(n.endswith(".weight_packed") for n in names) == 3 * 8 * 3
        and "model.layers.0.mlp.gate.weight" in names
    )
    # the library's own decompression of one module gives the rtn layout's weights exactly
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    dec = PackedQuantizationCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([64, 32])}, scheme
    )
    assert torch.equal(dec["weight"], mc.open_checkpoint(src).read_layer(1).experts.down.expert(7))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    _assert_same_experts(model, src)
    with torch.no_grad():
        got, want = model(IDS).logits, mc.load(src)(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_int8_channel_export_of_mixtral_through_the_cli(tmp_path, capsys):
    save_tiny("mixtral", tmp_path / "m")  # w1/w3/w2 under block_sparse_moe on disk
    src = _rtn_checkpoint(tmp_path / "m", tmp_path / "rtn8", bits=8, group_size=-1, symmetric=True)
    out = tmp_path / "ct8"
    assert cli_main(["export", "--format", "compressed-tensors", "-q", str(src), str(out)]) == 0
    w = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (w["weights"]["num_bits"], w["weights"]["strategy"], w["weights"]["group_size"]) == (
        8,
        "channel",
        None,
    )
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.2.block_sparse_moe.experts.3.w2.weight_scale").shape == (64, 1)
    _assert_same_experts(AutoModelForCausalLM.from_pretrained(out), src)
    assert cli_main(["export", "-q", str(src), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_sources_compressed_tensors_cannot_express_are_refused(qwen, tmp_path):
    asym = _rtn_checkpoint(qwen / "m", tmp_path / "asym", bits=4, group_size=16)
    with pytest.raises(ExportError, match=r"layer 0 gate: asymmetric rtn; .*symmetric: true and bits 4 or 8"):
        export(asym, tmp_path / "o", progress=False)
    three = _rtn_checkpoint(qwen / "m", tmp_path / "three", bits=3, group_size=16, symmetric=True)
    with pytest.raises(ExportError, match=r"3-bit rtn; vLLM's MoE kernels take \(4, 8\) bits"):
        export(three, tmp_path / "o", progress=False)
    with pytest.raises(ExportError, match=r"layer 0 is not quantised \(stock dense experts\)"):
        export(qwen / "m", tmp_path / "o", progress=False)

    def with_policy(layer):  # a servable rtn layer that also carries a routing policy
        return layer.replace(routing={"capacity_drop": {"gamma": 1.5}})

    routed = rewrite_checkpoint(_rtn_checkpoint(qwen / "m", tmp_path / "sym", bits=4, group_size=16, symmetric=True),
                                tmp_path / "routed", with_policy, progress=False)  # fmt: skip
    with pytest.raises(ExportError, match=r"routing policies .* would ignore"):
        export(routed, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


def test_protected_experts_are_refused_or_quantised_on_request(qwen, tmp_path):
    src = _rtn_checkpoint(qwen / "m", tmp_path / "p", protected=[2], bits=4, group_size=-1, symmetric=True)
    with pytest.raises(ExportError, match=r"protected experts are stored dense.*quantize_protected=True"):
        export(src, tmp_path / "o", progress=False)
    out = export(src, tmp_path / "o", quantize_protected=True, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out)
    dense = mc.open_checkpoint(src).read_layer(0).experts.gate.expert(2)
    codes, scales, _ = quantize(dense, 4, -1, symmetric=True)
    want = ((codes.float() - 8) * scales.float()).to(dense.dtype)
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2, :32], want)
    assert "protected" not in json.loads((out / "config.json").read_text())["moecompress"]
