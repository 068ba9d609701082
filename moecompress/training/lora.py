"""``trainable: lora``: per-expert LoRA factors on the stored expert tensors of a :class:`LayoutMoE`,
merged back on writing (maths in :mod:`moecompress.methods.lora`).

Merging is exact where the layout stores the experts' matrices themselves: ``dense`` (the weights)
and ``ragged`` (the live rows). Other layouts (codebook, rtn, lowrank, tucker) would need a
re-compression to merge: the dry run refuses them (:func:`lora_problem`). Protected experts get no
delta. Factors are seeded; the zero factor makes the initial delta exactly zero.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moecompress.ir import MoELayer
from moecompress.methods.lora import dense_delta, row_experts, rows_delta

MERGEABLE = ("dense", "ragged")
PROJ = ("gate", "up", "down")


def lora_problem(layer: MoELayer) -> str | None:
    """Why LoRA cannot be merged into ``layer`` (``None`` when it can)."""
    for which in ("experts", "shared"):
        bank = getattr(layer, which)
        for p in PROJ if bank is not None else ():
            kind = getattr(bank, p).kind
            if kind not in MERGEABLE:
                return (f"trainable: lora merges into dense or ragged experts only, but the {which}' {p} "
                        f"projection is {kind}; use trainable: compressed, or put distill before that step")  # fmt: skip
    return None


class ExpertLoRA(nn.Module):
    """LoRA factors for every dense/ragged projection of one MoE layer."""

    def __init__(self, layer: MoELayer, rank: int, alpha: float, seed: int) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.factors = nn.ParameterDict()
        self.owner: dict[str, torch.Tensor] = {}
        protected = {layer.physical(e) for e in layer.protected}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for which in ("experts", "shared"):
                bank = getattr(layer, which)
                if bank is None:
                    continue
                keep = torch.tensor([which == "shared" or e not in protected for e in range(bank.num_experts)])
                for p in PROJ:
                    lay = getattr(bank, p)
                    if lay.kind == "dense":
                        e, out, inn = lay.shape
                        name = f"{which}.{p}.weight"
                        self._add(name, torch.zeros(e, out, rank), torch.randn(e, rank, inn) / math.sqrt(inn))
                    else:
                        n, h = lay.rows.shape
                        name = f"{which}.{p}.rows"
                        self._add(name, torch.zeros(n, rank), torch.randn(bank.num_experts, rank, h) / math.sqrt(h))
                        self.owner[name] = row_experts(lay.widths)
                    self.register_buffer(f"keep_{which}_{p}", keep, persistent=False)

    def _add(self, name: str, zero: torch.Tensor, rand: torch.Tensor) -> None:
        k = name.replace(".", "__")
        self.factors[k + "__a"] = nn.Parameter(zero, requires_grad=False)
        self.factors[k + "__b"] = nn.Parameter(rand, requires_grad=False)

    def delta(self, name: str) -> torch.Tensor | None:
        k = name.replace(".", "__")
        if k + "__a" not in self.factors:
            return None
        a, b = self.factors[k + "__a"], self.factors[k + "__b"]
        which, p, _ = name.split(".")
        keep = getattr(self, f"keep_{which}_{p}")
        if name in self.owner:
            return rows_delta(a, b, self.owner[name].to(a.device), self.scale, keep)
        return dense_delta(a, b, self.scale, keep)
