"""Reading MoE layers by chunks of experts (``Checkpoint.read_experts``, ``read_layer_shell``): every
adapter, hub and fused forms, and the quantised inputs, equal the whole-layer read bit for bit."""

from __future__ import annotations

import pytest
import torch

from moecompress.errors import AdapterError, CheckpointError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.testing import MODEL_TYPES, save_tiny
from moecompress.testing_quantized import save_compressed_tensors, save_fp8_block, save_mxfp4


def _bank_tensors(bank) -> dict[str, torch.Tensor]:
    out = {p: getattr(bank, p).weight for p in ("gate", "up", "down")}
    out.update({f"bias.{k}": v for k, v in bank.biases.items()})
    return out


def _assert_chunks_equal(ckpt, chunks=((0, 1), (1, 3), (0, None))):
    for i in ckpt.moe_layer_indices:
        whole = ckpt.read_layer(i)
        e = whole.experts.num_experts
        for start, stop in chunks:
            stop = e if stop is None else stop
            part = ckpt.read_experts(i, start, stop)
            assert part.num_experts == stop - start
            assert part.act == whole.experts.act and part.alpha == whole.experts.alpha
            got, want = _bank_tensors(part), _bank_tensors(whole.experts)
            assert got.keys() == want.keys()
            for k in want:
                assert torch.equal(got[k], want[k][start:stop]), (i, k, start, stop)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_chunks_equal_whole_layer(tmp_path, model_type, fused):
    save_tiny(model_type, tmp_path / "m", fused=fused)
    _assert_chunks_equal(open_checkpoint(tmp_path / "m"))


def test_chunks_of_fp8_block_input(tmp_path):
    save_fp8_block("deepseek_v3", tmp_path / "m", block=(16, 16))
    _assert_chunks_equal(open_checkpoint(tmp_path / "m"))


def test_chunks_of_compressed_tensors_input(tmp_path):
    save_compressed_tensors("qwen3_moe", tmp_path / "m", kind="w4-group")
    _assert_chunks_equal(open_checkpoint(tmp_path / "m"))


def test_chunks_of_mxfp4_input_read_only_their_rows(tmp_path):
    save_mxfp4(tmp_path / "m", intermediate_size=96)
    ckpt = open_checkpoint(tmp_path / "m")
    _assert_chunks_equal(ckpt)
    seen = []
    rows = ckpt.raw.get_rows
    ckpt.raw.get_rows = lambda name, a, b: seen.append((a, b)) or rows(name, a, b)  # instance spy
    ckpt.read_experts(ckpt.moe_layer_indices[0], 1, 2)
    assert seen and all((a, b) == (1, 2) for a, b in seen)


def test_shell_has_meta_experts_and_real_router(tmp_path):
    save_tiny("deepseek_v3", tmp_path / "m")
    ckpt = open_checkpoint(tmp_path / "m")
    i = ckpt.moe_layer_indices[0]
    shell, whole = ckpt.read_layer_shell(i), ckpt.read_layer(i)
    assert shell.experts.gate.weight.is_meta and shell.experts.down.weight.shape == whole.experts.down.weight.shape
    assert torch.equal(shell.router_weight, whole.router_weight)
    assert torch.equal(shell.score_bias, whole.score_bias)
    assert torch.equal(shell.shared.gate.weight, whole.shared.gate.weight)
    assert not shell.shared.gate.weight.is_meta


def test_bad_range_is_one_line(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    ckpt = open_checkpoint(tmp_path / "m")
    i = ckpt.moe_layer_indices[0]
    for start, stop in ((2, 2), (-1, 1), (0, 10_000)):
        with pytest.raises(AdapterError, match="expert range"):
            ckpt.read_experts(i, start, stop)


def test_moecompress_format_layer_is_refused(tmp_path):
    from test_runtime import _ragged

    from moecompress.engine.layer_loop import rewrite_checkpoint

    save_tiny("qwen3_moe", tmp_path / "m")
    rewrite_checkpoint(tmp_path / "m", tmp_path / "r", _ragged, progress=False)
    ckpt = open_checkpoint(tmp_path / "r")
    i = ckpt.moe_layer_indices[0]
    for read in (lambda: ckpt.read_experts(i, 0, 1), lambda: ckpt.read_layer_shell(i)):
        with pytest.raises(CheckpointError, match=r"moecompress format.*expert_chunk: off"):
            read()
