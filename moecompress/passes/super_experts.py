"""``protect_super_experts``: find the super experts and protect them from every later step.

Paper: "Unveiling Super Experts in Mixture-of-Experts Large Language Models" (Super Experts). A super
expert's down projection produces rare, extreme outliers that become the massive activations of the
residual stream; pruning or quantising it collapses the model.

Rule (``shared/guide/METHODS.md`` §5): with ``a[l, e] = max over calibration tokens and channels of
|down_proj output|`` for every routed (and shared) expert of every MoE layer, expert ``e`` of layer ``l``
is a super expert iff

    a[l, e] > max(P_percentile(all a), min_fraction_of_max * max(all a))

and ``l`` is among the first ``layer_fraction`` of the MoE layers (outlier experts in the last layers
are large but harmless). ``manual`` adds experts by hand. The chosen experts go into
``MoELayer.protected``; the executor then verifies after every step that they are bit-identical, and
the output's ``config.json`` records them (``moecompress.protected``) so later runs keep them.

Statistics needed: ``down_out_absmax``/``down_out_argmax`` and the shared-expert equivalents (one
forward sweep). Cost: negligible beyond calibration. The report has the paper's Table-1 view: the top
magnitudes per layer, P99.5 and max/10, the chosen experts and their massive-activation channels.

Example step::

    steps:
      - protect_super_experts: {percentile: 99.5, min_fraction_of_max: 0.1, layer_fraction: 0.75}
      - protect_super_experts: {manual: [{layer: 3, experts: [17]}]}
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassConfig, PassSpec
from moecompress.errors import PassError
from moecompress.ir import MoELayer

NEEDS = {"down_out_absmax", "down_out_argmax", "shared_down_out_absmax", "shared_down_out_argmax"}


class ManualExperts(PassConfig):
    layer: int = Field(ge=0)
    experts: list[int] = Field(min_length=1)


class SuperExpertsConfig(PassConfig):
    percentile: float = Field(99.5, gt=0, lt=100, description="percentile of all expert magnitudes")
    min_fraction_of_max: float = Field(0.1, ge=0, le=1, description="and at least this fraction of the max")
    layer_fraction: float = Field(0.75, gt=0, le=1, description="only the first fraction of MoE layers")
    manual: list[ManualExperts] = Field(default_factory=list, description="experts to protect by hand")
    auto: bool = Field(True, description="apply the magnitude rule (false: manual list only)")
    top: int = Field(10, ge=1, le=100, description="magnitudes per layer in the report")


def _plan(all_stats: dict[int, LayerStats], cfg: SuperExpertsConfig) -> dict[int, dict]:
    layers = sorted(all_stats)
    unknown = sorted({m.layer for m in cfg.manual} - set(layers))
    if unknown:
        raise PassError(f"manual: layers {unknown} are not MoE layers; MoE layers are {layers}")
    values = torch.cat(
        [all_stats[i]["down_out_absmax"].float() for i in layers]
        + [all_stats[i].get("shared_down_out_absmax", torch.empty(0)).float() for i in layers]
    )
    p = float(torch.quantile(values, cfg.percentile / 100)) if values.numel() else math.inf
    gmax = float(values.max()) if values.numel() else 0.0
    threshold = max(p, cfg.min_fraction_of_max * gmax)
    eligible = set(layers[: max(1, math.floor(len(layers) * cfg.layer_fraction + 1e-9))])
    plan = {}
    for i in layers:
        a = all_stats[i]["down_out_absmax"].float()
        auto = [int(e) for e in torch.nonzero(a > threshold).flatten()] if cfg.auto and i in eligible else []
        manual = sorted({e for m in cfg.manual if m.layer == i for e in m.experts})
        plan[i] = {"threshold": threshold, "percentile_value": p, "global_max": gmax, "eligible": i in eligible,
                   "auto": auto, "manual": manual}  # fmt: skip
    return plan


def _summarize(infos: dict[int, dict], cfg: SuperExpertsConfig) -> dict:
    layers = sorted(infos)
    chosen = {i: infos[i]["chosen"] for i in layers if infos[i]["chosen"]}
    first = infos[layers[0]] if layers else {}
    return {
        "summary": {
            "threshold": first.get("threshold"),
            f"P{cfg.percentile:g}": first.get("percentile_value"),
            "global_max": first.get("global_max"),
            "max_over_10": (first.get("global_max") or 0.0) / 10,
            "super_experts": {str(i): v for i, v in chosen.items()},
            "count": sum(len(v) for v in chosen.values()),
            "top_magnitudes_per_layer": {str(i): infos[i]["top"] for i in layers},
        },
        "warnings": [] if chosen else ["no super experts found (a legitimate result; see the magnitude table)"],
        "plots": [
            {"file": "expert_magnitudes.png", "kind": "heatmap", "title": "max |down_proj output| per expert",
             "data": [infos[i]["magnitudes"] for i in layers], "xlabel": "expert", "ylabel": "MoE layer (order)"},
            {"file": "top_magnitude.png", "kind": "line", "title": "largest expert magnitude per layer",
             "data": [infos[i]["top"][0] if infos[i]["top"] else 0.0 for i in layers], "xlabel": "MoE layer (order)",
             "ylabel": "max |y|"},
        ],
    }  # fmt: skip


def protect_super_experts(
    layer: MoELayer, stats: LayerStats, cfg: SuperExpertsConfig
) -> tuple[MoELayer, dict]:
    """Mark the super experts of this layer as protected (weights unchanged)."""
    decision = stats.plan or {}
    manual = decision.get("manual", [])
    bad = [e for e in manual if not 0 <= e < layer.router.num_experts]
    if bad:
        raise PassError(f"manual experts {bad} out of range [0, {layer.router.num_experts})")
    auto_physical = set(decision.get("auto", []))  # statistics are per physical expert
    auto = {e for e in range(layer.router.num_experts) if layer.physical(e) in auto_physical}
    chosen = sorted(auto | set(manual))
    a = stats["down_out_absmax"].float()
    channels = stats["down_out_argmax"]
    info = {
        "chosen": chosen,
        "channels": {str(e): int(channels[layer.physical(e)]) for e in chosen},
        "magnitudes": [round(float(v), 6) for v in a],
        "top": [round(float(v), 6) for v in a.sort(descending=True).values[: cfg.top]],
        "layer_percentile": float(torch.quantile(a, cfg.percentile / 100)),
        "shared_absmax": [round(float(v), 6) for v in stats.get("shared_down_out_absmax", torch.empty(0))],
        **{k: decision.get(k) for k in ("threshold", "percentile_value", "global_max", "eligible")},
    }
    return layer.replace(protected=layer.protected | frozenset(chosen)), info


def _check(layer: MoELayer, cfg: SuperExpertsConfig) -> None:
    bad = sorted({e for m in cfg.manual if m.layer == layer.index for e in m.experts if not 0 <= e < layer.router.num_experts})
    if bad:
        raise PassError(f"manual experts {bad} out of range [0, {layer.router.num_experts})")


def _emits(layer: MoELayer, cfg: SuperExpertsConfig) -> MoELayer:
    """Shapes are unchanged; the manual experts are known to be protected already (the automatic ones
    only once the statistics exist)."""
    manual = {e for m in cfg.manual if m.layer == layer.index for e in m.experts}
    return layer.replace(protected=layer.protected | frozenset(manual)) if manual else layer


SPEC = PassSpec(
    "protect_super_experts", SuperExpertsConfig, protect_super_experts, needs=NEEDS, emits=_emits, check=_check,
    plan=_plan, protects=lambda d: [*d["auto"], *d["manual"]], summarize=_summarize, chunking=Chunking("select"),
    alters=frozenset(),
)  # fmt: skip
