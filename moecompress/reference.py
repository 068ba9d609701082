"""Reference forward of a canonical :class:`~moecompress.ir.MoELayer`: plain, readable PyTorch.

This is the oracle every other number in the project is checked against. It must equal the
transformers MoE block of each supported architecture (fp32, relative error <= 1e-5, see
``tests/test_adapters_forward.py``) and it is correct for every layout because it only uses the
:class:`~moecompress.layouts.Layout` interface. Speed is not a goal here; kernels are.

Routing is computed in fp32 (as the transformers routers do); expert matmuls run in the weights'
dtype; the weighted sum is accumulated in fp32 and cast back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from moecompress.ir import Act, ExpertBank, Gating, GroupScore, MoELayer, RouterSpec
from moecompress.methods.rotation import fake_quant_tokens


def router_logits(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Router logits ``[T, E]`` in fp32."""
    bias = None if layer.router_bias is None else layer.router_bias.float()
    return F.linear(x.float(), layer.router_weight.float(), bias)


def _group_limit(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """Keep only the experts of the ``topk_group`` best groups (others become -inf)."""
    if spec.n_group is None:
        return choice
    t, e = choice.shape
    grouped = choice.view(t, spec.n_group, e // spec.n_group)
    if spec.group_score is GroupScore.TOP2_SUM:
        group_scores = grouped.topk(min(2, e // spec.n_group), dim=-1).values.sum(-1)
    else:
        group_scores = grouped.max(dim=-1).values
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(spec.topk_group, dim=-1).indices, True)
    mask = keep.unsqueeze(-1).expand_as(grouped).reshape(t, e)
    return choice.masked_fill(~mask, float("-inf"))


def _sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's SparseMixer (inference branch): two picks, each weighted by a masked softmax."""
    ids, weights = [], []
    masked = logits
    for _ in range(2):
        best, pick = masked.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=best)
        outside = (best - logits) / factor > 2 * eps
        w = masked.masked_fill(outside, float("-inf")).softmax(dim=-1).gather(-1, pick)
        ids.append(pick)
        weights.append(w)
        masked = masked.scatter(-1, pick, float("-inf"))
    return torch.cat(ids, dim=-1), torch.cat(weights, dim=-1)


def route(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: returns ``(ids [T, k] int64 logical expert ids, weights [T, k] fp32)``."""
    _, ids, w = _route(layer, x)
    return ids, w


def route_logits(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [T, E], ids [T, k], weights [T, k])``: :func:`route` with the router logits."""
    return _route(layer, x)


def _route(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = layer.router
    logits = router_logits(layer, x)
    if spec.gating is Gating.SPARSEMIXER:
        ids, w = _sparsemixer(logits, spec.jitter_eps)
        return logits, ids, w * spec.routed_scale
    if spec.gating is Gating.SOFTMAX_TOPK:
        scores = logits.softmax(dim=-1)
    elif spec.gating is Gating.SIGMOID:
        scores = logits.sigmoid()
    else:  # TOPK_SOFTMAX selects on raw logits
        scores = logits
    choice = scores if layer.score_bias is None else scores + layer.score_bias.float()
    choice = _group_limit(choice, spec)
    ids = choice.topk(spec.top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if spec.gating is Gating.TOPK_SOFTMAX:
        w = w.softmax(dim=-1)
    elif spec.norm_topk:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, ids, w * spec.routed_scale


def _act(bank: ExpertBank, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if bank.act is Act.SWIGLU_CLAMPED:
        g = g.clamp(max=bank.limit)
        u = u.clamp(min=-bank.limit, max=bank.limit)
        return (u + 1) * (g * torch.sigmoid(g * bank.alpha))
    return F.silu(g) * u


def bank_input(bank: ExpertBank, x: torch.Tensor, e: int | None = None) -> torch.Tensor:
    """What the gate/up projections of the bank (of expert ``e``) read: ``x``, rotated
    (``x @ rotation``) and fake-quantised per token (``act_bits``) when the bank says so (``codequant``);
    experts in ``bank.unrotated`` read ``x`` itself."""
    if e is not None and e in bank.unrotated:
        return x
    if bank.rotation is not None:
        x = F.linear(x.to(bank.rotation.dtype), bank.rotation.T)
    if bank.act_bits is not None:
        x = fake_quant_tokens(x, bank.act_bits)
    return x


def _cut(bank: ExpertBank, e: int) -> int | None:
    """Live width of expert ``e`` when it is pruned, else ``None`` (pruned neurons take no part)."""
    live = bank.width_of(e)
    return live if live < bank.width else None


def _hidden(bank: ExpertBank, e: int, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Down-projection input of expert ``e`` from its live gate/up outputs (biases, activation)."""
    n = g.shape[1]
    if "gate" in bank.biases:
        g = g + bank.biases["gate"][e][:n]
    if "up" in bank.biases:
        u = u + bank.biases["up"][e][:n]
    return _act(bank, g, u)


def _logical(bank: ExpertBank, h: torch.Tensor) -> torch.Tensor:
    """``h`` at the bank's full width (pruned neurons read 0), as statistics expect it."""
    return (
        h if h.shape[1] == bank.width else torch.cat([h, h.new_zeros(h.shape[0], bank.width - h.shape[1])], 1)
    )


def expert_forward(
    bank: ExpertBank, e: int, x: torch.Tensor, observe: Callable[[torch.Tensor], None] | None = None
) -> torch.Tensor:
    """Output ``[T, H]`` of physical expert ``e`` of ``bank`` on tokens ``x`` ``[T, H]`` (unweighted).

    ``observe(h)`` is called with the down-projection input ``h`` ``[T, I]`` (calibration statistics)."""
    cut = _cut(bank, e)
    x = bank_input(bank, x, e)
    h = _hidden(bank, e, bank.gate.apply(x, e, rows=cut), bank.up.apply(x, e, rows=cut))
    if observe is not None:
        observe(_logical(bank, h))
    y = bank.down.apply(h, e, cols=cut)
    if "down" in bank.biases:
        y = y + bank.biases["down"][e]
    return y


class Observer(Protocol):
    """Receives the internals of :func:`moe_forward` (used to gather calibration statistics)."""

    def on_route(self, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None: ...

    def on_expert(
        self, e: int, tok: torch.Tensor, slot: torch.Tensor, h: torch.Tensor, y: torch.Tensor
    ) -> None:
        """Physical expert ``e`` ran on tokens ``tok`` (routing slots ``slot``); ``h`` is its
        down-projection input ``[n, I]``, ``y`` its unweighted output ``[n, H]``."""

    def on_shared(self, h: torch.Tensor, y: torch.Tensor) -> None: ...


def moe_forward(layer: MoELayer, x: torch.Tensor, observer: Observer | None = None) -> torch.Tensor:
    """The MoE block's output for hidden states ``x`` of shape ``[T, H]``."""
    if x.dim() != 2 or x.shape[1] != layer.hidden_size:
        raise ValueError(f"moe_forward expects x of shape [T, {layer.hidden_size}], got {tuple(x.shape)}")
    logits, ids, weights = _route(layer, x)
    if observer is not None:
        observer.on_route(logits, ids, weights)
    out = experts_forward(layer.experts, x, ids, weights, layer.expert_map, observer)
    if layer.shared is not None:
        out = out + shared_forward(layer, x, observer)
    return out.to(x.dtype)


def shared_forward(layer: MoELayer, x: torch.Tensor, observer: Observer | None = None) -> torch.Tensor:
    """The shared expert's output ``[T, H]`` in fp32, gated when the layer has a ``shared_gate``."""
    assert layer.shared is not None
    seen: list[torch.Tensor] = []
    s = expert_forward(layer.shared, 0, x, None if observer is None else seen.append)
    if observer is not None:
        observer.on_shared(seen[0], s)
    s = s.float()
    if layer.shared_gate is not None:
        s = s * torch.sigmoid(F.linear(x.float(), layer.shared_gate.float()))
    return s


def physical_ids(ids: torch.Tensor, n_logical: int, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """Physical expert of each routing slot (``-1``: a routing policy's dropped slot, an id past the last
    logical expert, transformers' convention ``id == E``)."""
    dropped = ids >= n_logical
    phys = ids if expert_map is None else expert_map.to(ids.device)[ids.clamp(max=n_logical - 1)]
    return phys.masked_fill(dropped, -1)


def experts_forward(
    bank: ExpertBank,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    observer: Observer | None = None,
) -> torch.Tensor:
    """Weighted sum of the routed experts, fp32 ``[T, H]``: ``sum_k weights[t, k] * E_{ids[t, k]}(x_t)``.

    ``ids`` are logical expert ids (an id past the last expert is a dropped slot and contributes nothing);
    ``expert_map`` maps them to physical experts of ``bank``. Written with
    the layouts' ``encode``/``partial``/``decode`` so factorised layouts do their shared work once per
    token: the gate/up input transform before the loop, the down output transform after the weighted
    sum (``decode`` is linear)."""
    n_logical = bank.num_experts if expert_map is None else expert_map.numel()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    acc: dict[str, torch.Tensor] = {}
    expert_partials(bank, x, physical_ids(ids, n_logical, expert_map), weights, out, acc, observer)
    for space, value in acc.items():
        out += bank.down.decode(space, value).float()
    return out


def expert_partials(
    bank: ExpertBank,
    x: torch.Tensor,
    phys: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    acc: dict[str, torch.Tensor],
    observer: Observer | None = None,
    first: int = 0,
) -> None:
    """Add the weighted partials of the experts of ``bank`` to ``acc`` (per layout space, decoded by the
    caller) and their down biases outside the output space to ``out``. ``bank`` holds physical experts
    ``[first, first + bank.num_experts)`` of the layer (a chunk of experts: ``phys`` are the layer's
    physical ids of :func:`physical_ids`; slots of other experts are skipped). Called chunk after chunk
    on the same ``out`` and ``acc``, the sums are those of one call on the whole bank, bit for bit."""
    for term in expert_terms(bank, x, phys, weights, observer, first):
        add_term(term, out, acc)


@dataclass(frozen=True)
class Term:
    """One expert's weighted contribution to the MoE output: ``part`` (fp32 ``[len(tok), D]``) goes to
    the rows ``tok`` of the accumulator of layout ``space``; ``bias`` (or ``None``), its down bias outside
    that space, to the rows ``tok`` of the output."""

    expert: int
    tok: torch.Tensor
    space: str
    part: torch.Tensor
    bias: torch.Tensor | None = None


def add_term(term: Term, out: torch.Tensor, acc: dict[str, torch.Tensor]) -> None:
    """Add ``term`` where :func:`expert_partials` adds it (terms added in expert order give its bits)."""
    if term.bias is not None:
        out.index_add_(0, term.tok, term.bias)
    if term.space not in acc:
        acc[term.space] = torch.zeros(out.shape[0], term.part.shape[1], dtype=torch.float32, device=out.device)
    acc[term.space].index_add_(0, term.tok, term.part)


def expert_terms(
    bank: ExpertBank,
    x: torch.Tensor,
    phys: torch.Tensor,
    weights: torch.Tensor,
    observer: Observer | None = None,
    first: int = 0,
) -> Iterator[Term]:
    """The :class:`Term` of every expert of ``bank`` that a slot of ``phys`` reaches, in expert order
    (see :func:`expert_partials`); the observer sees each expert as its term is made."""
    n = bank.num_experts
    xin = bank_input(bank, x)
    ctx = {False: (bank.gate.encode(xin), bank.up.encode(xin))}
    if bank.unrotated:
        ctx[True] = (bank.gate.encode(x), bank.up.encode(x)) if xin is not x else ctx[False]
    for q in torch.unique(phys).tolist():
        p = q - first
        if not 0 <= p < n:
            continue
        tok, slot = torch.where(phys == q)
        cut = _cut(bank, p)
        ctx_g, ctx_u = ctx[p in bank.unrotated]
        g = bank.gate.decode(*bank.gate.partial(ctx_g, p, tok, rows=cut))
        u = bank.up.decode(*bank.up.partial(ctx_u, p, tok, rows=cut))
        h = _hidden(bank, p, g, u)
        space, mid = bank.down.partial(
            bank.down.encode(h), p, torch.arange(len(tok), device=x.device), cols=cut
        )
        w = weights[tok, slot, None].float()
        bias = bank.biases.get("down")
        extra = None
        if bias is not None and space == "out":  # already in the output space: add it as transformers does
            mid = mid + bias[p]
        elif bias is not None:
            extra = bias[p].float().expand(len(tok), -1) * w
        term = Term(q, tok, space, mid.float() * w, extra)
        if observer is not None:
            y = bank.down.decode(space, mid)
            y = y + bias[p] if bias is not None and space != "out" else y
            observer.on_expert(q, tok, slot, _logical(bank, h), y)
        yield term
