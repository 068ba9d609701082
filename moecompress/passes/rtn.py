"""``rtn``: round-to-nearest scalar quantisation of every routed expert (data-free baseline).

Every routed expert's gate, up and down projection is quantised to ``bits`` bits per weight, per group
of ``group_size`` consecutive input channels (``-1``: one group per output channel), and stored in the
:class:`~moecompress.scalarq.RTN` layout (packed codes, float16 scales, uint8 zero points)::

    asymmetric (default):  lo' = min(lo, 0), hi' = max(hi, 0)
                           s = (hi' − lo') / (2^b − 1),   z = clamp(round(−lo'/s), 0, 2^b − 1)
    symmetric:             s = max|w| / (2^(b−1) − 1),     z = 2^(b−1)
    q = clamp(round(w/s) + z, 0, 2^b − 1),   ŵ = (q − z)·s        (s stored in float16; s = 0 → ŵ = 0)

Every expert is quantised, including experts that saw no calibration tokens: the pass needs no
statistics (no calibration pass runs for it). Protected (super) experts stay dense and bit-identical;
routers, shared experts and biases are untouched. Neuron-pruned (ragged) banks are quantised at their
full logical width (the pruned neurons cost codes; the forward still skips them). Factorised or
already-quantised layouts are refused.

``symmetric: true`` is what vLLM's compressed-tensors MoE kernels and transformers' loader accept;
:func:`moecompress.io.compressed_tensors.export` converts such an output (4 or 8 bits) into a
``pack-quantized`` compressed-tensors checkpoint.

Report: per layer the bytes of the routed experts before/after, bytes per routed-expert parameter
(codes + scales + zero points + protected dense experts + member maps) and the mean relative weight
error ``‖W_e − Ŵ_e‖_F / ‖W_e‖_F`` over the quantised experts, per projection; the summary gives the
totals and the bits per weight. Cost: one pass over the weights, no calibration.

Example steps::

    steps:
      - rtn: {bits: 4, group_size: 128}                    # asymmetric, stored in the moecompress format
      - rtn: {bits: 4, group_size: 128, symmetric: true}   # exportable to compressed-tensors (vLLM)
"""

from __future__ import annotations

import dataclasses
import math

import torch
from pydantic import Field, field_validator

from moecompress.errors import PassError
from moecompress.ir import MoELayer
from moecompress.layouts import Dense, Ragged
from moecompress.registry import LayerStats, PassConfig, register_pass
from moecompress.scalarq import RTN, dequantize

PROJ = ("gate", "up", "down")


class RtnConfig(PassConfig):
    bits: int = Field(4, description="bits per weight: 8, 4, 3 or 2")
    group_size: int = Field(128, description="input channels per scale (-1: one group per output channel)")
    symmetric: bool = Field(False, description="zero point fixed at 2^(bits-1) (needed for vLLM export)")

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in (8, 4, 3, 2):
            raise ValueError("bits must be 8, 4, 3 or 2; use bits: 4 (or 8 for near-lossless)")
        return v

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(
                "group_size must be a positive number of input channels (e.g. 128) or -1 for one group per "
                "output channel"
            )
        return v


def check_quantizable(layer: MoELayer, cfg: RtnConfig) -> None:
    """Dry-run checks on shapes (``meta`` tensors allowed)."""
    bank = layer.experts
    for name in PROJ:
        lay = getattr(bank, name)
        if not isinstance(lay, Dense | Ragged):
            raise PassError(
                f"rtn quantises dense (or neuron-pruned) experts, got layout {lay.kind!r} ({name}); run rtn "
                "once, on dense weights (before any decomposition or other quantisation)"
            )
        inn = lay.shape[2]
        if cfg.group_size != -1 and inn % cfg.group_size:
            ins = sorted({getattr(bank, p).shape[2] for p in PROJ})
            raise PassError(
                f"group_size={cfg.group_size} does not divide the {inn} input channels of the {name} projection; "
                f"use a common divisor of {' and '.join(map(str, ins))} (e.g. "
                f"{_largest_divisor(ins, cfg.group_size)}) or group_size: -1 (one group per output channel)"
            )


def _largest_divisor(sizes: list[int], limit: int) -> int:
    g = math.gcd(*sizes)
    return max(d for d in range(1, min(g, limit) + 1) if g % d == 0)


def _rel_errors(w: torch.Tensor, lay: RTN, ids: list[int], chunk: int = 8) -> list[float]:
    """``‖W_e − Ŵ_e‖_F / ‖W_e‖_F`` of the quantised experts ``ids`` (decoded ``chunk`` at a time)."""
    out: list[float] = []
    for a in range(0, len(ids), chunk):
        part = ids[a : a + chunk]
        m = lay.members[part]
        q = torch.stack([lay.quantised(e)[0] for e in part])  # type: ignore[index]
        z = None if lay.zeros is None else lay.zeros[m]
        deq = dequantize(q, lay.scales[m], z, lay.bits)
        ref = w[part].float()
        num = (deq - ref).flatten(1).norm(dim=1)
        den = ref.flatten(1).norm(dim=1).clamp_min(1e-30)
        out += (num / den).tolist()
    return out


@register_pass(
    "rtn", RtnConfig, check=check_quantizable, summarize=lambda infos, cfg: summarize_rtn(infos, cfg)
)
def rtn(layer: MoELayer, stats: LayerStats, cfg: RtnConfig) -> tuple[MoELayer, dict]:
    """Round-to-nearest scalar quantisation of every routed expert (per group of input channels)."""
    check_quantizable(layer, cfg)
    bank = layer.experts
    protected = frozenset(layer.physical(e) for e in layer.protected)
    todo = [e for e in range(bank.num_experts) if e not in protected]
    new, errors, params = {}, {}, 0
    for name in PROJ:
        w = getattr(bank, name).dense()
        lay = RTN.from_dense(w, cfg.bits, cfg.group_size, symmetric=cfg.symmetric, protected=protected)
        errs = _rel_errors(w, lay, todo)
        errors[name] = sum(errs) / len(errs) if errs else 0.0
        new[name] = lay
        params += w.numel()
    new_bank = dataclasses.replace(bank, **new)
    before = sum(getattr(bank, p).nbytes() for p in PROJ)
    after = sum(new[p].nbytes() for p in PROJ)
    info = {
        "bits": cfg.bits,
        "group_size": cfg.group_size,
        "symmetric": cfg.symmetric,
        "protected": sorted(protected),
        "quantised_experts": len(todo),
        "routed_params": params,
        "bytes_before": before,
        "bytes_after": after,
        "bytes_per_param": after / params if params else 0.0,
        "rel_error": errors,
    }
    return layer.replace(experts=new_bank), info


def summarize_rtn(infos: dict[int, dict], cfg: RtnConfig) -> dict:
    """Step summary: total bytes before/after, bits per routed weight, mean relative error per layer."""
    layers = sorted(infos)
    before = sum(infos[i]["bytes_before"] for i in layers)
    after = sum(infos[i]["bytes_after"] for i in layers)
    params = sum(infos[i]["routed_params"] for i in layers)
    protected = {str(i): infos[i]["protected"] for i in layers if infos[i]["protected"]}
    mean_err = {str(i): sum(infos[i]["rel_error"].values()) / len(infos[i]["rel_error"]) for i in layers}
    warnings = []
    if protected:
        warnings.append(
            f"protected experts {protected} stay dense; a compressed-tensors export (vLLM) needs every expert "
            "quantised and refuses them unless asked to quantise them too (quantize_protected)"
        )
    return {
        "summary": {
            "bits": cfg.bits,
            "group_size": cfg.group_size,
            "symmetric": cfg.symmetric,
            "routed_params": params,
            "routed_bytes_before": before,
            "routed_bytes_after": after,
            "routed_bytes_per_param": after / params if params else 0.0,
            "routed_bits_per_param": 8 * after / params if params else 0.0,
            "compression": before / after if after else 0.0,
            "protected": protected,
            "rel_error": mean_err,
        },
        "warnings": warnings,
    }
