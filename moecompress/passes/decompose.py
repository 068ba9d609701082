"""``decompose``: low-rank decomposition of the routed experts, choosing TD-MoE or per-expert SVD per layer.

``method: auto`` (default) computes, per MoE layer, the expert-structure prediction of
:mod:`moecompress.passes.expert_structure` at ``ratio`` — the whitened residual energy a shared Tucker
basis (``tdmoe``) and per-expert bases (``svd_experts``) leave at equal parameters, summed over gate, up
and down (:func:`moecompress.methods.structure.predict`) — and runs the pass with the smaller one on that
layer (ties: ``tdmoe``, which stores less per expert). ``method: tdmoe`` / ``svd_experts`` force one;
``override: {layer: method}`` replaces the choice in single layers (to check a prediction layer by layer).
Both predictions are exact for the whitened error (HOSVD with the expert mode kept; balanced SVD ranks),
so what can fail is only the link from whitened weight error to the model's loss; the step report lists
each layer's choice and both predicted residuals, and the achieved one.

``tdmoe_budget: from_structure`` (default ``uniform``) lets the layers that pick ``tdmoe`` spread their
parameters over the projections (``tdmoe: {budget: from_structure}``).

Dry run: the choice needs the weights, so the shapes shown are ``svd_experts``'s (``tdmoe`` under
``method: tdmoe``); both are factorised layouts that later steps needing dense experts refuse alike.
Input: dense, unpruned experts (decompose before pruning). Protected experts stay dense.

Statistics: those of the whitening (``input_cov``, ``down_in_cov_pooled`` for ``input``). Cost: the
diagnostics (one SVD per expert and projection, two eigendecompositions) plus the chosen pass.

Example step::

    steps:
      - decompose: {method: auto, ratio: 0.4}
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.ir import MoELayer
from moecompress.methods.structure import predict
from moecompress.methods.whitening import ALL_NEEDS, whitening_needs
from moecompress.passes import svd_experts as svd
from moecompress.passes import tdmoe as td
from moecompress.passes.expert_structure import decomposed_members, layer_structure


class DecomposeConfig(PassConfig):
    method: Literal["auto", "tdmoe", "svd_experts"] = Field(
        "auto", description="per-layer choice or a fixed pass"
    )
    ratio: float = Field(
        0.4, gt=0, lt=1, description="fraction of the decomposed experts' parameters removed"
    )
    whitening: Literal["input", "output", "both", "none"] = Field("input", description="data-aware whitening")
    input_form: Literal["chol", "inverse"] = Field("chol", description="input whitening factor")
    tdmoe_budget: Literal["uniform", "from_structure"] = Field(
        "uniform", description="tdmoe layers: same ratio per projection, or spread by structure"
    )
    override: dict[int, Literal["tdmoe", "svd_experts"]] = Field(
        default_factory=dict, description="layer index -> method, replacing the choice there (ablations)"
    )


def _td(cfg: DecomposeConfig) -> td.TdmoeConfig:
    return td.TdmoeConfig(ratio=cfg.ratio, whitening=cfg.whitening, input_form=cfg.input_form,
                          budget=cfg.tdmoe_budget)  # fmt: skip


def _svd(cfg: DecomposeConfig) -> svd.SvdExpertsConfig:
    return svd.SvdExpertsConfig(ratio=cfg.ratio, whitening=cfg.whitening, input_form=cfg.input_form)


def _check(layer: MoELayer, cfg: DecomposeConfig) -> None:
    decomposed_members(layer, "decompose")
    if cfg.method in ("auto", "svd_experts"):
        svd.check_decomposable(layer, _svd(cfg))
    if cfg.method in ("auto", "tdmoe"):
        td._check(layer, _td(cfg))


def _emits(layer: MoELayer, cfg: DecomposeConfig) -> MoELayer:
    """Shapes only: ``svd_experts``'s (``tdmoe``'s for ``method: tdmoe``); see the module docstring."""
    method = cfg.override.get(layer.index, cfg.method)
    return td._emits(layer, _td(cfg)) if method == "tdmoe" else svd._emits(layer, _svd(cfg))


def decompose(layer: MoELayer, stats: LayerStats, cfg: DecomposeConfig) -> tuple[MoELayer, dict]:
    """Decompose the routed experts with tdmoe or svd_experts, chosen per layer by their predicted error."""
    _check(layer, cfg)
    info: dict = {}
    choice = cfg.method
    if not decomposed_members(layer, "decompose"):
        return layer, {"skipped": "every expert is protected"}
    if cfg.method == "auto":
        with torch.no_grad():
            st = layer_structure(layer, stats, (cfg.ratio,), cfg.whitening, cfg.input_form)
        choice, tot = predict(st, cfg.ratio)
        info.update(predicted_residual=tot, predicted=choice)
    choice = cfg.override.get(layer.index, choice)
    if choice == "tdmoe":
        new, sub = td.tdmoe(layer, stats, _td(cfg))
        achieved = sum(sub[p]["whitened_rel_error"] ** 2 for p in td.PROJ)
        before, after = sub["params_before"], sub["params_after"]
    else:
        new, sub = svd.svd_experts(layer, stats, _svd(cfg))
        achieved = None  # svd reports the mean per-expert error, not the pooled energy
        before, after = sub["params_before"], sub["params_after"]
    info.update(
        method=choice, achieved_residual=achieved, params_before=before, params_after=after, detail=sub
    )
    return new, info


def _summarize(infos: dict[int, dict], cfg: DecomposeConfig) -> dict:
    layers = [i for i in sorted(infos) if "method" in infos[i]]
    before = sum(infos[i]["params_before"] for i in layers)
    after = sum(infos[i]["params_after"] for i in layers)
    return {
        "summary": {
            "ratio": cfg.ratio,
            "method": cfg.method,
            "choice": {str(i): infos[i]["method"] for i in layers},
            "predicted_residual": {str(i): infos[i].get("predicted_residual") for i in layers},
            "routed_fraction_removed": 1 - after / before if before else 0.0,
        },
        "warnings": [],
    }


SPEC = PassSpec(
    "decompose", DecomposeConfig, decompose, needs=ALL_NEEDS, emits=_emits, check=_check,
    needs_fn=lambda cfg: whitening_needs(cfg.whitening), summarize=lambda i, c: _summarize(i, c),
    extras=("decompose",), alters=frozenset({"weights"}),
)  # fmt: skip
