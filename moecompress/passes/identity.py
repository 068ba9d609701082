"""``identity``: returns every layer unchanged.

What it is for: proving that the pipeline (read -> canonical layer -> write) is lossless; its output
tensors are byte-identical to the input and the checkpoint loads in transformers unchanged.

Formula: ``layer' = layer``. Statistics needed: none. Cost: one streaming pass.

Example step::

    steps:
      - identity: {}
"""

from __future__ import annotations

from moecompress.engine.spec import Chunking, LayerStats, PassConfig, PassSpec
from moecompress.ir import MoELayer


class IdentityConfig(PassConfig):
    """No settings."""


def identity(layer: MoELayer, stats: LayerStats, cfg: IdentityConfig) -> tuple[MoELayer, dict]:
    """Return the layer unchanged (lossless pipeline check)."""
    return layer, {}


SPEC = PassSpec("identity", IdentityConfig, identity, chunking=Chunking("select"), alters=frozenset())
