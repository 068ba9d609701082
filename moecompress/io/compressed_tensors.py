"""Export an ``rtn`` output to a compressed-tensors ``pack-quantized`` checkpoint (vLLM, transformers).

:func:`export` streams a moecompress checkpoint whose routed experts are all in the ``rtn`` layout
(:mod:`moecompress.layouts.rtn`, written by the ``rtn`` pass with ``symmetric: true`` and 4 or 8 bits) into
a checkpoint that stock loaders read through ``quant_method: compressed-tensors``: every routed
expert under its Hub per-expert name, as the ``nn.Linear`` modules of the original architecture::

    <experts>.<e>.<proj>.weight_packed   int32 [out, in·b/32]   signed codes q − 2^(b−1), 32/b per int32
    <experts>.<e>.<proj>.weight_scale    [out, G]               the rtn scales (float32 by default)
    <experts>.<e>.<proj>.weight_shape    int64 [2]              (out, in)

(``<proj>`` is ``gate_proj``/``up_proj``/``down_proj``, Mixtral/PhiMoE ``w1``/``w3``/``w2``). Packing
is compressed-tensors' own ``pack_to_int32``, and the ``quantization_config`` is built from its
``QuantizationConfig`` objects: one scheme (``targets: [Linear]``, int, symmetric, ``group`` of the rtn
group size or ``channel`` for one group per row) for every expert of every layer, and
``ignore: [lm_head, "re:^(?!.*\\.experts\\.\\d+\\.).*"]`` — every module that is not a routed expert
(attention, routers, shared experts, dense MLPs) stays unquantised and keeps its stored weights.
Dequantisation ``q·s`` is exact in float32, so the loaded weights equal the rtn layout's decoded ones.

Why symmetric only: vLLM's compressed-tensors MoE methods assert "Only symmetric quantization is
supported for MoE", and transformers 5.x (which loads per-expert checkpoints into fused
``experts.gate_up_proj``/``down_proj`` by dequantising at load) fails on asymmetric experts with
"AssertionError: Asymmetric quant requires zero-point values" (its expert converter never passes the
``weight_zero_point``). vLLM's WNA16 MoE kernels take 4 or 8 bits. An asymmetric, 2/3-bit, pruned,
merged or rotated source is refused with the fix. Protected (super) experts are stored dense by
``rtn``; a compressed-tensors layer must quantise every expert, so they are refused unless
``quantize_protected=True`` quantises them with the same scheme here.

Example::

    moecompress apply recipe.yaml              # steps: [{rtn: {bits: 4, group_size: 128, symmetric: true}}]
    moecompress export --format compressed-tensors out/ out-ct/
    # or: from moecompress.io.compressed_tensors import export; export("out", "out-ct")

The output appears atomically (written into a temporary sibling directory, then renamed); an existing
output directory is refused unless ``overwrite``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from moecompress.adapters.base import PerExpertAdapter
from moecompress.errors import CheckpointError
from moecompress.extras import require
from moecompress.io.checkpoint import Checkpoint, open_checkpoint
from moecompress.io.outputs import DEFAULT_MAX_SHARD_SIZE, check_output_dir
from moecompress.io.writer import ShardWriter
from moecompress.ir import MoELayer
from moecompress.layouts.rtn import RTN
from moecompress.methods.scalar_quant import quantize

log = logging.getLogger(__name__)

EXPORT_BITS = (4, 8)
IGNORE = ["lm_head", r"re:^(?!.*\.experts\.\d+\.).*"]
SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PROJ = ("gate", "up", "down")


class ExportError(CheckpointError):
    """A checkpoint cannot be written in the requested export format."""


def _library():
    require("compressed-tensors", "moecompress export --format compressed-tensors")
    try:
        import compressed_tensors
        from compressed_tensors.compressors import pack_to_int32
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationConfig,
            QuantizationScheme,
            QuantizationStatus,
        )
    except ImportError as err:
        raise ExportError(
            f"the compressed-tensors export needs the compressed-tensors library ({err}); "
            "pip install 'moecompress[compressed-tensors]'"
        ) from None
    return (
        compressed_tensors,
        pack_to_int32,
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )


def _scheme_of(ckpt: Checkpoint, quantize_protected: bool) -> dict[str, Any]:
    """The one scheme every described layer must share: ``bits``, ``strategy``, ``group_size``."""
    if not isinstance(ckpt.adapter, PerExpertAdapter):
        raise ExportError(
            f"{ckpt.model_type}: the compressed-tensors export writes per-expert nn.Linear names, which this "
            "architecture does not have on disk (fused experts); export is supported for per-expert models"
        )
    if ckpt.routing:
        raise ExportError(
            f"layers {sorted(ckpt.routing)} carry routing policies (capacity_drop / sere), which compressed-tensors "
            "loaders would ignore; export the output of the steps before the routing-policy steps"
        )
    layouts = ckpt.layouts
    fix = "run the rtn pass with symmetric: true and bits 4 or 8 as the last step"
    seen: dict[str, Any] = {}
    for i in ckpt.moe_layer_indices:
        desc = layouts.get(i)
        if desc is None:
            raise ExportError(f"layer {i} is not quantised (stock dense experts); {fix}")
        extra = [k for k in ("widths", "expert_map", "rotation", "act_bits") if desc.get(k)]
        if extra or desc.get("biases"):
            raise ExportError(
                f"layer {i} stores {', '.join(extra + ['biases'] * bool(desc.get('biases')))}, which "
                "compressed-tensors cannot express; export needs full-width, unmerged, plain experts"
            )
        sizes: set[int] = set()
        per_row = True
        for name in PROJ:
            meta = desc["experts"][name]
            if meta.get("kind") != "rtn":
                raise ExportError(f"layer {i} {name}: layout {meta.get('kind')!r} is not rtn; {fix}")
            if not meta.get("symmetric"):
                raise ExportError(
                    f"layer {i} {name}: asymmetric rtn; vLLM's MoE kernels and transformers' loader take "
                    f"symmetric int experts only; {fix}"
                )
            if int(meta["bits"]) not in EXPORT_BITS:
                raise ExportError(
                    f"layer {i} {name}: {meta['bits']}-bit rtn; vLLM's MoE kernels take {EXPORT_BITS} bits; {fix}"
                )
            if "dense" in meta.get("tensors", []) and not quantize_protected:
                raise ExportError(
                    f"layer {i}: protected experts are stored dense, but compressed-tensors needs every expert "
                    "quantised; pass quantize_protected=True (--quantize-protected) to quantise them too"
                )
            groups = int(meta["tensor_shapes"]["scales"][2])
            sizes.add(int(meta["shape"][2]) // groups)
            per_row &= groups == 1
            seen.setdefault("bits", int(meta["bits"]))
            if seen["bits"] != int(meta["bits"]):
                raise ExportError(f"layer {i} {name}: {meta['bits']} bits, other layers {seen['bits']}")
        scheme = ("channel", None) if per_row else ("group", min(sizes)) if len(sizes) == 1 else None
        if scheme is None or seen.setdefault("scheme", scheme) != scheme:
            raise ExportError(
                f"layer {i}: group sizes {sorted(sizes)} differ between projections or layers; "
                "compressed-tensors takes one scheme per model: re-run rtn with one group_size dividing every "
                "input size, or group_size: -1"
            )
    if not seen:
        raise ExportError(f"{ckpt.path} has no MoE layers to export")
    strategy, group = seen["scheme"]
    return {"bits": seen["bits"], "strategy": strategy, "group_size": group}


def quantization_config(bits: int, strategy: str, group_size: int | None) -> dict[str, Any]:
    """``config.json["quantization_config"]`` for the export, built from compressed-tensors' objects."""
    ct, _, QArgs, QConfig, QScheme, QStatus = _library()
    weights = QArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group_size)
    qc = QConfig(
        config_groups={"group_0": QScheme(targets=["Linear"], weights=weights)},
        format="pack-quantized",
        quantization_status=QStatus.COMPRESSED,
        ignore=list(IGNORE),
    )
    # what compressed-tensors' ModelCompressor.update_config writes
    return {
        "version": ct.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **qc.model_dump(mode="json", exclude={"quant_method"}),
    }


def expert_tensors(
    layer: MoELayer, prefix: str, proj_names: tuple[str, str, str], scheme: dict[str, Any], scale_dtype
) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of every routed expert of ``layer`` (``prefix``: ``…experts``)."""
    _, pack_to_int32, *_ = _library()
    bits, offset = scheme["bits"], 1 << (scheme["bits"] - 1)
    out: dict[str, torch.Tensor] = {}
    for name, disk in zip(PROJ, proj_names):
        lay = getattr(layer.experts, name)
        if not isinstance(lay, RTN):
            raise ExportError(f"layer {layer.index} {name}: layout {lay.kind!r} is not rtn")
        n, rows, inn = lay.shape
        gs = -1 if scheme["strategy"] == "channel" else scheme["group_size"]
        for e in range(n):
            part = lay.quantised(e)
            if part is None:  # protected: quantised here with the same scheme (quantize_protected)
                codes, scales, _ = quantize(lay.expert(e), bits, gs, symmetric=True)
            else:
                codes, scales, _ = part
            key = f"{prefix}.{e}.{disk}"
            out[f"{key}.weight_packed"] = pack_to_int32((codes.to(torch.int16) - offset).to(torch.int8), bits)
            out[f"{key}.weight_scale"] = scales.to(scale_dtype).contiguous()
            out[f"{key}.weight_shape"] = torch.tensor([rows, inn], dtype=torch.int64)
    return out


def export(
    src: str | Path,
    out_dir: str | Path,
    *,
    scale_dtype: str = "float32",
    quantize_protected: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the rtn checkpoint ``src`` into a compressed-tensors checkpoint at ``out_dir``.

    ``scale_dtype``: dtype of ``weight_scale`` (``float32`` makes transformers' dequantisation exact;
    ``float16`` halves the scale bytes; loaders compute ``q·s`` in the scale's dtype). Non-weight files
    (tokenizer, generation config, recipe, reports) are copied; the model card is not (it describes the
    moecompress format). Returns the output path."""
    check_output_dir(out_dir, overwrite)
    if scale_dtype not in SCALE_DTYPES:
        raise ExportError(f"scale_dtype={scale_dtype!r} is not one of {sorted(SCALE_DTYPES)}")
    _library()
    ckpt = open_checkpoint(src)
    scheme = _scheme_of(ckpt, quantize_protected)
    adapter = ckpt.adapter
    moe = set(ckpt.moe_layer_indices)
    with ShardWriter(out_dir, max_shard_size=max_shard_size, overwrite=overwrite) as writer:
        for idx, keys in tqdm(ckpt.key_groups(), desc="layers", unit="layer", disable=not progress):
            writer.make_room(sum(ckpt.reader.nbytes(k) for k in keys))
            owned: set[str] = set()
            if idx in moe:
                layer = ckpt.read_layer(idx)
                prefix = f"{adapter.layer_prefix(idx)}{adapter.disk_block}.experts"
                writer.add_many(adapter.router_tensors(layer))
                writer.add_many(
                    expert_tensors(layer, prefix, adapter.proj, scheme, SCALE_DTYPES[scale_dtype])
                )
                owned = set(ckpt.moe_keys(idx))
                del layer
            writer.add_many(ckpt.reader.get_many([k for k in keys if k not in owned]))
        for f in ckpt.non_weight_files():
            if f.name not in ("config.json", "README.md"):
                writer.copy_file(f)
        writer.write_json("config.json", export_config(ckpt.raw_config, scheme))
        path = writer.commit()
    log.info("exported %s to %s (%s)", ckpt.path, path, scheme)
    return path


def export_config(raw_config: dict, scheme: dict[str, Any]) -> dict:
    """The source ``config.json`` with the compressed-tensors ``quantization_config`` and the
    moecompress provenance block without its layouts (the experts are stock names again)."""
    cfg = copy.deepcopy(raw_config)
    cfg["quantization_config"] = quantization_config(scheme["bits"], scheme["strategy"], scheme["group_size"])
    block = cfg.get("moecompress")
    if isinstance(block, dict):
        block = {k: v for k, v in block.items() if k not in ("layers", "protected")}
        block["export"] = {"format": "compressed-tensors", **scheme}
        cfg["moecompress"] = block
    return cfg
