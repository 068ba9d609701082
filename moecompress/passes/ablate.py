"""``ablate_experts``: zero the down projection of chosen experts (a diagnosis, as the Super Experts
paper does) so that ``moecompress eval`` measures what an expert is worth.

Formula: ``W_down[e] <- 0`` for every listed (layer, expert); the router is unchanged, so the expert is
still selected and simply contributes nothing. Statistics needed: none. Cost: one streaming pass.
Protected experts cannot be ablated (the protection contract fails the step): ablate before
``protect_super_experts`` or without it.

Example step::

    steps:
      - ablate_experts: {experts: [{layer: 1, experts: [3]}]}
"""

from __future__ import annotations

import dataclasses

from pydantic import Field

from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.errors import PassError
from moecompress.ir import MoELayer
from moecompress.layouts.dense import Dense


class AblateTarget(PassConfig):
    layer: int = Field(ge=0)
    experts: list[int] = Field(min_length=1)


class AblateConfig(PassConfig):
    experts: list[AblateTarget] = Field(min_length=1, description="which experts to zero, per layer")


def _check(layer: MoELayer, cfg: AblateConfig) -> None:
    for t in cfg.experts:
        if t.layer == layer.index and any(not 0 <= e < layer.router.num_experts for e in t.experts):
            raise PassError(f"experts {t.experts} out of range [0, {layer.router.num_experts})")
    if any(t.layer == layer.index for t in cfg.experts) and not isinstance(layer.experts.down, Dense):
        raise PassError(
            f"ablate_experts needs a dense down projection, got {layer.experts.down.kind!r}; ablate before "
            "pruning, decomposing or quantising"
        )


def ablate_experts(layer: MoELayer, stats: LayerStats, cfg: AblateConfig) -> tuple[MoELayer, dict]:
    """Zero the down projection of the listed experts (diagnosis)."""
    targets = sorted({e for t in cfg.experts if t.layer == layer.index for e in t.experts})
    if not targets:
        return layer, {"ablated": []}
    _check(layer, cfg)
    down = layer.experts.down.weight.clone()
    for e in targets:
        down[layer.physical(e)] = 0
    new_bank = dataclasses.replace(layer.experts, down=Dense(down))  # keeps widths, biases, rotation
    return layer.replace(experts=new_bank), {"ablated": targets}


SPEC = PassSpec("ablate_experts", AblateConfig, ablate_experts, check=_check, alters=frozenset({"weights"}))
