"""Routing policies applied while the model runs (``docs/routing.md``).

Each MoE block with a policy gets a child module :class:`RoutingPolicy` at ``<block>.routing`` (where
SERE's similarity tensor is loaded from, by name). It rewrites the routing between transformers' router
and experts with three forward hooks on that block instance (PyTorch's hook API; no class is patched):
the block's pre-hook reads the batch shape ``[B, S]``, the router's hook keeps its logits (the
probabilities that ``capacity_drop`` ranks by), and the experts module's pre-hook replaces
``(top_k_index, top_k_weights)`` by :func:`moecompress.methods.routing.apply_policy`'s. A dropped slot is
expert id ``E``, which transformers' experts modules (every implementation) and moecompress's
:class:`~moecompress.runtime.quantizer.CompressedExperts` skip.

A checkpoint that stores a policy loads it through the moecompress quantizer (``import moecompress``;
``AutoModelForCausalLM.from_pretrained`` or :func:`moecompress.load`); ``set_routing`` switches
policies off, changes their knobs or adds a capacity policy to any loaded model for an experiment.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from moecompress.errors import RoutingError
from moecompress.io.routing import SIMILARITY, parse_policy, policy_dict, read_routing
from moecompress.methods.routing import apply_policy, fill_dropped, loads, router_probs, straggler_ratio

ATTR = "routing"


class RoutingPolicy(nn.Module):
    """The policy of one MoE block; ``record=True`` accumulates :attr:`counts` (slots, dropped,
    re-routed, experts per batch) and the per-expert loads before/after, for measurements."""

    def __init__(self, policy: dict, *, router_spec, protected=(), stored_similarity: bool = False) -> None:
        super().__init__()
        self.policy = policy
        self.num_experts, self.top_k, self.gating = router_spec.num_experts, router_spec.top_k, router_spec.gating
        # explicit CPU tensors, not buffers: transformers builds the model (and calls the quantizer that
        # makes this module) under a meta-device context, and would fill meta buffers with garbage
        self.protected_mask = torch.zeros(self.num_experts, dtype=torch.bool, device="cpu")
        self.protected_mask[sorted(int(e) for e in protected)] = True
        if stored_similarity:  # the checkpoint holds it: transformers fills this meta buffer by name
            self.register_buffer(SIMILARITY, torch.empty(self.num_experts, self.num_experts, device="meta"))
        self.record = False
        self.counts: Counter = Counter()
        self.loads_before = torch.zeros(self.num_experts, dtype=torch.long, device="cpu")
        self.loads_after = torch.zeros(self.num_experts, dtype=torch.long, device="cpu")
        self._shape: tuple[int, int] = (1, 1)
        self._probs: torch.Tensor | None = None
        self._handles: list = []

    @property
    def stored_similarity(self) -> torch.Tensor | None:
        return getattr(self, SIMILARITY, None)

    def attach(self, block: nn.Module, router: nn.Module, experts: nn.Module) -> None:
        self._handles = [
            block.register_forward_pre_hook(self._on_block, with_kwargs=True),
            router.register_forward_hook(self._on_router),
            experts.register_forward_pre_hook(self._on_experts, with_kwargs=True),
        ]

    def reset_counts(self) -> None:
        self.counts.clear()
        self.loads_before.zero_()
        self.loads_after.zero_()

    # -- hooks -------------------------------------------------------------------------------------
    def _on_block(self, module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            s = int(x.shape[-2]) if x.dim() >= 3 else int(x.shape[0])
            b = int(x.numel() // (x.shape[-1] * s)) if s else 1
            self._shape = (b, s)
        return None

    def _on_router(self, module, args, output):
        if self.policy.get("capacity_drop"):
            logits = output[0] if isinstance(output, tuple) else output
            self._probs = router_probs(logits.reshape(-1, self.num_experts), self.gating)
        return None

    def _on_experts(self, module, args, kwargs):
        if not self.policy:
            return None
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = list(args) + [kwargs.pop(n) for n in names[len(args) :] if n in kwargs]
        if len(values) < 3:
            return None
        hidden, ids, weights = values[:3]
        probs, self._probs = self._probs, None
        if probs is not None and probs.shape[0] != ids.shape[0]:
            probs = None
        sim = self.stored_similarity
        b, s = self._shape
        if b * s != ids.shape[0]:  # experts called without their block (no batch shape seen): one sequence
            self._shape = (1, int(ids.shape[0]))
        new_ids, new_w, c = apply_policy(
            self.policy, ids, weights, probs, num_experts=self.num_experts, top_k=self.top_k, batch_shape=self._shape,
            similarity=None if sim is None else sim.to(ids.device), protected=self.protected_mask.to(ids.device),
        )  # fmt: skip
        if self.record:
            self.counts.update(c)
            self.counts["forwards"] += 1
            self.loads_before += loads(ids, self.num_experts).cpu()
            self.loads_after += loads(new_ids, self.num_experts).cpu()
            if self._shape[1] > 1:  # a prefill: how long its busiest expert runs against an average one
                self.counts["prefills"] += 1
                self.counts["straggler_before"] += straggler_ratio(ids, self.num_experts)
                self.counts["straggler_after"] += straggler_ratio(new_ids, self.num_experts)
        if not _skips_dropped(module):
            new_ids, new_w = fill_dropped(new_ids, new_w, self.num_experts)
        return (hidden, new_ids, new_w.to(weights.dtype), *values[3:]), kwargs


def _skips_dropped(experts: nn.Module) -> bool:
    """Whether ``experts`` skips slot id ``E``: moecompress's modules and transformers' ``eager`` loop do;
    its ``grouped_mm`` / ``batched_mm`` do so only under expert parallelism."""
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    return impl in (None, "eager")


def _moe_modules(model, adapter, i: int) -> tuple[nn.Module, nn.Module, nn.Module]:
    block = getattr(model.model.layers[i], adapter.module_attr)
    return block, getattr(block, adapter.router_module), block.experts


def attach_stored(model, adapter, block: dict | None) -> None:
    """Give every layer with a stored policy its :class:`RoutingPolicy` (before weights load)."""
    protected = (block or {}).get("protected") or {}
    for i, policy in read_routing(block).items():
        add_policy(model, adapter, i, policy_dict(policy), protected.get(str(i), ()),
                   stored_similarity="sere" in policy)  # fmt: skip


def add_policy(model, adapter, i: int, policy: dict, protected=(), *, stored_similarity: bool = False) -> RoutingPolicy:
    block, router, experts = _moe_modules(model, adapter, i)
    module = RoutingPolicy(policy, router_spec=adapter.router_spec(), protected=protected,
                           stored_similarity=stored_similarity)  # fmt: skip
    setattr(block, ATTR, module)
    module.attach(block, router, experts)
    return module


def policies(model) -> dict[int, RoutingPolicy]:
    """The routing-policy modules of a loaded model, by layer."""
    out = {}
    for i, layer in enumerate(getattr(getattr(model, "model", None), "layers", [])):
        for child in layer.children():
            module = getattr(child, ATTR, None)
            if isinstance(module, RoutingPolicy):
                out[i] = module
    return out


def set_routing(model, routing: Any) -> dict[int, dict]:
    """Switch a loaded model's policies: ``False`` / ``"off"`` turns every policy off (plain top-k);
    ``True`` / ``"stored"`` keeps what the checkpoint stores; a mapping ``{"capacity_drop": {...},
    "sere": {...}}`` sets those knobs on every MoE layer (over the stored ones; a kind given as
    ``None`` is removed). Returns the policies now in force by layer."""
    from moecompress.adapters import adapter_class

    mods = policies(model)
    if routing in (None, True, "stored"):
        return {i: m.policy for i, m in mods.items() if m.policy}
    if routing in (False, "off"):
        for m in mods.values():
            m.policy = {}
        return {}
    if not isinstance(routing, dict):
        raise RoutingError(f"routing={routing!r}: give 'off', 'stored' or a mapping such as {{'capacity_drop': {{'gamma': 1.5}}}}")
    removed = {k for k, v in routing.items() if v is None}
    try:
        given = parse_policy({k: v for k, v in routing.items() if v is not None}, "routing")
    except ValueError as err:
        raise RoutingError(str(err)) from None
    adapter = adapter_class(model.config.model_type)(model.config)
    protected = ((getattr(model.config, "moecompress", None) or {}).get("protected") or {})
    out = {}
    for i in adapter.moe_layer_indices:
        m = mods.get(i) or add_policy(model, adapter, i, {}, protected.get(str(i), ()))
        merged = {k: dict(v) for k, v in m.policy.items() if k not in removed}
        for kind, knobs in given.items():
            merged[kind] = {**merged.get(kind, {}), **knobs.model_dump(mode="json", exclude_unset=True)}
            merged[kind] = policy_dict(parse_policy({kind: merged[kind]}, f"routing (layer {i})"))[kind]
        if "sere" in merged and m.stored_similarity is None:
            raise RoutingError(
                f"layer {i} stores no SERE similarity; run a `sere` step on the checkpoint to compute it"
            )
        m.policy = merged
        out[i] = merged
    return out
