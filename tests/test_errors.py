"""Bad input: one clear line naming the problem, exit status 2 from the CLI, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_tiny

import moecompress as mc
from moecompress.cli import main as cli_main


@pytest.fixture
def ckpt_dir(tmp_path):
    d = tmp_path / "ckpt"
    save_tiny("qwen3_moe", d)
    return d


def _assert_nothing_written(tmp_path, out_name="out"):
    assert not (tmp_path / out_name).exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out_name}.")]
    assert leftovers == []


def _cli_error(argv, capsys) -> str:
    rc = cli_main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_missing_directory(tmp_path, capsys):
    with pytest.raises(mc.CheckpointError, match="does not exist"):
        mc.open_checkpoint(tmp_path / "nope")
    _cli_error(["rewrite", str(tmp_path / "nope"), str(tmp_path / "out")], capsys)
    _assert_nothing_written(tmp_path)


def test_directory_without_config(tmp_path, ckpt_dir, capsys):
    (ckpt_dir / "config.json").unlink()
    with pytest.raises(mc.CheckpointError, match=r"has no config\.json"):
        mc.open_checkpoint(ckpt_dir)
    err = _cli_error(["rewrite", str(ckpt_dir), str(tmp_path / "out")], capsys)
    assert "config.json" in err
    _assert_nothing_written(tmp_path)


def test_unknown_model_type(tmp_path, ckpt_dir, capsys):
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mc.AdapterError, match="unsupported model_type 'llama'; supported: deepseek_v2"):
        mc.open_checkpoint(ckpt_dir)
    _cli_error(["rewrite", str(ckpt_dir), str(tmp_path / "out")], capsys)
    _assert_nothing_written(tmp_path)


def test_invalid_config_json(ckpt_dir):
    (ckpt_dir / "config.json").write_text("{not json")
    with pytest.raises(mc.CheckpointError, match=r"config.json: invalid JSON"):
        mc.open_checkpoint(ckpt_dir)


def test_truncated_shard(tmp_path, ckpt_dir, capsys):
    shard = ckpt_dir / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(mc.CheckpointError, match=r"corrupt or truncated shard .*model.safetensors"):
        mc.open_checkpoint(ckpt_dir)
    err = _cli_error(["rewrite", str(ckpt_dir), str(tmp_path / "out")], capsys)
    assert "truncated" in err
    _assert_nothing_written(tmp_path)


def test_missing_shard_listed_in_index(tmp_path):
    d = tmp_path / "ckpt"
    save_tiny("qwen3_moe", d, max_shard_size="150KB")
    shards = sorted(d.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(mc.CheckpointError, match=f"missing shard .*{shards[-1].name}"):
        mc.open_checkpoint(d)


def test_missing_expert_tensor(tmp_path, ckpt_dir, capsys):
    shard = ckpt_dir / "model.safetensors"
    tensors = load_file(shard)
    key = "model.layers.1.mlp.experts.5.up_proj.weight"
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(
        mc.AdapterError, match=rf"layer 1: missing tensor '{key}' \(expected shape \[32, 64\]\)"
    ):
        mc.open_checkpoint(ckpt_dir)
    _cli_error(["rewrite", str(ckpt_dir), str(tmp_path / "out")], capsys)
    _assert_nothing_written(tmp_path)


def test_shape_mismatch_names_key_and_shapes(ckpt_dir):
    shard = ckpt_dir / "model.safetensors"
    tensors = load_file(shard)
    key = "model.layers.2.mlp.experts.0.down_proj.weight"
    tensors[key] = torch.zeros(64, 31)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(mc.AdapterError, match=rf"'{key}' has shape \[64, 31\], expected \[64, 32\]"):
        mc.open_checkpoint(ckpt_dir)


def test_unexpected_quantized_tensor(ckpt_dir):
    shard = ckpt_dir / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(mc.AdapterError, match=r"not understood by the adapter .*dequantized"):
        mc.open_checkpoint(ckpt_dir)


def test_pickle_only_checkpoint_is_refused(ckpt_dir):
    (ckpt_dir / "model.safetensors").unlink()
    (ckpt_dir / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(mc.CheckpointError, match=r"only pickle weights .*never unpickles"):
        mc.open_checkpoint(ckpt_dir)


def test_existing_output_is_refused_then_overwritten_atomically(tmp_path, ckpt_dir, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(mc.OutputExistsError, match=r"already exists; pass overwrite=True"):
        mc.rewrite_checkpoint(ckpt_dir, out, progress=False)
    err = _cli_error(["rewrite", str(ckpt_dir), str(out)], capsys)
    assert "--overwrite" in err
    assert (out / "precious.txt").read_text() == "keep me"
    mc.rewrite_checkpoint(ckpt_dir, out, overwrite=True, progress=False)
    assert not (out / "precious.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_failure_mid_write_leaves_nothing(tmp_path, ckpt_dir):
    def boom(layer):
        if layer.index == 2:
            raise RuntimeError("pass failed")
        return layer

    with pytest.raises(RuntimeError, match="pass failed"):
        mc.rewrite_checkpoint(ckpt_dir, tmp_path / "out", boom, progress=False)
    _assert_nothing_written(tmp_path)


def test_reading_a_dense_layer_is_an_error(tmp_path):
    save_tiny("deepseek_v3", tmp_path / "c")
    with pytest.raises(mc.AdapterError, match=r"layer 0 is not an MoE layer; MoE layers are \[1, 2\]"):
        mc.open_checkpoint(tmp_path / "c").read_layer(0)


def test_hub_id_offline_is_one_clear_line(tmp_path):
    code = (
        "import moecompress as mc\n"
        "try:\n    mc.open_checkpoint('no-such-org/no-such-model')\n"
        "except mc.CheckpointError as e:\n    print('ERR', e)\n"
    )
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    line = out.stdout.strip()
    assert line.startswith(
        "ERR 'no-such-org/no-such-model' is not a local directory and could not be downloaded"
    )
    assert "\n" not in line


def test_cli_info_prints_json(ckpt_dir, capsys):
    assert cli_main(["info", str(ckpt_dir)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_type"] == "qwen3_moe" and info["moe_layers"] == [0, 1, 2] and info["num_experts"] == 8
