"""Neuron (atomic-expert) pruning shared by ``heapr`` and ``neuron_prune``: budget, widths, slicing.

**Unit.** An atomic expert is neuron ``k`` of routed expert ``e``: row ``k`` of ``gate`` and ``up`` and
column ``k`` of ``down`` (``3·H`` parameters, plus GPT-OSS's two bias entries). ``ratio`` is the
fraction of routed-expert neurons removed, which is the fraction of routed-expert parameters removed.
Shared experts, routers and dense layers are never touched.

**Selection** (given a score per neuron, higher = more important). Each expert's neurons are sorted by
score; an expert may keep only an *allowed* width: a multiple of ``align`` that is at least
``min_width`` (rounded up to ``align``), or its full width. Going from one allowed width down to the
next removes a *unit* (its lowest-scored neurons) whose cost is the sum of their scores. All units of
all eligible experts in the scope (one layer, or every MoE layer for a global ranking) are sorted by
cost (made non-decreasing from each expert's tail, so that every prefix of the order is a valid set of
suffix removals) and removed cheapest first until ``round(ratio · N)`` neurons are gone (``N`` = every
routed neuron in the scope). With ``align > 1`` the last unit may not fit; the next that fits is taken,
so the removed count can fall short of the target by less than ``align`` per expert; reports give the
achieved fraction.

**Exempt experts.** Protected (super) experts keep every neuron; their neurons still count in ``N``,
so the others carry the budget. Experts that received no calibration token have no evidence either
way; ``unseen`` decides: ``typical`` (default) prunes them at exactly the requested ratio (width
rounded like ``uniform``), ordered by weight magnitude, outside the ranking; ``keep`` leaves them
whole; ``prune`` removes them first (the original HEAPr code's score of -1).

**Layouts.** ``ragged``: per-expert widths in the :class:`~moecompress.layouts.Ragged` layout (no
padding on disk; loads through the moecompress quantizer). ``uniform``: every non-protected expert of
every layer keeps its top ``uniform_width`` neurons, so the layer stays dense with a smaller width (a
stock checkpoint with a smaller ``moe_intermediate_size`` where the architecture allows it); a layer
with protected experts becomes ragged (protected experts keep full width).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field

from moecompress.engine.spec import KEPT_NEURONS, LayerStats, PassConfig, shifted_ids
from moecompress.errors import PassError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.base import meta_tensor
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.methods.widths import Scope, exempt_widths, neuron_norms, select_widths, uniform_width


class NeuronPruneOptions(PassConfig):
    """Options shared by the neuron-pruning passes."""

    ratio: float = Field(
        0.25, ge=0, lt=1, description="fraction of routed-expert neurons (= parameters) removed"
    )
    layout: Literal["ragged", "uniform"] = Field(
        "ragged", description="per-expert widths, or one width everywhere"
    )
    align: int = Field(1, ge=1, description="kept widths are multiples of this (or the full width)")
    min_width: int = Field(0, ge=0, description="every pruned expert keeps at least this many neurons")
    unseen: Literal["typical", "keep", "prune"] = Field(
        "typical", description="experts without calibration tokens: prune at the ratio, keep, or prune first"
    )


GROUPED_MM_BYTES = 16
"""Row strides transformers' grouped expert matmul (``torch._grouped_mm``) accepts: multiples of this."""


def check_prunable(layer: MoELayer, cfg: NeuronPruneOptions) -> None:
    """Dry-run checks on shapes (``meta`` tensors allowed)."""
    bank = layer.experts
    if any(isinstance(lay, Ragged) for lay in (bank.gate, bank.up, bank.down)) or (
        bank.widths is not None
        and bank.widths.device.type != "meta"
        and bool((bank.widths < bank.width).any())
    ):
        raise PassError("the experts are already neuron-pruned; prune once, with the combined ratio")
    if not all(isinstance(lay, Dense) for lay in (bank.gate, bank.up, bank.down)):
        raise PassError(f"neuron pruning needs dense experts, got layout {bank.gate.kind!r}; prune before it")
    if cfg.min_width > bank.width:
        raise PassError(f"min_width={cfg.min_width} exceeds the expert width {bank.width}; lower it")
    if cfg.layout == "uniform" and not protected_physical(layer):  # a stock checkpoint of a smaller width
        w, size = uniform_width(bank.width, cfg), bank.gate.dtype.itemsize
        if w < bank.width and (w * size) % GROUPED_MM_BYTES:
            step = GROUPED_MM_BYTES // math.gcd(GROUPED_MM_BYTES, size)
            raise PassError(
                f"layout: uniform leaves the experts {w} wide, rows of {w * size} bytes, which transformers' "
                f"grouped expert matmul cannot load (it needs multiples of {GROUPED_MM_BYTES} bytes); set "
                f"align: {math.lcm(step, cfg.align)}"
            )


def pruned_shape(layer: MoELayer, cfg: NeuronPruneOptions) -> MoELayer:
    """Shapes only: the layer :func:`prune` emits. ``uniform`` keeps one width (ragged when protected
    experts keep their full width); ``ragged`` keeps about ``(1 - ratio)`` of the neurons, split per
    expert by the data."""
    bank = layer.experts
    e, width, h, dt = bank.num_experts, bank.width, bank.hidden_size, bank.gate.dtype
    protected = protected_physical(layer)
    if cfg.layout == "uniform":
        w = uniform_width(width, cfg)
        if w == width or len(protected) == e:
            return layer
        if not protected:
            lays = [Dense.meta_like(e, w, h, dt), Dense.meta_like(e, w, h, dt), Dense.meta_like(e, h, w, dt)]
            return layer.replace(experts=_with_biases(bank, lays, w))
        widths = torch.tensor([width if x in protected else w for x in range(e)])
        lays = [Ragged.meta_like(width, h, axis, dt, widths=widths) for axis in ("out", "out", "in")]
    else:
        removed = round(cfg.ratio * e * width)
        if removed == 0:
            return layer
        lays = [Ragged.meta_like(width, h, axis, dt, experts=e, live=e * width - removed) for axis in ("out", "out", "in")]
    return layer.replace(experts=_with_biases(bank, lays, width))


def _with_biases(bank: ExpertBank, lays: list, width: int) -> ExpertBank:
    biases = {k: b if k == "down" else meta_tensor(b.shape[0], width, dtype=b.dtype) for k, b in bank.biases.items()}
    return ExpertBank(*lays, biases=biases, act=bank.act, alpha=bank.alpha, limit=bank.limit)


def protected_physical(layer: MoELayer) -> set[int]:
    return {layer.physical(e) for e in layer.protected}


def kept_neurons(key: torch.Tensor, widths: torch.Tensor) -> list[torch.Tensor]:
    """Per expert ``e``, the ids of the ``widths[e]`` neurons with the highest ``key[e]``, in their
    original order (ties: the lower id)."""
    return [key[e].double().sort(descending=True, stable=True).indices[: int(widths[e])].sort().values
            for e in range(key.shape[0])]  # fmt: skip


def prune_layer(layer: MoELayer, key: torch.Tensor, widths: torch.Tensor, uniform: bool) -> MoELayer:
    """Keep, in each expert ``e``, the ``widths[e]`` neurons with the highest ``key[e]`` (in their
    original order). Dense result when ``uniform`` and every expert keeps the same width, else ragged;
    ``layer`` itself when nothing is removed."""
    bank = layer.experts
    if bool((widths == bank.width).all()):
        return layer
    keep = kept_neurons(key, widths)
    gate, up, down = (lay.dense() for lay in (bank.gate, bank.up, bank.down))
    same = uniform and bool((widths == widths[0]).all())
    if same:
        lays = [
            Dense(torch.stack([gate[e][k] for e, k in enumerate(keep)])),
            Dense(torch.stack([up[e][k] for e, k in enumerate(keep)])),
            Dense(torch.stack([down[e][:, k] for e, k in enumerate(keep)])),
        ]
    else:
        lays = [Ragged.from_dense(gate, keep, "out"), Ragged.from_dense(up, keep, "out"),
                Ragged.from_dense(down, keep, "in")]  # fmt: skip
    biases = {}
    for name, b in bank.biases.items():
        if name == "down":
            biases[name] = b
            continue
        new = b.new_zeros(b.shape[0], int(widths[0]) if same else b.shape[1])
        for e, k in enumerate(keep):
            new[e, : len(k)] = b[e, k]
        biases[name] = new
    pruned = ExpertBank(*lays, biases=biases, act=bank.act, alpha=bank.alpha, limit=bank.limit)
    return layer.replace(experts=pruned)


def physical_counts(layer: MoELayer, counts: torch.Tensor) -> torch.Tensor:
    """Routed-token counts per physical expert (``expert_counts`` is per router id)."""
    if layer.expert_map is None:
        return counts
    out = torch.zeros(layer.experts.num_experts, dtype=counts.dtype)
    return out.index_add_(0, layer.expert_map.to(torch.int64), counts)


def prune(
    layer: MoELayer, scores: torch.Tensor, stats: LayerStats, cfg, widths: torch.Tensor | None = None,
    *, data_free: bool = False,
):  # fmt: skip
    """The common per-layer body of the neuron-pruning passes: ``scores`` ``[E, I]`` per physical
    neuron; ``widths`` from a cross-layer plan, else chosen here (``scope: layer`` / ``uniform``).
    ``data_free`` scores need no tokens, so no expert counts as unseen."""
    bank = layer.experts
    check_prunable(layer, cfg)
    if tuple(scores.shape) != (bank.num_experts, bank.width):
        raise PassError(
            f"statistics describe {tuple(scores.shape)} experts x neurons but the layer has "
            f"{(bank.num_experts, bank.width)}; run this step before steps that change the experts"
        )
    counts = torch.ones(bank.num_experts) if data_free else physical_counts(layer, stats["expert_counts"])
    protected = protected_physical(layer)
    local = scores.double().clone()
    fixed, unseen = exempt_widths(local, counts, protected, cfg)
    if cfg.layout == "uniform":
        widths = torch.full((bank.num_experts,), uniform_width(bank.width, cfg), dtype=torch.int64)
        for e, w in fixed.items():  # protected and `unseen: keep` experts stay whole
            widths[e] = w
    elif widths is None:
        widths = select_widths(Scope({layer.index: local}, {layer.index: fixed}), cfg)[layer.index]
    widths = widths.clone()
    for e in protected:  # authoritative even if a plan did not know about the protection
        widths[e] = bank.width
    key = scores.double().clone()
    if unseen:
        key[unseen] = neuron_norms(bank)[unseen].double()
    info = layer_info(layer, widths, unseen, bank.width)
    new = prune_layer(layer, key, widths, cfg.layout == "uniform")
    if new is not layer:  # the engine maps the statistics of later steps (engine/follow.py)
        info[KEPT_NEURONS] = [k.tolist() for k in kept_neurons(key, widths)]
    return new, info


def layer_info(layer: MoELayer, widths: torch.Tensor, unseen: list[int], width: int) -> dict:
    """Per-layer report entry shared by the pruning passes."""
    h = layer.hidden_size
    removed = int(widths.numel() * width - widths.sum())
    return {
        "widths": [int(w) for w in widths],
        "neurons_total": int(widths.numel() * width),
        "neurons_removed": removed,
        "routed_params_removed": removed * 3 * h,
        "fraction_removed": removed / max(widths.numel() * width, 1),
        "unseen_experts": unseen,
        "protected": sorted(layer.protected),
        "empty_experts": [e for e, w in enumerate(widths.tolist()) if w == 0],
    }


def summarize_pruning(infos: dict[int, dict], cfg: NeuronPruneOptions) -> dict:
    """Step summary: target vs achieved fraction, the width histogram, warnings, a heatmap."""
    layers = sorted(infos)
    total = sum(infos[i]["neurons_total"] for i in layers)
    removed = sum(infos[i]["neurons_removed"] for i in layers)
    widths = [w for i in layers for w in infos[i]["widths"]]
    hist: dict[str, int] = {}
    for w in widths:
        hist[str(w)] = hist.get(str(w), 0) + 1
    unseen = {str(i): infos[i]["unseen_experts"] for i in layers if infos[i]["unseen_experts"]}
    empty = {str(i): infos[i]["empty_experts"] for i in layers if infos[i]["empty_experts"]}
    warnings = []
    if unseen:
        warnings.append(f"experts with no calibration tokens (unseen: {cfg.unseen}): {unseen}")
    if empty:
        warnings.append(f"experts pruned to width 0 (they still receive tokens and return 0): {empty}")
    return {
        "summary": {
            "ratio": cfg.ratio,
            "routed_fraction_removed": removed / max(total, 1),
            "neurons_removed": removed,
            "neurons_total": total,
            "routed_params_removed": sum(infos[i]["routed_params_removed"] for i in layers),
            "layout": cfg.layout,
            "width_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "unseen_experts": unseen,
        },
        "warnings": warnings,
        "plots": [
            {"file": "kept_widths.png", "kind": "heatmap", "title": "kept width per expert",
             "data": [infos[i]["widths"] for i in layers], "xlabel": "expert", "ylabel": "MoE layer (order)"},
        ] if layers else [],
    }  # fmt: skip


def one_width_members(layer: MoELayer, step: str, verb: str) -> tuple[list[int], list[int], int]:
    """``(unprotected physical experts, protected ones, the unprotected experts' live width)`` for a
    step (``tdmoe``, ``codequant``) that needs every expert it changes at one width: a dense bank, or a
    uniformly pruned one whose protected experts kept their full width. Other ragged banks fail."""
    bank = layer.experts
    protected = sorted({layer.physical(e) for e in layer.protected})
    members = [e for e in range(bank.num_experts) if e not in protected]
    if bank.widths is not None and bank.widths.device.type == "meta":  # dry run: per-expert widths
        raise PassError(
            f"the {verb} experts are pruned to per-expert widths (ragged); {step} needs one width (prune with "
            "heapr layout: uniform)"
        )
    widths = {bank.width_of(e) for e in members}
    if len(widths) > 1:
        raise PassError(
            f"the {verb} experts have different widths {sorted(widths)}; {step} needs one width (prune with "
            "heapr layout: uniform)"
        )
    return members, protected, widths.pop() if widths else bank.width


# -- by chunks of experts (engine/chunks.py) ----------------------------------------------------------
def pruning_kind(shell: MoELayer, stats: LayerStats, cfg: Any) -> str:
    """What a neuron-pruning step (:mod:`moecompress.passes.neuron_pruning`) makes of the whole layer,
    from its statistics alone: ``unchanged``, ``dense`` (one narrower width) or ``ragged``."""
    bank = shell.experts
    e, width = bank.num_experts, bank.width
    protected = {shell.physical(p) for p in shell.protected}
    if isinstance(stats.plan, torch.Tensor):
        widths = stats.plan.clone().to(torch.int64)
    else:
        magnitude = getattr(cfg, "method", None) == "magnitude"
        counts = torch.ones(e) if magnitude else stats["expert_counts"]
        fixed, _ = exempt_widths(torch.zeros(e, width, dtype=torch.float64), counts, protected, cfg)
        widths = torch.full((e,), uniform_width(width, cfg), dtype=torch.int64)
        for x, w in fixed.items():
            widths[x] = w
    for x in protected:
        widths[x] = width
    if bool((widths == width).all()):
        return "unchanged"
    same = cfg.layout == "uniform" and bool((widths == widths[0]).all())
    return "dense" if same else "ragged"


def refuse_layer_ranking(cfg: Any) -> str | None:
    """``heapr``/``neuron_prune`` with ``layout: ragged`` and no cross-layer plan rank the neurons of all
    experts of a layer together: not by chunks."""
    if cfg.layout == "uniform" or getattr(cfg, "scope", "layer") == "global":
        return None
    field = type(cfg).model_fields.get("scope")
    fix = (
        "scope: global or layout: uniform"
        if field is not None and "global" in str(field.annotation)
        else "layout: uniform"
    )
    return f"ranks the neurons of all experts of a layer together (layout: ragged, scope: layer); use {fix}"


def merge_pruning(infos: list[dict], bnds: list[tuple[int, int]], cfg: Any) -> dict:
    """A neuron-pruning step's layer info (``neuron_pruning.layer_info``) from its chunks'."""
    total = sum(i["neurons_total"] for i in infos)
    removed = sum(i["neurons_removed"] for i in infos)
    out = {
        "widths": [w for i in infos for w in i["widths"]],
        "neurons_total": total,
        "neurons_removed": removed,
        "routed_params_removed": sum(i["routed_params_removed"] for i in infos),
        "fraction_removed": removed / max(total, 1),
        "unseen_experts": shifted_ids(infos, bnds, "unseen_experts"),
        "protected": shifted_ids(infos, bnds, "protected"),
        "empty_experts": shifted_ids(infos, bnds, "empty_experts"),
    }
    rest = {k: v for k, v in infos[0].items() if k not in out and k != KEPT_NEURONS}
    return {**out, **rest}
