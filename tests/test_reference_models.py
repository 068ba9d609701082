"""The trained reference models in ../shared (skipped when absent): real weights, real text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import moecompress as mc

REF_MODELS = ["ref-qwen3moe", "ref-mixtral", "ref-deepseekv3"]

pytestmark = pytest.mark.shared


def _held_out_ids(shared_dir, model_dir, n_tokens=96):
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    text = (shared_dir / "data" / "corpus" / "python_docs.txt").read_text(errors="replace")
    tail = text[int(len(text) * 0.98) :]  # the held-out 2%
    return torch.tensor([tok(tail[:4000])["input_ids"][:n_tokens]])


@pytest.mark.parametrize("name", REF_MODELS)
def test_reference_forward_on_real_activations(shared_dir, name):
    model_dir = shared_dir / "data" / "models" / name
    ckpt = mc.open_checkpoint(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [
        model.model.layers[i].mlp.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(
                i, (args[0][0], (out[0] if isinstance(out, tuple) else out)[0])
            )
        )
        for i in ckpt.moe_layer_indices
    ]
    with torch.no_grad():
        model(_held_out_ids(shared_dir, model_dir))
    for h in hooks:
        h.remove()
    assert sorted(captured) == ckpt.moe_layer_indices
    for i, (x, want) in captured.items():
        got = mc.moe_forward(ckpt.read_layer(i), x)
        rel = float((got - want).abs().max() / want.abs().max())
        assert rel <= 1e-5, f"{name} layer {i}: {rel:.2e}"


@pytest.mark.parametrize("name", REF_MODELS)
def test_reference_model_round_trip(shared_dir, tmp_path, name):
    model_dir = shared_dir / "data" / "models" / name
    mc.rewrite_checkpoint(model_dir, tmp_path / "out", progress=False)
    ids = _held_out_ids(shared_dir, model_dir, 48)
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits
    assert torch.equal(a, b)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
