"""``heapr``: atomic-expert pruning with HEAPr's output-space second-order score.

Paper: "HEAPr: Hessian-based Efficient Atomic Expert Pruning in Output Space" (ICLR 2026,
arXiv 2509.22299); implemented from ``shared/guide/METHODS.md`` §1, not from the (CC BY-NC) code.

An atomic expert is neuron ``k`` of routed expert ``i`` (row ``k`` of gate and up, column ``k`` of down;
``3·H`` parameters): ``e_k(x) = w_k · h_k(x)`` with ``h`` the down-projection input. Its score is the
OBS loss increase of zeroing its *output*, with the Fisher ``Ḡ_i = E[g gᵀ]`` (``g = ∂ℓ/∂`` expert
``i``'s down output, which carries the routing weight) as the Hessian. Because ``wₖᵀ g = ∂ℓ/∂h_k``, the
paper's ``E_t[e_kᵀ Ḡ_i e_k]`` factorises exactly into

    score_k = E_{t∈T_i}[h_{t,k}²] · E_{t∈T_i}[(∂ℓ/∂h_{t,k})²]

(product of two means over the tokens ``T_i`` routed to expert ``i``; the constant ½ is dropped). Memory
is ``2·E·I`` floats per layer instead of the original code's ``2·E·H²`` (Qwen3-30B-A3B: 38 MB instead of
192 GiB). ``ℓ`` is the causal-LM loss of the calibration text; the engine's streamed backward gathers
``∂ℓ/∂h`` one layer at a time.

**Ranking.** ``scope: global`` (default, the paper's HEAPr-G) ranks every neuron of every MoE layer
together in a cross-layer plan; ``scope: layer`` (HEAPr-L) applies the ratio in each layer. Selection,
``ratio`` (fraction of routed-expert neurons = parameters removed), ``align``, ``min_width``,
``unseen`` experts and the ``ragged``/``uniform`` layouts are described in :mod:`moecompress.passes.neuron_pruning`;
``uniform`` ranks within each expert and ignores ``scope``. Protected experts keep every neuron; shared
experts, routers and dense layers are untouched. Llama-4-style experts (input scaled by the router)
would measure the scaled path; no supported architecture does that.

Statistics: ``act_sq_mean``, ``grad_sq_mean`` (forward + streamed LM-loss backward), ``expert_counts``.

Example steps::

    steps:
      - heapr: {ratio: 0.25}                              # global ranking, ragged widths
      - heapr: {ratio: 0.5, scope: layer, align: 16}
      - heapr: {ratio: 0.25, layout: uniform, align: 64}  # stock checkpoint, smaller width
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassSpec
from moecompress.ir import MoELayer
from moecompress.methods.widths import Scope, exempt_widths, select_widths
from moecompress.passes.neuron_pruning import (
    NeuronPruneOptions,
    check_prunable,
    merge_pruning,
    prune,
    pruned_shape,
    pruning_kind,
    refuse_layer_ranking,
    summarize_pruning,
)

NEEDS = {"act_sq_mean", "grad_sq_mean", "expert_counts"}


class HeaprConfig(NeuronPruneOptions):
    scope: Literal["global", "layer"] = Field("global", description="rank across all MoE layers or per layer")


def heapr_scores(stats: LayerStats) -> torch.Tensor:
    """``[E, I]``: E[h²] · E[(∂ℓ/∂h)²] per neuron (float64)."""
    return stats["act_sq_mean"].double() * stats["grad_sq_mean"].double()


def _plan(all_stats: dict[int, LayerStats], cfg: HeaprConfig) -> dict[int, torch.Tensor | None]:
    if cfg.scope != "global" or cfg.layout == "uniform":
        return {i: None for i in all_stats}
    scores, fixed = {}, {}
    for i, st in all_stats.items():
        scores[i] = heapr_scores(st)
        fixed[i], _ = exempt_widths(scores[i], st["expert_counts"], st.protected, cfg)
    return select_widths(Scope(scores, fixed), cfg)


def heapr(layer: MoELayer, stats: LayerStats, cfg: HeaprConfig) -> tuple[MoELayer, dict]:
    """Prune routed-expert neurons with the lowest HEAPr score E[h²]·E[(∂ℓ/∂h)²]."""
    new, info = prune(layer, heapr_scores(stats), stats, cfg, widths=stats.plan)
    return new, {**info, "scope": "expert" if cfg.layout == "uniform" else cfg.scope}


SPEC = PassSpec(
    "heapr", HeaprConfig, heapr, needs=NEEDS, emits=pruned_shape, check=check_prunable, plan=_plan,
    summarize=summarize_pruning, plans=lambda cfg: cfg.scope == "global" and cfg.layout != "uniform",
    chunking=Chunking("expert", merge=merge_pruning, refuse=refuse_layer_ranking, kind=pruning_kind), alters=frozenset({"neurons"}),
)  # fmt: skip
