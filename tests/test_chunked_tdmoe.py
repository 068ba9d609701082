"""``tdmoe`` on layers held by chunks of experts (issue 37), in two phases: the whitened mode Gram matrices
summed over every chunk, the shared factors fitted once per layer (their leading eigenvectors, signed as
tensorly's HOSVD signs its singular vectors), then every chunk's cores projected onto them.

Against the whole layer (tensorly's HOSVD of the stacked experts): the same tensor names, shapes, dtypes
and infos, the shared factors equal to rounding, every expert's reconstruction within
``8·eps(dtype)·‖Ŵ_e‖`` (the cores differ only in float64 rounding, 1 ulp of the stored dtype at most), the
loaded models' logits within a KL of 1e-9 on random tokens; what needs every expert at once (``hooi``,
``r1``, ``budget: from_structure``, an earlier per-expert step that changes the layer) is refused in one
line; the dry run's chunk peak counts both phases."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tiny import reference_logits, save_tiny

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
    _tiny(model_type, tmp_path / "m")
    steps = [PROTECT, TD]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    whole = _tensors(tmp_path / "whole")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = reference_logits(tmp_path / "m", tmp_path / "whole", ids).double()
    for chunk in (1, 3):  # chunk 1: chunks of one protected expert (no core), the factors still written once
        out = tmp_path / f"chunk{chunk}"
        _run(tmp_path / "m", out, steps, chunk, tmp_path / "c")
        got = _tensors(out)
        assert got.keys() == whole.keys()
        for k, t in whole.items():
            assert got[k].shape == t.shape and got[k].dtype == t.dtype, k
            if not k.endswith((".core", ".u_out", ".u_in")):
                assert torch.equal(got[k], t), k  # router, exact (protected) experts, members, the rest
        tw, tc = _projections(whole), _projections(got)
        assert tw.keys() == tc.keys() and tw
        for p, a in tw.items():
            b, eps = tc[p], torch.finfo(a.dtype).eps
            for f in ("u_out", "u_in"):  # the same eigenvectors as tensorly's singular vectors, same signs
                x, y = getattr(a, f).double(), getattr(b, f).double()
                assert (x - y).norm() <= 8 * eps * x.norm(), (chunk, p, f)
            for e in range(a.shape[0]):
                x, y = a.expert(e).double(), b.expert(e).double()
                assert (x - y).norm() <= 8 * eps * x.norm(), (chunk, p, e)
        assert _config(tmp_path / "whole") == _config(out)
        for ra, rb in zip(_rows(tmp_path / "whole"), _rows(out), strict=True):
            for k in ("layer", "params_before", "params_after", "bytes_before", "bytes_after", "changed"):
                assert ra[k] == rb[k], k
            ia, ib = ra["info"], rb["info"]
            assert ia.keys() == ib.keys()
            for k, v in ia.items():
                if k in ("gate", "up", "down"):
                    assert ib[k]["ranks"] == v["ranks"]
                    assert ib[k]["whitened_rel_error"] == pytest.approx(v["whitened_rel_error"], rel=1e-5, abs=1e-6)
                elif isinstance(v, float):
                    assert ib[k] == pytest.approx(v, rel=1e-12), k
                else:
                    assert ib[k] == v, k
        mc.load(out)  # the joined layer loads
        lc = reference_logits(tmp_path / "m", out, ids).double()
        kl = F.kl_div(lc.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean")
        assert float(kl) <= 1e-9, float(kl)


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
