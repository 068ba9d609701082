"""The expert-by-expert backward (``calibration/moe_backward.py``): its VJP equals autograd through the whole
decoder layer (within rounding), and its terms do not depend on how the experts are split, so the whole
layer, chunks of experts and chunks over ranks give the same bits."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.calibration import moe_backward as mb
from moecompress.calibration.chunked import ChunkedLayer
from moecompress.calibration.skeleton import Skeleton
from moecompress.calibration.stats import StatsCollector

ADAPTERS = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe"]


def _setup(tmp_path, model_type):
    save_tiny(model_type, tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    skel = Skeleton(ckpt, torch.float32)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    hidden, kwargs = skel.capture(ids)
    i = ckpt.moe_layer_indices[-1]
    g = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
    return ckpt, skel, i, hidden, kwargs[i], g


def _canonical(skel, i, x, args, kw, g, size, needs=frozenset({"grad_sq_mean"})):
    layer = ChunkedLayer(skel, i, size)
    col = layer.collector(needs)
    col.mode = "backward"
    mod, dev = layer.module(), skel.device
    p = mb.open_batch(layer, mb.record(layer, mod, x, args, kw, dev), g, col, dev, finish=True)
    for first, bank in layer.chunks(check=False):
        for term in mb.chunk_terms(bank, first, p, col, dev):
            mb.add_grad_term(term, p)
    return mb.close_batch(layer, mod, x, args, kw, p, col, dev), col.result()


@pytest.mark.parametrize("model_type", ADAPTERS)
def test_the_vjp_is_autograd_through_the_whole_layer(tmp_path, model_type):
    """Oracle: the input gradient and ``grad_sq_mean`` equal plain autograd through transformers' decoder
    layer with the whole MoE block (shared expert, biases, clamped activations), to fp32 rounding."""
    ckpt, skel, i, x, (args, kw), g = _setup(tmp_path, model_type)
    moe = ckpt.read_layer(i)
    col = StatsCollector(moe, {"grad_sq_mean"})
    col.mode = "backward"
    leaf = x.detach().requires_grad_(True)
    with torch.enable_grad():
        skel.layer(i, moe, col)(leaf, *args, **kw).backward(g)
    want, want_st = leaf.grad, col.result()
    got, st = _canonical(skel, i, x, args, kw, g, ckpt.adapter.num_experts)
    tol = 16 * torch.finfo(torch.float32).eps * math.sqrt(ckpt.raw_config["hidden_size"])
    assert float((got - want).abs().max()) <= tol * float(want.abs().max())
    assert float(st["grad_sq_mean"].sum()) > 0
    assert torch.allclose(st["grad_sq_mean"], want_st["grad_sq_mean"], rtol=tol, atol=0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_bits_do_not_depend_on_the_split(tmp_path, model_type):
    """Chunks of 1, 3 and E - 1 experts give the whole bank's input gradient and statistics bit for bit."""
    ckpt, skel, i, x, (args, kw), g = _setup(tmp_path, model_type)
    e = ckpt.adapter.num_experts
    want, want_st = _canonical(skel, i, x, args, kw, g, e)
    assert float(want.abs().sum()) > 0
    for size in (1, 3, e - 1):
        got, st = _canonical(skel, i, x, args, kw, g, size)
        assert torch.equal(got, want), size
        assert all(torch.equal(st[k], v) for k, v in want_st.items()), size


def test_rules(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=1)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    assert mb.canonical(ckpt, 0, {"grad_sq_mean", "down_in_grad_cov_pooled"})
    assert not mb.canonical(ckpt, 0, {"grad_sq_mean", "expert_out_gram_fisher"})
