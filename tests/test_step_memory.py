"""The dry run's per-step memory estimate (engine/resources.py: stat_bytes, step_peak) and its refusal."""

from __future__ import annotations

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.engine import resources
from moecompress.engine.recipe import load_recipe
from moecompress.errors import RecipeError
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense

DIMS = {"E": 4, "I": 8, "H": 16, "N": 32, "NH": 12, "S": 1}


@pytest.mark.parametrize(
    "needs,elements",
    [
        ({"act_sq_mean"}, 4 * 8),  # [E, I]
        ({"expert_in_cov"}, 4 * 16 * 16),  # [E, H, H]
        ({"io_sample"}, 2 * 32 * 16),  # [N, H] x2
        ({"holdout"}, 12 * 16),  # the held-back tokens, not the sample
        ({"router_entropy"}, 1),  # []
        ({"act_sq_mean", "grad_sq_mean", "expert_counts"}, 4 * 8 * 2 + 4),
    ],
)
def test_stat_bytes_follow_the_catalogue_shapes(needs, elements):
    assert resources.stat_bytes(needs, DIMS) == 4 * elements


def _layer(dtype, e=4, i=8, h=16) -> MoELayer:
    bank = ExpertBank(*(Dense(torch.zeros(e, *s, dtype=dtype)) for s in ((i, h), (i, h), (h, i))))
    return MoELayer(0, RouterSpec(e, 2, Gating.SOFTMAX_TOPK), torch.zeros(e, h, dtype=dtype), bank)


def test_step_peak_counts_what_the_layer_loop_holds():
    small, big = _layer(torch.float32, e=2), _layer(torch.float32)
    base = resources.STEP_BASE_BYTES
    # same dtype: no cast copies; the output is held with its encoded tensors
    assert resources.step_peak(big, small, torch.float32, 100, 7, first=False) == (
        base + 100 + big.nbytes() + 7 + 2 * small.nbytes()
    )
    # a bf16 layer computed in float32: the cast for the reconstruction error is twice its bytes
    half, out = _layer(torch.bfloat16), _layer(torch.bfloat16)
    peak = resources.step_peak(half, out, torch.float32, 0, 0, first=False)
    assert peak == base + half.nbytes() + out.nbytes() + 2 * out.nbytes()  # input, output, float32 cast
    assert resources.step_peak(half, out, torch.float32, 0, 0, first=True) >= peak
    # a step that returns its input (identity, report-only) adds only the encoded tensors
    assert resources.step_peak(half, half, torch.float32, 0, 0, first=False) == base + 2 * half.nbytes()


def _rec(tmp_path, **cal):
    save_tiny("qwen3_moe", tmp_path / "m", num_experts=32)  # the MoE block outweighs the attention
    return {"model": str(tmp_path / "m"), "output": str(tmp_path / "out"), "steps": [{"heapr": {"ratio": 0.5}}],
            "calibration": {"source": "random", "samples": 4, "seq_len": 8, **cal}}  # fmt: skip


def test_dry_run_lists_every_step_memory(tmp_path):
    rec = _rec(tmp_path)
    rec["steps"].append({"rtn": {"bits": 4}})
    mem = mc.apply(rec, dry_run=True, progress=False).report["dry_run"]["step_memory"]
    assert list(mem) == ["step 1 (heapr)", "step 2 (rtn)"]
    assert mem["step 1 (heapr)"]["output_bytes"] < mem["step 1 (heapr)"]["input_bytes"]
    assert mem["step 2 (rtn)"]["input_bytes"] == mem["step 1 (heapr)"]["output_bytes"]  # chained


def test_a_step_that_does_not_fit_is_refused_in_the_dry_run(tmp_path):
    rec = _rec(tmp_path)
    dry = mc.apply(rec, dry_run=True, progress=False).report["dry_run"]
    need = dry["step_memory"]["step 1 (heapr)"]["bytes"]
    assert dry["calibration_memory_bytes"] < need - 1  # the calibration fits, the step does not
    rec["calibration"]["memory_limit"] = need - 1
    rec["expert_chunk"] = "off"  # (auto would hold the layer by chunks of experts, which fit)
    with pytest.raises(RecipeError, match=r"step 1 \(heapr\) needs about .* GiB .* layer 0 .* calibration\.memory_limit"):
        mc.apply(rec, progress=False)
    assert not (tmp_path / "out").exists()


def test_copied_tensors_are_read_in_bounded_groups():
    from moecompress.io.reader import read_groups

    sizes = {"a": 3, "b": 4, "c": 10, "d": 1, "e": 2}
    groups = read_groups(list(sizes), sizes.__getitem__, limit=7)
    assert groups == [["a", "b"], ["c"], ["d", "e"]]  # in order; a tensor over the limit alone
    assert [k for g in groups for k in g] == list(sizes)


def test_dry_run_counts_the_largest_copied_tensor_twice(tmp_path):
    rec = _rec(tmp_path)
    dry = mc.apply(rec, dry_run=True, progress=False).report["dry_run"]
    ckpt = mc.open_checkpoint(tmp_path / "m")
    moe = {k for i in ckpt.moe_layer_indices for k in ckpt.raw_moe_keys(i)}
    rest = [k for k in ckpt.raw.keys if k not in moe]
    largest = max((sum(ckpt.raw.nbytes(k) for k in keys if k not in moe), idx)
                  for idx, keys in ckpt.key_groups(raw=True))  # fmt: skip
    # tiny tensors: every group fits in one read, so a group of tensors is the unit
    assert dry["copy_memory_bytes"] == resources.STEP_BASE_BYTES + 2 * largest[0]
    assert dry["copy_largest_tensor"] in rest
    plan = {**dry, "calibration_memory_bytes": 0, "step_memory": {}}
    recipe = load_recipe(rec)
    with pytest.raises(RecipeError, match=r"copying the tensors outside the MoE layers needs about"):
        resources.check(recipe, plan, tmp_path, memory=dry["copy_memory_bytes"] - 1, disk_free=None)
    resources.check(recipe, plan, tmp_path, memory=dry["copy_memory_bytes"], disk_free=None)


def test_backward_counts_the_logits_phase_and_the_layer_phase_as_the_larger_not_their_sum(tmp_path):
    """The streamed backward first takes every batch's logits at the head, then one decoder layer at a time
    (calibration/sweep.py ``_backward``): the estimate is the larger phase (on DeepSeek-V3 shapes the sum
    over-counted by 1.6 GiB, 1.32x the measured peak)."""
    save_tiny("qwen3_moe", tmp_path / "m", num_experts=32, vocab_size=4096)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    cal = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}
    rec = load_recipe({"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": cal,
                       "steps": [{"heapr": {"ratio": 0.5}}]})  # fmt: skip
    est = resources.estimate(rec, ckpt, torch.float32)
    hidden, vocab, tokens = ckpt.raw_config["hidden_size"], 4096, 4 * 8
    layers = ckpt.raw_config["num_hidden_layers"]
    act, logits = tokens * hidden * 4, 3 * tokens * vocab * 4
    forward = resources.STEP_BASE_BYTES + 2 * act + tokens * 8 + est["calibration_layer_bytes"]
    held = resources.STEP_BASE_BYTES + tokens * 8 + layers * act + act + vocab * hidden * 4
    phases = held + max(act + logits, est["calibration_layer_bytes"] + act)
    assert logits > est["calibration_layer_bytes"]  # the head's phase is the larger one here
    assert est["calibration_memory_bytes"] == max(forward, phases)
    summed = forward + layers * act + act + logits + vocab * hidden * 4
    assert est["calibration_memory_bytes"] < summed
