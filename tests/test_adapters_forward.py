"""Oracle: the reference forward of every adapter's canonical layer equals transformers' MoE block."""

from __future__ import annotations

import pytest
import torch
from tiny import MODEL_TYPES, save_tiny

import moecompress as mc

TOL = 1e-5


def _hf_block_out(model, i: int, x: torch.Tensor) -> torch.Tensor:
    out = model.model.layers[i].mlp(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("fused", [False, True], ids=["hub", "fused"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_reference_matches_transformers_block(tmp_path, model_type, fused):
    model = save_tiny(model_type, tmp_path / "ckpt", fused=fused)
    ckpt = mc.open_checkpoint(tmp_path / "ckpt")
    assert ckpt.model_type == model_type
    assert ckpt.moe_layer_indices, "every tiny config has MoE layers"
    g = torch.Generator().manual_seed(1)
    for i in ckpt.moe_layer_indices:
        layer = ckpt.read_layer(i)
        x = torch.randn(37, model.config.hidden_size, generator=g)
        with torch.no_grad():
            want = _hf_block_out(model, i, x)
            got = mc.moe_forward(layer, x)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert _rel_err(got, want) <= TOL, f"{model_type} layer {i}: rel err {_rel_err(got, want):.2e}"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_moe_layer_indices_match_transformers_modules(tmp_path, model_type):
    model = save_tiny(model_type, tmp_path / "ckpt")
    ckpt = mc.open_checkpoint(tmp_path / "ckpt")
    has_experts = [i for i, lyr in enumerate(model.model.layers) if hasattr(lyr.mlp, "experts")]
    assert ckpt.moe_layer_indices == has_experts


def test_decoder_sparse_step_and_ungrouped_routers(tmp_path):
    """Layer rules and router variants beyond the default tiny configs."""
    cases = {
        "qwen3_moe": dict(decoder_sparse_step=2, num_hidden_layers=4, norm_topk_prob=False),
        "deepseek_v2": dict(topk_method="greedy", n_group=None, topk_group=None),
        "deepseek_v3": dict(norm_topk_prob=False, n_group=1, topk_group=1),
    }
    for model_type, over in cases.items():
        d = tmp_path / model_type
        model = save_tiny(model_type, d, seed=3, **over)
        ckpt = mc.open_checkpoint(d)
        for i in ckpt.moe_layer_indices:
            x = torch.randn(29, model.config.hidden_size)
            with torch.no_grad():
                err = _rel_err(mc.moe_forward(ckpt.read_layer(i), x), _hf_block_out(model, i, x))
            assert err <= TOL, f"{model_type} {over} layer {i}: {err:.2e}"
    assert mc.open_checkpoint(tmp_path / "qwen3_moe").moe_layer_indices == [1, 3]
