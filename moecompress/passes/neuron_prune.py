"""``neuron_prune``: gradient-free baselines for atomic-expert pruning (the units of ``heapr``).

Each neuron ``k`` of routed expert ``e`` (row ``k`` of gate and up, column ``k`` of down) is scored
without gradients, then pruned exactly like ``heapr`` (:mod:`moecompress.passes.neuron_pruning`: ``ratio`` = fraction
of routed-expert neurons = parameters removed, ``align``, ``min_width``, ``unseen``, ``ragged`` or
``uniform`` layout; protected experts untouched):

- ``magnitude``: ``‖[W_g[k,:], W_u[k,:], W_d[:,k]]‖₂``, the weight norm of the unit (no calibration
  data; ``unseen`` does not apply);
- ``wanda``: Wanda's ``|W|·‖x‖`` summed over the unit's weights, with RMS activations over the tokens
  routed to the expert (``x`` the expert input, ``h`` the down-projection input):
  ``Σ_j |W_g[k,j]|·rms(x_j) + Σ_j |W_u[k,j]|·rms(x_j) + rms(h_k)·Σ_i |W_d[i,k]|``
  (Sun et al., "A Simple and Effective Pruning Approach for Large Language Models", ICLR 2024,
  adapted from weights to neurons).

Ranking is per layer (``scope: layer`` only): weight-based scores are not comparable across layers (their
scale differs per layer), which is what HEAPr's loss-based score fixes.

Statistics: ``expert_counts``; ``wanda`` adds ``expert_in_sq_mean`` and ``act_sq_mean`` (forward only).

Example steps::

    steps:
      - neuron_prune: {method: wanda, ratio: 0.25}
      - neuron_prune: {method: magnitude, ratio: 0.5, layout: uniform}
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassSpec
from moecompress.errors import PassError
from moecompress.ir import MoELayer
from moecompress.methods.widths import neuron_norms
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

NEEDS = {"expert_counts", "expert_in_sq_mean", "act_sq_mean"}


class NeuronPruneConfig(NeuronPruneOptions):
    method: Literal["magnitude", "wanda"] = Field("wanda", description="neuron score")
    scope: Literal["layer"] = Field("layer", description="ranking scope (per layer only; see the docstring)")


CHUNK = 8
"""Experts whose weights are scored at once (their float64 copies are the pass's only workspace)."""


def wanda_scores(layer: MoELayer, stats: LayerStats) -> torch.Tensor:
    """``[E, I]`` Wanda score per neuron (float64)."""
    bank = layer.experts
    x = stats["expert_in_sq_mean"].double().sqrt()  # [E, H]
    h = stats["act_sq_mean"].double().sqrt()  # [E, I]
    if tuple(x.shape) != (bank.num_experts, bank.hidden_size) or tuple(h.shape) != (
        bank.num_experts,
        bank.width,
    ):
        raise PassError(
            f"statistics shapes {tuple(x.shape)}/{tuple(h.shape)} do not match the layer's experts; run this "
            "step before steps that change the experts"
        )
    out = torch.empty(bank.num_experts, bank.width, dtype=torch.float64, device=x.device)
    for a in range(0, bank.num_experts, CHUNK):  # float64 copies of CHUNK experts at a time, not the layer
        e = range(a, min(a + CHUNK, bank.num_experts))
        g, u, d = (torch.stack([lay.expert(i) for i in e]).double().abs() for lay in (bank.gate, bank.up, bank.down))
        out[a : e.stop] = torch.einsum("eih,eh->ei", g + u, x[a : e.stop]) + h[a : e.stop] * d.sum(1)
    return out


def neuron_prune(layer: MoELayer, stats: LayerStats, cfg: NeuronPruneConfig) -> tuple[MoELayer, dict]:
    """Prune routed-expert neurons by weight magnitude or Wanda score (gradient-free baselines)."""
    magnitude = cfg.method == "magnitude"
    scores = neuron_norms(layer.experts).double() if magnitude else wanda_scores(layer, stats)
    new, info = prune(layer, scores, stats, cfg, data_free=magnitude)
    return new, {**info, "method": cfg.method}


SPEC = PassSpec(
    "neuron_prune", NeuronPruneConfig, neuron_prune, needs=NEEDS, emits=pruned_shape, check=check_prunable,
    summarize=summarize_pruning,
    needs_fn=lambda cfg: {"expert_counts"} if cfg.method == "magnitude" else NEEDS,
    chunking=Chunking("expert", merge=merge_pruning, refuse=refuse_layer_ranking, kind=pruning_kind), alters=frozenset({"neurons"}),
)  # fmt: skip
