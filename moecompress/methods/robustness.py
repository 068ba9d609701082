"""Routing stability and robustness: MoEEdit's routing-stability metrics and a TLGA-style router attack.

- **Stability** (MoEEdit, arXiv 2602.10965, METHODS.md §10): between two routings of the same tokens,
  the top-k Jaccard ``J = mean_t |A_t ∩ B_t| / |A_t ∪ B_t|`` of the selected-expert sets and the router
  KL ``mean_t KL(softmax(l_a) ‖ softmax(l_b))`` of the router distributions.
- **Attack** (TLGA, "Temporal Lipschitz-Guided Attacks", seed abstract in ``shared/seeds/``: attacks on
  the router alone, here without the temporal part): a perturbation ``δ_t`` of each MoE input with
  ``‖δ_t‖₂ ≤ ε‖x_t‖₂`` (relative, so one ``ε`` fits every layer) found by projected gradient ascent on
  the negative router margin ``−(min_{i∈S_t} c_i − max_{j∉S_t} c_j)``, ``S_t`` the clean top-k and ``c``
  the selection scores (gating of the logits plus any selection bias; group limits ignored), ``steps``
  normalised-gradient steps of ``2.5·ε/steps``. Reported: J and KL between clean and attacked routing,
  and the share of tokens whose top-k set changed. ``ε = 0`` gives ``δ = 0``: J = 1, KL = 0 exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Scores = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``x [T, H] -> (router logits [T, E], selection scores [T, E])``, differentiable in ``x``."""


def topk_jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token Jaccard ``[T]`` of the id sets ``a`` ``[T, k]`` and ``b`` ``[T, k']``."""
    hit = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1).double()
    return hit / (a.shape[1] + b.shape[1] - hit)


def router_kl(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(softmax(la) ‖ softmax(lb))`` ``[T]`` (float64)."""
    pa, qa = la.double().log_softmax(-1), lb.double().log_softmax(-1)
    return (pa.exp() * (pa - qa)).sum(-1).clamp_min(0)


def margin(choice: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``[T]``: lowest selected score minus highest unselected one (``top`` ``[T, k]`` the selected ids)."""
    sel = torch.zeros_like(choice, dtype=torch.bool).scatter(1, top, True)
    inf = torch.finfo(choice.dtype).max
    return choice.masked_fill(~sel, inf).min(1).values - choice.masked_fill(sel, -inf).max(1).values


def attack(scores: Scores, x: torch.Tensor, k: int, eps: float, steps: int = 10) -> torch.Tensor:
    """The perturbed inputs ``x + δ`` (``‖δ_t‖ ≤ eps‖x_t‖``) maximising the routing change (see above)."""
    x = x.detach().float()
    if eps == 0 or steps == 0:
        return x.clone()
    with torch.no_grad():
        top = scores(x)[1].topk(k, dim=-1).indices
    radius = eps * x.norm(dim=1, keepdim=True)
    delta = torch.zeros_like(x, requires_grad=True)
    step = 2.5 * eps / steps
    for _ in range(steps):
        loss = -margin(scores(x + delta)[1], top).sum()
        (g,) = torch.autograd.grad(loss, delta)
        with torch.no_grad():
            delta += step * x.norm(dim=1, keepdim=True) * g / g.norm(dim=1, keepdim=True).clamp_min(1e-30)
            n = delta.norm(dim=1, keepdim=True)
            delta *= (radius / n.clamp_min(1e-30)).clamp(max=1.0)
    return (x + delta).detach()


def probe(scores: Scores, route_ids: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, k: int,
          eps: float, steps: int = 10) -> dict[str, float]:  # fmt: skip
    """Routing change under the attack at ``eps``: mean Jaccard, mean KL, flipped-token share."""
    xa = attack(scores, x, k, eps, steps)
    with torch.no_grad():
        j = topk_jaccard(route_ids(x), route_ids(xa))
        kl = router_kl(scores(x)[0], scores(xa)[0])
    return {"jaccard": float(j.mean()), "kl": float(kl.mean()), "flipped": float((j < 1).double().mean())}


def logit_stability(
    base: torch.Tensor, cur: torch.Tensor, top_k: int, mapping: torch.Tensor | None = None
) -> dict:
    """MoEEdit's stability between two routings of the same tokens given as router logits, each on its
    own model's inputs (``base`` ``[T, E]``; ``cur`` ``[T, E']``, column ``j`` = base expert
    ``mapping[j]``, identity when ``None``): top-k Jaccard of the selected sets (top-k of the logits:
    softmax gating without selection bias) and router KL over the kept experts (base renormalised)."""
    m = torch.arange(cur.shape[1]) if mapping is None else mapping.long()
    ids_b = base.topk(min(top_k, base.shape[1]), dim=-1).indices
    ids_c = m[cur.topk(min(top_k, cur.shape[1]), dim=-1).indices]
    return {
        "jaccard": float(topk_jaccard(ids_b, ids_c).mean()),
        "kl": float(router_kl(base[:, m], cur).mean()),
    }
