"""DeepSeek-V3 (also Kimi-K2/Moonlight layouts): DeepSeek-V2's names plus the selection-only
``mlp.gate.e_score_correction_bias``. Sigmoid scores; experts are chosen on scores + bias inside the
``topk_group`` best of ``n_group`` groups (group score = sum of its two best biased scores); weights
are the unbiased scores, renormalised iff ``norm_topk_prob``, times ``routed_scaling_factor``.
MTP layers past ``num_hidden_layers`` are not MoE layers here and are copied through."""

from __future__ import annotations

from moecompress.adapters.deepseek_v2 import DeepseekV2Adapter
from moecompress.ir import Gating, GroupScore, RouterSpec


class DeepseekV3Adapter(DeepseekV2Adapter):
    model_type = "deepseek_v3"
    has_score_bias = True

    def router_spec(self, num_experts: int | None = None) -> RouterSpec:
        cfg = self.config
        grouped = cfg.n_group is not None
        return RouterSpec(
            num_experts=num_experts or self.num_experts,
            top_k=int(cfg.num_experts_per_tok),
            gating=Gating.SIGMOID,
            norm_topk=bool(cfg.norm_topk_prob),
            routed_scale=float(cfg.routed_scaling_factor),
            n_group=int(cfg.n_group) if grouped else None,
            topk_group=int(cfg.topk_group) if grouped else None,
            group_score=GroupScore.TOP2_SUM if grouped else None,
        )
