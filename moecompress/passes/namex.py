"""``namex``: merge each MoE layer's routed experts into fewer experts with Nash-bargaining weights.

Post-hoc adaptation (our design; METHODS.md §3.3) of NAMEx ("Expert Merging in Sparse Mixture of
Experts with Nash Bargaining", ICLR 2026, arXiv 2510.16138), a training-time SMoE layer. Per layer:

1. **Groups** (:mod:`moecompress.passes.expert_merging`; protected experts are singletons): by default
   usage-weighted Ward clustering (:func:`~moecompress.methods.merging.ward_linkage`) of the experts'
   outputs on the same 64 fit tokens (``similarity: output_tokens``, ``linkage: ward``) — the grouping
   that minimises the first-order merge loss ``Σ_g Σ_{i∈g} f_i ‖E_i(x) − Ē_g(x)‖²``. HC-SMoE's average
   linkage of mean outputs (``similarity: output, linkage: average``, the default before issue 19)
   chained near-copies into one 5-member group per layer on ref-mixtral-upcycled and lost to REAP
   pruning (benchmarks/RESULTS.md, issue 19). Base ``b`` = the most-used member; with ``align``
   (default) the other members' neurons are permuted to the base's (weight matching).
2. **Bargaining** per group with ``|C| ≥ 2``: task vectors ``τ_i = E_i − E_b`` over the concatenated
   gate/up/down weights (and biases) of the other members (members equal to the base are left out),
   ``G = [τ_i]``; ``α > 0`` with ``(GᵀG)α = 1/α`` by damped Newton
   (:func:`~moecompress.methods.merging.nash_weights`; residual and iterations reported). A base that is a
   non-negative combination of the members (their mean) makes this unsolvable: a clear error.
3. **γ**: merged expert ``E_b + γ Σ α_i τ_i``, ``γ = r·γ₀`` with ``γ₀ = ‖Σ f_i τ_i‖ / ‖Σ α_i τ_i‖``
   (``f`` = usage frequencies in the group, so ``r = 1`` moves as far as frequency-weighted merging;
   ``r = 0`` keeps the dominant expert). ``r`` is chosen per group from ``gamma_grid`` by the error of
   the group's share of the block output on the held-back ``io_sample`` tokens routed to any member,
   ``Σ_t ‖s_t E_merged(x_t) − Σ_{i∈C} w_{t,i} E_i(x_t)‖²`` (``s_t`` the members' summed routing weight)
   — the block error under the remapped router with the other groups exact (also for ``router:
   collapse``, whose router is only chosen afterwards). Ties: the ``r`` closest to 1.
4. **Refinement** (``refine_steps``, default 10; 0 switches it off): gradient steps on each merged
   expert against the same target on the *fit* tokens, heavy-ball momentum with a complex coefficient ``β = r·e^{iφ}`` (``momentum``,
   ``phase`` in degrees): ``μ ← βμ − η·∇``, ``θ ← θ + Re(μ)``, the step normalised to ``η = lr·‖θ‖/‖∇‖``
   (``lr`` is a relative step size). The best iterate by fit loss is kept. The same steps with real
   momentum (``φ = 0``) run for comparison; both held-back layer errors are reported
   (``rel_error_refined``, ``rel_error_refined_real``: the written layer, remap or collapse). The
   configured (complex) result is kept when it lowers that error, else the unrefined merge
   (``refined: false``).
5. **Router**: ``remap`` (exact routing, expert map, moecompress format) or ``collapse`` (stock
   checkpoint, one router row per group); see :mod:`moecompress.passes.expert_merging`.

Statistics: ``expert_counts``, ``io_sample`` (``calibration.sample_tokens`` MoE inputs; half fit,
half held back); a budget (``target_experts: {ratio: r}``, spent over layers in the step's plan) adds
``expert_out_gram`` and, for its default ``scale: loss``, ``expert_out_gram_fisher`` (a backward).
Cost: one Newton solve on a ``(|C|−1)²`` Gram per group, ``|gamma_grid|`` expert forwards per group, ``2·refine_steps`` forward+backward passes per group when refining, an
``O(I³)`` assignment per aligned member.

Example step::

    steps:
      - protect_super_experts: {}
      - namex: {ratio: 0.25, router: remap}
      # or one budget over all layers: namex: {target_experts: {ratio: 0.5}}
"""

from __future__ import annotations

import cmath
import math

import torch
from pydantic import Field, field_validator

from moecompress.engine.spec import Chunking, LayerStats, PassSpec
from moecompress.errors import MethodError, PassError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.methods.merging import Params, combine, dot, nash_weights, norm, params_forward
from moecompress.passes.expert_merging import (
    NEEDS,
    MergeOptions,
    MergePlan,
    check_mergeable,
    chosen_later,
    merge_needs,
    merge_workspace,
    merged_shape,
    plan_merge,
    summarize_merging,
)
from moecompress.passes.merge_budget import GRAM_NEEDS, plan_budget
from moecompress.passes.merge_units import (
    add_summaries,
    fit_groups,
    gather_pair,
    gather_summaries,
    group_workspace,
    merge_units,
    reads_experts,
    run_unit,
    take_summaries,
    weight_pairs,
)

GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)


class NamexConfig(MergeOptions):
    gamma_grid: tuple[float, ...] = Field(GRID, min_length=1, description="candidates for γ/γ₀ (per group)")
    refine_steps: int = Field(
        10,
        ge=0,
        description="gradient steps on each merged expert (0: none; kept only if it helps held-back)",
    )
    lr: float = Field(0.01, gt=0, le=1, description="refinement step, relative to the weights' norm")
    momentum: float = Field(0.8, ge=0, lt=1, description="|β| of the complex momentum")
    phase: float = Field(15.0, ge=-180, le=180, description="arg β in degrees (0: real heavy-ball momentum)")

    @field_validator("gamma_grid")
    @classmethod
    def _finite(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not math.isfinite(g) or g < 0 for g in v):
            raise ValueError("gamma_grid values must be finite and >= 0")
        return v


def _group_error(bank: ExpertBank, p: Params, data: tuple[torch.Tensor, ...]) -> float:
    x, s, target = data
    if len(x) == 0:
        return 0.0
    with torch.no_grad():
        err = (s[:, None] * params_forward(bank, p, x) - target).pow(2).sum()
    return float(err / target.pow(2).sum().clamp_min(1e-30))


def refine(
    bank: ExpertBank, p0: Params, data: tuple[torch.Tensor, ...], steps: int, lr: float, beta: complex
) -> tuple[Params, list[float]]:
    """Heavy-ball steps with complex momentum ``beta`` on ``‖s·E_θ(x) − target‖² / ‖target‖²``; returns the
    best iterate and the loss of every iterate."""
    x, s, target = data
    scale = float(target.pow(2).sum()) or 1.0
    theta = {k: v.detach().clone().requires_grad_(True) for k, v in p0.items()}
    mu = {k: torch.zeros(v.shape, dtype=torch.complex64) for k, v in p0.items()}
    best, best_loss, losses = p0, math.inf, []
    for j in range(steps + 1):
        loss = (s[:, None] * params_forward(bank, theta, x) - target).pow(2).sum() / scale
        losses.append(float(loss.detach()))
        if losses[-1] < best_loss:
            best_loss, best = losses[-1], {k: v.detach().clone() for k, v in theta.items()}
        if j == steps:
            break
        grads = torch.autograd.grad(loss, list(theta.values()))
        gn = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        if gn == 0.0:
            break
        eta = lr * math.sqrt(sum(float(v.detach().pow(2).sum()) for v in theta.values())) / gn
        with torch.no_grad():
            for (k, v), g in zip(theta.items(), grads):
                mu[k] = beta * mu[k] - eta * g
                v += mu[k].real
    return best, losses


def merge_groups(plan: MergePlan, cfg: NamexConfig, first: int = 0) -> tuple[dict[int, Params], dict]:
    """Steps 2-3 (bargaining, γ) on ``plan``'s groups with two or more members: the merged experts and the
    ``merged_groups`` report (member ids are the layer's, so ``first`` is not needed)."""
    bank = plan.layer.experts
    merged: dict[int, Params] = {}
    report: list[dict] = []
    for g, members in enumerate(plan.groups):
        if len(members) < 2:
            continue
        base, tau, k = plan.task_vectors(g, hold=len(members) <= HOLD_MEMBERS)
        live = [i for i in range(k) if norm(tau(i)) > 0]
        gram = torch.tensor(_gram(tau, live), dtype=torch.float64)
        try:
            a, residual, iters = nash_weights(gram.reshape(len(live), len(live)))
        except MethodError as err:
            raise PassError(f"group {members} (base {plan.bases[g]}): {err}") from None
        alpha = [0.0] * k
        for i, v in zip(live, a.tolist()):
            alpha[i] = v
        f = plan.weights(g)[1:].tolist()
        nash_dir, freq_dir = _directions(base, tau, alpha, f)
        n_nash = norm(nash_dir)
        gamma0 = norm(freq_dir) / n_nash if n_nash > 0 else 0.0
        held = plan.group_data(g, "held")
        if len(held[0]) == 0:
            held = plan.group_data(g, "fit")
        errs = [_group_error(bank, combine(base, [nash_dir], [r * gamma0]), held) for r in cfg.gamma_grid]
        r = min(zip(errs, (abs(r - 1) for r in cfg.gamma_grid), cfg.gamma_grid))[2]
        merged[g] = combine(base, [nash_dir], [r * gamma0])
        report.append({
            "members": members, "base": plan.bases[g], "alpha": alpha, "frequencies": plan.weights(g).tolist(),
            "solver_residual": residual, "solver_iterations": iters, "gamma0": gamma0, "gamma_rel": r,
            "gamma": r * gamma0, "group_error_by_gamma": errs,
        })  # fmt: skip
    return merged, {"merged_groups": report}


def namex(layer: MoELayer, stats: LayerStats, cfg: NamexConfig) -> tuple[MoELayer, dict]:
    """Merge experts into fewer with Nash-bargaining weights (NAMEx, post hoc); remap or collapse the router."""
    plan = plan_merge(layer, stats, cfg)
    merged, info = merge_groups(plan, cfg)
    if cfg.refine_steps and merged:
        merged = _refine_all(plan, merged, cfg, info)
    new = plan.build(merged)
    return new, {**plan.info(new), **info}


HOLD_MEMBERS = 4
"""A group of at most this many members keeps its task vectors; a larger one makes each again from the
bank when it is needed (:meth:`~moecompress.passes.merge_plan.MergePlan.task_vectors`: the same bits), so
it holds the base, two vectors and the two directions whatever its size, for ``k(k+1)/2 + 2k`` vectors
made instead of ``k``."""


def _gram(tau, live: list[int]) -> list[list[float]]:
    """``[[⟨τ_i, τ_j⟩ for j in live] for i in live]``, each entry computed as ``dot(τ_i, τ_j)`` (row
    ``i`` first), with two vectors in hand at a time."""
    out = [[0.0] * len(live) for _ in live]
    for a, i in enumerate(live):
        ti = tau(i)
        for b in range(a, len(live)):
            tj = ti if b == a else tau(live[b])
            out[a][b], out[b][a] = dot(ti, tj), dot(tj, ti)
            del tj
        del ti
    return out


def _directions(base: Params, tau, alpha: list[float], freq: list[float]) -> tuple[Params, Params]:
    """``combine(0, τ, alpha)`` and ``combine(0, τ, freq)`` (the same additions in the same order), the
    vectors taken one at a time."""
    nash, fdir = _zero(base), _zero(base)
    for i, (a, f) in enumerate(zip(alpha, freq, strict=True)):
        if not (a or f):
            continue
        t = tau(i)
        for out, c in ((nash, a), (fdir, f)):
            if c:
                for key in out:
                    out[key] += float(c) * t[key]
        del t
    return nash, fdir


def _zero(p: Params) -> Params:
    return {k: torch.zeros_like(v) for k, v in p.items()}


def refine_variants(
    plan: MergePlan, merged: dict[int, Params], cfg: NamexConfig, first: int = 0, only: str | None = None
):
    """Every merged expert of ``plan`` refined with complex and with real momentum (step 4):
    ``({"complex": ..., "real": ...}, {run: {group: [first loss, last loss]}})``; ``first``: the layer's
    number of the plan's first group (a :meth:`MergePlan.unit`); ``only``: that run alone (the written pass
    by units, once the whole layer's choice is made: the same bits, half the work and memory)."""
    bank = plan.layer.experts
    beta = cfg.momentum * cmath.exp(1j * math.radians(cfg.phase))
    runs = {"complex": beta, "real": complex(cfg.momentum)} if cfg.phase else {"complex": beta}
    runs = {k: b for k, b in runs.items() if only is None or k == only}
    out: dict[str, dict[int, Params]] = {k: {} for k in runs}
    losses: dict[str, dict[str, list[float]]] = {k: {} for k in runs}
    for g, p in merged.items():
        data = plan.group_data(g, "fit")
        for name, b in runs.items():
            if len(data[0]) == 0:
                out[name][g] = p
                continue
            out[name][g], losses[name][str(first + g)] = refine(bank, p, data, cfg.refine_steps, cfg.lr, b)
    return out, {name: {g: [v[0], v[-1]] for g, v in ls.items()} for name, ls in losses.items()}


def _refine_all(plan, merged: dict[int, Params], cfg: NamexConfig, info: dict) -> dict[int, Params]:
    """Refine every merged expert with complex and with real momentum; keep the complex result when it
    lowers the held-back layer error (see the module docstring)."""
    out, losses = refine_variants(plan, merged, cfg)
    before = plan.held_error(plan.build(merged))
    after = {name: plan.held_error(plan.build(m)) for name, m in out.items()}
    keep = after["complex"] < before
    info.update(
        rel_error_unrefined=before,
        rel_error_refined=after["complex"],
        rel_error_refined_real=after.get("real", after["complex"]),
        refined=keep,
        refine_fit_loss=losses,
    )
    return out["complex"] if keep else merged


def _workspace(layer: MoELayer, cfg: NamexConfig) -> int:
    """:func:`~moecompress.passes.expert_merging.merge_workspace`: while a group is bargained, its members and
    task vectors, the Nash and frequency directions and one γ candidate (3 experts); while refining, the
    merged experts once per momentum run besides the unrefined ones (2 or 3 sets), with one expert's
    parameters, best iterate, gradients and complex momentum (5 experts)."""
    if not cfg.refine_steps:
        return merge_workspace(layer, cfg, 1, 3)
    return merge_workspace(layer, cfg, 3 if cfg.phase else 2, 5)


def _summarize(infos: dict[int, dict], cfg: NamexConfig) -> dict:
    out = summarize_merging(infos, cfg)
    groups = [grp for i in sorted(infos) for grp in infos[i]["merged_groups"]]
    s = out["summary"]
    s["merged_groups"] = len(groups)
    s["mean_gamma_rel"] = sum(x["gamma_rel"] for x in groups) / len(groups) if groups else None
    s["gamma_rel_histogram"] = {str(r): sum(x["gamma_rel"] == r for x in groups) for r in cfg.gamma_grid}
    s["max_solver_residual"] = max((x["solver_residual"] for x in groups), default=0.0)
    s["max_solver_iterations"] = max((x["solver_iterations"] for x in groups), default=0)
    if cfg.refine_steps:
        rows = [infos[i] for i in sorted(infos) if "rel_error_unrefined" in infos[i]]
        for key in ("rel_error_unrefined", "rel_error_refined", "rel_error_refined_real"):
            s[f"mean_{key}"] = sum(r[key] for r in rows) / len(rows) if rows else None
        s["layers_refined"] = sum(bool(r["refined"]) for r in rows)
    return out


def _fit(acc, shell: MoELayer, stats: LayerStats, cfg: NamexConfig):
    """The groups by chunks; refining, the choice between the merge and its refinement is made on the whole
    layer's held-back error over an unwritten pass of the units (``GroupDecision.variants``)."""
    dec = fit_groups(acc, shell, stats, cfg)
    if cfg.refine_steps:
        dec.variants = refine_variants
    return dec


CHUNKING = Chunking(
    "group", merge=merge_units, gather=gather_summaries, pairs=weight_pairs, pair=gather_pair, reads=reads_experts,
    take=take_summaries, add=add_summaries, fit=_fit,
    unit=lambda dec, lo, hi, bank, cfg: run_unit(dec, lo, hi, bank, merge_groups, cfg),
    exact=lambda cfg: not weight_pairs(cfg),  # the units give the whole layer's bytes; the weight Gram by pairs: not
    workspace=lambda layer, cfg, n, groups=None: group_workspace(
        layer, cfg, n, *((3 if cfg.phase else 2, 5) if cfg.refine_steps else (1, 3)), groups=groups,
        cap=HOLD_MEMBERS,
    ),  # as _workspace
)  # by units of groups: the groups from per-expert summaries gathered over the chunks


SPEC = PassSpec(
    "namex",
    NamexConfig,
    namex,
    needs=NEEDS | GRAM_NEEDS,
    emits=merged_shape,
    check=check_mergeable,
    needs_fn=merge_needs,
    plan=plan_budget,
    plans=chosen_later,
    summarize=lambda i, c: _summarize(i, c), alters=frozenset({"routing", "weights"}),
    chunking=CHUNKING,
    workspace=lambda layer, cfg: _workspace(layer, cfg),
)
