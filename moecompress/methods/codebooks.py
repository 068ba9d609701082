"""CodeQuant's building blocks on one MoE layer: rotation of the bank, per-row codebooks by k-means,
output-aware reassignment, and the routing a chunk of a layer's experts is given (used by
:mod:`moecompress.passes.codequant`; the centroid fine-tuning is :mod:`moecompress.methods.codebook_finetune`).

Shapes: a projection's weights ``w`` ``[M, out, in]`` (the quantised experts only), codebooks
``cents`` ``[M, out, G, K]`` (``G = in / gs`` groups of ``gs`` inputs, ``K = 2^bits``), indices ``codes``
``[M, out, in]`` (``uint8``: ``K <= 256``; widened to int64 a block of rows at a time where an index is needed).
"""

from __future__ import annotations

import dataclasses

import torch

from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.dense import Dense
from moecompress.methods.kmeans import CHUNK_VALUES, SortedRows, expert_uniforms, kmeans_1d, nearest
from moecompress.methods.rotation import fake_quant_tokens
from moecompress.reference import bank_input, expert_forward, route


def rotate_bank(bank: ExpertBank, rotation: torch.Tensor, exempt: frozenset[int]) -> ExpertBank:
    """``bank`` reading ``x @ rotation``: gate/up of every expert but ``exempt`` stored as ``W @ rotation``
    (computed in float64), the function unchanged in exact arithmetic. ``rotation`` is kept in float32
    whatever the model dtype (bf16 would break the exactness); ``exempt`` experts keep their weights
    bit-identical and read the unrotated input."""
    r = rotation.double()
    new = {}
    for name in ("gate", "up"):
        w = getattr(bank, name).dense()
        rot = (w.double() @ r).to(w.dtype)
        keep = torch.tensor(sorted(exempt), dtype=torch.long)
        if len(keep):
            rot[keep] = w[keep]
        new[name] = Dense(rot)
    return dataclasses.replace(bank, **new, rotation=rotation.to(torch.float32), unrotated=exempt)


CODE_DTYPE = torch.uint8
"""The codes' integer type while codequant works (``K = 2^bits <= 256``): 1 byte per weight, not int64's 8."""


def cluster(
    w: torch.Tensor,
    bits: int,
    gs: int,
    *,
    iters: int,
    seed: int,
    keep_sorted: bool = False,
    seeds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, SortedRows]:
    """Per-group k-means (k-means++ seeded) of ``w`` ``[M, out, in]``: ``(cents [M, out, G, K], codes)``.
    Every group of every expert at once (:func:`kmeans_1d` chunks the rows to bound memory).
    ``keep_sorted``: also the groups' :class:`SortedRows` (``reassign_rows(w, G, None)`` without a sort).
    ``seeds``: one seed per expert (:func:`expert_seed`), so that an expert's codebooks do not depend on
    the other experts of the call (``seed`` is then unused)."""
    m, out, inn = w.shape
    g, k = inn // gs, 1 << bits
    u = None if seeds is None else expert_uniforms(k, out * g, seeds)
    res = kmeans_1d(w.reshape(m * out * g, gs), k, iters=iters, seed=seed, keep_sorted=keep_sorted,
                    code_dtype=CODE_DTYPE, uniforms=u)  # fmt: skip
    return (res[0].view(m, out, g, k), res[1].view(m, out, inn), *res[2:])  # type: ignore[return-value]


def expert_seed(seed: int, e: int) -> int:
    """The k-means++ seed of expert ``e`` of a layer (``-1``: the shared expert) for a step's ``seed``."""
    return seed * 1_000_003 + e + 1


def reassign(
    w: torch.Tensor, cents: torch.Tensor, scale: torch.Tensor | None, rows: SortedRows | None = None
) -> torch.Tensor:
    """Output-aware reassignment ``k*(i, j) = argmin_k (B_j W_ij − A_j C_ik)²``, i.e. the centroid
    nearest to ``W_ij · B_j / A_j`` (``scale = B / A`` ``[M, in]``; ``None`` = 1: nearest centroid), as
    :data:`CODE_DTYPE`, a few experts at a time (``CHUNK_VALUES`` weights).
    ``rows``: :func:`reassign_rows` of the same ``w`` and ``scale``, sorted once for repeated calls."""
    m, out, g, k = cents.shape
    inn = w.shape[-1]
    if rows is not None:
        return rows.assign(cents.reshape(m * out * g, k)).view(m, out, inn)
    codes = torch.empty(w.shape, dtype=CODE_DTYPE, device=w.device)
    step = max(1, CHUNK_VALUES // max(out * inn, 1))
    for a in range(0, m, step):
        b = min(a + step, m)
        t = w[a:b] if scale is None else w[a:b] * scale[a:b, None, :]
        codes[a:b] = nearest(t.reshape(-1, inn // g), cents[a:b].reshape(-1, k)).view(b - a, out, inn)
    return codes


def reassign_rows(w: torch.Tensor, groups: int, scale: torch.Tensor | None) -> SortedRows:
    """The values :func:`reassign` assigns (``W_ij · B_j / A_j`` per group of ``w`` ``[M, out, in]``), sorted."""
    m, out, inn = w.shape
    t = w if scale is None else w * scale[:, None, :]
    return SortedRows(t.reshape(m * out * groups, inn // groups), code_dtype=CODE_DTYPE)


def channel_scale(x: torch.Tensor, act_bits: int | None) -> torch.Tensor | None:
    """``B / A`` per input channel for inputs ``x`` ``[n, in]``: ``A_j = E[x_j²]``, ``B_j = E[x_j x̂_j]``
    with ``x̂ = Q_act_bits(x)`` per token; ``None`` without activation quantisation (then ``B = A``).
    Channels without signal (``A_j = 0``) get 1."""
    if act_bits is None or x.shape[0] == 0:
        return None
    xf = x.double()
    a = (xf * xf).mean(0)
    b = (xf * fake_quant_tokens(xf, act_bits)).mean(0)
    return torch.where(a > 0, b / a.clamp_min(1e-300), torch.ones_like(a)).float()


def gate_up_scales(
    layer: MoELayer, x: torch.Tensor, ids: list[int], act_bits: int | None, routing: Routing | None = None
) -> torch.Tensor | None:
    """``B / A`` ``[len(ids), H]`` of each physical expert's (rotated, routed) gate/up input on tokens
    ``x`` of the layer; experts that received no token use every token. ``routing``: the tokens' routing
    given (a chunk of a layer's experts, :class:`Routing`), else ``layer``'s router routes them."""
    if act_bits is None:
        return None
    if routing is None:
        logical, _ = route(layer, x)
        phys = logical if layer.expert_map is None else layer.expert_map[logical]
    xin = bank_input(layer.experts, x)
    rows = []
    for e in ids:
        tok = routing.tokens(e) if routing is not None else torch.where((phys == e).any(-1))[0]
        rows.append(channel_scale(xin[tok] if len(tok) else xin, act_bits))
    return torch.stack(rows)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which tokens reach each expert and with what weight: ``mask`` ``[E, T]`` (bool) and ``gates``
    ``[E, T]`` (float32, 0 where not routed). What a chunk of a layer's experts is given of the layer's
    routing (its sub-layer's router holds only its rows, so it cannot route): :meth:`of` routes on the
    whole layer, :meth:`rows` keeps experts ``[a, b)``."""

    mask: torch.Tensor
    gates: torch.Tensor

    @classmethod
    def of(cls, layer: MoELayer, x: torch.Tensor) -> Routing:
        """The routing of tokens ``x`` by ``layer``'s router (logical ids; no merged experts)."""
        ids, w = route(layer, x)
        e, t = layer.router.num_experts, x.shape[0]
        tok = torch.arange(t, device=ids.device)[:, None].expand_as(ids)
        keep = ids < e  # an id past the last expert is a dropped slot
        mask = torch.zeros(e, t, dtype=torch.bool, device=ids.device)
        gates = torch.zeros(e, t, dtype=torch.float32, device=ids.device)
        mask[ids[keep], tok[keep]] = True
        gates[ids[keep], tok[keep]] = w[keep].float()
        return cls(mask, gates)

    def rows(self, a: int, b: int) -> Routing:
        return Routing(self.mask[a:b], self.gates[a:b])

    def tokens(self, e: int) -> torch.Tensor:
        """The tokens routed to expert ``e``, ascending."""
        return self.mask[e].nonzero()[:, 0]

    def partial(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        """``Σ_e gates[e, t] · E_e(x_t)`` over ``layer``'s experts (fp32 ``[T, H]``): their part of the block's
        output (no shared expert)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.mask.shape[0]):
            tok = self.tokens(e)
            if len(tok):
                out.index_add_(
                    0, tok, expert_forward(layer.experts, e, x[tok]).float() * self.gates[e, tok, None]
                )
        return out
