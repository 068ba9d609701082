"""The lean PyTorch forward of a loaded compressed bank (CPU, and CUDA where no kernel serves it).

:class:`CompressedExperts` builds one :class:`LeanBank` from its stored tensors the first time it runs
(and again only when those tensors move or change) instead of decoding the bank on every call. A call
then costs::

    one sort of the T·k routed slots by physical expert (argsort + bincount, one host sync; slots of
    one token on logical experts merged into one physical expert run it once, weights summed),
    one gather of the routed rows of x, and only for the experts that received rows:
        gate/up -> act -> down on the live width: one grouped GEMM per projection when every expert
        has one shape (runtime/grouped.py), else three matmuls on precomputed views per expert,
    one weighted index_add of the results into [T, H] (factorised layouts: one per space, then the
    shared output factor once per token).

Prepared once: the decoded layouts (no per-call bank rebuild), per-expert weight views, Tucker cores
with the expert factor folded in (``C_m = Σ_j U_e[m, j] G_j``), and the quantised layouts'
:class:`~moecompress.runtime.unpacked.Unpacked` form (the packed-code CPU kernel for experts with few
rows, else only the hit experts decoded). Nothing else is materialised. ``dense_dtype`` (behind
``moecompress.load(..., dequantize=)``) trades memory for speed: quantised experts are decoded once, at
preparation, into dense weights of that dtype (fp16 holds a codebook's fp16 centroids exactly; RTN's
products are exact in fp32 only).

The oracle is :func:`moecompress.reference.experts_forward` (same maths, same fp32 accumulation; only
the order of sums differs); ``tests/test_lean.py`` compares every path with it and
``tests/test_serving_outputs.py`` the logits of every layout loaded through transformers.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from moecompress.ir import Act, ExpertBank
from moecompress.layouts.base import Layout
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.dense import Dense
from moecompress.layouts.lowrank import LowRank
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.rtn import RTN
from moecompress.layouts.tucker import Tucker
from moecompress.reference import _act, _cut, bank_input
from moecompress.runtime.grouped import grouped
from moecompress.runtime.unpacked import Unpacked, decoded_dense

DEQUANTIZE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""The dtypes ``dequantize=`` accepts, by name."""


def prepare_layout(layout: Layout, dtype: torch.dtype | None = None, *, native: bool | None = None) -> Layout:
    """``layout`` in the form the lean forward runs fastest (same logical weights); ``dtype``: decode
    quantised layouts once into dense weights of that dtype."""
    if isinstance(layout, (Codebook, RTN)):
        return Unpacked(layout, native=native) if dtype is None else decoded_dense(layout, dtype)
    if isinstance(layout, Tucker) and layout.u_expert is not None:
        cores = torch.stack([layout.core_of(m) for m in range(layout.u_expert.shape[0])])
        return dataclasses.replace(layout, core=cores, u_expert=None)
    return layout


def _linear(weight: torch.Tensor):
    """``x -> x @ weight.T`` (``weight`` a view of the stored tensor)."""
    return lambda x: F.linear(x, weight)


def _two(v: torch.Tensor, u: torch.Tensor):
    """A low-rank expert: ``x -> (x @ v.T) @ u.T``."""
    return lambda x: F.linear(F.linear(x, v), u)


def expert_op(layout: Layout, e: int, rows: int | None, cols: int | None):
    """A callable computing ``x @ W[e][:rows, :cols].T`` for a non-factorised layout (``x`` already in
    the layout's dtype), with everything that does not depend on ``x`` (slicing, offsets, widths) done
    here, once; ``None`` for layouts whose experts share factors (Tucker: served through
    ``encode``/``partial``/``decode``)."""
    if isinstance(layout, Dense):
        return _linear(layout.weight[e][:rows, :cols])
    if isinstance(layout, Ragged):
        part = layout.live(e)  # [live, H]: gate/up rows, or down's columns transposed
        return _linear(part[:rows]) if layout.axis == "out" else _linear(part[:cols].T)
    if isinstance(layout, LowRank):
        f = layout.factors(e)
        if f is not None:
            return _two(f[1], f[0])
    if isinstance(layout, Tucker):
        return None
    return lambda x: layout.apply(x, e, rows=rows, cols=cols)


@dataclasses.dataclass
class LeanBank:
    """A bank prepared for serving (:func:`prepare`); call it like transformers' experts modules."""

    bank: ExpertBank
    expert_map: torch.Tensor | None
    n_logical: int

    def __post_init__(self) -> None:
        bank = self.bank
        cuts = [_cut(bank, e) for e in range(bank.num_experts)]
        self.ops = [
            (
                expert_op(bank.gate, e, cuts[e], None), expert_op(bank.up, e, cuts[e], None),
                expert_op(bank.down, e, None, cuts[e]),
            )
            for e in range(bank.num_experts)
        ]  # fmt: skip
        self.factorised = any(isinstance(lay, Tucker) for lay in (bank.gate, bank.up, bank.down))
        emap = self.expert_map
        # the expert map with the dropped-slot sentinel appended: one gather routes every slot
        self.routes = None if emap is None else torch.cat([emap, emap.new_full((1,), bank.num_experts)])
        self.merged = emap is not None and int(emap.unique().numel()) < int(emap.numel())
        self.plain_act = bank.act is Act.SWIGLU and not bank.biases
        dtypes = {bank.gate.dtype, bank.up.dtype, bank.down.dtype}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None  # one compute dtype: cast the inputs once
        live = set(cuts)
        self.grouped = None
        if len(live) == 1 and not bank.unrotated and self.dtype is not None:
            (cut,) = live
            ops = (grouped(bank.gate, cut, "out"), grouped(bank.up, cut, "out"), grouped(bank.down, cut, "in"))
            self.grouped = ops if all(op is not None for op in ops) else None

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``Σ_k weights[t, k] · expert_{ids[t, k]}(x_t)`` in fp32 ``[T, H]``; ids ``>= n_logical`` are
        dropped slots (a routing policy's id ``E``), as in the reference forward."""
        bank, (t_count, k) = self.bank, ids.shape
        e_count = bank.num_experts
        # logical -> physical, a dropped slot (id >= n_logical) -> the sentinel e_count (sorts last, never run)
        phys = ids.reshape(-1).clamp(max=self.n_logical)
        if self.routes is not None:
            phys = self.routes[phys]
        tok, w = None, weights.reshape(-1).float()
        if self.merged:  # merged experts: one run per (token, physical expert), weights summed
            tok, phys, w = _coalesce(phys, w, k, e_count)
        order = torch.argsort(phys, stable=True)
        per_expert = torch.bincount(phys, minlength=e_count + 1)
        counts = per_expert.tolist()
        tok_all = order // k if tok is None else tok[order]
        w_all = w[order].unsqueeze(1)
        out = torch.zeros(t_count, x.shape[1], dtype=torch.float32, device=x.device)
        if self.grouped is not None:
            offs = per_expert[:e_count].cumsum(0, dtype=torch.int32)
            return self._grouped(x, counts[:e_count], offs, tok_all, phys[order], w_all, out)
        toks, ws = tok_all.split(counts), w_all.split(counts)
        if self.factorised or bank.unrotated or self.dtype is None or bank.biases:
            return self._general(x, counts, toks, ws, out)
        return self._looped(x, counts, tok_all, ws, out)

    def _looped(self, x, counts, tok_all, ws, out) -> torch.Tensor:
        """The common per-expert case (no shared factors, biases or unrotated experts): three matmuls on
        precomputed views per hit expert, the weighted rows written in place, one ``index_add``."""
        bank = self.bank
        n = sum(counts[: bank.num_experts])
        xs = bank_input(bank, x).to(self.dtype)[tok_all].split(counts)
        ys = torch.empty(n, x.shape[1], dtype=torch.float32, device=x.device)  # every expert's rows, in order
        start = 0
        for p in range(bank.num_experts):
            if counts[p]:
                gate_op, up_op, down_op = self.ops[p]
                g, u = gate_op(xs[p]), up_op(xs[p])
                h = F.silu(g, inplace=True).mul_(u) if self.plain_act else _act(bank, g, u)
                torch.mul(down_op(h), ws[p], out=ys[start : start + counts[p]])
                start += counts[p]
        return out.index_add_(0, tok_all[:n], ys)

    def _grouped(self, x, counts, offs, tok_all, phys_sorted, w_all, out) -> torch.Tensor:
        """Every projection one grouped GEMM over the sorted routed rows (:mod:`moecompress.runtime.grouped`):
        ``counts``/``offs`` the rows of each expert and their running sums."""
        bank, (gate, up, down) = self.bank, self.grouped
        n = sum(counts)
        if not n:
            return out
        tok, w = tok_all[:n], w_all[:n]
        xin = bank_input(bank, x).to(self.dtype)
        xs = xin[tok] if gate.encode is up.encode else None
        g = gate.rows(xs if xs is not None else gate.encode(xin)[tok], counts, offs)
        u = up.rows(xs if xs is not None else up.encode(xin)[tok], counts, offs)
        biases, rows_of = bank.biases, phys_sorted[:n]
        if "gate" in biases:
            g = g + biases["gate"][rows_of, : g.shape[1]]
        if "up" in biases:
            u = u + biases["up"][rows_of, : u.shape[1]]
        h = F.silu(g) * u if self.plain_act else _act(bank, g, u)
        mid = down.rows(down.encode(h), counts, offs)
        bias = biases.get("down")
        if bias is not None and down.space == "out":
            mid = mid + bias[rows_of]
        elif bias is not None:
            out.index_add_(0, tok, bias[rows_of].float() * w)
        if down.space == "out":
            return out.index_add_(0, tok, mid.float() * w)
        acc = torch.zeros(out.shape[0], mid.shape[1], dtype=torch.float32, device=x.device)
        acc.index_add_(0, tok, mid.float() * w)
        return out + down.decode(acc).float()

    def _general(self, x, counts, toks, ws, out) -> torch.Tensor:
        """Every feature: factorised layouts (their shared input transform once per token, the output
        transform after the weighted sum), unrotated experts, biases, mixed dtypes."""
        bank = self.bank
        xin = bank_input(bank, x)
        inputs = {False: xin, True: x}
        ctx = None
        if self.factorised:
            ctx = {False: (bank.gate.encode(xin), bank.up.encode(xin))}
            if bank.unrotated:
                ctx[True] = (bank.gate.encode(x), bank.up.encode(x)) if xin is not x else ctx[False]
        biases, bias = bank.biases, bank.biases.get("down")
        parts: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for p in range(bank.num_experts):
            n = counts[p]
            if not n:
                continue
            tok, w = toks[p], ws[p]
            gate_op, up_op, down_op = self.ops[p]
            raw = p in bank.unrotated
            if gate_op is not None:
                g = gate_op(inputs[raw][tok].to(bank.gate.dtype))
            else:
                g = bank.gate.decode(*bank.gate.partial(ctx[raw][0], p, tok))
            if up_op is not None:
                u = up_op(inputs[raw][tok].to(bank.up.dtype))
            else:
                u = bank.up.decode(*bank.up.partial(ctx[raw][1], p, tok))
            if "gate" in biases:
                g = g + biases["gate"][p][: g.shape[1]]
            if "up" in biases:
                u = u + biases["up"][p][: u.shape[1]]
            h = _act(bank, g, u)
            if down_op is not None:
                space, mid = "out", down_op(h.to(bank.down.dtype))
            else:
                space, mid = bank.down.partial(bank.down.encode(h), p, torch.arange(n, device=x.device))
            if bias is not None and space == "out":
                mid = mid + bias[p]
            elif bias is not None:
                out.index_add_(0, tok, bias[p].float().expand(n, -1) * w)
            tok_list, vals = parts.setdefault(space, ([], []))
            tok_list.append(tok)
            vals.append(mid.float() * w)
        for space, (tok_list, vals) in parts.items():
            if space == "out":
                out.index_add_(0, torch.cat(tok_list), torch.cat(vals))
                continue
            acc = torch.zeros(out.shape[0], vals[0].shape[1], dtype=torch.float32, device=x.device)
            acc.index_add_(0, torch.cat(tok_list), torch.cat(vals))
            out += bank.down.decode(space, acc).float()
        return out


def _coalesce(phys: torch.Tensor, w: torch.Tensor, k: int, e_count: int):
    """``(token, physical expert, summed weight)`` of the distinct pairs among the ``T·k`` slots: two
    slots of one token routed to logical experts merged into one physical expert run it once, with the
    sum of their weights (``Σ w_i f(x) = (Σ w_i) f(x)``; saves the duplicate's work)."""
    tok = torch.arange(phys.numel(), device=phys.device) // k
    key, inv = torch.unique(tok * (e_count + 1) + phys, return_inverse=True)
    return key // (e_count + 1), key % (e_count + 1), w.new_zeros(key.numel()).index_add_(0, inv, w)


def prepare(
    bank: ExpertBank,
    expert_map: torch.Tensor | None = None,
    *,
    dense_dtype: torch.dtype | None = None,
    native: bool | None = None,
) -> LeanBank:
    """``bank`` prepared once for the lean forward (see the module docstring); ``native=False`` decodes
    quantised experts even where the packed-code CPU kernel would serve them (tests, comparisons)."""
    lean = dataclasses.replace(
        bank, **{p: prepare_layout(getattr(bank, p), dense_dtype, native=native) for p in ("gate", "up", "down")}
    )
    n_logical = bank.num_experts if expert_map is None else int(expert_map.numel())
    emap = None if expert_map is None else expert_map.to(torch.int64)
    return LeanBank(lean, emap, n_logical)
