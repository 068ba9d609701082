"""The compute device (``calibration.device``): resolution, one-line refusals, and the moves it relies on.

No GPU is needed: a layout moves to another device by ``from_tensors(tensors(), meta())`` (tested here on
the CPU for every layout: the rebuilt bank computes bit for bit what the original does); the activations
visit the device through :func:`to_device` (tested on ``meta``); the same plumbing runs on the CPU in every
calibration test. ``benchmarks/gpu_device_check.py`` checks CUDA against the CPU when a GPU is lent.
"""

from __future__ import annotations

import pytest
import torch
from test_lean import _banks
from tiny import save_tiny

import moecompress as mc
from moecompress.calibration.skeleton import to_device
from moecompress.engine.context import resolve_device
from moecompress.errors import RecipeError
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec, layer_to
from moecompress.reference import experts_forward

NO_CUDA = not torch.cuda.is_available()


def test_auto_is_cuda_only_when_present():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(not NO_CUDA, reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_unavailable_cuda_is_one_line(name):
    with pytest.raises(RecipeError) as err:
        resolve_device(name)
    msg = str(err.value)
    assert "calibration.device" in msg and name in msg and "\n" not in msg


@pytest.mark.skipif(not NO_CUDA, reason="the refusal is for machines without CUDA")
def test_dry_run_refuses_missing_cuda_and_writes_nothing(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    out = tmp_path / "out"
    rec = {"model": str(tmp_path / "m"), "output": str(out), "steps": [{"identity": {}}],
           "calibration": {"source": "random", "samples": 4, "seq_len": 8, "device": "cuda"}}  # fmt: skip
    with pytest.raises(RecipeError, match=r"calibration\.device"):
        mc.apply(rec, dry_run=True, progress=False)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_dry_run_reports_the_device(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "out"), "steps": [{"identity": {}}],
           "calibration": {"source": "random", "samples": 4, "seq_len": 8, "device": "cpu"}}  # fmt: skip
    assert mc.apply(rec, dry_run=True, progress=False).report["dry_run"]["device"] == "cpu"


@pytest.mark.parametrize("bad", ["tpu", "cuda:", "gpu", "CUDA"])
def test_bad_device_names_the_field(bad):
    rec = {"model": "m", "output": "o", "steps": [{"identity": {}}], "calibration": {"device": bad}}
    with pytest.raises(RecipeError, match=r"calibration\.device.*auto.*cpu.*cuda:N"):
        mc.load_recipe(rec)


@pytest.mark.parametrize("name,bank", list(_banks()), ids=[n for n, _ in _banks()])
def test_a_layout_rebuilt_from_its_tensors_computes_the_same(name, bank):
    """What ``Layout.to(device)`` does, on the CPU: the rebuilt bank's forward is bit-identical."""
    rebuilt = ExpertBank(
        *(type(lay).from_tensors(dict(lay.tensors()), lay.meta()) for lay in (bank.gate, bank.up, bank.down)),
        widths=bank.widths, biases=bank.biases, act=bank.act, alpha=bank.alpha, limit=bank.limit,
        rotation=bank.rotation, act_bits=bank.act_bits, unrotated=bank.unrotated,
    )  # fmt: skip
    x = torch.randn(20, bank.hidden_size, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, bank.num_experts, (20, 2), generator=torch.Generator().manual_seed(4))
    w = torch.rand(20, 2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(experts_forward(bank, x, ids, w), experts_forward(rebuilt, x, ids, w))


def _layer(bank: ExpertBank) -> MoELayer:
    e, h = bank.num_experts, bank.hidden_size
    return MoELayer(0, RouterSpec(e, 2, Gating.SOFTMAX_TOPK), torch.randn(e, h), bank)


@pytest.mark.parametrize("name,bank", list(_banks())[:6], ids=[n for n, _ in _banks()][:6])
def test_layer_to_moves_every_tensor(name, bank):
    layer = _layer(bank)
    assert layer_to(layer, "cpu") is layer  # already there: nothing is copied
    moved = layer_to(layer, "meta")
    held = [moved.router_weight, *(t for lay in (moved.experts.gate, moved.experts.up, moved.experts.down)
                                   for t in lay.tensors().values())]  # fmt: skip
    assert all(t.device.type == "meta" for t in held)
    assert moved.experts.gate.shape == layer.experts.gate.shape and moved.nbytes() == layer.nbytes()


def test_to_device_moves_nested_activations():
    kw = {"position_embeddings": (torch.ones(2, 3), torch.zeros(2, 3)), "mask": None, "flag": True,
          "cache": [torch.ones(1)]}  # fmt: skip
    moved = to_device(kw, torch.device("meta"))
    assert moved["position_embeddings"][0].device.type == "meta" and moved["cache"][0].is_meta
    assert moved["mask"] is None and moved["flag"] is True and isinstance(moved["position_embeddings"], tuple)
