"""``expert_prune``: remove whole routed experts, the same number in every layer (a stock checkpoint).

Baselines for every finer-grained pruning method. Per MoE layer with ``E`` routed experts, each expert
gets a score and the lowest-scored ones are removed (router rows, DeepSeek-V3 ``score_bias`` and GPT-OSS
``router_bias`` entries, every expert tensor); routing then runs over the kept router rows only. Shared
experts are untouched. Because every layer keeps the same count, the output is a *stock* checkpoint
(the config's expert count is rewritten) that plain ``transformers`` loads.

Scores (``method``):

- ``reap`` (default) — REAP ("REAP: Router-weighted Expert Activation Pruning", Cerebras 2025):
  ``S_j = mean over tokens routed to j of g_j(x) * ||f_j(x)||_2`` (routing weight times the norm of the
  expert's output), statistic ``reap_saliency``;
- ``frequency`` — number of calibration tokens routed to the expert (statistic ``expert_counts``), the
  classic baseline of e.g. "Not All Experts are Equal" (NAEE, Lu et al. 2024);
- ``random`` — ``torch.rand`` from a generator seeded with ``seed`` and the layer index (deterministic).

Count: ``n = round(ratio * E)`` experts per layer, rounding to the nearest integer with halves *up*
(``floor(ratio * E + 0.5)``, not Python's half-to-even); the report gives the fraction actually removed.
Group-limited routers (DeepSeek-V2/V3, ``n_group`` groups of ``m = E / n_group`` contiguous experts)
lose ``round(ratio * m)`` experts from *every* group, so the groups stay equal; the result must still
reach ``top_k`` (``top_k <= topk_group * kept_per_group``). Ties keep the lower expert index. Protected
(super) experts are always kept; a ratio that cannot be met without them fails. Impossible ratios
(zero experts left, fewer than ``top_k``) fail in the dry run. Kept experts keep their relative order,
so ids are renumbered ``0..E-n-1``; protected ids follow (the step reports ``kept_experts``, which the
protection contract uses to compare each protected expert with its new id). Merged experts
(``expert_map``) are not supported.

Statistics needed: ``reap_saliency`` (and the always-collected ``expert_counts``); one forward sweep.
Cost: negligible beyond calibration.

Example step::

    steps:
      - protect_super_experts: {}
      - expert_prune: {ratio: 0.25, method: reap}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassConfig, PassSpec
from moecompress.errors import PassError
from moecompress.ir import ExpertBank, MoELayer, RouterSpec
from moecompress.layouts.base import Layout
from moecompress.layouts.dense import Dense

NEEDS = {"expert_counts", "reap_saliency"}
STAT = {"frequency": "expert_counts", "reap": "reap_saliency"}


class ExpertPruneConfig(PassConfig):
    ratio: float = Field(
        0.25, ge=0, lt=1, description="fraction of routed experts (= routed-expert parameters) to remove"
    )
    method: Literal["frequency", "reap", "random"] = Field(
        "reap", description="expert score: reap saliency, routed-token count, or random"
    )
    seed: int = Field(0, ge=0, description="seed of method: random (combined with the layer index)")


def _round(x: float) -> int:
    """Nearest integer, halves up (1e-9 absorbs float error such as 0.15 * 10 = 1.4999...)."""
    return math.floor(x + 0.5 + 1e-9)


def _counts(router: RouterSpec, ratio: float) -> tuple[int, int | None]:
    """``(experts removed, removed per group or None)``; raises PassError for an impossible ratio."""
    e, k = router.num_experts, router.top_k
    if router.n_group is None:
        n, per = _round(ratio * e), None
        if e - n < k:
            hint = f"use ratio <= {(e - k) / e:.4g}"
            raise PassError(f"ratio={ratio} removes {n} of {e} experts, leaving fewer than top_k={k}; {hint}")
        return n, per
    g, tg = router.n_group, router.topk_group or router.n_group
    m = e // g
    per = _round(ratio * m)
    left = m - per
    max_per = m - math.ceil(k / tg)
    hint = f"use ratio <= {max_per / m:.4g}" if max_per > 0 else "this router cannot lose experts"
    if left < 1 or tg * left < k:
        raise PassError(
            f"ratio={ratio} removes {per} of the {m} experts of each of the {g} groups; the {tg} best groups "
            f"then reach only {tg * left} experts, fewer than top_k={k}; {hint}"
        )
    return per * g, per


def _blocks(layer: MoELayer, per: int | None, n: int) -> list[tuple[range, int]]:
    """``[(experts of a block, how many to remove from it)]``: the groups, or the whole layer."""
    e = layer.router.num_experts
    if per is None:
        return [(range(e), n)]
    m = e // layer.router.n_group
    return [(range(g * m, (g + 1) * m), per) for g in range(layer.router.n_group)]


def _check(layer: MoELayer, cfg: ExpertPruneConfig) -> None:
    if layer.expert_map is not None:
        raise PassError(
            "merged experts (expert_map) are not supported: a logical expert shares its physical expert "
            "with others, so removing it is not a whole-expert removal; prune before merging"
        )
    n, per = _counts(layer.router, cfg.ratio)
    for block, r in _blocks(layer, per, n):
        free = [x for x in block if x not in layer.protected]
        if len(free) < r:
            where = (
                ""
                if per is None
                else f" in group {block.start // len(block)} (experts {block.start}-{block.stop - 1})"
            )
            raise PassError(
                f"ratio={cfg.ratio} must remove {r} experts{where} but only {len(free)} are unprotected "
                f"(protected: {sorted(p for p in layer.protected if p in block)}); lower the ratio to at most "
                f"{len(free) / len(block):.4g} or protect fewer experts"
            )


def _scores(layer: MoELayer, stats: LayerStats, cfg: ExpertPruneConfig) -> torch.Tensor:
    e = layer.router.num_experts
    if cfg.method == "random":
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + layer.index)
        return torch.rand(e, generator=g, dtype=torch.float64)
    s = stats[STAT[cfg.method]].double().flatten()
    if s.numel() != e:
        raise PassError(
            f"statistic {STAT[cfg.method]!r} covers {s.numel()} experts but the layer has {e}: statistics "
            "describe the input checkpoint, so run expert_prune before any step that removes experts"
        )
    return s


def _take(lay: Layout, idx: torch.Tensor, keep: list[int]) -> Layout:
    if isinstance(lay, Dense):
        return Dense(lay.weight.index_select(0, idx))
    if lay.kind == "ragged":  # per-expert live rows, concatenated
        if lay.rows.device.type == "meta":  # type: ignore[attr-defined]  # shapes only: the live rows' share
            n = round(lay.rows.shape[0] * len(keep) / max(lay.shape[0], 1))  # type: ignore[attr-defined]
            return dataclasses.replace(lay, rows=lay.rows[:n], widths=lay.widths.index_select(0, idx))  # type: ignore[call-arg, attr-defined]
        rows = torch.cat([lay.live(e) for e in keep])  # type: ignore[attr-defined]
        return dataclasses.replace(lay, rows=rows, widths=lay.widths.index_select(0, idx))  # type: ignore[call-arg]
    raise PassError(f"expert_prune cannot select experts of a {lay.kind!r} layout; prune before compressing")


def prune_experts(layer: MoELayer, keep: list[int]) -> MoELayer:
    """``layer`` restricted to logical experts ``keep`` (ascending), renumbered ``0..len(keep)-1``."""
    idx = torch.tensor(keep, dtype=torch.long)
    bank = layer.experts
    new_bank = ExpertBank(
        *(_take(getattr(bank, p), idx, keep) for p in ("gate", "up", "down")),
        widths=None if bank.widths is None else bank.widths.index_select(0, idx),
        biases={k: b.index_select(0, idx) for k, b in bank.biases.items()},
        act=bank.act, alpha=bank.alpha, limit=bank.limit,
    )  # fmt: skip
    new_id = {old: new for new, old in enumerate(keep)}
    return layer.replace(
        router=dataclasses.replace(layer.router, num_experts=len(keep)),
        router_weight=layer.router_weight.index_select(0, idx),
        router_bias=None if layer.router_bias is None else layer.router_bias.index_select(0, idx),
        score_bias=None if layer.score_bias is None else layer.score_bias.index_select(0, idx),
        experts=new_bank,
        protected=frozenset(new_id[p] for p in layer.protected),
    )


def _summarize(infos: dict[int, dict], cfg: ExpertPruneConfig) -> dict:
    layers = sorted(infos)
    before = sum(infos[i]["num_experts_before"] for i in layers)
    after = sum(infos[i]["num_experts_after"] for i in layers)
    pb = sum(infos[i]["routed_params_before"] for i in layers)
    pa = sum(infos[i]["routed_params_after"] for i in layers)
    frac = (before - after) / before if before else 0.0
    warnings = []
    if layers and abs(frac - cfg.ratio) > 1e-9:
        warnings.append(
            f"removed {frac:.4f} of the routed experts, not ratio={cfg.ratio}: the count per layer (or per "
            "group) is ratio * experts rounded to the nearest integer, halves up"
        )
    norm = [[s / (max(infos[i]["scores"]) or 1.0) for s in infos[i]["scores"]] for i in layers]
    kept = [
        [float(e in set(infos[i]["kept_experts"])) for e in range(infos[i]["num_experts_before"])]
        for i in layers
    ]
    return {
        "summary": {
            "method": cfg.method,
            "ratio": cfg.ratio,
            "experts_before": before,
            "experts_after": after,
            "experts_per_layer": infos[layers[0]]["num_experts_after"] if layers else None,
            "fraction_removed": frac,
            "routed_params_before": pb,
            "routed_params_after": pa,
            "routed_fraction_removed": (pb - pa) / pb if pb else 0.0,
            "removed": {str(i): infos[i]["removed_experts"] for i in layers},
        },
        "warnings": warnings,
        "plots": [
            {"file": "expert_scores.png", "kind": "heatmap", "title": f"{cfg.method} score / layer max",
             "data": norm, "xlabel": "expert (original id)", "ylabel": "MoE layer (order)"},
            {"file": "kept_experts.png", "kind": "heatmap", "title": "kept (1) / removed (0) experts",
             "data": kept, "xlabel": "expert (original id)", "ylabel": "MoE layer (order)"},
        ] if layers else [],
    }  # fmt: skip


def _removed(layer: MoELayer, scores: torch.Tensor, cfg: ExpertPruneConfig) -> list[int]:
    """The experts to remove, ascending: per block, the lowest-scored unprotected ones (among equal
    scores the higher index goes first, so the lower one is kept)."""
    n, per = _counts(layer.router, cfg.ratio)
    removed: list[int] = []
    for block, r in _blocks(layer, per, n):
        free = sorted((x for x in block if x not in layer.protected), key=lambda x: (float(scores[x]), -x))
        removed += free[:r]
    return sorted(removed)


def _emits(layer: MoELayer, cfg: ExpertPruneConfig) -> MoELayer:
    """Shapes only: the same count of experts removed per layer (which ones is data-dependent)."""
    removed = set(_removed(layer, torch.zeros(layer.router.num_experts), cfg))
    return prune_experts(layer, [x for x in range(layer.router.num_experts) if x not in removed])


def expert_prune(layer: MoELayer, stats: LayerStats, cfg: ExpertPruneConfig) -> tuple[MoELayer, dict]:
    """Remove the lowest-scored whole routed experts (REAP, frequency or random), equally per layer."""
    _check(layer, cfg)
    e = layer.router.num_experts
    scores = _scores(layer, stats, cfg)
    removed = _removed(layer, scores, cfg)
    keep = [x for x in range(e) if x not in set(removed)]
    counts = stats.get("expert_counts")
    info = {
        "method": cfg.method,
        "num_experts_before": e,
        "num_experts_after": len(keep),
        "fraction_removed": len(removed) / e,
        "kept_experts": keep,
        "removed_experts": removed,
        "scores": [float(s) for s in scores],
        "routed_params_before": layer.experts.num_params(),
    }
    if counts is not None and counts.numel() == e and float(counts.sum()) > 0:
        info["removed_token_share"] = float(counts[removed].sum() / counts.sum())
    new = layer if not removed else prune_experts(layer, keep)
    info["routed_params_after"] = new.experts.num_params()
    return new, info


SPEC = PassSpec(
    "expert_prune", ExpertPruneConfig, expert_prune, needs=NEEDS, emits=_emits, check=_check,
    summarize=_summarize, needs_fn=lambda cfg: {"expert_counts", *([STAT[cfg.method]] if cfg.method in STAT else [])},
    chunking=Chunking("select"), alters=frozenset({"routing"}),
)  # fmt: skip
