"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B): Qwen3-MoE's names and layer rule plus one shared expert
``mlp.shared_expert.*`` (width ``shared_expert_intermediate_size``) scaled by
``sigmoid(mlp.shared_expert_gate @ x)``."""

from __future__ import annotations

from moecompress.adapters.qwen3_moe import Qwen3MoeAdapter


class Qwen2MoeAdapter(Qwen3MoeAdapter):
    model_type = "qwen2_moe"
    shared_name = "shared_expert"
    shared_gate_name = "shared_expert_gate"

    @property
    def shared_width(self) -> int:
        return int(self.config.shared_expert_intermediate_size)
