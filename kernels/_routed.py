"""What the K3 (``codebook_gemm``) and K4 (``factorized``) paths share around their kernels.

A compressed layout stores ``M`` compressed experts and ``P`` exact ones (``members[e] == -1``:
protected super experts, bit-identical). The kernels serve the compressed experts only, addressed by
their member index ``m``; this module turns routing into that index and serves the rest:

- :class:`Members` — logical id → member index of its physical expert (``M`` = not compressed), one
  table composed with the ``expert_map`` at prepare time and handed to K1/K5 as their map, so the
  kernels skip exact experts and dropped slots (ids outside ``[0, E_logical)``) with no per-call work;
- :class:`ExactExperts` — the exact experts, through K2's grouped GEMM on their dense storage;
- :func:`input_of` — the bank's input transform (``codequant``'s rotation ``x @ R`` and per-token
  activation fake-quantisation), once per token, as :func:`moecompress.reference.bank_input` does.

Pure PyTorch, no triton import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moecompress.ir import Act, ExpertBank
from moecompress.methods.rotation import fake_quant_tokens


def act_fn(act: Act, alpha: float, limit: float, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The bank's gated activation (``reference._act``)."""
    if act is Act.SWIGLU_CLAMPED:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))
    return F.silu(g) * u


def logical_map(by_phys: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """A table by physical id ``[E + 1, ...]`` (row ``E``: the "skip" sentinel) composed with the
    logical → physical ``expert_map``: the same table by logical id; map entries outside ``[0, E)``
    (vLLM's ``−1``: not on this device) read the sentinel."""
    n = by_phys.shape[0] - 1
    if expert_map is None:
        return by_phys[:n].contiguous()
    em = expert_map.to(by_phys.device, torch.int64)
    return by_phys[torch.where((em >= 0) & (em < n), em, n)].contiguous()


@dataclass(frozen=True, eq=False)
class Members:
    """Where routing finds the compressed experts: ``cmap [E_logical]`` maps a logical id to the member
    index of its physical expert, or to ``M`` when that expert is exact — K1 (``moe_align``) and K5
    (``moe_combine``) take it as their ``expert_map`` and drop those slots (and ids outside
    ``[0, E_logical)``), so no per-call remapping runs; ``member_of [E + 1]`` is the same by physical
    id (``E``: a dropped slot); ``count`` is ``M``."""

    cmap: torch.Tensor
    member_of: torch.Tensor
    count: int

    @classmethod
    def of(cls, members: torch.Tensor, expert_map: torch.Tensor | None, device: torch.device) -> Members:
        members = members.to(device, torch.int64)
        m = int((members >= 0).sum())
        member_of = torch.cat([torch.where(members >= 0, members, m), members.new_full((1,), m)])
        return cls(logical_map(member_of, expert_map), member_of, m)


def same_members(*members: torch.Tensor) -> bool:
    """Whether every projection compresses the same experts (an expert is exact in all or in none)."""
    first = members[0].to(torch.int64).cpu()
    return all(torch.equal(first, m.to(torch.int64).cpu()) for m in members[1:])


def input_of(rotation: torch.Tensor | None, act_bits: int | None, x: torch.Tensor) -> torch.Tensor:
    """Gate/up input of the rotated experts (``reference.bank_input``): ``x @ rotation``, then
    per-token fake-quantisation to ``act_bits``; ``x`` itself when the bank has neither."""
    if rotation is not None:
        x = F.linear(x.to(rotation.dtype), rotation.T)
    return x if act_bits is None else fake_quant_tokens(x, act_bits)


@dataclass(frozen=True, eq=False)
class ExactExperts:
    """The exact (protected) experts of a compressed bank, served by K2's grouped GEMM
    (:func:`moecompress.kernels.grouped_gemm.grouped_moe`) over their dense weights ``[P, I, H]``,
    ``[P, H, I]`` (the layout's own ``exact``/``dense`` storage, used in place). ``emap [E_logical]``
    maps a logical id to its exact slot (``P``, i.e. dropped, for the compressed experts); ``raw [P]``
    marks the experts that read the untransformed input (``bank.unrotated``)."""

    ops: object  # grouped_gemm.Operands
    emap: torch.Tensor
    raw: torch.Tensor | None
    dtype: torch.dtype

    @classmethod
    def of(cls, bank: ExpertBank, members: torch.Tensor, expert_map: torch.Tensor | None, gate, up, down):
        from moecompress.kernels.grouped_gemm import Operands

        ids = [int(e) for e in torch.nonzero(members < 0).flatten()]
        if not ids:
            return None
        dev, (p, i, h) = gate.device, gate.shape
        sel = torch.tensor(ids, dtype=torch.int64, device=dev)
        slot_of = torch.full((bank.num_experts + 1,), p, dtype=torch.int64, device=dev)
        slot_of[sel] = torch.arange(p, device=dev)
        widths = torch.tensor([bank.width_of(e) for e in ids], dtype=torch.int32, device=dev)
        bias = {k: v.to(dev, gate.dtype)[sel].contiguous() for k, v in bank.biases.items()}
        ar = torch.arange(p, dtype=torch.int64, device=dev)
        ops = Operands(
            gate.contiguous(), up.contiguous(), down.contiguous(), ar * i * h, ar * i * h, ar * h * i, widths,
            (1, i), h, i, bias.get("gate"), bias.get("up"), bias.get("down"), bank.act.value,
            float(bank.alpha), float(bank.limit),
        )  # fmt: skip
        transformed = bank.rotation is not None or bank.act_bits is not None
        raw = None
        if transformed and bank.unrotated:
            raw = torch.tensor([int(e in bank.unrotated) for e in ids], dtype=torch.int32, device=dev)
        return cls(ops, logical_map(slot_of, expert_map), raw, gate.dtype)

    def forward(self, x: torch.Tensor, xin: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``Σ_k w · expert(x)`` over the exact experts' slots, fp32 ``[T, H]``."""
        from moecompress.kernels.grouped_gemm import grouped_moe

        xs = xin.to(self.dtype)
        if self.raw is not None:
            xs = torch.stack([xs, x.to(self.dtype)])
        return grouped_moe(self.ops, xs, ids, weights.float(), self.emap, self.raw)


def logical_bias(bias: torch.Tensor, members: Members, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Down bias by logical id ``[E_logical + 1, H]`` fp32: zero for exact experts (served with their
    own bias) and in the last row (dropped slots)."""
    b = bias.float() * (members.member_of[:-1] < members.count).to(bias.device, torch.float32)[:, None]
    b = logical_map(torch.cat([b, b.new_zeros(1, b.shape[1])]), expert_map)
    return torch.cat([b, b.new_zeros(1, b.shape[1])])


def bias_sum(table: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_k w[t, k] · table[ids[t, k]]`` (ids outside the table's logical range read its zero row):
    the down bias of experts whose output is summed in a rank space before the bias could apply."""
    n = table.shape[0] - 1
    ids = torch.where((ids >= 0) & (ids < n), ids, n)
    return torch.einsum("tk,tkh->th", weights.float(), table[ids])
