"""``analyze``: a report of how the calibration data uses the experts; the weights are untouched.

Per MoE layer: tokens routed to each expert (and the experts that received none, which later passes
must not prune blindly), the mean per-token router entropy (nats, and normalised by ``log E``), the
mean router probability per expert, and the mean L2 norm of each expert's (unweighted) output. The
step report adds a tokens-per-expert heatmap, entropy per layer and output norms per layer.

Statistics needed: ``expert_counts``, ``router_prob_mean``, ``router_entropy``,
``expert_out_norm_mean`` (one forward sweep). Cost: the calibration forward; no writes.

Example step::

    steps:
      - analyze: {top: 5}
"""

from __future__ import annotations

import math

from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassConfig, PassSpec
from moecompress.ir import MoELayer


class AnalyzeConfig(PassConfig):
    top: int = Field(5, ge=1, description="how many most/least used experts to list per layer")


def _summarize(infos: dict[int, dict], cfg: AnalyzeConfig) -> dict:
    layers = sorted(infos)
    dead = {i: infos[i]["experts_without_tokens"] for i in layers if infos[i]["experts_without_tokens"]}
    warnings = [
        f"layer {i}: experts {ids} received no calibration tokens (more or more varied calibration data helps)"
        for i, ids in dead.items()
    ]
    return {
        "summary": {
            "layers": len(layers),
            "experts_without_tokens": sum(len(v) for v in dead.values()),
            "mean_router_entropy_normalised": (
                sum(infos[i]["router_entropy_normalised"] for i in layers) / max(len(layers), 1)
            ),
        },
        "warnings": warnings,
        "plots": [
            {
                "file": "tokens_per_expert.png",
                "kind": "heatmap",
                "title": "tokens per expert",
                "data": [infos[i]["tokens_per_expert"] for i in layers],
                "xlabel": "expert",
                "ylabel": f"MoE layer ({layers[0] if layers else 0}..{layers[-1] if layers else 0})",
            },
            {
                "file": "router_entropy.png",
                "kind": "line",
                "title": "router entropy / log E",
                "data": [infos[i]["router_entropy_normalised"] for i in layers],
                "xlabel": "MoE layer (order)",
                "ylabel": "normalised entropy",
            },
            {
                "file": "expert_output_norms.png",
                "kind": "heatmap",
                "title": "mean ||expert output||",
                "data": [infos[i]["expert_out_norm_mean"] for i in layers],
                "xlabel": "expert",
                "ylabel": "MoE layer",
            },
        ],
    }


def analyze(layer: MoELayer, stats: LayerStats, cfg: AnalyzeConfig) -> tuple[MoELayer, dict]:
    """Report expert usage, router entropy and expert output norms; return the layer unchanged."""
    counts = stats["expert_counts"].long()
    order = counts.argsort(descending=True).tolist()
    entropy = float(stats["router_entropy"])
    e = layer.router.num_experts
    info = {
        "tokens": int(counts.sum()),
        "tokens_per_expert": counts.tolist(),
        "experts_without_tokens": [i for i, c in enumerate(counts.tolist()) if c == 0],
        "most_used": order[: cfg.top],
        "least_used": order[::-1][: cfg.top],
        "router_entropy": entropy,
        "router_entropy_normalised": entropy / math.log(e) if e > 1 else 0.0,
        "router_prob_mean": [round(float(p), 6) for p in stats["router_prob_mean"]],
        "expert_out_norm_mean": [round(float(v), 6) for v in stats["expert_out_norm_mean"]],
    }
    return layer, info


SPEC = PassSpec(
    "analyze", AnalyzeConfig, analyze,
    needs={"expert_counts", "router_prob_mean", "router_entropy", "expert_out_norm_mean"},
    summarize=_summarize, report_only=True, chunking=Chunking("select"),
)  # fmt: skip
