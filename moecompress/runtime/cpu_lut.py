"""A native CPU GEMV on *packed* quantised experts: the codebook lookup done in registers.

PyTorch has no op for ``y = x Wᵀ`` whose weights are looked up in a per-row table, and decoding an
expert first (``torch.gather`` over every weight) costs 10–15x the matvec it feeds. This kernel reads the
bit-packed codes (``bits/8`` bytes per weight, :mod:`moecompress.layouts.bitpack`) and, for each output
row ``r`` and group ``g`` of ``gs = in / G`` consecutive inputs, a table ``L[r, g, k]`` of ``K = 2^bits``
float32 values::

    codebook:  L[r, g, k] = float(centroids[r, g, k])                  (float16 -> float32 is exact)
    rtn:       L[r, g, k] = float(k − z[r, g]) · float(s[r, g])        (z = 2^(bits−1) when symmetric)
    y[t, r]  = Σ_j  L[r, j // gs, q[r, j]] · x[t, j]                    (float32 accumulation)

so ``L[r, g, q]`` is bit-identical to the layout's decoded weight (``Codebook.expert``,
:func:`moecompress.methods.scalar_quant.dequantize`); only the order of the sum differs from
``F.linear`` on the decoded weight. This is the table-lookup GEMV of llama.cpp's k-quants and of
T-MAC (Wei et al., 2024, arXiv:2407.00088) reduced to the lookup of a weight value.

AVX2 row kernel (T < 8; 32 weights per step, decoded once and reused for every token):

- 2/3/4 bits: 8 codes are one 32-bit broadcast load and a per-lane variable shift (``vpsrlvd``; no mask,
  ``vpermps`` reads only the low 3 bits of a lane); the table lives in registers and one ``vpermps``
  looks 8 weights up (4 bits: two 8-entry halves and a blend on bit 3). Float32 tables keep rtn's
  ``(q − z)·s`` exact, which llama.cpp's float16 byte-split ``pshufb`` table could not, at fewer
  shuffle-port µops.
- 8 bits: a 256-entry float32 table in L1 and ``vgatherdps`` (slower than a dense float32 GEMV at T = 1,
  still ~5x faster than decoding).
- Scalar C++ for the codes a 16-wide step cannot take: the head up to an 8-aligned input and the tail of
  each group (only when ``gs`` is not a multiple of 16, or at a row's last < 16 inputs).
- Rows go in tiles of 16 whose tables are built together; for 1 < T < 8, x is read in blocks of 16 KiB
  (L1) so that every row of a tile reuses it.

From T = 8 tokens (prefill: ~32 routed rows per expert at 512 tokens) a tile GEMM replaces the row
kernel: per tile of R rows and kb inputs the weights are decoded once into an L1 scratch (the lookup
cost is then shared by all T tokens), x is packed token-major per input tile (``x[v][k][L]``, L tokens
a vector, zero-padded past T), and a register-blocked micro-kernel keeps R x 2 vectors of accumulators
(``acc[r][v] += w[r, k] · x[v, k, :]``, one broadcast per row and input), the BLIS/GotoBLAS scheme
(Goto & van de Geijn, 2008, "Anatomy of high-performance matrix multiplication"). AVX-512 where the
CPU has it (L = 16, R = 12, 16 codes per ``vpermps`` on a 16-entry zmm table; from T = 8) else AVX2
(L = 8, R = 6; from T = 9, the row kernel being faster at 8). Each tile's products are summed from zero in registers and then
added to the row's partial sum (chains of kb ≤ 512 terms, not ``in``).

Measured (``benchmarks/cpu_lut.py``, one thread, Qwen3-30B-A3B experts): at T = 1 the 4-bit kernel is
about as fast as the dense float32 matvec and 2-bit ~2.5x faster, both 10–30x faster than decode +
``F.linear``; at T = 32–64 the tile GEMM is within ~1.0–1.4x of MKL's dense float32 GEMM.

Rows are split over ``at::parallel_for`` (``torch.get_num_threads()``). The source is compiled once per
machine on first use (``torch.utils.cpp_extension.load_inline``, cached in the torch extensions
directory); :func:`available` says whether it could be, and :func:`codebook_matmul` / :func:`rtn_matmul`
fall back to decode + ``F.linear`` (:func:`reference_codebook`, :func:`reference_rtn`) when not.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moecompress.errors import LayoutError
from moecompress.layouts.bitpack import BITS, packed_size, unpack_bits
from moecompress.methods.scalar_quant import dequantize

log = logging.getLogger(__name__)

_NAME = "moecompress_cpu_lut"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c"]
_SOURCE = Path(__file__).with_name("cpu_lut.cpp")
"""The kernel's C++ source, shipped beside this module (package data)."""


@functools.cache
def _ops():
    """Build (once per machine) and load the kernel; ``None`` with one warning line when it cannot be."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        log.warning("cpu_lut: CPU capability %s has no AVX2; quantised experts are decoded instead", cap)
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        start = time.perf_counter()
        load_inline(
            _NAME,
            _SOURCE.read_text(),
            extra_cflags=_FLAGS,
            is_python_module=False,
            no_implicit_headers=True,
            verbose=False,
        )
        log.info("cpu_lut: kernel ready in %.1f s", time.perf_counter() - start)
        return torch.ops.moecompress_lut
    except Exception as err:  # any compiler/ninja/loader failure means "no kernel", never a crash
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        log.warning("cpu_lut: could not build the kernel (%s); quantised experts are decoded instead", first)
        return None


def available() -> bool:
    """Whether the native kernel is usable here (builds it on the first call; never raises)."""
    return _ops() is not None


def _check(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, bits: int, what: str) -> int:
    """Validate one expert's operands; return the number of groups ``G``."""
    if bits not in BITS:
        raise LayoutError(f"cpu_lut: bits={bits} is not supported; use one of {BITS}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise LayoutError(f"cpu_lut: x must be a float32 CPU [T, in] tensor, got {x.dtype} {tuple(x.shape)}")
    inn = int(x.shape[1])
    if codes.dim() != 2 or codes.dtype != torch.uint8 or codes.shape[1] != packed_size(inn, bits):
        raise LayoutError(
            f"cpu_lut: codes must be uint8 [rows, {packed_size(inn, bits)}] for {inn} inputs at {bits} bits, "
            f"got {codes.dtype} {tuple(codes.shape)}"
        )
    groups = int(params.shape[1]) if params.dim() >= 2 else 0
    if params.dtype != torch.float16 or params.shape[0] != codes.shape[0] or groups < 1 or inn % groups:
        raise LayoutError(
            f"cpu_lut: {what} must be float16 with {codes.shape[0]} rows and a group count dividing {inn}, "
            f"got {params.dtype} {tuple(params.shape)}"
        )
    return groups


def reference_codebook(
    x: torch.Tensor, codes: torch.Tensor, centroids: torch.Tensor, bits: int
) -> torch.Tensor:
    """Decode + ``F.linear``: ``W[r, j] = centroids[r, j // gs, q[r, j]]`` (what the kernel computes)."""
    rows, g, _ = centroids.shape
    q = unpack_bits(codes, bits, x.shape[1]).long().view(rows, g, -1)
    return F.linear(x, centroids.float().gather(2, q).view(rows, -1))


def reference_rtn(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """Decode + ``F.linear``: ``W = (q − z) · s`` (:func:`moecompress.methods.scalar_quant.dequantize`)."""
    return F.linear(x, dequantize(unpack_bits(codes, bits, x.shape[1]), scales, zeros, bits))


def codebook_matmul(x: torch.Tensor, codes: torch.Tensor, centroids: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` float32 ``[T, in]``, packed ``codes`` uint8 ``[rows, ceil(in·bits/8)]``, ``centroids`` float16
    ``[rows, G, 2^bits]`` -> ``x Wᵀ`` float32 ``[T, rows]`` with ``W[r, j] = centroids[r, j // (in/G), q[r, j]]``.

    The kernel checks its operands itself (``TORCH_CHECK``), so well-formed calls pay no Python checks;
    anything it refuses (or a strided view) is checked here for a typed error, then made contiguous."""
    ops = _ops()
    if ops is not None:
        try:
            return ops.codebook_matmul(x, codes, centroids, bits)
        except (RuntimeError, TypeError):
            pass
    _check(x, codes, centroids, bits, "centroids")
    if centroids.dim() != 3 or centroids.shape[2] != 1 << bits:
        raise LayoutError(f"cpu_lut: centroids must be [rows, G, {1 << bits}], got {tuple(centroids.shape)}")
    if ops is None:
        return reference_codebook(x, codes, centroids, bits)
    return ops.codebook_matmul(x.contiguous(), codes.contiguous(), centroids.contiguous(), bits)


def rtn_matmul(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """``x`` float32 ``[T, in]``, packed ``codes`` uint8, ``scales`` float16 ``[rows, G]``, ``zeros`` uint8
    ``[rows, G]`` or ``None`` (symmetric, ``z = 2^(bits−1)``) -> ``x Wᵀ`` float32 ``[T, rows]``,
    ``W[r, j] = (q[r, j] − z[r, g]) · s[r, g]``, ``g = j // (in/G)``. Checked as :func:`codebook_matmul`."""
    ops = _ops()
    if ops is not None:
        try:
            return ops.rtn_matmul(x, codes, scales, zeros, bits)
        except (RuntimeError, TypeError):
            pass
    _check(x, codes, scales, bits, "scales")
    if scales.dim() != 2 or (
        zeros is not None and (zeros.dtype != torch.uint8 or zeros.shape != scales.shape)
    ):
        raise LayoutError(
            f"cpu_lut: scales must be [rows, G] and zeros uint8 of the same shape (or None), got "
            f"{tuple(scales.shape)} and {None if zeros is None else (zeros.dtype, tuple(zeros.shape))}"
        )
    if ops is None:
        return reference_rtn(x, codes, scales, zeros, bits)
    z = None if zeros is None else zeros.contiguous()
    return ops.rtn_matmul(x.contiguous(), codes.contiguous(), scales.contiguous(), z, bits)
