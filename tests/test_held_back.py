"""The held-back forwards of the report's reconstruction errors: a dense bank cast to the compute dtype an
expert at a time gives the bits of the whole bank cast at once (``reference.moe_forward``), on every
supported model type (shared experts, biases, group-limited routing), whole or by chunks of experts."""

from __future__ import annotations

import pytest
import torch
from tiny import MODEL_TYPES, save_tiny

from moecompress.engine import chunks
from moecompress.engine.held_back import Errors, _pieces, forward_by_pieces
from moecompress.engine.protection import TopActivation
from moecompress.io.checkpoint import open_checkpoint
from moecompress.ir import cast_layer, layer_to
from moecompress.passes.rtn import RtnConfig, rtn
from moecompress.reference import experts_forward, moe_forward

CPU = torch.device("cpu")


def _layer(tmp_path, model_type: str):
    save_tiny(model_type, tmp_path / "m", dtype=torch.bfloat16)
    ckpt = open_checkpoint(tmp_path / "m")
    idx = ckpt.moe_layer_indices[0]
    return ckpt, idx, ckpt.read_layer(idx)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_forward_by_pieces_is_the_whole_cast_forward_bit_for_bit(tmp_path, model_type):
    _, _, layer = _layer(tmp_path, model_type)
    assert len(_pieces(layer.experts, 1)) == layer.experts.num_experts > 1  # the pieces path, not the fallback
    hx = torch.randn(37, layer.hidden_size, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        top0, top1 = TopActivation(), TopActivation()
        want = moe_forward(layer_to(cast_layer(layer, dtype), CPU), hx.to(dtype), top0)
        got = forward_by_pieces(layer, hx.to(dtype), dtype, CPU, top1)
        assert torch.equal(got, want) and top0.value == top1.value > 0


def test_a_quantised_bank_is_forwarded_whole(tmp_path):
    _, _, layer = _layer(tmp_path, "qwen3_moe")
    new, _ = rtn(layer, {}, RtnConfig(bits=4, group_size=-1))
    assert _pieces(new.experts, 1) == [(0, new.experts)]
    hx = torch.randn(9, layer.hidden_size, generator=torch.Generator().manual_seed(2))
    want = moe_forward(layer_to(cast_layer(new, torch.float32), CPU), hx)
    assert torch.equal(forward_by_pieces(new, hx, torch.float32, CPU), want)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_chunk_s_part_is_one_call_on_the_whole_chunk(tmp_path, model_type):
    ckpt, idx, layer = _layer(tmp_path, model_type)
    shell = ckpt.read_layer_shell(idx)
    hx = torch.randn(29, layer.hidden_size, generator=torch.Generator().manual_seed(3))
    err = Errors([shell], hx, CPU, torch.float32)
    n = layer.experts.num_experts
    for a, b in chunks.bounds(n, max(2, n // 3)):
        bank = ckpt.read_experts(idx, a, b)
        ids, w = err.routes[0]
        local = torch.where((ids >= a) & (ids < b), ids - a, torch.full_like(ids, b - a))
        whole = cast_layer(layer_to(chunks.sub_layer(err.shells[0], bank, a), CPU), torch.float32).experts
        top = TopActivation()
        want = experts_forward(whole, hx, local, w, None, top)
        part = err.part(0, bank, a)
        assert torch.equal(part.acc, want) and part.top == top.value
        err.add(part)
    # the chunks' sums added chunk by chunk: the whole layer's output to float32 rounding (another order)
    torch.testing.assert_close(err.output(0), moe_forward(layer_to(cast_layer(layer, torch.float32), CPU), hx))
