"""The static-shape forward of a loaded compressed bank: what ``torch.compile`` and CUDA graphs run.

:class:`~moecompress.runtime.lean.LeanBank` (the eager CPU path) sorts the routed slots and reads the
per-expert counts on the host (``.tolist()``) to loop over the experts that received rows: fast in eager
mode, but a host sync and a data-dependent shape, which ``torch.compile(fullgraph=True)`` and CUDA-graph
capture refuse. :class:`StaticBank` is the same maths with every shape fixed by ``(T, k)`` and no host
sync, built once by :func:`prepare_static`:

- every projection decoded once into one dense operand ``[E, out, in]`` in its compute dtype (ragged
  widths and pruning cuts zero-padded: the padded columns of ``down`` are zero, so padded neurons add
  nothing whatever the activation gives them; quantised and factorised layouts materialised, i.e. the
  memory of the original layer — the Triton kernels, not this path, serve compressed bytes on a GPU);
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
from moecompress.reference import _act, bank_input


@dataclasses.dataclass
class StaticBank:
    """A bank prepared for static-shape serving (:func:`prepare_static`); call it like
    :class:`~moecompress.runtime.lean.LeanBank`: ``(x [T, H], ids [T, k], weights [T, k]) -> fp32 [T, H]``."""

    bank: ExpertBank  # activation, rotation, activation quantisation
    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I], zero beyond each expert's live width
    biases: dict[str, torch.Tensor]  # gate/up [E, I] (zero-padded), down [E, H]
    routes: torch.Tensor  # [n_logical + 1] logical -> physical, the last entry E (dropped)
    unrotated: torch.Tensor | None  # [E] bool: experts reading the unrotated input, or None

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t_count, k = ids.shape
        e_count = self.gate.shape[0]
        phys = self.routes[ids.clamp(min=0, max=self.routes.shape[0] - 1)]  # [T, k]; E = dropped
        w = weights.float().masked_fill(phys >= e_count, 0.0)
        phys = phys.clamp(max=e_count - 1)
        xin = bank_input(self.bank, x)
        if t_count * k <= e_count:
            return self._slots(x, xin, phys.reshape(-1), w.reshape(-1), k)
        return self._all(x, xin, phys, w)

    def _slots(self, x, xin, phys, w, k) -> torch.Tensor:
        """Decode: one gathered batched matvec per projection over the ``T·k`` routed slots."""
        tok = torch.arange(phys.shape[0], device=x.device) // k
        xs = xin[tok]
        if self.unrotated is not None:
            xs = torch.where(self.unrotated[phys][:, None], x[tok].to(xs.dtype), xs)

        def mv(weight: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.bmm(weight[phys], v.to(weight.dtype).unsqueeze(-1)).squeeze(-1)

        g, u = mv(self.gate, xs), mv(self.up, xs)
        if "gate" in self.biases:
            g = g + self.biases["gate"][phys]
        if "up" in self.biases:
            u = u + self.biases["up"][phys]
        y = mv(self.down, _act(self.bank, g, u)).float()
        if "down" in self.biases:
            y = y + self.biases["down"][phys].float()
        return (y * w[:, None]).view(-1, k, y.shape[-1]).sum(1)

    def _all(self, x, xin, phys, w) -> torch.Tensor:
        """Prefill: every expert on every token, combined by the routed weights (merged slots summed)."""

        def proj(
            weight: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:  # [T, in] or [T, E, in] -> [T, E, out]
            v = v.to(weight.dtype)
            return torch.einsum("th,eoh->teo" if v.dim() == 2 else "teh,eoh->teo", v, weight)

        g, u = proj(self.gate, xin), proj(self.up, xin)
        if self.unrotated is not None:
            raw = self.unrotated[None, :, None]
            g, u = torch.where(raw, proj(self.gate, x), g), torch.where(raw, proj(self.up, x), u)
        if "gate" in self.biases:
            g = g + self.biases["gate"]
        if "up" in self.biases:
            u = u + self.biases["up"]
        y = proj(self.down, _act(self.bank, g, u)).float()  # [T, E, H]
        if "down" in self.biases:
            y = y + self.biases["down"].float()
        combine = torch.zeros(phys.shape[0], y.shape[1], dtype=torch.float32, device=x.device)
        combine = combine.scatter_add(1, phys, w)  # [T, E]; two slots on one merged expert add up
        return torch.einsum("teh,te->th", y, combine)


def prepare_static(
    bank: ExpertBank, expert_map: torch.Tensor | None = None, dense_dtype: torch.dtype | None = None
) -> StaticBank:
    """``bank`` (and its logical -> physical ``expert_map``) as a :class:`StaticBank`, decoded once;
    ``dense_dtype``: the dtype quantised layouts decode to (``moecompress.load(..., dequantize=)``)."""
    quantised = ("codebook", "rtn")

    def dense(p: str) -> torch.Tensor:
        lay = getattr(bank, p)
        w = lay.dense()
        return w.to(dense_dtype) if dense_dtype is not None and lay.kind in quantised else w

    gate, up, down = dense("gate"), dense("up"), dense("down").clone()
    e_count, width = gate.shape[0], gate.shape[1]
    for e in range(e_count):  # pruned neurons take no part: zero down's columns past the live width
        down[e, :, bank.width_of(e) :] = 0
    biases = {}
    for name, b in bank.biases.items():
        if name != "down" and b.shape[1] < width:
            b = F.pad(b, (0, width - b.shape[1]))
        biases[name] = b
    device = gate.device
    emap = torch.arange(e_count, device=device) if expert_map is None else expert_map.to(device, torch.int64)
    routes = torch.cat([emap, emap.new_full((1,), e_count)])
    unrot = None
    if bank.unrotated:
        unrot = torch.zeros(e_count, dtype=torch.bool, device=device)
        unrot[sorted(bank.unrotated)] = True
    return StaticBank(bank, gate, up, down, biases, routes, unrot)
