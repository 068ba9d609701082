"""``attribute_routing``: which parts of the residual stream steer each MoE layer's router, and which
experts are routing hubs; optionally protects the hubs.

Method: cross-layer routing attribution ("Understanding Cross-layer Contributions to MoE Routing in
LLMs", METHODS.md §10), formulas in :mod:`moecompress.methods.attribution`. On the first
``ATTRIB_TOKENS`` (128) calibration tokens, each MoE layer's router logits are split into sub-scores of
the embeddings (``embed``), each earlier layer's attention output (``attn_c``) and MoE output
(``moe_c``; a dense layer's whole update: ``dense_c``), this layer's attention (``attn_ℓ``) and the
router bias (``bias``, GPT-OSS; statistics that do not match this layout get ``component_c`` names) — the RMS of the total shared proportionally, so they sum to the logits
(``sum_error``, relative, is reported; ``norm_fit_error`` is the rank-1 RMSNorm fit). Per component:
influence (variance across experts), APS / ANS (mean positive / negative sub-score), ``selected``
(mean sub-score on the chosen top-k: promotion > 0, inhibition < 0) and AARV (mean top-k rank change
when the component is zeroed; the causal check). Routing scores for ranks are the logits plus
DeepSeek-V3's selection bias; group limits are ignored.

**Hubs.** Each routed expert ``e`` of a layer ``c`` gets the score ``Σ_{ℓ>c} Σ_{t: e∈topK_c(t)} AARV_ℓ(w y_e)
/ T``: the top-k rank displacement per traced token it causes in all later routers when its
contribution is removed. ``protect: N`` protects the ``N`` highest-scoring experts over all layers
(super-expert style: later steps must keep them bit-identical; ``protect: 0``, default, only reports).

Statistics: ``route_attrib`` (forward; the calibration trace keeps ``(2L + 1)`` residual components and
``n_moe · top_k`` expert contributions of 128 tokens × hidden: the dry run adds
``route_attrib_trace_bytes`` to the calibration memory). Cost per MoE layer: ``C`` router products
of ``128 × H`` and rankings of ``E`` scores.

Example steps::

    steps:
      - attribute_routing: {protect: 4}
      - heapr: {ratio: 0.5}
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.ir import MoELayer
from moecompress.methods.attribution import ATTRIB_TOKENS

KEYS = ("influence", "aps", "ans", "selected", "aarv")


class AttributeRoutingConfig(PassConfig):
    protect: int = Field(0, ge=0, description="protect this many hub experts (highest later-routing pull)")
    hub_score: Literal["sum", "mean"] = Field(
        "sum",
        description="an expert's pull summed over all later routers, or their mean (per-layer "
        "normalisation: an early layer has more later routers to pull)",
    )


def labels(index: int, moe_layers: list[int], n: int) -> list[str]:
    """Names of the ``n`` components of MoE layer ``index``'s sub-scores (see the module docstring)."""
    out = ["embed"]
    for c in range(index):
        out += [f"attn_{c}", f"moe_{c}"] if c in moe_layers else [f"dense_{c}"]
    out.append(f"attn_{index}")
    if n == len(out) + 1:
        out.append("bias")
    return out if n == len(out) else [f"component_{c}" for c in range(n)]  # statistics of another stream


def _plan(all_stats: dict[int, LayerStats], cfg: AttributeRoutingConfig) -> dict[int, dict]:
    layers = sorted(all_stats)
    score: dict[int, torch.Tensor] = {}
    for i in layers:
        st = all_stats[i]
        earlier = [c for c in layers if c < i]
        rows = st["route_attrib_hub_aarv"].double()
        if rows.shape[0] != len(earlier):  # statistics not from one sweep over these layers: no hubs
            continue
        for c, row in zip(earlier, rows):
            pull = row / ATTRIB_TOKENS
            score[c] = pull if c not in score else score[c] + pull[: len(score[c])]
    if cfg.hub_score == "mean":
        score = {c: v / sum(1 for i in layers if i > c) for c, v in score.items()}
    flat = sorted(
        ((float(v), c, e) for c, s in score.items() for e, v in enumerate(s.tolist())), reverse=True
    )
    chosen: dict[int, list[int]] = {i: [] for i in layers}
    for v, c, e in flat[: cfg.protect]:
        if v > 0:
            chosen[c].append(e)
    return {
        i: {"hubs": sorted(chosen[i]), "moe_layers": layers,
            "hub_score": [round(v, 6) for v in score.get(i, torch.zeros(0)).tolist()]}
        for i in layers
    }  # fmt: skip


def attribute_routing(
    layer: MoELayer, stats: LayerStats, cfg: AttributeRoutingConfig
) -> tuple[MoELayer, dict]:
    """Decompose router logits over the residual stream; report influence, AARV, hubs; protect hubs."""
    decision = stats.plan or {"hubs": [], "moe_layers": [layer.index], "hub_score": []}
    n = stats["route_attrib_influence"].numel()
    names = labels(layer.index, decision["moe_layers"], n)
    table = {k: dict(zip(names, (round(float(v), 6) for v in stats[f"route_attrib_{k}"]))) for k in KEYS}
    hubs = [e for e in decision["hubs"] if 0 <= e < layer.router.num_experts]
    info = {
        "components": names,
        **table,
        "sum_error": float(stats["route_attrib_sum_error"]),
        "norm_fit_error": float(stats["route_attrib_norm_fit_error"]),
        "hub_score": decision["hub_score"],
        "hubs": hubs,
    }
    return layer.replace(protected=layer.protected | frozenset(hubs)), info


def _kind(label: str) -> str:
    return label.split("_")[0]


def _summarize(infos: dict[int, dict], cfg: AttributeRoutingConfig) -> dict:
    layers = sorted(infos)
    by_kind = {}
    for i in layers:
        agg: dict[str, float] = {}
        for name, v in infos[i]["aarv"].items():
            agg[_kind(name)] = agg.get(_kind(name), 0.0) + v
        by_kind[str(i)] = {k: round(v, 4) for k, v in agg.items()}
    err = max((infos[i]["sum_error"] for i in layers), default=0.0)
    return {
        "summary": {
            "hubs": {str(i): infos[i]["hubs"] for i in layers if infos[i]["hubs"]},
            "aarv_by_kind": by_kind,
            "top_influence": {str(i): max(infos[i]["influence"], key=infos[i]["influence"].get) for i in layers},
            "max_sum_error": err,
            "max_norm_fit_error": max((infos[i]["norm_fit_error"] for i in layers), default=0.0),
        },
        "warnings": [f"sub-scores miss the router logits by {err:.2g} (relative)"] if err > 1e-4 else [],
        "plots": [{"file": "aarv.png", "kind": "heatmap", "title": "AARV by component (row: MoE layer)",
                   "data": [[infos[i]["aarv"].get(n, 0.0) for n in infos[layers[-1]]["components"]] for i in layers],
                   "xlabel": "component (last layer's order)", "ylabel": "MoE layer (order)"}] if layers else [],
    }  # fmt: skip


SPEC = PassSpec(
    "attribute_routing", AttributeRoutingConfig, attribute_routing, needs={"route_attrib"}, plan=_plan,
    protects=lambda d: d["hubs"], summarize=lambda i, c: _summarize(i, c), alters=frozenset(),
)  # fmt: skip
