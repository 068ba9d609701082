"""``RunContext``: what a run computes with (dtype, device, seed, progress bars), decided once.

No module reads global settings: the executor builds one context from the recipe and the checkpoint
and hands it to what needs it; environment variables are read only in ``cli.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from moecompress.engine.distributed import SINGLE, Ranks
from moecompress.engine.recipe import Recipe
from moecompress.errors import RecipeError
from moecompress.io.checkpoint import Checkpoint


@dataclass(frozen=True)
class RunContext:
    """``dtype``: compute dtype of calibration and of the reconstruction errors; ``device``: where
    they run; ``seed``: the calibration seed; ``progress``: whether to show progress bars;
    ``expert_chunks``: MoE layer index -> experts per chunk, for the layers read, calibrated, compressed
    and written by chunks of experts (a layer not listed is held whole; the dry run's ``expert_chunk``);
    ``ranks``: this process among the ``torchrun`` ranks (:mod:`moecompress.engine.distributed`)."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    progress: bool = True
    expert_chunks: Mapping[int, int] = field(default_factory=dict)
    ranks: Ranks = SINGLE

    @classmethod
    def for_recipe(
        cls, recipe: Recipe, ckpt: Checkpoint, *, progress: bool = True, plan: Mapping | None = None,
        ranks: Ranks = SINGLE,
    ) -> RunContext:  # fmt: skip
        """The context of ``recipe`` on ``ckpt``; ``plan``: its dry run, whose ``expert_chunk`` lists the
        layers held by chunks (without one, every layer is held whole). ``ranks``: on CUDA, each rank
        computes on its own device (``cuda:LOCAL_RANK``)."""
        device = resolve_device(recipe.calibration.device)
        return cls(
            dtype=compute_dtype(recipe, ckpt),
            device=ranks.device if ranks.world_size > 1 and device != "cpu" else device,
            seed=recipe.calibration.seed,
            progress=progress and ranks.is_writer,
            ranks=ranks,
            expert_chunks={int(i): int(n) for i, n in ((plan or {}).get("expert_chunk") or {}).items()},
        )


def resolve_device(name: str) -> str:
    """``calibration.device`` as a concrete device: ``auto`` is ``cuda`` when PyTorch sees a CUDA device,
    else ``cpu``; an unavailable CUDA device is a :class:`RecipeError` (raised in the dry run)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(name.partition(":")[2] or 0)
    if index >= count:
        why = (
            f"PyTorch {torch.__version__} sees no CUDA device"
            if count == 0
            else f"this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
        )
        raise RecipeError(
            f"calibration.device: {name!r} is not available ({why}); use device: auto or cpu"
        )
    return name


def compute_dtype(recipe: Recipe, ckpt: Checkpoint) -> torch.dtype:
    """``calibration.dtype``, or under ``auto`` the dtype of the first routed-expert tensor on disk
    (float32 when that is not a floating-point dtype, as in quantised releases)."""
    name = recipe.calibration.dtype
    if name != "auto":
        return getattr(torch, name)
    first = ckpt.moe_keys(ckpt.moe_layer_indices[0])[0]
    dtype = ckpt.reader.torch_dtype(first)
    return dtype if dtype.is_floating_point else torch.float32
