"""The dry run chains: each step is checked against the layer the earlier steps would emit, so an
impossible chain fails before any weight or calibration token is read, with nothing written."""

from __future__ import annotations

import sys

import pytest
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.dry_run import chain, meta_layer
from moecompress.engine.recipe import load_recipe
from moecompress.errors import MissingExtraError, PassError
from moecompress.extras import missing

CAL = {"source": "random", "samples": 4, "seq_len": 8}
MANUAL = {"auto": False, "manual": [{"layer": i, "experts": [0, 1, 2, 3, 4, 5, 6]} for i in range(3)]}

# (id, steps, the failing step's label, words of the message). Each of these passed the old dry run
# (which checked every step against the input layer) and failed only at the first compressed layer.
IMPOSSIBLE = [
    ("svd_then_codequant", [{"svd_experts": {}}, {"codequant": {}}], "step 2 (codequant)", "dense"),
    ("tdmoe_then_rtn", [{"tdmoe": {}}, {"rtn": {}}], "step 2 (rtn)", "'tucker'"),
    ("prune_twice", [{"heapr": {"scope": "layer"}}, {"neuron_prune": {}}], "step 2 (neuron_prune)", "prune once"),
    ("expert_prune_below_top_k", [{"expert_prune": {"ratio": 0.7}}, {"expert_prune": {"ratio": 0.25}}],
     "step 2 (expert_prune)", "fewer than top_k=2"),
    ("merged_then_expert_prune", [{"namex": {"ratio": 0.5}}, {"expert_prune": {}}], "step 2 (expert_prune)",
     "merged experts"),
    ("rtn_then_merge", [{"rtn": {}}, {"merge_experts": {"ratio": 0.5}}], "step 2 (merge_experts)", "merge before"),
    ("uniform_prune_then_group", [{"heapr": {"ratio": 0.5, "layout": "uniform"}}, {"rtn": {"group_size": 32}}],
     "step 2 (rtn)", "does not divide the 16 input channels"),
    ("rtn_then_ablate", [{"rtn": {}}, {"ablate_experts": {"experts": [{"layer": 0, "experts": [0]}]}}],
     "step 2 (ablate_experts)", "ablate before"),
    ("codequant_then_tdmoe", [{"codequant": {}}, {"tdmoe": {}}], "step 2 (tdmoe)", "'codebook'"),
    ("prune_then_collapse_too_many", [{"expert_prune": {"ratio": 0.5}}, {"namex": {"target_experts": 6, "router": "collapse"}}],
     "step 2 (namex)", "keeps 6 of the layer's 4 experts"),
    ("ragged_then_tdmoe", [{"heapr": {"scope": "layer"}}, {"tdmoe": {}}], "step 2 (tdmoe)", "one width"),
    ("manual_protection_then_expert_prune", [{"protect_super_experts": MANUAL}, {"expert_prune": {"ratio": 0.5}}],
     "step 2 (expert_prune)", "only 1 are unprotected"),
    ("rotated_twice", [{"codequant": {"rotation": "hadamard"}}, {"codequant": {}}], "step 2 (codequant)", "dense"),
]  # fmt: skip

POSSIBLE = [
    [{"protect_super_experts": {}}, {"heapr": {"ratio": 0.25, "layout": "uniform", "align": 16}}, {"tdmoe": {}}],
    [{"protect_super_experts": MANUAL}, {"heapr": {"ratio": 0.5, "layout": "uniform"}}, {"codequant": {"group": 16}}],
    [{"namex": {"ratio": 0.25, "router": "collapse"}}, {"neuron_prune": {"method": "wanda"}}, {"rtn": {}}],
    [{"expert_prune": {"ratio": 0.5}}, {"svd_experts": {"ratio": 0.5}}],
    [{"heapr": {"ratio": 0.5, "layout": "uniform"}}, {"rtn": {"group_size": 16}}],
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("dry") / "m"
    save_tiny("qwen3_moe", path)  # 8 experts, top-2, width 32, hidden 64
    return path


def _nothing_written(root):
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize(("name", "steps", "label", "words"), IMPOSSIBLE, ids=[c[0] for c in IMPOSSIBLE])
def test_impossible_chain_fails_before_any_work(tmp_path, model, name, steps, label, words):
    if name in ("tdmoe_then_rtn", "codequant_then_tdmoe") and missing("decompose"):
        pytest.skip("needs the decompose extra")
    rec = {"model": str(model), "output": str(tmp_path / "out"), "calibration": CAL, "steps": steps}
    with pytest.raises(PassError) as dry:
        mc.apply(rec, dry_run=True, progress=False)
    msg = str(dry.value)
    assert msg.startswith(f"{label}, layer 0: ") and words in msg, msg
    with pytest.raises(PassError, match="^" + label.replace("(", r"\(").replace(")", r"\)")):
        mc.apply(rec, progress=False)  # a real run stops at the same place, before calibration
    assert _nothing_written(tmp_path) == [], "no output, no staging directory, no statistics cache"


@pytest.mark.parametrize("steps", POSSIBLE, ids=range(len(POSSIBLE)))
def test_possible_chains_pass(tmp_path, model, steps):
    if any(next(iter(s)) == "tdmoe" for s in steps) and missing("decompose"):
        pytest.skip("needs the decompose extra")
    rec = {"model": str(model), "output": str(tmp_path / "out"), "calibration": CAL, "steps": steps}
    plan = mc.apply(rec, dry_run=True, progress=False).report["dry_run"]
    sizes = list(plan["estimated_output_bytes"].values())
    assert sizes[-1] < plan["input_bytes"], "a compressing chain is estimated smaller than its input"
    assert _nothing_written(tmp_path) == []


def test_chain_reports_every_emitted_layer(model):
    rec = load_recipe({"model": str(model), "output": "x", "calibration": CAL,
                       "steps": [{"expert_prune": {"ratio": 0.5}}, {"heapr": {"layout": "uniform", "ratio": 0.5}},
                                 {"rtn": {"bits": 4}}]})  # fmt: skip
    layers = chain(rec, meta_layer(mc.open_checkpoint(model), 0))
    assert [lay.router.num_experts for lay in layers] == [4, 4, 4]
    assert [lay.experts.width for lay in layers] == [32, 16, 16]
    assert [lay.experts.gate.kind for lay in layers] == ["dense", "dense", "rtn"]
    assert layers[-1].experts.gate.group_size == 16  # rtn's automatic group divides the pruned width
    assert all(t.device.type == "meta" for lay in layers for t in lay.experts.gate.tensors().values())


def test_a_missing_extra_is_one_line_in_the_dry_run(tmp_path, model, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorly", None)  # as on a core install: `import tensorly` fails
    rec = {"model": str(model), "output": str(tmp_path / "out"), "calibration": CAL, "steps": [{"tdmoe": {"method": "hooi"}}]}
    with pytest.raises(MissingExtraError, match=r'^step 1 \(tdmoe\) needs tensorly, which is not installed: '
                       r'pip install "moecompress\[decompose\]"$'):  # fmt: skip
        mc.apply(rec, dry_run=True, progress=False)
    with pytest.raises(MissingExtraError):
        mc.apply(rec, progress=False)
    assert _nothing_written(tmp_path) == []
