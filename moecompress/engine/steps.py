"""One step on one layer: the statistics view it may read, error messages that name it, and the
protection contract checked on its result."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from moecompress.engine import follow
from moecompress.engine.protection import RENUMBER_KEY, protection_violations
from moecompress.engine.recipe import Recipe, Step
from moecompress.engine.spec import LayerStats
from moecompress.errors import MoecompressError, PassError
from moecompress.ir import MoELayer, layer_to


def step_stats(
    step: Step, index: int, available: Mapping[str, torch.Tensor], *, plan: Any = None,
    protected: frozenset[int] = frozenset(), prelude: Any = None, first: int = 0, team: Any = None,
) -> LayerStats:  # fmt: skip
    """What ``step`` may read of layer ``index``'s statistics: exactly what it declared (``first``: a chunk's
    first expert in the step's input; ``team``: the units worked with it, ``LayerStats.team``)."""
    return LayerStats.view(index, available, step.needs, step=step.label, plan=plan, protected=protected,
                           prelude=prelude, first=first, team=team)  # fmt: skip


def run_step(step: Step, layer: MoELayer, stats: LayerStats) -> tuple[MoELayer, dict]:
    """One step on one layer, with errors that name the step and the layer; enforces the protection
    contract (:mod:`moecompress.engine.protection`)."""
    try:
        new, info = step.spec.fn(layer, stats, step.config)
    except MoecompressError as err:
        raise PassError(f"{step.label}, layer {layer.index}: {err}") from None
    if not isinstance(new, MoELayer) or not isinstance(info, dict):
        raise PassError(f"{step.label}: a pass must return (MoELayer, dict), got {type(new).__name__}")
    if step.spec.report_only:
        return layer, info
    broken = protection_violations(layer, new, info.get(RENUMBER_KEY))
    if broken:
        raise PassError(
            f"{step.label}, layer {layer.index}: {broken[0]} ({len(broken)} violation(s)); protected (super) "
            "experts must stay bit-identical: the pass must skip layer.protected"
        )
    return new, info


def compress_for_propagation(rec: Recipe, device: str = "cpu"):
    """``calibration.propagate: compressed``: the layer that the next layer's inputs come from (the
    steps run on the compute ``device``)."""

    def on_layer(i: int, layer: MoELayer, stats: dict[str, torch.Tensor]) -> MoELayer:
        dev = torch.device(device)
        layer = layer_to(layer, dev)
        follows = follow.follower(rec, stats, layer.router_weight.dtype)  # statistics follow the layer
        for n, step in enumerate(rec.steps):
            now = {k: v.to(dev) for k, v in follows.before(n, step, layer).items()}
            new, info = run_step(step, layer, step_stats(step, i, now))
            follows.after(step, layer, new, follow.split_kept(info)[1])
            layer = new
        return layer

    return on_layer
