"""The static-shape forward of a loaded compressed bank: what ``torch.compile`` and CUDA graphs run.

:class:`~moecompress.runtime.lean.LeanBank` (the eager CPU path) sorts the routed slots and reads the
per-expert counts on the host (``.tolist()``) to loop over the experts that received rows: fast in eager
mode, but a host sync and a data-dependent shape, which ``torch.compile(fullgraph=True)`` and CUDA-graph
capture refuse. :class:`StaticBank` is the same maths with every shape fixed by ``(T, k)`` and no host
sync, built once by :func:`prepare_static`:

- every projection prepared once as a static operand: Tucker layouts keep their factors (``x·U_in``,
  the expert's core, ``U_out``) and low-rank ones their per-expert factors, zero-padded to the largest
  rank; the others (and those with exact experts, or a factorised ``down`` under pruning cuts) are
  decoded into one dense ``[E, out, in]`` operand in the compute dtype (ragged widths and pruning cuts
  zero-padded: the padded columns of ``down`` are zero, so padded neurons add nothing whatever the
  activation gives them; quantised layouts thereby cost the memory of the original layer — the Triton
  kernels, not this path, serve compressed bytes on a GPU);
- routing stays on the device: logical -> physical through the expert map, dropped slots (a routing
  policy's id ``E``) weight 0;
- decode (``T·k ≤ E``): each routed slot gathers its expert's weights (``k`` experts' bytes per token,
  as a kernel reads them) and runs one batched matvec per projection;
- larger batches (prefill): every expert on every token, then the routed ones combined by a ``[T, E]``
  weight matrix (exact; ``E/k`` times the FLOPs of a routed kernel).

The oracle is :func:`moecompress.reference.experts_forward` (``tests/test_compile_serving.py``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from moecompress.ir import ExpertBank
from moecompress.layouts.lowrank import LowRank
from moecompress.layouts.tucker import Tucker
from moecompress.reference import _act, bank_input


def _in(v: torch.Tensor, dtype: torch.dtype, two: str, three: str) -> tuple[torch.Tensor, str]:
    """``v`` in ``dtype`` and the einsum of its rank: ``[T, in]`` (``two``) or ``[T, E, in]`` (``three``)."""
    return v.to(dtype), two if v.dim() == 2 else three


@dataclasses.dataclass
class DenseOp:
    """One projection as a dense operand ``w [E, out, in]``."""

    w: torch.Tensor

    def slots(self, v: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:  # [S, in] -> [S, out]
        return torch.bmm(self.w[phys], v.to(self.w.dtype).unsqueeze(-1)).squeeze(-1)

    def every(self, v: torch.Tensor) -> torch.Tensor:  # [T, in] or [T, E, in] -> [T, E, out]
        v, eq = _in(v, self.w.dtype, "th,eoh->teo", "teh,eoh->teo")
        return torch.einsum(eq, v, self.w)


@dataclasses.dataclass
class TuckerOp:
    """``W_e = U_out C_e U_inᵀ``: ``u_in [in, r3]``, ``core [E, r2, r3]`` (per expert), ``u_out [out, r2]``."""

    u_in: torch.Tensor
    core: torch.Tensor
    u_out: torch.Tensor

    def slots(self, v: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
        z = v.to(self.u_in.dtype) @ self.u_in
        return torch.bmm(self.core[phys], z.unsqueeze(-1)).squeeze(-1) @ self.u_out.T

    def every(self, v: torch.Tensor) -> torch.Tensor:
        z = v.to(self.u_in.dtype) @ self.u_in
        z, eq = _in(z, z.dtype, "tr,eqr->teq", "ter,eqr->teq")
        return torch.einsum(eq, z, self.core) @ self.u_out.T


@dataclasses.dataclass
class LowRankOp:
    """``W_e = U_e V_e`` with the ranks zero-padded: ``u [E, out, r]``, ``v [E, r, in]``."""

    u: torch.Tensor
    v: torch.Tensor

    def slots(self, x: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
        z = torch.bmm(self.v[phys], x.to(self.v.dtype).unsqueeze(-1))
        return torch.bmm(self.u[phys], z).squeeze(-1)

    def every(self, x: torch.Tensor) -> torch.Tensor:
        x, eq = _in(x, self.v.dtype, "th,erh->ter", "teh,erh->ter")
        return torch.einsum("ter,eor->teo", torch.einsum(eq, x, self.v), self.u)


Op = DenseOp | TuckerOp | LowRankOp


@dataclasses.dataclass
class StaticBank:
    """A bank prepared for static-shape serving (:func:`prepare_static`); call it like
    :class:`~moecompress.runtime.lean.LeanBank`: ``(x [T, H], ids [T, k], weights [T, k]) -> fp32 [T, H]``."""

    bank: ExpertBank  # activation, rotation, activation quantisation
    gate: Op  # [E, I, H]
    up: Op  # [E, I, H]
    down: Op  # [E, H, I], zero beyond each expert's live width
    biases: dict[str, torch.Tensor]  # gate/up [E, I] (zero-padded), down [E, H]
    routes: torch.Tensor  # [n_logical + 1] logical -> physical, the last entry E (dropped)
    unrotated: torch.Tensor | None  # [E] bool: experts reading the unrotated input, or None
    num_experts: int  # physical

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t_count, k = ids.shape
        e_count = self.num_experts
        phys = self.routes[ids.clamp(min=0, max=self.routes.shape[0] - 1)]  # [T, k]; E = dropped
        w = weights.float().masked_fill(phys >= e_count, 0.0)
        phys = phys.clamp(max=e_count - 1)
        xin = bank_input(self.bank, x)
        if t_count * k <= e_count:
            return self._slots(x, xin, phys.reshape(-1), w.reshape(-1), k)
        return self._all(x, xin, phys, w)

    def _slots(self, x, xin, phys, w, k) -> torch.Tensor:
        """Decode: each projection on the ``T·k`` routed slots, each slot its own expert's operand."""
        tok = torch.arange(phys.shape[0], device=x.device) // k
        xs = xin[tok]
        if self.unrotated is not None:
            xs = torch.where(self.unrotated[phys][:, None], x[tok].to(xs.dtype), xs)
        g, u = self.gate.slots(xs, phys), self.up.slots(xs, phys)
        if "gate" in self.biases:
            g = g + self.biases["gate"][phys]
        if "up" in self.biases:
            u = u + self.biases["up"][phys]
        y = self.down.slots(_act(self.bank, g, u), phys).float()
        if "down" in self.biases:
            y = y + self.biases["down"][phys].float()
        return (y * w[:, None]).view(-1, k, y.shape[-1]).sum(1)

    def _all(self, x, xin, phys, w) -> torch.Tensor:
        """Prefill: every expert on every token, combined by the routed weights (merged slots summed)."""
        g, u = self.gate.every(xin), self.up.every(xin)
        if self.unrotated is not None:
            raw = self.unrotated[None, :, None]
            g, u = torch.where(raw, self.gate.every(x), g), torch.where(raw, self.up.every(x), u)
        if "gate" in self.biases:
            g = g + self.biases["gate"]
        if "up" in self.biases:
            u = u + self.biases["up"]
        y = self.down.every(_act(self.bank, g, u)).float()  # [T, E, H]
        if "down" in self.biases:
            y = y + self.biases["down"].float()
        combine = torch.zeros(phys.shape[0], y.shape[1], dtype=torch.float32, device=x.device)
        combine = combine.scatter_add(1, phys, w)  # [T, E]; two slots on one merged expert add up
        return torch.einsum("teh,te->th", y, combine)


def _factorised(lay, cut: bool) -> Op | None:
    """``lay`` kept factorised (every expert factorised, no pruning cut to honour), else ``None``."""
    if cut:
        return None
    if isinstance(lay, Tucker) and lay.exact is None:
        from moecompress.runtime.lean import prepare_layout

        lay = prepare_layout(lay)  # the expert factor folded into per-member cores
        return TuckerOp(lay.u_in, lay.core[lay.members.to(torch.int64)], lay.u_out)
    if isinstance(lay, LowRank) and bool((lay.members >= 0).all()):
        fs = [lay.factors(e) for e in range(lay.num_experts)]
        r = max(v.shape[0] for _, v in fs)
        u = torch.stack([F.pad(a, (0, r - a.shape[1])) for a, _ in fs])
        v = torch.stack([F.pad(b, (0, 0, 0, r - b.shape[0])) for _, b in fs])
        return LowRankOp(u, v)
    return None


def prepare_static(
    bank: ExpertBank, expert_map: torch.Tensor | None = None, dense_dtype: torch.dtype | None = None
) -> StaticBank:
    """``bank`` (and its logical -> physical ``expert_map``) as a :class:`StaticBank`, prepared once;
    ``dense_dtype``: the dtype quantised layouts decode to (``moecompress.load(..., dequantize=)``)."""
    e_count, width = bank.num_experts, bank.width
    cut = any(bank.width_of(e) < width for e in range(e_count))
    ops: dict[str, Op] = {}
    for p in ("gate", "up", "down"):
        lay = getattr(bank, p)
        op = _factorised(lay, cut and p == "down")
        if op is None:
            w = lay.dense()
            if dense_dtype is not None and lay.kind in ("codebook", "rtn"):
                w = w.to(dense_dtype)
            if p == "down" and cut:  # pruned neurons take no part: zero down's columns past the live width
                w = w.clone()
                for e in range(e_count):
                    w[e, :, bank.width_of(e) :] = 0
            op = DenseOp(w)
        ops[p] = op
    biases = {}
    for name, b in bank.biases.items():
        if name != "down" and b.shape[1] < width:
            b = F.pad(b, (0, width - b.shape[1]))
        biases[name] = b
    device = next(iter(bank.gate.tensors().values())).device
    emap = torch.arange(e_count, device=device) if expert_map is None else expert_map.to(device, torch.int64)
    routes = torch.cat([emap, emap.new_full((1,), e_count)])
    unrot = None
    if bank.unrotated:
        unrot = torch.zeros(e_count, dtype=torch.bool, device=device)
        unrot[sorted(bank.unrotated)] = True
    return StaticBank(bank, ops["gate"], ops["up"], ops["down"], biases, routes, unrot, e_count)
