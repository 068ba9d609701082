"""``capacity_drop``: store a capacity-aware token-drop policy (arXiv 2503.05066) in the checkpoint.

Formula (applied by the moecompress runtime at every multi-token forward, never in single-token
decode): capacity ``C = ceil(gamma * k * T / E)`` for a batch of ``T`` tokens; an expert assigned more
than ``C`` (token, slot) pairs keeps the ``C`` ranked highest by ``strategy`` (``score``: the router
probability; ``random``; ``first`` / ``last`` by position; ``overselect``: ``k * rounds`` candidates per
token, then the cut) and its other slots become no-ops of weight 0. ``expanded: true`` is Expanded
Drop: candidates are the top-k plus ``local_experts`` and each expert keeps its top-``C`` candidates.
Protected (super) experts' slots are never dropped. The weights are not touched: the step only writes
the policy (``config.json["moecompress"]["routing"]``); ``mc.load(path, routing=...)`` changes or
switches it off. Maths: :mod:`moecompress.methods.routing`.

Statistics needed: none. Cost: none (a copy).

Example step::

    steps:
      - capacity_drop: {gamma: 1.5, strategy: score}
"""

from __future__ import annotations

import math

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.errors import PassError
from moecompress.io.routing import CapacityPolicy
from moecompress.ir import MoELayer


class CapacityDropConfig(CapacityPolicy, PassConfig):
    """The knobs of :class:`~moecompress.io.routing.CapacityPolicy`."""


def _check(layer: MoELayer, cfg: CapacityDropConfig) -> None:
    if not math.isfinite(cfg.gamma):
        raise PassError(f"gamma={cfg.gamma} stores no capacity; leave the capacity_drop step out instead")
    e = layer.router.num_experts
    if cfg.local_experts != "all":
        bad = [x for x in cfg.local_experts if not 0 <= x < e]
        if bad or not cfg.local_experts:
            raise PassError(f"local_experts {cfg.local_experts} must be expert ids in [0, {e}) (or 'all')")


def capacity_drop(layer: MoELayer, stats: LayerStats, cfg: CapacityDropConfig) -> tuple[MoELayer, dict]:
    """Attach the capacity policy to the layer (weights unchanged)."""
    _check(layer, cfg)
    knobs = CapacityPolicy(**cfg.model_dump()).model_dump(mode="json")
    routing = {**(layer.routing or {}), "capacity_drop": knobs}
    k, e = layer.router.top_k, layer.router.num_experts
    return layer.replace(routing=routing), {
        "policy": knobs,
        "capacity_per_1k_tokens": math.ceil(cfg.gamma * k * 1000 / e),
        "protected_never_dropped": sorted(layer.protected),
    }


SPEC = PassSpec("capacity_drop", CapacityDropConfig, capacity_drop, check=_check, alters=frozenset())
