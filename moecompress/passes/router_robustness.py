"""``router_robustness``: how stable and how fragile is each MoE layer's routing? (report only)

Three measurements on the ``io_sample`` tokens, formulas in :mod:`moecompress.methods.robustness`:

- **Stability against the base** (MoEEdit's routing-stability metrics): top-k Jaccard and router KL
  between the routing of the layer *as the recipe has made it so far* and the base router's logits on the
  same tokens (``router_sample``, collected from the input checkpoint). When earlier steps removed or
  collapsed experts, each current expert is matched to the base router column its logits equal
  (nearest, reported as ``match_error``; exact for rows that were kept) and KL is taken over the kept
  experts (base distribution renormalised on them). Place the step after each step of a recipe to get
  the metrics after every step.
  Under ``calibration.propagate: original`` these are the base model's MoE inputs, so steps that change
  only experts (heapr, namex with remap, decompositions) show Jaccard 1 / KL 0 here.
- **Drift** (the routing drift on the compressed model's own inputs): ``logit_stability(router_sample_base,
  router_logits(layer, io_sample_x), top_k, mapping)`` (:func:`~moecompress.methods.robustness.logit_stability`:
  top-k Jaccard of the logits and router KL over the kept experts), ``router_sample_base`` the input
  checkpoint's router logits on its *own* MoE inputs for the same tokens and ``mapping`` the column match
  above. Under ``calibration.propagate: compressed`` the ``io_sample`` inputs of layer ``ℓ`` come from the
  compressed layers ``< ℓ``, so this is ``benchmarks/quality.py --drift`` inside the recipe, per step;
  under ``original`` it equals the stability (the two inputs are the same).
- **Robustness** (TLGA-style router attack): for each ``epsilons`` value, bounded perturbations
  ``‖δ_t‖ ≤ ε‖x_t‖`` of the MoE inputs maximising the routing change by gradient ascent on the router
  margin (``steps``), and the top-k Jaccard / router KL / flipped-token share between clean and
  attacked routing of the *current* router. Run the step first (base) and last (compressed) to compare.

Statistics: ``io_sample``, ``router_sample``, ``router_sample_base`` (forward; the last costs a second
stream of the sample's batches through the unmodified layers under ``propagate: compressed``). Cost: ``steps`` router forward+backward passes
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
from moecompress.methods.robustness import logit_stability, probe, router_kl, topk_jaccard
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


def _match(cur: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(mapping, error)``: the base column each current router column reproduces on the same inputs."""
    if cur.shape[1] == base.shape[1]:
        return torch.arange(cur.shape[1]), 0.0
    d = torch.cdist(cur.T.double(), base.T.double())  # experts removed / collapsed: the nearest base column
    return d.argmin(1), float(d.min(1).values.max() / base.norm(dim=0).max().clamp_min(1e-30))


def _stability(layer: MoELayer, x: torch.Tensor, base: torch.Tensor) -> dict:
    with torch.no_grad():
        cur = router_logits(layer, x)
        ids = route(layer, x)[0]
    mapping, err = _match(cur, base)
    base_ids = base.topk(min(ids.shape[1], base.shape[1]), dim=-1).indices
    return {
        "jaccard": float(topk_jaccard(base_ids, mapping[ids]).mean()),
        "kl": float(router_kl(base[:, mapping], cur).mean()),
        "experts_compared": cur.shape[1],
        "match_error": err,
    }


def _drift(layer: MoELayer, x: torch.Tensor, same_inputs: torch.Tensor, base: torch.Tensor) -> dict:
    """The current routing on ``x`` against the input checkpoint's on its own inputs (``base``); columns
    matched on ``same_inputs`` (the input router on ``x``)."""
    with torch.no_grad():
        cur = router_logits(layer, x)
    mapping, _ = _match(cur, same_inputs)
    return logit_stability(base, cur, layer.router.top_k, mapping)


def router_robustness(
    layer: MoELayer, stats: LayerStats, cfg: RouterRobustnessConfig
) -> tuple[MoELayer, dict]:
    """Report routing stability against the base router and routing change under a bounded attack."""
    x = stats["io_sample_x"].float()
    base = stats["router_sample"].float()[: len(x)]
    info = {"tokens": int(x.shape[0]), "stability": _stability(layer, x, base)}
    info["drift"] = _drift(layer, x, base, stats["router_sample_base"].float()[: len(x)])
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
            "drift_jaccard": mean(lambda r: r["drift"]["jaccard"]),
            "drift_kl": mean(lambda r: r["drift"]["kl"]),
            "per_layer_drift_jaccard": {str(i): infos[i]["drift"]["jaccard"] for i in layers},
            "per_layer_drift_kl": {str(i): infos[i]["drift"]["kl"] for i in layers},
        },
        "warnings": [],
    }  # fmt: skip


SPEC = PassSpec(
    "router_robustness", RouterRobustnessConfig, router_robustness, needs={"io_sample", "router_sample", "router_sample_base"},
    summarize=lambda i, c: _summarize(i, c), report_only=True,
)  # fmt: skip
