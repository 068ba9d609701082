"""``identity``: returns every layer unchanged.

What it is for: proving that the pipeline (read -> canonical layer -> write) is lossless; its output
tensors are byte-identical to the input and the checkpoint loads in transformers unchanged.

Formula: ``layer' = layer``. Statistics needed: none. Cost: one streaming pass.

Example step::

    steps:
      - identity: {}
"""

from __future__ import annotations

from moecompress.ir import MoELayer
from moecompress.registry import LayerStats, PassConfig, register_pass


class IdentityConfig(PassConfig):
    """No settings."""


@register_pass("identity", IdentityConfig, modifies_experts=False)
def identity(layer: MoELayer, stats: LayerStats, cfg: IdentityConfig) -> tuple[MoELayer, dict]:
    """Return the layer unchanged (lossless pipeline check)."""
    return layer, {}
