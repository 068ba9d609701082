"""``routing_report``: how the calibration tokens load the experts, with and without the layer's
routing policy (``capacity_drop``, ``sere`` steps before it); the weights are untouched.

Per MoE layer, on the calibration MoE inputs ``io_sample`` routed by the layer's own router:

- **prefill** (all sample tokens as one batch): the straggler ratio ``max / mean`` expert load, and with
  a capacity policy, the ratio after it and the fraction of slots it drops (and adds, expanded drop);
- **decode** for each ``batch_sizes`` entry ``B`` (random batches of ``B`` sample tokens, seeded, as
  decode batches of ``B`` sequences are): distinct experts per batch, and with a SERE policy the
  experts it still runs and the fraction of slots it re-routes.

Formula and rules: :mod:`moecompress.methods.routing`. Statistics needed: ``io_sample``. Cost: one
router evaluation per sample token.

Example step::

    steps:
      - sere: {select_top: 2, threshold: 0.1}
      - routing_report: {batch_sizes: [8, 16, 32]}
"""

from __future__ import annotations

import torch
from pydantic import Field

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.ir import MoELayer
from moecompress.methods.routing import apply_policy, router_probs, straggler_ratio
from moecompress.reference import route, router_logits


class RoutingReportConfig(PassConfig):
    batch_sizes: list[int] = Field([1, 8, 16, 32], min_length=1, description="decode batch sizes measured")
    seed: int = Field(0, ge=0, description="seed of the random decode batches")


def protected_mask(layer: MoELayer) -> torch.Tensor | None:
    if not layer.protected:
        return None
    mask = torch.zeros(layer.router.num_experts, dtype=torch.bool)
    mask[sorted(layer.protected)] = True
    return mask


def routing_report(layer: MoELayer, stats: LayerStats, cfg: RoutingReportConfig) -> tuple[MoELayer, dict]:
    """Measure expert loads and the policy's effect on the sample tokens; return the layer unchanged."""
    x = stats["io_sample_x"].float()
    e, k = layer.router.num_experts, layer.router.top_k
    ids, w = route(layer, x)
    probs = router_probs(router_logits(layer, x), layer.router.gating)
    policy = {kk: dict(v) for kk, v in (layer.routing or {}).items()}
    prot = protected_mask(layer)
    t = x.shape[0]
    info: dict = {"tokens": t, "policy": policy, "prefill": {"straggler_ratio": round(straggler_ratio(ids, e), 4)}}
    if "capacity_drop" in policy:
        new_ids, _, c = apply_policy({"capacity_drop": policy["capacity_drop"]}, ids, w, probs, num_experts=e, top_k=k,
                                     batch_shape=(1, t), protected=prot)  # fmt: skip
        info["prefill"].update(
            straggler_ratio_policy=round(straggler_ratio(new_ids, e), 4),
            dropped_fraction=round(c["dropped"] / max(c["slots"], 1), 6),
            added_fraction=round(c["added"] / max(c["slots"], 1), 6),
        )
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(t, generator=gen)
    decode = []
    for b in cfg.batch_sizes:
        n = t // b
        if n == 0:
            decode.append({"batch": b, "batches": 0})
            continue
        groups = order[: n * b].view(n, b)
        distinct = [int(torch.unique(ids[g]).numel()) for g in groups]
        row = {"batch": b, "batches": n, "distinct_experts": round(sum(distinct) / n, 4),
               "straggler_ratio": round(sum(straggler_ratio(ids[g], e) for g in groups) / n, 4)}  # fmt: skip
        if "sere" in policy and layer.routing_similarity is not None:
            executed = rerouted = slots = 0
            for g in groups:
                _, _, c = apply_policy({"sere": policy["sere"]}, ids[g], w[g], None, num_experts=e, top_k=k, batch_shape=(b, 1),
                                       similarity=layer.routing_similarity, protected=prot)  # fmt: skip
                executed, rerouted, slots = executed + c["executed"], rerouted + c["rerouted_slots"], slots + c["slots"]
            row.update(distinct_experts_policy=round(executed / n, 4), rerouted_fraction=round(rerouted / max(slots, 1), 6))
        decode.append(row)
    info["decode"] = decode
    return layer, info


def _summarize(infos: dict[int, dict], cfg: RoutingReportConfig) -> dict:
    layers = sorted(infos)
    if not layers:
        return {"summary": {"layers": 0}, "warnings": [], "plots": []}
    sizes = [b for b in cfg.batch_sizes]

    def series(key: str) -> list[list[float]]:
        return [[float(r.get(key, r.get("distinct_experts", 0.0))) for r in infos[i]["decode"]] for i in layers]

    plots = [
        {"file": "distinct_experts.png", "kind": "line", "title": "distinct experts per decode batch",
         "data": series("distinct_experts"), "xlabel": f"batch size {sizes}", "ylabel": "experts (one line per layer)"},
        {"file": "straggler_ratio.png", "kind": "line", "title": "prefill straggler ratio (max/mean load)",
         "data": [infos[i]["prefill"]["straggler_ratio"] for i in layers], "xlabel": "MoE layer (order)",
         "ylabel": "max / mean"},
    ]  # fmt: skip
    if any("distinct_experts_policy" in r for i in layers for r in infos[i]["decode"]):
        plots.append({"file": "distinct_experts_sere.png", "kind": "line", "title": "experts run per batch with SERE",
                      "data": series("distinct_experts_policy"), "xlabel": f"batch size {sizes}",
                      "ylabel": "experts (one line per layer)"})  # fmt: skip
    prefill = [infos[i]["prefill"] for i in layers]
    summary = {
        "layers": len(layers),
        "straggler_ratio": round(sum(p["straggler_ratio"] for p in prefill) / len(layers), 4),
    }
    if all("straggler_ratio_policy" in p for p in prefill):
        summary["straggler_ratio_policy"] = round(sum(p["straggler_ratio_policy"] for p in prefill) / len(layers), 4)
        summary["dropped_fraction"] = round(sum(p["dropped_fraction"] for p in prefill) / len(layers), 6)
    return {"summary": summary, "warnings": [], "plots": plots}


SPEC = PassSpec(
    "routing_report", RoutingReportConfig, routing_report, needs={"io_sample"}, summarize=_summarize,
    report_only=True,
)  # fmt: skip
