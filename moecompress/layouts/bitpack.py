"""Bit-packing of small integer codes (2, 3, 4 or 8 bits per value) into ``uint8`` bytes.

Quantised layouts (``codebook``, ``rtn``) store one code per weight. Each *row* (the last axis) is
packed as its own little-endian bit stream: value ``j`` occupies bits ``[j·b, (j+1)·b)`` of the row's
stream, bit ``k`` of the stream is bit ``k % 8`` of byte ``k // 8``. A row of ``n`` codes takes
``ceil(n·b / 8)`` bytes (the tail bits of the last byte are zero), so rows stay byte-aligned and any
row (one expert's output channel) can be unpacked alone::

    packed = pack_bits(codes, 3)            # codes: int tensor [..., n], values in [0, 8)
    codes2 = unpack_bits(packed, 3, n)      # uint8 [..., n]; torch.equal(codes2, codes.to(torch.uint8))

3-bit rows therefore cost exactly ``3n/8`` bytes when ``8 | n`` (every hidden/intermediate size we meet).
"""

from __future__ import annotations

import torch

from moecompress.errors import LayoutError

BITS = (2, 3, 4, 8)


def _check(bits: int) -> None:
    if bits not in BITS:
        raise LayoutError(f"bit width {bits} is not supported; use one of {BITS}")


def packed_size(n: int, bits: int) -> int:
    """Bytes of one packed row of ``n`` codes."""
    _check(bits)
    return (n * bits + 7) // 8


def _lanes(bits: int) -> tuple[int, int]:
    """``(bytes, codes)`` of one aligned word: 1 byte holds 4 (2-bit) or 2 (4-bit) codes, 3 bytes 8 (3-bit)."""
    return (3, 8) if bits == 3 else (1, 8 // bits)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` ``[..., n]`` (each in ``[0, 2**bits)``) into ``uint8`` ``[..., ceil(n·bits/8)]``."""
    _check(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise LayoutError(f"pack_bits needs integer codes, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise LayoutError(
            f"codes in [{int(codes.min())}, {int(codes.max())}] do not fit {bits} bits (allowed 0..{(1 << bits) - 1})"
        )
    *lead, n = codes.shape
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    nb, per = _lanes(bits)
    words = -(-n // per)
    c = torch.nn.functional.pad(codes.to(torch.int32), (0, words * per - n)).view(*lead, words, per)
    shifts = torch.arange(0, per * bits, bits, dtype=torch.int32, device=codes.device)
    word = (c << shifts).sum(-1, dtype=torch.int32)  # the codes of one word, LSB first
    out = (word.unsqueeze(-1) >> torch.arange(0, 8 * nb, 8, dtype=torch.int32, device=codes.device)) & 0xFF
    return out.reshape(*lead, words * nb)[..., : packed_size(n, bits)].to(torch.uint8).contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``uint8`` ``[..., ceil(n·bits/8)]`` to ``uint8`` codes ``[..., n]``.

    Works a whole aligned word at a time (shifts and masks of ``uint8`` bytes; 3-byte ``int32`` words at
    3 bits), so decoding costs a few passes over the codes, not one per bit."""
    _check(bits)
    if packed.dtype != torch.uint8:
        raise LayoutError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_size(n, bits):
        raise LayoutError(
            f"packed rows of {packed.shape[-1]} bytes do not hold {n} codes of {bits} bits "
            f"(expected {packed_size(n, bits)} bytes)"
        )
    if bits == 8:
        return packed
    *lead, nbytes = packed.shape
    nb, per = _lanes(bits)
    mask = (1 << bits) - 1
    if nb == 1:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(-1) >> shifts) & mask
        return codes.reshape(*lead, nbytes * per)[..., :n]
    words = -(-nbytes // nb)
    b = torch.nn.functional.pad(packed, (0, words * nb - nbytes)).view(*lead, words, nb).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    shifts = torch.arange(0, per * bits, bits, dtype=torch.int32, device=packed.device)
    codes = ((word.unsqueeze(-1) >> shifts) & mask).to(torch.uint8)
    return codes.reshape(*lead, words * per)[..., :n]
