"""``rtn``: round-to-nearest scalar quantisation of every routed expert (data-free baseline).

Every routed expert's gate, up and down projection is quantised to ``bits`` bits per weight, per group
of ``group_size`` consecutive input channels (``-1``: one group per output channel; ``auto``, the
default: the largest of 128, 64, 32 and 16 that divides the inputs of every projection, else ``-1`` —
Qwen3-30B-A3B gets 128, gpt-oss's 2880-wide experts 64, a 48-wide toy model ``-1``), and stored in the
:class:`~moecompress.layouts.rtn.RTN` layout (packed codes, float16 scales, uint8 zero points)::

    asymmetric (default):  lo' = min(lo, 0), hi' = max(hi, 0)
                           s = (hi' − lo') / (2^b − 1),   z = clamp(round(−lo'/s), 0, 2^b − 1)
    symmetric:             s = max|w| / (2^(b−1) − 1),     z = 2^(b−1)
    q = clamp(round(w/s) + z, 0, 2^b − 1),   ŵ = (q − z)·s        (s stored in float16; s = 0 → ŵ = 0)

Every expert is quantised, including experts that saw no calibration tokens: the pass needs no
statistics (the engine still runs its calibration forward for the always-collected statistics and the
report's reconstruction errors). Protected (super) experts stay dense and bit-identical; routers,
shared experts and biases are untouched. Neuron-pruned (ragged) banks are quantised at their
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
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from moecompress.engine.spec import Chunking, LayerStats, PassConfig, PassSpec, shifted_ids
from moecompress.errors import PassError
from moecompress.ir import MoELayer
from moecompress.layouts.bitpack import packed_size
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.rtn import RTN
from moecompress.methods.scalar_quant import group_width, pack_codes, quantize_with_error

PROJ = ("gate", "up", "down")


class RtnConfig(PassConfig):
    bits: int = Field(4, description="bits per weight: 8, 4, 3 or 2")
    group_size: int | Literal["auto"] = Field(
        "auto",
        description="input channels per scale (-1: one group per output channel; auto: the largest of "
        "128/64/32/16 dividing every projection's inputs, else -1)",
    )
    symmetric: bool = Field(False, description="zero point fixed at 2^(bits-1) (needed for vLLM export)")

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in (8, 4, 3, 2):
            raise ValueError("bits must be 8, 4, 3 or 2; use bits: 4 (or 8 for near-lossless)")
        return v

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int | str) -> int | str:
        if v != "auto" and v != -1 and v < 1:  # type: ignore[operator]
            raise ValueError(
                "group_size must be a positive number of input channels (e.g. 128) or -1 for one group per "
                "output channel"
            )
        return v


AUTO_GROUPS = (128, 64, 32, 16)


def group_size(layer: MoELayer, cfg: RtnConfig) -> int:
    """The group size this step uses on ``layer``: the configured one, or under ``auto`` the largest of
    :data:`AUTO_GROUPS` dividing every projection's inputs (``-1`` when none does)."""
    if cfg.group_size != "auto":
        return cfg.group_size  # type: ignore[return-value]
    ins = {getattr(layer.experts, p).shape[2] for p in PROJ}
    return next((g for g in AUTO_GROUPS if all(i % g == 0 for i in ins)), -1)


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
        inn, gs = lay.shape[2], group_size(layer, cfg)
        if gs != -1 and inn % gs:
            ins = sorted({getattr(bank, p).shape[2] for p in PROJ})
            raise PassError(
                f"group_size={cfg.group_size} does not divide the {inn} input channels of the {name} projection; "
                f"use a common divisor of {' and '.join(map(str, ins))} (e.g. "
                f"{_largest_divisor(ins, cfg.group_size)}) or group_size: -1 (one group per output channel)"
            )


def _largest_divisor(sizes: list[int], limit: int) -> int:
    g = math.gcd(*sizes)
    return max(d for d in range(1, min(g, limit) + 1) if g % d == 0)


INNER_CHUNK = 8
"""Experts quantised at once by :func:`quantize_bank` (its ``chunk``)."""


def quantize_bank(
    w: torch.Tensor, bits: int, gs: int, symmetric: bool, protected: frozenset[int], chunk: int = 8
) -> tuple[RTN, list[float]]:
    """``RTN.from_dense(w, ...)`` of one projection ``[E, out, in]`` and ``‖W_e − Ŵ_e‖_F / ‖W_e‖_F`` of every
    quantised expert, from the same ``chunk``-expert pass (the codes are checked before they are packed,
    not unpacked again)."""
    n, out, inn = w.shape
    ids = [e for e in range(n) if e not in protected]
    rest = [e for e in range(n) if e in protected]
    members = torch.full((n,), -1, dtype=torch.int64, device=w.device)
    members[ids] = torch.arange(len(ids), device=w.device)
    g = inn // group_width(inn, gs)
    codes = [w.new_zeros(0, out, packed_size(inn, bits), dtype=torch.uint8)]
    scales = [w.new_zeros(0, out, g, dtype=torch.float16)]
    zeros = [w.new_zeros(0, out, g, dtype=torch.uint8)]
    errors: list[float] = []
    for a in range(0, len(ids), chunk):
        part = w[a : a + chunk] if not rest else w[ids[a : a + chunk]]  # a view when no expert is kept dense
        q, s, z, err = quantize_with_error(part, bits, gs, symmetric)
        errors += err.tolist()
        codes.append(pack_codes(q, bits))
        scales.append(s)
        zeros.append(z)  # type: ignore[arg-type]
    dense = w[rest].clone() if rest else w.new_zeros(0, out, inn)
    lay = RTN(torch.cat(codes), torch.cat(scales), None if symmetric else torch.cat(zeros), members, dense, bits,
              int(inn), w.dtype)  # fmt: skip
    return lay, errors


def _emits(layer: MoELayer, cfg: RtnConfig) -> MoELayer:
    """Shapes only: every projection in the :class:`RTN` layout, protected experts exact."""
    bank, gs = layer.experts, group_size(layer, cfg)
    exact = len({layer.physical(e) for e in layer.protected})
    new = {}
    for name in PROJ:
        e, out, inn = getattr(bank, name).shape
        new[name] = RTN.meta_like(e, out, inn, bits=cfg.bits, group_size=gs, symmetric=cfg.symmetric,
                                  exact=exact, dtype=getattr(bank, name).dtype)  # fmt: skip
    return layer.replace(experts=dataclasses.replace(bank, **new))


def rtn(layer: MoELayer, stats: LayerStats, cfg: RtnConfig) -> tuple[MoELayer, dict]:
    """Round-to-nearest scalar quantisation of every routed expert (per group of input channels)."""
    check_quantizable(layer, cfg)
    bank = layer.experts
    protected = frozenset(layer.physical(e) for e in layer.protected)
    todo = [e for e in range(bank.num_experts) if e not in protected]
    new, errors, params, gs = {}, {}, 0, group_size(layer, cfg)
    for name in PROJ:
        w = getattr(bank, name).dense()
        lay, errs = quantize_bank(w, cfg.bits, gs, cfg.symmetric, protected, INNER_CHUNK)
        errors[name] = sum(errs) / len(errs) if errs else 0.0
        new[name] = lay
        params += w.numel()
    new_bank = dataclasses.replace(bank, **new)
    before = sum(getattr(bank, p).nbytes() for p in PROJ)
    after = sum(new[p].nbytes() for p in PROJ)
    info = {
        "bits": cfg.bits,
        "group_size": gs,
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
            "group_sizes_used": sorted({infos[i]["group_size"] for i in layers}),
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


def merge_rtn(infos: list[dict], bnds: list[tuple[int, int]], cfg: Any) -> dict:
    """``rtn``'s layer info from its chunks' (the mean errors weighted by the chunks' quantised experts)."""
    n = sum(i["quantised_experts"] for i in infos)
    params = sum(i["routed_params"] for i in infos)
    after = sum(i["bytes_after"] for i in infos)
    errors = {
        p: sum(i["rel_error"][p] * i["quantised_experts"] for i in infos) / n if n else 0.0
        for p in infos[0]["rel_error"]
    }
    return {
        **infos[0],
        "protected": shifted_ids(infos, bnds, "protected"),
        "quantised_experts": n,
        "routed_params": params,
        "bytes_before": sum(i["bytes_before"] for i in infos),
        "bytes_after": after,
        "bytes_per_param": after / params if params else 0.0,
        "rel_error": errors,
    }


def _workspace(layer: MoELayer, cfg: RtnConfig) -> int:
    """Bytes :func:`rtn` allocates beyond its input and output (the dry run's estimate): per
    :data:`INNER_CHUNK` experts of the largest projection, their gathered copy (the stored dtype), the
    float32 working copy and one float32 temporary, and the uint8 codes; then the packed codes of one
    projection twice while the chunks are concatenated."""
    bank = layer.experts
    shapes = [getattr(bank, p).shape for p in PROJ]
    worst = max(out * inn for _, out, inn in shapes)
    size = getattr(bank, PROJ[0]).dtype.itemsize
    inner = min(INNER_CHUNK, bank.num_experts) * worst * (size + 4 + 4 + 1)
    return inner + 2 * bank.num_experts * worst * cfg.bits // 8


SPEC = PassSpec(
    "rtn", RtnConfig, rtn, emits=_emits, check=check_quantizable, summarize=lambda infos, cfg: summarize_rtn(infos, cfg),
    chunking=Chunking("expert", merge=merge_rtn), workspace=_workspace, alters=frozenset({"weights"}),
)
