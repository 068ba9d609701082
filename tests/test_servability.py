"""vLLM-servability rules (moecompress.io.servability) on tiny outputs of small recipes, and in inspect."""

from __future__ import annotations

import copy
import json

import pytest
from tiny import save_tiny

import moecompress as mc
from moecompress.io.servability import CPU_MLA_ARGS, vllm_servable
from moecompress.io.verify import read_block
from moecompress.tools.inspect import format_report, inspect_checkpoint

CAL = {"source": "random", "samples": 4, "seq_len": 16, "batch_size": 4}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("servability")
    save_tiny("qwen3_moe", root / "m")  # H = 64, expert width 32, 8 experts, top-2
    return root


def _run(root, name, steps):
    out = root / name
    if not out.exists():
        mc.apply({"model": str(root / "m"), "output": str(out), "calibration": {**CAL, "cache_dir": str(root / "c")},
                  "steps": steps}, progress=False)  # fmt: skip
    return out


def _verdict(path, platform="gpu"):
    raw = json.loads((path / "config.json").read_text())
    qc = raw.get("quantization_config") or {}
    descs, _ = read_block(raw.get("moecompress"), quant_method=qc.get("quant_method"))
    return vllm_servable(raw, descs, platform=platform)


def test_stock_outputs_serve_and_moecompress_format_does_not(root):
    assert _verdict(root / "m") == (True, "stock weights: vLLM's unquantised fused MoE")
    pruned = _run(root, "ep", [{"expert_prune": {"ratio": 0.25, "method": "frequency"}}])
    uniform = _run(
        root, "np-u", [{"neuron_prune": {"ratio": 0.25, "method": "magnitude", "layout": "uniform"}}]
    )
    for out in (pruned, uniform):
        for platform in ("gpu", "cpu"):
            assert _verdict(out, platform)[0], (out, platform)
    ragged = _run(
        root, "np-r", [{"neuron_prune": {"ratio": 0.25, "method": "magnitude", "layout": "ragged"}}]
    )
    ok, why = _verdict(ragged)
    assert not ok and "'moecompress'" in why and "ragged" in why and "not a vLLM quantization method" in why
    rep = inspect_checkpoint(ragged)
    assert rep["vllm"]["serves"] is False and rep["stock_transformers"]["loads"] is False
    assert "vLLM: no (quant_method 'moecompress'" in format_report(rep)
    rep = inspect_checkpoint(pruned)
    assert rep["vllm"] == {"serves": True, "why": "stock weights: vLLM's unquantised fused MoE", "cpu": True,
                           "cpu_why": "stock weights: vLLM's unquantised fused MoE"}  # fmt: skip
    assert "vLLM: yes (stock weights" in format_report(rep)


def test_compressed_tensors_export_kernel_rules(root):
    pytest.importorskip("compressed_tensors")
    from moecompress.io.compressed_tensors import export

    src = _run(root, "rtn4", [{"rtn": {"bits": 4, "symmetric": True}}])  # group auto: 32 (width 32)
    ct = export(src, root / "rtn4-ct", progress=False)
    ok, why = _verdict(ct, "gpu")  # H = 64: no Marlin (needs H % 128 == 0), the Triton WNA16 kernel
    assert ok and "Triton" in why and "group 32" in why
    ok, why = _verdict(ct, "cpu")
    assert not ok and "32-group" in why
    assert not _verdict(src)[0], "the rtn layout itself is the moecompress format"
    rep = inspect_checkpoint(ct)
    assert rep["vllm"]["serves"] and not rep["vllm"]["cpu"]
    assert "CPU build: no (int4 group 32: the 32-group" in format_report(rep)


def _ct(bits=4, group=128, strategy="group", symmetric=True, **extra):
    w = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": group}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, **extra}}}  # fmt: skip


QWEN = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8}  # fmt: skip


@pytest.mark.parametrize(
    "change,platform,ok,fragment",
    [
        ({}, "gpu", True, "stock weights"),
        ({"quantization_config": _ct()}, "gpu", True, "Marlin"),
        ({"quantization_config": _ct()}, "cpu", True, "CPUExpertsInt4"),
        ({"quantization_config": _ct(bits=8)}, "cpu", False, "no CPU MoE kernel for 8-bit"),
        ({"quantization_config": _ct(bits=8)}, "gpu", True, "Marlin"),
        ({"quantization_config": _ct(group=96)}, "gpu", False, "group_size 96 must divide"),
        (
            {"quantization_config": _ct(group=-1, strategy="channel"), "hidden_size": 64 * 31},
            "gpu",
            False,
            "group-wise scales only",
        ),
        ({"quantization_config": _ct(group=16), "hidden_size": 64 * 31}, "gpu", True, "Triton"),
        ({"quantization_config": _ct(symmetric=False)}, "gpu", False, "asymmetric"),
        ({"quantization_config": _ct(input_activations={"num_bits": 8})}, "gpu", False, "activation"),
        (
            {"quantization_config": {"quant_method": "moecompress", "format": 1}},
            "gpu",
            False,
            "'moecompress'",
        ),
        ({"quantization_config": {"quant_method": "awq"}}, "gpu", False, "not checked"),
        ({"num_experts_per_tok": 200}, "gpu", False, "exceeds the 128 routed experts"),
        ({"model_type": "llama"}, "gpu", False, "model_type 'llama'"),
        ({"hidden_size": 2040}, "cpu", False, "multiple of 32"),
    ],
)
def test_rules_on_configs(change, platform, ok, fragment):
    raw = {**copy.deepcopy(QWEN), **change}
    got, why = vllm_servable(raw, {}, platform=platform)
    assert got is ok and fragment in why, why


def test_config_keys_and_group_limited_routers():
    t5 = {k: v for k, v in QWEN.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert vllm_servable(t5)[0], "transformers 5 writes num_local_experts, an alias of Qwen's num_experts"
    assert "no 'num_experts'" in vllm_servable({k: v for k, v in QWEN.items() if k != "num_experts"})[1]
    ds = {"model_type": "deepseek_v3", "hidden_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 12,
          "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}  # fmt: skip
    assert vllm_servable(ds)[0]
    no_method = {k: v for k, v in ds.items() if k != "topk_method"}
    assert "builds no e_score_correction_bias" in vllm_servable(no_method)[1], "vLLM's KeyError on the bias"
    assert "routes by softmax" in vllm_servable({**ds, "scoring_func": "softmax"})[1], "vLLM's default scoring"
    ok, why = vllm_servable({**ds, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, platform="cpu")
    assert ok and why.endswith(CPU_MLA_ARGS) and "-rotary_embedding" in why, "the arguments that make it right"
    assert CPU_MLA_ARGS not in vllm_servable({**ds, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, platform="gpu")[1]
    why = vllm_servable({**ds, "kv_lora_rank": 32, "qk_rope_head_dim": 16}, platform="cpu")[1]
    assert "= 48: vLLM's CPU MLA attention runs only 576" in why
    assert vllm_servable({**ds, "kv_lora_rank": 32, "qk_rope_head_dim": 16}, platform="gpu")[0], "a CPU rule"
    oss = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 8,
           "num_experts_per_tok": 2}  # fmt: skip
    assert "no unquantised MoE backend" in vllm_servable(oss, platform="cpu")[1], "measured: stock fails to load"
    assert vllm_servable(oss, platform="gpu")[0]
    assert "n_group=4" in vllm_servable({**ds, "n_routed_experts": 14})[1]
    assert "topk_group=2" in vllm_servable({**ds, "n_routed_experts": 4, "num_experts_per_tok": 3})[1]
    with pytest.raises(ValueError, match="platform"):
        vllm_servable(ds, platform="tpu")
    assert vllm_servable(None) == (False, "config.json is missing or not an object")
