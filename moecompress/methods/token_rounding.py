"""SonicMoE token rounding (METHODS.md §9), a pure function: each expert's token count rounded to a
multiple of the kernel tile, filled expert-choice style.

1. token-choice top-k per token; ``f_e`` = tokens per expert;
2. ``f_e`` rounded to a multiple of ``tile``: ``nr`` nearest, ``up`` ceil, ``down`` floor;
3. per expert, tokens ranked token-choice-selected first (by score), then the rest by ``score − 1``;
4. each expert takes its first ``rounded f_e`` tokens (rounding down drops its lowest-score selected
   tokens, rounding up adds the highest-score unselected ones).
"""

from __future__ import annotations

import torch

ROUND = {"nr": torch.round, "up": torch.ceil, "down": torch.floor}


def token_round(p: torch.Tensor, k: int, tile: int = 128, mode: str = "nr") -> torch.Tensor:
    """``[T, E]`` bool: the (token, expert) assignment after rounding, from router scores ``p [T, E]``."""
    if mode not in ROUND:
        raise ValueError(f"token rounding mode must be one of {sorted(ROUND)}, got {mode!r}")
    t, _ = p.shape
    p = p.detach().float()
    sel = torch.zeros_like(p, dtype=torch.bool).scatter_(1, p.topk(k, dim=-1).indices, True)
    target = (ROUND[mode](sel.sum(0).float() / tile) * tile).clamp(max=t).to(torch.int64)
    order = torch.where(sel, p, p - 1.0).argsort(dim=0, descending=True, stable=True)  # [T, E] token ranks
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(t, device=p.device).unsqueeze(1).expand_as(order))
    return rank < target.unsqueeze(0)
