"""moecompress: compress Hugging Face Mixture-of-Experts checkpoints, layer by layer.

Public API (importing this package never loads weights and never imports triton)::

    import moecompress as mc
    ckpt = mc.open_checkpoint("path/or/hub-id")
    layer = ckpt.read_layer(ckpt.moe_layer_indices[0])
    y = mc.moe_forward(layer, x)          # x: [T, H]
"""

from __future__ import annotations

from moecompress.errors import (
    AdapterError,
    CheckpointError,
    LayoutError,
    MoecompressError,
    OutputExistsError,
)
from moecompress.io.checkpoint import Checkpoint, open_checkpoint, rewrite_checkpoint
from moecompress.ir import Act, ExpertBank, Gating, GroupScore, MoELayer, RouterSpec
from moecompress.layouts import Dense, Layout
from moecompress.reference import moe_forward, route

__version__ = "0.1.0"

__all__ = [
    "Act",
    "AdapterError",
    "Checkpoint",
    "CheckpointError",
    "Dense",
    "ExpertBank",
    "Gating",
    "GroupScore",
    "Layout",
    "LayoutError",
    "MoELayer",
    "MoecompressError",
    "OutputExistsError",
    "RouterSpec",
    "__version__",
    "moe_forward",
    "open_checkpoint",
    "rewrite_checkpoint",
    "route",
]
