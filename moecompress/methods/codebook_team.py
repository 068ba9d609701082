"""The fine-tuning's units (:mod:`moecompress.methods.codebook_finetune`): a layer's experts split into units
fine-tuned at the same time, one per rank, that see each other's tensors through an :class:`Exchange`
(:class:`moecompress.engine.team.Team` over ranks, :class:`Solo` for a whole layer), and what the
fine-tuning computes from gathered values so that its bits do not depend on the split: the objective's
target (:func:`target`) and each part's step-size scale (:func:`mean_abs`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from moecompress.ir import MoELayer
from moecompress.methods.codebooks import Routing
from moecompress.reference import expert_forward, shared_forward


class Exchange(Protocol):
    """The units of one layer's experts fine-tuned at the same time, one per rank (:class:`Solo` alone):
    :meth:`gather` hands every unit's tensors to every unit, in unit order, which is expert order."""

    def gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]: ...


class Solo:
    """One unit holding every expert of the layer: :meth:`gather` is its own tensors."""

    def gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        return [tensors]


def pairs(got: list[list[torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(tokens, rows)`` pairs of every unit's flat ``[tok, y, tok, y, ...]``, in unit order."""
    for ts in got:
        yield from zip(ts[::2], ts[1::2])


def target(layer: MoELayer, routing: Routing, x: torch.Tensor, team: Exchange) -> torch.Tensor:
    """The block's output ``[T, H]`` (fp32) on tokens ``x`` as the fine-tuning's objective sums it: every
    routed expert's weighted output added in expert order (each unit's experts ``layer``, routed by
    ``routing``, gathered from the units), then the shared expert's. The same bits however the experts are
    split into units."""
    mine: list[torch.Tensor] = []
    for e in range(routing.mask.shape[0]):
        tok = routing.tokens(e)
        if len(tok):
            mine += [tok, expert_forward(layer.experts, e, x[tok]).float() * routing.gates[e, tok, None]]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for tok, y in pairs(team.gather(mine)):
        out.index_add_(0, tok, y)
    return out + shared_forward(layer, x) if layer.shared is not None else out


def mean_abs(parts: dict[tuple[str, str], dict], team: Exchange | None) -> dict[tuple[str, str], float]:
    """Each part's mean |weight| over the layer (its step size's scale): with a team, every unit's float64
    sums per expert added in expert order (the same bits however the experts are split)."""
    if team is None:
        return {k: float(p["w"].abs().mean()) for k, p in parts.items()}
    keys = sorted(parts)
    mine = [parts[k]["w"].abs().double().flatten(1).sum(1) for k in keys]
    mine += [torch.tensor([parts[k]["w"].numel()], dtype=torch.float64) for k in keys]
    got = team.gather(mine)
    n = len(keys)
    return {k: float(torch.cat([g[i] for g in got]).sum()) / float(sum(float(g[n + i]) for g in got))
            for i, k in enumerate(keys)}  # fmt: skip
