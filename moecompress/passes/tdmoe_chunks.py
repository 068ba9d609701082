"""``tdmoe``'s config, what its two ways of running share (the layer's live statistics), and its run in two
phases (``Chunking("expert")`` with ``gather``/``fit``/``take``/``add``, and :func:`whole` on a layer held
whole): the whitened mode Grams summed block by block over every expert, the shared factors fitted once per
layer, each expert's core projected onto them. tensorly's HOSVD/HOOI of the stacked experts (what the two
phases cannot do: ``hooi``, a truncated expert mode, ``budget: from_structure``) and the pass's spec are in
:mod:`moecompress.passes.tdmoe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import LayerStats, PassConfig, shifted_ids
from moecompress.errors import MethodError, PassError
from moecompress.ir import ExpertBank, MoELayer, fold_blocks
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.tucker import Tucker
from moecompress.methods.tucker import add_grams, gram_factors, sandwich, tucker_ranks, work_dtype
from moecompress.methods.whitening import Whitener, projection_whiteners
from moecompress.passes.neuron_pruning import one_width_members
from moecompress.reference import moe_forward

PROJ = ("gate", "up", "down")


class TdmoeConfig(PassConfig):
    ratio: float = Field(
        0.4, gt=0, lt=1, description="fraction of the decomposed experts' parameters removed"
    )
    whitening: Literal["input", "output", "both", "none"] = Field("input", description="data-aware whitening")
    input_form: Literal["chol", "inverse"] = Field("chol", description="input whitening factor")
    method: Literal["hosvd", "hooi"] = Field("hosvd", description="Tucker algorithm (tensorly)")
    r1: int | None = Field(None, ge=1, description="expert-mode rank (default: not truncated)")
    budget: Literal["uniform", "adaptive", "from_structure"] = Field(
        "uniform", description="same ratio per layer, by sensitivity, or per projection by expert structure"
    )


def check_dense(layer: MoELayer) -> None:
    for lay in (layer.experts.gate, layer.experts.up, layer.experts.down):
        if not isinstance(lay, (Dense, Ragged)):
            raise PassError(f"tdmoe needs dense experts, got a {lay.kind!r} layout; decompose before it")


class _DownInputCov:
    """Observer: E[h hᵀ] of the down-projection input over routed (token, expert) pairs."""

    def __init__(self, width: int) -> None:
        self.sum, self.n = torch.zeros(width, width, dtype=torch.float64), 0

    def on_route(self, logits, ids, weights) -> None: ...

    def on_shared(self, h, y) -> None: ...

    def on_expert(self, e, tok, slot, h, y) -> None:
        hd = h.detach().double()
        self.sum += hd.T @ hd
        self.n += hd.shape[0]


def live_stats(layer: MoELayer, stats: LayerStats, live: int, cfg: TdmoeConfig) -> LayerStats:
    """The layer's statistics; for a neuron-pruned bank (ragged, or narrower than at calibration), the
    down-input covariance is recomputed on the
    calibration sample through the pruned layer (the calibration statistics index the original neurons,
    which pruning selected per expert), cut to the live width."""
    width_stats = [stats[n] for n in ("down_in_cov_pooled", "down_in_grad_cov_pooled") if n in stats]
    if layer.experts.widths is None and all(t.shape[0] == layer.experts.width for t in width_stats):
        return stats
    if cfg.whitening in ("output", "both"):
        raise PassError(
            "output whitening needs gradient statistics of the pruned neurons, which calibration (run on the "
            "input model) does not have; use whitening: input after neuron pruning"
        )
    if cfg.whitening == "none":
        return stats
    obs = _DownInputCov(layer.experts.width)
    with torch.no_grad():
        moe_forward(layer, stats["io_sample_x"].to(layer.experts.gate.dtype), obs)
    cov = (obs.sum / max(obs.n, 1))[:live, :live]
    return LayerStats(stats.index, {**stats.tensors, "down_in_cov_pooled": cov})


# -- in two phases (engine/units.py, Chunking.gather / fit / take / add) ----------------------------------
# HOSVD with the expert mode kept (r1 = M) needs of every expert only the whitened mode Gram matrices: the
# factors U_out, U_in are the leading eigenvectors of G_out = Σ_e X_e X_eᵀ and G_in = Σ_e X_eᵀ X_e
# (X_e = A·W_e·B), the left singular vectors of the mode unfoldings that tensorly computes, and the
# per-expert cores C_e = U_outᵀ X_e U_in depend on expert e alone. A layer is swept twice: the Grams summed
# over every expert (``gather``), the factors fitted once (``fit``), then each expert projected onto them
# (``project``). The sums run block by block (``fold_blocks``: 8 fixed blocks of the layer's experts, each
# summed expert by expert from zero, then the blocks added in order: ``take``/``add``), the same order
# whether the layer is held whole (:func:`whole`), by chunks of any size, or gathered across ranks (each
# rank sums its blocks), so every way gives the same bytes. The cores need no whitened copy of an
# expert: C_e = U_outᵀ (A W_e B) U_in = (Aᵀ U_out)ᵀ W_e (B U_in), both outer factors made once by ``fit``;
# the whitened errors ‖X_e − U_out C_e U_inᵀ‖² = ‖X_e‖² − ‖C_e‖² (orthonormal factors), with ‖X_e‖²
# noted by ``gather``, summed per expert in order (:func:`merge_tdmoe`). Like tensorly's path
# (``tdmoe._factorise``), they are the decomposition's errors (in the work dtype, :func:`work_dtype`),
# before the factors are stored in the weights' dtype.


@dataclass
class Block:
    """Sums of one block of experts (:func:`~moecompress.ir.fold_blocks`), or of every block folded:
    per projection the lower triangles of ``G_out`` ``[out, out]`` and ``G_in`` ``[in, in]`` (in the work
    dtype, :func:`~moecompress.methods.whitening.gram_lower`), per expert of the step's input, in order,
    ``‖X_e‖²`` (0 for a protected one), and the decomposed experts seen."""

    g_out: dict[str, torch.Tensor]
    g_in: dict[str, torch.Tensor]
    energy: dict[str, list[float]]
    members: int = 0


@dataclass
class Grams:
    """The first sweep's fold: the whiteners (the layer's pooled statistics, made at the first chunk, float64;
    ``{}`` on a rank that has only added other ranks' blocks: :func:`fit` makes them), their copies in each
    projection's work dtype (``work``, :func:`~moecompress.methods.tucker.work_dtype`), the block being
    gathered (``block``, handed out by :func:`take`) and every block added so far (``total``, :func:`add`)."""

    whiteners: dict[str, Whitener]
    work: dict[str, Whitener] = field(default_factory=dict)
    block: Block | None = None
    total: Block | None = None


@dataclass
class Factors:
    """What every chunk of a layer reads (``stats.prelude``): the whiteners, the layer's ratio, its decomposed
    experts ``members`` (``M``, 0: every expert protected, the layer is left as it is), per projection the
    ranks ``(M, r2, r3)``, the stored factors ``outer`` (``A⁻¹U_out``, ``B⁻ᵀU_in``, in the weights' dtype),
    the factors that give the cores from the un-whitened experts ``inner`` (``AᵀU_out``, ``B U_in``, in
    the work dtype) and ``energy``: ``‖X_e‖²`` per expert of the step's input (``chunk(a, b)``: the chunk's)."""

    whiteners: dict[str, Whitener]
    ratio: float
    members: int
    ranks: dict[str, tuple[int, int, int]]
    outer: dict[str, tuple[torch.Tensor, torch.Tensor]]
    inner: dict[str, tuple[torch.Tensor, torch.Tensor]]
    energy: dict[str, torch.Tensor]

    def chunk(self, a: int, b: int) -> Factors:
        return replace(self, energy={p: v[a:b] for p, v in self.energy.items()})


def _expert(full: torch.Tensor, proj: str, e: int, live: int) -> torch.Tensor:
    return full[e, :live] if proj != "down" else full[e, :, :live]


def _start(layer: MoELayer, stats: LayerStats, cfg: TdmoeConfig, live: int, acc: Grams | None) -> Grams:
    """``acc`` with the whiteners (made once, from the layer's live statistics) and a block to gather into."""
    if acc is None or not acc.whiteners:
        whiteners = projection_whiteners(live_stats(layer, stats, live, cfg), cfg.whitening, cfg.input_form)
        cast: dict[int, Whitener] = {}  # gate and up share one whitener: one cast copy
        work = {}
        for proj in PROJ:
            wh = whiteners[proj]
            work[proj] = cast.setdefault(id(wh), wh.to(dtype=work_dtype(getattr(layer.experts, proj).dtype)))
        acc = Grams(whiteners, work, None, None if acc is None else acc.total)
    if acc.block is None:
        g_out, g_in = {}, {}
        for proj in PROJ:
            lay = getattr(layer.experts, proj)
            _, out, inp = lay.shape
            out, inp = (live, inp) if proj != "down" else (out, live)
            wd = work_dtype(lay.dtype)
            g_out[proj] = torch.zeros(out, out, dtype=wd)
            g_in[proj] = torch.zeros(inp, inp, dtype=wd)
        acc.block = Block(g_out, g_in, {p: [] for p in PROJ})
    return acc


def _dense(bank: ExpertBank) -> dict[str, torch.Tensor]:
    """Each projection's ``[E, out, in]`` weights (a ragged bank's rebuilt once)."""
    return {proj: getattr(bank, proj).dense() for proj in PROJ}


def _fold(acc: Grams, fulls: dict[str, torch.Tensor], a: int, b: int, members: list[int], live: int) -> None:
    """Experts ``[a, b)`` of the bank ``fulls`` (:func:`_dense`; ``members``: its decomposed experts) whitened
    and added to the block, one expert at a time."""
    blk, chosen = acc.block, [e for e in members if a <= e < b]
    for proj in PROJ:
        full, wh = fulls[proj], acc.work[proj]
        g_out, g_in = blk.g_out[proj], blk.g_in[proj]  # type: ignore[union-attr]
        energy = [0.0] * (b - a)
        for e in chosen:
            energy[e - a] = add_grams(wh.whiten(_expert(full, proj, e, live)).to(g_out.device), g_out, g_in)
        blk.energy[proj] += energy  # type: ignore[union-attr]
    blk.members += len(chosen)  # type: ignore[union-attr]


def gather(sub: MoELayer, stats: LayerStats, cfg: TdmoeConfig, acc: Grams | None) -> Grams:
    """A chunk's whitened experts added to its block's mode Grams, one expert at a time."""
    check_dense(sub)
    if sub.experts.widths is not None:
        raise PassError("a neuron-pruned bank's down-input covariance follows the whole layer's routing; "
                        "use expert_chunk: off or calibration.recalibrate: auto")  # fmt: skip
    members, _, live = one_width_members(sub, "tdmoe", "decomposed")
    acc = _start(sub, stats, cfg, live, acc)
    _fold(acc, _dense(sub.experts), 0, sub.experts.num_experts, members, live)
    return acc


def take(acc: Grams | None) -> dict[str, torch.Tensor]:
    """The block gathered since the last call, as tensors (its Grams only when it has a decomposed expert),
    cleared from ``acc``; ``{}`` when nothing was gathered."""
    if acc is None or acc.block is None:
        return {}
    blk, acc.block = acc.block, None
    out = {"members": torch.tensor([blk.members], dtype=torch.int64)}
    for proj in PROJ:
        out[f"energy.{proj}"] = torch.tensor(blk.energy[proj], dtype=torch.float64)
        if blk.members:
            out[f"g_out.{proj}"], out[f"g_in.{proj}"] = blk.g_out[proj], blk.g_in[proj]
    return out


def add(acc: Grams | None, part: dict[str, torch.Tensor]) -> Grams | None:
    """A block's sums (:func:`take`) added to the layer's total, ``total + block`` (blocks in order)."""
    if not part:
        return acc
    acc = Grams({}) if acc is None else acc
    members = int(part["members"][0])
    energy = {p: part[f"energy.{p}"].tolist() for p in PROJ}
    if acc.total is None:
        acc.total = Block({}, {}, {p: [] for p in PROJ})
    tot = acc.total
    tot.members += members
    for proj in PROJ:
        tot.energy[proj] += energy[proj]
        if not members:
            continue
        for have, name in ((tot.g_out, "g_out"), (tot.g_in, "g_in")):
            got = part[f"{name}.{proj}"]
            if proj in have:
                have[proj] += got
            else:
                have[proj] = got.clone()
    return acc


def fit(acc: Grams | None, shell: MoELayer, stats: LayerStats, cfg: TdmoeConfig) -> Factors:
    """The layer's factors from its Grams, once: ranks ``(r2, r3)`` for ``M`` experts at the layer's ratio
    (``budget: adaptive``: the plan's), the leading eigenvectors (:func:`gram_factor`)."""
    ratio = cfg.ratio if stats.plan is None else float(stats.plan)
    tot = None if acc is None else acc.total
    if tot is None or tot.members == 0:
        return Factors({}, ratio, 0, {}, {}, {}, {})
    whiteners = acc.whiteners  # type: ignore[union-attr]
    if not whiteners:  # this rank gathered no block: the whiteners from the layer's statistics
        _, _, live = one_width_members(shell, "tdmoe", "decomposed")
        whiteners = projection_whiteners(live_stats(shell, stats, live, cfg), cfg.whitening, cfg.input_form)
    ranks, outer, inner = {}, {}, {}
    for proj in PROJ:  # each Gram released once used
        g_out, g_in = tot.g_out.pop(proj), tot.g_in.pop(proj)
        ranks[proj] = tucker_ranks(tot.members, g_out.shape[0], g_in.shape[0], ratio, None)[:3]
        outer[proj], inner[proj] = gram_factors(
            g_out, g_in, *ranks[proj][1:], whiteners[proj], getattr(shell.experts, proj).dtype
        )
        del g_out, g_in
    energy = {p: torch.tensor(v, dtype=torch.float64) for p, v in tot.energy.items()}
    return Factors(whiteners, ratio, tot.members, ranks, outer, inner, energy)


def whole(layer: MoELayer, stats: LayerStats, cfg: TdmoeConfig) -> tuple[MoELayer, dict]:
    """The two phases on a layer held whole, block by block as on chunks (the same sums in the same order:
    the same bytes as by chunks or across ranks): gather, fit, project."""
    members, _, live = one_width_members(layer, "tdmoe", "decomposed")
    acc: Grams | None = None
    e, fulls = layer.experts.num_experts, _dense(layer.experts)
    for a, b in fold_blocks(e):
        acc = _start(layer, stats, cfg, live, acc)
        _fold(acc, fulls, a, b, members, live)
        acc = add(acc, take(acc))
    new, info = project(layer, fit(acc, layer, stats, cfg))
    return new, merge_tdmoe([info], [(0, e)], cfg)


def project(layer: MoELayer, pre: Factors) -> tuple[MoELayer, dict]:
    """A chunk's experts on the layer's factors: ``C_e = U_outᵀ X_e U_in`` per decomposed expert, the
    protected ones exact, the factors un-whitened as the whole layer's (:func:`_factorise`). The info holds
    per decomposed expert, in order, the squared whitened error and norm (``sq``) and the factors' parameters once (``factor_params``), which
    :func:`merge_tdmoe` needs."""
    check_dense(layer)
    if pre.members == 0:
        return layer, {"skipped": "every expert is protected"}
    bank = layer.experts
    members, dense_ids, live = one_width_members(layer, "tdmoe", "decomposed")
    lays, info, shared = {}, {}, 0
    for proj in PROJ:
        lay = getattr(bank, proj)
        full, dt = lay.dense(), lay.dtype
        (u_out, u_in), (p, q), energy = pre.outer[proj], pre.inner[proj], pre.energy[proj]
        r1, r2, r3 = pre.ranks[proj]
        cores = torch.zeros(len(members), r2, r3, dtype=p.dtype)
        errs, refs = [], []
        for i, e in enumerate(members):
            cores[i] = sandwich(p, _expert(full, proj, e, live), q)
            refs.append(float(energy[e]))
            errs.append(max(refs[-1] - float(torch.linalg.vector_norm(cores[i], dtype=torch.float64) ** 2), 0.0))
        pad = lay.shape[1] - u_out.shape[0] if proj != "down" else lay.shape[2] - u_in.shape[0]
        if proj != "down":
            u_out = torch.cat([u_out, u_out.new_zeros(pad, r2)])
        else:
            u_in = torch.cat([u_in, u_in.new_zeros(pad, r3)])
        index = torch.full((lay.shape[0],), -1, dtype=torch.int64)
        index[members] = torch.arange(len(members))
        dense = full[dense_ids].to(dt) if dense_ids else None
        new = Tucker(u_out.to(dt), u_in.to(dt), cores.to(dt), index, dense, None)
        info[proj] = {"ranks": [r1, r2, r3], "sq": [errs, refs]}
        lays[proj] = new
        shared += new.u_out.numel() + new.u_in.numel()
    before = sum(getattr(bank, p).num_params() for p in PROJ)
    after = sum(lays[p].num_params() for p in PROJ)
    dense_params = len(dense_ids) * 3 * bank.width * bank.hidden_size
    info.update(ratio=pre.ratio, params_before=before, params_after=after, members=len(members),
                dense_experts=dense_ids, dense_params=dense_params, factor_params=shared)  # fmt: skip
    new_bank = ExpertBank(lays["gate"], lays["up"], lays["down"], biases=bank.biases, act=bank.act,
                          alpha=bank.alpha, limit=bank.limit)  # fmt: skip
    return layer.replace(experts=new_bank), info


def merge_tdmoe(infos: list[dict], bnds: list[tuple[int, int]], cfg: TdmoeConfig) -> dict:
    """A layer's info from its chunks' (``bnds``: each chunk's ``(a, b)``), with the whole layer's keys: the
    ranks (the layer's, the same in every chunk), the whitened errors from the chunks' summed squares, the
    counts summed and the shared factors counted once."""
    if all("skipped" in i for i in infos):
        return dict(infos[0])
    out: dict = {}
    for proj in PROJ:
        err = sum(x for i in infos for x in i[proj]["sq"][0])  # per expert, in order: as many chunks as there are
        ref = sum(x for i in infos for x in i[proj]["sq"][1])
        rel = (err / ref) ** 0.5 if ref > 0 else 0.0
        out[proj] = {"ranks": infos[0][proj]["ranks"], "whitened_rel_error": round(rel, 6)}
    before = sum(i["params_before"] for i in infos)
    shared = infos[0]["factor_params"]
    after = sum(i["params_after"] - i["factor_params"] for i in infos) + shared
    dense_params = sum(i["dense_params"] for i in infos)
    out.update(ratio=infos[0]["ratio"], params_before=before, params_after=after,
               members=sum(i["members"] for i in infos), dense_experts=shifted_ids(infos, bnds, "dense_experts"),
               dense_params=dense_params, fraction_removed=(before - after) / max(before - dense_params, 1))  # fmt: skip
    return out


def refuse_chunks(cfg: TdmoeConfig) -> str | None:
    """What needs every expert of a layer at once (the fix in the line)."""
    if cfg.method == "hooi":
        return ("method: hooi iterates over every expert of the layer at once; use method: hosvd (its shared "
                "factors are fitted over the chunks)")  # fmt: skip
    if cfg.budget == "from_structure":
        return ("budget: from_structure scans per-projection ranks on the whitened stack of every expert at "
                "once; use budget: uniform or adaptive")  # fmt: skip
    return None


def refuse_layer(shell: MoELayer, cfg: TdmoeConfig) -> str | None:
    """``r1`` below the layer's experts truncates the expert mode, which needs every expert at once."""
    if cfg.r1 is not None and cfg.r1 < shell.experts.num_experts:
        return (f"r1={cfg.r1} truncates the expert mode, which mixes every expert of the layer; leave r1 unset "
                "(the shared factors are fitted over the chunks)")  # fmt: skip
    return None


def chunk_workspace(sub: MoELayer, cfg: TdmoeConfig) -> int:
    """Peak bytes on a chunk ``sub`` beyond its input and output: the largest of :func:`phases`."""
    return max(phases(sub, cfg))


def phases(sub: MoELayer, cfg: TdmoeConfig) -> tuple[int, int, int]:
    """Bytes of the three phases on a chunk ``sub`` of ``n`` experts beyond its input (and, the project
    phase, its output), which never overlap (``b``: the work dtype's bytes, :func:`~moecompress.methods.tucker.work_dtype`;
    ``s``: the weights'):

    - gather: the three projections' Gram matrices ``G = 3·(H² + I²)·b``, twice (the block's and the
      total: :func:`~moecompress.ir.fold_blocks`), the float64 whiteners
      ``W = 8·(2·H² + I²)`` and their work-dtype copies ``(2·H² + I²)·b`` (``b = 4``), one expert's
      whitened copies ``3·I·H·b``;
    - fit: ``G``, the whiteners and copies, the eigendecomposition of the largest Gram (``3·H²·b``) and its
      float64 un-whitened factors (``2·8·H²``);
    - project: the float64 whiteners, the factors (``inner`` ``3·(H² + I²)·b``, ``outer`` ``3·(H² + I²)·s``
      at most), one projection's cores for the chunk (``n·r2·r3·b`` at the chunk's ranks for ``ratio``, at
      most ``n·I·H·b``) and one expert's products (``3·I·H·b``).

    Summed (before 2026-12-05), the estimate was 1.46x the peak at 64 DeepSeek-V3 experts."""
    n, i, h = sub.experts.gate.shape
    b, s = work_dtype(sub.experts.gate.dtype).itemsize, sub.experts.gate.dtype.itemsize
    whiteners = 8 * (2 * h * h + i * i) + ((2 * h * h + i * i) * b if b < 8 else 0)
    grams = 3 * (h * h + i * i) * b
    gather = 2 * grams + whiteners + 3 * i * h * b  # the block's Grams and the total
    fit = grams + whiteners + 3 * h * h * b + 16 * h * h
    try:  # one projection's cores at a time: at the chunk's ranks (a bound: the layer's experts share more)
        core = max(r[1] * r[2] for r in (tucker_ranks(n, i, h, cfg.ratio), tucker_ranks(n, h, i, cfg.ratio)))
    except MethodError:
        core = i * h
    project = 8 * (2 * h * h + i * i) + 3 * (h * h + i * i) * (b + s) + (n * core + 3 * i * h) * b
    return gather, fit, project
