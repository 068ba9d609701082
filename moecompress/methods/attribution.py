"""Cross-layer routing attribution: router logits decomposed along the residual stream.

Paper: "Understanding Cross-layer Contributions to MoE Routing in LLMs" (METHODS.md §10; code
``wengangli/routing-contribution`` not public). The MoE input of layer ℓ is ``x = γ ⊙ z / RMS(z)`` with
``z`` the residual stream before the MoE block's RMSNorm, and ``z`` is a sum of components::

    z = x⁰ + Σ_{c≤ℓ} a^c + Σ_{c<ℓ} m^c        (embeddings, attention outputs, MoE / MLP outputs)

With the RMS of the *total* shared proportionally (the paper's split; the only approximation, and it is
exact for the sum), component ``c`` has the sub-score ``S_c = W_r (γ ⊙ c) / RMS(z)`` ``[T, E]`` and
``Σ_c S_c = W_r x`` (plus the router bias as its own component). ``γ`` and the per-token ``1/RMS`` are
fitted from ``x`` and ``z`` (:func:`norm_scale`, rank-1 least squares of ``x ≈ γ ⊙ z · u``), so no norm
weight or epsilon has to be known; the fit error is reported.

Per component, over tokens ``t`` and experts ``j``:

- influence ``= mean_t Var_j S_c[t, j]`` (how much the component differentiates experts);
- APS / ANS ``=`` mean of the positive / negative sub-scores; ``selected`` = mean sub-score on the
  top-k experts actually chosen (> 0 promotes the choice, < 0 inhibits it);
- AARV (causal check) ``= mean_t (1/K) Σ_{e∈topK(t)} |rank(e) − rank'(e)|`` with ranks of the routing
  scores before and after removing ``S_c`` (zeroing the component).

A routed expert ``e`` of an earlier MoE layer ``c`` contributes ``w_{t,e} y_{t,e}`` to ``m^c``; the same
quantities on that contribution (per (token, slot) where ``e`` was selected) give each expert's pull on
later routers: the hub score.
"""

from __future__ import annotations

import torch

ATTRIB_TOKENS = 128
"""Calibration tokens (the first ones of the non-held-back batches) the attribution is computed on."""


def norm_scale(x: torch.Tensor, z: torch.Tensor, iters: int = 5) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(γ [H], u [T], relative error)`` with ``x ≈ γ ⊙ z · u[:, None]`` (RMSNorm: ``u = 1/RMS(z)``),
    by alternating least squares from ``u = 1/RMS(z)``. float64."""
    x, z = x.double(), z.double()
    u = z.pow(2).mean(1).clamp_min(1e-300).rsqrt()
    for _ in range(iters):
        zu = z * u[:, None]
        g = (x * zu).sum(0) / zu.pow(2).sum(0).clamp_min(1e-300)
        zg = z * g
        u = (x * zg).sum(1) / zg.pow(2).sum(1).clamp_min(1e-300)
    err = float((x - g * z * u[:, None]).norm() / x.norm().clamp_min(1e-300))
    return g, u, err


def sub_scores(parts: torch.Tensor, gamma: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[C, T, E]``: ``S_c = ((γ ⊙ c) u) W_rᵀ`` for components ``parts`` ``[C, T, H]``, router ``w`` ``[E, H]``."""
    return torch.einsum("cth,eh->cte", parts.double() * gamma * u[None, :, None], w.double())


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every expert (0 = highest score) along the last dimension; ties by expert id."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    return order.argsort(dim=-1, stable=True)


def aarv(choice: torch.Tensor, sub: torch.Tensor, k: int) -> torch.Tensor:
    """``[...]``: mean over the top-``k`` of ``choice`` ``[T, E]`` of ``|rank − rank'|`` after
    subtracting each ``sub`` ``[..., T, E]``, averaged over tokens."""
    r0 = ranks(choice)
    top = choice.topk(k, dim=-1).indices  # [T, k]
    r1 = ranks(choice - sub)
    idx = top.expand(*sub.shape[:-1], k) if sub.dim() > 2 else top
    before = r0.gather(-1, top).double()
    after = r1.gather(-1, idx).double()
    return (after - before).abs().mean(-1).mean(-1)


def component_stats(sub: torch.Tensor, choice: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Influence, APS, ANS, selected mean and AARV ``[C]`` of sub-scores ``[C, T, E]``."""
    pos, neg = sub.clamp_min(0), sub.clamp_max(0)
    npos, nneg = (sub > 0).sum((1, 2)).clamp_min(1), (sub < 0).sum((1, 2)).clamp_min(1)
    top = choice.topk(k, dim=-1).indices
    sel = sub.gather(-1, top.expand(sub.shape[0], *top.shape))
    return {
        "influence": sub.var(-1, unbiased=False).mean(-1),
        "aps": pos.sum((1, 2)) / npos,
        "ans": neg.sum((1, 2)) / nneg,
        "selected": sel.mean((1, 2)),
        "aarv": aarv(choice, sub, k),
    }


def expert_pull(
    contrib: torch.Tensor,
    ids: torch.Tensor,
    gamma,
    u,
    w: torch.Tensor,
    choice: torch.Tensor,
    k: int,
    n_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per expert of an earlier MoE layer: summed influence, summed AARV and count ``[n_experts]`` of its
    contributions ``contrib`` ``[T, k_c, H]`` (``ids`` ``[T, k_c]``; ``-1`` = no token) on a router ``w``."""
    t, kc, _ = contrib.shape
    s = torch.einsum("tsh,eh->ste", contrib.double() * gamma * u[:, None, None], w.double())  # [k_c, T, E]
    infl = s.var(-1, unbiased=False)  # [k_c, T]
    top = choice.topk(k, dim=-1).indices
    r0 = ranks(choice).gather(-1, top).double()  # [T, k]
    r1 = ranks(choice[None] - s).gather(-1, top.expand(kc, t, k)).double()
    av = (r1 - r0).abs().mean(-1)  # [k_c, T]
    valid = ids.T >= 0
    e = ids.T.clamp_min(0)[valid]
    out = [torch.zeros(n_experts, dtype=torch.float64).index_add_(0, e, v[valid]) for v in (infl, av)]
    cnt = torch.zeros(n_experts, dtype=torch.float64).index_add_(
        0, e, torch.ones_like(e, dtype=torch.float64)
    )
    return out[0], out[1], cnt


def trace_bytes(n_layers: int, n_moe: int, tokens: int, hidden: int, top_k: int, size: int = 4) -> int:
    """Peak memory of the calibration trace: ``(2·n_layers + 1)`` residual components and ``n_moe·top_k``
    expert contributions of ``tokens × hidden`` values, plus one layer's ``[C, T, E]`` sub-scores (float64,
    bounded by the same count with ``E ≤ hidden``)."""
    comps = (2 * n_layers + 1) * tokens * hidden
    return size * (comps + n_moe * top_k * tokens * hidden) + 8 * comps
