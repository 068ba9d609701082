"""Width selection for neuron (atomic-expert) pruning: which width each expert keeps, given a score per
neuron (higher = more important) and a budget. The rules are described in
:mod:`moecompress.passes.neuron_pruning`; this module is the maths, free of engine types.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from moecompress.errors import MethodError
from moecompress.ir import ExpertBank


class WidthRule(Protocol):
    """What width selection reads from a pass configuration."""

    ratio: float
    align: int
    min_width: int
    unseen: str


def uniform_width(width: int, cfg: WidthRule) -> int:
    """The width every expert keeps under ``layout: uniform`` (and unseen experts under ``typical``)."""
    floor = _min_allowed(width, cfg)
    w = math.floor(width * (1 - cfg.ratio) / cfg.align + 0.5) * cfg.align  # nearest; ties keep more
    return width if w >= width else max(floor, w)


def _min_allowed(width: int, cfg: WidthRule) -> int:
    return min(width, math.ceil(cfg.min_width / cfg.align) * cfg.align)


@dataclass
class Scope:
    """Experts competing for one budget: per layer, scores ``[E, I]`` and which experts are exempt."""

    scores: dict[int, torch.Tensor]
    fixed: dict[int, dict[int, int]]  # layer -> {expert: width decided outside the ranking}


def exempt_widths(
    scores: torch.Tensor, counts: torch.Tensor, protected: Iterable[int], cfg: WidthRule
) -> tuple[dict[int, int], list[int]]:
    """Widths of the experts outside the ranking (protected; unseen unless ``unseen: prune``) and the
    list of unseen experts. ``scores`` ``[E, I]`` is modified in place for ``unseen: prune``."""
    width = scores.shape[1]
    fixed = {int(e): width for e in protected}
    unseen = [e for e in range(scores.shape[0]) if float(counts[e]) == 0 and e not in fixed]
    for e in unseen:
        if cfg.unseen == "keep":
            fixed[e] = width
        elif cfg.unseen == "typical":
            fixed[e] = uniform_width(width, cfg)
        else:
            scores[e] = -1.0
    return fixed, unseen


def select_widths(scope: Scope, cfg: WidthRule) -> dict[int, torch.Tensor]:
    """Kept width per expert ``{layer: widths [E]}`` for the whole scope; see the module docstring."""
    total = sum(s.numel() for s in scope.scores.values())
    target = round(cfg.ratio * total)
    widths = {i: torch.full((s.shape[0],), s.shape[1], dtype=torch.int64) for i, s in scope.scores.items()}
    for i, fixed in scope.fixed.items():
        for e, w in fixed.items():
            widths[i][e] = w
    target -= sum(int(s.shape[1] - widths[i][e]) for i, s in scope.scores.items() for e in scope.fixed[i])
    cost, size, owner, depth = [], [], [], []
    keys: list[tuple[int, int]] = []
    for i, s in scope.scores.items():
        allowed = torch.tensor(_allowed(s.shape[1], cfg))
        rows = [e for e in range(s.shape[0]) if e not in scope.fixed[i]]
        if not rows or len(allowed) < 2:
            continue
        srt = s[rows].double().sort(dim=1, descending=True).values
        cs = torch.cat([srt.new_zeros(len(rows), 1), srt.cumsum(1)], dim=1)
        sums = (cs[:, allowed[1:]] - cs[:, allowed[:-1]]).flip(1)  # units from the tail
        cost.append(sums.cummax(1).values.flatten())  # non-decreasing from each tail
        size.append(allowed.diff().flip(0).repeat(len(rows)))
        owner.append(torch.arange(len(keys), len(keys) + len(rows)).repeat_interleave(sums.shape[1]))
        keys += [(i, e) for e in rows]
        depth.append(torch.arange(sums.shape[1]).repeat(len(rows)))
    capacity = int(torch.cat(size).sum()) if size else 0
    if target > capacity:
        raise MethodError(
            f"ratio={cfg.ratio} needs {target} more neurons removed but only {capacity} are removable "
            "(protected experts, min_width and unseen experts are exempt); lower the ratio"
        )
    if target <= 0 or not cost:
        return widths
    c, z, o = torch.cat(cost), torch.cat(size), torch.cat(owner)
    d = torch.cat(depth)
    order = torch.arange(len(c))
    for key in (d, o, c):  # lexicographic (cost, expert, depth from the tail) by stable sorts
        order = order[key[order].sort(stable=True).indices]
    removed = torch.zeros(len(keys), dtype=torch.int64)
    csum = z[order].cumsum(0)
    k = int(torch.searchsorted(csum, torch.tensor(target), right=True))
    removed.index_add_(0, o[order[:k]], z[order[:k]])
    left = target - (int(csum[k - 1]) if k else 0)
    closed: set[int] = set()
    for u in order[k:].tolist():  # only when align leaves a remainder
        if left <= 0:
            break
        who = int(o[u])
        if who in closed:
            continue
        if int(z[u]) <= left:
            removed[who] += z[u]
            left -= int(z[u])
        else:
            closed.add(who)
    for n, (i, e) in enumerate(keys):
        widths[i][e] -= removed[n]
    return widths


def _allowed(width: int, cfg: WidthRule) -> list[int]:
    lo = _min_allowed(width, cfg)
    return sorted({*range(lo, width + 1, cfg.align), width})


def neuron_norms(bank: ExpertBank) -> torch.Tensor:
    """``[E, I]``: L2 norm of each neuron's 3·H weights (gate row, up row, down column)."""
    def sq(lay, e: int, dim: int) -> torch.Tensor:
        return lay.expert(e).float().pow(2).sum(dim)

    return torch.stack([
        (sq(bank.gate, e, -1) + sq(bank.up, e, -1) + sq(bank.down, e, 0)).sqrt() for e in range(bank.num_experts)
    ])  # one expert's float32 copy at a time
