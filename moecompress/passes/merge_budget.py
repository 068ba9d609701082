"""A merge budget over layers in one step: ``target_experts: {ratio: r}`` (or ``{total_experts: N}``) of
``namex`` / ``merge_experts``, spent in the step's cross-layer plan exactly as ``choose_groups {ratio}``
spends it (docs/analysis.md; issue 19).

Per layer, the merge-loss curve of the merging passes' default grouping (usage-weighted Ward on the experts'
outputs on the Ward tokens, protected experts singletons) needs only the pairwise squared distances of the
outputs, ``g_ii + g_jj − 2 g_ij``, so it comes from one statistic: ``expert_out_gram`` ``[E, E]``,
``Σ_t ⟨E_i(x_t), E_j(x_t)⟩`` (``scale: relative`` / ``absolute``), or ``expert_out_gram_fisher``,
``Σ_t ⟨G^{1/2}E_i(x_t), G^{1/2}E_j(x_t)⟩`` with ``G = out_grad_cov`` (``scale: loss``, the Fisher estimate
of the loss increase, default). :func:`~moecompress.methods.mixture.gram_curve` turns it into the curve
(the same function ``choose_groups`` uses, on the same Gram: the counts are equal) and
:func:`~moecompress.methods.merging.allocate_groups` spends the budget (exact dynamic programme).

Statistics: ``expert_counts``, ``expert_out_gram`` (with ``expert_out_gram_route``: the tokens and the
routing's ``mean_t Σ_k w²``), ``expert_out_gram_fisher`` (backward) for ``scale: loss``.

Example step::

    steps:
      - namex: {target_experts: {ratio: 0.5}}        # 50 % of all routed experts merged away, where cheapest
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from moecompress.engine.spec import LayerStats, PassConfig
from moecompress.errors import MethodError, PassError
from moecompress.methods.merging import allocate_groups, budget_keep
from moecompress.methods.mixture import gram_curve

GRAM_NEEDS = {"expert_out_gram", "expert_out_gram_fisher"}


class MergeBudget(PassConfig):
    """``target_experts: {ratio: r}`` / ``{total_experts: N}``: a total budget over the MoE layers (the
    spelling of ``choose_groups``)."""

    ratio: float | None = Field(None, ge=0, lt=1, description="fraction of all routed experts removed")
    total_experts: int | None = Field(None, ge=1, description="groups kept over all MoE layers")
    scale: Literal["loss", "relative", "absolute"] = Field(
        "loss", description="merge cost: Fisher loss estimate (backward statistic), relative, or output units"
    )

    @model_validator(mode="after")
    def _one_budget(self):
        if (self.ratio is None) == (self.total_experts is None):
            raise ValueError("a target_experts budget sets exactly one of ratio or total_experts")
        return self


def budget_needs(target: Any) -> set[str]:
    """What a budget adds to a merging step's statistics (nothing for any other ``target_experts``)."""
    if not isinstance(target, MergeBudget):
        return set()
    return {"expert_out_gram"} | ({"expert_out_gram_fisher"} if target.scale == "loss" else set())


def plan_budget(all_stats: dict[int, LayerStats], cfg: Any) -> dict[int, int | None]:
    """The merging steps' cross-layer plan: a budget's ``{layer: groups}`` (``None`` everywhere without a
    budget), from each layer's Gram statistic, ``expert_counts`` and the protected experts."""
    t = cfg.target_experts
    if not isinstance(t, MergeBudget):
        return {i: None for i in all_stats}
    curves, experts = {}, {}
    for i, st in all_stats.items():
        gram = st["expert_out_gram_fisher"] if t.scale == "loss" else st["expert_out_gram"]
        tokens, energy = st["expert_out_gram_route"].tolist()
        experts[i] = st["expert_counts"].numel()
        curves[i] = gram_curve(gram, st["expert_counts"], t.scale, int(tokens), energy, st.protected)
    try:
        return allocate_groups(curves, experts, budget_keep(sum(experts.values()), t.ratio, t.total_experts))
    except MethodError as err:
        raise PassError(
            f"target_experts={t.model_dump(exclude_none=True)}: {err}; choose a smaller ratio (or more "
            "total_experts)"
        ) from None
