"""``expert_prune`` on a quantised input writes the kept experts in their on-disk encoding (FP8 weight and
``weight_scale_inv`` renamed to the new ids, MXFP4 rows of the kept experts, compressed-tensors packed
tensors), whole-layer and chunked alike: the dequantised kept experts equal the input's bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import moecompress as mc
from moecompress.testing_quantized import save_compressed_tensors, save_fp8_block, save_mxfp4

STEPS = [{"expert_prune": {"ratio": 0.25, "method": "frequency"}}]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qsel")
    save_fp8_block("deepseek_v3", root / "fp8", block=(16, 16), num_experts_per_tok=2, num_hidden_layers=2)
    save_mxfp4(root / "mxfp4", intermediate_size=96)
    save_compressed_tensors("qwen3_moe", root / "ct", kind="w4-group", num_hidden_layers=2)
    return root


def _run(src, out, chunk, cache):
    rec = {"model": str(src), "output": str(out), "steps": STEPS, "expert_chunk": chunk,
           "calibration": {"source": "random", "samples": 4, "seq_len": 8, "cache_dir": str(cache)}}  # fmt: skip
    return mc.apply(rec, progress=False).report


def _size(d):
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "ct"])
def test_kept_experts_keep_their_encoding(inputs, tmp_path, fmt):
    src = inputs / fmt
    report = _run(src, tmp_path / "whole", "off", tmp_path / "c")
    _run(src, tmp_path / "chunk", 3, tmp_path / "c")
    for name in sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors")):  # chunked: the same bytes
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "chunk" / name).read_bytes()
    out = tmp_path / "whole"
    assert _size(out) < _size(src)
    raw_in = {k: v for f in src.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    raw_out = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    quantised = {k for k, v in raw_in.items() if v.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int32)}
    assert any(k in quantised for k in raw_out if ".experts." in k)  # experts are still stored quantised
    cfg = json.loads((out / "config.json").read_text())
    qc_in = json.loads((src / "config.json").read_text())["quantization_config"]
    assert cfg["quantization_config"]["quant_method"] == qc_in["quant_method"]
    a, b = mc.open_checkpoint(src), mc.open_checkpoint(out)
    step = report["steps"][0]["report"]
    infos = json.loads((out / step.replace("report.md", "report.json")).read_text())["layers"]
    for row in infos:
        i, kept = row["layer"], row["info"]["kept_experts"]
        before, after = a.read_layer(i), b.read_layer(i)
        assert after.router.num_experts == len(kept)
        idx = torch.tensor(kept)
        for p in ("gate", "up", "down"):
            want = getattr(before.experts, p).dense().index_select(0, idx)
            assert torch.equal(getattr(after.experts, p).dense(), want), (fmt, i, p)
        for k, v in before.experts.biases.items():
            assert torch.equal(after.experts.biases[k], v.index_select(0, idx))
        assert torch.equal(after.router_weight, before.router_weight.index_select(0, idx))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_disk_estimate_counts_the_kept_encoding(inputs, tmp_path, fmt):
    """The dry run's output estimate (what the disk check uses) counts the bytes a selection writes: the
    input's encoding, not the dequantised tensors (within 25 % of the written size: headers, rounding)."""
    src = inputs / fmt
    report = _run(src, tmp_path / "o", "off", tmp_path / "c")
    est = next(iter(report["dry_run"]["estimated_output_bytes"].values()))
    assert abs(est - _size(tmp_path / "o")) <= 0.25 * _size(tmp_path / "o")
    assert est < report["dry_run"]["input_bytes"]  # the dequantised input is larger than what is written
