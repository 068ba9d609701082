"""``expert_structure``: do a layer's experts share a low-rank basis? (MoLR-MoG-style diagnostics; report only)

Per MoE layer and projection (gate, up, down), on the routed experts that are not protected, whitened
exactly as ``tdmoe``/``svd_experts`` whiten them (``whitening``, default ``input``): each expert's
effective rank, the mean pairwise subspace overlap (principal angles, output and input sides) and, for
every ratio of ``ratios``, the whitened residual energy of a shared Tucker basis (``tdmoe``) and of
per-expert bases (``svd_experts``) at equal parameters — the formulas are in
:mod:`moecompress.methods.structure`. The report gives per layer the predicted winner at each ratio and
the crossover ratio (the smallest ratio at which the shared basis wins).

The decision it feeds: ``decompose: {method: auto}`` picks, per layer, the predicted winner at its ratio,
and ``tdmoe: {budget: from_structure}`` spreads a layer's parameters over gate/up/down by the same
residuals. Both recompute the diagnostics from the weights they decompose (no state passes between steps),
so this step is the readable form of their decision.

Statistics: the whitening covariances (``input_cov``, ``down_in_cov_pooled``; forward only). Cost per
layer and projection: one SVD per expert and two eigendecompositions (``out²``, ``in²``), float64.

Example step::

    steps:
      - expert_structure: {ratios: [0.4, 0.6]}
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.errors import MethodError, PassError
from moecompress.ir import MoELayer
from moecompress.layouts.dense import Dense
from moecompress.methods.structure import crossover, predict, projection_structure, structure_workspace
from moecompress.methods.whitening import ALL_NEEDS, projection_whiteners, whitening_needs

PROJ = ("gate", "up", "down")


class StructureConfig(PassConfig):
    ratios: tuple[float, ...] = Field((0.2, 0.4, 0.6, 0.8), min_length=1, description="budgets to predict at")
    whitening: Literal["input", "output", "both", "none"] = Field(
        "input", description="as in tdmoe/svd_experts"
    )
    input_form: Literal["chol", "inverse"] = Field("chol", description="input whitening factor")

    @field_validator("ratios")
    @classmethod
    def _in_range(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 < r < 1 for r in v):
            raise ValueError("ratios must lie in (0, 1)")
        return tuple(sorted(set(v)))


def decomposed_members(layer: MoELayer, step: str) -> list[int]:
    """Physical ids of the experts a decomposition would factorise (dense bank, not protected)."""
    bank = layer.experts
    for name in PROJ:
        if not isinstance(getattr(bank, name), Dense) or bank.widths is not None:
            raise PassError(
                f"{step} needs dense, unpruned experts; run it before pruning or other decompositions"
            )
    protected = {layer.physical(e) for e in layer.protected}
    return [e for e in range(bank.num_experts) if e not in protected]


def layer_structure(
    layer: MoELayer, stats: LayerStats, ratios, whitening: str, input_form: str = "chol"
) -> dict:
    """``{proj: projection_structure(...)}`` of the layer's decomposed experts (whitened as the passes do)."""
    members = decomposed_members(layer, "expert_structure")
    if len(members) == 0:
        return {}
    wh = projection_whiteners(stats, whitening, input_form)
    out = {}
    for name in PROJ:
        w = getattr(layer.experts, name).dense()[members]
        out[name] = projection_structure(wh[name].whiten(w), tuple(ratios))
    return out


def expert_structure(layer: MoELayer, stats: LayerStats, cfg: StructureConfig) -> tuple[MoELayer, dict]:
    """Report each layer's expert structure and whether tdmoe or svd_experts should win there."""
    with torch.no_grad():
        st = layer_structure(layer, stats, cfg.ratios, cfg.whitening, cfg.input_form)
    if not st:
        return layer, {"skipped": "every expert is protected"}
    pred = {}
    for r in cfg.ratios:
        try:
            win, tot = predict(st, r)
            pred[str(r)] = {"winner": win, **{k: round(v, 6) for k, v in tot.items()}}
        except MethodError as err:  # a ratio no method can meet is reported, not fatal
            pred[str(r)] = {"winner": None, "why": str(err)}
    info = {
        "projections": {p: {**{k: v for k, v in s.items() if k != "residual"},
                            "residual": {str(r): v for r, v in s["residual"].items()}} for p, s in st.items()},
        "prediction": pred,
        "crossover_ratio": crossover(st),
    }  # fmt: skip
    return layer, info


def _workspace(layer: MoELayer) -> int:
    """One projection at a time (:func:`~moecompress.methods.structure.structure_workspace`), the largest;
    every expert counted (protected ones are left out of the stack: an upper bound)."""
    bank = layer.experts
    return max(structure_workspace(*getattr(bank, p).shape, getattr(bank, p).dtype.itemsize) for p in PROJ)


def _summarize(infos: dict[int, dict], cfg: StructureConfig) -> dict:
    layers = [i for i in sorted(infos) if "prediction" in infos[i]]
    return {
        "summary": {
            "winner": {str(r): {str(i): infos[i]["prediction"][str(r)]["winner"] for i in layers} for r in cfg.ratios},
            "crossover_ratio": {str(i): infos[i]["crossover_ratio"] for i in layers},
            "mean_effective_rank": {str(i): {p: round(sum(v["effective_rank"]) / len(v["effective_rank"]), 3)
                                             for p, v in infos[i]["projections"].items()} for i in layers},
            "overlap": {str(i): {p: [round(v["overlap_out"], 4), round(v["overlap_in"], 4)]
                                 for p, v in infos[i]["projections"].items()} for i in layers},
        },
        "warnings": [],
    }  # fmt: skip


SPEC = PassSpec(
    "expert_structure", StructureConfig, expert_structure, needs=ALL_NEEDS,
    check=lambda layer, cfg: decomposed_members(layer, "expert_structure") and None,
    needs_fn=lambda cfg: whitening_needs(cfg.whitening), summarize=lambda i, c: _summarize(i, c), report_only=True,
    workspace=lambda layer, cfg: _workspace(layer),
)  # fmt: skip
