"""``choose_groups``: how many merge groups each MoE layer should keep under a total budget, and how many
clusters its experts form (FedGEM-style EM). Report only.

**Budget** (``ratio``: fraction of all routed experts removed over the model, or ``total_experts``: groups
kept over all MoE layers). Per layer, the merging passes' default grouping (usage-weighted Ward on each
expert's outputs on the first 64 fit tokens of ``io_sample``, protected experts singletons) is run down
to one group and the cost of every merge is recorded (:func:`~moecompress.methods.mixture.merge_curve`):
the increase of ``Σ_g Σ_{i∈g} f_i ‖E_i(x) − Ē_g(x)‖²``, the first-order loss of replacing each group by
its usage-weighted average, divided by the layer's usage-weighted expert output energy on the same
tokens (``scale: relative``; ``absolute`` keeps squared output units; ``loss``, the default, is the Fisher
estimate with ``G = out_grad_cov``). The budget's merges are then spent by an exact dynamic programme over
layers (:func:`~moecompress.methods.merging.allocate_merges`). The summary's ``target_experts``
(``{layer: groups}``) is the allocation, to be given to ``namex`` / ``merge_experts``
(``target_experts: {layer: groups}``): their groups are then exactly the Ward groups the curve was
computed on.

The same budget in one step: ``namex: {target_experts: {ratio: 0.5}}`` (or ``merge_experts``) computes
this allocation in its cross-layer plan from the ``expert_out_gram`` statistics (Ward needs only the
pairwise distances of the outputs); both go through :func:`~moecompress.methods.mixture.gram_curve`, so
the counts are the same. This step remains the report (curves, predicted cost, BIC clusters) and the only
way to ``curve: merged``.

**Clusters** (as before): a tied isotropic Gaussian mixture over the unprotected experts' features (their
outputs and centred router-logit columns, reduced to principal dimensions), ``K`` by BIC
(:func:`~moecompress.methods.mixture.choose_count`) — reported per layer as ``groups``; it is what
``target_experts: auto`` uses, a cluster count and not a compression budget.

Statistics: ``expert_counts``, ``io_sample`` (forward). Cost: one expert forward per expert on 64 tokens,
Ward on ``E`` points, EM on ``E`` points.

Example step::

    steps:
      - choose_groups: {ratio: 0.5}
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.errors import MethodError, PassError
from moecompress.ir import MoELayer
from moecompress.methods.merging import allocate_groups, budget_keep
from moecompress.methods.mixture import choose_count, merge_curve
from moecompress.passes.merge_experts import MergeExpertsConfig, merge_experts
from moecompress.reference import moe_forward


class ChooseGroupsConfig(PassConfig):
    ratio: float | None = Field(
        None, ge=0, lt=1, description="fraction of all routed experts removed (budget)"
    )
    total_experts: int | None = Field(None, ge=1, description="groups kept over all MoE layers (budget)")
    curve: Literal["ward", "merged"] = Field(
        "ward",
        description="cost of each merge: the first-order Ward estimate (no merge is built), or the measured "
        "error of the frequency-merged layer",
    )
    scale: Literal["loss", "relative", "absolute"] = Field(
        "loss",
        description="merge cost as a Fisher loss estimate (backward statistic), relative to the "
        "layer's expert output energy, or in output units",
    )

    clusters: bool = Field(True, description="also fit the Gaussian mixture and report BIC's count per layer")

    @model_validator(mode="after")
    def _one_budget(self):
        if self.ratio is not None and self.total_experts is not None:
            raise ValueError("set at most one of ratio or total_experts")
        return self


def _budgeted(cfg: ChooseGroupsConfig) -> bool:
    return cfg.ratio is not None or cfg.total_experts is not None


def _needs(cfg: ChooseGroupsConfig) -> set[str]:
    """``out_grad_cov`` (a backward sweep) only for a budget with ``scale: loss``."""
    return {"io_sample", "expert_counts"} | (
        {"out_grad_cov"} if _budgeted(cfg) and cfg.scale == "loss" else set()
    )


def check_distinct(layer: MoELayer, cfg: ChooseGroupsConfig) -> None:
    """Dry-run check: the layer's experts are distinct (no expert map: nothing merged or remapped yet)."""
    if layer.expert_map is not None:
        raise PassError(
            "choose_groups plans merges of distinct experts, but this layer already maps several experts to "
            "one (namex or merge_experts ran before); run choose_groups on the checkpoint before merging"
        )


def choose_groups(layer: MoELayer, stats: LayerStats, cfg: ChooseGroupsConfig) -> tuple[MoELayer, dict]:
    """Report each layer's merge-loss curve and BIC cluster count; the summary spends a budget over layers."""
    x = stats["io_sample_x"].float()
    x_fit = x[: (x.shape[0] + 1) // 2] if x.shape[0] > 1 else x
    e = layer.router.num_experts
    counts = stats["expert_counts"].double().flatten()
    if counts.numel() != e:
        raise PassError(f"statistic 'expert_counts' covers {counts.numel()} experts but the layer has {e}")
    with torch.no_grad():
        info = choose_count(layer, x_fit)[1] if cfg.clusters else {"groups": None}
        curve = None
        if _budgeted(cfg):
            grad_cov = stats["out_grad_cov"] if cfg.scale == "loss" else None
            if cfg.curve == "ward":
                curve = merge_curve(layer, x_fit, counts, cfg.scale, grad_cov)
            else:
                curve = measured_curve(layer, stats, cfg.scale, grad_cov)
    return layer, {**info, "experts": e, "merge_costs": curve}


def measured_curve(
    layer: MoELayer, stats: LayerStats, scale: str, grad_cov: torch.Tensor | None
) -> list[float]:
    """``c[m]``: the increase of the layer's output error on the held-back ``io_sample`` tokens from its
    ``m``-th to its ``(m+1)``-th merge, each merge state built by ``merge_experts`` (frequency weights,
    aligned, Ward groups: the groups ``namex`` forms for the same count), the error measured with the
    real router — ``loss``: ``½ E_t δ_tᵀ G δ_t`` (``G`` = ``out_grad_cov``, the Fisher estimate of the
    loss increase); ``relative``: ``Σ‖δ‖² / Σ‖y‖²``; ``absolute``: ``E_t ‖δ_t‖²``. Weight-space merging
    of dissimilar experts loses more than the function-space average the Ward estimate assumes, which
    this measures. Not monotone in general (:func:`allocate_merges` is exact for any curve)."""
    e = layer.router.num_experts
    lowest = len(layer.protected) + (1 if e > len(layer.protected) else 0)
    x = stats["io_sample_x"].float()
    held = x[(x.shape[0] + 1) // 2 :] if x.shape[0] > 1 else x
    y0 = moe_forward(layer, held).double()
    g = grad_cov.double() if grad_cov is not None else None

    def err(new: MoELayer) -> float:
        d = moe_forward(new, held).double() - y0
        if g is not None:
            return 0.5 * float(torch.einsum("ti,ij,tj->", d, g, d)) / len(d)
        return float(d.pow(2).sum()) / (float(y0.pow(2).sum()) if scale == "relative" else len(d))

    cum = [0.0]
    for k in range(e - 1, lowest - 1, -1):
        new, _ = merge_experts(layer, stats, MergeExpertsConfig(target_experts=k))
        cum.append(err(new))
    return [cum[j + 1] - cum[j] for j in range(len(cum) - 1)]


def _summarize(infos: dict[int, dict], cfg: ChooseGroupsConfig) -> dict:
    layers = sorted(infos)
    summary: dict = {"groups": {str(i): infos[i]["groups"] for i in layers},
                     "experts": {str(i): infos[i]["experts"] for i in layers}}  # fmt: skip
    total = sum(infos[i]["experts"] for i in layers)
    if _budgeted(cfg):
        keep = budget_keep(total, cfg.ratio, cfg.total_experts)
        curves = {i: infos[i]["merge_costs"] for i in layers}
        try:
            groups = allocate_groups(curves, {i: infos[i]["experts"] for i in layers}, keep)
        except MethodError as err:
            raise PassError(str(err)) from None
        done = {i: infos[i]["experts"] - groups[i] for i in layers}
        summary["target_experts"] = {str(i): groups[i] for i in layers}
        summary["experts_kept"] = keep
        summary["experts_total"] = total
        summary["predicted_cost"] = {str(i): sum(curves[i][: done[i]]) for i in layers}
    return {"summary": summary, "warnings": []}


SPEC = PassSpec(
    "choose_groups", ChooseGroupsConfig, choose_groups, needs={"io_sample", "expert_counts", "out_grad_cov"},
    needs_fn=_needs, check=check_distinct,
    report_only=True,
    summarize=lambda i, c: _summarize(i, c),
)  # fmt: skip
