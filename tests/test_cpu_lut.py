"""The packed-code CPU kernel (runtime/cpu_lut.py) equals decode with the layout's own ``expert()`` then
``F.linear``, over bit widths, groups, odd sizes (heads and tails of the 16-wide steps), token blocks and
zero scales. The whole file is skipped where the kernel cannot be built (no AVX2, compiler or ninja)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.rtn import RTN
from moecompress.runtime import cpu_lut

if not cpu_lut.available():
    pytest.skip(
        "the cpu_lut kernel cannot be built here (no AVX2, C++ compiler or ninja; see the warning logged)",
        allow_module_level=True,
    )

INS = (24, 100, 200)  # not multiples of 8/16/32: 100/4 = 25 and 200/2 = 100 start groups off the 8-grid
ROWS = (1, 7)
TOKENS = (1, 3, 6, 9)  # token blocks 1, 2+1, 4+2, 8+1


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Equal up to float32 reordering of a sum of ``in`` products: 8·eps·sqrt(in)·(|x| |W|ᵀ) per element."""
    ref = F.linear(x, w)
    bound = 8 * torch.finfo(torch.float32).eps * math.sqrt(x.shape[1]) * F.linear(x.abs(), w.abs())
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert bool(torch.isfinite(y).all())
    err = (y - ref).abs()
    assert bool((err <= bound + 1e-30).all()), (
        f"max error {float(err.max()):.3g} over bound {float(bound.max()):.3g}"
    )


def _codebook(bits: int, groups: int, rows: int, inn: int, seed: int) -> Codebook:
    g = torch.Generator().manual_seed(seed)
    codes = {e: torch.randint(0, 1 << bits, (rows, inn), generator=g) for e in range(2)}
    cents = {e: torch.randn(rows, groups, 1 << bits, generator=g) for e in range(2)}
    return Codebook.build(codes, cents, {}, bits, torch.empty(2, rows, inn))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_codebook_equals_layout(bits, groups):
    for inn in INS:
        for rows in ROWS:
            lay = _codebook(bits, groups, rows, inn, seed=bits * 100 + groups * 10 + rows)
            for t in TOKENS:
                x = torch.randn(t, inn, generator=torch.Generator().manual_seed(t))
                for e in range(2):
                    m = int(lay.members[e])
                    _close(cpu_lut.codebook_matmul(x, lay.codes[m], lay.centroids[m], bits), x, lay.expert(e))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("symmetric", [False, True])
def test_rtn_equals_layout(bits, groups, symmetric):
    for inn in INS:
        for rows in ROWS:
            g = torch.Generator().manual_seed(bits * 100 + groups * 10 + rows)
            w = torch.randn(2, rows, inn, generator=g)
            w[0, :, : inn // groups] = 0  # a zero group in every row: scale 0 must give 0, not NaN
            lay = RTN.from_dense(w, bits, inn // groups, symmetric=symmetric)
            assert float(lay.scales[0, :, 0].float().abs().max()) == 0.0
            for t in TOKENS:
                x = torch.randn(t, inn, generator=torch.Generator().manual_seed(t))
                for e in range(2):
                    z = None if symmetric else lay.zeros[e]
                    _close(cpu_lut.rtn_matmul(x, lay.codes[e], lay.scales[e], z, bits), x, lay.expert(e))


def test_views_long_batches_and_threads():
    """Row slices of the stored codes (the lean path's live rows), a strided x, 8-token blocks, and the
    same bits whatever the thread count (each row is summed by one thread in one order)."""
    lay = _codebook(4, 2, 40, 200, seed=7)
    x = torch.randn(20, 400)[:, ::2]  # 8 + 8 + 4 tokens, not contiguous
    y = cpu_lut.codebook_matmul(x, lay.codes[1, :33], lay.centroids[1, :33], 4)
    _close(y, x.contiguous(), lay.expert(1)[:33])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_lut.codebook_matmul(x, lay.codes[1, :33], lay.centroids[1, :33], 4)
        torch.set_num_threads(2)
        two = cpu_lut.codebook_matmul(x, lay.codes[1, :33], lay.centroids[1, :33], 4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("bits", [3, 4])
def test_long_rows_are_summed_over_x_blocks(bits):
    """Rows longer than one x block (4096 floats / tokens: 512 inputs at 8 tokens, 1024 at 4), with
    block edges inside groups of 275 (not a multiple of 8)."""
    inn, groups = 1100, 4
    lay = _codebook(bits, groups, 3, inn, seed=11)
    w = torch.randn(1, 3, inn)
    rtn = RTN.from_dense(w, bits, inn // groups)
    for t in (4, 9):
        x = torch.randn(t, inn)
        _close(cpu_lut.codebook_matmul(x, lay.codes[0], lay.centroids[0], bits), x, lay.expert(0))
        _close(cpu_lut.rtn_matmul(x, rtn.codes[0], rtn.scales[0], rtn.zeros[0], bits), x, rtn.expert(0))


def test_empty_shapes():
    lay = _codebook(2, 1, 5, 24, seed=1)
    assert cpu_lut.codebook_matmul(torch.zeros(0, 24), lay.codes[0], lay.centroids[0], 2).shape == (0, 5)
    y = cpu_lut.codebook_matmul(torch.ones(3, 24), lay.codes[0, :0], lay.centroids[0, :0], 2)
    assert y.shape == (3, 0)


def test_bad_operands_are_typed_errors():
    lay = _codebook(4, 2, 3, 24, seed=2)
    c, cb, x = lay.codes[0], lay.centroids[0], torch.randn(1, 24)
    with pytest.raises(LayoutError, match="bits=5"):
        cpu_lut.codebook_matmul(x, c, cb, 5)
    with pytest.raises(LayoutError, match="x must be a float32"):
        cpu_lut.codebook_matmul(x.double(), c, cb, 4)
    with pytest.raises(LayoutError, match=r"codes must be uint8 \[rows, 12\]"):
        cpu_lut.codebook_matmul(x, c[:, :11], cb, 4)
    with pytest.raises(LayoutError, match=r"centroids must be \[rows, G, 16\]"):
        cpu_lut.codebook_matmul(x, c, cb[..., :8], 4)
    with pytest.raises(LayoutError, match="group count dividing 24"):
        cpu_lut.rtn_matmul(x, c, torch.ones(3, 5, dtype=torch.float16), None, 4)
    with pytest.raises(LayoutError, match="zeros uint8"):
        cpu_lut.rtn_matmul(
            x, c, torch.ones(3, 2, dtype=torch.float16), torch.zeros(3, 1, dtype=torch.uint8), 4
        )


def test_no_avx2_means_no_kernel_and_one_warning(monkeypatch, caplog):
    """The CPUID guard: without AVX2 the builder returns nothing (and never compiles) and logs one line;
    the ops then fall back to decode + F.linear."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with caplog.at_level(logging.WARNING, logger=cpu_lut.__name__):
        assert cpu_lut._ops.__wrapped__() is None
    assert len(caplog.records) == 1 and "no AVX2" in caplog.records[0].getMessage()
    monkeypatch.setattr(cpu_lut, "_ops", lambda: None)
    lay = _codebook(3, 1, 4, 24, seed=3)
    x = torch.randn(2, 24)
    _close(cpu_lut.codebook_matmul(x, lay.codes[0], lay.centroids[0], 3), x, lay.expert(0))


@pytest.fixture(params=[0, 8, 16], ids=["auto", "avx2", "avx512"])
def lanes(request):
    """Run a test with the tile GEMM's default width, then forced to 8 (AVX2) and 16 (AVX-512) lanes."""
    ops = cpu_lut._ops()
    if request.param == 16 and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("no AVX-512 on this CPU")
    old = ops.gemm_lanes(request.param)
    yield request.param
    ops.gemm_lanes(old)


GEMM_TOKENS = (8, 16, 32, 33, 64)  # tile GEMM from 8 (AVX-512) or 9 (AVX2) tokens; padded vectors
# in-size: groups. One group ending at the row's end; groups of 50 and 275 (off the 16-grid); 1100 spans
# several input tiles with tile edges inside groups.
GEMM_INS = {40: 1, 200: 4, 1100: 4}


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_tile_gemm_codebook_and_rtn(bits, lanes):
    """Prefill shapes: rows not a multiple of the 6/12-row tile, odd in-sizes, every padded token count."""
    rows = 13
    for inn, groups in GEMM_INS.items():
        lay = _codebook(bits, groups, rows, inn, seed=bits * 1000 + inn)
        w = torch.randn(1, rows, inn, generator=torch.Generator().manual_seed(inn))
        rtn = RTN.from_dense(w, bits, inn // groups)
        for t in GEMM_TOKENS:
            x = torch.randn(t, inn, generator=torch.Generator().manual_seed(t))
            _close(cpu_lut.codebook_matmul(x, lay.codes[0], lay.centroids[0], bits), x, lay.expert(0))
            _close(cpu_lut.rtn_matmul(x, rtn.codes[0], rtn.scales[0], rtn.zeros[0], bits), x, rtn.expert(0))


def test_tile_gemm_batch_alone_and_threads(lanes):
    """A 33-token batch (tile GEMM, a padded last vector) and the same tokens one at a time (row kernel)
    both equal the reference; the batch gives the same bits on 1 and 2 threads (rows own their sums)."""
    lay = _codebook(4, 2, 50, 300, seed=5)
    x = torch.randn(33, 300)
    y = cpu_lut.codebook_matmul(x, lay.codes[0], lay.centroids[0], 4)
    _close(y, x, lay.expert(0))
    alone = torch.cat(
        [cpu_lut.codebook_matmul(x[i : i + 1], lay.codes[0], lay.centroids[0], 4) for i in (0, 32)]
    )
    _close(alone, x[[0, 32]], lay.expert(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = cpu_lut.codebook_matmul(x, lay.codes[0], lay.centroids[0], 4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, two)
