"""K3 decode: a GEMV-shaped kernel for ``codebook``/``rtn`` experts when each expert sees few tokens.

At decode (tokens per expert ``m_e = T·k / M`` of a handful) the K3 GEMM of :mod:`codebook_gemm` pads
every expert's few rows to a 16-row ``tl.dot`` and gathers each weight's centroid from global memory:
it is bound by that per-weight traffic, not by the bytes of the codes (issue 39: 7–50x slower than the
bf16 layer it replaces). This kernel is shaped for the bandwidth floor instead (KERNELS.md §1, §3–§4,
gemlite's split-K GEMV):

- **wide words**: the codes are read as ``int32`` words (``BK / (32 / bits)`` words per row and tile,
  16-byte aligned rows) and unpacked in registers with shifts and masks (``[BN, words, codes/word]``
  reshaped to ``[BN, BK]``);
- **tables once per tile**: a row's centroids ``[BN, groups in the tile, 2^bits]`` (codebook) or its
  group scales/zero points ``[BN, groups in the tile]`` (rtn) are loaded once per tile, or once per
  program when a row has one group; centroids are then picked in registers (``tl.gather`` on the
  loaded table), never by a per-weight load from global memory;
- **split-K** over the input dimension (gate/up over ``H``, down over the expert's live width) so a
  few hit experts still fill the GPU; fp32 partials, summed deterministically (no atomics);
- **fp32** accumulation; rows of the ``BM`` slots of one expert block (``moe_align`` with a small block,
  ``BM`` ≤ 8) reuse each decoded tile (``tl.sum`` products, no ``tl.dot`` and so no 16-row padding).

Two launches: ``gate_up`` writes the fp32 gate and up partials ``[S1, 2, T·k, I]`` (biases by split 0);
``down`` sums the S1 partials, applies the activation (SwiGLU or GPT-OSS's clamped form) while loading
its input tile, multiplies by the decoded down tile, adds the down bias (split 0) and the routed weight,
and writes ``[S2, T·k, H]`` fp32 for K5 (``moe_combine``) to sum over splits and slots.

**Prepared layout** (:func:`prepare_proj`, once at load, on the bank's device): 2/4/8-bit rows are
K3's repacked byte rows (16-byte padded) *viewed* as ``int32`` words — bitpack streams are LSB-first,
so code ``j`` of a row is bits ``(j % c)·b`` of word ``j // c`` (``c = 32 / b``): no copy. 3-bit codes
(10⅔ per word) are split into two bit planes, the low 2 bits (16 per word) and the high bit (32 per
word): 3 bits per weight as stored, equal in content (:func:`unpack_words` round-trips to the stored
codes; ``tests/test_kernels_gemv.py``).

Served around the kernels exactly as the K3 GEMM path: the input rotation / activation quantisation
(:func:`._routed.input_of`), protected exact experts (:class:`._routed.ExactExperts`), expert maps and
dropped slots (:class:`._routed.Members` through K1 and K5) — :class:`codebook_gemm.CodebookPrepared`
calls :func:`decode_forward` for the decode buckets of :data:`DECODE_CONFIGS`.

Configurations are [est]: not yet tuned on a GPU (issue 39; ``benchmarks/gpu_moe.py --only quantised``).

The two ``@triton.jit`` kernels are in :mod:`codebook_gemv_kernels`; this module holds the layout, the configs
and the launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecompress.kernels._launch import KernelConfigError, check_config, next_pow2
from moecompress.kernels.codebook_gemv_kernels import _kernels
from moecompress.layouts.bitpack import packed_size, unpack_bits

CODEBOOK, RTN_FMT = 0, 1  # the same numbering as codebook_gemm (QuantProj.fmt)
SMS = 132  # H200 streaming multiprocessors: split-K aims at >= 2 waves of programs
MIN_BN = 32  # BN 16 with 2-bit codebooks crashes Triton 3.6's sm_90 pipeline (TritonGPUOptimizeThreadLocality)


@dataclass(frozen=True)
class GemvConfig:
    """One decode bucket: ``bm`` slots of one expert per program (a power of two, ≤ 8; K1's block),
    ``bn`` output rows and ``bk`` inputs per tile (gate/up and down), ``split_gu``/``split_down``
    K-splits (0: chosen at launch to fill ~2 waves of :data:`SMS`), ``warps``/``stages``."""

    bm: int = 1
    bn: int = 32
    bk: int = 256
    bn_down: int = 32
    bk_down: int = 256
    split_gu: int = 0
    split_down: int = 0
    warps: int = 4
    stages: int = 2


DECODE_MAX_ME = 8.0
"""The decode kernel serves tokens per expert ``m_e = T·k / M`` up to this; above it the K3 GEMM."""

DECODE_CONFIGS: tuple[tuple[float, GemvConfig], ...] = (
    (1.0, GemvConfig(bm=1, bn=32, bk=256, bn_down=32, bk_down=256)),
    (2.0, GemvConfig(bm=2, bn=32, bk=256, bn_down=32, bk_down=256)),
    (4.0, GemvConfig(bm=4, bn=32, bk=128, bn_down=32, bk_down=128)),
    (DECODE_MAX_ME, GemvConfig(bm=8, bn=32, bk=128, bn_down=64, bk_down=128)),
)
"""``(m_e upper bound, config)`` per tokens-per-expert bucket, first match wins [est: chosen for an H200
from the byte counts of KERNELS.md §1 — 32 B of 4-bit codes per thread and tile at BN 32, BK 256, 4 warps
(``bk`` is for 4 bits; 2-bit tiles are twice as deep) —
and not tuned; a GPU session tunes them with ``benchmarks/gpu_moe.py --only quantised``]."""


def decode_config(numel: int, members: int) -> GemvConfig | None:
    """The decode bucket of ``numel`` routed slots over ``members`` compressed experts, or ``None``
    (many tokens per expert: the K3 GEMM)."""
    me = numel / max(members, 1)
    return next((cfg for hi, cfg in DECODE_CONFIGS if me <= hi), None)


# ---------------------------------------------------------------- the prepared layout
def codes_per_word(bits: int) -> int:
    return 32 // bits


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """``int64`` values in ``[0, 2^32)`` as the ``int32`` with the same bits."""
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def pack_words(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., n]`` (ints in ``[0, 2^bits)``, ``bits`` ∈ {1, 2, 4, 8}) as ``int32`` words
    ``[..., w]``, code ``j`` at bits ``(j % c)·bits`` of word ``j // c`` (``c = 32 / bits``); ``w`` a
    multiple of 4 (16-byte rows), zero-padded."""
    c = 32 // bits
    *lead, n = q.shape
    w = -(-max(n, 1) // (4 * c)) * 4
    v = torch.zeros(*lead, w * c, dtype=torch.int64, device=q.device)
    v[..., :n] = q.to(torch.int64)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=q.device)
    return _to_int32((v.view(*lead, w, c) << shifts).sum(-1))


def unpack_words(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: ``uint8`` codes ``[..., n]``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    q = (words.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(*words.shape[:-1], -1)[..., :n].to(torch.uint8)


@dataclass(frozen=True, eq=False)
class GemvProj:
    """One projection prepared for the decode kernel: ``words`` ``int32 [M, rows, w]`` (2/4/8 bits: the
    K3 byte rows viewed as words; 3 bits: the low 2-bit plane), ``high`` ``int32 [M, rows, w']`` (3 bits:
    the high bit plane; otherwise ``words`` again, unread), and K3's ``table``/``zeros`` (not copied)."""

    fmt: int
    words: torch.Tensor
    high: torch.Tensor
    table: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    rows: int
    cols: int
    groups: int

    @property
    def group_size(self) -> int:
        return self.cols // self.groups

    def codes(self) -> torch.Tensor:
        """The codes ``uint8 [M, rows, cols]`` decoded from the prepared words (the round-trip check)."""
        if self.bits == 3:
            return unpack_words(self.words, 2, self.cols) | (unpack_words(self.high, 1, self.cols) << 2)
        return unpack_words(self.words, self.bits, self.cols)


def prepare_proj(p, chunk: int = 8) -> GemvProj:
    """The decode layout of a K3 ``QuantProj`` ``p`` (same device; 3-bit planes built ``chunk`` experts
    at a time to bound the temporaries)."""
    if p.bits != 3:
        words = p.codes.view(torch.int32)  # rows are 16-byte padded: a free reinterpretation
        return GemvProj(p.fmt, words, words, p.table, p.zeros, p.bits, p.rows, p.cols, int(p.table.shape[2]))
    nb = packed_size(p.cols, 3)
    lo, hi = [], []
    for a in range(0, p.codes.shape[0], chunk):
        q = unpack_bits(p.codes[a : a + chunk, :, :nb].contiguous(), 3, p.cols)
        lo.append(pack_words(q & 3, 2))
        hi.append(pack_words(q >> 2, 1))
    m = p.codes.shape[0]
    if m == 0:
        dev = p.codes.device
        lo = [torch.zeros(0, p.rows, pack_words(torch.zeros(1, p.cols, device=dev), 2).shape[-1], dtype=torch.int32,
                          device=dev)]  # fmt: skip
        hi = [torch.zeros(0, p.rows, pack_words(torch.zeros(1, p.cols, device=dev), 1).shape[-1], dtype=torch.int32,
                          device=dev)]  # fmt: skip
    return GemvProj(p.fmt, torch.cat(lo), torch.cat(hi), p.table, p.zeros, 3, p.rows, p.cols, int(p.table.shape[2]))


def depth(bk: int, bits: int) -> int:
    """A config's ``bk`` (chosen for 4 bits) at ``bits``: 2-bit tiles twice as deep, so each thread still
    reads >= 16 bytes of code words per tile."""
    return bk * 2 if bits == 2 else bk


def tile_k(bk: int, p: GemvProj) -> tuple[int, int] | None:
    """``(BK, groups per tile)`` for projection ``p`` from the config's ``bk``: a tile holds whole
    words (``BK ≥ 32 / bits``; 32 for the 3-bit high plane) and either lies inside one group or holds
    whole groups (so its scales/centroids are one ``[BN, GPT(, 2^bits)]`` load); ``None`` when no tile
    fits (a group size like 24 at 2 bits): K3's GEMM serves the bank."""
    least = 32 if p.bits == 3 else codes_per_word(p.bits)
    bk = max(least, min(depth(bk, p.bits), next_pow2(p.cols)))
    if p.groups > 1:
        gs = p.group_size
        if gs % bk and bk % gs:
            bk = gs & -gs  # the largest power of two dividing the group
        if bk < least:
            return None
        return bk, max(1, bk // gs)
    return bk, 1


# ---------------------------------------------------------------- launch
@dataclass(frozen=True, eq=False)
class GemvPrepared:
    """The three projections in the decode layout, with their tile sizes per config (checked at prepare
    time: a bank none of whose tiles fit is not given one)."""

    gate: GemvProj
    up: GemvProj
    down: GemvProj


def prepare(gate, up, down) -> GemvPrepared | None:
    """The decode layout of K3's three ``QuantProj``, or ``None`` when a group size fits no tile of some
    decode config (the K3 GEMM then serves every batch)."""
    g, u, d = (prepare_proj(p) for p in (gate, up, down))
    for _, cfg in DECODE_CONFIGS:
        if tile_k(cfg.bk, g) is None or tile_k(cfg.bk_down, d) is None:
            return None
    return GemvPrepared(g, u, d)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(requested: int, programs: int, k: int, bk: int) -> int:
    if requested:
        return max(1, min(requested, -(-k // bk)))
    return max(1, min(8, _cdiv(2 * SMS, max(programs, 1)), _cdiv(k, bk)))


def decode_forward(prep, gp: GemvPrepared, cfg: GemvConfig, xa: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The compressed experts' part of the layer at decode: fp32 ``[S2, T·k, H]`` per slot (routed weight
    and down bias applied; slots of exact experts or dropped ids unwritten) for K5. ``prep`` is the
    :class:`codebook_gemm.CodebookPrepared` (members, widths, biases, activation), ``xa`` its transformed
    input ``[T, H]`` in the model dtype."""
    from moecompress.kernels.moe_align import moe_align

    t, top_k = ids.shape
    numel, m = t * top_k, prep.members.count
    g, u, d = gp.gate, gp.up, gp.down
    hidden, inter, dev = d.rows, g.rows, xa.device
    bk, gpt = tile_k(cfg.bk, g)
    bkd, gptd = tile_k(cfg.bk_down, d)
    check_config("codebook gemv", pow2={"bk": cfg.bk, "bk_down": cfg.bk_down})
    check_config("codebook gemv gate_up", pow2={"BM": cfg.bm, "BN": cfg.bn, "BK": bk})
    check_config("codebook gemv down", pow2={"BN": cfg.bn_down, "BK": bkd})
    if min(cfg.bn, cfg.bn_down) < MIN_BN or cfg.bm > 8:
        raise KernelConfigError(
            f"codebook gemv: BN {cfg.bn}/{cfg.bn_down} must be >= {MIN_BN} (Triton 3.6 fails to compile 2-bit "
            f"codebook tiles of 16 rows for sm_90) and BM {cfg.bm} <= 8 (one decoded tile serves BM slots)"
        )
    sorted_ids, eids, total = moe_align(ids, m, cfg.bm, prep.members.cmap)
    n_mb = -(-(numel + min(m, numel) * (cfg.bm - 1)) // cfg.bm)
    active = min(m, numel)
    s1 = _split(cfg.split_gu, active * -(-inter // cfg.bn), g.cols, bk)
    s2 = _split(cfg.split_down, active * -(-hidden // cfg.bn_down), prep.max_width, bkd)
    k1 = _cdiv(_cdiv(g.cols, bk), s1) * bk  # whole tiles per split: tiles stay group-aligned
    k2 = _cdiv(_cdiv(max(prep.max_width, 1), bkd), s2) * bkd
    gu = torch.empty(s1, 2, numel, inter, dtype=torch.float32, device=dev)
    y = torch.empty(s2, numel, hidden, dtype=torch.float32, device=dev)
    rw = weights.reshape(-1).float().contiguous()
    ks = _kernels()
    bias_g, bias_u = prep.biases.get("gate", xa), prep.biases.get("up", xa)
    zg = g.zeros if g.zeros is not None else g.words
    zu = u.zeros if u.zeros is not None else u.words
    ks["gate_up"][(n_mb, -(-inter // cfg.bn), s1)](
        xa, gu, sorted_ids, eids, total, prep.widths,
        g.words, g.high, g.table, zg, u.words, u.high, u.table, zu, bias_g, bias_u,
        numel, top_k, g.cols, k1, xa.stride(0), inter, gu.stride(0), g.words.shape[2], g.words.stride(1),
        g.words.stride(0), g.high.shape[2], g.high.stride(1), g.high.stride(0), g.rows, g.groups, g.group_size,
        bias_g.shape[-1] if "gate" in prep.biases else 0,
        FMT=g.fmt, BITS=g.bits, HAS_ZERO=g.zeros is not None, HAS_BIAS="gate" in prep.biases,
        GPT=gpt, ONE_GROUP=g.groups == 1, BM=cfg.bm, BN=cfg.bn, BK=bk, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    bias_d = prep.biases.get("down", y)
    ks["down"][(n_mb, -(-hidden // cfg.bn_down), s2)](
        gu, y, sorted_ids, eids, total, prep.widths, rw,
        d.words, d.high, d.table, d.zeros if d.zeros is not None else d.words, bias_d,
        numel, hidden, inter, k2, gu.stride(0), y.stride(0), d.words.shape[2], d.words.stride(1), d.words.stride(0),
        d.high.shape[2], d.high.stride(1), d.high.stride(0), d.groups, d.group_size, prep.alpha, prep.limit,
        FMT=d.fmt, BITS=d.bits, HAS_ZERO=d.zeros is not None, HAS_BIAS="down" in prep.biases,
        ACT=int(prep.act.value == "swiglu_clamped"), S_IN=s1, GPT=gptd, ONE_GROUP=d.groups == 1,
        BM=cfg.bm, BN=cfg.bn_down, BK=bkd, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return y
