"""``RunContext``: what a run computes with (dtype, device, seed, progress bars), decided once.

No module reads global settings: the executor builds one context from the recipe and the checkpoint
and hands it to what needs it; environment variables are read only in ``cli.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecompress.engine.recipe import Recipe
from moecompress.io.checkpoint import Checkpoint


@dataclass(frozen=True)
class RunContext:
    """``dtype``: compute dtype of calibration and of the reconstruction errors; ``device``: where
    they run; ``seed``: the calibration seed; ``progress``: whether to show progress bars."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    progress: bool = True

    @classmethod
    def for_recipe(cls, recipe: Recipe, ckpt: Checkpoint, *, progress: bool = True) -> RunContext:
        return cls(dtype=compute_dtype(recipe, ckpt), seed=recipe.calibration.seed, progress=progress)


def compute_dtype(recipe: Recipe, ckpt: Checkpoint) -> torch.dtype:
    """``calibration.dtype``, or under ``auto`` the dtype of the first routed-expert tensor on disk
    (float32 when that is not a floating-point dtype, as in quantised releases)."""
    name = recipe.calibration.dtype
    if name != "auto":
        return getattr(torch, name)
    first = ckpt.moe_keys(ckpt.moe_layer_indices[0])[0]
    dtype = ckpt.reader.torch_dtype(first)
    return dtype if dtype.is_floating_point else torch.float32
