"""Round-to-nearest scalar quantisation per group of input channels (the maths of the ``rtn`` layout
and pass; the formulas are in :mod:`moecompress.layouts.rtn`)."""

from __future__ import annotations

import torch

from moecompress.errors import LayoutError
from moecompress.layouts.bitpack import BITS

_FP16_MAX = float(torch.finfo(torch.float16).max)


def group_width(inn: int, group_size: int) -> int:
    """The group width for rows of ``inn`` inputs (``-1``: the whole row); raises when it does not divide."""
    gs = inn if group_size == -1 else group_size
    if gs < 1 or inn % gs:
        raise LayoutError(
            f"group_size={group_size} does not divide the {inn} input channels of a row; use a divisor of "
            f"{inn} or group_size: -1 (one group per output channel)"
        )
    return gs


def quantize(
    w: torch.Tensor, bits: int, group_size: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest of ``w`` ``[..., out, in]``: integer codes ``[..., out, in]`` (uint8, unpacked),
    float16 scales ``[..., out, G]`` and uint8 zero points ``[..., out, G]`` (``None`` if ``symmetric``)."""
    if bits not in BITS:
        raise LayoutError(f"bits={bits} is not supported; use one of {BITS}")
    *lead, out, inn = w.shape
    gs = group_width(inn, group_size)
    g = w.to(torch.float32, copy=True).reshape(*lead, out, inn // gs, gs)
    qmax = (1 << bits) - 1
    if symmetric:
        raw = g.abs().amax(-1) / ((1 << (bits - 1)) - 1)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        raw = (hi - lo) / qmax
    if raw.numel() and (not bool(torch.isfinite(raw).all()) or float(raw.max()) > _FP16_MAX):
        raise LayoutError(
            "weights are too large (or not finite) for float16 group scales; check the checkpoint for inf/NaN"
        )
    scales = raw.to(torch.float16)
    s = scales.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    if symmetric:
        z = torch.full_like(s, float(1 << (bits - 1)))
    else:
        z = torch.clamp(torch.round(-lo / safe), 0, qmax)
    q = g.div_(safe[..., None]).round_().add_(z[..., None]).clamp_(0, qmax)  # in place: g is a copy
    codes = q.to(torch.uint8).reshape(*lead, out, inn)
    return codes, scales, None if symmetric else z.to(torch.uint8)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """float32 weights ``(q − z) · s`` from codes ``[..., out, in]`` (unpacked), scales and zero points
    ``[..., out, G]`` (``zeros=None``: symmetric, ``z = 2^(bits−1)``)."""
    *lead, out, inn = codes.shape
    g = scales.shape[-1]
    q = codes.to(torch.int32).reshape(*lead, out, g, inn // g)
    z = (1 << (bits - 1)) if zeros is None else zeros.to(torch.int32)[..., None]
    return ((q - z).float() * scales.float()[..., None]).reshape(*lead, out, inn)
