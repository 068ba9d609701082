"""``choose_groups``: how many merge groups each MoE layer's experts form (FedGEM-style EM; report only).

Per layer, a tied isotropic Gaussian mixture over the unprotected experts' features (their outputs on
the first fit tokens of ``io_sample`` and their centred router-logit columns, scaled per block and
reduced to principal dimensions) is fitted by EM for every ``K`` and ``K`` is chosen by BIC
(:mod:`moecompress.methods.mixture`, :func:`moecompress.passes.expert_merging.choose_count`).

The decision it feeds: ``namex`` / ``merge_experts`` with ``target_experts: auto`` use exactly this
count per layer (they recompute it from the same tokens; no state passes between steps).

Statistics: ``io_sample`` (forward). Cost: one expert forward per expert on 64 tokens, EM on ``E`` points.

Example step::

    steps:
      - choose_groups: {}
"""

from __future__ import annotations

import torch

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.ir import MoELayer
from moecompress.passes.expert_merging import choose_count


class ChooseGroupsConfig(PassConfig):
    pass


def choose_groups(layer: MoELayer, stats: LayerStats, cfg: ChooseGroupsConfig) -> tuple[MoELayer, dict]:
    """Report the number of merge groups a Gaussian mixture with BIC finds in each layer's experts."""
    x = stats["io_sample_x"].float()
    with torch.no_grad():
        _, info = choose_count(layer, x[: (x.shape[0] + 1) // 2] if x.shape[0] > 1 else x)
    return layer, {**info, "experts": layer.router.num_experts}


def _summarize(infos: dict[int, dict], cfg: ChooseGroupsConfig) -> dict:
    layers = sorted(infos)
    return {"summary": {"groups": {str(i): infos[i]["groups"] for i in layers},
                        "experts": {str(i): infos[i]["experts"] for i in layers}}, "warnings": []}  # fmt: skip


SPEC = PassSpec(
    "choose_groups", ChooseGroupsConfig, choose_groups, needs={"io_sample"}, report_only=True,
    summarize=lambda i, c: _summarize(i, c),
)  # fmt: skip
