"""Verified outputs: a damaged compressed output never loads with random experts nor ends in a traceback.

Every case damages a real output of ``heapr`` (ragged) or ``rtn`` and checks the four readers:
``AutoModelForCausalLM.from_pretrained`` (through the quantizer), ``moecompress.load``, ``moecompress
eval`` (exit 2, one ``error:`` line) and ``moecompress inspect`` (the same problem, reported).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_evaluate import _tokenizer
from test_runtime import _block_error
from tiny import save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.cli import main as cli_main
from moecompress.runtime.loading import refuse_missing
from moecompress.tools.inspect import inspect_checkpoint

STEPS = {"heapr": {"heapr": {"ratio": 0.25, "scope": "layer"}}, "rtn": {"rtn": {}}}
EVAL = ["-q", "--seq-len", "8", "--max-tokens", "64"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verified")
    save_tiny("qwen3_moe", root / "m", vocab_size=300)  # the eval tokenizer has 300 ids
    _tokenizer(root / "m")
    for name, step in STEPS.items():
        recipe = {
            "model": str(root / "m"),
            "output": str(root / name),
            "calibration": {"source": "random", "samples": 4, "seq_len": 8},
            "steps": [step],
        }
        mc.apply(recipe, progress=False)
    return root


def _copy(outputs, tmp_path, name: str):
    out = tmp_path / name
    shutil.copytree(outputs / name, out)
    return out


def _edit_config(out, fn) -> None:
    cfg = json.loads((out / "config.json").read_text())
    fn(cfg)
    (out / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(out, fn) -> None:
    tensors = load_file(out / "model.safetensors")
    fn(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def _layer(cfg, i=0):
    return cfg["moecompress"]["layers"][str(i)]


def _set(path: list, value):
    """An edit setting ``cfg["moecompress"]["layers"]["0"]["experts"][path...] = value``."""

    def edit(cfg):
        node = _layer(cfg)["experts"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _width_30(cfg):
    experts = _layer(cfg)["experts"]
    experts["gate"]["shape"] = experts["up"]["shape"] = [8, 30, 64]
    experts["down"]["shape"] = [8, 64, 30]


def _undeclared(t):
    t["model.layers.0.mlp.experts.rotation"] = torch.eye(64)


CASES = {  # name: (output, config edit, tensor edit, what the one line must say)
    "dropped_layer": ("heapr", lambda c: c["moecompress"]["layers"].pop("1"), None, "no entry '1'"),
    "tensor_shapes": ("heapr", _set(["gate", "tensor_shapes", "rows"], [190, 64]), None,
                      "experts.gate.tensor_shapes.rows) declares [190, 64]"),
    "rtn_tensor_shapes": ("rtn", _set(["down", "tensor_shapes", "codes"], [8, 64, 17]), None,
                          "experts.down.tensor_shapes.codes) declares [8, 64, 17]"),
    "shape": ("heapr", _set(["gate", "shape"], [8, 30, 64]), None, "experts.gate.shape is [8, 30, 64]"),
    "rtn_shape": ("rtn", _set(["up", "shape"], [8, 32, 60]), None, "do not form a 'rtn' layout"),
    "shape_beyond_live_widths": ("heapr", _width_30, None, "allocate a width of 30"),
    "dtype": ("rtn", _set(["up", "dtypes", "scales"], "float32"), None, "experts.up.dtypes.scales) declares float32"),
    "unknown_kind": ("heapr", _set(["up", "kind"], "sparse24"), None, "unknown layout kind 'sparse24'"),
    "kind_not_a_string": ("heapr", _set(["up", "kind"], 7), None, "unknown layout kind 7"),
    "shape_not_a_list": ("heapr", _set(["up", "shape"], "8x32x64"), None, "experts.up.shape is \"8x32x64\""),
    "block_not_an_object": ("heapr", lambda c: c.__setitem__("moecompress", 5), None, "'moecompress' is 5"),
    "layers_not_an_object": ("heapr", lambda c: c["moecompress"].__setitem__("layers", []), None,
                             "moecompress.layers is []"),
    "description_not_an_object": ("rtn", lambda c: c["moecompress"]["layers"].__setitem__("1", 5), None,
                                  "moecompress.layers.1 is 5"),
    "tensor_missing": ("heapr", None, lambda t: t.pop("model.layers.2.mlp.experts.down.rows"),
                       "'model.layers.2.mlp.experts.down.rows' that config.json declares"),
    "tensor_undeclared": ("heapr", None, _undeclared, "'model.layers.0.mlp.experts.rotation' is stored"),
}  # fmt: skip


def _one_line(err: BaseException, marker: str) -> None:
    text = str(err)
    assert "\n" not in text and marker in text, text
    assert "re-run the recipe" in text or "re-download" in text or "upgrade" in text, text


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_output_fails_with_one_line_everywhere(outputs, tmp_path, capsys, case):
    source, edit_config, edit_tensors, marker = CASES[case]
    out = _copy(outputs, tmp_path, source)
    if edit_config:
        _edit_config(out, edit_config)
    if edit_tensors:
        _edit_tensors(out, edit_tensors)
    with pytest.raises(mc.CheckpointError) as hf:
        AutoModelForCausalLM.from_pretrained(out)
    _one_line(hf.value, marker)
    with pytest.raises(mc.CheckpointError) as ours:
        mc.load(out)
    _one_line(ours.value, marker)
    capsys.readouterr()
    assert cli_main(["eval", str(out), *EVAL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and marker in err[0], err
    report = inspect_checkpoint(out)
    assert not report["ok"] and not report["moecompress_quantizer"]["loads"]
    assert any(marker in p["problem"] for p in report["problems"]), report["problems"]


def test_inspect_collects_every_damaged_layer(outputs, tmp_path):
    out = _copy(outputs, tmp_path, "rtn")

    def damage(cfg):
        _layer(cfg, 0)["experts"]["up"]["kind"] = "sparse24"
        _layer(cfg, 2)["experts"]["gate"]["dtypes"]["codes"] = "int8"

    _edit_config(out, damage)
    report = inspect_checkpoint(out)
    assert [p["layer"] for p in report["problems"]] == [0, 2]
    assert [x["layer"] for x in report["layers"]] == [1], "the undamaged layer is still described"
    with pytest.raises(mc.CheckpointError, match=r"layer 0: .*unknown layout kind"):
        mc.load(out)


@pytest.mark.parametrize("source", sorted(STEPS))
def test_an_undamaged_output_loads_and_equals_the_reference(outputs, source):
    out = outputs / source
    ckpt = mc.open_checkpoint(out)
    for model in (AutoModelForCausalLM.from_pretrained(out).eval(), mc.load(out)):
        assert _block_error(model, ckpt) <= 1e-5
    report = inspect_checkpoint(out)
    assert report["ok"] and report["problems"] == []
    assert cli_main(["eval", str(out), *EVAL]) == 0


def test_layers_described_without_quantization_config(outputs, tmp_path, capsys):
    out = _copy(outputs, tmp_path, "heapr")
    _edit_config(out, lambda c: c.pop("quantization_config"))
    marker = "quantization_config is not"
    with pytest.raises(mc.CheckpointError) as ours:
        mc.load(out)
    _one_line(ours.value, marker)
    capsys.readouterr()
    assert cli_main(["eval", str(out), *EVAL]) == 2
    assert marker in capsys.readouterr().err
    assert any(marker in p["problem"] for p in inspect_checkpoint(out)["problems"])


def test_quantization_config_format_not_an_integer(outputs, tmp_path):
    out = _copy(outputs, tmp_path, "rtn")
    _edit_config(out, lambda c: c["quantization_config"].__setitem__("format", "one"))
    with pytest.raises(mc.CheckpointError, match=r"quantization_config\.format is 'one'"):
        AutoModelForCausalLM.from_pretrained(out)


def test_moe_keys_transformers_reports_missing_are_refused(outputs, tmp_path):
    """A stock checkpoint missing an expert tensor: plain transformers initialises it randomly; the
    checker refuses it before loading, and so does the loading-info check after loading."""
    out = tmp_path / "stock"
    shutil.copytree(outputs / "m", out)

    def drop_down(t):
        for e in range(8):
            t.pop(f"model.layers.1.mlp.experts.{e}.down_proj.weight")

    _edit_tensors(out, drop_down)
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert any(".layers.1.mlp.experts." in k for k in info["missing_keys"])
    adapter = mc.open_checkpoint(out, validate=False).adapter
    with pytest.raises(mc.CheckpointError, match="initialise it randomly") as err:
        refuse_missing(adapter, info["missing_keys"], out)
    assert "model.layers.1.mlp.experts" in str(err.value)
    with pytest.raises(mc.CheckpointError, match=r"layer 1: .*missing tensor"):
        mc.load(out)
