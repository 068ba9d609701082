"""Statistics follow the layer (issue 34): after a step that changes a layer, the statistics a later step
reads equal those of a fresh calibration of the intermediate checkpoint; what cannot follow is refused
in the dry run, in one line, before any token is read."""

from __future__ import annotations

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.spec import PassConfig, PassSpec
from moecompress.errors import RecipeError

CAL = {"source": "random", "samples": 6, "seq_len": 16, "batch_size": 2, "sample_tokens": 48}
SEEN: dict[str, dict[int, dict[str, torch.Tensor]]] = {}


class _RecordCfg(PassConfig):
    tag: str = "x"


def _record(layer, stats, cfg):
    """Test-only: keeps the statistics it was given."""
    SEEN.setdefault(cfg.tag, {})[layer.index] = {k: v.clone() for k, v in stats.items()}
    return layer, {}


def _recorder(needs) -> PassSpec:
    return PassSpec("test_record", _RecordCfg, _record, needs=needs, report_only=True, alters=frozenset())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("follow") / "m"
    save_tiny("qwen3_moe", path)  # 8 experts, top-2, width 32, hidden 64; MoE layers 0, 1, 2
    return path


def _recipe(model, out, steps, **cal):
    return {"model": str(model), "output": str(out), "calibration": {**CAL, **cal}, "steps": steps}


def _tol(t: torch.Tensor, tokens: int) -> float:
    """float32 sums over ``tokens`` terms, in another order: a few ulps per term of the largest value."""
    return 8 * torch.finfo(torch.float32).eps * tokens * max(float(t.abs().max()), 1e-12)


def test_uniform_heapr_then_svd_experts_runs_and_loads(tmp_path, model):
    """The crash of issue 34 (whitening.py: 512x24 and 32x32): svd_experts reads the pooled down-input
    covariance of the neurons heapr kept."""
    rec = _recipe(model, tmp_path / "out", [{"heapr": {"layout": "uniform", "ratio": 0.25}}, {"svd_experts": {}}])
    assert mc.apply(rec, dry_run=True, progress=False).dry_run
    res = mc.apply(rec, progress=False)
    steps = res.report["steps"]
    assert steps[1]["params_after"] < steps[1]["params_before"] < steps[0]["params_before"]
    mc.load(tmp_path / "out")


FIRST = {
    "neurons_uniform": {"heapr": {"layout": "uniform", "ratio": 0.25}},
    "neurons_ragged": {"neuron_prune": {"method": "magnitude", "ratio": 0.3, "scope": "layer"}},
    "expert_subset": {"expert_prune": {"ratio": 0.25}},
    "expert_map": {"namex": {"ratio": 0.25, "refine_steps": 0}},
}
READ = {
    "neurons_uniform": {"act_sq_mean", "down_in_cov", "down_in_cov_pooled", "expert_in_cov", "expert_counts",
                        "io_sample", "expert_out_gram", "input_cov"},
    "neurons_ragged": {"act_sq_mean", "down_in_cov", "down_in_cov_pooled", "expert_in_sq_mean"},
    "expert_subset": {"expert_in_cov", "down_in_cov", "expert_counts", "reap_saliency", "router_prob_mean",
                      "act_sq_mean", "io_sample"},
    "expert_map": {"expert_in_cov", "down_in_cov", "expert_counts", "expert_out_norm_mean", "down_out_absmax"},
}  # fmt: skip
RULES = {"neurons_uniform": "map", "neurons_ragged": "map", "expert_subset": "replay", "expert_map": "replay"}


@pytest.mark.parametrize("case", sorted(FIRST))
def test_followed_statistics_equal_a_fresh_calibration_of_the_intermediate(tmp_path, model, case):
    """One test per rule: the statistics the second step reads (mapped, recomputed on the sample, or
    replayed) equal those of calibrating the first step's output, on the first MoE layer (whose input the
    first step does not change)."""
    spec = _recorder(READ[case])
    steps = [FIRST[case], {"test_record": {"tag": f"{case}-followed"}}]
    plan = mc.apply(_recipe(model, tmp_path / "a", steps), passes=[spec], dry_run=True, progress=False)
    assert plan.dry_run
    mc.apply(_recipe(model, tmp_path / "a", [FIRST[case], {"identity": {}}, steps[1]]), passes=[spec], progress=False)
    mc.apply(_recipe(model, tmp_path / "mid", [FIRST[case]]), progress=False)
    fresh = [{"test_record": {"tag": f"{case}-fresh"}}]
    mc.apply(_recipe(tmp_path / "mid", tmp_path / "b", fresh), passes=[spec], progress=False)
    got, want = SEEN[f"{case}-followed"][0], SEEN[f"{case}-fresh"][0]
    assert set(got) == set(want)
    tokens = (CAL["samples"] - 1) * CAL["seq_len"]
    for name in sorted(want):
        a, b = got[name].double(), want[name].double()
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert (a - b).abs().max() <= _tol(b, tokens), (name, float((a - b).abs().max()))


def test_the_rules_are_the_dry_runs(model):
    from moecompress.engine import follow
    from moecompress.engine.recipe import load_recipe, pass_table

    for case, rule in RULES.items():
        table = {**pass_table(), "test_record": _recorder(READ[case])}
        rec = load_recipe(_recipe(model, "/tmp/x", [FIRST[case], {"test_record": {}}]), passes=table)
        rules = follow.verdicts(rec.steps)[1]
        assert rule in rules.values(), (case, rules)
        assert rules.get("input_cov", "keep") == "keep"
        extra = follow.extra_needs(rec.steps)
        assert ("moe_inputs" in extra) == (rule == "replay"), (case, extra)


@pytest.mark.parametrize(
    ("steps", "units"),
    [
        ([{"heapr": {"ratio": 0.25, "layout": "uniform"}}, {"gptq": {"bits": 4}}], True),  # down_in_cov mapped
        ([{"heapr": {"ratio": 0.25}}, {"neuron_prune": {"ratio": 0.25}}, {"gptq": {"bits": 4}}], True),
        ([{"heapr": {"ratio": 0.25, "layout": "uniform"}}, {"rtn": {"bits": 4}}], True),  # nothing follows
        ([{"expert_prune": {"ratio": 0.25}}, {"gptq": {"bits": 4}}], False),  # replayed: the routing changed
        ([{"heapr": {"ratio": 0.25, "layout": "uniform"}}, {"tdmoe": {"ratio": 0.4}}], False),  # the pooled one
        ([{"heapr": {"ratio": 0.25, "layout": "uniform"}}, {"codequant": {"bits": 3}}], False),  # re-sampled
    ],
)
def test_statistics_mapped_per_expert_follow_units_of_experts(model, steps, units):
    """``follow.by_units``: a recipe whose statistics follow the layer only by per-expert maps can be shared
    out by units under torchrun (each unit maps its own rows); a replay, a re-sample or the pooled map cannot."""
    from moecompress.engine import follow
    from moecompress.engine.recipe import load_recipe

    rec = load_recipe(_recipe(model, "/tmp/x", steps))
    assert follow.by_units(rec.steps) is units
    assert follow.required(rec.steps) == ("rtn" not in steps[-1])  # rtn reads nothing: nothing follows


REFUSED = [
    ([{"namex": {"ratio": 0.25}}, {"heapr": {"scope": "layer"}}], "step 2 (heapr) reads statistic 'grad_sq_mean', "
     "which step 1 (namex) changes"),
    ([{"expert_prune": {}}, {"svd_experts": {"whitening": "output"}}], "step 2 (svd_experts) reads statistic"),
    ([{"heapr": {"layout": "uniform"}}, {"protect_super_experts": {}}], "step 2 (protect_super_experts) decides "
     "across layers"),
    ([{"rtn": {}}, {"attribute_routing": {}}], "step 2 (attribute_routing) reads statistic 'route_attrib'"),
]  # fmt: skip


@pytest.mark.parametrize(("steps", "words"), REFUSED, ids=range(len(REFUSED)))
def test_what_cannot_follow_is_refused_in_the_dry_run_under_recalibrate_off(tmp_path, model, steps, words):
    rec = _recipe(model, tmp_path / "out", steps, recalibrate="off")
    with pytest.raises(RecipeError) as err:
        mc.apply(rec, dry_run=True, progress=False)
    msg = str(err.value)
    assert words in msg and "\n" not in msg and ("put " in msg or "use " in msg), msg
    assert "recalibrate: auto" in msg, msg  # the fix that keeps the order
    with pytest.raises(RecipeError):
        mc.apply(rec, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "refused before calibration: nothing written"


@pytest.mark.parametrize(("steps", "words"), REFUSED, ids=range(len(REFUSED)))
def test_recalibrate_auto_cuts_the_recipe_before_the_step_and_the_run_loads(tmp_path, model, steps, words):
    rec = _recipe(model, tmp_path / "out", steps)
    plan = mc.apply(rec, dry_run=True, progress=False).report["dry_run"]
    assert plan["segments"] == [["step 1 (" + next(iter(steps[0])) + ")"], ["step 2 (" + next(iter(steps[1])) + ")"]]
    res = mc.apply(rec, progress=False)
    assert list(res.report["calibration"]) == ["segment 1", "segment 2"]  # calibrated twice
    assert [s["name"] for s in res.report["steps"]] == [next(iter(s)) for s in steps]
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(mc.load(tmp_path / "out")(ids).logits).all()
    assert not any(p.name.endswith(".segments") for p in tmp_path.iterdir())  # staged checkpoints removed


def test_recalibrated_step_equals_a_second_recipe_on_the_first_ones_output(tmp_path, model):
    """The oracle of ``recalibrate: auto``: heapr after namex, cut and calibrated again, writes the same
    bytes as heapr run as its own recipe on namex's output (same calibration, same tokens)."""
    from safetensors.torch import load_file

    first, second = {"namex": {"ratio": 0.25, "refine_steps": 0}}, {"heapr": {"scope": "layer", "ratio": 0.25}}
    res = mc.apply(_recipe(model, tmp_path / "both", [first, second]), progress=False)
    mc.apply(_recipe(model, tmp_path / "a", [first]), progress=False)
    mc.apply(_recipe(tmp_path / "a", tmp_path / "b", [second]), progress=False)
    got, want = load_file(tmp_path / "both" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert res.report["steps"][1]["params_after"] < res.report["steps"][1]["params_before"]  # heapr did prune


def test_following_statistics_hold_the_layer_whole(tmp_path, model):
    """Replayed statistics need the whole layer: under recalibrate: off an explicit expert_chunk is refused
    in the dry run; expert_chunk: auto holds such a layer whole."""
    steps = [{"expert_prune": {"ratio": 0.25}}, {"neuron_prune": {"method": "wanda"}}]
    with pytest.raises(RecipeError, match="held whole, but expert_chunk: 4 holds it by chunks"):
        mc.apply({**_recipe(model, tmp_path / "out", steps, recalibrate="off"), "expert_chunk": 4}, dry_run=True,
                 progress=False)  # fmt: skip
    assert mc.apply(_recipe(model, tmp_path / "out", steps), dry_run=True, progress=False).report["dry_run"][
        "expert_chunk"] == {}


def test_expert_chunk_recalibrates_what_cannot_follow_a_chunked_layer(tmp_path, model):
    """expert_chunk: N with recalibrate: auto cuts before a step whose statistics would have to follow the
    layer (a chunk cannot map or replay them): prune then quantise runs by chunks, and writes the bytes of
    the second step run as its own recipe on the first one's output, both by chunks."""
    from safetensors.torch import load_file

    first, second = {"expert_prune": {"ratio": 0.25, "method": "frequency"}}, {"gptq": {"bits": 4, "group_size": 16}}
    both = {**_recipe(model, tmp_path / "both", [first, second]), "expert_chunk": 3}
    plan = mc.apply(both, dry_run=True, progress=False).report["dry_run"]
    assert plan["segments"] == [["step 1 (expert_prune)"], ["step 2 (gptq)"]]
    assert plan["expert_chunk"] == {"0": 3, "1": 3, "2": 3}
    res = mc.apply(both, progress=False)
    assert list(res.report["calibration"]) == ["segment 1", "segment 2"]
    mc.apply({**_recipe(model, tmp_path / "a", [first]), "expert_chunk": 3}, progress=False)
    mc.apply({**_recipe(tmp_path / "a", tmp_path / "b", [second]), "expert_chunk": 3}, progress=False)
    got, want = load_file(tmp_path / "both" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # under expert_chunk: auto the same recipe maps the kept experts' statistics (held whole), no cut
    assert "segments" not in mc.apply(_recipe(model, tmp_path / "c", [first, second]), dry_run=True,
                                      progress=False).report["dry_run"]  # fmt: skip


@pytest.mark.parametrize("merge", [{"namex": {"ratio": 0.5}}, {"merge_experts": {"ratio": 0.5}}])
def test_expert_chunk_cuts_around_a_merge_by_groups(tmp_path, model, merge):
    """A merge by chunks works units of groups of its input's experts, so under expert_chunk: N with
    recalibrate: auto a step that changes the layer before it, and one after it, each start a segment:
    prune, merge, quantise runs by chunks in three segments, and writes the bytes of the three steps run
    as three recipes, each on the previous output, by chunks."""
    from safetensors.torch import load_file

    steps = [{"expert_prune": {"ratio": 0.25, "method": "frequency"}}, merge, {"rtn": {"bits": 4, "group_size": 16}}]
    both = {**_recipe(model, tmp_path / "all", steps), "expert_chunk": 3}
    plan = mc.apply(both, dry_run=True, progress=False).report["dry_run"]
    name = next(iter(merge))
    assert plan["segments"] == [["step 1 (expert_prune)"], [f"step 2 ({name})"], ["step 3 (rtn)"]]
    mc.apply(both, progress=False)
    src = model
    for n, step in enumerate(steps):
        mc.apply({**_recipe(src, tmp_path / f"s{n}", [step]), "expert_chunk": 3}, progress=False)
        src = tmp_path / f"s{n}"
    got, want = load_file(tmp_path / "all" / "model.safetensors"), load_file(src / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    off = {**_recipe(model, tmp_path / "off", steps), "expert_chunk": 3,
           "calibration": {**both["calibration"], "recalibrate": "off"}}  # fmt: skip
    with pytest.raises(RecipeError, match="recalibrate: auto"):
        mc.apply(off, dry_run=True, progress=False)


PIPELINES = ["expert_prune_gptq", "heapr_gptq", "namex_rtn", "prune_then_quantize"]


@pytest.mark.parametrize("name", PIPELINES)
def test_prune_then_quantize_recipes_run_and_load(tmp_path, model, name):
    """The recipes of the pipelines users run (recipes/), on the tiny checkpoint with a small calibration."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recipes" / f"{name}.yaml"
    overrides = [f"model={model}", f"output={tmp_path / 'out'}", "calibration.source=random",
                 "calibration.samples=6", "calibration.seq_len=16", "calibration.sample_tokens=48",
                 "calibration.batch_size=2"]  # fmt: skip
    if name in ("heapr_gptq", "prune_then_quantize"):
        overrides.append("steps.2.align=8")  # the tiny experts are 32 wide
    if name == "prune_then_quantize":
        overrides.append("steps.3.finetune_steps=2")
    mc.apply(path, overrides, progress=False)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(mc.load(tmp_path / "out")(ids).logits).all()


def test_kept_inputs_are_counted_in_the_dry_run(tmp_path, model):
    """The replay's calibration inputs: in the calibration memory and the statistics of each step."""
    base = mc.apply(_recipe(model, tmp_path / "a", [{"expert_prune": {}}, {"rtn": {}}]), dry_run=True,
                    progress=False).report["dry_run"]  # fmt: skip
    plan = mc.apply(_recipe(model, tmp_path / "b", [{"expert_prune": {}}, {"gptq": {}}]), dry_run=True,
                    progress=False).report["dry_run"]  # fmt: skip
    kept = (CAL["samples"] - 1) * CAL["seq_len"] * 64 * 4  # tokens x hidden float32
    assert "moe_inputs" in plan["statistics"] and "moe_inputs" not in base["statistics"]
    assert plan["moe_inputs_cache_bytes"] == 3 * kept
    assert plan["calibration_memory_bytes"] - base["calibration_memory_bytes"] >= 2 * kept
    assert plan["step_memory"]["step 2 (gptq)"]["stats_bytes"] >= kept


def test_a_cut_before_a_report_only_step_keeps_the_earlier_checkpoint(tmp_path, model):
    """``rtn → choose_groups``: the second segment writes reports only; the output is rtn's checkpoint with
    both steps' reports."""
    res = mc.apply(_recipe(model, tmp_path / "out", [{"rtn": {}}, {"choose_groups": {"ratio": 0.25}}]),
                   progress=False)  # fmt: skip
    assert res.report["segments"] == [["step 1 (rtn)"], ["step 2 (choose_groups)"]]
    assert sorted(p.name for p in (tmp_path / "out" / "steps").iterdir()) == ["01-rtn", "02-choose_groups"]
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(mc.load(tmp_path / "out")(ids).logits).all()


@pytest.mark.parametrize("first", ["namex", "merge_experts"])
def test_choose_groups_after_a_merge_is_refused_in_the_dry_run(tmp_path, model, first):
    rec = _recipe(model, tmp_path / "out", [{first: {"ratio": 0.25}}, {"choose_groups": {"ratio": 0.25}}])
    with pytest.raises(mc.MoecompressError, match=r"step 2 \(choose_groups\), layer \d+: .*before merging"):
        mc.apply(rec, dry_run=True, progress=False)


def test_a_uniform_width_transformers_cannot_load_is_refused_with_the_align(tmp_path, model):
    """Uniform pruning twice (32 → 24 → 18 neurons of float32: rows of 72 bytes) would write a stock
    checkpoint whose experts transformers' grouped matmul refuses; the dry run names the align."""
    step = {"heapr": {"ratio": 0.25, "layout": "uniform"}}
    with pytest.raises(mc.MoecompressError, match=r"step 2 \(heapr\), layer \d+: .* 18 wide.*set align: 4"):
        mc.apply(_recipe(model, tmp_path / "out", [step, step]), dry_run=True, progress=False)
    aligned = {"heapr": {"ratio": 0.25, "layout": "uniform", "align": 4}}
    mc.apply(_recipe(model, tmp_path / "ok", [step, aligned]), progress=False)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(mc.load(tmp_path / "ok")(ids).logits).all()
