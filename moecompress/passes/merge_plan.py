"""One layer's merge plan (:class:`MergePlan`): the groups, their bases, the tokens the merge is fitted and
judged on, and what a merging pass builds from them (``namex``, ``merge_experts``); made by
:func:`moecompress.passes.expert_merging.plan_merge`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moecompress.errors import PassError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.dense import Dense
from moecompress.methods.merging import (
    Params,
    align_to,
    expert_params,
    match,
    permute,
    sub_,
)
from moecompress.methods.metrics import relative_error
from moecompress.reference import (
    expert_forward,
    moe_forward,
    route,
)

PROJ = ("gate", "up", "down")


@dataclass
class MergePlan:
    """One layer's groups and the tokens the merge is fitted and judged on."""

    layer: MoELayer
    cfg: Any
    """the step's options (:class:`moecompress.passes.expert_merging.MergeOptions`, which imports this module)"""
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
        return list(self.iter_members(g))

    def iter_members(self, g: int) -> Iterator[Params]:
        """:meth:`members` one at a time (a merge that folds them in holds the base and one member)."""
        bank = self.layer.experts
        b = self.bases[g]
        base = expert_params(bank, self._at(b))
        yield base
        for e in self.groups[g]:
            if e != b:
                p = expert_params(bank, self._at(e))
                if self.cfg.align:
                    p, n = align_to(base, p)
                    self.moved += n
                yield p
                del p

    def task_vectors(self, g: int, hold: bool) -> tuple[Params, Callable[[int], Params], int]:
        """Group ``g``'s base (float32) and its other members' task vectors ``τ_i = member_i − base``
        (aligned if ``align``; in :meth:`members`' order): ``(base, tau, k)`` with ``tau(i)`` the ``i``-th
        of ``k``. ``hold``: made once and kept; else each member's alignment is kept and ``tau(i)`` makes its
        vector again from the bank when asked (the same bits), so a large group holds the base and the
        vectors in use, not every member."""
        bank = self.layer.experts
        b = self.bases[g]
        base = expert_params(bank, self._at(b))
        others = [e for e in self.groups[g] if e != b]
        perms: list[torch.Tensor | None] = []
        held: list[Params] = []

        def make(i: int, perm: torch.Tensor | None) -> Params:
            p = expert_params(bank, self._at(others[i]))
            return sub_(p if perm is None else permute(p, perm), base)  # in place

        for i, e in enumerate(others):
            perm = None
            if self.cfg.align:
                p = expert_params(bank, self._at(e))
                perm = match(base, p)
                self.moved += int((perm != torch.arange(len(perm))).sum())
                p = sub_(permute(p, perm), base) if hold else None
            else:
                p = make(i, None) if hold else None
            perms.append(perm)
            if hold:
                held.append(p)  # type: ignore[arg-type]
            del p

        def tau(i: int) -> Params:
            return held[i] if hold else make(i, perms[i])

        return base, tau, len(others)

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
