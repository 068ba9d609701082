"""``RunContext``: what a run computes with (dtype, device, seed, progress bars), decided once.

No module reads global settings: the executor builds one context from the recipe and the checkpoint
and hands it to what needs it; environment variables are read only in ``cli.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
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
    """``calibration.dtype``, or under ``auto`` the dtype of the first routed-expert tensor on disk (float32
    when that is not a floating-point dtype, as in quantised releases, or when this CPU has no fast kernel
    for it: :func:`auto_dtype`)."""
    name = recipe.calibration.dtype
    if name != "auto":
        return getattr(torch, name)
    first = ckpt.moe_keys(ckpt.moe_layer_indices[0])[0]
    return auto_dtype(ckpt.reader.torch_dtype(first), resolve_device(recipe.calibration.device))


def auto_dtype(stored: torch.dtype, device: str, fast: Callable[[torch.dtype], bool] | None = None) -> torch.dtype:
    """``calibration.dtype: auto`` for weights stored in ``stored`` computed on ``device``: ``stored``, except
    float32 for a non-floating dtype and, on a CPU, for a 16-bit dtype the CPU has no fast matmul for
    (``fast``, default :func:`fast_cpu_matmul`)."""
    if not stored.is_floating_point:
        return torch.float32
    if device == "cpu" and not (fast or fast_cpu_matmul)(stored):
        return torch.float32
    return stored


@functools.cache
def fast_cpu_matmul(dtype: torch.dtype) -> bool:
    """Whether PyTorch multiplies ``dtype`` matrices on this CPU with an optimised kernel. bfloat16 and float16
    matmuls go to oneDNN only where the CPU has the instructions for it (x86: AVX-512 for bfloat16, AVX512-FP16
    or AMX-FP16 for float16; Arm: its bf16 / fp16 extensions), which PyTorch itself checks with
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` / ``_fp16_``; elsewhere (an AVX2-only x86 CPU) they fall to a
    scalar loop (pytorch/pytorch#146508). Measured on an AVX2 AMD EPYC, torch 2.13, one thread, a
    [128, 2048] x [2048, 768] product: bfloat16 7x slower than float32 with the weight transposed (a forward),
    150x with it as stored (a backward's input gradient); a 2-layer heapr run at Qwen3-30B widths took 80 s in
    float32 and had not finished calibrating after 6 minutes in bfloat16 (``benchmarks/RESULTS.md``, ninth
    session). If PyTorch does not say, the
    kernel is taken to be fast (nothing changes)."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    if check is None:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return True


def slow_dtype_note(recipe: Recipe, device: str, fast: Callable[[torch.dtype], bool] | None = None) -> str | None:
    """A line for a recipe that asks for a 16-bit ``calibration.dtype`` on a CPU without a fast matmul for it
    (``fast``, default :func:`fast_cpu_matmul`); ``None`` otherwise."""
    name = recipe.calibration.dtype
    if name not in ("bfloat16", "float16") or device != "cpu" or (fast or fast_cpu_matmul)(getattr(torch, name)):
        return None
    return (
        f"calibration.dtype: {name} on this CPU ({torch.backends.cpu.get_cpu_capability()}, no {name} matmul "
        f"kernel): PyTorch multiplies {name} matrices here in a scalar loop, 7-150x slower than float32; "
        "dtype: auto (float32 on this CPU) is faster and at least as accurate"
    )
