"""Mixtral: ``block_sparse_moe.experts.<e>.w1/w3/w2`` (gate/up/down) on disk, ``mlp`` in memory;
softmax over all experts (fp32) -> top-k -> renormalise. Every layer is MoE."""

from __future__ import annotations

from moecompress.adapters.base import PerExpertAdapter
from moecompress.ir import Gating, RouterSpec


class MixtralAdapter(PerExpertAdapter):
    model_type = "mixtral"
    count_key = "num_local_experts"
    width_key = "intermediate_size"
    disk_block = "block_sparse_moe"
    proj = ("w1", "w3", "w2")

    def router_spec(self, num_experts: int | None = None) -> RouterSpec:
        return RouterSpec(
            num_experts=num_experts or self.num_experts,
            top_k=int(self.config.num_experts_per_tok),
            gating=Gating.SOFTMAX_TOPK,
            norm_topk=True,
        )
