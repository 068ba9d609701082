"""Launch-time checks shared by every kernel launcher (KERNELS.md §5–§6).

The Triton interpreter (``TRITON_INTERPRET=1``) accepts configurations that will not compile on a GPU
(``tl.dot`` dims < 16, shared memory beyond the SM's 227 KiB, bf16 atomics), and computes bf16 wrong.
Launchers therefore call :func:`check_config` before every launch so a bad configuration fails on CPU
with one typed line, and pass :func:`upcast` as a ``constexpr`` so loaded tiles become fp32 under the
interpreter (free on GPU: the flag is ``False`` there and the branch is compiled away).

This module imports no triton: it is safe to import from ``moecompress.kernels`` at package import.
"""

from __future__ import annotations

import os

import torch

from moecompress.errors import LayoutError

SMEM_LIMIT = 227 * 1024
"""Shared memory per thread block on H100/H200 (bytes, opt-in maximum)."""


class KernelConfigError(LayoutError):
    """A kernel launch configuration (block sizes, stages, dtypes) cannot compile or run on a GPU."""


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (read at call time, set by ``tests/conftest.py``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast() -> bool:
    """The ``UPCAST`` constexpr: cast loaded tiles to fp32 (interpreter only, where bf16 is wrong)."""
    return interpreting()


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def smem_bytes(bm: int, bn: int, bk: int, stages: int, elem: int, b_tiles: int = 1) -> int:
    """Static shared-memory estimate of a pipelined K-loop: ``(BM·BK + b_tiles·BK·BN)·elem·stages``
    (``b_tiles = 2`` when gate and up tiles stream side by side)."""
    return (bm * bk + b_tiles * bk * bn) * elem * stages


def check_config(
    kernel: str,
    *,
    pow2: dict[str, int],
    dot: dict[str, int] | None = None,
    smem: int = 0,
    atomic_dtype: torch.dtype | None = None,
) -> None:
    """Raise :class:`KernelConfigError` unless every block in ``pow2`` is a power of two, every
    ``tl.dot`` dimension in ``dot`` is ``>= 16``, the shared-memory estimate ``smem`` fits
    :data:`SMEM_LIMIT`, and atomics (``atomic_dtype``) are not bf16."""
    for name, v in pow2.items():
        if not is_pow2(int(v)):
            raise KernelConfigError(f"{kernel}: block {name}={v} must be a power of two; pick 16, 32, 64, ...")
    for name, v in (dot or {}).items():
        if int(v) < 16:
            raise KernelConfigError(
                f"{kernel}: tl.dot dimension {name}={v} is below 16 and will not compile on a GPU; use >= 16"
            )
    if smem > SMEM_LIMIT:
        raise KernelConfigError(
            f"{kernel}: shared memory estimate {smem} B exceeds {SMEM_LIMIT} B; lower num_stages or the blocks"
        )
    if atomic_dtype is torch.bfloat16:
        raise KernelConfigError(f"{kernel}: bf16 atomics are unsupported; accumulate into an fp32 buffer")


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of a torch float dtype (imports triton: call only at launch)."""
    import triton.language as tl

    table = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if dtype not in table:
        raise KernelConfigError(f"kernels compute in fp32, fp16 or bf16, got dtype {dtype}; cast the bank")
    return table[dtype]
