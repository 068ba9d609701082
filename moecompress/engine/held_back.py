"""The reconstruction error of a layer worked by units, on the held-back tokens: per state (the original
layer, then after each step) the routing of the tokens on the state's whole router, the routed experts'
outputs summed over the units in unit order (:class:`ErrPart`, from any rank), the shared expert once,
and the largest expert output (the massive-activation check)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moecompress.engine import chunks
from moecompress.engine.protection import TopActivation
from moecompress.ir import ExpertBank, MoELayer, cast_layer, layer_to
from moecompress.layouts.dense import Dense
from moecompress.reference import (
    expert_forward,
    expert_partials,
    experts_forward,
    moe_forward,
    physical_ids,
    route,
    route_logits,
    shared_forward,
)


@dataclass
class ErrPart:
    """One chunk's addition to state ``state``'s routed sum on the held-back tokens (0: the original
    layer, ``s + 1``: after step ``s``) and the largest |expert output| it saw."""

    state: int
    acc: torch.Tensor
    top: float


def _bank_to(bank: ExpertBank, dev) -> ExpertBank:
    return dataclasses.replace(
        bank, gate=bank.gate.to(dev), up=bank.up.to(dev), down=bank.down.to(dev),
        widths=None if bank.widths is None else bank.widths.to(dev), biases={k: v.to(dev) for k, v in bank.biases.items()},
    )  # fmt: skip


PIECE = 1
"""Experts of a dense bank cast to the compute dtype at once for a forward of the held-back tokens
(:meth:`Errors.part`, :func:`forward_by_pieces`). A Qwen3-30B expert is 19 MB in float32, which the allocator
reuses from piece to piece; a chunk of 16 (300 MB) or a whole layer (2.4 GB) is fresh memory each time, and
touching it for the first time cost more than the cast (one thread, AMD EPYC, a layer's 8 chunks of 16:
3.3-3.8 s by chunks, 2.9-3.1 s by 4 experts, 2.1-2.3 s by 1 expert)."""


def _pieces(bank: ExpertBank, size: int) -> list[tuple[int, ExpertBank]]:
    """``(first expert, bank)`` pieces of ``size`` experts of a dense bank (views, not copies); a bank with an
    input rotation, ragged widths or another layout stays whole (its forward has shared work per call)."""
    lays = (bank.gate, bank.up, bank.down)
    if bank.rotation is not None or bank.unrotated or bank.widths is not None or not all(isinstance(x, Dense) for x in lays):
        return [(0, bank)]
    return [(a, dataclasses.replace(bank, gate=Dense(bank.gate.weight[a:b]), up=Dense(bank.up.weight[a:b]),
                                    down=Dense(bank.down.weight[a:b]), biases={k: v[a:b] for k, v in bank.biases.items()}))
            for a, b in chunks.bounds(bank.num_experts, size)]  # fmt: skip


def forward_by_pieces(layer: MoELayer, hx: torch.Tensor, dtype, dev, observer=None) -> torch.Tensor:
    """``moe_forward(layer_to(cast_layer(layer, dtype), dev), hx, observer)``, bit for bit, with a dense bank's
    routed experts cast :data:`PIECE` at a time (the sums of :func:`reference.expert_partials` chunk after
    chunk are one call's)."""
    pieces = _pieces(layer.experts, PIECE)
    if len(pieces) == 1 or layer.expert_map is not None:
        return moe_forward(layer_to(cast_layer(layer, dtype), dev), hx, observer)
    bank = layer.experts
    meta = dataclasses.replace(bank, gate=Dense(bank.gate.weight.to("meta")), up=Dense(bank.up.weight.to("meta")),
                               down=Dense(bank.down.weight.to("meta")))  # fmt: skip
    light = _router_part(layer.replace(experts=meta), dev, dtype)  # the router and shared expert, cast
    logits, ids, weights = route_logits(light, hx)
    if observer is not None:
        observer.on_route(logits, ids, weights)
    phys = physical_ids(ids, layer.experts.num_experts)
    out = _routed_sum(light, bank, 0, hx, phys, weights, dev, dtype, observer)
    if light.shared is not None:
        out = out + shared_forward(light, hx, observer)
    return out.to(hx.dtype)


def _routed_sum(shell: MoELayer, bank: ExpertBank, start: int, hx, phys, weights, dev, dtype, observer) -> torch.Tensor:
    """The float32 sum on ``hx`` of the routed experts of ``bank`` (experts ``[start, start + n)`` of
    ``shell``'s layer; ``phys`` ``[T, k]`` in ``[0, n]``, ``n``: not in the bank), each :data:`PIECE` of a dense
    bank cast to ``dtype`` on ``dev`` as its turn comes. ``shell`` holds the router and the shared expert,
    already cast and on ``dev`` (:func:`_router_part`), so a piece's sub-layer moves only its experts."""
    out = torch.zeros(hx.shape, dtype=torch.float32, device=hx.device)
    acc: dict[str, torch.Tensor] = {}
    for first, piece in _pieces(bank, PIECE):
        b = cast_layer(layer_to(chunks.sub_layer(shell, piece, start + first), dev), dtype).experts
        expert_partials(b, hx, phys, weights, out, acc, observer, first)
    for space, value in acc.items():
        out += b.down.decode(space, value).float()
    return out


def _router_part(shell: MoELayer, dev, dtype) -> MoELayer:
    """The shell in the compute dtype with its router and shared expert on ``dev`` (experts stay ``meta``)."""
    cast = cast_layer(shell, dtype)

    def t(x):
        return None if x is None else x.to(dev)

    shared = None if cast.shared is None else _bank_to(cast.shared, dev)
    return cast.replace(router_weight=t(cast.router_weight), router_bias=t(cast.router_bias),
                        score_bias=t(cast.score_bias), shared=shared, shared_gate=t(cast.shared_gate))  # fmt: skip


class Errors:
    """Per state (0: the original layer, s + 1: after step s) the routing of the held-back tokens, the
    routed experts' running sum over chunks and the top activation. :meth:`part` is a chunk's share (on
    any rank), :meth:`add` adds it in chunk order (rank 0)."""

    def __init__(self, shells: list[MoELayer], hx: torch.Tensor, dev, dtype) -> None:
        self.hx, self.dev, self.dtype = hx, dev, dtype
        cache: dict[int, tuple] = {}
        self.shells = [_router_part(s, dev, dtype) for s in shells]
        self.routes = []
        for s, cast in zip(shells, self.shells):
            if id(s) not in cache:
                cache[id(s)] = route(cast, hx)
            self.routes.append(cache[id(s)])
        self.acc = [torch.zeros(hx.shape, dtype=torch.float32, device=dev) for _ in shells]
        self.tops = [TopActivation() for _ in shells]

    def part(self, state: int, bank: ExpertBank, start: int) -> ErrPart:
        """The chunk ``bank`` of experts ``[start, start + n)`` of state ``state``: its routed experts' sum on
        the held-back tokens, cast to the compute dtype :data:`PIECE` experts at a time where the bank is
        dense (the sums of one call on the whole chunk, bit for bit: :func:`reference.expert_partials`)."""
        ids, w = self.routes[state]
        n = bank.num_experts
        local = torch.where((ids >= start) & (ids < start + n), ids - start, torch.full_like(ids, n))
        top = TopActivation()
        out = _routed_sum(self.shells[state], bank, start, self.hx, physical_ids(local, n), w, self.dev, self.dtype, top)
        return ErrPart(state, out, top.value)

    def part_rows(self, state: int, bank: ExpertBank, local_of: torch.Tensor) -> ErrPart:
        """As :meth:`part`, for a bank holding the experts of state ``state`` that ``local_of`` ``[E_logical]``
        maps to their rows (``bank.num_experts``: not held): a unit of groups of a merging step
        (``Chunking('group')``), its members before, its output experts after (through the expert map)."""
        ids, w = self.routes[state]
        local = local_of.to(ids.device)[ids]
        b = cast_layer(layer_to(chunks.sub_layer(self.shells[0], bank, 0), self.dev), self.dtype).experts
        top = TopActivation()
        return ErrPart(state, experts_forward(b, self.hx, local, w, None, top), top.value)

    def add(self, part: ErrPart) -> None:
        self.acc[part.state] += part.acc.to(self.dev)
        top = self.tops[part.state]
        top.value = max(top.value, part.top)

    def output(self, state: int) -> torch.Tensor:
        """The state's block output: the routed sum plus the shared expert (as ``reference.moe_forward``)."""
        layer, out, top = self.shells[state], self.acc[state], self.tops[state]
        if layer.shared is not None:
            seen: list[torch.Tensor] = []
            s = expert_forward(layer.shared, 0, self.hx, seen.append)
            top.on_shared(seen[0], s)
            s = s.float()
            if layer.shared_gate is not None:
                s = s * torch.sigmoid(F.linear(self.hx.float(), layer.shared_gate.float()))
            out = out + s
        return out.to(self.hx.dtype)
