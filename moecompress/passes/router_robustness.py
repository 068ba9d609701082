"""``router_robustness``: how stable and how fragile is each MoE layer's routing? (report only)

Two measurements on the ``io_sample`` tokens (the base model's MoE inputs), formulas in
:mod:`moecompress.methods.robustness`:

- **Stability against the base** (MoEEdit's routing-stability metrics): top-k Jaccard and router KL
  between the routing of the layer *as the recipe has made it so far* and the base router's logits on the
  same tokens (``router_sample``, collected from the input checkpoint). When earlier steps removed or
  collapsed experts, each current expert is matched to the base router column its logits equal
  (nearest, reported as ``match_error``; exact for rows that were kept) and KL is taken over the kept
  experts (base distribution renormalised on them). Place the step after each step of a recipe to get
  the metrics after every step.
  These are the base model's MoE inputs, so steps that change only experts (heapr, namex with remap,
  decompositions) show Jaccard 1 / KL 0 here; the routing drift on the compressed model's own inputs is
  measured by ``benchmarks/quality.py --drift`` (:func:`~moecompress.methods.robustness.logit_stability`;
  the statistic this step would need for it, ``router_sample_base``, is described in docs/analysis.md).
- **Robustness** (TLGA-style router attack): for each ``epsilons`` value, bounded perturbations
  ``‖δ_t‖ ≤ ε‖x_t‖`` of the MoE inputs maximising the routing change by gradient ascent on the router
  margin (``steps``), and the top-k Jaccard / router KL / flipped-token share between clean and
  attacked routing of the *current* router. Run the step first (base) and last (compressed) to compare.

Statistics: ``io_sample``, ``router_sample`` (forward). Cost: ``steps`` router forward+backward passes
on ``calibration.sample_tokens`` tokens per epsilon (the router only: ``T·E·H`` each).

Example steps::

    steps:
      - router_robustness: {epsilons: [0.05, 0.1]}
      - heapr: {ratio: 0.5}
      - router_robustness: {epsilons: [0.05, 0.1]}
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.ir import Gating, MoELayer
from moecompress.methods.robustness import probe, router_kl, topk_jaccard
from moecompress.reference import route, router_logits


class RouterRobustnessConfig(PassConfig):
    epsilons: tuple[float, ...] = Field((0.0, 0.05, 0.1), description="relative L2 budgets of the attack")
    steps: int = Field(10, ge=1, le=200, description="gradient-ascent steps per epsilon")

    @field_validator("epsilons")
    @classmethod
    def _non_negative(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 <= e < 10 for e in v):
            raise ValueError("epsilons must lie in [0, 10)")
        return v


def selection_scores(layer: MoELayer):
    """``x -> (logits, selection scores)`` of the layer's router, differentiable (group limits ignored)."""

    def scores(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(layer, x)
        g = layer.router.gating
        s = (
            logits.softmax(-1)
            if g is Gating.SOFTMAX_TOPK
            else logits.sigmoid()
            if g is Gating.SIGMOID
            else logits
        )
        return logits, s if layer.score_bias is None else s + layer.score_bias.float()

    return scores


def _stability(layer: MoELayer, x: torch.Tensor, base: torch.Tensor) -> dict:
    with torch.no_grad():
        cur = router_logits(layer, x)
        ids = route(layer, x)[0]
    e_base, e_cur = base.shape[1], cur.shape[1]
    if e_cur == e_base:
        mapping, err = torch.arange(e_cur), 0.0
    else:  # experts removed / collapsed: match every current column to the base column it equals
        d = torch.cdist(cur.T.double(), base.T.double())
        mapping = d.argmin(1)
        err = float(d.min(1).values.max() / base.norm(dim=0).max().clamp_min(1e-30))
    k = ids.shape[1]
    base_ids = base.topk(min(k, e_base), dim=-1).indices
    return {
        "jaccard": float(topk_jaccard(base_ids, mapping[ids]).mean()),
        "kl": float(router_kl(base[:, mapping], cur).mean()),
        "experts_compared": e_cur,
        "match_error": err,
    }


def router_robustness(
    layer: MoELayer, stats: LayerStats, cfg: RouterRobustnessConfig
) -> tuple[MoELayer, dict]:
    """Report routing stability against the base router and routing change under a bounded attack."""
    x = stats["io_sample_x"].float()
    base = stats["router_sample"].float()[: len(x)]
    info = {"tokens": int(x.shape[0]), "stability": _stability(layer, x, base)}
    scores = selection_scores(layer)
    ids = lambda t: route(layer, t)[0]  # noqa: E731
    info["attack"] = {str(e): probe(scores, ids, x, layer.router.top_k, e, cfg.steps) for e in cfg.epsilons}
    return layer, info


def _summarize(infos: dict[int, dict], cfg: RouterRobustnessConfig) -> dict:
    layers = sorted(infos)

    def mean(f) -> float:
        return sum(f(infos[i]) for i in layers) / max(len(layers), 1)

    return {
        "summary": {
            "stability_jaccard": mean(lambda r: r["stability"]["jaccard"]),
            "stability_kl": mean(lambda r: r["stability"]["kl"]),
            "attack": {str(e): {k: mean(lambda r, e=e, k=k: r["attack"][str(e)][k]) for k in ("jaccard", "kl", "flipped")}
                       for e in cfg.epsilons},
            "per_layer_jaccard": {str(i): infos[i]["stability"]["jaccard"] for i in layers},
        },
        "warnings": [],
    }  # fmt: skip


SPEC = PassSpec(
    "router_robustness", RouterRobustnessConfig, router_robustness, needs={"io_sample", "router_sample"},
    summarize=lambda i, c: _summarize(i, c), report_only=True,
)  # fmt: skip
