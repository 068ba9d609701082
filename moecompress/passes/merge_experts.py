"""``merge_experts``: merge each MoE layer's routed experts into fewer by a fixed weighted average — the
baselines of ``namex`` on the same grouping.

Groups, base, alignment and router handling are exactly ``namex``'s (:mod:`moecompress.passes.expert_merging`), so a
comparison isolates the weighting. A group ``C`` with base ``b`` becomes
``E_b + Σ_{i≠b} w_i (E_i − E_b) = Σ_i w_i E_i`` (written relative to the base so that identical members
merge losslessly), with

- ``method: average`` — ``w_i = 1/|C|`` (plain mean merging);
- ``method: frequency`` (default) — ``w_i`` = share of the group's calibration tokens routed to member
  ``i`` (``expert_counts``; uniform if none): M-SMoE/HC-SMoE usage-weighted merging. With ``align``
  (default) this is MC-SMoE's merge step (weight matching, then frequency merging).

Statistics: ``expert_counts``, ``io_sample`` (grouping features and the held-back error of the report); a
budget (``target_experts: {ratio: r}``) adds ``expert_out_gram`` and, for ``scale: loss``,
``expert_out_gram_fisher`` (a backward).
Cost: negligible beyond the grouping and the alignment.

Example step::

    steps:
      - merge_experts: {ratio: 0.25, method: frequency, router: collapse}
      # or one budget over all layers: merge_experts: {target_experts: {total_experts: 12}}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassSpec
from moecompress.ir import MoELayer
from moecompress.methods.merging import Params, sub_
from moecompress.passes.expert_merging import (
    NEEDS,
    MergeOptions,
    MergePlan,
    check_mergeable,
    chosen_later,
    merge_needs,
    merge_workspace,
    merged_shape,
    plan_merge,
    summarize_merging,
)
from moecompress.passes.merge_budget import GRAM_NEEDS, plan_budget
from moecompress.passes.merge_units import (
    add_summaries,
    fit_groups,
    gather_pair,
    gather_summaries,
    group_workspace,
    merge_units,
    reads_experts,
    run_unit,
    take_summaries,
    weight_pairs,
)


class MergeExpertsConfig(MergeOptions):
    method: Literal["average", "frequency"] = Field(
        "frequency", description="member weights: uniform, or the members' shares of routed tokens"
    )


def _summarize(infos: dict[int, dict], cfg: MergeExpertsConfig) -> dict:
    out = summarize_merging(infos, cfg)
    out["summary"]["method"] = cfg.method
    return out


def fold(members: Iterator[Params], coeffs: list[float]) -> Params:
    """``combine(base, [m − base, …], coeffs)`` with the members (base first) taken one at a time: the same
    additions in the same order (the same bits), holding the base, the sum and one member."""
    base = next(members)
    out = {k: v.clone() for k, v in base.items()}
    for c in coeffs:  # not zip: its reused result tuple would keep the last member while the next is made
        p = sub_(next(members), base)  # in place
        if c:
            for k in out:
                out[k] += float(c) * p[k]
        del p
    return out


def merge_groups(plan: MergePlan, cfg: MergeExpertsConfig, first: int = 0) -> tuple[dict[int, Params], dict]:
    """The merged experts of ``plan``'s groups with two or more members, and the ``weights`` entry
    (``first``: the layer's number of the plan's first group, for a :meth:`MergePlan.unit`)."""
    merged: dict[int, Params] = {}
    weights = {}
    for g, members in enumerate(plan.groups):
        if len(members) < 2:
            continue
        w = plan.weights(g) if cfg.method == "frequency" else [1 / len(members)] * len(members)
        w = [float(v) for v in w]
        merged[g] = fold(plan.iter_members(g), w[1:])
        weights[str(first + g)] = w  # base first
    return merged, {"method": cfg.method, "weights": weights}


def merge_experts(layer: MoELayer, stats: LayerStats, cfg: MergeExpertsConfig) -> tuple[MoELayer, dict]:
    """Merge experts into fewer by their mean or usage-weighted mean (HC-SMoE / M-SMoE baselines)."""
    plan = plan_merge(layer, stats, cfg)
    merged, info = merge_groups(plan, cfg)
    new = plan.build(merged)
    return new, {**plan.info(new), **info}


CHUNKING = Chunking(
    "group", merge=merge_units, gather=gather_summaries, pairs=weight_pairs, pair=gather_pair, reads=reads_experts,
    take=take_summaries, add=add_summaries, fit=fit_groups,
    unit=lambda dec, lo, hi, bank, cfg: run_unit(dec, lo, hi, bank, merge_groups, cfg),
    exact=lambda cfg: not weight_pairs(cfg),  # the units give the whole layer's bytes; the weight Gram by pairs: not
    workspace=lambda layer, cfg, n, groups=None: group_workspace(layer, cfg, n, groups=groups, cap=2),  # fold
)  # by units of groups: the groups from per-expert summaries gathered over the chunks


SPEC = PassSpec(
    "merge_experts",
    MergeExpertsConfig,
    merge_experts,
    needs=NEEDS | GRAM_NEEDS,
    emits=merged_shape,
    check=check_mergeable,
    needs_fn=merge_needs,
    plan=plan_budget,
    plans=chosen_later,
    summarize=_summarize, alters=frozenset({"routing", "weights"}),
    chunking=CHUNKING,
    workspace=lambda layer, cfg: merge_workspace(layer, cfg, streamed=True),
)
