"""Chunks of experts read expert by expert into one reused tensor per projection
(``calibration/chunk_buffer.py``, ``chunked.read_into``): the bits of the chunk read whole and cast, on every
adapter, hub and fused forms, the quantised inputs, both compute dtypes; the tensors reused from chunk to chunk
and layer to layer; a damaged expert named. A layer held whole cast into the same tensors
(``chunked.cast_into``): the bits of ``cast_layer``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from moecompress.calibration.chunk_buffer import ChunkBuffer
from moecompress.calibration.chunked import cast_into, read_into, ready_bank
from moecompress.engine.chunks import bounds
from moecompress.errors import CheckpointError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.ir import cast_layer, layer_to
from moecompress.passes.rtn import RtnConfig, rtn
from moecompress.testing import MODEL_TYPES, save_tiny
from moecompress.testing_quantized import save_compressed_tensors, save_fp8_block, save_mxfp4

CPU = torch.device("cpu")


def _tensors(bank) -> dict[str, torch.Tensor]:
    out = {p: getattr(bank, p).weight for p in ("gate", "up", "down")}
    out.update({f"bias.{k}": v for k, v in bank.biases.items()})
    return out


def _assert_reads_equal(ckpt, size: int = 3) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        buf = ChunkBuffer()
        for i in ckpt.moe_layer_indices:
            e = ckpt.read_layer_shell(i).experts.num_experts
            for a, b in bounds(e, size):  # the last chunk may be smaller: a view of the buffer's first rows
                want = ready_bank(ckpt.read_experts(i, a, b), dtype, CPU)
                got = read_into(ckpt, i, a, b, buf, dtype, CPU, check=True)
                assert got.num_experts == b - a and got.act == want.act and got.alpha == want.alpha
                g, w = _tensors(got), _tensors(want)
                assert g.keys() == w.keys()
                for k in w:
                    assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), (i, a, b, k, dtype)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_read_into_is_the_chunk_read_whole_and_cast(tmp_path, model_type, fused):
    save_tiny(model_type, tmp_path / "m", fused=fused, dtype=torch.bfloat16)
    _assert_reads_equal(open_checkpoint(tmp_path / "m"))


@pytest.mark.parametrize("kind", ["fp8", "w4-group", "mxfp4"])
def test_read_into_quantised_inputs(tmp_path, kind):
    if kind == "fp8":
        save_fp8_block("deepseek_v3", tmp_path / "m", block=(16, 16))
    elif kind == "mxfp4":
        save_mxfp4(tmp_path / "m", intermediate_size=96)
    else:
        save_compressed_tensors("qwen3_moe", tmp_path / "m", kind=kind)
    _assert_reads_equal(open_checkpoint(tmp_path / "m"), size=2)


def test_the_buffer_is_reused_across_chunks_and_layers(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", dtype=torch.bfloat16)
    ckpt = open_checkpoint(tmp_path / "m")
    buf = ChunkBuffer()
    ptrs = set()
    for i in ckpt.moe_layer_indices:
        for a, b in bounds(ckpt.read_layer_shell(i).experts.num_experts, 3):
            bank = read_into(ckpt, i, a, b, buf, torch.float32, CPU, check=False)
            ptrs.add(tuple(getattr(bank, p).weight.data_ptr() for p in ("gate", "up", "down")))
    assert len(ckpt.moe_layer_indices) > 1 and len(ptrs) == 1


def test_the_buffer_is_replaced_for_another_shape_dtype_or_more_rows():
    buf = ChunkBuffer()
    t = buf.take("gate", (4, 6, 8), torch.float32, CPU)
    assert buf.take("gate", (2, 6, 8), torch.float32, CPU).data_ptr() == t.data_ptr()  # fewer rows: a view
    for shape, dtype in (((5, 6, 8), torch.float32), ((4, 7, 8), torch.float32), ((4, 6, 8), torch.bfloat16)):
        u = buf.take("gate", shape, dtype, CPU)
        assert tuple(u.shape) == shape and u.dtype == dtype
    assert buf.take("up", (4, 6, 8), torch.float32, CPU).shape == (4, 6, 8)  # one tensor per projection


def test_a_damaged_expert_is_named(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    shard = next((tmp_path / "m").glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["model.layers.0.mlp.experts.4.down_proj.weight"][1, 2] = float("inf")
    save_file(tensors, shard, metadata={"format": "pt"})
    ckpt = open_checkpoint(tmp_path / "m")
    buf = ChunkBuffer()
    read_into(ckpt, 0, 0, 3, buf, torch.float32, CPU, check=True)  # experts 0-2 are fine
    with pytest.raises(CheckpointError, match=r"layer 0: expert 4 down_proj"):
        read_into(ckpt, 0, 3, 6, buf, torch.float32, CPU, check=True)


def test_weights_beyond_the_compute_dtype_are_named(tmp_path):
    """Finite in the checkpoint (float32), infinite in float16: the overflow is named, not a damaged checkpoint."""
    save_tiny("qwen3_moe", tmp_path / "m", dtype=torch.float32)
    shard = next((tmp_path / "m").glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["model.layers.0.mlp.experts.4.gate_proj.weight"][0, 0] = 1e6
    save_file(tensors, shard, metadata={"format": "pt"})
    ckpt = open_checkpoint(tmp_path / "m")
    buf = ChunkBuffer()
    read_into(ckpt, 0, 3, 6, buf, torch.float32, CPU, check=True)  # float32 holds it
    with pytest.raises(CheckpointError, match=r"layer 0: experts 3\.\.5 gate_proj .* calibration.dtype float16; set"):
        read_into(ckpt, 0, 3, 6, buf, torch.float16, CPU, check=True)


def test_a_chunk_is_one_read_into_the_buffer(tmp_path, monkeypatch):
    """One ``read_experts`` per chunk, its weights copied into the buffer as read (no stacked copy first)."""
    save_tiny("qwen3_moe", tmp_path / "m", dtype=torch.bfloat16)
    ckpt = open_checkpoint(tmp_path / "m")
    reads, real = [], ckpt.read_experts
    monkeypatch.setattr(ckpt, "read_experts", lambda i, a, b, alloc=None: reads.append((a, b, alloc)) or real(i, a, b, alloc))
    buf = ChunkBuffer()
    bank = read_into(ckpt, 0, 2, 7, buf, torch.float32, CPU, check=True)
    assert [(a, b) for a, b, _ in reads] == [(2, 7)] and reads[0][2] is not None
    assert bank.gate.weight.data_ptr() == buf.take("gate", (5, *bank.gate.weight.shape[1:]), torch.float32, CPU).data_ptr()


def _layer_tensors(layer) -> dict[str, torch.Tensor]:
    out = {f"experts.{k}": v for k, v in _tensors(layer.experts).items()}
    if layer.shared is not None:
        out.update({f"shared.{k}": v for k, v in _tensors(layer.shared).items()})
    for name in ("router_weight", "router_bias", "score_bias", "shared_gate", "expert_map"):
        if getattr(layer, name) is not None:
            out[name] = getattr(layer, name)
    return out


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cast_into_is_cast_layer(tmp_path, model_type):
    save_tiny(model_type, tmp_path / "m", dtype=torch.bfloat16)
    ckpt = open_checkpoint(tmp_path / "m")
    buf = ChunkBuffer()
    for i in ckpt.moe_layer_indices:
        layer = ckpt.read_layer(i)
        want = layer_to(cast_layer(layer, torch.float32), CPU)
        got = cast_into(layer, buf, torch.float32, CPU)
        assert got.experts.gate.weight.data_ptr() == buf.take("gate", (1, *layer.experts.gate.weight.shape[1:]),
                                                              torch.float32, CPU).data_ptr()  # fmt: skip
        g, w = _layer_tensors(got), _layer_tensors(want)
        assert g.keys() == w.keys()
        for k in w:
            assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), (model_type, i, k)


def test_cast_into_leaves_what_needs_no_cast_or_is_not_dense(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", dtype=torch.bfloat16)
    ckpt = open_checkpoint(tmp_path / "m")
    layer = ckpt.read_layer(ckpt.moe_layer_indices[0])
    buf = ChunkBuffer()
    same = cast_into(layer, buf, torch.bfloat16, CPU)  # already in the compute dtype: no copy at all
    assert same.experts.gate.weight.data_ptr() == layer.experts.gate.weight.data_ptr() and not buf._held
    quant, _ = rtn(layer, {}, RtnConfig(bits=4, group_size=-1))
    got = cast_into(quant, buf, torch.float32, CPU)
    want = layer_to(cast_layer(quant, torch.float32), CPU)
    assert type(got.experts.gate) is type(quant.experts.gate) and not buf._held
    for (k, a), (_, b) in zip(got.experts.gate.tensors().items(), want.experts.gate.tensors().items(), strict=True):
        assert torch.equal(a, b), k
