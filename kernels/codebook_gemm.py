"""K3 ``moe_codebook_gemm``: MoE experts stored as ``codebook`` or ``rtn`` codes, dequantised in the tile load.

Both layouts store, per compressed expert ``m`` and output row ``n``, bit-packed codes ``q`` (2/3/4/8
bits, :mod:`moecompress.layouts.bitpack`) and per-group parameters over ``G`` groups of ``gs`` inputs::

    codebook:  W[m][n, j] = C[m, n, j // gs, q]                 (fp16 centroids, 2^bits per group)
    rtn:       W[m][n, j] = (q − z[m, n, j // gs]) · s[m, n, j // gs]   (fp16 scales, uint8 zeros or 2^(b−1))

Two launches per MoE layer after K1's alignment (vLLM ``fused_moe`` skeleton, KERNELS.md §2, §4 K3):

1. ``gate_up``: one program per (M-block of slots of one expert, N-block of its live width). The A tile
   (rows of ``x`` gathered through ``sorted_token_ids // k``) is shared by the gate and the up tile;
   each B tile is decoded in registers from the packed bytes (shift and mask; 3-bit codes read two
   bytes), then a centroid gather from the row's table (L1-resident: ``2^bits`` entries per group; or,
   with ``Config(lut="reg")``, a ``[2^bits, BN]`` register copy loaded once per program or K block and
   indexed by ``tl.gather``) or ``(q − z)·s``; two fp32 accumulators; SwiGLU (or GPT-OSS's clamped
   form, biases) in the epilogue;
   ``h`` stored per slot ``[T·k, I]`` — no ``[T·k, 2I]`` intermediate, no dense weight anywhere.
2. ``down``: reduction over the expert's live width (runtime bound), split-K across programs for
   decode, routed weight (and bias) in the epilogue, fp32 partials ``[S, T·k, H]`` summed over
   splits and the top-k slots (deterministic, no atomics).

With one group per row (``G = 1``) the rtn scale moves to the epilogue (``acc · s[n]``; the tile holds
the small integers ``q − z``). Codes are repacked once at prepare time: rows padded to 16 bytes (+1
byte for 3-bit reads) so row starts are 16-byte aligned. Exact (protected) experts, the input
rotation and per-token activation quantisation are served around the kernels (:mod:`._routed`).

Paper/format references: CodeQuant-style per-row codebooks (METHODS.md), vLLM's
``fused_moe_kernel_gptq_awq`` for the zero-point/group-scale decode.

The two ``@triton.jit`` kernels are in :mod:`codebook_gemm_kernels`; this module holds the prepared layout,
the reference, the configs and the launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecompress.ir import Act, ExpertBank
from moecompress.kernels._launch import check_config, interpreting, next_pow2, smem_bytes, tl_dtype
from moecompress.kernels._routed import ExactExperts, Members, input_of, same_members
from moecompress.kernels.codebook_gemm_kernels import _kernels
from moecompress.kernels.codebook_gemv import GemvConfig, GemvPrepared, decode_config, decode_forward
from moecompress.kernels.codebook_gemv import prepare as prepare_gemv
from moecompress.layouts.bitpack import packed_size, unpack_bits
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.rtn import RTN

CODEBOOK, RTN_FMT = 0, 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compute_type(dtype: torch.dtype):
    """The tiles' Triton dtype: the model's, except bf16 under the interpreter (computed wrong there,
    KERNELS.md §5), which is upcast to fp32."""
    import triton.language as tl

    return tl.float32 if dtype == torch.bfloat16 and interpreting() else tl_dtype(dtype)


@dataclass(frozen=True, eq=False)
class QuantProj:
    """One projection's compressed experts, repacked for the kernel: ``codes`` uint8 ``[M, rows,
    stride]`` (bitpack rows, zero-padded), ``table`` (codebook: centroids ``[M, rows, G, 2^bits]`` in
    the compute dtype; rtn: fp16 scales ``[M, rows, G]``), ``zeros`` uint8 ``[M, rows, G]`` or ``None``
    (rtn symmetric: ``z = 2^(bits−1)``), ``cols`` stored inputs."""

    fmt: int
    codes: torch.Tensor
    table: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    rows: int
    cols: int

    @property
    def groups(self) -> int:
        return int(self.table.shape[2])

    @property
    def group_size(self) -> int:
        return self.cols // self.groups

    def same_format(self, other: QuantProj) -> bool:
        return (self.fmt, self.bits, self.rows, self.cols, self.groups, self.zeros is None) == (
            other.fmt, other.bits, other.rows, other.cols, other.groups, other.zeros is None)  # fmt: skip


def _repack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows padded to a multiple of 16 bytes, with one spare byte for the 3-bit two-byte read."""
    m, n, nb = codes.shape
    stride = -(-(nb + (bits == 3)) // 16) * 16
    out = codes.new_zeros(m, n, stride)
    out[..., :nb] = codes
    return out


def quant_proj(lay, dtype: torch.dtype, device: torch.device) -> QuantProj | None:
    """The kernel's view of a ``Codebook`` or ``RTN`` layout (``None`` for other layouts)."""
    if isinstance(lay, Codebook):
        cb = lay.centroids.to(device, dtype).contiguous()  # the reference decodes in the logical dtype
        rows, cols = lay.stored
        return QuantProj(CODEBOOK, _repack(lay.codes.to(device), lay.bits), cb, None, lay.bits, rows, cols)
    if isinstance(lay, RTN):
        z = None if lay.zeros is None else lay.zeros.to(device).contiguous()
        sc = lay.scales.to(device).contiguous()
        _, rows, cols = lay.shape
        return QuantProj(RTN_FMT, _repack(lay.codes.to(device), lay.bits), sc, z, lay.bits, rows, cols)
    return None


def dequant(p: QuantProj, m: int) -> torch.Tensor:
    """Plain-PyTorch reference decode of compressed expert ``m``: fp32 ``[rows, cols]`` (§4 K3)."""
    q = unpack_bits(p.codes[m, :, : packed_size(p.cols, p.bits)].contiguous(), p.bits, p.cols).long()
    g, gs = p.groups, p.group_size
    if p.fmt == CODEBOOK:
        return p.table[m].gather(2, q.view(p.rows, g, gs)).reshape(p.rows, p.cols).float()
    z = (1 << (p.bits - 1)) if p.zeros is None else p.zeros[m].long()[..., None]
    w = (q.view(p.rows, g, gs) - z).float() * p.table[m].float()[..., None]
    return w.reshape(p.rows, p.cols)


def codebook_moe_ref(
    x: torch.Tensor, gate: QuantProj, up: QuantProj, down: QuantProj, widths: torch.Tensor,
    mids: torch.Tensor, weights: torch.Tensor, act: Act = Act.SWIGLU, alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:
    """§4 K3 reference: dequantise each hit expert, then the plain MoE loop; ``mids [T, k]`` member
    indices (``>= M`` skipped), fp32 ``[T, H]``."""
    from moecompress.kernels._routed import act_fn

    out = torch.zeros(x.shape[0], down.rows, dtype=torch.float32, device=x.device)
    for m in torch.unique(mids).tolist():
        if m >= widths.numel():
            continue
        tok, slot = torch.where(mids == m)
        n = int(widths[m])
        xs = x[tok].float()
        h = act_fn(act, alpha, limit, xs @ dequant(gate, m)[:n].t(), xs @ dequant(up, m)[:n].t())
        out.index_add_(0, tok, (h @ dequant(down, m)[:, :n].t()) * weights[tok, slot, None].float())
    return out


@dataclass(frozen=True)
class Config:
    """Blocks of the two launches; ``split_k`` splits the down reduction across programs (decode)."""

    bm: int = 16
    bn: int = 64
    bk: int = 64
    bn_down: int = 64
    bk_down: int = 64
    split_k: int = 1
    stages: int = 3
    warps: int = 4
    lut: str = "l1"  # codebook centroids: "l1" (gather loads, L1-served) or "reg" (tl.gather, registers)


def pick_config(numel: int, experts: int, inter: int, hidden: int) -> Config:
    """A fixed config per bucket of tokens per expert ``numel / experts`` (§7 compile budget; [est],
    tune on a GPU); under the interpreter, the fewest loop steps."""
    if interpreting():
        p2 = lambda v: min(128, max(16, next_pow2(v)))  # noqa: E731
        return Config(16, p2(inter), p2(hidden), p2(hidden), p2(inter), 1, 1)
    me = numel / max(experts, 1)
    if me <= 2:  # decode: narrow gate/up tiles for parallelism; split the down reduction to fill 2 waves
        active = min(experts, numel) * cdiv(hidden, 64)
        return Config(16, 32, 128, 64, 128, max(1, min(4, 264 // max(active, 1), cdiv(inter, 256))), 4, 4)
    if me <= 16:
        return Config(16, 64, 128, 64, 128, 1, 3, 4)
    if me <= 64:
        return Config(32, 64, 64, 128, 64, 1, 3, 4)
    return Config(64, 64, 64, 128, 64, 1, 3, 8)


def _lut(cfg: Config, p: QuantProj, bk: int) -> int:
    """The ``LUT`` constexpr: 0 centroids gathered from L1; register tables (``cfg.lut == "reg"``,
    codebook) 1 once per program (one group per row), 2 once per K block (groups of whole K blocks)."""
    if cfg.lut != "reg" or p.fmt != CODEBOOK or (p.groups > 1 and p.group_size % bk):
        return 0
    return 1 if p.groups == 1 else 2


@dataclass(frozen=True, eq=False)
class CodebookPrepared:
    """A ``codebook``/``rtn`` bank ready for K3; :meth:`forward` is the whole routed-experts sum."""

    gate: QuantProj
    up: QuantProj
    down: QuantProj
    members: Members
    widths: torch.Tensor  # [M] int32 live width of each compressed expert
    biases: dict[str, torch.Tensor]  # by member index
    act: Act
    alpha: float
    limit: float
    rotation: torch.Tensor | None
    act_bits: int | None
    exact: ExactExperts | None
    max_width: int  # the longest down reduction (split-K planning without a device sync)
    dtype: torch.dtype
    config: Config | GemvConfig | None = None  # forces the GEMM (Config) or the decode kernel (GemvConfig)
    gemv: GemvPrepared | None = None  # the decode layout (codebook_gemv), None when its tiles do not fit

    def decode_config(self, numel: int) -> GemvConfig | None:
        """The decode kernel's config for ``numel`` routed slots, or ``None`` for the K3 GEMM: the
        forced config, else the tokens-per-expert bucket (:data:`codebook_gemv.DECODE_CONFIGS`)."""
        if self.gemv is None or isinstance(self.config, Config):
            return None
        if isinstance(self.config, GemvConfig):
            return self.config
        return decode_config(numel, self.members.count)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``Σ_k w[t, k] · expert_{ids[t, k]}(x_t)``, fp32 ``[T, H]`` (``reference.experts_forward``)."""
        from moecompress.kernels.combine import moe_combine
        from moecompress.kernels.moe_align import moe_align

        t, k = ids.shape
        h_dim = self.down.rows
        out = torch.zeros(t, h_dim, dtype=torch.float32, device=x.device)
        if t == 0:
            return out
        xin = input_of(self.rotation, self.act_bits, x)
        m, cmap = self.members.count, self.members.cmap
        if m:
            numel = t * k
            dec = self.decode_config(numel)
            if dec is not None:  # few tokens per expert: the bandwidth-shaped GEMV (codebook_gemv)
                y = decode_forward(self, self.gemv, dec, xin.to(self.dtype).contiguous(), ids, weights)
                out += moe_combine(y, k, ids=ids, num_experts=m, expert_map=cmap)
                if self.exact is not None:
                    out += self.exact.forward(x, xin, ids, weights)
                return out
            inter = int(self.gate.rows)
            cfg = self.config if isinstance(self.config, Config) else pick_config(numel, m, inter, h_dim)
            sorted_ids, eids, total = moe_align(ids, m, cfg.bm, cmap)  # exact experts' slots dropped
            xa = xin.to(self.dtype).contiguous()
            h = torch.empty(numel, inter, dtype=self.dtype, device=x.device)
            y = torch.empty(cfg.split_k, numel, h_dim, dtype=torch.float32, device=x.device)
            n_mb = cdiv(numel + min(m, numel) * (cfg.bm - 1), cfg.bm)  # blocks K1 can fill at most
            self._launch(cfg, n_mb, xa, h, y, sorted_ids, eids, total, weights.reshape(-1).float().contiguous(), k)
            out += moe_combine(y, k, ids=ids, num_experts=m, expert_map=cmap)  # K5: fixed order, no atomics
        if self.exact is not None:
            out += self.exact.forward(x, xin, ids, weights)
        return out

    def _launch(self, cfg, n_mb, xa, h, y, sorted_ids, eids, total, rw, top_k) -> None:
        ks = _kernels()
        g, u, d = self.gate, self.up, self.down
        cdt, esz = compute_type(self.dtype), xa.element_size()
        prec = "ieee" if self.dtype == torch.float32 else "tf32"  # fp32 models keep fp32 products on GPU
        numel, inter, hidden = h.shape[0], g.rows, d.rows
        check_config(
            "codebook gate_up", pow2={"BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk},
            dot={"BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk}, smem=smem_bytes(cfg.bm, cfg.bn, cfg.bk, cfg.stages, esz, 2),
        )  # fmt: skip
        check_config(
            "codebook down", pow2={"BN": cfg.bn_down, "BK": cfg.bk_down},
            dot={"BM": cfg.bm, "BN": cfg.bn_down, "BK": cfg.bk_down},
            smem=smem_bytes(cfg.bm, cfg.bn_down, cfg.bk_down, cfg.stages, esz), atomic_dtype=None,
        )  # fmt: skip
        bias_g = self.biases.get("gate", xa)
        bias_u = self.biases.get("up", xa)
        scale_epi = g.fmt == RTN_FMT and g.groups == 1
        ks["gate_up"][(n_mb, -(-inter // cfg.bn))](
            xa, h, sorted_ids, eids, total, self.widths,
            g.codes, g.table, g.zeros if g.zeros is not None else g.codes,
            u.codes, u.table, u.zeros if u.zeros is not None else u.codes, bias_g, bias_u,
            numel, top_k, g.cols, xa.stride(0), h.stride(0), g.codes.stride(0), g.codes.stride(1), g.rows,
            g.groups, g.group_size, bias_g.shape[-1] if "gate" in self.biases else 0, self.alpha, self.limit,
            FMT=g.fmt, BITS=g.bits, HAS_ZERO=g.zeros is not None, SCALE_EPI=scale_epi,
            ACT=int(self.act is Act.SWIGLU_CLAMPED), HAS_BIAS="gate" in self.biases,
            LUT=_lut(cfg, g, cfg.bk), CDT=cdt, PREC=prec,
            BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        k_split = cdiv(cdiv(self.max_width, cfg.bk_down), cfg.split_k) * cfg.bk_down
        bias_d = self.biases.get("down", y)
        ks["down"][(n_mb, -(-hidden // cfg.bn_down), cfg.split_k)](
            h, y, sorted_ids, eids, total, self.widths, rw,
            d.codes, d.table, d.zeros if d.zeros is not None else d.codes, bias_d,
            numel, hidden, h.stride(0), y.stride(1), y.stride(0), d.codes.stride(0), d.codes.stride(1),
            d.groups, d.group_size, k_split,
            FMT=d.fmt, BITS=d.bits, HAS_ZERO=d.zeros is not None, SCALE_EPI=d.fmt == RTN_FMT and d.groups == 1,
            HAS_BIAS="down" in self.biases, LUT=_lut(cfg, d, cfg.bk_down), CDT=cdt, PREC=prec,
            BM=cfg.bm, BN=cfg.bn_down, BK=cfg.bk_down, num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip


def prepare(
    bank: ExpertBank, expert_map: torch.Tensor | None, config: Config | GemvConfig | None = None
) -> CodebookPrepared | None:
    """Prepare a bank whose gate/up/down are ``codebook`` or ``rtn`` (gate and up in the same format)
    for K3, once at load time; ``None`` when K3 cannot serve it (other layouts, gate/up formats that
    differ, experts exact in one projection only, a rotated-input exemption on a compressed expert)."""
    lays = (bank.gate, bank.up, bank.down)
    if any(lay.kind not in ("codebook", "rtn") for lay in lays) or bank.gate.members.device.type == "meta":
        return None
    dtype = bank.gate.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16) or not same_members(*(lay.members for lay in lays)):
        return None
    device = bank.gate.codes.device
    g, u, d = (quant_proj(lay, dtype, device) for lay in lays)
    if not g.same_format(u) or d.rows != bank.hidden_size:
        return None
    mem = Members.of(bank.gate.members, expert_map, device)
    sel = torch.nonzero(bank.gate.members >= 0).flatten().to(device)
    if any(int(e) in bank.unrotated for e in sel.tolist()):
        return None
    full = (torch.full((bank.num_experts,), bank.width, dtype=torch.int64, device=device) if bank.widths is None
            else bank.widths)  # fmt: skip
    widths = full.to(device)[sel].clamp(max=min(g.rows, d.cols)).to(torch.int32).contiguous()
    biases = {k: v.to(device, dtype)[sel].contiguous() for k, v in bank.biases.items()}
    ex = [(lay.exact if lay.kind == "codebook" else lay.dense_experts).to(device) for lay in lays]
    exact = ExactExperts.of(bank, bank.gate.members, expert_map, *ex)
    return CodebookPrepared(
        g, u, d, mem, widths, biases, bank.act, bank.alpha, bank.limit,
        None if bank.rotation is None else bank.rotation.to(device), bank.act_bits, exact,
        int(widths.max()) if widths.numel() else 0, dtype, config,
        None if isinstance(config, Config) else prepare_gemv(g, u, d),
    )  # fmt: skip
