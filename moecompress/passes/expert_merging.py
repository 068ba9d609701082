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
``weight``: the flattened gate/up/down weights; ``output_tokens``: each expert's outputs on the first 64
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field, model_validator

from moecompress.engine.spec import LayerStats, PassConfig
from moecompress.errors import PassError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.base import meta_tensor
from moecompress.layouts.dense import Dense
from moecompress.methods.merging import (
    Params,
    align_to,
    average_linkage,
    expert_params,
    ward_linkage,
)
from moecompress.methods.metrics import relative_error
from moecompress.methods.mixture import AUTO_TOKENS, choose_count
from moecompress.passes.merge_budget import MergeBudget, budget_needs
from moecompress.reference import (
    expert_forward,
    experts_forward,
    moe_forward,
    route,
    router_logits,
    shared_forward,
)

NEEDS = {"expert_counts", "io_sample"}
PROJ = ("gate", "up", "down")


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


def merge_workspace(layer: MoELayer, cfg: MergeOptions, sets: int = 1, in_flight: int = 0) -> int:
    """Bytes a merging pass holds beyond its input and output layers (the dry run's ``workspace``), in
    float32 copies of one expert (:func:`~moecompress.methods.merging.expert_params`): ``sets`` copies of
    every merged group, held until the layer is built (at most ``m = min(t, E − t)`` of the ``t`` groups
    have two or more members), plus one group being merged: its members, aligned, and their differences
    from the base (``2c`` for a group of the mean size ``c = (E − t + m) / m``), and ``in_flight`` more.
    The grouping features come first and are freed before (``similarity: weight``: every expert once). A
    grouping with one large group holds up to ``E − t + 1`` members at once instead of ``c``."""
    bank, e = layer.experts, layer.router.num_experts
    t = e // 2 if chosen_later(cfg) else target_groups(e, cfg, layer.index)  # a plan: the largest m
    m = min(t, e - t)
    if m <= 0:
        return 0
    expert = 4 * (sum(math.prod(getattr(bank, p).shape[1:]) for p in PROJ)
                  + sum(math.prod(b.shape[1:]) for b in bank.biases.values()))  # fmt: skip
    mean = -(-(e - t + m) // m)
    feats = e * expert if cfg.similarity == "weight" else 4 * e * AUTO_TOKENS * bank.hidden_size
    return max(feats, expert * (sets * m + 2 * mean + in_flight))


@dataclass
class MergePlan:
    """One layer's groups and the tokens the merge is fitted and judged on."""

    layer: MoELayer
    cfg: MergeOptions
    groups: list[list[int]]
    bases: list[int]
    counts: torch.Tensor
    x_fit: torch.Tensor
    x_held: torch.Tensor
    moved: int = 0
    auto: dict | None = None
    _y_held: torch.Tensor | None = None
    _routes: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    index: dict[int, int] | None = None
    """a :meth:`unit`'s: expert id -> its row in ``layer.experts`` (``None``: the id itself)"""

    def _at(self, e: int) -> int:
        return e if self.index is None else self.index[e]

    def unit(self, lo: int, hi: int, bank: ExpertBank) -> MergePlan:
        """Groups ``[lo, hi)`` of this plan (made on the layer's shell, :func:`plan_merge` with summaries)
        with ``bank`` holding their members, in ascending id order (read expert by expert): members,
        weights, tokens and merged bank (:meth:`bank_of`) are those of the whole layer's plan, bit for bit;
        the routing is the whole layer's."""
        for part in ("fit", "held"):  # the whole router's, before the plan forgets the layer
            if part not in self._routes:
                self._routes[part] = route(self.layer, self.x_fit if part == "fit" else self.x_held)
        mem = sorted(m for g in self.groups[lo:hi] for m in g)
        if bank.num_experts != len(mem):
            raise PassError(f"groups {lo}-{hi - 1} have {len(mem)} members, the bank holds {bank.num_experts}")
        rows = torch.tensor(mem, dtype=torch.long)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, rows.to(t.device))

        spec = dataclasses.replace(self.layer.router, num_experts=len(mem), top_k=min(self.layer.router.top_k, len(mem)),
                                   n_group=None, topk_group=None, group_score=None)  # fmt: skip
        sub = self.layer.replace(
            router=spec, router_weight=pick(self.layer.router_weight), router_bias=pick(self.layer.router_bias),
            score_bias=pick(self.layer.score_bias), experts=bank, routing=None, routing_similarity=None,
            protected=frozenset(i for i, m in enumerate(mem) if m in self.layer.protected),
        )  # fmt: skip
        return dataclasses.replace(
            self, layer=sub, groups=self.groups[lo:hi], bases=self.bases[lo:hi], moved=0, _y_held=None,
            index={m: i for i, m in enumerate(mem)},
        )  # fmt: skip

    def members(self, g: int) -> list[Params]:
        """Float32 parameters of group ``g``: the base first, then the others (aligned if ``align``)."""
        bank = self.layer.experts
        b = self.bases[g]
        base = expert_params(bank, self._at(b))
        out = [base]
        for e in self.groups[g]:
            if e != b:
                p = expert_params(bank, self._at(e))
                if self.cfg.align:
                    p, n = align_to(base, p)
                    self.moved += n
                out.append(p)
        return out

    def weights(self, g: int) -> torch.Tensor:
        """Usage frequencies of group ``g``'s members (base first), summing to 1 (uniform if unused)."""
        order = [self.bases[g], *(e for e in self.groups[g] if e != self.bases[g])]
        c = self.counts[order].double()
        return c / c.sum() if float(c.sum()) > 0 else torch.full_like(c, 1 / len(c))

    def group_data(self, g: int, part: Literal["fit", "held"]) -> tuple[torch.Tensor, ...]:
        """Tokens routed to any member of group ``g``: ``(x [n, H], s [n], target [n, H])`` with ``s`` the
        summed routing weight of the members and ``target = Σ_member w · E_member(x)`` (the group's share
        of the original block output); the merged expert's share is ``s · E_merged(x)``."""
        x = self.x_fit if part == "fit" else self.x_held
        if part not in self._routes:
            self._routes[part] = route(self.layer, x)
        ids, w = self._routes[part]
        mem = torch.tensor(self.groups[g])
        mask = torch.isin(ids, mem)
        tok = mask.any(1).nonzero().squeeze(1)
        pos = torch.full((x.shape[0],), -1, dtype=torch.long)
        pos[tok] = torch.arange(len(tok))
        target = torch.zeros(len(tok), x.shape[1])
        for e in self.groups[g]:
            t, k = torch.where(ids == e)
            if len(t):
                y = expert_forward(self.layer.experts, self._at(e), x[t]).float()
                target.index_add_(0, pos[t], y * w[t, k, None].float())
        return x[tok].float(), (w * mask).sum(1)[tok].float(), target

    def held_error(self, new: MoELayer) -> float:
        """Relative error ``‖MoE_new(x) − MoE(x)‖ / ‖MoE(x)‖`` of a layer on the held-back tokens."""
        if self.index is not None:
            raise PassError("a unit of groups has no layer error of its own: sum held_parts over the units")
        if self._y_held is None:
            self._y_held = moe_forward(self.layer, self.x_held)
        return relative_error(self._y_held, moe_forward(new, self.x_held))

    def bank_of(self, merged: dict[int, Params]) -> ExpertBank:
        """One physical expert per group, in group order: ``merged[g]`` for merged groups, the original
        tensors (bit-identical) for singletons."""
        bank, groups = self.layer.experts, self.groups

        def stack(key: str, orig: torch.Tensor) -> torch.Tensor:
            """``orig`` ``[E, ...]`` per group: the merged value, or the singleton's own (bit-identical)."""
            return torch.stack([merged[g][key].to(orig.dtype) if g in merged else orig[self._at(m[0])]
                                for g, m in enumerate(groups)])  # fmt: skip

        lays = {name: Dense(stack(name, getattr(bank, name).dense())) for name in PROJ}
        biases = {k: stack(f"bias.{k}", b) for k, b in bank.biases.items()}
        return dataclasses.replace(bank, **lays, biases=biases, widths=None)

    def build(self, merged: dict[int, Params]) -> MoELayer:
        """The layer with one physical expert per group: ``merged[g]`` for merged groups, the original
        tensors (bit-identical) for singletons; router per ``cfg.router``."""
        layer, groups = self.layer, self.groups
        e = layer.router.num_experts
        if len(groups) == e:
            return layer
        new_bank = self.bank_of(merged)
        if self.cfg.router == "remap":
            emap = torch.empty(e, dtype=torch.int64)
            for g, m in enumerate(groups):
                emap[m] = g
            return layer.replace(experts=new_bank, expert_map=emap)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if self.cfg.collapse_row == "base":
                return torch.stack([t[b] for b in self.bases])
            return torch.stack([t[m[0]] if len(m) == 1 else t[m].float().mean(0).to(t.dtype) for m in groups])

        new_id = {m[0]: g for g, m in enumerate(groups) if len(m) == 1}
        return layer.replace(
            router=dataclasses.replace(layer.router, num_experts=len(groups)),
            router_weight=rows(layer.router_weight),
            router_bias=rows(layer.router_bias),
            score_bias=rows(layer.score_bias),
            experts=new_bank,
            protected=frozenset(new_id[p] for p in layer.protected),
        )

    def info(self, new: MoELayer) -> dict:
        """The report entry every merging pass shares."""
        layer = self.layer
        out = {
            "groups": self.groups,
            "bases": self.bases,
            "router": self.cfg.router,
            "num_experts_before": layer.router.num_experts,
            "num_experts_after": new.experts.num_experts,
            "routed_params_before": layer.experts.num_params(),
            "routed_params_after": new.experts.num_params(),
            "bytes_before": layer.nbytes(),
            "bytes_after": new.nbytes(),
            "fit_tokens": int(self.x_fit.shape[0]),
            "held_tokens": int(self.x_held.shape[0]),
            "neurons_moved": self.moved,
            "rel_error_held": self.held_error(new) if new is not layer else 0.0,
        }
        if self.auto is not None:
            out["choose_groups"] = self.auto
        if self.cfg.router == "collapse" and new is not layer:
            out["kept_experts"] = self.bases  # protection.RENUMBER_KEY: new id g was old id bases[g]
        return out


def expert_summaries(layer: MoELayer, x_fit: torch.Tensor, cfg: MergeOptions) -> dict[str, torch.Tensor]:
    """What the grouping reads of each routed expert of ``layer`` (the whole layer, or a chunk's sub-layer:
    rows in expert order, so chunks concatenate): ``output`` ``[n, H]`` the mean output over the fit
    tokens (``similarity: output``); ``tokens`` ``[n, T, H]`` the outputs on the first ``AUTO_TOKENS`` fit
    tokens (``similarity: output_tokens``, and ``target_experts: auto``). ``router`` needs the router only,
    ``weight`` the weights themselves (nothing here)."""
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
    return torch.cat([getattr(layer.experts, p).dense().float().flatten(1) for p in PROJ], dim=1)


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


# -- by chunks of experts (Chunking("group")) -------------------------------------------------------------
def refuse_chunks(cfg: MergeOptions) -> str | None:
    """A merging configuration that cannot run on a layer held by chunks of experts, with the fix."""
    if cfg.similarity == "weight":
        return ("groups by every expert's flattened weights at once (similarity: weight); use similarity: "
                "output_tokens, output or router")  # fmt: skip
    if isinstance(cfg.target_experts, MergeBudget):
        return ("spends a budget over layers from expert_out_gram, which calibration collects only on whole "
                "layers; use a count per layer (ratio, target_experts: N or {layer: groups})")  # fmt: skip
    return None


def gather_summaries(sub: MoELayer, stats: LayerStats, cfg: MergeOptions, acc: dict | None) -> dict:
    """The first sweep's fold: a chunk's :func:`expert_summaries`, in chunk order."""
    part = expert_summaries(sub, fit_held(stats)[0], cfg)
    acc = acc if acc is not None else {k: [] for k in part}
    for k, v in part.items():
        acc[k].append(v)
    return acc


def group_workspace(layer: MoELayer, cfg: MergeOptions, n: int, sets: int = 1, in_flight: int = 0) -> int:
    """The dry run's workspace of a merging step by chunks of ``n`` experts (``Chunking.workspace``): the
    summaries gathered for every expert of ``layer`` (float32: ``output`` ``[E, H]``, the first 64 fit
    tokens' outputs ``[E, 64, H]``), held to the end, and one unit of ``n`` members as
    :func:`merge_workspace` counts a group (``sets`` copies of its at most ``⌈n/2⌉`` merged experts, the
    members aligned and their differences, ``in_flight`` more). A group of more than ``n`` members is read
    alone: it needs more (the step's report lists the groups)."""
    bank, e, h = layer.experts, layer.router.num_experts, layer.hidden_size
    expert = 4 * (sum(math.prod(getattr(bank, p).shape[1:]) for p in PROJ)
                  + sum(math.prod(b.shape[1:]) for b in bank.biases.values()))  # fmt: skip
    sums = 4 * e * h * ((AUTO_TOKENS if cfg.similarity == "output_tokens" or cfg.target_experts == "auto" else 0)
                        + (1 if cfg.similarity == "output" else 0))  # fmt: skip
    return sums + expert * (sets * -(-n // 2) + 2 * n + in_flight)


@dataclass
class GroupDecision:
    """A merging step's decision on a layer held by chunks: the groups (``plan``, made on the shell) and
    the layer after the step (``shell``: router, expert map, experts on ``meta``); ``info`` its part of the
    step's info; ``shared``: the shared expert's output on the held-back tokens (``rel_error_held``)."""

    plan: MergePlan
    shell: MoELayer
    info: dict
    shared: torch.Tensor | None
    variants: Callable | None = None
    """``variants(unit, merged, cfg, first) -> ({name: merged}, report)``: candidates besides the merge
    (``namex``'s refinements), chosen between on the whole layer's held-back error: then :attr:`sweeps` is 2"""
    choice: str | None = None
    refine_info: dict | None = None
    acc: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def sweeps(self) -> int:
        """The second sweep's passes over the units: one more, unwritten, when a whole-layer choice is due."""
        return 2 if self.variants is not None and any(len(g) > 1 for g in self.plan.groups) else 1

    def fold(self, info: dict) -> None:
        """A unit's shares of the held-back outputs (``info["_held"]``) added to the layer's, and dropped."""
        for k, t in info.pop("_held", {}).items():
            self.acc[k] = self.acc[k] + t if k in self.acc else t

    def _error(self, after: str) -> float:
        before, y = self.acc["before"], self.acc[after]
        if self.shared is not None:
            before, y = before + self.shared, y + self.shared
        return relative_error(before, y)

    def choose(self, infos: list[dict]) -> None:
        """After the unwritten pass: the candidate the whole layer keeps (``namex``: its complex-momentum
        refinement when it lowers the held-back error, else the merge), as :func:`namex._refine_all`."""
        for info in infos:
            self.fold(info)
        errs = {k.split(":", 1)[1]: self._error(k) for k in self.acc if k.startswith("after:")}
        keep = errs["complex"] < errs["unrefined"]
        losses: dict[str, dict] = {}
        for info in infos:
            for name, ls in info.get("refine_fit_loss", {}).items():
                losses.setdefault(name, {}).update(ls)
        self.refine_info = {
            "rel_error_unrefined": errs["unrefined"], "rel_error_refined": errs["complex"],
            "rel_error_refined_real": errs.get("real", errs["complex"]), "refined": keep,
            "refine_fit_loss": losses,
        }  # fmt: skip
        self.choice = "complex" if keep else "unrefined"
        self.acc = {}

    def units(self, size: int) -> list[tuple[int, int]]:
        """Consecutive groups ``[lo, hi)`` of at most ``size`` members together (a larger group alone)."""
        out, lo, n = [], 0, 0
        for g, members in enumerate(self.plan.groups):
            if g > lo and n + len(members) > size:
                out.append((lo, g))
                lo, n = g, 0
            n += len(members)
        if lo < len(self.plan.groups):
            out.append((lo, len(self.plan.groups)))
        return out

    def members(self, lo: int, hi: int) -> list[int]:
        """The input experts of groups ``[lo, hi)``, ascending (the order :meth:`MergePlan.unit` reads)."""
        return sorted(m for g in self.plan.groups[lo:hi] for m in g)


def fit_groups(acc: dict | None, shell: MoELayer, stats: LayerStats, cfg: MergeOptions) -> GroupDecision:
    """The groups from the summaries gathered over the chunks (exactly the whole layer's: the same
    features, rows in expert order), and the layer the step makes (its experts on ``meta``)."""
    sums = {k: torch.cat(v) for k, v in (acc or {}).items()}
    plan = plan_merge(shell, stats, cfg, sums)
    after = plan.build({})  # shapes: every group's tensors taken from the meta bank
    info = {
        "groups": plan.groups, "bases": plan.bases, "router": cfg.router,
        "num_experts_before": shell.router.num_experts, "num_experts_after": after.experts.num_experts,
        "routed_params_before": shell.experts.num_params(), "routed_params_after": after.experts.num_params(),
        "bytes_before": shell.nbytes(), "bytes_after": after.nbytes(), "fit_tokens": int(plan.x_fit.shape[0]),
        "held_tokens": int(plan.x_held.shape[0]),
    }  # fmt: skip
    if plan.auto is not None:
        info["choose_groups"] = plan.auto
    if cfg.router == "collapse" and after is not shell:
        info["kept_experts"] = plan.bases
    shared = shared_forward(shell, plan.x_held) if shell.shared is not None else None
    for part in ("fit", "held"):  # the whole router's routing, once per layer
        plan._routes[part] = route(shell, plan.x_fit if part == "fit" else plan.x_held)
    return GroupDecision(plan, after, info, shared)


def run_unit(dec: GroupDecision, lo: int, hi: int, bank: ExpertBank, merge_groups, cfg: MergeOptions):
    """Groups ``[lo, hi)`` merged from ``bank`` (their members, :meth:`GroupDecision.members`):
    ``(their physical experts, the unit's info)``; the info carries the unit's shares of the routed outputs
    on the held-back tokens before and after (``_held``, folded by :meth:`GroupDecision.fold`). With
    candidates (:attr:`GroupDecision.variants`) and no choice yet: ``(None, info)`` with every candidate's
    share, for :meth:`GroupDecision.choose`."""
    unit = dec.plan.unit(lo, hi, bank)
    merged, extra = merge_groups(unit, cfg, lo)
    cands, report = {"unrefined": merged}, None
    if dec.sweeps == 2:
        more, report = dec.variants(unit, merged, cfg, lo)
        cands.update(more)
    x = unit.x_held
    ids, w = unit._routes["held"]
    lut = torch.full((dec.plan.layer.router.num_experts + 1,), bank.num_experts, dtype=torch.long)
    lut[torch.tensor(dec.members(lo, hi))] = torch.arange(bank.num_experts)
    held = {"before": experts_forward(bank, x, lut[ids], w)}
    a_ids, a_w = route(dec.shell, x)
    if dec.shell.expert_map is not None:
        a_ids = dec.shell.expert_map[a_ids]
    local = torch.where((a_ids >= lo) & (a_ids < hi), a_ids - lo, torch.full_like(a_ids, hi - lo))
    info = {**extra, "neurons_moved": unit.moved}
    if dec.sweeps == 2 and dec.choice is None:
        for name, m in cands.items():
            held[f"after:{name}"] = experts_forward(unit.bank_of(m), x, local, a_w)
        return None, {**info, "_held": held, "refine_fit_loss": report or {}}
    new = unit.bank_of(cands[dec.choice or "unrefined"])
    held["after"] = experts_forward(new, x, local, a_w)
    return new, {**info, "_held": held}


def merge_units(infos: list[dict], bounds: list[tuple[int, int]], dec: GroupDecision) -> dict:
    """The layer's info from its units' (:func:`run_unit`), as a whole-layer run reports it."""
    for info in infos:
        dec.fold(info)
    changed = dec.shell is not dec.plan.layer
    out = {**dec.info, "neurons_moved": sum(i["neurons_moved"] for i in infos),
           "rel_error_held": dec._error("after") if changed else 0.0}  # fmt: skip
    for info in infos:
        for k, v in info.items():
            if k == "neurons_moved":
                continue
            if isinstance(v, list):
                out.setdefault(k, []).extend(v)
            elif isinstance(v, dict):
                out.setdefault(k, {}).update(v)
            else:
                out[k] = v
    if dec.refine_info is not None:
        out.update(dec.refine_info)
    dec.acc = {}
    return out


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
        "warnings": [],
        "plots": [
            {"file": "groups.png", "kind": "heatmap", "title": "group (physical expert) of each expert, scaled",
             "data": groups, "xlabel": "expert (original id)", "ylabel": "MoE layer (order)"},
        ] if layers else [],
    }  # fmt: skip
