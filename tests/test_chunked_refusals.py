"""Expert-chunked layers in the dry run: steps that need every expert at once are refused with the figure
and the fix, ``expert_chunk: auto`` chunks only the layers that do not fit, and the estimates follow."""

from __future__ import annotations

import pytest
from tiny import save_tiny

import moecompress as mc
from moecompress.errors import RecipeError

CAL = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("refuse") / "m"
    save_tiny("qwen3_moe", path, num_hidden_layers=2)
    return path


def _plan(model, tmp_path, steps, chunk, **cal):
    rec = {"model": str(model), "output": str(tmp_path / "o"), "steps": steps, "expert_chunk": chunk,
           "calibration": {**CAL, "cache_dir": str(tmp_path / "c"), **cal}}  # fmt: skip
    return mc.apply(rec, dry_run=True, progress=False).report["dry_run"]


@pytest.mark.parametrize(
    ("step", "why"),
    [
        ({"tdmoe": {"method": "hooi"}}, r"method: hooi iterates over every expert.*use method: hosvd"),
        ({"tdmoe": {"budget": "from_structure"}}, r"budget: from_structure scans .*use budget: uniform or adaptive"),
    ],
)
def test_a_step_needing_every_expert_is_refused_on_a_chunked_layer(model, tmp_path, step, why):
    name = next(iter(step))
    with pytest.raises(RecipeError, match=rf"step 1 \({name}\), layer \d+: {why}") as err:
        _plan(model, tmp_path, [step], 3)
    msg = str(err.value)
    assert "\n" not in msg and "GiB for the whole layer" in msg and "expert_chunk: off" in msg
    _plan(model, tmp_path, [step], "off")  # whole layers: accepted


@pytest.mark.parametrize("name", ["namex", "merge_experts"])
def test_weight_similarity_runs_by_chunks_holding_a_second_chunk_for_the_gram(model, tmp_path, name):
    """``similarity: weight`` groups by the experts' weight Gram, made on chunks from every pair of them: the
    dry run accepts it and counts the Gram and a second chunk, not the whole layer's flattened weights."""
    step = {name: {"ratio": 0.25, "similarity": "weight"}}
    other = {name: {"ratio": 0.25, "similarity": "router"}}
    mem = lambda plan, k=1: plan["step_memory"][f"step {k} ({name})"]  # noqa: E731
    whole = mem(_plan(model, tmp_path, [step], "off"))["bytes"]
    chunked, by_router = mem(_plan(model, tmp_path, [step], 2)), mem(_plan(model, tmp_path, [other], 2))
    assert chunked["chunk"] == 2 and 0 < chunked["bytes"] < whole
    assert chunked["bytes"] > by_router["bytes"]  # the Gram and the pairs' second chunk


@pytest.mark.parametrize("step", [{"namex": {"ratio": 0.25}}, {"merge_experts": {"ratio": 0.25}}])
def test_merging_runs_by_chunks_but_not_with_another_changing_step_in_its_segment(model, tmp_path, step):
    name = next(iter(step))
    whole = _plan(model, tmp_path, [step], "off")["step_memory"][f"step 1 ({name})"]["bytes"]
    chunked = _plan(model, tmp_path, [{"protect_super_experts": {}}, step], 2)  # by units of groups
    assert chunked["step_memory"][f"step 2 ({name})"]["chunk"] == 2
    assert 0 < chunked["step_memory"][f"step 2 ({name})"]["bytes"] < whole
    with pytest.raises(
        RecipeError, match=rf"step 1 \({name}\), layer \d+: merges groups .* step 2 \(rtn\) cannot follow.*expert_chunk: off"
    ) as err:
        _plan(model, tmp_path, [step, {"rtn": {"bits": 4}}], 3, recalibrate="off")
    assert "\n" not in str(err.value) and "recalibrate: auto" in str(err.value)
    # recalibrate: auto (the default) cuts the recipe after the merge instead
    plan = _plan(model, tmp_path, [step, {"rtn": {"bits": 4}}], 3)
    assert plan["segments"] == [[f"step 1 ({name})"], ["step 2 (rtn)"]]


def test_layer_ranking_without_plan_is_refused_with_the_fix(model, tmp_path):
    with pytest.raises(
        RecipeError, match=r"step 1 \(heapr\), layer \d+: ranks the neurons.*scope: global or layout: uniform"
    ):
        _plan(model, tmp_path, [{"heapr": {"ratio": 0.25, "scope": "layer"}}], 3)
    with pytest.raises(RecipeError, match=r"neuron_prune.*use layout: uniform"):
        _plan(model, tmp_path, [{"neuron_prune": {"ratio": 0.25}}], 3)
    _plan(model, tmp_path, [{"heapr": {"ratio": 0.25}}], 3)  # the global plan decides the widths


def test_propagate_compressed_is_refused_on_chunked_layers(model, tmp_path):
    with pytest.raises(
        RecipeError,
        match=r"propagate: 'compressed'.*chunks of 3 experts.*propagate: original or expert_chunk: off",
    ):
        _plan(model, tmp_path, [{"rtn": {"bits": 4}}], 3, propagate="compressed")


def test_plan_lists_chunks_and_chunk_estimates(model, tmp_path):
    whole = _plan(model, tmp_path, [{"rtn": {"bits": 4}}], "off")
    chunked = _plan(model, tmp_path, [{"rtn": {"bits": 4}}], 2)
    assert whole["expert_chunk"] == {} and set(chunked["expert_chunk"].values()) == {2}
    assert chunked["step_memory"]["step 1 (rtn)"]["chunk"] == 2
    assert chunked["step_memory"]["step 1 (rtn)"]["bytes"] < whole["step_memory"]["step 1 (rtn)"]["bytes"]


def test_auto_chunks_only_what_does_not_fit(model, tmp_path):
    steps, free = [{"rtn": {"bits": 4}}], {"source": "none"}  # data-free: no calibration estimate
    assert _plan(model, tmp_path, steps, "auto", **free)["expert_chunk"] == {}  # a tiny layer fits
    whole = _plan(model, tmp_path, steps, "off", **free)["step_memory"]["step 1 (rtn)"]["bytes"]
    limit = whole - 1  # just below the whole layer's estimate: chunks, each fitting the limit
    plan = _plan(model, tmp_path, steps, "auto", memory_limit=limit, **free)
    sizes = plan["expert_chunk"]
    assert sizes and all(1 <= n < 8 for n in sizes.values())
    assert plan["step_memory"]["step 1 (rtn)"]["bytes"] <= limit
    with pytest.raises(RecipeError, match="use expert_chunk: auto") as err:
        _plan(model, tmp_path, steps, "off", memory_limit=limit, **free)
    assert "not built" not in str(err.value)


def test_auto_leaves_a_layer_whole_when_a_step_cannot_chunk(model, tmp_path):
    step = {"tdmoe": {"method": "hooi"}}
    whole = _plan(model, tmp_path, [step], "off")["step_memory"]["step 1 (tdmoe)"]["bytes"]
    with pytest.raises(
        RecipeError, match=r"held whole because step 1 \(tdmoe\) method: hooi iterates over every expert of the "
        r"layer at once; use method: hosvd"
    ):
        _plan(model, tmp_path, [step], "auto", memory_limit=whole - 1)


def test_a_calibration_over_the_limit_names_the_step_that_holds_layers_whole():
    """Under ``expert_chunk: auto``, when no layer could be chunked because a step refuses chunks, the
    calibration refusal names that step and its own fix (codequant: ``shared: false``), not only a bigger
    machine."""
    from types import SimpleNamespace

    from moecompress.engine.resources import _calibration_fix

    why = "quantises the shared expert (shared: true), which ...; set shared: false to keep it dense"
    plan = {"expert_chunk": {}, "step_memory": {"step 1 (codequant)": {"bytes": 1, "whole_because": "step 1 (codequant)",
                                                                        "whole_why": why}}}  # fmt: skip
    got = _calibration_fix(SimpleNamespace(expert_chunk="auto"), plan)
    assert got.startswith("the layer is held whole because step 1 (codequant) quantises the shared expert")
    assert "set shared: false" in got and got.endswith("more memory")
    assert "held whole" not in _calibration_fix(SimpleNamespace(expert_chunk="auto"), {"expert_chunk": {}})
    assert "smaller expert_chunk" in _calibration_fix(SimpleNamespace(expert_chunk="auto"), {"expert_chunk": {"1": 4}})


def test_a_merge_budget_over_layers_is_planned_by_chunks(model, tmp_path):
    """``target_experts: {ratio}`` reads expert_out_gram(_fisher), which a chunked layer's calibration now
    makes from its chunks' outputs on the Ward tokens: accepted, and those outputs counted."""
    step = {"merge_experts": {"target_experts": {"ratio": 0.5, "scale": "relative"}}}
    plain = _plan(model, tmp_path, [{"merge_experts": {"ratio": 0.5}}], 3)
    budget = _plan(model, tmp_path, [step], 3)
    assert budget["step_memory"]["step 1 (merge_experts)"]["chunk"] == 3
    e, h = 8, 64  # tiny qwen3_moe: the outputs of every expert on min(64, tokens) Ward tokens, float32
    grew = budget["calibration_stats_bytes"] - plain["calibration_stats_bytes"]
    assert grew >= e * min(64, CAL["samples"] * CAL["seq_len"]) * h * 4, (grew, budget, plain)
