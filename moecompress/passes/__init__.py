"""Recipe steps, one file each; :data:`BUILTIN_PASSES` is the explicit table of them.

A pass module defines its configuration, its pure function ``(layer, stats, cfg) -> (layer, info)`` and
one :class:`~moecompress.engine.spec.PassSpec` named ``SPEC``. To add a built-in pass, write the module
and add its ``SPEC`` below; a plugin passes its spec to ``moecompress.apply(..., passes=[SPEC])``.
``neuron_pruning`` and ``expert_merging`` hold what two passes each share (options, checks, reports).
Whole-model stages (``distill``: a spec with a ``stage``) are listed in :data:`BUILTIN_STAGES`.
"""

from __future__ import annotations

from moecompress.engine.spec import PassSpec
from moecompress.passes import (
    ablate,
    analyze,
    attribute_routing,
    capacity_drop,
    choose_groups,
    codequant,
    decompose,
    distill,
    expert_prune,
    expert_structure,
    gptq,
    heapr,
    identity,
    lora_heal,
    merge_experts,
    namex,
    neuron_prune,
    router_robustness,
    routing_report,
    rtn,
    sere,
    super_experts,
    svd_experts,
    tdmoe,
)

BUILTIN_PASSES: dict[str, PassSpec] = {
    spec.name: spec
    for spec in (
        identity.SPEC,
        analyze.SPEC,
        super_experts.SPEC,
        ablate.SPEC,
        heapr.SPEC,
        neuron_prune.SPEC,
        expert_prune.SPEC,
        tdmoe.SPEC,
        svd_experts.SPEC,
        expert_structure.SPEC,
        decompose.SPEC,
        codequant.SPEC,
        rtn.SPEC,
        gptq.SPEC,
        namex.SPEC,
        merge_experts.SPEC,
        choose_groups.SPEC,
        capacity_drop.SPEC,
        sere.SPEC,
        routing_report.SPEC,
        attribute_routing.SPEC,
        router_robustness.SPEC,
    )
}
"""Every built-in recipe step, by name."""

BUILTIN_STAGES: dict[str, PassSpec] = {spec.name: spec for spec in (distill.SPEC, lora_heal.SPEC)}
"""Every built-in whole-model stage (a step that trains the whole model; see docs/training.md), by name."""

__all__ = ["BUILTIN_PASSES", "BUILTIN_STAGES"]
