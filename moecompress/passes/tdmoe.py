"""``tdmoe``: cross-expert Tucker decomposition of each projection, with data-aware whitening.

Paper: "TD-MoE: Tensor Decomposition for MoE Models" (ICLR 2026); implemented from
``shared/guide/METHODS.md`` §2. Per MoE layer and projection (gate, up, down), the ``M`` routed experts
that are not protected are stacked into ``T ∈ ℝ^{M×out×in}``, whitened slice by slice
(``A·W_e·B``, :mod:`moecompress.methods.whitening`: ``input`` = Cholesky factor of the input covariance,
minimising the output error, default; ``output`` = gradient covariance of the LM loss; ``both``;
``none``), decomposed with Tucker (``method: hosvd`` default, ``hooi`` = 50 alternating iterations)::

    T_w ≈ G ×₁ U_e ×₂ U_out ×₃ U_in,     then  U_out' = A⁻¹U_out,  U_in' = B⁻ᵀU_in

and stored in the :class:`~moecompress.layouts.tucker.Tucker` layout (un-whitened factors: no extra inference
work). The expert mode is not truncated by default (``r1 = M``, the expert factor folded into
per-expert cores ``C_m``); ``r1`` truncates it. Ranks ``(r2, r3)`` meet ``ratio`` (fraction of the
decomposed experts' parameters removed) with the parameter count
``P = M·r2·r3 + out·r2 + in·r3`` (``r1·r2·r3 + M·r1 + out·r2 + in·r3`` with ``r1 < M``): every ``r2``
is scanned, ``r3`` solved for, and among the candidates within 0.5% of the target the one with the
most equal relative ranks (``r2/out ≈ r3/in``) is kept (else the closest). Protected (super) experts
stay dense, outside the shared factors.

HOSVD with the expert mode kept (the default) runs in two phases (:mod:`moecompress.passes.tdmoe_chunks`):
``U_out``, ``U_in`` are the leading eigenvectors of the whitened mode Gram matrices summed over every expert
in fixed blocks, then each core is ``U_outᵀ X_e U_in``: the factors tensorly's HOSVD of the stack gives,
to rounding (``benchmarks/RESULTS.md``, 2026-12-05 and 2026-12-07), in a fixed order of sums, so a layer
held whole, by chunks of experts or across ``torchrun`` ranks gives the same bytes, and without the stack's
float64 copies. ``hooi``, a truncated expert mode (``r1 < M``) and ``budget: from_structure`` use
tensorly's ``tucker`` on the stack. Shared experts and routers are untouched. ``budget: adaptive``
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

import sys

import torch

from moecompress.engine.spec import Chunking, LayerStats, PassSpec
from moecompress.errors import MethodError, PassError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.tucker import Tucker
from moecompress.methods.structure import allocate, mode_bases, tucker_residual
from moecompress.methods.tucker import decompose, decompose_workspace, tucker_ranks
from moecompress.methods.whitening import ALL_NEEDS, Whitener, projection_whiteners, whitening_needs
from moecompress.passes.neuron_pruning import one_width_members
from moecompress.passes.tdmoe_chunks import (
    PROJ,
    Factors,
    TdmoeConfig,
    add,
    check_dense,
    chunk_workspace,
    fit,
    gather,
    live_stats,
    merge_tdmoe,
    phases,
    project,
    refuse_chunks,
    refuse_layer,
    take,
    whole,
)


def _check(layer: MoELayer, cfg: TdmoeConfig) -> None:
    bank = layer.experts
    check_dense(layer)
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
    members, _, _ = one_width_members(layer, "tdmoe", "decomposed")
    if not members:
        return layer, {"skipped": "every expert is protected"}
    if two_phase(cfg, len(members)):
        return whole(layer, stats, cfg)
    return _stacked(layer, stats, cfg)


def stacked(layer: MoELayer, stats: LayerStats, cfg: TdmoeConfig) -> tuple[MoELayer, dict]:
    """tensorly's Tucker decomposition of each projection's stack of experts (``hosvd`` or ``hooi``), for any
    configuration (what :func:`tdmoe` runs when :func:`two_phase` does not apply; the tests' reference for
    the two phases)."""
    _check(layer, cfg)
    if not one_width_members(layer, "tdmoe", "decomposed")[0]:
        return layer, {"skipped": "every expert is protected"}
    return _stacked(layer, stats, cfg)


def _stacked(layer: MoELayer, stats: LayerStats, cfg: TdmoeConfig) -> tuple[MoELayer, dict]:
    """:func:`stacked` on a checked layer with an expert to decompose."""
    bank = layer.experts
    members, dense_ids, live = one_width_members(layer, "tdmoe", "decomposed")
    ratio = cfg.ratio if stats.plan is None else float(stats.plan)
    whiteners = projection_whiteners(live_stats(layer, stats, live, cfg), cfg.whitening, cfg.input_form)
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


def two_phase(cfg: TdmoeConfig, members: int) -> bool:
    """Whether the layer's HOSVD runs in two phases from the mode Grams (:func:`~.tdmoe_chunks.whole`): HOSVD
    with the expert mode kept and one ratio for the three projections; otherwise tensorly."""
    return cfg.method == "hosvd" and cfg.budget != "from_structure" and (cfg.r1 is None or cfg.r1 >= members)


def _extras(cfg: TdmoeConfig) -> tuple[str, ...]:
    """tensorly (``decompose``) where a layer may need it: ``hooi``, ``budget: from_structure``, or ``r1`` set
    (below a layer's experts, :func:`two_phase`); the default runs in two phases without it."""
    return () if two_phase(cfg, sys.maxsize) else ("decompose",)  # every layer, whatever its experts


def _workspace(layer: MoELayer, cfg: TdmoeConfig) -> int:
    """In two phases (:func:`two_phase`): :func:`~.tdmoe_chunks.phases` with every expert's core, the output
    counted in the last phase only;
    else one projection at a time (:func:`~moecompress.methods.tucker.decompose_workspace`): its experts
    stacked, whitened in float64 and decomposed by tensorly. Every projection has ``E·I·H`` weights; every
    expert is counted (protected ones are not stacked: an upper bound)."""
    e, i, h = layer.experts.gate.shape
    if two_phase(cfg, e):  # the output exists in the last phase only (the dry run adds it to the workspace)
        out = _emits(layer, cfg).experts.nbytes()
        gather, fit, project = phases(layer, cfg)
        return max(gather, fit, project + out) - out
    return decompose_workspace(e, i, h, layer.experts.gate.dtype.itemsize)


SPEC = PassSpec(
    "tdmoe", TdmoeConfig, tdmoe, needs=ALL_NEEDS | {"io_sample"}, emits=_emits, check=_check, plan=_plan,
    plans=lambda cfg: cfg.budget == "adaptive",
    needs_fn=lambda cfg: whitening_needs(cfg.whitening) | {"io_sample"}
    | ({"out_grad_cov"} if cfg.budget == "adaptive" else set()),
    summarize=lambda infos, cfg: _summarize(infos, cfg), extras=_extras, workspace=_workspace,
    alters=frozenset({"weights"}),
    chunking=Chunking("expert", merge=merge_tdmoe, refuse=refuse_chunks, refuse_layer=refuse_layer,
                      gather=gather, fit=fit, take=take, add=add, workspace=chunk_workspace),
)  # fmt: skip
