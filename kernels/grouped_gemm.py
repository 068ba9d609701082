"""K2 ``moe_grouped_gemm``: dense, uniformly pruned and ragged experts; gate+up+SwiGLU in one pass.

For every routed slot ``s = t·k + j`` with physical expert ``e`` of live width ``I_e``::

    h_s = act(x_t W_g[e][:I_e]ᵀ + b_g[e], x_t W_u[e][:I_e]ᵀ + b_u[e])        [I_e]   (GEMM1, fused)
    y_s = c_{t,j} · (h_s W_d[e][:, :I_e]ᵀ + b_d[e])                           [H]     (GEMM2 + epilogue)
    out_t = Σ_j y_{t·k+j}                                                     (K5, deterministic)

``act`` is SwiGLU ``silu(g)·u`` or GPT-OSS's clamped form ``(clamp(u, ±L) + 1)·g'·σ(α g')``,
``g' = min(g, L)`` (Shazeer 2020 "GLU variants"; OpenAI 2025 gpt-oss model card).

Structure (vLLM ``fused_moe``, KERNELS.md §2, re-derived): K1 metadata groups slots by expert in
``BLOCK_M`` runs. GEMM1 programs ``(m_block, n_block)`` gather ``BLOCK_M`` token rows once and stream the
gate and up tiles of the same neurons into two fp32 accumulators sharing that A tile; the activation is
applied in registers and only ``h`` ``[T·k, I]`` is written (no ``[T·k, 2I]`` intermediate, no activation
kernel). A program whose ``n_block·BN >= I_e`` exits at once, so a pruned expert costs its live width
(ragged early exit). GEMM2 programs ``(m_block, n_block, split)`` reduce over ``I_e`` (a runtime bound),
split-K for decode when ``active experts × ⌈H/BN⌉`` is below ≈ 2 waves of SMs; the epilogue adds the
down bias (split 0) and multiplies by the router weight; each split writes its own ``[T·k, H]`` plane
(fp32 with split-K, else the compute dtype, as vLLM's ``[T, k, H]``) and K5 sums planes and slots in fp32
in a fixed order (no atomics: bit-reproducible).

Operands are addressed as base pointer + per-expert int64 element offset + uniform strides, so a
``Dense`` ``[E, I, H]`` weight and a ``Ragged`` ``[Σ I_e, H]`` one are both used in place (no copy at
load): gate/up element ``(n, k)`` of expert ``e`` is at ``off[e] + n·H + k``; down element ``(k, n)``
(reduction index ``k`` over neurons) at ``off[e] + k·stride_k + n·stride_n`` (Dense: ``1, I``; Ragged
down, stored transposed: ``H, 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moecompress.kernels._launch import check_config, smem_bytes, upcast
from moecompress.kernels.combine import moe_combine
from moecompress.kernels.moe_align import moe_align
from moecompress.methods.rotation import fake_quant_tokens

ACT_CODES = {"swiglu": 0, "swiglu_clamped": 1}


def moe_loop(x, w13, w2, w, ids, b13=None, b2=None, act: str = "swiglu", alpha=1.702, limit=7.0):
    """Unfused reference and the eager baseline (KERNELS.md §4): ``w13[e]`` ``[2·I_e, H]`` (gate rows,
    then up rows), ``w2[e]`` ``[H, I_e]``; optional biases ``b13[e]`` ``[2·I_e]``, ``b2[e]`` ``[H]``.
    Slots with ids outside ``[0, len(w13))`` are dropped. Returns fp32 ``[T, H]``."""
    out = torch.zeros(x.shape[0], w2[0].shape[0], dtype=torch.float32, device=x.device)
    for e in range(len(w13)):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gu = x[tok].float() @ w13[e].float().t()
        if b13 is not None:
            gu = gu + b13[e].float()
        i = gu.shape[-1] // 2
        g, u = gu[:, :i], gu[:, i:]
        if act == "swiglu_clamped":
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            a = (u + 1) * g * torch.sigmoid(alpha * g)
        else:
            a = F.silu(g) * u
        y = a @ w2[e].float().t()
        if b2 is not None:
            y = y + b2[e].float()
        out.index_add_(0, tok, y * w[tok, slot, None].float())
    return out


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the K2 pair (``bm`` is also K1's block)."""

    bm: int
    bn1: int
    bk1: int
    bn2: int
    bk2: int
    warps: int = 4
    stages: int = 3
    split_k: int | None = None  # None: chosen from occupancy (decode only)


CONFIGS: list[tuple[float, GemmConfig]] = [
    # (max tokens per expert m_e = T·k/E, config) [est: from vLLM's H200 table shapes; tune on GPU]
    (2.0, GemmConfig(16, 32, 128, 64, 128, warps=4, stages=4)),
    (16.0, GemmConfig(16, 64, 128, 64, 128, warps=4, stages=3, split_k=1)),
    (64.0, GemmConfig(32, 64, 64, 128, 64, warps=4, stages=3, split_k=1)),
    (256.0, GemmConfig(64, 64, 64, 128, 64, warps=4, stages=3, split_k=1)),
    (float("inf"), GemmConfig(128, 64, 64, 128, 64, warps=8, stages=3, split_k=1)),
]
"""Configs by batch bucket, keyed by tokens per expert so one table serves Qwen3 (k/E = 1/16) and
Mixtral (1/4): decode (m_e ≤ 2) uses split-K, prefill large M tiles."""


def pick_config(tokens: int, top_k: int, num_experts: int) -> GemmConfig:
    me = tokens * top_k / max(num_experts, 1)
    return next(c for bound, c in CONFIGS if me <= bound)


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["numel", "x_plane"])
    def gate_up_kernel(
        x_ptr, raw_ptr, g_ptr, u_ptr, g_off_ptr, u_off_ptr, width_ptr, gb_ptr, ub_ptr, h_ptr,
        sorted_ptr, eids_ptr, total_ptr,
        numel, H, I_full, stride_h, x_plane, alpha, limit,
        TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        EVEN_K: tl.constexpr, HAS_GB: tl.constexpr, HAS_UB: tl.constexpr, HAS_RAW: tl.constexpr,
        ACT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ALIGN: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(eids_ptr + pid_m).to(tl.int64)
        width = tl.load(width_ptr + e)
        if pid_n * BN >= width:  # ragged early exit: pruned neurons cost nothing
            return
        tok = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        valid = tok < numel
        row = tok // TOP_K
        x_base = x_ptr
        if HAS_RAW:
            x_base += tl.load(raw_ptr + e).to(tl.int64) * x_plane
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < width
        offs_k = tl.arange(0, BK)
        a_ptrs = x_base + row[:, None] * H + offs_k[None, :]
        g_off = tl.load(g_off_ptr + e)
        u_off = tl.load(u_off_ptr + e)
        if ALIGN:  # expert offsets are multiples of 16 elements: lets the weight tiles load as 16-byte vectors
            g_off = tl.multiple_of(g_off, 16)
            u_off = tl.multiple_of(u_off, 16)
        bg_ptrs = g_ptr + g_off + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
        bu_ptrs = u_ptr + u_off + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                bg = tl.load(bg_ptrs, mask=nmask[None, :], other=0.0)
                bu = tl.load(bu_ptrs, mask=nmask[None, :], other=0.0)
            else:
                km = offs_k < H - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
                bg = tl.load(bg_ptrs, mask=km[:, None] & nmask[None, :], other=0.0)
                bu = tl.load(bu_ptrs, mask=km[:, None] & nmask[None, :], other=0.0)
            if UPCAST:
                a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PREC)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PREC)
            a_ptrs += BK
            bg_ptrs += BK
            bu_ptrs += BK
        if HAS_GB:
            acc_g += tl.load(gb_ptr + e * I_full + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if HAS_UB:
            acc_u += tl.load(ub_ptr + e * I_full + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = (u + 1.0) * g * tl.sigmoid(alpha * g)
        else:
            h = acc_g * tl.sigmoid(acc_g) * acc_u
        h_ptrs = h_ptr + tok[:, None] * stride_h + offs_n[None, :]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])

    @triton.jit(do_not_specialize=["numel"])
    def down_kernel(
        h_ptr, d_ptr, d_off_ptr, width_ptr, db_ptr, w_ptr, y_ptr, sorted_ptr, eids_ptr, total_ptr,
        numel, N, stride_h, stride_dk, stride_dn,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
        HAS_DB: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ALIGN: tl.constexpr,
        EVEN_W: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(eids_ptr + pid_m).to(tl.int64)
        width = tl.load(width_ptr + e)
        tok = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        valid = tok < numel
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        k_per = tl.cdiv(tl.cdiv(width, SPLIT_K), BK) * BK
        k_lo = pid_s * k_per
        k_hi = tl.minimum(width, k_lo + k_per)
        offs_k = tl.arange(0, BK)
        a_ptrs = h_ptr + tok[:, None] * stride_h + (k_lo + offs_k)[None, :]
        d_off = tl.load(d_off_ptr + e)
        if ALIGN:
            d_off = tl.multiple_of(d_off, 16)
            k_lo = tl.multiple_of(k_lo, 16)
        b_ptrs = (d_ptr + d_off + (k_lo + offs_k)[:, None].to(tl.int64) * stride_dk
                  + offs_n[None, :].to(tl.int64) * stride_dn)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            if EVEN_W:  # every live width a multiple of BK: no mask along the contiguous k (vector loads)
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
            else:
                km = offs_k < k_hi - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=km[:, None] & nmask[None, :], other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            a_ptrs += BK
            b_ptrs += BK * stride_dk
        if HAS_DB:
            bias = tl.load(db_ptr + e * N + offs_n, mask=nmask & (pid_s == 0), other=0.0)
            acc += bias.to(tl.float32)[None, :]
        c = tl.load(w_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        acc = acc * c[:, None]
        y_ptrs = y_ptr + pid_s * numel * N + tok[:, None] * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])

    return gate_up_kernel, down_kernel


_KERNELS = None


def _get():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _kernels()
    return _KERNELS


@dataclass(frozen=True)
class Operands:
    """Prepared K2 operands (all on the bank's device; see the module docstring for the addressing)."""

    gate: torch.Tensor  # flat storage of gate weights (rows of length H)
    up: torch.Tensor
    down: torch.Tensor
    gate_off: torch.Tensor  # int64 [E] element offsets
    up_off: torch.Tensor
    down_off: torch.Tensor
    widths: torch.Tensor  # int32 [E] live widths
    down_strides: tuple[int, int]  # (stride_k, stride_n)
    hidden: int
    width: int  # allocated (max) width I
    gate_bias: torch.Tensor | None = None  # [E, I]
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None  # [E, H]
    act: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0
    aligned: bool = False  # every expert offset a multiple of 16 elements (16-byte vector loads)
    width_gcd: int = 1  # gcd of the live widths (a multiple of BK: the down K-loop needs no mask)

    @property
    def num_experts(self) -> int:
        return int(self.widths.numel())


def grouped_moe(
    ops: Operands,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    raw: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum, fp32 ``[T, H]``. ``x`` is ``[T, H]`` in the weights' dtype, or
    ``[2, T, H]`` (bank input, raw input) with ``raw [E]`` int32 choosing the plane per expert."""
    gate_up_kernel, down_kernel = _get()
    xs = x if x.dim() == 3 else x.unsqueeze(0)
    xs = xs.contiguous()
    t, h_dim = xs.shape[1], xs.shape[2]
    k = ids.shape[1]
    e_phys, i_max = ops.num_experts, ops.width
    cfg = config or pick_config(t, k, e_phys)
    numel = t * k
    dev = xs.device
    if numel == 0 or (i_max == 0 and ops.down_bias is None):
        return torch.zeros(t, h_dim, dtype=torch.float32, device=dev)
    elem = xs.element_size()
    check_config(
        "moe_grouped_gemm gate_up",
        pow2={"BM": cfg.bm, "BN": cfg.bn1, "BK": cfg.bk1},
        dot={"BM": cfg.bm, "BN": cfg.bn1, "BK": cfg.bk1},
        smem=smem_bytes(cfg.bm, cfg.bn1, cfg.bk1, cfg.stages, elem, b_tiles=2),
    )
    check_config(
        "moe_grouped_gemm down",
        pow2={"BM": cfg.bm, "BN": cfg.bn2, "BK": cfg.bk2},
        dot={"BM": cfg.bm, "BN": cfg.bn2, "BK": cfg.bk2},
        smem=smem_bytes(cfg.bm, cfg.bn2, cfg.bk2, cfg.stages, elem),
    )
    sorted_ids, eids, total = moe_align(ids, e_phys, cfg.bm, expert_map)
    m_blocks = -(-(numel + min(e_phys, numel) * (cfg.bm - 1)) // cfg.bm)  # used blocks never exceed this
    up = upcast()
    h_dtype = torch.float32 if (up and xs.dtype == torch.bfloat16) else xs.dtype
    prec = "ieee" if xs.dtype == torch.float32 else "tf32"
    hbuf = torch.empty(numel, max(i_max, 1), dtype=h_dtype, device=dev)
    dummy = ops.widths
    if i_max > 0:
        gate_up_kernel[(m_blocks, -(-i_max // cfg.bn1))](
            xs, dummy if raw is None else raw, ops.gate, ops.up, ops.gate_off, ops.up_off, ops.widths,
            dummy if ops.gate_bias is None else ops.gate_bias, dummy if ops.up_bias is None else ops.up_bias,
            hbuf, sorted_ids, eids, total,
            numel, h_dim, i_max, hbuf.stride(0), t * h_dim, float(ops.alpha), float(ops.limit),
            TOP_K=k, BM=cfg.bm, BN=cfg.bn1, BK=cfg.bk1, EVEN_K=h_dim % cfg.bk1 == 0,
            HAS_GB=ops.gate_bias is not None, HAS_UB=ops.up_bias is not None, HAS_RAW=raw is not None,
            ACT=ACT_CODES[ops.act], UPCAST=up, PREC=prec, ALIGN=ops.aligned, num_warps=cfg.warps,
            num_stages=cfg.stages,
        )
    n_blocks = -(-h_dim // cfg.bn2)
    split = cfg.split_k
    if split is None:
        active = min(e_phys, numel) * n_blocks
        split = max(1, min(4, -(-2 * _sm_count(dev) // active), -(-i_max // cfg.bk2)))
    # one split: per-slot results in the compute dtype (halves the y round trip at prefill, as vLLM's
    # [T, k, H] output); split-K partial sums stay fp32. K5 sums in fp32 either way.
    y_dtype = torch.float32 if split > 1 else h_dtype
    y = torch.empty(split, numel, h_dim, dtype=y_dtype, device=dev)
    flat_w = weights.reshape(-1).contiguous()
    down_kernel[(m_blocks, n_blocks, split)](
        hbuf, ops.down, ops.down_off, ops.widths, dummy if ops.down_bias is None else ops.down_bias,
        flat_w, y, sorted_ids, eids, total,
        numel, h_dim, hbuf.stride(0), ops.down_strides[0], ops.down_strides[1],
        BM=cfg.bm, BN=cfg.bn2, BK=cfg.bk2, SPLIT_K=split, HAS_DB=ops.down_bias is not None,
        UPCAST=up, PREC=prec, ALIGN=ops.aligned, EVEN_W=ops.width_gcd % cfg.bk2 == 0, num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return moe_combine(y, k, ids=ids, num_experts=e_phys, expert_map=expert_map)


def operands(bank) -> Operands | None:
    """K2 operands of a bank whose gate, up and down are ``dense`` or ``ragged`` (no copy of the weights
    unless a dense weight is non-contiguous); ``None`` for any other layout."""
    g, u, d = bank.gate, bank.up, bank.down
    if {g.kind, u.kind, d.kind} - {"dense", "ragged"}:
        return None
    if (g.kind == "ragged" and g.axis != "out") or (u.kind == "ragged" and u.axis != "out"):
        return None
    if d.kind == "ragged" and d.axis != "in":
        return None
    dtypes = {g.dtype, u.dtype, d.dtype}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    e, i, h = g.shape
    dev = (g.weight if g.kind == "dense" else g.rows).device
    if dev.type == "meta":
        return None
    widths = (bank.widths if bank.widths is not None else torch.full((e,), i, device=dev)).to(dev, torch.int32)

    def rows_off(lay):
        if lay.kind == "dense":
            return lay.weight.contiguous(), torch.arange(e, device=dev, dtype=torch.int64) * (i * h)
        off = torch.cat([lay.widths.new_zeros(1), lay.widths.cumsum(0)[:-1]]).to(dev, torch.int64)
        return lay.rows.contiguous(), off * h

    gw, goff = rows_off(g)
    uw, uoff = rows_off(u)
    if d.kind == "dense":
        dw, doff, strides = d.weight.contiguous(), torch.arange(e, device=dev, dtype=torch.int64) * (h * i), (1, i)
    else:
        dw, doff = rows_off(d)
        strides = (h, 1)
    b = bank.biases

    def bias(name):
        return None if name not in b else b[name].to(dev).contiguous()

    aligned = h % 16 == 0 and all(bool((o % 16 == 0).all()) for o in (goff, uoff, doff))
    return Operands(
        gw, uw, dw, goff, uoff, doff, widths, strides, h, i,
        bias("gate"), bias("up"), bias("down"), bank.act.value, float(bank.alpha), float(bank.limit), aligned,
        math.gcd(*(int(w) for w in widths.tolist())),
    )


@dataclass
class GroupedPrepared:
    """``prepare_triton``'s result for dense/ragged banks: ``forward(x, ids, weights) -> [T, H]`` fp32.
    Every tensor is on the weights' device, the bank's input transform (``reference.bank_input``) too."""

    ops: Operands
    expert_map: torch.Tensor | None
    raw: torch.Tensor | None  # int32 [E]: 1 for experts reading the untransformed input
    rotation: torch.Tensor | None = None
    act_bits: int | None = None
    config: GemmConfig | None = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dt = self.ops.gate.dtype
        xin = x if self.rotation is None else F.linear(x.to(self.rotation.dtype), self.rotation.T)
        xs = (xin if self.act_bits is None else fake_quant_tokens(xin, self.act_bits)).to(dt)
        if self.raw is not None:
            xs = torch.stack([xs, x.to(dt)])
        return grouped_moe(self.ops, xs, ids, weights, self.expert_map, self.raw, self.config)

    __call__ = forward


def prepare(bank, expert_map: torch.Tensor | None = None) -> GroupedPrepared | None:
    """Load-time preparation for a dense/ragged bank (``None`` when another family must serve it)."""
    ops = operands(bank)
    if ops is None:
        return None
    transformed = bank.rotation is not None or bank.act_bits is not None
    raw = None
    if transformed and bank.unrotated:
        raw = torch.zeros(ops.num_experts, dtype=torch.int32, device=ops.widths.device)
        raw[sorted(bank.unrotated)] = 1
    emap = None if expert_map is None else expert_map.to(ops.widths.device, torch.int64).contiguous()
    rotation = None if bank.rotation is None else bank.rotation.to(ops.widths.device)
    return GroupedPrepared(ops, emap, raw, rotation, bank.act_bits)


__all__ = ["CONFIGS", "GemmConfig", "GroupedPrepared", "Operands", "grouped_moe", "moe_loop", "operands",
           "pick_config", "prepare"]
