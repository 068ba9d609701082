"""K4 ``moe_lowrank``: MoE experts stored as ``tucker`` (shared factors, per-expert cores) or ``lowrank``
(per-expert factors) without ever forming a dense weight.

Every factorised projection is ``W_e = Q_e · P_e`` with a rank-``R_e`` middle space, so one expert
applied to rows ``a`` is a *shrink* ``c = a · P_eᵀ`` then an *expand* ``Q_e · c`` (vLLM's LoRA
SGMV/BGMV split, on K1's expert-sorted slots)::

    tucker gate/up:  z = x · U_in (once per token, torch)   shrink  c = z · C_mᵀ    expand  U_out · c   (shared)
    lowrank gate/up:                                        shrink  c = x · v_mᵀ    expand  u_m · c
    tucker down:     shrink  d = h · U_in_d (shared)       expand  e = C^d_m · d   weighted k-sum [T, r2]  →  · U_out_dᵀ once per token
    lowrank down:    shrink  d = h · v^d_mᵀ                expand  y = u^d_m · d   weighted k-sum [T, H]

Launches per layer: gate/up = shrink (gate and up in one grid) + expand (both accumulators, bias,
SwiGLU or GPT-OSS's clamp in the epilogue, ``h`` per slot); down = shrink + expand (routed weight in
the epilogue, fp32 per-slot rows), then one sum over the top-k slots and (tucker) one ``U_out_d``
matmul — the k-sum happens in rank space (KERNELS.md §4 K4, TD-MoE's algebra). Shrinks split K
across programs at decode (fp32 partials summed by the expand's load); ranks are per-expert runtime
bounds (``lowrank``'s packed factors of different ranks, offsets from an exclusive cumsum).

Bytes at decode: the shared factors once (L2-resident across programs) plus the routed experts'
cores/factors; nothing is recomputed per output block (the shrink output is a ``[T·k, R]`` buffer).
Exact (protected) experts, the input transform and down biases in rank space: :mod:`._routed`.

The two ``@triton.jit`` kernels are in :mod:`factorized_kernels`; this module holds the stages, the reference,
the configs and the launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecompress.ir import Act, ExpertBank
from moecompress.kernels._launch import check_config, interpreting, next_pow2, smem_bytes
from moecompress.kernels._routed import (
    ExactExperts,
    Members,
    act_fn,
    bias_sum,
    input_of,
    logical_bias,
    same_members,
)
from moecompress.kernels.codebook_gemm import cdiv, compute_type
from moecompress.kernels.factorized_kernels import _kernels
from moecompress.layouts.lowrank import LowRank
from moecompress.layouts.tucker import Tucker


@dataclass(frozen=True, eq=False)
class Stage:
    """One shrink or expand of ``Z`` projections (gate and up: ``Z = 2``) over ``M`` experts: element
    ``(r, j)`` of expert ``m``'s matrix of projection ``z`` is ``flat[off[z, m] + r·ld[z] + j]``;
    ``rank[z, m]`` its live rows (shrink) / columns (expand); ``dim[z]`` the reduced length (shrink)
    or output length (expand); ``col[z]`` where ``z`` reads (shrink: A, expand: C) its columns."""

    flat: torch.Tensor
    off: torch.Tensor  # int64 [Z, M]
    rank: torch.Tensor  # int32 [Z, M]
    ld: torch.Tensor  # int64 [Z]
    dim: torch.Tensor  # int64 [Z]
    col: torch.Tensor  # int64 [Z]
    rank_max: tuple[int, ...]  # host copies (launch planning without a device sync)
    dims: tuple[int, ...]
    cols: tuple[int, ...]

    @property
    def z(self) -> int:
        return len(self.dims)

    def max_rank(self) -> int:
        return max(self.rank_max)


def _stage(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]], dtype, device) -> Stage:
    """``parts``: per projection ``(matrix storage, per-expert element offsets, ranks, ld, dim, col)``."""
    flats, offs, base = [], [], 0
    for mat, off, *_ in parts:
        flats.append(mat.reshape(-1))
        offs.append(off.to(torch.int64) + base)
        base += mat.numel()
    t = lambda vals: torch.tensor(vals, dtype=torch.int64, device=device)  # noqa: E731
    ranks = torch.stack([p[2].to(torch.int32) for p in parts])
    rank_max = tuple(int(r.max()) if r.numel() else 0 for r in ranks)
    return Stage(
        torch.cat(flats).to(device, dtype).contiguous(), torch.stack(offs).to(device).contiguous(),
        ranks.to(device).contiguous(), t([p[3] for p in parts]), t([p[4] for p in parts]), t([p[5] for p in parts]),
        rank_max, tuple(int(p[4]) for p in parts), tuple(int(p[5]) for p in parts),
    )  # fmt: skip


def _cores(lay: Tucker) -> torch.Tensor:
    """Per-expert cores ``[M, r2, r3]`` (a truncated expert mode folded in once: ``C_m = Σ_j U_e[m, j] G_j``)."""
    if lay.u_expert is None:
        return lay.core
    return torch.einsum("mj,jab->mab", lay.u_expert.float(), lay.core.float()).to(lay.core.dtype)


def _lowrank_parts(lay: LowRank) -> tuple[torch.Tensor, torch.Tensor]:
    ranks = lay.ranks.to(torch.int64)
    return torch.cat([ranks.new_zeros(1), ranks.cumsum(0)])[:-1], ranks


def _index_makers(m: int, device) -> tuple[torch.Tensor, object]:
    """Per-member int64 zeros ``[m]`` and ``full(v)`` (``[m]`` of ``v``), made on ``device`` (no host copy)."""
    zero = torch.zeros(m, dtype=torch.int64, device=device)
    return zero, lambda v: torch.full((m,), int(v), dtype=torch.int64, device=device)


def gate_up_stages(g, u, m: int, dtype, device) -> tuple[Stage, Stage, torch.Tensor | None]:
    """Shrink and expand of gate+up (``Z = 2``), and (tucker) the shared input factor ``[H, r3g + r3u]``."""
    zero, full = _index_makers(m, device)
    if isinstance(g, Tucker):
        cg, cu = _cores(g), _cores(u)
        (r2g, r3g), (r2u, r3u) = cg.shape[1:], cu.shape[1:]
        ar = torch.arange(m, dtype=torch.int64, device=device)
        shrink = _stage([(cg, ar * r2g * r3g, full(r2g), r3g, r3g, 0),
                         (cu, ar * r2u * r3u, full(r2u), r3u, r3u, r3g)], dtype, device)  # fmt: skip
        expand = _stage([(g.u_out, zero, full(r2g), r2g, g.shape[1], 0),
                         (u.u_out, zero, full(r2u), r2u, u.shape[1], r2g)], dtype, device)  # fmt: skip
        return shrink, expand, torch.cat([g.u_in, u.u_in], 1).to(device, dtype).contiguous()
    (og, rg), (ou, ru) = _lowrank_parts(g), _lowrank_parts(u)
    h, rmax = g.shape[2], int(rg.max()) if m else 0
    shrink = _stage([(g.v, og * h, rg, h, h, 0), (u.v, ou * h, ru, h, h, 0)], dtype, device)
    expand = _stage([(g.u, og, rg, g.u.shape[1], g.shape[1], 0),
                     (u.u, ou, ru, u.u.shape[1], u.shape[1], rmax)], dtype, device)  # fmt: skip
    return shrink, expand, None


def down_stages(d, m: int, dtype, device) -> tuple[Stage, Stage, torch.Tensor | None]:
    """Shrink and expand of down (``Z = 1``), and (tucker) the shared output factor ``U_out_d [H, r2]``."""
    zero, full = _index_makers(m, device)
    _, hidden, inter = d.shape
    if isinstance(d, Tucker):
        c = _cores(d)
        r2, r3 = c.shape[1:]
        shrink = _stage([(d.u_in.t().contiguous(), zero, full(r3), inter, inter, 0)], dtype, device)
        ar = torch.arange(m, dtype=torch.int64, device=device)
        expand = _stage([(c, ar * r2 * r3, full(r3), r3, r2, 0)], dtype, device)
        return shrink, expand, d.u_out.to(device, dtype).contiguous()
    off, ranks = _lowrank_parts(d)
    shrink = _stage([(d.v, off * inter, ranks, inter, inter, 0)], dtype, device)
    expand = _stage([(d.u, off, ranks, d.u.shape[1], hidden, 0)], dtype, device)
    return shrink, expand, None


def factorized_moe_ref(
    x: torch.Tensor, gate, up, down, mids: torch.Tensor, weights: torch.Tensor,
    act: Act = Act.SWIGLU, alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:
    """§4 K4 reference (``tucker_moe`` generalised to both layouts): ``mids [T, k]`` member indices
    (``>= M`` skipped); tucker shares ``U_in`` once per token and ``U_out_d`` after the rank-space
    k-sum. fp32 ``[T, H]``."""

    def proj(lay, a: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(lay, Tucker):  # returns (value in rank space, factor to decode with)
            z = a @ lay.u_in.float()
            return torch.einsum("nr,nqr->nq", z, _cores(lay).float()[m]), lay.u_out.float()
        off, ranks = _lowrank_parts(lay)
        rows = [lay.u[:, o : o + r].float() @ (lay.v[o : o + r].float() @ a[i]) for i, (o, r) in
                enumerate(zip(off[m].tolist(), ranks[m].tolist()))]  # fmt: skip
        return torch.stack(rows) if rows else a.new_zeros(0, lay.shape[1]), None

    t = mids.shape[0]
    m_count = int(gate.members.ge(0).sum())
    keep = mids < m_count
    tok, slot = torch.where(keep)
    mm = mids[tok, slot]
    xs = x[tok].float()
    (cg, ug), (cu, uu) = proj(gate, xs, mm), proj(up, xs, mm)
    g = cg if ug is None else cg @ ug.t()
    u = cu if uu is None else cu @ uu.t()
    val, ud = proj(down, act_fn(act, alpha, limit, g, u), mm)
    acc = torch.zeros(t, val.shape[1], dtype=torch.float32, device=x.device)
    acc.index_add_(0, tok, val * weights[tok, slot, None].float())
    return acc if ud is None else acc @ ud.t()


@dataclass(frozen=True)
class Config:
    """Blocks: ``BM`` slots, ``BR`` rank, ``BK`` reduction, ``BN`` output; ``split_k`` for the shrinks."""

    bm: int = 16
    br: int = 32
    bk: int = 64
    bn: int = 64
    split_k: int = 1
    stages: int = 3
    warps: int = 4


def pick_config(numel: int, experts: int, max_k: int, max_rank: int, max_n: int) -> Config:
    """A fixed config per bucket of tokens per expert (§7 compile budget; [est], tune on a GPU); under
    the interpreter, the fewest loop steps."""
    if interpreting():
        p2 = lambda v: min(128, max(16, next_pow2(v)))  # noqa: E731
        return Config(16, p2(max_rank), p2(max_k), p2(max_n), 1, 1)
    me = numel / max(experts, 1)
    if me <= 2:  # decode: split the long reductions (lowrank's H) across programs
        return Config(16, 32, 128, 64, max(1, min(4, max_k // 512)), 4, 4)
    if me <= 32:
        return Config(16, 64, 64, 64, 1, 3, 4)
    return Config(64, 64, 64, 64, 1, 3, 4)


@dataclass(frozen=True, eq=False)
class FactorizedPrepared:
    """A ``tucker``/``lowrank`` bank ready for K4; :meth:`forward` is the whole routed-experts sum."""

    gu_shrink: Stage
    gu_expand: Stage
    u_in: torch.Tensor | None  # tucker: [H, r3g + r3u], applied once per token
    d_shrink: Stage
    d_expand: Stage
    u_out_d: torch.Tensor | None  # tucker: [H, r2d], applied once per token after the k-sum
    members: Members
    biases: dict[str, torch.Tensor]  # gate/up by member; down by physical id (rank space) or member
    act: Act
    alpha: float
    limit: float
    rotation: torch.Tensor | None
    act_bits: int | None
    exact: ExactExperts | None
    hidden: int
    inter: int
    dtype: torch.dtype
    config: Config | None = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``Σ_k w[t, k] · expert_{ids[t, k]}(x_t)``, fp32 ``[T, H]`` (``reference.experts_forward``)."""
        from moecompress.kernels.combine import moe_combine
        from moecompress.kernels.moe_align import moe_align

        t, k = ids.shape
        out = torch.zeros(t, self.hidden, dtype=torch.float32, device=x.device)
        if t == 0:
            return out
        xin = input_of(self.rotation, self.act_bits, x)
        m, cmap = self.members.count, self.members.cmap
        if m:
            numel = t * k
            cfg = self.config or pick_config(
                numel, m, max(self.hidden, self.inter), max(self.gu_shrink.max_rank(), self.d_shrink.max_rank()),
                max(self.hidden, self.inter),
            )  # fmt: skip
            sorted_ids, eids, total = moe_align(ids, m, cfg.bm, cmap)  # exact experts' slots dropped
            n_mb = cdiv(numel + min(m, numel) * (cfg.bm - 1), cfg.bm)  # blocks K1 can fill at most
            rw = weights.reshape(-1).float().contiguous()
            a = xin.to(self.dtype)
            a = (a @ self.u_in if self.u_in is not None else a).contiguous()
            h = torch.empty(numel, self.inter, dtype=self.dtype, device=x.device)
            meta = (n_mb, sorted_ids, eids, total, rw)
            self._pair(cfg, a, k, h, self.gu_shrink, self.gu_expand, meta, dual=True)
            y = torch.empty(numel, self.d_expand.dims[0], dtype=torch.float32, device=x.device)
            self._pair(cfg, h, 1, y, self.d_shrink, self.d_expand, meta, dual=False)
            y = moe_combine(y, k, ids=ids, num_experts=m, expert_map=cmap)  # K5 top-k sum (tucker: rank space)
            if self.u_out_d is not None:
                y = (y.to(self.dtype) @ self.u_out_d.t()).float()
                if "down" in self.biases:
                    y = y + bias_sum(self.biases["down"], ids, weights)
            out += y
        if self.exact is not None:
            out += self.exact.forward(x, xin, ids, weights)
        return out

    def _pair(self, cfg, a, a_div, out, shrink: Stage, expand: Stage, meta, dual) -> None:
        """One shrink + one expand launch (gate+up when ``dual``, else down)."""
        n_mb, sorted_ids, eids, total, rw = meta
        ks = _kernels()
        cdt, esz = compute_type(self.dtype), a.element_size()
        prec = "ieee" if self.dtype == torch.float32 else "tf32"
        check_config(
            "factorized", pow2={"BM": cfg.bm, "BR": cfg.br, "BK": cfg.bk, "BN": cfg.bn},
            dot={"BM": cfg.bm, "BR": cfg.br, "BK": cfg.bk, "BN": cfg.bn},
            smem=max(smem_bytes(cfg.bm, cfg.br, cfg.bk, cfg.stages, esz),
                     smem_bytes(cfg.bm, cfg.bn, cfg.br, cfg.stages, 4)),
        )  # fmt: skip
        numel, m = out.shape[0], self.members.count
        kmax = max(shrink.dims)
        split = max(1, min(cfg.split_k, cdiv(kmax, cfg.bk)))  # no empty splits on short reductions
        k_split = cdiv(cdiv(kmax, cfg.bk), split) * cfg.bk
        width = max(c0 + r for c0, r in zip(expand.cols, shrink.rank_max))
        c = torch.empty(split, numel, max(width, 1), dtype=torch.float32, device=a.device)
        ks["shrink"][(n_mb, max(1, cdiv(shrink.max_rank(), cfg.br)), shrink.z * split)](
            a, c, sorted_ids, eids, total, shrink.flat, shrink.off, shrink.rank, shrink.ld, shrink.dim,
            shrink.col, expand.col, numel, a_div, m, a.stride(0), c.stride(0), c.stride(1), k_split,
            SPLIT=split, CDT=cdt, PREC=prec, BM=cfg.bm, BR=cfg.br, BK=cfg.bk,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        if dual:
            bg, bu, bias_on = self.biases.get("gate"), self.biases.get("up"), "gate" in self.biases
        else:  # lowrank's down output is the output space: its bias joins the routed weight there
            bg = self.biases.get("down_m") if self.u_out_d is None else None
            bu, bias_on = None, bg is not None
        bg = bg if bg is not None else rw
        bu = bu if bu is not None else bg
        ks["expand"][(n_mb, cdiv(max(expand.dims), cfg.bn))](
            c, out, sorted_ids, eids, total, expand.flat, expand.off, expand.rank, expand.ld, expand.dim,
            expand.col, rw, bg, bu, numel, m, c.stride(0), c.stride(1), out.stride(0),
            bg.shape[-1] if bias_on else 0, self.alpha, self.limit,
            SPLIT=split, DUAL=dual, ACT=int(self.act is Act.SWIGLU_CLAMPED), HAS_BIAS=bias_on,
            MUL_W=not dual, CDT=cdt, PREC=prec, BM=cfg.bm, BN=cfg.bn, BR=cfg.br,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip


def prepare(
    bank: ExpertBank, expert_map: torch.Tensor | None, config: Config | None = None
) -> FactorizedPrepared | None:
    """Prepare a bank whose gate and up are both ``tucker`` or both ``lowrank`` (down either) for K4,
    once at load time; ``None`` when K4 cannot serve it (other layouts, live-width cuts, experts exact
    in one projection only, a rotated-input exemption on a factorised expert)."""
    g, u, d = bank.gate, bank.up, bank.down
    kinds = (g.kind, u.kind, d.kind)
    if kinds[0] != kinds[1] or any(kd not in ("tucker", "lowrank") for kd in kinds):
        return None
    if g.members.device.type == "meta" or not same_members(g.members, u.members, d.members):
        return None
    if bank.widths is not None and bool((bank.widths < bank.width).any()):
        return None
    dtype = g.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16) or not (u.dtype == d.dtype == dtype):
        return None
    device = (g.u_out if isinstance(g, Tucker) else g.u).device
    mem = Members.of(g.members, expert_map, device)
    sel = torch.nonzero(g.members >= 0).flatten()
    if any(int(e) in bank.unrotated for e in sel.tolist()):
        return None
    gs, ge, u_in = gate_up_stages(g, u, mem.count, dtype, device)
    ds, de, u_out_d = down_stages(d, mem.count, dtype, device)
    biases = {n: bank.biases[n].to(device, dtype)[sel.to(device)].contiguous() for n in ("gate", "up")
              if n in bank.biases}  # fmt: skip
    if "down" in bank.biases:  # tucker sums in rank space: its bias by logical id, outside; lowrank's by member
        bd = bank.biases["down"].to(device)
        if u_out_d is not None:
            biases["down"] = logical_bias(bd, mem, expert_map)
        else:
            biases["down_m"] = bd.to(dtype)[sel.to(device)].contiguous()
    exact = None
    if mem.count < bank.num_experts:
        ex = [lay.exact if isinstance(lay, Tucker) else lay.dense_experts for lay in (g, u, d)]
        exact = ExactExperts.of(bank, g.members, expert_map, *(w.to(device) for w in ex))
    return FactorizedPrepared(
        gs, ge, u_in, ds, de, u_out_d, mem, biases, bank.act, bank.alpha, bank.limit,
        None if bank.rotation is None else bank.rotation.to(device), bank.act_bits, exact,
        bank.hidden_size, bank.width, dtype, config,
    )  # fmt: skip
