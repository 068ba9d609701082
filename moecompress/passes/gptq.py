"""``gptq``: GPTQ scalar quantisation of every routed expert, one Hessian per expert and projection.

GPTQ (Frantar et al. 2022, arXiv 2210.17323; the maths and its conventions are in
:mod:`moecompress.methods.gptq`) quantises each row group of a projection ``W`` ``[out, in]`` column by
column on the grid of the ``rtn`` layout and spreads each column's rounding error over the columns not
yet quantised, minimising the layer-output error ``‖(W − Ŵ) X‖²`` on the expert's own inputs::

    H = E[x xᵀ] + damp·mean(diag)·I,   U = chol(H⁻¹)ᵀ
    for column j:  ŵ_j = Q(w_j),  w_k ← w_k − (w_j − ŵ_j) U_jk / U_jj   (k > j; lazy blocks of ``block``)

Per expert ``e`` the Hessian is the second moment of what that projection reads over the tokens routed
to ``e``: ``expert_in_cov[e]`` (``E[x xᵀ]`` of the MoE input, ``[H, H]``) for gate and up, and
``down_in_cov[e]`` (``E[h hᵀ]`` of the down-projection input, ``[I, I]``) for down. Groups of
``group_size`` consecutive inputs (``auto``: the ``rtn`` rule, the largest of 128/64/32/16 dividing
every projection's inputs, else ``-1``) get their float16 scale and uint8 zero point (asymmetric, range
widened to hold 0) or the fixed ``z = 2^(b−1)`` (``symmetric``) when the group starts; ``act_order``
processes columns by decreasing ``diag H`` with the groups' scales taken from the original weights
(static groups: the layout's groups are consecutive channels) and undoes the permutation.

The output is the :class:`~moecompress.layouts.rtn.RTN` layout, so everything that reads an ``rtn``
output reads this one; ``symmetric: true`` with 4 or 8 bits exports with ``moecompress export --format
compressed-tensors`` (vLLM). Protected (super) experts stay dense and bit-identical; routers, shared
experts and biases are untouched. Every expert's result depends on that expert alone, so a layer larger
than memory runs by chunks of experts (``expert_chunk``), byte-identical to the whole layer. An expert that received no calibration tokens (zero Hessian) is
rounded to nearest (exactly ``rtn``; listed in the report as ``rtn_fallback``). Dense or neuron-pruned
(ragged, quantised at full width) input only.

Statistics: ``expert_in_cov`` ``[E, H, H]`` and ``down_in_cov`` ``[E, I, I]`` (forward only; ``E·H²``
floats per layer: 2 GiB in float32 for Qwen3-30B-A3B's 128 experts of 2048 inputs). Cost per expert and
projection: a Cholesky factorisation and inverse of ``H`` (``in³``) and ``out·in²`` for the updates.

Report: as ``rtn`` (bytes before/after, bytes per routed parameter, relative weight error) plus the
relative output error ``tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)`` of GPTQ and of round-to-nearest on the same grid,
per projection, averaged over the quantised experts (estimated on 512 evenly spaced output rows of a
projection with more, through the factorisation's triangular Cholesky factor:
:func:`~moecompress.methods.gptq.output_errors`).

Example steps::

    steps:
      - gptq: {bits: 4}                                           # asymmetric, group_size auto
      - gptq: {bits: 4, group_size: 128, symmetric: true}         # exportable to compressed-tensors
      - gptq: {bits: 3, act_order: true, damp: 0.05}
"""

from __future__ import annotations

import dataclasses

import torch
from pydantic import Field

from moecompress.engine.spec import Chunking, LayerStats, PassSpec, shifted_ids
from moecompress.errors import MethodError, PassError
from moecompress.ir import MoELayer
from moecompress.layouts.bitpack import pack_bits, packed_size
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.rtn import RTN
from moecompress.methods.gptq import gptq_quantize, hessian_factor, output_errors
from moecompress.methods.scalar_quant import dequantize, quantize
from moecompress.passes.rtn import (
    PROJ,
    RtnConfig,
    _emits,
    _largest_divisor,
    group_size,
    merge_rtn,
    summarize_rtn,
)

HESSIAN = {"gate": "expert_in_cov", "up": "expert_in_cov", "down": "down_in_cov"}


class GptqConfig(RtnConfig):
    act_order: bool = Field(
        False, description="quantise columns by decreasing Hessian diagonal (static groups)"
    )
    damp: float = Field(0.01, ge=0, lt=10, description="λ: H + λ·mean(diag H)·I (the paper's percdamp)")
    block: int = Field(128, ge=1, description="columns per lazy batch update")


def check_gptq(layer: MoELayer, cfg: GptqConfig) -> None:
    """Dry-run checks on shapes (``meta`` tensors allowed)."""
    bank = layer.experts
    for name in PROJ:
        lay = getattr(bank, name)
        if not isinstance(lay, Dense | Ragged):
            raise PassError(
                f"gptq quantises dense (or neuron-pruned) experts, got layout {lay.kind!r} ({name}); run gptq "
                "once, on dense weights (before any decomposition or other quantisation)"
            )
        inn, gs = lay.shape[2], group_size(layer, cfg)
        if gs != -1 and inn % gs:
            ins = sorted({getattr(bank, p).shape[2] for p in PROJ})
            raise PassError(
                f"group_size={cfg.group_size} does not divide the {inn} input channels of the {name} projection; "
                f"use a common divisor of {' and '.join(map(str, ins))} (e.g. "
                f"{_largest_divisor(ins, cfg.group_size)}) or group_size: -1 (one group per output channel)"
            )


def _hessians(layer: MoELayer, stats: LayerStats, name: str) -> torch.Tensor:
    h = stats[HESSIAN[name]]
    e, _, inn = getattr(layer.experts, name).shape
    if tuple(h.shape) != (e, inn, inn):
        raise PassError(
            f"layer {layer.index}: statistic {HESSIAN[name]} has shape {list(h.shape)}, expected {[e, inn, inn]} "
            f"for the {name} projection; recalibrate on this step's input (statistics of an earlier layer shape)"
        )
    return h


def _workspace(layer: MoELayer, cfg: GptqConfig) -> int:
    """Beyond the layer and its statistics: the widest Hessian's factorisation
    (:func:`~moecompress.methods.gptq.inverse_hessian_factor`: its float32 reversal, the float64 buffer
    factorised and inverted in place, the inverse's temporaries, the float32 Cholesky factor kept for the
    output errors, the float32 factor and its reversal: 28·in² bytes, 1.4 GB at DeepSeek-V3's 7168 inputs)
    and float32 copies of the largest projection of one expert (the weights, the two dequantisations, the
    codes, the working transpose: 5·out·in·4)."""
    shapes = [getattr(layer.experts, p).shape for p in PROJ]
    inn, big = max(s[2] for s in shapes), max(s[1] * s[2] for s in shapes)
    return 28 * inn * inn + 5 * big * 4


def gptq(layer: MoELayer, stats: LayerStats, cfg: GptqConfig) -> tuple[MoELayer, dict]:
    """GPTQ of every routed expert with its own input Hessian (per group of input channels)."""
    check_gptq(layer, cfg)
    bank = layer.experts
    protected = frozenset(layer.physical(e) for e in layer.protected)
    n = bank.num_experts
    todo = [e for e in range(n) if e not in protected]
    gs = group_size(layer, cfg)
    new, errors, out_err, rtn_err, fallback, params = {}, {}, {}, {}, set(), 0
    dense = {name: getattr(bank, name).dense() for name in PROJ}
    hess = {name: _hessians(layer, stats, name) for name in PROJ}
    parts: dict[str, dict[str, list]] = {name: {k: [] for k in ("q", "s", "z", "rel", "o", "r")} for name in PROJ}
    for e in todo:  # experts outer: gate and up read the same Hessian and share its factor
        factors: dict[str, tuple] = {}
        for name in PROJ:
            we, he, acc = dense[name][e].float(), hess[name][e].float(), parts[name]
            rq, rs, rz = quantize(we, cfg.bits, gs, cfg.symmetric)
            if not bool(he.diagonal().gt(0).any()):  # no calibration token reached this expert
                q, s, z = rq, rs, rz
                fallback.add(e)
            else:
                try:
                    if HESSIAN[name] not in factors:
                        factors[HESSIAN[name]] = hessian_factor(he, cfg.damp, cfg.act_order, root=True)
                    q, s, z = gptq_quantize(we, he, cfg.bits, gs, cfg.symmetric, cfg.act_order, cfg.damp, cfg.block,
                                            factor=factors[HESSIAN[name]])  # fmt: skip
                except MethodError as err:
                    raise PassError(f"layer {layer.index} expert {e} {name}: {err}") from None
            deq = dequantize(q, s, z, cfg.bits)
            acc["rel"].append(float((deq - we).norm() / we.norm().clamp_min(1e-30)))
            root = factors[HESSIAN[name]][2] if e not in fallback else None
            o, r = output_errors(we, [deq, dequantize(rq, rs, rz, cfg.bits)], he, root=root)
            acc["o"].append(o)
            acc["r"].append(r)
            acc["q"].append(pack_bits(q, cfg.bits))
            acc["s"].append(s)
            acc["z"].append(z)
    for name in PROJ:
        w, acc = dense[name], parts[name]
        _, out, inn = w.shape
        codes, scales, zeros, rel, oerr, rerr = acc["q"], acc["s"], acc["z"], acc["rel"], acc["o"], acc["r"]
        members = torch.full((n,), -1, dtype=torch.int64)
        members[todo] = torch.arange(len(todo))
        g = inn // (inn if gs == -1 else gs)
        rest = [e for e in range(n) if e in protected]
        lay = RTN(
            torch.stack(codes) if codes else torch.zeros(0, out, packed_size(inn, cfg.bits), dtype=torch.uint8),
            torch.stack(scales) if scales else torch.zeros(0, out, g, dtype=torch.float16),
            None if cfg.symmetric else (torch.stack(zeros) if zeros else torch.zeros(0, out, g, dtype=torch.uint8)),
            members, w[rest].clone() if rest else w.new_zeros(0, out, inn), cfg.bits, int(inn), w.dtype,
        )  # fmt: skip
        new[name] = lay
        params += w.numel()
        errors[name] = sum(rel) / len(rel) if rel else 0.0
        out_err[name] = sum(oerr) / len(oerr) if oerr else 0.0
        rtn_err[name] = sum(rerr) / len(rerr) if rerr else 0.0
    before = sum(getattr(bank, p).nbytes() for p in PROJ)
    after = sum(new[p].nbytes() for p in PROJ)
    info = {
        "bits": cfg.bits,
        "group_size": gs,
        "symmetric": cfg.symmetric,
        "act_order": cfg.act_order,
        "damp": cfg.damp,
        "protected": sorted(protected),
        "quantised_experts": len(todo),
        "rtn_fallback": sorted(fallback),
        "routed_params": params,
        "bytes_before": before,
        "bytes_after": after,
        "bytes_per_param": after / params if params else 0.0,
        "rel_error": errors,
        "output_error": out_err,
        "output_error_rtn": rtn_err,
    }
    return layer.replace(experts=dataclasses.replace(bank, **new)), info


def merge_gptq(infos: list[dict], bnds: list[tuple[int, int]], cfg: GptqConfig) -> dict:
    """``gptq``'s layer info from its chunks' (``rtn``'s merge; the output errors weighted by the chunks'
    quantised experts, the fallback experts in the layer's numbering)."""
    out = merge_rtn(infos, bnds, cfg)
    n = out["quantised_experts"]
    for key in ("output_error", "output_error_rtn"):
        out[key] = {
            p: sum(i[key][p] * i["quantised_experts"] for i in infos) / n if n else 0.0 for p in infos[0][key]
        }
    out["rtn_fallback"] = shifted_ids(infos, bnds, "rtn_fallback")
    return out


def summarize_gptq(infos: dict[int, dict], cfg: GptqConfig) -> dict:
    """The ``rtn`` summary plus GPTQ's output errors next to round-to-nearest's and the fallbacks."""
    out = summarize_rtn(infos, cfg)
    layers = sorted(infos)
    s = out["summary"]
    s["act_order"], s["damp"] = cfg.act_order, cfg.damp

    def mean(key: str) -> dict[str, float]:
        return {str(i): sum(infos[i][key].values()) / len(infos[i][key]) for i in layers}

    s["output_error"], s["output_error_rtn"] = mean("output_error"), mean("output_error_rtn")
    fallback = {str(i): infos[i]["rtn_fallback"] for i in layers if infos[i]["rtn_fallback"]}
    s["rtn_fallback"] = fallback
    if fallback:
        out["warnings"].append(
            f"experts {fallback} received no calibration tokens and were rounded to nearest (rtn); calibrate on "
            "more tokens to give them a Hessian"
        )
    return out


SPEC = PassSpec(
    "gptq",
    GptqConfig,
    gptq,
    needs={"expert_in_cov", "down_in_cov"},
    emits=lambda layer, cfg: _emits(layer, cfg),
    check=check_gptq, workspace=_workspace,
    summarize=lambda infos, cfg: summarize_gptq(infos, cfg), alters=frozenset({"weights"}),
    chunking=Chunking("expert", merge=merge_gptq),  # per expert: its own Hessians, the layer by chunks
)
