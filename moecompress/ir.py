"""The canonical MoE layer: one description for every supported architecture.

Adapters translate on-disk tensors into these frozen dataclasses and back; passes and the reference
forward only ever see this form, so compute code has no architecture branches. Conventions:

- Expert weights use HF ``nn.Linear`` orientation: gate and up ``[E, I, H]``, down ``[E, H, I]``;
  gate and up are always split (GPT-OSS's interleaved columns are separated by its adapter).
- Routing semantics are data (:class:`RouterSpec`), not code paths chosen by model name.
- Passes never mutate a layer: they return ``dataclasses.replace(layer, ...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from moecompress.errors import LayoutError
from moecompress.layouts.base import Layout


class Gating(str, Enum):
    """How router logits become the top-k expert ids and their weights."""

    SOFTMAX_TOPK = "softmax_topk"
    """softmax over all experts, top-k of the probabilities (renormalised iff ``norm_topk``):
    Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2."""
    TOPK_SOFTMAX = "topk_softmax"
    """top-k of the logits, softmax over the k selected logits: GPT-OSS."""
    SIGMOID = "sigmoid"
    """sigmoid scores; selection on scores + ``score_bias``; weights are the unbiased scores
    (renormalised iff ``norm_topk``): DeepSeek-V3."""
    SPARSEMIXER = "sparsemixer"
    """PhiMoE's SparseMixer at inference: two sequential argmax picks, each weighted by a softmax over
    the logits within a relative margin ``2 * jitter_eps`` of the pick."""


class GroupScore(str, Enum):
    """How a group of experts is scored for group-limited top-k."""

    MAX = "max"
    """best expert score in the group (DeepSeek-V2 ``group_limited_greedy``)."""
    TOP2_SUM = "top2_sum"
    """sum of the two best biased scores in the group (DeepSeek-V3 ``noaux_tc``)."""


class Act(str, Enum):
    """The gated activation of an expert: ``down(act(gate x) * up x)``."""

    SWIGLU = "swiglu"
    """``silu(g) * u``."""
    SWIGLU_CLAMPED = "swiglu_clamped"
    """GPT-OSS: ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha g)``."""


@dataclass(frozen=True)
class RouterSpec:
    """Routing semantics of one MoE layer."""

    num_experts: int
    top_k: int
    gating: Gating
    norm_topk: bool = False
    routed_scale: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    group_score: GroupScore | None = None
    jitter_eps: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise LayoutError(f"router top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.n_group is not None:
            if self.topk_group is None or self.group_score is None:
                raise LayoutError("group-limited routing needs n_group, topk_group and group_score")
            if self.num_experts % self.n_group:
                raise LayoutError(
                    f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}"
                )
            reachable = self.topk_group * (self.num_experts // self.n_group)
            if not 1 <= self.topk_group <= self.n_group or self.top_k > reachable:
                raise LayoutError(
                    f"top_k={self.top_k} cannot be met: topk_group={self.topk_group} of n_group="
                    f"{self.n_group} groups reach only {reachable} experts"
                )


@dataclass(frozen=True, eq=False)
class ExpertBank:
    """A bank of SwiGLU experts. ``gate``/``up``: logical ``[E, I, H]``; ``down``: ``[E, H, I]``.

    ``widths[e]`` (optional) is the live intermediate width of expert ``e``: only its first
    ``widths[e]`` gate/up rows and down columns take part in the forward. ``biases`` may hold
    ``"gate"``/``"up"`` ``[E, I]`` and ``"down"`` ``[E, H]`` (GPT-OSS).

    ``rotation`` ``[H, H]`` (optional, orthogonal) is applied to the bank's input once per token,
    ``x' = x @ rotation``, before every expert; gate/up are then stored in the rotated basis
    (``W' = W @ rotation`` leaves ``W' x'`` unchanged). ``act_bits`` (optional) fake-quantises that
    input per token (asymmetric min-max, evaluation of A4-style schemes). Both come from ``codequant``.
    Experts in ``unrotated`` (protected super experts, stored bit-identically) read the original input.
    """

    gate: Layout
    up: Layout
    down: Layout
    widths: torch.Tensor | None = None
    biases: dict[str, torch.Tensor] = field(default_factory=dict)
    act: Act = Act.SWIGLU
    alpha: float = 1.702
    limit: float = 7.0
    rotation: torch.Tensor | None = None
    act_bits: int | None = None
    unrotated: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        e, i, h = self.gate.shape
        if self.rotation is not None and tuple(self.rotation.shape) != (h, h):
            raise LayoutError(f"rotation shape {tuple(self.rotation.shape)} != ({h}, {h})")
        if self.act_bits is not None and not 2 <= self.act_bits <= 16:
            raise LayoutError(f"act_bits={self.act_bits} must be in [2, 16]")
        if any(not 0 <= x < e for x in self.unrotated):
            raise LayoutError(f"unrotated experts {sorted(self.unrotated)} out of [0, {e})")
        if self.up.shape != (e, i, h):
            raise LayoutError(f"up shape {self.up.shape} != gate shape {(e, i, h)}")
        if self.down.shape != (e, h, i):
            raise LayoutError(f"down shape {self.down.shape} != expected {(e, h, i)}")
        own = [
            lay.widths for lay in (self.gate, self.up, self.down) if getattr(lay, "widths", None) is not None
        ]
        if own and self.widths is None:  # a ragged layout carries the live widths itself
            object.__setattr__(self, "widths", own[0].to(torch.int64))
        if self.widths is not None and tuple(self.widths.shape) != (e,):
            raise LayoutError(f"widths must have shape ({e},), got {tuple(self.widths.shape)}")
        for w in own:
            if (
                self.widths.device.type != "meta"
                and w.device.type != "meta"
                and not torch.equal(w.to(torch.int64), self.widths.to(torch.int64))
            ):
                raise LayoutError("the ragged layouts' widths and the bank's widths disagree")
        expect = {"gate": (e, i), "up": (e, i), "down": (e, h)}
        for name, b in self.biases.items():
            if name not in expect or tuple(b.shape) != expect[name]:
                raise LayoutError(f"bias {name!r} of shape {tuple(b.shape)}; expected one of {expect}")

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate.shape[2]

    @property
    def width(self) -> int:
        """Full (allocated) intermediate width."""
        return self.gate.shape[1]

    def width_of(self, e: int) -> int:
        return self.width if self.widths is None else int(self.widths[e])

    def _extras(self) -> list[torch.Tensor]:
        return [*self.biases.values(), *([] if self.rotation is None else [self.rotation])]

    def num_params(self) -> int:
        n = self.gate.num_params() + self.up.num_params() + self.down.num_params()
        return n + sum(b.numel() for b in self._extras())

    def nbytes(self) -> int:
        n = self.gate.nbytes() + self.up.nbytes() + self.down.nbytes()
        return n + sum(b.numel() * b.element_size() for b in self._extras())


@dataclass(frozen=True, eq=False)
class MoELayer:
    """One MoE block.

    - ``router_weight`` ``[E, H]`` (+ ``router_bias`` ``[E]`` for GPT-OSS) gives the logits;
      ``score_bias`` ``[E]`` is DeepSeek-V3's selection-only ``e_score_correction_bias``.
    - ``experts`` is the routed bank; ``shared`` an always-on bank (DeepSeek's ``n_shared_experts``
      are one shared expert of width ``n * I``, as transformers stores them), multiplied by
      ``sigmoid(shared_gate @ x)`` when ``shared_gate`` ``[1, H]`` is set (Qwen2-MoE).
    - ``expert_map`` ``[E]`` maps logical (router) expert ids to physical experts of the bank (after
      merging); ``None`` means identity.
    - ``protected`` holds logical expert ids that no pass may modify (super experts).
    - ``routing`` is the runtime routing policy the layer carries (``{"capacity_drop": {...},
      "sere": {...}}``, knobs as ``docs/routing.md`` lists them; ``None``: plain top-k), applied when the
      model runs, never to the weights; ``routing_similarity`` ``[E, E]`` is SERE's expert similarity.
    """

    index: int
    router: RouterSpec
    router_weight: torch.Tensor
    experts: ExpertBank
    router_bias: torch.Tensor | None = None
    score_bias: torch.Tensor | None = None
    shared: ExpertBank | None = None
    shared_gate: torch.Tensor | None = None
    expert_map: torch.Tensor | None = None
    protected: frozenset[int] = frozenset()
    routing: Mapping[str, Mapping[str, Any]] | None = None
    routing_similarity: torch.Tensor | None = None

    def __post_init__(self) -> None:
        e, h = self.router.num_experts, self.experts.hidden_size
        s = self.routing_similarity
        if s is not None and tuple(s.shape) != (e, e):
            raise LayoutError(
                f"layer {self.index}: the routing policy's expert similarity is {tuple(s.shape)} but the router "
                f"has {e} experts; put routing-policy steps (sere) after the steps that remove or merge experts"
            )
        if tuple(self.router_weight.shape) != (e, h):
            raise LayoutError(
                f"layer {self.index}: router weight {tuple(self.router_weight.shape)} != {(e, h)}"
            )
        for name in ("router_bias", "score_bias"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (e,):
                raise LayoutError(f"layer {self.index}: {name} shape {tuple(t.shape)} != ({e},)")
        if self.expert_map is None and self.experts.num_experts != e:
            raise LayoutError(
                f"layer {self.index}: {self.experts.num_experts} physical experts but {e} router rows "
                "and no expert_map"
            )
        if self.expert_map is not None:
            m = self.expert_map
            bad_range = m.device.type != "meta" and (
                int(m.min()) < 0 or int(m.max()) >= self.experts.num_experts
            )
            if tuple(m.shape) != (e,) or bad_range:
                raise LayoutError(f"layer {self.index}: expert_map must map {e} ids into the physical bank")
        if self.shared_gate is not None and (self.shared is None or tuple(self.shared_gate.shape) != (1, h)):
            raise LayoutError(f"layer {self.index}: shared_gate needs a shared bank and shape (1, {h})")
        if any(not 0 <= p < e for p in self.protected):
            raise LayoutError(f"layer {self.index}: protected ids {sorted(self.protected)} out of [0, {e})")

    @property
    def hidden_size(self) -> int:
        return self.experts.hidden_size

    def physical(self, logical: int) -> int:
        """Physical expert that logical expert ``logical`` runs."""
        return logical if self.expert_map is None else int(self.expert_map[logical])

    def num_params(self) -> int:
        n = self.router_weight.numel() + self.experts.num_params()
        for t in (self.router_bias, self.score_bias, self.shared_gate):
            n += 0 if t is None else t.numel()
        return n + (0 if self.shared is None else self.shared.num_params())

    def nbytes(self) -> int:
        """Bytes of everything the layer stores (what compression reports compare)."""
        n = self.experts.nbytes() + (0 if self.shared is None else self.shared.nbytes())
        for t in (self.router_weight, self.router_bias, self.score_bias, self.shared_gate, self.expert_map):
            n += 0 if t is None else t.numel() * t.element_size()
        return n

    def replace(self, **changes) -> MoELayer:
        """``dataclasses.replace`` as a method, for readability in passes."""
        return dataclasses.replace(self, **changes)


def cast_layer(layer: MoELayer, dtype: torch.dtype) -> MoELayer:
    """``layer`` with its dense weights in ``dtype`` (calibration compute dtype)."""

    def bank(b: ExpertBank | None) -> ExpertBank | None:
        if b is None:
            return None
        return dataclasses.replace(
            b,
            gate=b.gate.cast(dtype),
            up=b.up.cast(dtype),
            down=b.down.cast(dtype),
            biases={k: v.to(dtype) for k, v in b.biases.items()},
        )  # a rotation stays float32: rounding it would break the rotated weights' exactness

    def t(x):
        return None if x is None else x.to(dtype) if x.is_floating_point() else x

    return layer.replace(
        experts=bank(layer.experts),
        shared=bank(layer.shared),
        router_weight=t(layer.router_weight),
        router_bias=t(layer.router_bias),
        shared_gate=t(layer.shared_gate),
    )


def layer_to(layer: MoELayer, device: torch.device | str) -> MoELayer:
    """``layer`` with every tensor on ``device`` (the layer itself when it is already there): the
    calibration and pass compute device (``calibration.device``)."""
    device = torch.device(device)

    def t(x):
        return None if x is None else x.to(device)

    def bank(b: ExpertBank | None) -> ExpertBank | None:
        if b is None:
            return None
        return dataclasses.replace(
            b,
            gate=b.gate.to(device),
            up=b.up.to(device),
            down=b.down.to(device),
            widths=t(b.widths),
            biases={k: v.to(device) for k, v in b.biases.items()},
            rotation=t(b.rotation),
        )

    held = [layer.router_weight, layer.router_bias, layer.score_bias, layer.shared_gate, layer.expert_map,
            layer.routing_similarity]  # fmt: skip
    for b in (layer.experts, layer.shared):
        if b is not None:
            held += [b.widths, b.rotation, *b.biases.values()]
            held += [x for lay in (b.gate, b.up, b.down) for x in lay.tensors().values()]
    if all(x.device == device for x in held if x is not None):
        return layer
    return layer.replace(
        experts=bank(layer.experts),
        shared=bank(layer.shared),
        router_weight=t(layer.router_weight),
        router_bias=t(layer.router_bias),
        score_bias=t(layer.score_bias),
        shared_gate=t(layer.shared_gate),
        expert_map=t(layer.expert_map),
        routing_similarity=t(layer.routing_similarity),
    )


FOLD_BLOCKS = 8
"""A layer's experts in this many fixed blocks, whatever the chunk size and the number of ranks, so that a sum
over experts is added in one order everywhere: a two-phase step's first sweep (``Chunking.take``/``add``,
:mod:`moecompress.engine.block_sweep`) and calibration's ``down_in_cov_pooled``
(:class:`~moecompress.calibration.stats.StatsCollector`)."""


def fold_blocks(num_experts: int) -> list[tuple[int, int]]:
    """The blocks ``[(a, b), ...]`` of a layer of ``num_experts`` experts (:data:`FOLD_BLOCKS` of
    ``ceil(E / FOLD_BLOCKS)`` experts, fewer when ``E`` is small)."""
    size = fold_block_size(num_experts)
    return [(a, min(a + size, num_experts)) for a in range(0, num_experts, size)]


def fold_block_size(num_experts: int) -> int:
    """Experts per block of :func:`fold_blocks` (the last block may hold fewer)."""
    return max(1, -(-num_experts // FOLD_BLOCKS))
