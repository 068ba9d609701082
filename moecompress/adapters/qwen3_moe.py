"""Qwen3-MoE: ``mlp.experts.<e>.{gate,up,down}_proj``, router ``mlp.gate``; softmax -> top-k,
renormalised iff ``norm_topk_prob``. Layer ``i`` is MoE iff ``i`` is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``. The Hub writes ``num_experts``; transformers 5 writes
``num_local_experts`` (an alias of the same attribute)."""

from __future__ import annotations

from moecompress.adapters.base import PerExpertAdapter
from moecompress.ir import Gating, RouterSpec


class Qwen3MoeAdapter(PerExpertAdapter):
    model_type = "qwen3_moe"
    count_key = "num_experts"
    width_key = "moe_intermediate_size"

    def is_moe_layer(self, i: int) -> bool:
        cfg = self.config
        return (
            0 <= i < self.num_layers
            and i not in (cfg.mlp_only_layers or [])
            and self.num_experts > 0
            and (i + 1) % cfg.decoder_sparse_step == 0
        )

    def router_spec(self, num_experts: int | None = None) -> RouterSpec:
        return RouterSpec(
            num_experts=num_experts or self.num_experts,
            top_k=int(self.config.num_experts_per_tok),
            gating=Gating.SOFTMAX_TOPK,
            norm_topk=bool(self.config.norm_topk_prob),
        )
