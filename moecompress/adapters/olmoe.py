"""OLMoE: ``mlp.experts.<e>.{gate,up,down}_proj``, router ``mlp.gate``; softmax -> top-k, renormalised
iff ``norm_topk_prob`` (default false). Expert width is ``intermediate_size``; every layer is MoE."""

from __future__ import annotations

from moecompress.adapters.base import PerExpertAdapter
from moecompress.ir import Gating, RouterSpec


class OlmoeAdapter(PerExpertAdapter):
    model_type = "olmoe"
    count_key = "num_experts"
    width_key = "intermediate_size"

    def router_spec(self, num_experts: int | None = None) -> RouterSpec:
        return RouterSpec(
            num_experts=num_experts or self.num_experts,
            top_k=int(self.config.num_experts_per_tok),
            gating=Gating.SOFTMAX_TOPK,
            norm_topk=bool(self.config.norm_topk_prob),
        )
