"""``moecompress inspect`` reports layouts and flags what would crash at load or serve time."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_runtime import _ragged
from tiny import save_tiny

import moecompress as mc
from moecompress.cli import main as cli_main
from moecompress.tools.inspect import inspect_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    return tmp_path / "m"


def _edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_clean_checkpoint_is_ok_and_loads(ckpt, capsys):
    rep = inspect_checkpoint(ckpt, load=True)
    assert rep["ok"] and rep["problems"] == [] and rep["stock_transformers"]["loads"]
    assert [x["physical_experts"] for x in rep["layers"]] == [8, 8, 8]
    assert rep["load_check"]["ok"]
    assert cli_main(["inspect", str(ckpt)]) == 0
    assert "plain transformers: yes" in capsys.readouterr().out


def test_top_k_larger_than_experts_kept(ckpt, capsys):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9
    (ckpt / "config.json").write_text(json.dumps(cfg))
    rep = inspect_checkpoint(ckpt)
    assert not rep["ok"] and {p["layer"] for p in rep["problems"]} == {0, 1, 2}
    assert "top_k=9" in rep["problems"][0]["problem"] and "num_experts_per_tok" in rep["problems"][0]["fix"]
    assert cli_main(["inspect", str(ckpt)]) == 1
    assert "PROBLEM layer 0" in capsys.readouterr().out


def test_missing_expert_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.3.down_proj.weight"))
    rep = inspect_checkpoint(ckpt)
    assert [p["layer"] for p in rep["problems"]] == [2]
    assert "experts.3.down_proj" in rep["problems"][0]["problem"] and "restore" in rep["problems"][0]["fix"]
    assert len(rep["layers"]) == 2, "the other layers are still described"


def test_inconsistent_width(ckpt):
    def narrow(t):
        t["model.layers.1.mlp.experts.4.up_proj.weight"] = torch.zeros(31, 64)

    _edit_tensors(ckpt, narrow)
    rep = inspect_checkpoint(ckpt)
    assert [p["layer"] for p in rep["problems"]] == [1]
    assert "[31, 64]" in rep["problems"][0]["problem"] and "ragged" in rep["problems"][0]["fix"]


def test_ragged_layout_alignment_and_quantizer_load(ckpt, tmp_path):
    mc.rewrite_checkpoint(ckpt, tmp_path / "r", _ragged, progress=False)
    rep = inspect_checkpoint(tmp_path / "r", load=True)
    assert rep["problems"] == [] and rep["load_check"]["ok"]
    assert not rep["stock_transformers"]["loads"] and "moecompress format" in rep["stock_transformers"]["why"]
    assert rep["layers"][0]["width_min"] < rep["layers"][0]["width_max"]
    aligned = inspect_checkpoint(tmp_path / "r", align=16)
    assert any("not multiples of 16" in p["problem"] for p in aligned["problems"])
