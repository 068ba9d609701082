"""Every layout the passes write, loaded through transformers, serves logits equal to the reference
forward of its layers (the lean path of ``CompressedExperts``; docs/serving.md)."""

from __future__ import annotations

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.runtime.quantizer import CompressedExperts
from moecompress.testing import reference_logits

STEPS = {
    "heapr-ragged": {"heapr": {"ratio": 0.4, "scope": "global"}},
    "neuron-uniform": {"neuron_prune": {"ratio": 0.5, "method": "magnitude"}},
    "namex-remap": {"namex": {"ratio": 0.5, "router": "remap", "refine_steps": 0}},
    "tdmoe": {"tdmoe": {"ratio": 0.4}},
    "svd": {"svd_experts": {"ratio": 0.4}},
    "codequant-4": {"codequant": {"bits": 4, "finetune_steps": 0}},
    "rtn-3-sym": {"rtn": {"bits": 3, "group_size": 16, "symmetric": True}},
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    save_tiny("qwen3_moe", root / "m")
    for name, step in STEPS.items():
        recipe = {
            "model": str(root / "m"),
            "output": str(root / name),
            "calibration": {"source": "random", "samples": 8, "seq_len": 16},
            "steps": [{"protect_super_experts": {}}, step] if name == "codequant-4" else [step],
        }
        mc.apply(recipe, progress=False)
    return root


CASES = [(name, None) for name in sorted(STEPS)] + [("codequant-4", "float32"), ("rtn-3-sym", "float32")]


@pytest.mark.parametrize(("name", "dequantize"), CASES)
def test_loaded_logits_equal_the_reference(outputs, name, dequantize):
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    model = mc.load(outputs / name, dequantize=dequantize)
    blocks = [m for m in model.modules() if isinstance(m, CompressedExperts)]
    assert blocks or name == "neuron-uniform", "a compressed layout loads as CompressedExperts"
    with torch.no_grad():
        got = model(ids).logits
        again = model(ids).logits  # the prepared bank is reused
    want = reference_logits(outputs / "m", outputs / name, ids)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    assert torch.equal(got, again)


def test_a_changed_weight_is_served_at_once(outputs):
    """In-place edits of a stored tensor (``load_state_dict`` copies into it) re-prepare the bank."""
    model = mc.load(outputs / "heapr-ragged")
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        block = next(m for m in model.modules() if isinstance(m, CompressedExperts))
        param = next(p for p in block.parameters() if p.dim() == 2)
        param.mul_(0.5)
        after = model(ids).logits
    assert not torch.equal(before, after), "the bank prepared from the old weights was served"
