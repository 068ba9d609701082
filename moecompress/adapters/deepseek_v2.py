"""DeepSeek-V2: layers ``i >= first_k_dense_replace`` are MoE; ``mlp.experts.<e>.*``, router
``mlp.gate`` (fp32), shared experts ``mlp.shared_experts.*`` of width ``moe_intermediate_size *
n_shared_experts``, added unweighted. Softmax over all experts, ``greedy`` top-k or
``group_limited_greedy`` (group score = best expert in the group), no renormalisation (transformers 5),
times ``routed_scaling_factor``."""

from __future__ import annotations

from moecompress.adapters.base import PerExpertAdapter
from moecompress.errors import AdapterError
from moecompress.ir import Gating, GroupScore, RouterSpec


class DeepseekV2Adapter(PerExpertAdapter):
    model_type = "deepseek_v2"
    count_key = "n_routed_experts"
    width_key = "moe_intermediate_size"
    shared_name = "shared_experts"
    stock_width_change = False  # the shared experts' width is moe_intermediate_size * n_shared_experts

    def __init__(self, config) -> None:
        super().__init__(config)
        if getattr(config, "mlp_bias", False):
            raise AdapterError(f"{self.model_type}: mlp_bias=true is not supported")
        if not getattr(config, "n_shared_experts", 0):
            raise AdapterError(f"{self.model_type}: n_shared_experts must be >= 1")

    @property
    def shared_width(self) -> int:
        return int(self.config.moe_intermediate_size) * int(self.config.n_shared_experts)

    def is_moe_layer(self, i: int) -> bool:
        return int(self.config.first_k_dense_replace) <= i < self.num_layers

    def router_spec(self, num_experts: int | None = None) -> RouterSpec:
        cfg = self.config
        method = getattr(cfg, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise AdapterError(
                f"{self.model_type}: topk_method={method!r} is not supported; "
                "expected 'greedy' or 'group_limited_greedy'"
            )
        grouped = method == "group_limited_greedy"
        return RouterSpec(
            num_experts=num_experts or self.num_experts,
            top_k=int(cfg.num_experts_per_tok),
            gating=Gating.SOFTMAX_TOPK,
            norm_topk=False,
            routed_scale=float(cfg.routed_scaling_factor),
            n_group=int(cfg.n_group) if grouped else None,
            topk_group=int(cfg.topk_group) if grouped else None,
            group_score=GroupScore.MAX if grouped else None,
        )
