"""Compression passes, one file each, registered in :mod:`moecompress.registry` on import.

Add a pass by creating a module here and importing it below.
"""

from moecompress.passes import (
    ablate,
    analyze,
    codequant,
    expert_prune,
    heapr,
    identity,
    merge_experts,
    namex,
    neuron_prune,
    rtn,
    super_experts,
    svd_experts,
    tdmoe,
)

__all__ = [
    "ablate",
    "analyze",
    "codequant",
    "expert_prune",
    "heapr",
    "identity",
    "merge_experts",
    "namex",
    "neuron_prune",
    "rtn",
    "super_experts",
    "svd_experts",
    "tdmoe",
]
