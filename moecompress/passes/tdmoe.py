"""``tdmoe``: cross-expert Tucker decomposition of each projection, with data-aware whitening.

Paper: "TD-MoE: Tensor Decomposition for MoE Models" (ICLR 2026); implemented from
``shared/guide/METHODS.md`` §2. Per MoE layer and projection (gate, up, down), the ``M`` routed experts
that are not protected are stacked into ``T ∈ ℝ^{M×out×in}``, whitened slice by slice
(``A·W_e·B``, :mod:`moecompress.methods.whitening`: ``input`` = Cholesky factor of the input covariance,
minimising the output error, default; ``output`` = gradient covariance of the LM loss; ``both``;
``none``), decomposed with Tucker (tensorly; ``method: hosvd`` default, ``hooi`` = 50 alternating
iterations)::

    T_w ≈ G ×₁ U_e ×₂ U_out ×₃ U_in,     then  U_out' = A⁻¹U_out,  U_in' = B⁻ᵀU_in

and stored in the :class:`~moecompress.layouts.tucker.Tucker` layout (un-whitened factors: no extra inference
work). The expert mode is not truncated by default (``r1 = M``, the expert factor folded into
per-expert cores ``C_m``); ``r1`` truncates it. Ranks ``(r2, r3)`` meet ``ratio`` (fraction of the
decomposed experts' parameters removed) with the parameter count
``P = M·r2·r3 + out·r2 + in·r3`` (``r1·r2·r3 + M·r1 + out·r2 + in·r3`` with ``r1 < M``): every ``r2``
is scanned, ``r3`` solved for, and among the candidates within 0.5% of the target the one with the
most equal relative ranks (``r2/out ≈ r3/in``) is kept (else the closest). Protected (super) experts
stay dense, outside the shared factors. Shared experts and routers are untouched. ``budget: adaptive``
gives each layer its own ratio by sensitivity (see ``_plan``; the mean over layers is ``ratio``);
``budget: from_structure`` keeps each layer's budget and spreads it over gate/up/down by how much
whitened energy the shared basis keeps in each (see ``_structure_ratios``; the dry run shows the
uniform ranks, which store as many parameters or more).

Input layouts: dense, or ragged where every decomposed expert has the same live width (``heapr`` with
``layout: uniform`` and protected experts): their live parts are decomposed and the factors padded
with zeros to the bank's width. Other ragged banks are rejected (prune with ``layout: uniform``).

Statistics: ``input_cov`` and ``down_in_cov_pooled`` (input whitening, forward), ``out_grad_cov`` and
``down_in_grad_cov_pooled`` (output whitening, the streamed LM-loss backward).

Example steps::

    steps:
      - tdmoe: {ratio: 0.4}                           # input whitening, HOSVD
      - tdmoe: {ratio: 0.6, whitening: output, method: hooi}
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassConfig, PassSpec, shifted_ids
from moecompress.errors import MethodError, PassError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.tucker import Tucker
from moecompress.methods.structure import allocate, mode_bases, tucker_residual
from moecompress.methods.tucker import (
    add_grams,
    decompose,
    decompose_workspace,
    gram_factors,
    sandwich,
    tucker_ranks,
)
from moecompress.methods.whitening import ALL_NEEDS, Whitener, projection_whiteners, whitening_needs
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


def _check_dense(layer: MoELayer) -> None:
    for lay in (layer.experts.gate, layer.experts.up, layer.experts.down):
        if not isinstance(lay, (Dense, Ragged)):
            raise PassError(f"tdmoe needs dense experts, got a {lay.kind!r} layout; decompose before it")


def _check(layer: MoELayer, cfg: TdmoeConfig) -> None:
    bank = layer.experts
    _check_dense(layer)
    if cfg.r1 is not None and cfg.r1 > bank.num_experts:
        raise PassError(f"r1={cfg.r1} exceeds the {bank.num_experts} experts")
    e, i, h = bank.gate.shape
    for out, inp in ((i, h), (h, i)):
        for r in {cfg.ratio, min(2 * cfg.ratio, 0.9) if cfg.budget == "adaptive" else cfg.ratio}:
            tucker_ranks(e, out, inp, r, cfg.r1)


def _plan(all_stats: dict[int, LayerStats], cfg: TdmoeConfig) -> dict[int, float | None]:
    """``budget: adaptive``: per-layer ratios ``ρ_l ∝ 1/s_l`` with the layer's sensitivity
    ``s_l = E[yᵀ Σ_g y]`` (``y`` the MoE output on the calibration sample, ``Σ_g`` the LM-loss gradient
    covariance at it: the loss increase per unit of relative output error, to second order), clipped to
    ``[ratio/2, min(2·ratio, 0.9)]`` and scaled (bisection) so that their mean is ``ratio``."""
    if cfg.budget != "adaptive":
        return {i: None for i in all_stats}
    sens = {}
    for i, st in all_stats.items():
        y = st["io_sample_y"].double()
        sens[i] = float(torch.einsum("ij,ti,tj->", st["out_grad_cov"].double(), y, y)) / max(len(y), 1)
    inv = {i: 1 / max(v, 1e-300) for i, v in sens.items()}
    lo, hi = cfg.ratio / 2, min(2 * cfg.ratio, 0.9)

    def ratios(lam: float) -> dict[int, float]:
        return {i: min(hi, max(lo, lam * v)) for i, v in inv.items()}

    a, b = 0.0, cfg.ratio / min(inv.values())
    for _ in range(100):
        mid = (a + b) / 2
        a, b = (mid, b) if sum(ratios(mid).values()) / len(inv) < cfg.ratio else (a, mid)
    return ratios((a + b) / 2)


def _factorise(lay, proj: str, members, dense_ids, live: int, wh: Whitener, ratio: float, cfg: TdmoeConfig):
    full = lay.dense()
    w = full[members][:, :live] if proj != "down" else full[members][:, :, :live]
    m, out, inp = w.shape
    r1, r2, r3, _ = tucker_ranks(m, out, inp, ratio, cfg.r1)
    core, (u_e, u_out, u_in) = decompose(w, wh, r1, r2, r3, cfg.method)
    u_out, u_in = wh.unwhiten_out(u_out), wh.unwhiten_in(u_in)
    pad = lay.shape[1] - out if proj != "down" else lay.shape[2] - inp  # ragged input: back to full width
    if proj != "down":
        u_out = torch.cat([u_out, u_out.new_zeros(pad, r2)])
    else:
        u_in = torch.cat([u_in, u_in.new_zeros(pad, r3)])
    fold = r1 == m
    cores = torch.einsum("mj,jab->mab", u_e, core) if fold else core
    index = torch.full((lay.shape[0],), -1, dtype=torch.int64)
    index[members] = torch.arange(m)
    dt = lay.dtype
    dense = full[dense_ids].to(dt) if dense_ids else None
    new = Tucker(u_out.to(dt), u_in.to(dt), cores.to(dt), index, dense, None if fold else u_e.to(dt))
    ref = float(wh.whiten(w).pow(2).sum())  # the core is the whitened stack projected on the factors
    err = (max(ref - float(core.pow(2).sum()), 0.0) / ref) ** 0.5 if ref > 0 else 0.0
    return new, {"ranks": [r1, r2, r3], "whitened_rel_error": round(err, 6)}


STRUCTURE_GRID = (0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25, 1.5, 1.75, 2.0)
"""``budget: from_structure``: candidate per-projection ratios, as multiples of the layer's ratio."""


def _structure_ratios(bank, members, live, whiteners, ratio: float, cfg: TdmoeConfig) -> dict[str, float]:
    """``budget: from_structure``: per-projection ratios (from ``ratio × STRUCTURE_GRID``, below 0.95)
    minimising the summed whitened residual of the shared basis,
    ``Σ_p 1 − ‖U₂ᵀ W_p U₃‖²/‖W_p‖²`` (:func:`moecompress.methods.structure.tucker_residual`), with the
    layer's stored parameters at most those of the uniform ``ratio`` (:func:`~moecompress.methods.structure.
    allocate`). Layers whose projections are equally compressible keep the uniform split."""
    costs, target = {}, 0
    for proj in PROJ:
        full = getattr(bank, proj).dense()
        w = full[members][:, :live] if proj != "down" else full[members][:, :, :live]
        ww = whiteners[proj].whiten(w)
        bases = mode_bases(ww)
        costs[proj] = {}
        for f in STRUCTURE_GRID:
            r = ratio * f
            if not 0 < r < 0.95:
                continue
            try:
                res, _ = tucker_residual(ww, r, bases)
                p = tucker_ranks(*ww.shape, r, cfg.r1)[3]
            except MethodError:
                continue
            costs[proj][r] = (res, p)
        target += tucker_ranks(*ww.shape, ratio, cfg.r1)[3]
    return allocate(costs, target)


def _emits(layer: MoELayer, cfg: TdmoeConfig) -> MoELayer:
    """Shapes only: every projection in the :class:`Tucker` layout at the ranks of ``ratio`` (under
    ``budget: adaptive`` each layer's ratio is chosen from the statistics), protected experts exact."""
    members, _, live = one_width_members(layer, "tdmoe", "decomposed")
    if not members:
        return layer
    bank, lays = layer.experts, {}
    for proj in PROJ:
        lay = getattr(bank, proj)
        e, out, inn = lay.shape
        cut = (live, inn) if proj != "down" else (out, live)
        r1, r2, r3, _ = tucker_ranks(len(members), *cut, cfg.ratio, cfg.r1)
        lays[proj] = Tucker.meta_like(e, out, inn, (r1, r2, r3), factorised=len(members), dtype=lay.dtype)
    return layer.replace(experts=ExpertBank(**lays, biases=bank.biases, act=bank.act, alpha=bank.alpha,
                                            limit=bank.limit))  # fmt: skip


def tdmoe(layer: MoELayer, stats: LayerStats, cfg: TdmoeConfig) -> tuple[MoELayer, dict]:
    """Decompose each projection of the routed experts with a shared Tucker basis (TD-MoE)."""
    if isinstance(stats.prelude, Factors):  # a chunk of a layer held by chunks of experts
        return project(layer, stats.prelude)
    _check(layer, cfg)
    bank = layer.experts
    members, dense_ids, live = one_width_members(layer, "tdmoe", "decomposed")
    if not members:
        return layer, {"skipped": "every expert is protected"}
    ratio = cfg.ratio if stats.plan is None else float(stats.plan)
    whiteners = projection_whiteners(_live_stats(layer, stats, live, cfg), cfg.whitening, cfg.input_form)
    ratios = {p: ratio for p in PROJ}
    info: dict = {}
    if cfg.budget == "from_structure":
        ratios = info["projection_ratios"] = _structure_ratios(bank, members, live, whiteners, ratio, cfg)
    lays = {}
    for proj in PROJ:
        lays[proj], info[proj] = _factorise(
            getattr(bank, proj), proj, members, dense_ids, live, whiteners[proj], ratios[proj], cfg
        )
    before = sum(getattr(bank, p).num_params() for p in PROJ)
    after = sum(lays[p].num_params() for p in PROJ)
    dense_params = len(dense_ids) * 3 * bank.width * bank.hidden_size
    info.update(ratio=ratio, params_before=before, params_after=after, members=len(members), dense_experts=dense_ids,
                dense_params=dense_params, fraction_removed=(before - after) / max(before - dense_params, 1))  # fmt: skip
    new = ExpertBank(lays["gate"], lays["up"], lays["down"], biases=bank.biases, act=bank.act,
                     alpha=bank.alpha, limit=bank.limit)  # fmt: skip
    return layer.replace(experts=new), info


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


def _live_stats(layer: MoELayer, stats: LayerStats, live: int, cfg: TdmoeConfig) -> LayerStats:
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


def _summarize(infos: dict[int, dict], cfg: TdmoeConfig) -> dict:
    layers = [i for i in sorted(infos) if "params_before" in infos[i]]
    before = sum(infos[i]["params_before"] for i in layers)
    after = sum(infos[i]["params_after"] for i in layers)
    dense = sum(infos[i]["dense_params"] for i in layers)
    return {
        "summary": {
            "ratio": cfg.ratio,
            "routed_fraction_removed": (before - after) / max(before - dense, 1),
            "per_layer_fraction": {str(i): round(infos[i]["fraction_removed"], 4) for i in layers},
            "budget": cfg.budget,
            "ranks": {str(i): {p: infos[i][p]["ranks"] for p in PROJ} for i in layers},
            "whitened_rel_error": {
                str(i): {p: infos[i][p]["whitened_rel_error"] for p in PROJ} for i in layers
            },
        },
        "warnings": [],
    }


# -- by chunks of experts (engine/chunks.py, Chunking.gather / fit) ----------------------------------------
# HOSVD with the expert mode kept (r1 = M) needs of every expert only the whitened mode Gram matrices: the
# factors U_out, U_in are the leading eigenvectors of G_out = Σ_e X_e X_eᵀ and G_in = Σ_e X_eᵀ X_e
# (X_e = A·W_e·B), the left singular vectors of the mode unfoldings that tensorly computes, and the
# per-expert cores C_e = U_outᵀ X_e U_in depend on expert e alone. A layer held by chunks is swept twice:
# the Grams summed over every chunk (``gather``), the factors fitted once (``fit``), then each chunk
# projected onto them (``project``, the step's run on the chunk). The cores need no whitened copy of an
# expert: C_e = U_outᵀ (A W_e B) U_in = (Aᵀ U_out)ᵀ W_e (B U_in), both outer factors made once by ``fit``;
# the whitened errors ‖X_e − U_out C_e U_inᵀ‖² = ‖X_e‖² − ‖C_e‖² (orthonormal factors), with ‖X_e‖²
# noted by ``gather``. Like the whole layer's (``_factorise``), they are the float64 decomposition's
# errors, before the factors are stored in the weights' dtype.


@dataclass
class Grams:
    """The first sweep's fold: the whiteners (the layer's pooled statistics, made at the first chunk), per
    projection the lower triangles of ``G_out`` ``[out, out]`` and ``G_in`` ``[in, in]`` (float64,
    :func:`~moecompress.methods.whitening.gram_lower`) and per expert of the step's input, in order,
    ``‖X_e‖²`` (0 for a protected one); the decomposed experts seen."""

    whiteners: dict[str, Whitener]
    g_out: dict[str, torch.Tensor]
    g_in: dict[str, torch.Tensor]
    members: int = 0
    energy: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Factors:
    """What every chunk of a layer reads (``stats.prelude``): the whiteners, the layer's ratio, its decomposed
    experts ``members`` (``M``, 0: every expert protected, the layer is left as it is), per projection the
    ranks ``(M, r2, r3)``, the stored factors ``outer`` (``A⁻¹U_out``, ``B⁻ᵀU_in``, in the weights' dtype),
    the factors that give the cores from the un-whitened experts ``inner`` (``AᵀU_out``, ``B U_in``,
    float64) and ``energy``: ``‖X_e‖²`` per expert of the step's input (``chunk(a, b)``: the chunk's)."""

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


def gather(sub: MoELayer, stats: LayerStats, cfg: TdmoeConfig, acc: Grams | None) -> Grams:
    """A chunk's whitened experts added to the layer's mode Grams, one expert at a time."""
    _check_dense(sub)
    if sub.experts.widths is not None:
        raise PassError("a neuron-pruned bank's down-input covariance follows the whole layer's routing; "
                        "use expert_chunk: off or calibration.recalibrate: auto")  # fmt: skip
    members, _, live = one_width_members(sub, "tdmoe", "decomposed")
    if acc is None:
        whiteners = projection_whiteners(_live_stats(sub, stats, live, cfg), cfg.whitening, cfg.input_form)
        acc = Grams(whiteners, {}, {})
        for proj in PROJ:
            _, out, inp = getattr(sub.experts, proj).shape
            out, inp = (live, inp) if proj != "down" else (out, live)
            acc.g_out[proj] = torch.zeros(out, out, dtype=torch.float64)
            acc.g_in[proj] = torch.zeros(inp, inp, dtype=torch.float64)
            acc.energy[proj] = []
    for proj in PROJ:
        full, wh = getattr(sub.experts, proj).dense(), acc.whiteners[proj]
        g_out, g_in = acc.g_out[proj], acc.g_in[proj]
        energy = [0.0] * sub.experts.num_experts
        for e in members:
            energy[e] = add_grams(wh.whiten(_expert(full, proj, e, live)).to(g_out.device), g_out, g_in)
        acc.energy[proj] += energy
    acc.members += len(members)
    return acc


def fit(acc: Grams | None, shell: MoELayer, stats: LayerStats, cfg: TdmoeConfig) -> Factors:
    """The layer's factors from its Grams, once: ranks ``(r2, r3)`` for ``M`` experts at the layer's ratio
    (``budget: adaptive``: the plan's), the leading eigenvectors (:func:`gram_factor`)."""
    ratio = cfg.ratio if stats.plan is None else float(stats.plan)
    if acc is None or acc.members == 0:
        return Factors({}, ratio, 0, {}, {}, {}, {})
    ranks, outer, inner = {}, {}, {}
    for proj in PROJ:  # each Gram released once used
        g_out, g_in = acc.g_out.pop(proj), acc.g_in.pop(proj)
        ranks[proj] = tucker_ranks(acc.members, g_out.shape[0], g_in.shape[0], ratio, None)[:3]
        outer[proj], inner[proj] = gram_factors(
            g_out, g_in, *ranks[proj][1:], acc.whiteners[proj], getattr(shell.experts, proj).dtype
        )
        del g_out, g_in
    energy = {p: torch.tensor(v, dtype=torch.float64) for p, v in acc.energy.items()}
    return Factors(acc.whiteners, ratio, acc.members, ranks, outer, inner, energy)


def project(layer: MoELayer, pre: Factors) -> tuple[MoELayer, dict]:
    """A chunk's experts on the layer's factors: ``C_e = U_outᵀ X_e U_in`` per decomposed expert, the
    protected ones exact, the factors un-whitened as the whole layer's (:func:`_factorise`). The info holds
    the chunk's squared whitened errors (``sq``) and the factors' parameters once (``factor_params``), which
    :func:`merge_tdmoe` needs."""
    _check_dense(layer)
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
        cores = torch.zeros(len(members), r2, r3, dtype=torch.float64)
        err = ref = 0.0
        for i, e in enumerate(members):
            cores[i] = sandwich(p, _expert(full, proj, e, live).double(), q)
            ref += float(energy[e])
            err += max(float(energy[e]) - float(cores[i].pow(2).sum()), 0.0)
        pad = lay.shape[1] - u_out.shape[0] if proj != "down" else lay.shape[2] - u_in.shape[0]
        if proj != "down":
            u_out = torch.cat([u_out, u_out.new_zeros(pad, r2)])
        else:
            u_in = torch.cat([u_in, u_in.new_zeros(pad, r3)])
        index = torch.full((lay.shape[0],), -1, dtype=torch.int64)
        index[members] = torch.arange(len(members))
        dense = full[dense_ids].to(dt) if dense_ids else None
        new = Tucker(u_out.to(dt), u_in.to(dt), cores.to(dt), index, dense, None)
        rel = (err / ref) ** 0.5 if ref > 0 else 0.0
        info[proj] = {"ranks": [r1, r2, r3], "whitened_rel_error": round(rel, 6), "sq": [err, ref]}
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
        err = sum(i[proj]["sq"][0] for i in infos)
        ref = sum(i[proj]["sq"][1] for i in infos)
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
    """Peak bytes of both phases on a chunk ``sub`` of ``n`` experts beyond its input and output: the three
    projections' Gram matrices (``3·(H² + I²)`` float64, held from the first chunk to the fit), the
    whiteners (``2·H² + I²``), the fit's eigendecomposition of the largest (``2·H²``), one expert's whitened
    copies (``3·I·H``) and the chunk's float64 cores (at most ``n·I·H``)."""
    n, i, h = sub.experts.gate.shape
    return 8 * (3 * (h * h + i * i) + 2 * h * h + i * i + 2 * h * h + 3 * i * h + n * i * h)


def _workspace(layer: MoELayer) -> int:
    """One projection at a time (:func:`~moecompress.methods.tucker.decompose_workspace`): its experts
    stacked, whitened in float64 and decomposed by tensorly's HOSVD. Every projection has ``E·I·H``
    weights; every expert is counted (protected ones are not stacked: an upper bound)."""
    e, i, h = layer.experts.gate.shape
    return decompose_workspace(e, i, h, layer.experts.gate.dtype.itemsize)


SPEC = PassSpec(
    "tdmoe", TdmoeConfig, tdmoe, needs=ALL_NEEDS | {"io_sample"}, emits=_emits, check=_check, plan=_plan,
    plans=lambda cfg: cfg.budget == "adaptive",
    needs_fn=lambda cfg: whitening_needs(cfg.whitening) | {"io_sample"}
    | ({"out_grad_cov"} if cfg.budget == "adaptive" else set()),
    summarize=lambda infos, cfg: _summarize(infos, cfg), extras=("decompose",), workspace=lambda layer, cfg: _workspace(layer),
    alters=frozenset({"weights"}),
    chunking=Chunking("expert", merge=merge_tdmoe, refuse=refuse_chunks, refuse_layer=refuse_layer,
                      exact=lambda cfg: False, gather=gather, fit=fit, workspace=chunk_workspace),
)  # fmt: skip
