"""What the expert-merging passes (``namex``, ``merge_experts``) share: options, checks, grouping, the
calibration tokens, router handling and the layer they write. The passes differ only in how a group's
members become one expert.

**Count.** ``ratio`` (fraction of routed experts removed: ``round(ratio · E)``, halves up, as
``expert_prune``) or ``target_experts`` (groups kept per layer, or ``{layer: groups}``: the allocation of a
total budget ``choose_groups {ratio}`` reports; unlisted layers keep every expert) — exactly one. ``target_experts: auto``
(``router: remap`` only) chooses the count per layer with a Gaussian mixture over expert features
(``choose_count``, :mod:`moecompress.methods.mixture`); the dry run shows every expert kept (an upper
bound on the bytes). ``target_experts: {ratio: r}`` (fraction of all routed experts removed over the model)
or ``{total_experts: N}`` (groups kept over all MoE layers), with ``scale`` (``loss``, default;
``relative``; ``absolute``): a total budget spent over layers in the step's cross-layer plan, exactly as
``choose_groups {ratio}`` spends it (:func:`~moecompress.passes.merge_budget.plan_budget`: Ward merge
curves from the ``expert_out_gram`` statistics through :func:`~moecompress.methods.mixture.gram_curve`, the function ``choose_groups`` uses,
and the exact allocation), in one run; the dry run shows every expert kept. Protected (super)
experts are singleton groups and count toward the groups kept.

**Tokens.** ``io_sample`` holds the first ``calibration.sample_tokens`` MoE inputs. Its first half
(*fit*) gives the ``output`` / ``router`` similarity features and the refinement targets; the second
half (*held-back*) chooses ``γ`` (``namex``) and gives the ``rel_error_held`` of the report. (With a
single token both halves are that token.) The executor's own ``holdout`` tokens, which no choice sees,
give the step report's ``rel_error`` row.

**Grouping** (HC-SMoE): features per expert — ``output``: the mean output of each expert over *all* fit
tokens (shared inputs, not only the tokens routed to it); ``router``: the expert's router-logit column
over the fit tokens, centred per token (softmax ignores a shared offset; MC-SMoE's similarity);
``weight``: the flattened gate/up/down weights (through their Gram matrix,
:mod:`~moecompress.methods.weight_gram`; by chunks from every pair of chunks); ``output_tokens``: each expert's outputs on the first 64
fit tokens, flattened (the functional distance ``E_t ‖E_i(x_t) − E_j(x_t)‖²``). ``linkage: average``:
average-linkage clustering with ``metric`` distance (:func:`~moecompress.methods.merging.average_linkage`,
HC-SMoE); ``linkage: ward``: usage-weighted Ward (:func:`~moecompress.methods.merging.ward_linkage`), the
grouping that least increases ``Σ_g Σ_{i∈g} f_i ‖x_i − x̄_g‖²`` (the default, with ``output_tokens``,
since issue 19; HC-SMoE's ``output`` + ``average`` chained near-copies into one large group). The base of a group is its most-used member
(``expert_counts``; ties: lowest id); with ``align`` every other member's neurons are permuted to the
base's first (weight matching).

**Router** (physical experts = groups, ordered by their lowest member id):

- ``remap`` (default, exact routing): every router row stays; ``expert_map[logical] = group``; the
  routing weights of logical experts sharing a physical expert add up. Written in the moecompress
  format: the merged experts are stored once (``<experts>.expert_map`` int64 ``[E]``), loaded by the
  moecompress quantizer.
- ``collapse`` (stock checkpoint with ``E'`` experts): one router row per group — ``collapse_row: base``
  (default) keeps the row (and router-bias / selection-bias entry) of the group's base, the member whose
  routing it mostly inherits; ``mean`` averages the members' rows and entries. Needs ``E' ≥ top_k`` and
  the same ``E'`` in every layer; with group-limited routing (DeepSeek ``n_group``) every routing group
  is clustered on its own into ``E'/n_group`` groups so the groups stay equal and contiguous. The step
  reports ``kept_experts`` (the base of each new expert) for the protection contract.

Merging needs dense, unpruned, unmerged experts: merge before pruning, decomposition or quantisation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from moecompress.engine.spec import LayerStats, PassConfig
from moecompress.errors import PassError
from moecompress.ir import MoELayer
from moecompress.layouts.base import meta_tensor
from moecompress.layouts.dense import Dense
from moecompress.methods.merging import (
    average_linkage,
    ward_linkage,
)
from moecompress.methods.mixture import AUTO_TOKENS, choose_count
from moecompress.methods.weight_gram import GRAM_COLS, gram_block, gram_bytes, gram_points
from moecompress.passes.merge_budget import MergeBudget, budget_needs
from moecompress.passes.merge_plan import PROJ, MergePlan
from moecompress.reference import (
    expert_forward,
    router_logits,
)

NEEDS = {"expert_counts", "io_sample"}


class MergeOptions(PassConfig):
    """Options shared by the merging passes."""

    ratio: float | None = Field(None, ge=0, lt=1, description="fraction of routed experts removed per layer")
    target_experts: int | Literal["auto"] | MergeBudget | dict[int, int] | None = Field(
        None,
        description="groups (physical experts) kept per layer; {layer: groups} per layer (the budgeted "
        "allocation choose_groups reports); {ratio: r} or {total_experts: N}: a total budget spent over "
        "layers in this step; auto: BIC's count per layer (no budget)",
    )
    similarity: Literal["output", "output_tokens", "router", "weight"] = Field(
        "output_tokens",
        description="grouping feature: per-token outputs, mean expert output, router-logit "
        "column, or weights",
    )
    metric: Literal["cosine", "euclidean"] = Field(
        "cosine", description="distance between features (average)"
    )
    linkage: Literal["average", "ward"] = Field(
        "ward", description="usage-weighted Ward (the merge loss) or average linkage (HC-SMoE)"
    )
    align: bool = Field(True, description="permute members' neurons to the base's before merging")
    router: Literal["remap", "collapse"] = Field(
        "remap", description="keep every router row + expert map, or one row per group (stock)"
    )
    collapse_row: Literal["base", "mean"] = Field(
        "base", description="router: collapse — the base member's row, or the mean of the members' rows"
    )

    @model_validator(mode="after")
    def _one_count(self):
        if (self.ratio is None) == (self.target_experts is None):
            raise ValueError(
                "set exactly one of ratio (fraction of routed experts removed) or target_experts "
                "(experts kept per layer)"
            )
        t = self.target_experts
        if any(v < 1 for v in (t.values() if isinstance(t, dict) else [t] if isinstance(t, int) else [])):
            raise ValueError("target_experts must be >= 1 (or auto, or {layer: groups >= 1})")
        if self.router == "collapse" and isinstance(t, dict) and len(set(t.values())) > 1:
            raise ValueError("router: collapse needs the same count in every layer; use router: remap with "
                             "per-layer target_experts")  # fmt: skip
        if isinstance(t, MergeBudget) and self.router == "collapse":
            raise ValueError("a target_experts budget spends a different count per layer, but router: collapse "
                             "needs the same count in every layer; use router: remap")  # fmt: skip
        if self.target_experts == "auto" and self.router == "collapse":
            raise ValueError(
                "target_experts: auto chooses a different count per layer, but router: collapse needs the same "
                "count in every layer; use router: remap with auto, or a fixed target_experts"
            )
        return self


def _what(cfg: MergeOptions) -> str:
    t = cfg.target_experts
    if isinstance(t, MergeBudget):
        return f"target_experts={t.model_dump(exclude_none=True)}"
    return f"ratio={cfg.ratio}" if cfg.ratio is not None else f"target_experts={t}"


def chosen_later(cfg: MergeOptions) -> bool:
    """The count is decided after the dry run (``auto``, or a budget's plan)."""
    return cfg.target_experts == "auto" or isinstance(cfg.target_experts, MergeBudget)


def merge_needs(cfg: MergeOptions) -> set[str]:
    """The statistics a merging step needs: a budget adds :func:`budget_needs`."""
    return NEEDS | budget_needs(cfg.target_experts)


def target_groups(num_experts: int, cfg: MergeOptions, index: int | None = None) -> int:
    """Groups kept in MoE layer ``index``; for ``target_experts: auto`` the upper bound ``num_experts``
    (chosen in :func:`plan_merge`); a layer a ``{layer: groups}`` mapping does not list keeps every expert."""
    if chosen_later(cfg):
        return num_experts
    if isinstance(cfg.target_experts, dict):
        return cfg.target_experts.get(index, num_experts) if index is not None else num_experts
    if cfg.target_experts is not None:
        return cfg.target_experts
    return num_experts - math.floor(cfg.ratio * num_experts + 0.5 + 1e-9)  # type: ignore[operator]


def blocks(layer: MoELayer, cfg: MergeOptions) -> list[range]:
    """Experts clustered together: every routing group for ``collapse`` with ``n_group``, else all."""
    e, ng = layer.router.num_experts, layer.router.n_group
    if cfg.router == "collapse" and ng:
        m = e // ng
        return [range(g * m, (g + 1) * m) for g in range(ng)]
    return [range(e)]


def check_mergeable(layer: MoELayer, cfg: MergeOptions) -> int:
    """Dry-run checks on shapes (``meta`` tensors allowed); returns the number of groups."""
    bank, spec = layer.experts, layer.router
    if layer.expert_map is not None:
        raise PassError("the experts are already merged (expert_map); merge once, with the combined ratio")
    if bank.rotation is not None or bank.act_bits is not None:
        raise PassError("the experts are rotated/quantised; merge before codequant or any quantisation")
    pruned = bank.widths is not None and (
        bank.widths.device.type == "meta" or bool((bank.widths < bank.width).any())
    )
    for name in PROJ:
        lay = getattr(bank, name)
        if not isinstance(lay, Dense) or pruned:
            raise PassError(
                f"merging needs dense, unpruned experts, got layout {lay.kind!r} ({name}); merge before "
                "pruning, decomposition or quantisation"
            )
    e, t = spec.num_experts, target_groups(spec.num_experts, cfg, layer.index)
    if t > e or t < 1:
        raise PassError(f"{_what(cfg)} keeps {t} of the layer's {e} experts; keep between 1 and {e}")
    if cfg.router == "collapse":
        k = spec.top_k
        if t < k:
            raise PassError(
                f"{_what(cfg)} keeps {t} experts, fewer than top_k={k}: router: collapse keeps one router row "
                f"per group; keep at least {k} (ratio <= {(e - k) / e:.4g}) or use router: remap"
            )
        if spec.n_group:
            if t % spec.n_group:
                raise PassError(
                    f"{_what(cfg)} keeps {t} experts, not a multiple of n_group={spec.n_group}: router: collapse "
                    "keeps the routing groups equal; choose target_experts as a multiple, or use router: remap"
                )
            per, tg = t // spec.n_group, spec.topk_group or spec.n_group
            if per * tg < k:
                raise PassError(
                    f"{_what(cfg)} keeps {per} experts per routing group; the topk_group={tg} best groups then "
                    f"reach {per * tg} < top_k={k}; keep more experts or use router: remap"
                )
    bl = blocks(layer, cfg)
    for b in bl:
        want = t // len(bl)
        prot = [p for p in layer.protected if p in b]
        if want < len(prot) + (1 if len(b) > len(prot) else 0):
            raise PassError(
                f"{_what(cfg)} keeps {want} groups for experts {b.start}-{b.stop - 1} but {len(prot)} of them "
                f"are protected singletons ({sorted(prot)}) and the others need a group too; keep more "
                "experts or protect fewer"
            )
    return t


def merged_shape(layer: MoELayer, cfg: MergeOptions) -> MoELayer:
    """Shapes only: the layer a merging pass emits — ``target_groups`` physical experts, with an expert
    map (``remap``) or as many router rows (``collapse``; which experts stay protected, and under which
    new ids, is decided by the grouping: the ids here are placeholders, the count is right)."""
    bank, e = layer.experts, layer.router.num_experts
    t = target_groups(e, cfg, layer.index)
    if t == e and not chosen_later(cfg):
        return layer
    lays = {p: Dense.meta_like(t, *getattr(bank, p).shape[1:], getattr(bank, p).dtype) for p in PROJ}
    biases = {k: meta_tensor(t, *b.shape[1:], dtype=b.dtype) for k, b in bank.biases.items()}
    new_bank = dataclasses.replace(bank, **lays, biases=biases, widths=None)
    if cfg.router == "remap":
        return layer.replace(experts=new_bank, expert_map=meta_tensor(e, dtype=torch.int64))

    def rows(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else meta_tensor(t, *x.shape[1:], dtype=x.dtype)

    return layer.replace(
        router=dataclasses.replace(layer.router, num_experts=t), router_weight=rows(layer.router_weight),
        router_bias=rows(layer.router_bias), score_bias=rows(layer.score_bias), experts=new_bank,
        protected=frozenset(range(len(layer.protected))),
    )  # fmt: skip


ALIGN = 5
"""float32 experts' worth held while one member is aligned to its group's base: both experts' neuron
features in float64 (2 each) and the member's permuted copy."""


def merge_workspace(
    layer: MoELayer, cfg: MergeOptions, sets: int = 1, in_flight: int = 0, streamed: bool = False
) -> int:
    """Bytes a merging pass holds beyond its input and output layers (the dry run's ``workspace``), in
    float32 copies of one expert (:func:`~moecompress.methods.merging.expert_params`), the larger of two
    phases (at most ``m = min(t, E − t)`` of the ``t`` groups have two or more members):
    - merging a group: the merged groups so far (``m``), the group's members, aligned, their differences
      from the base taken in place (``c`` for the mean group size ``c = (E − t + m) / m``) and one member's
      alignment (:data:`ALIGN`);
    - after the merges: ``sets`` copies of every merged group and ``in_flight`` more (a refinement).
    The grouping features come first and are freed before (``similarity: weight``: the experts' Gram, its
    points and one float32 block of columns, :mod:`~moecompress.methods.weight_gram`). A
    grouping with one large group holds up to ``E − t + 1`` members at once instead of ``c``.

    ``streamed`` (``merge_experts``: the members folded in one at a time, ``merge_experts.fold``): the base
    and the sum stand for the group's members, whatever its size, and the merging phase ends before the
    output layer is made (the dry run adds the output to the workspace: it is taken off that phase here).
    Measured at 16 experts ``[256, 512]``, ratio 0.5: 23.5 MB grown, 23.6 MB declared with the output
    (``test_step_memory``)."""
    bank, e = layer.experts, layer.router.num_experts
    t = e // 2 if chosen_later(cfg) else target_groups(e, cfg, layer.index)  # a plan: the largest m
    m = min(t, e - t)
    if m <= 0:
        return 0
    expert = 4 * (sum(math.prod(getattr(bank, p).shape[1:]) for p in PROJ)
                  + sum(math.prod(b.shape[1:]) for b in bank.biases.values()))  # fmt: skip
    feats = (gram_bytes(e) + 4 * e * GRAM_COLS if cfg.similarity == "weight"
             else 4 * e * AUTO_TOKENS * bank.hidden_size)  # fmt: skip
    if streamed:
        out = t * -(-bank.nbytes() // max(bank.num_experts, 1))  # the output's experts, made after the merges
        return max(feats, expert * (m + 2 + ALIGN) - out, expert * (sets * m + in_flight))
    mean = -(-(e - t + m) // m)
    return max(feats, expert * max(m + mean + ALIGN, sets * m + in_flight))




def expert_summaries(layer: MoELayer, x_fit: torch.Tensor, cfg: MergeOptions) -> dict[str, torch.Tensor]:
    """What the grouping reads of each routed expert of ``layer`` (the whole layer, or a chunk's sub-layer:
    rows in expert order, so chunks concatenate): ``output`` ``[n, H]`` the mean output over the fit
    tokens (``similarity: output``); ``tokens`` ``[n, T, H]`` the outputs on the first ``AUTO_TOKENS`` fit
    tokens (``similarity: output_tokens``, and ``target_experts: auto``). ``router`` needs the router only,
    ``weight`` the weights' Gram (nothing here: on chunks, from every pair of them,
    :func:`~moecompress.passes.merge_units.gather_pair`)."""
    bank, n, out = layer.experts, layer.experts.num_experts, {}
    if cfg.similarity == "output":
        out["output"] = torch.stack([expert_forward(bank, e, x_fit).float().mean(0) for e in range(n)])
    if cfg.similarity == "output_tokens" or cfg.target_experts == "auto":
        xs = x_fit[:AUTO_TOKENS]
        out["tokens"] = torch.stack([expert_forward(bank, e, xs).float() for e in range(n)])
    return out


def _features(layer: MoELayer, x: torch.Tensor, kind: str, sums: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind == "output":
        return sums["output"]
    if kind == "output_tokens":  # functional distance: E_t ‖E_i(x_t) − E_j(x_t)‖² on the same tokens
        return sums["tokens"].flatten(1)
    if kind == "router":
        logits = router_logits(layer, x)
        return (logits - logits.mean(1, keepdim=True)).T.contiguous()
    gram = sums["gram"] if "gram" in sums else gram_block([getattr(layer.experts, p).dense() for p in PROJ])
    return gram_points(gram)  # the flattened weights' distances, from their Gram (methods/weight_gram.py)


def fit_held(stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
    """``io_sample``'s fit and held-back halves (both the one token when there is one)."""
    x = stats["io_sample_x"].float()
    half = (x.shape[0] + 1) // 2
    return (x, x) if x.shape[0] < 2 else (x[:half], x[half:])


def plan_merge(
    layer: MoELayer, stats: LayerStats, cfg: MergeOptions, summaries: dict[str, torch.Tensor] | None = None
) -> MergePlan:
    """Checks, splits ``io_sample`` into fit / held-back tokens and groups the experts. ``summaries``: the
    experts' :func:`expert_summaries` gathered over chunks of experts (``layer`` is then the shell: the
    routed experts are not read)."""
    t = check_mergeable(layer, cfg)
    e = layer.router.num_experts
    counts = stats["expert_counts"].double().flatten()
    if counts.numel() != e:
        raise PassError(
            f"statistic 'expert_counts' covers {counts.numel()} experts but the layer has {e}: statistics "
            "describe the input checkpoint, so merge before any step that removes experts"
        )
    x_fit, x_held = fit_held(stats)
    sums = summaries

    def summary() -> dict[str, torch.Tensor]:
        nonlocal sums
        if sums is None:
            sums = expert_summaries(layer, x_fit, cfg)
        return sums

    auto = None
    if cfg.target_experts == "auto":
        t, auto = choose_count(layer, x_fit, summary()["tokens"])
    elif isinstance(cfg.target_experts, MergeBudget):
        t = stats.plan if stats.plan is not None else e
        if not 1 <= t <= e:
            raise PassError(f"{_what(cfg)}: the plan keeps {t} of the layer's {e} experts")
        auto = {"budget": cfg.target_experts.model_dump(exclude_none=True), "groups": t}
    feats = _features(layer, x_fit, cfg.similarity, summary()) if t < e else torch.zeros(e, 1)
    groups: list[list[int]] = []
    bl = blocks(layer, cfg)
    for b in bl:
        single = [p - b.start for p in layer.protected if p in b]
        if cfg.linkage == "ward":
            local = ward_linkage(
                feats[b.start : b.stop], t // len(bl), counts[b.start : b.stop], singletons=single
            )
        else:
            local = average_linkage(
                feats[b.start : b.stop], t // len(bl), metric=cfg.metric, singletons=single
            )
        groups += [[b.start + i for i in grp] for grp in local]
    groups.sort(key=lambda g: g[0])
    bases = [max(g, key=lambda m: (float(counts[m]), -m)) for g in groups]
    return MergePlan(layer, cfg, groups, bases, counts, x_fit, x_held, auto=auto)


def summarize_merging(infos: dict[int, dict], cfg: MergeOptions) -> dict:
    """Step summary shared by the merging passes (``routed_fraction_removed`` from the banks' parameters)."""
    layers = sorted(infos)
    before = sum(infos[i]["num_experts_before"] for i in layers)
    after = sum(infos[i]["num_experts_after"] for i in layers)
    pb = sum(infos[i]["routed_params_before"] for i in layers)
    pa = sum(infos[i]["routed_params_after"] for i in layers)
    sizes: dict[str, int] = {}
    for i in layers:
        for grp in infos[i]["groups"]:
            sizes[str(len(grp))] = sizes.get(str(len(grp)), 0) + 1
    groups = []
    for i in layers:
        row = [0.0] * infos[i]["num_experts_before"]
        for g, members in enumerate(infos[i]["groups"]):
            for m in members:
                row[m] = g / max(len(infos[i]["groups"]) - 1, 1)
        groups.append(row)
    errs = [infos[i]["rel_error_held"] for i in layers]
    return {
        "summary": {
            "count": _what(cfg),
            "router": cfg.router,
            "similarity": cfg.similarity,
            "align": cfg.align,
            "experts_before": before,
            "experts_after": after,
            "experts_per_layer": infos[layers[0]]["num_experts_after"] if layers else None,
            "groups_per_layer": {str(i): infos[i]["num_experts_after"] for i in layers},
            "fraction_removed": 1 - after / before if before else 0.0,
            "routed_params_before": pb,
            "routed_params_after": pa,
            "routed_fraction_removed": 1 - pa / pb if pb else 0.0,
            "group_size_histogram": dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))),
            "mean_rel_error_held": sum(errs) / len(errs) if errs else 0.0,
            "bytes_before": sum(infos[i]["bytes_before"] for i in layers),
            "bytes_after": sum(infos[i]["bytes_after"] for i in layers),
        },
        "warnings": [
            f"layer {i}: a unit of {big['members']} experts needed more than the dry run's units of "
            f"{big['chunk']} (its groups larger than planned): about {big['extra_bytes'] / 2**30:.2f} GiB more"
            for i in layers
            if (big := infos[i].get("largest_unit")) and big["extra_bytes"] > 0.1 * big.get("planned_bytes", 0)
        ],
        "plots": [
            {"file": "groups.png", "kind": "heatmap", "title": "group (physical expert) of each expert, scaled",
             "data": groups, "xlabel": "expert (original id)", "ylabel": "MoE layer (order)"},
        ] if layers else [],
    }  # fmt: skip
