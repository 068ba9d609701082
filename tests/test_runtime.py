"""Loading what moecompress writes: stock outputs with plain transformers, others via the quantizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.ir import ExpertBank
from moecompress.layouts.dense import Dense
from moecompress.runtime.quantizer import CompressedExperts


def _ragged(layer):
    e, bank = layer.experts.num_experts, layer.experts
    widths = torch.randint(1, bank.width, (e,), generator=torch.Generator().manual_seed(layer.index))
    return layer.replace(
        experts=ExpertBank(
            bank.gate, bank.up, bank.down, widths=widths, biases=bank.biases, act=bank.act, alpha=bank.alpha,
            limit=bank.limit,
        )
    )  # fmt: skip


def _merged(layer):
    """Experts 0 and 1 share expert 0's weights (an expert map); physical bank has E - 1 experts."""
    bank = layer.experts
    keep = [0, *range(2, bank.num_experts)]
    emap = torch.tensor([0, 0, *range(1, bank.num_experts - 1)])
    new = ExpertBank(*(Dense(lay.weight[keep].clone()) for lay in (bank.gate, bank.up, bank.down)))
    return layer.replace(experts=new, expert_map=emap)


def _drop_last_two(layer):
    """Uniform expert pruning: stock-expressible (fewer experts, router rows sliced)."""
    bank, k = layer.experts, layer.experts.num_experts - 2
    new = ExpertBank(*(Dense(lay.weight[:k].clone()) for lay in (bank.gate, bank.up, bank.down)))
    router = layer.router.__class__(**{**layer.router.__dict__, "num_experts": k})
    return layer.replace(experts=new, router=router, router_weight=layer.router_weight[:k].clone())


def _block_error(model, ckpt, n_tokens=24) -> float:
    worst = 0.0
    for i in ckpt.moe_layer_indices:
        x = torch.randn(n_tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            out = getattr(model.model.layers[i], ckpt.adapter.module_attr)(x[None])
            got = (out[0] if isinstance(out, tuple) else out)[0]
            want = mc.moe_forward(ckpt.read_layer(i), x)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("transform", [_ragged, _merged], ids=["ragged", "expert_map"])
def test_non_stock_output_loads_through_quantizer(tmp_path, model_type, transform):
    save_tiny(model_type, tmp_path / "m")
    mc.rewrite_checkpoint(tmp_path / "m", tmp_path / "out", transform, progress=False)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "moecompress", "format": 1}
    assert set(cfg["moecompress"]["layers"]) == {
        str(i) for i in mc.open_checkpoint(tmp_path / "m").moe_layer_indices
    }
    ckpt = mc.open_checkpoint(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    block = getattr(model.model.layers[ckpt.moe_layer_indices[0]], ckpt.adapter.module_attr)
    assert isinstance(block.experts, CompressedExperts)
    assert _block_error(model, ckpt) <= 1e-5
    gen = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 7)
    loaded = mc.load(tmp_path / "out")
    assert isinstance(getattr(loaded.model.layers[ckpt.moe_layer_indices[0]], ckpt.adapter.module_attr).experts,
                      CompressedExperts)  # fmt: skip


def test_compressed_checkpoint_round_trips_byte_identically(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    mc.rewrite_checkpoint(tmp_path / "m", tmp_path / "a", _ragged, progress=False)
    mc.rewrite_checkpoint(tmp_path / "a", tmp_path / "b", progress=False)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.layers.0.mlp.experts.widths" in a and "model.layers.0.mlp.experts.0.up_proj.weight" not in a


@pytest.mark.slow
def test_stock_output_loads_without_moecompress(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    mc.rewrite_checkpoint(tmp_path / "m", tmp_path / "out", _drop_last_two, progress=False)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in cfg
    count_keys = [k for k in ("num_experts", "num_local_experts") if k in cfg]
    assert count_keys and all(cfg[k] == 6 for k in count_keys)
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'out')!r}).eval()\n"
        "assert 'moecompress' not in sys.modules\n"
        "with torch.no_grad():\n"
        "    torch.save(m(torch.tensor([[1, 5, 9, 33]])).logits, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "logits.pt")], check=True, timeout=300)
    ckpt = mc.open_checkpoint(tmp_path / "out")
    assert ckpt.adapter.num_experts == 6 and ckpt.read_layer(0).experts.num_experts == 6
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert _block_error(model, ckpt) <= 1e-5


def test_unknown_format_version_is_a_clear_error(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    mc.rewrite_checkpoint(tmp_path / "m", tmp_path / "out", _ragged, progress=False)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    cfg["quantization_config"]["format"] = 99
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mc.CheckpointError, match="format 99 is newer"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "out")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_dtype_reaches_the_compressed_experts(tmp_path, dtype):
    """``load(dtype=)`` casts the stored floating tensors of compressed experts as transformers casts its
    own weights (it skips quantizer modules); integer codes stay as stored."""
    save_tiny("qwen3_moe", tmp_path / "m", dtype=torch.float16)
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "steps": [{"rtn": {"bits": 4}}],
           "calibration": {"source": "none"}}  # fmt: skip
    mc.apply(rec, progress=False)
    model = mc.load(tmp_path / "o", dtype=dtype)
    mods = [m for m in model.modules() if isinstance(m, CompressedExperts)]
    assert mods
    kinds = {t.dtype for m in mods for t in [*m.parameters(), *m.buffers()]}
    assert getattr(torch, dtype) in kinds and torch.float16 not in kinds
    assert any(not k.is_floating_point for k in kinds)  # the packed codes
