"""``prepare_triton``: a bank's layouts -> the kernel family that serves them, prepared once at load.

The explicit table :data:`FAMILIES` maps each layout kind (``bank.gate.kind``, ``bank.up.kind``,
``bank.down.kind``) to the kernel file of its family. A bank whose three projections are all ``dense``
or ``ragged`` goes to K2 (:mod:`grouped_gemm`); a bank with compressed projections goes to the one
compressed family they name (``codebook``/``rtn`` -> K3 ``codebook_gemm``, ``tucker``/``lowrank`` -> K4
``factorized``), whose ``prepare(bank, expert_map)`` decides whether it serves the mix (it may keep a
dense down projection, for example). Two compressed families in one bank, a family whose file is not
present, or triton not installed give ``None``: the runtime then uses its PyTorch path.

Every family's ``prepare`` returns an object with ``forward(x [T, H], ids [T, k], weights [T, k]) ->
[T, H]`` (fp32 or ``x.dtype``) equal to ``moecompress.reference.experts_forward(bank, x, ids, weights,
expert_map)``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Protocol

import torch

FAMILIES: dict[str, str] = {
    "dense": "grouped_gemm",
    "ragged": "grouped_gemm",
    "codebook": "codebook_gemm",
    "rtn": "codebook_gemm",
    "tucker": "factorized",
    "lowrank": "factorized",
}
"""Layout kind -> kernel module (in ``moecompress.kernels``) of the family that serves it."""

BASE_FAMILY = "grouped_gemm"
"""The family of uncompressed projections; a compressed family takes precedence over it."""


class Prepared(Protocol):
    """What every family's ``prepare`` returns."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


def family_of(bank) -> str | None:
    """The kernel module that serves ``bank``'s layouts, or ``None`` (an unknown kind, or two compressed
    families in one bank)."""
    kinds = (bank.gate.kind, bank.up.kind, bank.down.kind)
    if any(k not in FAMILIES for k in kinds):
        return None
    fams = {FAMILIES[k] for k in kinds} - {BASE_FAMILY}
    if len(fams) > 1:
        return None
    return next(iter(fams)) if fams else BASE_FAMILY


def available(module: str) -> bool:
    """Whether the kernel file ``module`` exists and triton is installed (a present file that fails to
    import is a bug and raises)."""
    return (
        importlib.util.find_spec("triton") is not None
        and importlib.util.find_spec(f"moecompress.kernels.{module}") is not None
    )


def prepare_triton(bank, expert_map: torch.Tensor | None = None) -> Prepared | None:
    """Prepare ``bank`` (and the logical -> physical ``expert_map``) for the Triton kernels, or ``None``
    when no kernel serves this combination of layouts."""
    module = family_of(bank)
    if module is None or not available(module):
        return None
    return importlib.import_module(f"moecompress.kernels.{module}").prepare(bank, expert_map)
