"""``codequant`` on layers held by chunks of experts (issue 37): k-means only (``finetune_steps: 0``) is
byte-identical to the whole layer, with protected experts, also rotated (the rotation is computed once per
layer, the same as the whole layer's); the fine-tuned run (each chunk on its own experts' part of the
block's output) loads and is close to the whole layer's; a quantised shared expert is refused in one line;
the dry run's peak follows the chunk size."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny import save_tiny

import moecompress as mc
from moecompress.errors import RecipeError
from moecompress.passes import codequant as cq

CAL = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}
E = 8  # the tiny models' routed experts
PROTECT = {"protect_super_experts": {"manual": [{"layer": 1, "experts": [2, 6]}]}}


def _recipe(model, out, steps, chunk, cache):
    return {"model": str(model), "output": str(out), "steps": steps, "expert_chunk": chunk,
            "calibration": {**CAL, "cache_dir": str(cache)}}  # fmt: skip


def _run(model, out, steps, chunk, cache):
    return mc.apply(_recipe(model, out, steps, chunk, cache), progress=False)


def _tensors(out):
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                got[k] = st.get_tensor(k)
    return got


def _config(out):
    cfg = json.loads((out / "config.json").read_text())
    cfg.get("moecompress", {}).pop("recipe_hash", None)  # the recipe differs in expert_chunk
    return cfg


def _rows(out):
    (f,) = [f for f in out.glob("steps/*/report.json") if "codequant" in f.parent.name]
    return json.loads(f.read_text())["layers"]


def _tiny(model_type, path):
    extra = {"num_experts_per_tok": 2} if model_type == "deepseek_v3" else {}
    save_tiny(model_type, path, num_hidden_layers=2, **extra)


# shared: false, the shared expert (deepseek_v3) stays dense: by chunks it cannot be changed
KMEANS = {"bits": 3, "finetune_steps": 0, "shared": False, "kmeans_iters": 50}


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [("qwen3_moe", {}), ("deepseek_v3", {}), ("qwen3_moe", {"rotation": "hadamard", "group": 16})],
)
def test_kmeans_only_by_chunks_equals_the_whole_layer(tmp_path, model_type, extra):
    _tiny(model_type, tmp_path / "m")
    steps = [PROTECT, {"codequant": {**KMEANS, **extra}}]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    for chunk in (1, 3):  # chunk 1: chunks of one protected expert
        out = tmp_path / f"chunk{chunk}"
        _run(tmp_path / "m", out, steps, chunk, tmp_path / "c")
        names = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
        assert names == sorted(p.name for p in out.glob("*.safetensors"))
        for name in names:
            assert (tmp_path / "whole" / name).read_bytes() == (out / name).read_bytes(), (chunk, name)
        assert _config(tmp_path / "whole") == _config(out)
        for ra, rb in zip(_rows(tmp_path / "whole"), _rows(out), strict=True):
            for k in ("layer", "params_before", "params_after", "bytes_before", "bytes_after", "changed"):
                assert ra[k] == rb[k], k
            for k in ("rel_error", "massive_ratio"):  # the held-back error: summed over chunks
                assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), k
            ia, ib = ra["info"], rb["info"]
            for k in ("protected", "bits", "bytes_before", "bytes_after", "routed_params", "quantised_experts",
                      "bytes_per_param", "rotation", "best_step", "router_kl"):  # fmt: skip
                assert ib[k] == ia[k], k
            for k in ("act_error_unrotated", "act_error_hadamard"):
                assert ib.get(k) == ia.get(k), k
    whole = _tensors(tmp_path / "whole")
    rot = [k for k in whole if k.endswith(".rotation")]
    assert bool(rot) == ("rotation" in extra)
    # protected experts of layer 1 stay bit-identical to the input
    base = _tensors(tmp_path / "m")
    exact = [k for k in whole if ".layers.1." in k and k.endswith(".exact")]
    assert exact
    for k in exact:
        proj = k.split(".")[-2]
        src = [n for n in base if ".layers.1." in n and f"{proj}_proj" in n and "shared" not in n]
        want = torch.stack([base[n] for n in sorted(src) if f".experts.{2}." in n or f".experts.{6}." in n])
        if whole[k].shape == want.shape:  # per-expert stock names (qwen3_moe, deepseek_v3)
            assert torch.equal(whole[k], want), k


def test_the_rotation_is_computed_once_per_layer_and_equals_the_whole_layers(tmp_path, monkeypatch):
    _tiny("qwen3_moe", tmp_path / "m")
    steps = [{"codequant": {**KMEANS, "rotation": "learned", "rotation_steps": 5}}]
    calls = []
    real = cq._rotation

    def counted(layer, x, cfg, info):
        calls.append(layer.index)
        return real(layer, x, cfg, info)

    monkeypatch.setattr(cq, "_rotation", counted)
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    whole_calls, calls[:] = list(calls), []
    _run(tmp_path / "m", tmp_path / "chunk", steps, 3, tmp_path / "c")  # 3 chunks per layer
    assert sorted(calls) == sorted(whole_calls) and len(calls) == len(set(calls)) == 2
    a, b = _tensors(tmp_path / "whole"), _tensors(tmp_path / "chunk")
    rot = [k for k in a if k.endswith(".rotation")]
    assert len(rot) == 2
    for k in rot:
        assert torch.equal(a[k], b[k]), k
    for ra, rb in zip(_rows(tmp_path / "whole"), _rows(tmp_path / "chunk"), strict=True):
        assert ra["info"]["rotation_loss_first_last"] == rb["info"]["rotation_loss_first_last"]
        assert ra["info"]["act_error_learned"] == rb["info"]["act_error_learned"]


def test_a_quantised_shared_expert_is_refused_by_chunks_in_one_line(tmp_path):
    _tiny("deepseek_v3", tmp_path / "m")
    rec = _recipe(tmp_path / "m", tmp_path / "o", [{"codequant": {"bits": 4}}], 3, tmp_path / "c")
    with pytest.raises(RecipeError) as err:
        mc.apply(rec, dry_run=True, progress=False)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("step 1 (codequant), layer ") and "shared: true" in msg and "shared: false" in msg
    mc.apply({**rec, "steps": [{"codequant": {"bits": 4, "shared": False}}]}, dry_run=True, progress=False)
    mc.apply({**rec, "expert_chunk": "off"}, dry_run=True, progress=False)  # whole layers: accepted
    # no shared expert (qwen3_moe): the default shared: true is accepted by chunks
    _tiny("qwen3_moe", tmp_path / "q")
    mc.apply(_recipe(tmp_path / "q", tmp_path / "o", [{"codequant": {}}], 3, tmp_path / "c"), dry_run=True,
             progress=False)  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_finetuned_by_chunks_loads_and_is_close_to_the_whole_layer(tmp_path, model_type):
    from moecompress.io.checkpoint import open_checkpoint
    from moecompress.reference import moe_forward

    _tiny(model_type, tmp_path / "m")
    steps = [PROTECT, {"codequant": {"bits": 3, "finetune_steps": 5, "shared": False, "kmeans_iters": 50}}]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    _run(tmp_path / "m", tmp_path / "chunk", steps, 3, tmp_path / "c")
    a, b = _tensors(tmp_path / "whole"), _tensors(tmp_path / "chunk")
    assert a.keys() == b.keys()
    for k, t in a.items():
        assert b[k].shape == t.shape and b[k].dtype == t.dtype, k
        if not k.endswith(".centroids") and not k.endswith(".codes"):
            assert torch.equal(b[k], t), k  # routers, exact (protected) experts, shared expert, the rest
    base, whole, chunk = (open_checkpoint(tmp_path / d) for d in ("m", "whole", "chunk"))
    torch.manual_seed(0)
    for i in base.moe_layer_indices:
        ref = base.read_layer(i)
        x = torch.randn(64, ref.hidden_size)
        y = moe_forward(ref, x).float()

        def err(ck, i=i, x=x, y=y):
            return float(((moe_forward(ck.read_layer(i), x).float() - y) ** 2).sum() / (y**2).sum())

        ew, ec = err(whole), err(chunk)
        assert ec < 0.2 and ec <= 1.5 * ew + 1e-4, (i, ew, ec)
    rows = _rows(tmp_path / "chunk")
    for r in rows:
        info = r["info"]
        assert len(info["best_step_per_chunk"]) == 3 and info["router_kl"] == 0.0
        assert info["quantised_experts"] == E - len(info["protected"])


def test_dry_run_states_the_chunks_peak(tmp_path):
    _tiny("qwen3_moe", tmp_path / "m")
    steps, label = [{"codequant": {"bits": 4}}], "step 1 (codequant)"

    def plan(chunk):
        rec = _recipe(tmp_path / "m", tmp_path / "o", steps, chunk, tmp_path / "c")
        return mc.apply(rec, dry_run=True, progress=False).report["dry_run"]

    whole = plan("off")
    w = whole["step_memory"][label]
    peaks = []
    for n in (1, 2, 4):  # the step's peak for the chunk size: its input, codebooks and workspace shrink
        chunked = plan(n)
        assert set(chunked["expert_chunk"].values()) == {n} and chunked["step_memory"][label]["chunk"] == n
        peaks.append(chunked["step_memory"][label]["bytes"])
    assert peaks == sorted(set(peaks)) and peaks[-1] < w["bytes"]
    limit = w["bytes"] - 1
    auto = mc.apply({**_recipe(tmp_path / "m", tmp_path / "o", steps, "auto", tmp_path / "c"),
                     "calibration": {**CAL, "cache_dir": str(tmp_path / "c"), "memory_limit": limit}},
                    dry_run=True, progress=False).report["dry_run"]  # fmt: skip
    assert auto["expert_chunk"] and auto["step_memory"][label]["bytes"] <= limit
