"""What each statistic depends on in an MoE layer, and the exact maps of a neuron subset.

A recipe step changes parts of a layer (``PassSpec.alters``): ``routing`` (router rows, which experts
exist or which physical expert a token reaches; stored routing policies are applied when the model is
served, not in the calibration forward), ``neurons`` (each expert keeps a
subset of its neurons), ``weights`` (expert weight values), ``shared`` (the shared expert). The MoE
block's input never changes within a layer. :data:`DEPENDS` says, per statistic of the catalogue,
which of these parts it is a function of (given the layer's input): a statistic whose parts no earlier
step changed still describes the layer as it is.

A neuron subset changes nothing upstream of a kept neuron (its gate and up rows are the same and the
router is untouched), so the statistics of the down-projection input are *exactly* the kept neurons'
entries (:func:`map_neurons`); a pruned expert's dropped neurons read 0, as the collector stores them
(``reference._logical``). ``down_in_cov_pooled`` pools experts that kept different neurons, so it is
rebuilt from the per-expert ``down_in_cov`` and the routed-token counts.
"""

from __future__ import annotations

import torch

ROUTING, NEURONS, WEIGHTS, SHARED = "routing", "neurons", "weights", "shared"
ANY = frozenset({ROUTING, NEURONS, WEIGHTS, SHARED})
_EXPERT = frozenset({ROUTING, NEURONS, WEIGHTS})

DEPENDS: dict[str, frozenset[str]] = {
    "expert_counts": frozenset({ROUTING}),
    "router_prob_mean": frozenset({ROUTING}),
    "router_entropy": frozenset({ROUTING}),
    "router_sample": frozenset(),  # the input checkpoint's router on these inputs: router_robustness's baseline
    "expert_in_sq_mean": frozenset({ROUTING}),
    "expert_in_cov": frozenset({ROUTING}),
    "act_sq_mean": _EXPERT,
    "down_in_cov": _EXPERT,
    "down_in_cov_pooled": _EXPERT,
    "expert_out_norm_mean": _EXPERT,
    "reap_saliency": _EXPERT,
    "down_out_absmax": _EXPERT,
    "down_out_argmax": _EXPERT,
    "shared_down_out_absmax": frozenset({SHARED}),
    "shared_down_out_argmax": frozenset({SHARED}),
    "io_sample": ANY,  # io_sample_y; io_sample_x is the input
    "expert_out_gram": _EXPERT,
    "input_cov": frozenset(),
    "holdout": frozenset(),
    "moe_inputs": frozenset(),
    "router_sample_base": frozenset(),  # the input checkpoint's routing, by definition
    # a backward pass runs through the changed model (every layer), the trace through earlier layers
    "route_attrib": ANY,
    "grad_sq_mean": ANY,
    "out_grad_cov": ANY,
    "down_in_grad_cov_pooled": ANY,
    "expert_out_gram_fisher": ANY,
}
"""Per statistic: the parts of a layer it is a function of (its input fixed)."""

NEURON_MAPPED = frozenset({"act_sq_mean", "down_in_cov", "down_in_cov_pooled"})
"""Statistics a neuron subset maps exactly (:func:`map_neurons`)."""

SAMPLED = frozenset({"io_sample", "expert_out_gram"})
"""Statistics computed from the stored ``io_sample_x`` tokens alone: recomputed exactly on the changed
layer from them."""


def map_neurons(
    stats: dict[str, torch.Tensor], keep: list[list[int]], width: int, counts: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The :data:`NEURON_MAPPED` statistics of ``stats`` after each physical expert ``e`` kept the neurons
    ``keep[e]`` (old ids, in order) of a bank now ``width`` wide (its live neurons first, the rest read
    0); ``counts``: routed (token, slot) pairs per physical expert, the weights of the pooled mean.
    ``down_in_cov_pooled`` needs ``down_in_cov``."""
    out: dict[str, torch.Tensor] = {}
    ids = [torch.as_tensor(k, dtype=torch.int64) for k in keep]
    if "act_sq_mean" in stats:
        old = stats["act_sq_mean"]
        new = old.new_zeros(len(ids), width)
        for e, k in enumerate(ids):
            new[e, : len(k)] = old[e, k]
        out["act_sq_mean"] = new
    if "down_in_cov" in stats:
        old = stats["down_in_cov"]
        new = old.new_zeros(len(ids), width, width)
        for e, k in enumerate(ids):
            new[e, : len(k), : len(k)] = old[e][k][:, k]
        out["down_in_cov"] = new
    if "down_in_cov_pooled" in stats:
        per = out.get("down_in_cov")
        if per is None:
            raise KeyError("down_in_cov_pooled follows a neuron subset through down_in_cov")
        n = counts.double()
        pooled = (per.double() * n.view(-1, 1, 1)).sum(0) / max(float(n.sum()), 1.0)
        out["down_in_cov_pooled"] = pooled.to(stats["down_in_cov_pooled"].dtype)
    return out
