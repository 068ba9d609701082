"""``sere``: store a SERE re-routing policy (arXiv 2602.07616) and its expert similarity.

Offline (this step): every expert runs on the same calibration MoE inputs ``X`` (the first ``tokens`` of
``io_sample``); ``A_i = E_i(X)``; the similarity ``S`` (``E x E``, diagonal 1) is ``cosine`` of the
flattened outputs (our default), ``frobenius`` ``1 - ||A_p - A_q||_F / max ||A_p - A_q||_F`` (the
paper's default; ``docs/routing.md`` shows why it is not ours) or linear ``cka``, for the
logical experts (merged experts share their physical expert's outputs). ``S`` is stored as a float32
tensor and the knobs in ``config.json["moecompress"]["routing"]``; the weights are untouched.

Online (the moecompress runtime, single-token decode only): a batch's primary experts are the union of
its tokens' top-``select_top``; each other selected expert ``u`` sends its tokens to
``v* = argmax_{v primary} S[u, v]`` with their weights when ``S[u, v*] >= threshold``, else runs (a
critical expert). Protected (super) experts always run. Maths: :mod:`moecompress.methods.routing`.

Statistics needed: ``io_sample``. Cost: ``E`` expert evaluations on ``tokens`` tokens per layer.

Example step::

    steps:
      - sere: {select_top: 2, threshold: 0.1, similarity: cosine}
"""

from __future__ import annotations

import torch
from pydantic import Field

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.io.routing import SerePolicy
from moecompress.ir import MoELayer
from moecompress.methods.routing import expert_similarity
from moecompress.reference import expert_forward


class SereConfig(SerePolicy, PassConfig):
    """The knobs of :class:`~moecompress.io.routing.SerePolicy`, and how many tokens measure ``S``."""

    tokens: int = Field(512, ge=2, description="calibration MoE inputs each expert runs on (from io_sample)")


def _knobs(cfg: SereConfig) -> dict:
    """The stored policy: the config without the compress-time ``tokens``."""
    return SerePolicy(**cfg.model_dump(exclude={"tokens"})).model_dump(mode="json")


def logical_outputs(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """``[E_logical, N, H]`` fp32: every router expert's output on ``x`` (a merged expert's physical one)."""
    bank = layer.experts
    phys = torch.stack([expert_forward(bank, p, x).float() for p in range(bank.num_experts)])
    return phys if layer.expert_map is None else phys[layer.expert_map.long()]


def sere(layer: MoELayer, stats: LayerStats, cfg: SereConfig) -> tuple[MoELayer, dict]:
    """Compute the expert similarity and attach the SERE policy (weights unchanged)."""
    x = stats["io_sample_x"][: cfg.tokens]
    x = x.to(layer.router_weight.dtype if layer.router_weight.is_floating_point() else torch.float32)
    s = expert_similarity(logical_outputs(layer, x), cfg.similarity)
    knobs = _knobs(cfg)
    routing = {**(layer.routing or {}), "sere": knobs}
    off = s[~torch.eye(s.shape[0], dtype=torch.bool)]
    info = {
        "policy": knobs,
        "tokens": int(x.shape[0]),
        "similarity_mean": round(float(off.mean()), 6) if off.numel() else 1.0,
        "similarity_max": round(float(off.max()), 6) if off.numel() else 1.0,
        "pairs_at_threshold": int((off >= cfg.threshold).sum()) // 2,
        "similarity": [[round(float(v), 4) for v in row] for row in s],
    }
    return layer.replace(routing=routing, routing_similarity=s), info


def _emits(layer: MoELayer, cfg: SereConfig) -> MoELayer:
    e = layer.router.num_experts
    knobs = _knobs(cfg)
    sim = torch.empty(e, e, device="meta")
    return layer.replace(routing={**(layer.routing or {}), "sere": knobs}, routing_similarity=sim)


def _summarize(infos: dict[int, dict], cfg: SereConfig) -> dict:
    layers = sorted(infos)
    warnings = []
    if layers and all(infos[i]["pairs_at_threshold"] == 0 for i in layers):
        warnings.append(
            f"no pair of experts reaches threshold {cfg.threshold} in any layer: SERE will re-route nothing "
            "(lower the threshold)"
        )
    return {
        "summary": {"layers": len(layers), "mean_similarity": [infos[i]["similarity_mean"] for i in layers]},
        "warnings": warnings,
        "plots": [
            {
                "file": f"similarity_layer{i}.png",
                "kind": "heatmap",
                "title": f"SERE expert similarity ({cfg.similarity}), layer {i}",
                "data": infos[i]["similarity"],
                "xlabel": "expert",
                "ylabel": "expert",
            }
            for i in layers[:4]
        ],
    }


SPEC = PassSpec(
    "sere", SereConfig, sere, needs={"io_sample"}, emits=_emits, summarize=_summarize, alters=frozenset()
)
