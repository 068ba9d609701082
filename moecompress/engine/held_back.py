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
from moecompress.reference import expert_forward, experts_forward, route


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
        ids, w = self.routes[state]
        n = bank.num_experts
        local = torch.where((ids >= start) & (ids < start + n), ids - start, torch.full_like(ids, n))
        b = cast_layer(
            layer_to(chunks.sub_layer(self.shells[state], bank, start), self.dev), self.dtype
        ).experts
        # (the sub-layer holds the state's router rows and shared expert, already on the device)
        top = TopActivation()
        return ErrPart(state, experts_forward(b, self.hx, local, w, None, top), top.value)

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
