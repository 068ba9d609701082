"""``tdmoe`` on layers held by chunks of experts (issue 37), in two phases: the whitened mode Gram matrices
summed over every expert in fixed blocks, the shared factors fitted once per layer (their leading
eigenvectors, signed as tensorly's HOSVD signs its singular vectors), then every chunk's cores projected onto
them. A layer held whole runs the same two phases (issue 36: the same sums in the same order), so by chunks of
any size the output is the whole layer's, byte for byte; against tensorly's HOSVD of the stack the factors
and every expert's reconstruction agree within ``8·eps(dtype)``. What needs every expert at once (``hooi``,
``r1``, ``budget: from_structure``, an earlier per-expert step that changes the layer) is refused in one
line; the dry run's chunk peak counts both phases."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny import save_tiny

import moecompress as mc
from moecompress.errors import RecipeError
from moecompress.layouts.tucker import Tucker

pytest.importorskip("tensorly")

CAL = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}
PROTECT = {"protect_super_experts": {"manual": [{"layer": 1, "experts": [2, 6]}]}}
TD = {"tdmoe": {"ratio": 0.4}}


def _recipe(model, out, steps, chunk, cache, **cal):
    return {"model": str(model), "output": str(out), "steps": steps, "expert_chunk": chunk,
            "calibration": {**CAL, "cache_dir": str(cache), **cal}}  # fmt: skip


def _run(model, out, steps, chunk, cache, **cal):
    return mc.apply(_recipe(model, out, steps, chunk, cache, **cal), progress=False)


def _plan(model, tmp_path, steps, chunk, **cal):
    rec = _recipe(model, tmp_path / "o", steps, chunk, tmp_path / "c", **cal)
    return mc.apply(rec, dry_run=True, progress=False).report["dry_run"]


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
    (f,) = [f for f in out.glob("steps/*/report.json") if "tdmoe" in f.parent.name]
    return json.loads(f.read_text())["layers"]


def _tiny(model_type, path):
    extra = {"num_experts_per_tok": 2} if model_type == "deepseek_v3" else {}
    save_tiny(model_type, path, num_hidden_layers=2, **extra)


def _projections(t):
    """``{prefix.proj: Tucker}`` of a checkpoint's tensors."""
    out = {}
    for k in t:
        if k.endswith(".u_out"):
            p = k.removesuffix(".u_out")
            out[p] = Tucker(t[p + ".u_out"], t[p + ".u_in"], t[p + ".core"], t[p + ".members"].long(),
                            t.get(p + ".exact"), t.get(p + ".u_expert"))  # fmt: skip
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_chunks_match_the_whole_layer(tmp_path, model_type):
    """The same sums in the same order (fixed blocks, per-expert errors summed in order): by chunks of any
    size, aligned to the blocks or not, the whole layer's bytes and report."""
    _tiny(model_type, tmp_path / "m")
    steps = [PROTECT, TD]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    whole = _tensors(tmp_path / "whole")
    assert _projections(whole)
    for chunk in (1, 3):  # chunk 1: chunks of one protected expert (no core), the factors still written once
        out = tmp_path / f"chunk{chunk}"
        _run(tmp_path / "m", out, steps, chunk, tmp_path / "c")
        got = _tensors(out)
        assert got.keys() == whole.keys()
        for k, t in whole.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), (chunk, k)
        assert _config(tmp_path / "whole") == _config(out)
        for ra, rb in zip(_rows(tmp_path / "whole"), _rows(out), strict=True):
            for k in ("layer", "params_before", "params_after", "bytes_before", "bytes_after", "changed", "info"):
                assert ra[k] == rb[k], k
        mc.load(out)  # the joined layer loads


def test_two_phases_match_tensorly(tmp_path):
    """The default (two phases from the mode Grams) against tensorly's HOSVD of the stack (``stacked``, what
    ``method: hooi``'s initialisation and ``r1`` run): the same ranks, the shared factors and every expert's
    reconstruction within ``8·eps(dtype)``, the whitened errors to 1e-5."""
    from moecompress.engine.spec import LayerStats
    from moecompress.passes.tdmoe import stacked, tdmoe
    from moecompress.passes.tdmoe_chunks import TdmoeConfig

    _tiny("qwen3_moe", tmp_path / "m")
    ck = mc.open_checkpoint(tmp_path / "m")
    g = torch.Generator().manual_seed(1)
    layer = ck.read_layer(ck.moe_layer_indices[0])
    h, i = layer.hidden_size, layer.experts.width
    x, y = torch.randn(64, h, generator=g, dtype=torch.float64), torch.randn(64, i, generator=g, dtype=torch.float64)
    st = LayerStats(0, {"input_cov": x.T @ x / 64, "down_in_cov_pooled": y.T @ y / 64})
    cfg = TdmoeConfig(ratio=0.4)
    (two, a), (ten, b) = tdmoe(layer, st, cfg), stacked(layer, st, cfg)
    for p in ("gate", "up", "down"):
        x2, xt = getattr(two.experts, p), getattr(ten.experts, p)
        eps = torch.finfo(xt.dtype).eps
        assert a[p]["ranks"] == b[p]["ranks"]
        assert a[p]["whitened_rel_error"] == pytest.approx(b[p]["whitened_rel_error"], abs=1e-5)
        for f in ("u_out", "u_in"):
            u, v = getattr(x2, f).double(), getattr(xt, f).double()
            assert (u - v).norm() <= 8 * eps * v.norm(), (p, f)
        for e in range(xt.shape[0]):
            u, v = x2.expert(e).double(), xt.expert(e).double()
            assert (u - v).norm() <= 8 * eps * v.norm(), (p, e)


def test_every_expert_of_a_chunk_protected_and_adaptive_budget(tmp_path):
    """A layer whose every expert is protected is left as it is by chunks too; ``budget: adaptive`` (a plan
    from the statistics, one ratio per layer) gives the whole layer's ranks."""
    _tiny("qwen3_moe", tmp_path / "m")
    every = {"protect_super_experts": {"manual": [{"layer": 0, "experts": list(range(8))}]}}
    steps = [every, {"tdmoe": {"ratio": 0.4, "budget": "adaptive"}}]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    _run(tmp_path / "m", tmp_path / "chunk", steps, 3, tmp_path / "c")
    ra, rb = _rows(tmp_path / "whole"), _rows(tmp_path / "chunk")
    assert ra[0]["info"] == rb[0]["info"] == {"skipped": "every expert is protected"}
    # (the calibration by chunks sums the statistics the plan reads in another order)
    assert ra[1]["info"]["ratio"] == pytest.approx(rb[1]["info"]["ratio"], rel=1e-6) and ra[1]["info"]["ratio"] != 0.4
    for p in ("gate", "up", "down"):
        assert ra[1]["info"][p]["ranks"] == rb[1]["info"][p]["ranks"]
    mc.load(tmp_path / "chunk")


@pytest.mark.parametrize(
    ("cfg", "why"),
    [
        ({"method": "hooi"}, r"method: hooi iterates over every expert.*use method: hosvd"),
        ({"budget": "from_structure"}, r"budget: from_structure.*use budget: uniform or adaptive"),
        ({"r1": 4}, r"r1=4 truncates the expert mode.*leave r1 unset"),
    ],
)
def test_what_needs_every_expert_is_refused_in_one_line(tmp_path, cfg, why):
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    step = {"tdmoe": {"ratio": 0.4, **cfg}}
    with pytest.raises(RecipeError, match=rf"step 1 \(tdmoe\), layer \d+: {why}.*expert_chunk: off") as err:
        _plan(tmp_path / "m", tmp_path, [step], 3)
    assert "\n" not in str(err.value)
    _plan(tmp_path / "m", tmp_path, [step], "off")  # whole layers: accepted
    _plan(tmp_path / "m", tmp_path, [TD], 3)  # the default: by chunks


def test_an_earlier_step_changing_the_experts_is_refused_or_cut(tmp_path):
    """heapr (uniform) then tdmoe: the Gram sweep would have to rerun heapr on every chunk. With
    ``calibration.recalibrate: off`` refused in one line naming both steps and the fix; ``auto`` (the
    default) starts a new segment at tdmoe, calibrated on heapr's output."""
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    steps = [{"heapr": {"ratio": 0.25, "layout": "uniform"}}, TD]
    with pytest.raises(RecipeError) as err:
        _plan(tmp_path / "m", tmp_path, steps, 3, recalibrate="off")
    msg = str(err.value)
    assert "\n" not in msg and "step 2 (tdmoe), layer " in msg and "step 1 (heapr) would have to run twice" in msg
    assert "calibration.recalibrate: auto" in msg and "expert_chunk: off" in msg
    plan = _plan(tmp_path / "m", tmp_path, steps, 3)
    assert plan["segments"] == [["step 1 (heapr)"], ["step 2 (tdmoe)"]]
    _plan(tmp_path / "m", tmp_path, [PROTECT, {"expert_prune": {"ratio": 0.25}}, TD], 3)  # selections: fine


def test_dry_run_states_both_phases_peak(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    label = "step 1 (tdmoe)"
    whole = _plan(tmp_path / "m", tmp_path, [TD], "off")["step_memory"][label]
    peaks = []
    for n in (1, 2, 4):
        p = _plan(tmp_path / "m", tmp_path, [TD], n)["step_memory"][label]
        assert p["chunk"] == n
        peaks.append(p)
    assert [p["bytes"] for p in peaks] == sorted({p["bytes"] for p in peaks}) and peaks[-1]["bytes"] < whole["bytes"]
    # auto: a limit that chunks of 4 meet (tensorly's whole-layer workspace, 6 float64 copies of a projection,
    # is larger than the Grams of these tiny shapes: one chunk of every expert would fit the whole's figure)
    limit = peaks[-1]["bytes"]
    auto = _plan(tmp_path / "m", tmp_path, [TD], "auto", memory_limit=limit)
    assert auto["expert_chunk"] and auto["step_memory"][label]["bytes"] <= limit
    assert max(auto["expert_chunk"].values()) < 8


def test_blocks_follow_the_selections():
    """A first sweep by blocks after selections that remove experts: the blocks are the step input's
    (``fold_blocks`` of its experts), read as ranges of the layer's experts (from the kept ids)."""
    from moecompress.engine.block_sweep import blocks, pieces
    from moecompress.ir import fold_blocks

    assert fold_blocks(128) == [(a, a + 16) for a in range(0, 128, 16)]
    assert fold_blocks(60)[-1] == (56, 60) and len(fold_blocks(60)) == 8
    assert fold_blocks(3) == [(0, 1), (1, 2), (2, 3)]
    assert blocks(16, [None]) == fold_blocks(16)
    kept = [0, 1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, 21, 22]  # 16 of 24 experts
    got = blocks(16, [None, kept])  # 8 blocks of 2 of the step's input
    assert got == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 18), (18, 21), (21, 23)]
    assert blocks(4, [kept, [0, 5, 6, 15]]) == [(0, 7), (7, 9), (9, 22), (22, 23)]  # ids 0, 7, 9, 22
    assert pieces(16, 32, 6) == [(16, 22), (22, 28), (28, 32)]
