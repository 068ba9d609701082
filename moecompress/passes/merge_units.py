"""Merging by units of groups, on a layer held by chunks of experts (``Chunking("group")``), for ``namex``
and ``merge_experts``: a first sweep gathers each expert's summary chunk by chunk
(:func:`gather_summaries`), the groups are decided once per layer on the shell (:func:`fit_groups`: the
whole layer's groups, :class:`GroupDecision`), then each unit of consecutive groups is read and merged
(:func:`run_unit`) and the layer's info made from the units' (:func:`merge_units`). The engine's side is
:mod:`moecompress.engine.layer_run` (``_grouped_layer``). The summaries go by fixed blocks under ``torchrun``
(:class:`Summaries`), and the held-back errors are added from the units' per-expert terms in expert order
(:func:`held_terms`, :func:`terms_sum`): the units give the whole layer's bytes and report, so a layer not
chunked by request is shared out by units over the ranks too (``Chunking.exact``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moecompress.engine.spec import LayerStats
from moecompress.ir import ExpertBank, MoELayer
from moecompress.methods.metrics import relative_error
from moecompress.methods.mixture import AUTO_TOKENS
from moecompress.methods.weight_gram import GRAM_COLS, gram_block, gram_bytes
from moecompress.passes.expert_merging import (
    ALIGN,
    PROJ,
    MergeOptions,
    MergePlan,
    chosen_later,
    expert_summaries,
    fit_held,
    plan_merge,
    target_groups,
)
from moecompress.reference import Term, add_term, expert_terms, physical_ids, route, shared_forward


@dataclass
class Summaries:
    """The first sweep's per-expert summaries (:func:`expert_summaries`; ``gram``: the weight Gram of
    :func:`gather_pair`), as lists of row blocks in expert order: the layer's so far (``total``) and the block
    being gathered (``part``). By chunks every chunk goes to ``part``; by blocks (:func:`take_summaries`/:func:`add_summaries`,
    :mod:`~moecompress.engine.block_sweep`) each block's rows are handed out and added to ``total`` in block
    order, on whichever rank gathered them."""

    total: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    part: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def sums(self) -> dict[str, torch.Tensor]:
        """Every summary's rows, concatenated in expert order."""
        keys = list(dict.fromkeys([*self.total, *self.part]))
        return {k: torch.cat(self.total.get(k, []) + self.part.get(k, [])) for k in keys}


def take_summaries(acc: Summaries | None) -> dict[str, torch.Tensor]:
    """``Chunking.take``: the block's summaries (rows in expert order), cleared from ``acc``."""
    if acc is None:
        return {}
    part, acc.part = acc.part, {}
    return {k: torch.cat(v) for k, v in part.items()}


def add_summaries(acc: Summaries | None, part: dict[str, torch.Tensor]) -> Summaries:
    """``Chunking.add``: a block's summaries after the blocks before it (a concatenation: no sums, so the
    rows are one process's whichever rank gathered them)."""
    acc = acc if acc is not None else Summaries()
    for k, v in part.items():
        acc.total.setdefault(k, []).append(v)
    return acc


def reads_experts(cfg: MergeOptions) -> bool:
    """Whether the first sweep reads the experts (``Chunking.reads``): not when the groups come from the router's
    logits alone (``similarity: router`` with a fixed number of groups)."""
    return cfg.similarity != "router" or cfg.target_experts == "auto"


def weight_pairs(cfg: MergeOptions) -> bool:
    """Whether the first sweep reads every pair of chunks (``Chunking.pairs``): ``similarity: weight`` groups
    by the experts' weight Gram, whose blocks pair experts of different chunks."""
    return cfg.similarity == "weight"


def gather_pair(a: MoELayer, b: MoELayer, cfg: MergeOptions, rows: tuple[int, int], experts: int,
                acc: Summaries | None) -> Summaries:  # fmt: skip
    """``Chunking.pair``: the block of the ``[experts, experts]`` weight Gram
    (:func:`~moecompress.methods.weight_gram.gram_block`) between chunk ``a`` and chunk ``b`` (``b is a`` on
    the diagonal), whose first experts are the layer's ``rows``, written into ``acc["gram"]`` and its mirror."""
    acc = acc if acc is not None else Summaries()
    g = acc.part.setdefault("gram", [torch.zeros(experts, experts, dtype=torch.float64)])[0]
    (ra, rb), na, nb = rows, a.experts.num_experts, b.experts.num_experts
    block = gram_block(*((_flat(a),) if b is a else (_flat(a), _flat(b))))
    g[ra : ra + na, rb : rb + nb] = block
    g[rb : rb + nb, ra : ra + na] = block.T
    return acc


def _flat(layer: MoELayer) -> list[torch.Tensor]:
    return [getattr(layer.experts, p).dense() for p in PROJ]


def gather_summaries(sub: MoELayer, stats: LayerStats, cfg: MergeOptions, acc: Summaries | None) -> Summaries:
    """The first sweep's fold: a chunk's :func:`expert_summaries`, in chunk order."""
    part = expert_summaries(sub, fit_held(stats)[0], cfg)
    acc = acc if acc is not None else Summaries()
    for k, v in part.items():
        acc.part.setdefault(k, []).append(v)
    return acc


def group_workspace(
    layer: MoELayer, cfg: MergeOptions, n: int, sets: int = 1, in_flight: int = 0, groups: list[int] | None = None,
    cap: int | None = None,
) -> int:
    """The workspace of a merging step by units of ``n`` members (``Chunking.workspace``): the summaries
    gathered for every expert of ``layer`` (float32: ``output`` ``[E, H]``, the first 64 fit tokens' outputs
    ``[E, 64, H]``; ``similarity: weight``: the float64 Gram and its points, :func:`gram_bytes`), held to the
    end, and the larger of the pairs' sweep (``weight``: a second chunk of ``n`` experts as read, and two
    float32 blocks of columns) and one unit in the two phases of :func:`merge_workspace`, in float32 experts:

    - while the unit's group of ``c`` members is merged: its members, one alignment (``ALIGN``) and the
      unit's groups merged before it (one copy each). Each of those had two or more members, so they are at
      most ``(n − c)/2``: ``(n + c)/2 + ALIGN`` in all;
    - after: ``sets`` copies of the unit's merged groups (at most ``⌈n/2⌉``; planned: its share ``m·n/E``)
      and ``in_flight`` more.

    ``groups``: the unit's group sizes in order, known once the groups are decided (exact; the run's check,
    ``layer_run._unit_overrun``); else the dry run's plan, with ``c`` the layer's mean merged group size
    (as :func:`merge_workspace`), capped at ``n``, and the unit's share of the layer's ``m`` merged groups
    before it, ``m·n/E`` (at most ``(n − c)/2``): measured at 64 DeepSeek-V3 experts, ratio 0.25, units of
    22, the bound ``(n − c)/2`` put the estimate 34 % above the peak (`benchmarks/RESULTS.md`). ``cap``: the most float32 experts a group's members take
    whatever its size (``merge_experts`` folds them in one at a time: the base and the sum, 2; ``namex``
    makes a large group's task vectors again when needed: ``namex.HOLD_MEMBERS``)."""
    bank, e, h = layer.experts, layer.router.num_experts, layer.hidden_size
    expert = 4 * (sum(math.prod(getattr(bank, p).shape[1:]) for p in PROJ)
                  + sum(math.prod(b.shape[1:]) for b in bank.biases.values()))  # fmt: skip
    sums = 4 * e * h * ((AUTO_TOKENS if cfg.similarity == "output_tokens" or cfg.target_experts == "auto" else 0)
                        + (1 if cfg.similarity == "output" else 0))  # fmt: skip
    pair = 0
    if weight_pairs(cfg):  # the Gram, and while it is made a second chunk as read and two float32 blocks
        sums += gram_bytes(e)
        pair = n * -(-bank.nbytes() // max(e, 1)) + 2 * 4 * n * GRAM_COLS
    if groups is not None:
        merging, done = 0, 0
        for c in groups:
            if c > 1:
                merging = max(merging, done + (c if cap is None else min(c, cap)) + ALIGN)
                done += 1
        return sums + max(pair, expert * max(merging, sets * done + in_flight))
    t = e // 2 if chosen_later(cfg) else target_groups(e, cfg, layer.index)  # a plan: the largest m
    m = min(t, e - t)
    c = min(n, -(-(e - t + m) // max(m, 1)))
    share = -(-m * n // max(e, 1))  # the unit's share of the layer's merged groups
    held = min(-(-(n - c) // 2), share) + (c if cap is None else min(c, cap))  # merged before it, its members
    return sums + max(pair, expert * max(held + ALIGN, sets * min(-(-n // 2), share) + in_flight))


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
    """``variants(unit, merged, cfg, first, only=None) -> ({name: merged}, report)``: candidates besides the
    merge (``namex``'s refinements; ``only``: that one alone, the same bits), chosen between on the whole
    layer's held-back error: then :attr:`sweeps` is 2"""
    choice: str | None = None
    refine_info: dict | None = None
    terms: dict[str, dict[int, dict]] = field(default_factory=dict)
    """Per state (``before``, ``after``, ``after:<candidate>``) the routed experts' terms on the held-back
    tokens (:func:`held_terms`), by expert: summed in expert order (:func:`terms_sum`) they are one forward
    of the whole layer's, bit for bit, whichever units and ranks made them."""

    @property
    def sweeps(self) -> int:
        """The second sweep's passes over the units: one more, unwritten, when a whole-layer choice is due."""
        return 2 if self.variants is not None and any(len(g) > 1 for g in self.plan.groups) else 1

    def fold(self, info: dict) -> None:
        """A unit's terms on the held-back tokens (``info["_held"]``) kept with the layer's, and dropped."""
        for k, terms in info.pop("_held", {}).items():
            self.terms.setdefault(k, {}).update((int(t["e"]), t) for t in terms)

    def _error(self, after: str) -> float:
        """The held-back relative error of state ``after`` as :meth:`MergePlan.held_error` gives it on the
        whole layer: each state's output one ``experts_forward``'s sums plus the shared expert's."""
        x = self.plan.x_held
        before = terms_sum(self.terms.get("before", {}), x, self.plan.layer.experts.down.decode)
        y = terms_sum(self.terms.get(after, {}), x, self.shell.experts.down.decode)
        if self.shared is not None:
            before, y = before + self.shared, y + self.shared
        return relative_error(before, y)

    def choose(self, infos: list[dict]) -> None:
        """After the unwritten pass: the candidate the whole layer keeps (``namex``: its complex-momentum
        refinement when it lowers the held-back error, else the merge), as :func:`namex._refine_all`."""
        for info in infos:
            self.fold(info)
        errs = {k.split(":", 1)[1]: self._error(k) for k in self.terms if k.startswith("after:")}
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
        self.terms = {}

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


def fit_groups(acc: Summaries | None, shell: MoELayer, stats: LayerStats, cfg: MergeOptions) -> GroupDecision:
    """The groups from the summaries gathered over the chunks (exactly the whole layer's: the same
    features, rows in expert order), and the layer the step makes (its experts on ``meta``)."""
    sums = acc.sums() if acc is not None else {}
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
    if dec.sweeps == 2 and dec.choice is None:  # the unwritten pass: every candidate
        more, report = dec.variants(unit, merged, cfg, lo)
        cands.update(more)
    elif dec.sweeps == 2 and dec.choice != "unrefined":  # the written pass: the chosen one alone
        cands.update(dec.variants(unit, merged, cfg, lo, only=dec.choice)[0])
    x = unit.x_held
    ids, w = unit._routes["held"]
    members = dec.members(lo, hi)
    lut = torch.full((dec.plan.layer.router.num_experts + 1,), bank.num_experts, dtype=torch.long)
    lut[torch.tensor(members)] = torch.arange(bank.num_experts)
    held = {"before": held_terms(bank, x, lut[ids], w, members)}
    a_ids, a_w = route(dec.shell, x)
    if dec.shell.expert_map is not None:
        a_ids = dec.shell.expert_map[a_ids]
    local = torch.where((a_ids >= lo) & (a_ids < hi), a_ids - lo, torch.full_like(a_ids, hi - lo))
    outs = list(range(lo, hi))
    info = {**extra, "neurons_moved": unit.moved}
    if dec.sweeps == 2 and dec.choice is None:
        for name, m in cands.items():
            held[f"after:{name}"] = held_terms(unit.bank_of(m), x, local, a_w, outs)
        return None, {**info, "_held": held, "refine_fit_loss": report or {}}
    new = unit.bank_of(cands[dec.choice or "unrefined"])
    held["after"] = held_terms(new, x, local, a_w, outs)
    return new, {**info, "_held": held}


def held_terms(bank: ExpertBank, x: torch.Tensor, local: torch.Tensor, w: torch.Tensor, ids: list[int]) -> list[dict]:
    """The terms (:func:`~moecompress.reference.expert_terms`) of ``bank``'s experts on ``x``, routed by
    ``local`` ``[T, k]`` (``bank.num_experts``: not in the bank) with weights ``w``, each named by its
    expert in the layer (``ids[row]``): plain values, so that they travel between ranks."""
    out = []
    for t in expert_terms(bank, x, physical_ids(local, bank.num_experts), w):
        d = {"e": ids[t.expert], "tok": t.tok, "space": t.space, "part": t.part}
        if t.bias is not None:
            d["bias"] = t.bias
        out.append(d)
    return out


def terms_sum(terms: dict[int, dict], x: torch.Tensor, decode: Callable) -> torch.Tensor:
    """The float32 ``[T, H]`` sum of ``terms`` (:func:`held_terms`) added in expert order, then decoded:
    :func:`~moecompress.reference.experts_forward`'s additions on the whole bank, bit for bit."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    acc: dict[str, torch.Tensor] = {}
    for e in sorted(terms):
        t = terms[e]
        add_term(Term(e, t["tok"], t["space"], t["part"], t.get("bias")), out, acc)
    for space, value in acc.items():
        out += decode(space, value).float()
    return out


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
    dec.terms = {}
    return out
