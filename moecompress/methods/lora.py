"""LoRA deltas on stored expert tensors, as pure tensor functions (``trainable: lora`` of ``distill``).

Dense experts ``[E, out, in]``: ``ΔW_e = scale · B_e A_e`` with ``B [E, out, r]``, ``A [E, r, in]``.
Ragged experts store each expert's live rows (gate/up) or live columns transposed (down) as ``rows``
``[N, H]``; a LoRA on the expert's live matrix is then, in stored orientation, a per-row factor times a
per-expert factor: ``Δrows[n] = scale · P[n] Q_{e(n)}`` with ``P [N, r]``, ``Q [E, r, H]`` — the same size
as what is stored, so merging it back changes nothing but the stored values.
"""

from __future__ import annotations

import torch


def row_experts(widths: torch.Tensor) -> torch.Tensor:
    """``[N]``: the expert each stored ragged row belongs to."""
    return torch.repeat_interleave(torch.arange(len(widths), device=widths.device), widths.to(torch.int64))


def dense_delta(b: torch.Tensor, a: torch.Tensor, scale: float, keep: torch.Tensor) -> torch.Tensor:
    """``scale · B_e A_e`` for every expert, zero where ``keep[e]`` is false (protected experts)."""
    return torch.bmm(b, a) * (scale * keep.to(b.dtype))[:, None, None]


def rows_delta(p: torch.Tensor, q: torch.Tensor, owner: torch.Tensor, scale: float, keep: torch.Tensor) -> torch.Tensor:
    """``scale · P[n] Q_{owner[n]}`` for every stored row, zero on rows of experts not in ``keep``."""
    out = torch.zeros(p.shape[0], q.shape[-1], dtype=p.dtype, device=p.device)
    for e in torch.unique(owner).tolist():
        idx = (owner == e).nonzero().squeeze(1)
        if bool(keep[e]):
            out = out.index_copy(0, idx, p[idx] @ q[e])
    return out * scale


def load_balance_loss(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """LoRA-Mixer's router load-balancing term (the ``α Σ_i p̄_i f̄_i`` of its RSL, Switch-style scaled
    by ``E``): ``E · Σ_e f_e · p̄_e`` with ``p̄_e`` the mean softmax probability of expert ``e`` over the
    tokens and ``f_e`` the fraction of the ``T·K`` routed slots ``chosen [..., K]`` sends to it (counts,
    no gradient). 1 when routing is uniform, ``E`` when every token goes to one expert and its
    probability is 1; the gradient flows through ``p̄``."""
    e = logits.shape[-1]
    p = logits.float().softmax(dim=-1).reshape(-1, e).mean(0)
    f = torch.bincount(chosen.reshape(-1), minlength=e).to(p.dtype) / chosen.numel()
    return e * (f * p).sum()
