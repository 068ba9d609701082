"""Round-to-nearest scalar quantisation per group of input channels (the maths of the ``rtn`` layout
and pass; the formulas are in :mod:`moecompress.layouts.rtn`)."""

from __future__ import annotations

import torch

from moecompress.errors import LayoutError
from moecompress.layouts.bitpack import BITS, pack_bits

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


def _group_params(
    g: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float16 scales of the groups ``g`` ``[..., G, gs]`` (float32), their float32 value, its divisor
    (1 where a scale is 0) and the float32 zero points: what :func:`quantize` and
    :func:`quantize_with_error` share."""
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
    return scales, s, safe, z


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
    scales, _, safe, z = _group_params(g, bits, symmetric)
    qmax = (1 << bits) - 1
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


BLOCK = 1 << 18
"""Weights quantised at once by :func:`quantize_with_error` on a CPU (1 MiB of float32). Its dozen passes over a
block stay in the cache, and the block's temporaries are memory the allocator reuses; a chunk's experts as one
float32 copy were fresh memory every time, and touching it cost more than the arithmetic
(``benchmarks/layer_work.py``, 8 experts of 768 x 2048, one thread, AVX2 EPYC: 0.15 s all at once, 0.056-0.065 s
by an expert or by blocks). Blocks keep a large expert (Mixtral's 14336 x 4096: 235 MB in float32) as cheap."""


def quantize_with_error(
    w: torch.Tensor, bits: int, group_size: int, symmetric: bool = False, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`quantize` of ``w`` ``[M, out, in]`` and, from the same pass, ``‖W_m − Ŵ_m‖_F / ‖W_m‖_F`` per
    leading index ``m`` (float32 ``[M]``), ``Ŵ`` as :func:`dequantize` gives it: bit for bit the same
    codes, scales and zero points as ``quantize`` (the rounded codes are dequantised in place, in float32,
    where ``(q − z)`` is exact). The work goes by blocks of whole rows (about ``block`` weights), each
    through every step while it is in cache; the norms are summed over the blocks in float64, so the errors
    equal the whole-tensor norms' to float32 rounding (not bit for bit: another order of summation)."""
    if bits not in BITS:
        raise LayoutError(f"bits={bits} is not supported; use one of {BITS}")
    m, out, inn = w.shape
    gs = group_width(inn, group_size)
    ng, qmax = inn // gs, (1 << bits) - 1
    codes = torch.empty(m, out, inn, dtype=torch.uint8, device=w.device)
    scales = torch.empty(m, out, ng, dtype=torch.float16, device=w.device)
    zeros = None if symmetric else torch.empty(m, out, ng, dtype=torch.uint8, device=w.device)
    num = torch.zeros(m, dtype=torch.float64, device=w.device)
    den = torch.zeros(m, dtype=torch.float64, device=w.device)
    step = max(1, block // inn) if w.device.type == "cpu" else out  # an accelerator: an expert at once
    for e in range(m):
        for r in range(0, out, step):
            src = w[e, r : r + step]
            g = src.to(torch.float32, copy=True).view(-1, ng, gs)
            den[e] += torch.linalg.vector_norm(g).double().square()
            sc, s, safe, z = _group_params(g, bits, symmetric)
            scales[e, r : r + step] = sc
            if zeros is not None:
                zeros[e, r : r + step] = z
            q = g.div_(safe[..., None]).round_().add_(z[..., None]).clamp_(0, qmax)
            codes[e, r : r + step] = q.view(-1, inn)
            deq = q.sub_(z[..., None]).mul_(s[..., None])  # (q − z)·s, as dequantize computes it
            num[e] += torch.linalg.vector_norm(deq.view(-1, inn).sub_(src)).double().square()
    err = num.sqrt() / den.sqrt().clamp_min(1e-30)
    return codes, scales, zeros, err.to(torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`~moecompress.layouts.bitpack.pack_bits` of ``uint8`` codes known to fit ``bits`` (the output
    of :func:`quantize`): the same bytes; 2 and 4 bits are packed in ``uint8`` shifts without the
    range check and the int32 words, other widths (and rows that do not fill whole bytes) by ``pack_bits``."""
    per = 8 // bits if bits in (2, 4) else 0
    if not per or codes.dtype != torch.uint8 or codes.shape[-1] % per:
        return pack_bits(codes, bits)
    *lead, n = codes.shape
    c = codes.reshape(*lead, n // per, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (j * bits)
    return out
