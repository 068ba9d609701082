"""The expert-chunked layer loop (``expert_chunk: N``): byte-identical outputs to the whole-layer loop for
the per-expert and selection passes, on several adapters and chunk sizes; reports that match."""

from __future__ import annotations

import json

import pytest
from tiny import save_tiny

import moecompress as mc

CAL = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}
E = 8  # the tiny models' routed experts


def _run(model, out, steps, chunk, cache):
    rec = {"model": str(model), "output": str(out), "steps": steps, "expert_chunk": chunk,
           "calibration": {**CAL, "cache_dir": str(cache)}}  # fmt: skip
    return mc.apply(rec, progress=False)


def _config(out):
    cfg = json.loads((out / "config.json").read_text())
    cfg.get("moecompress", {}).pop("recipe_hash", None)  # the recipe differs in expert_chunk
    return cfg


def _rows(out):
    rows = {}
    for f in sorted(out.glob("steps/*/report.json")):
        rows[f.parent.name] = json.loads(f.read_text())["layers"]
    return rows


MEANS = ("output_error", "output_error_rtn")


def assert_same_output(whole, chunked):
    names = sorted(p.name for p in whole.glob("*.safetensors"))
    assert names == sorted(p.name for p in chunked.glob("*.safetensors"))
    for name in names:
        assert (whole / name).read_bytes() == (chunked / name).read_bytes(), name
    assert _config(whole) == _config(chunked)
    a, b = _rows(whole), _rows(chunked)
    assert a.keys() == b.keys()
    for step in a:
        for ra, rb in zip(a[step], b[step], strict=True):
            for k in ("layer", "params_before", "params_after", "bytes_before", "bytes_after", "changed"):
                assert ra[k] == rb[k], (step, k)
            for k in ("rel_error", "massive_ratio"):
                if k in ra and ra[k] is not None:
                    assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), (step, k)
            infos_a, infos_b = ra["info"], rb["info"]
            assert infos_a.keys() == infos_b.keys()
            for k, v in infos_a.items():
                if k in MEANS:  # means over experts: the chunks' means weighted, summed in another order
                    assert infos_b[k] == pytest.approx(v, rel=1e-6), (step, k)
                elif k != "rel_error":
                    assert infos_b[k] == v, (step, k)


RECIPES = {
    "rtn": [{"rtn": {"bits": 4}}],
    "identity": [{"identity": {}}],
    "expert_prune": [{"expert_prune": {"ratio": 0.25, "method": "frequency"}}],
    "heapr": [{"heapr": {"ratio": 0.3}}],
    "gptq": [{"gptq": {"bits": 4, "group_size": 16}}],
    "prune_then_rtn": [
        {"protect_super_experts": {"manual": [{"layer": 1, "experts": [2, 6]}]}},
        {"expert_prune": {"ratio": 0.25}},
        {"rtn": {"bits": 4, "group_size": 16}},
    ],
}


SLOW = {("gpt_oss", "prune_then_rtn")}  # the longest case (~20 s); deepseek_v3 covers the chain by default
CASES = [
    pytest.param(m, r, marks=pytest.mark.slow) if (m, r) in SLOW else (m, r)
    for m in ("deepseek_v3", "gpt_oss") for r in sorted(RECIPES)
] + [
    ("qwen3_moe", "rtn"),
    ("qwen3_moe", "heapr"),
    ("qwen3_moe", "gptq"),
    ("mixtral", "expert_prune"),
    ("mixtral", "identity"),
]


@pytest.mark.parametrize(("model_type", "recipe"), CASES)
def test_chunked_equals_whole(tmp_path, model_type, recipe):
    extra = {"num_experts_per_tok": 2} if model_type == "deepseek_v3" else {}  # groups that can lose experts
    save_tiny(model_type, tmp_path / "m", num_hidden_layers=2, **extra)
    steps = RECIPES[recipe]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    sizes = (1, 3, E - 1) if recipe in ("rtn", "prune_then_rtn") and model_type != "qwen3_moe" else (3,)
    for chunk in sizes:
        out = tmp_path / f"chunk{chunk}"
        _run(tmp_path / "m", out, steps, chunk, tmp_path / "c")
        assert_same_output(tmp_path / "whole", out)


def test_chunked_fused_input_and_uniform_heapr(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2, fused=True)
    for steps in ([{"heapr": {"ratio": 0.25, "layout": "uniform", "align": 8}}], [{"rtn": {"bits": 4}}],
                  [{"neuron_prune": {"ratio": 0.25, "layout": "uniform", "align": 8}}]):  # fmt: skip
        _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
        _run(tmp_path / "m", tmp_path / "chunk", steps, 3, tmp_path / "c")
        assert_same_output(tmp_path / "whole", tmp_path / "chunk")
        for d in ("whole", "chunk"):
            import shutil

            shutil.rmtree(tmp_path / d)


def test_chunked_output_loads_and_matches_reference(tmp_path):
    """The chunked output is read back as the whole-layer one (the tensors are equal)."""
    from moecompress.io.checkpoint import open_checkpoint

    save_tiny("deepseek_v3", tmp_path / "m", num_hidden_layers=2, num_experts_per_tok=2)
    _run(tmp_path / "m", tmp_path / "o", RECIPES["prune_then_rtn"], 3, tmp_path / "c")
    ckpt = open_checkpoint(tmp_path / "o")
    for i in ckpt.moe_layer_indices:
        layer = ckpt.read_layer(i)
        assert layer.router.num_experts == 4 and layer.experts.gate.kind == "rtn"
