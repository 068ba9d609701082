"""PhiMoE: Mixtral's on-disk names (``block_sparse_moe.experts.<e>.w1/w3/w2``, router
``block_sparse_moe.gate``; in memory ``mlp.router``) with SparseMixer routing. transformers hard-codes
two picks (``num_experts_per_tok`` is not used by the router), so the canonical top-k is always 2;
the relative margin is ``2 * router_jitter_noise``."""

from __future__ import annotations

from moecompress.adapters.base import PerExpertAdapter
from moecompress.errors import AdapterError
from moecompress.ir import Gating, RouterSpec


class PhimoeAdapter(PerExpertAdapter):
    model_type = "phimoe"
    count_key = "num_local_experts"
    width_key = "intermediate_size"
    disk_block = "block_sparse_moe"
    proj = ("w1", "w3", "w2")
    fused_router = "router"
    router_module = "router"

    def router_spec(self, num_experts: int | None = None) -> RouterSpec:
        if self.num_experts < 2:
            raise AdapterError("phimoe: SparseMixer routing needs at least 2 experts")
        return RouterSpec(
            num_experts=num_experts or self.num_experts,
            top_k=2,
            gating=Gating.SPARSEMIXER,
            jitter_eps=float(self.config.router_jitter_noise),
        )
