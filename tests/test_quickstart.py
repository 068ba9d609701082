"""The bundled quickstart model (``moecompress:quickstart``) and ``recipes/quickstart.yaml`` work offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import moecompress as mc
from moecompress.errors import CheckpointError
from moecompress.io.hub import resolve_checkpoint_dir

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart.yaml"
BUNDLED = Path(mc.__file__).resolve().parent / "data" / "quickstart-qwen3moe"
MAX_BYTES = 5_000_000


def test_quickstart_recipe_runs_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe path is absolute; the model spec needs no cwd either
    out = tmp_path / "q"
    res = mc.apply(str(RECIPE), [f"output={out}"], progress=False)
    assert res.output_dir == out
    for name in ("model.safetensors", "report.md", "config.json"):
        assert (out / name).is_file(), name
    heapr = json.loads((out / "steps" / "03-heapr" / "report.json").read_text())
    assert heapr["summary"]["routed_fraction_removed"] == 0.25
    # non-expert tensors are copied unchanged; routed experts are stored ragged
    with safe_open(BUNDLED / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        name = "model.layers.0.self_attn.q_proj.weight"
        assert a.get_tensor(name).equal(b.get_tensor(name))
        assert "model.layers.0.mlp.experts.gate.rows" in set(b.keys())
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(mc.load(out)(ids).logits).all()


def test_bundled_name_resolves():
    path = resolve_checkpoint_dir("moecompress:quickstart")
    assert path == BUNDLED
    ckpt = mc.open_checkpoint("moecompress:quickstart")
    assert ckpt.model_type == "qwen3_moe"
    assert ckpt.moe_layer_indices == [0, 1, 2, 3]
    assert ckpt.adapter.num_experts == 8
    assert ckpt.adapter.router_spec().top_k == 2


def test_unknown_bundled_name_lists_the_bundled_models():
    with pytest.raises(CheckpointError, match=r"moecompress:nope.*moecompress:quickstart"):
        resolve_checkpoint_dir("moecompress:nope")


def test_bundled_folder_is_small_and_documented():
    files = {f.name: f.stat().st_size for f in BUNDLED.iterdir() if f.is_file()}
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert name in files, name
    assert sum(files.values()) <= MAX_BYTES, files
    record = json.loads((BUNDLED / "training.json").read_text())
    assert record["arch"] == "qwen3_moe"
    assert 1.0 < record["val_ppl"] < record["unigram_ppl"]
    config = json.loads((BUNDLED / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == "bfloat16"
