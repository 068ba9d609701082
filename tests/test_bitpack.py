"""Bit-packing round-trips exactly (the oracle of every quantised layout)."""

from __future__ import annotations

import pytest
import torch

from moecompress.errors import LayoutError
from moecompress.layouts.bitpack import pack_bits, packed_size, unpack_bits


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 64, 129])
def test_roundtrip_exact(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (3, 5, n), generator=g)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, packed_size(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_real_bytes(bits):
    """A row of 128 codes costs exactly 128·bits/8 bytes; extreme values survive."""
    codes = torch.tensor([[0, (1 << bits) - 1] * 64])
    packed = pack_bits(codes, bits)
    assert packed.numel() == 128 * bits // 8
    assert torch.equal(unpack_bits(packed, bits, 128), codes.to(torch.uint8))


def test_known_layout():
    """Little-endian bit stream: 3-bit codes 1, 2, 7 -> bits 100 010 111 -> bytes 0b11010001, 0b1."""
    packed = pack_bits(torch.tensor([1, 2, 7]), 3)
    assert packed.tolist() == [0b11010001, 0b00000001]


def test_errors():
    with pytest.raises(LayoutError, match="do not fit 2 bits"):
        pack_bits(torch.tensor([4]), 2)
    with pytest.raises(LayoutError, match="not supported"):
        pack_bits(torch.tensor([1]), 5)
    with pytest.raises(LayoutError, match="expected 3 bytes"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 3, 8)
