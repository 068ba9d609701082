"""The on-disk format of moecompress checkpoints (see ``docs/format.md``).

A layer whose result the stock architecture can express (dense weights, every expert of full width, no
expert map) is written with the architecture's own names by its adapter. Any other layer keeps its
router and shared expert under the stock names and stores its routed experts under the experts
*module* path (``model.layers.<i>.mlp.experts.``, transformers' in-memory name):

    <experts>.<gate|up|down>.<tensor>   the projection's layout tensors (``Layout.tensors()``)
    <experts>.<gate|up|down>_bias       biases (GPT-OSS)
    <experts>.widths                    int32 [E] live widths (when not all full)
    <experts>.expert_map                int64 [E_logical] logical -> physical expert (merged experts)
    <experts>.rotation                  [H, H] input rotation of the bank (codequant)

and ``config.json["moecompress"]["layers"]["<i>"]`` describes it (layout ``meta()`` per projection,
which optional tensors exist, the physical expert count). Such a checkpoint also carries
``quantization_config = {"quant_method": "moecompress", "format": 1}`` so that, after
``import moecompress``, ``AutoModelForCausalLM.from_pretrained`` routes it through our quantizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

import moecompress.lowrank  # noqa: F401  (registers the 'lowrank' layout kind for loading)
from moecompress.codebook import Codebook  # noqa: F401  (registers the 'codebook' layout kind for loading)
from moecompress.errors import CheckpointError, LayoutError
from moecompress.ir import Act, ExpertBank, MoELayer
from moecompress.layouts import LAYOUTS, Dense
from moecompress.scalarq import RTN  # noqa: F401  (registers the 'rtn' layout kind for loading)
from moecompress.tucker import Tucker  # noqa: F401  (registers the layout for loading)

FORMAT_VERSION = 1
PROJ = ("gate", "up", "down")


def is_stock(layer: MoELayer, adapter=None) -> bool:
    """Whether the architecture's own tensor names (and config) can express ``layer`` exactly. With
    ``adapter``, a changed expert width counts only where the stock config can say it (not DeepSeek,
    whose shared-expert width is tied to ``moe_intermediate_size``)."""
    bank = layer.experts
    if adapter is not None and not adapter.stock_width_change and bank.width != adapter.expert_width:
        return False
    dense = all(isinstance(lay, Dense) for lay in (bank.gate, bank.up, bank.down))
    full = bank.widths is None or bool((bank.widths == bank.width).all())
    shared_dense = layer.shared is None or all(
        isinstance(lay, Dense) for lay in (layer.shared.gate, layer.shared.up, layer.shared.down)
    )
    plain = bank.rotation is None and bank.act_bits is None
    return dense and full and shared_dense and plain and layer.expert_map is None


def encode_layer(adapter, layer: MoELayer) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """On-disk tensors of ``layer`` and its description (``None`` for a stock layer)."""
    if is_stock(layer, adapter):
        return adapter.layer_tensors(layer), None
    out = adapter.router_tensors(layer)
    p = adapter.experts_key(layer.index)
    bank = layer.experts
    desc: dict[str, Any] = {"experts": {}, "num_experts": bank.num_experts, "act": bank.act.value}
    if bank.act is Act.SWIGLU_CLAMPED:
        desc.update(alpha=bank.alpha, limit=bank.limit)
    for name in PROJ:
        lay = getattr(bank, name)
        stored = lay.tensors()
        desc["experts"][name] = {
            **lay.meta(),
            "tensors": sorted(stored),
            "tensor_shapes": {k: list(t.shape) for k, t in stored.items()},
            "dtypes": {k: str(t.dtype).removeprefix("torch.") for k, t in stored.items()},
        }
        for key, t in lay.tensors().items():
            out[f"{p}.{name}.{key}"] = t
    for name, b in bank.biases.items():
        out[f"{p}.{name}_bias"] = b
    desc["biases"] = sorted(bank.biases)
    if bank.widths is not None and not bool((bank.widths == bank.width).all()):
        out[f"{p}.widths"] = bank.widths.to(torch.int32)
        desc["widths"] = True
    if bank.rotation is not None:
        out[f"{p}.rotation"] = bank.rotation
        desc["rotation"] = str(bank.rotation.dtype).removeprefix("torch.")
    if bank.act_bits is not None:
        desc["act_bits"] = int(bank.act_bits)
    if bank.unrotated:
        desc["unrotated"] = sorted(bank.unrotated)
    if layer.expert_map is not None:
        out[f"{p}.expert_map"] = layer.expert_map.to(torch.int64)
        desc["expert_map"] = True
        desc["num_logical_experts"] = int(layer.expert_map.numel())
    return out, desc


def compressed_keys(adapter, i: int, desc: dict[str, Any]) -> list[str]:
    """The expert tensor names a described layer stores (for validation and copying)."""
    p = adapter.experts_key(i)
    keys = []
    for name in PROJ:
        meta = desc["experts"][name]
        cls = LAYOUTS.get(meta.get("kind"))
        if cls is None:
            raise CheckpointError(
                f"layer {i}: unknown layout kind {meta.get('kind')!r}; known: {sorted(LAYOUTS)}"
            )
        keys += [f"{p}.{name}.{k}" for k in meta.get("tensors", ["weight"])]
    keys += [f"{p}.{b}_bias" for b in desc.get("biases", [])]
    keys += [f"{p}.widths"] if desc.get("widths") else []
    keys += [f"{p}.expert_map"] if desc.get("expert_map") else []
    keys += [f"{p}.rotation"] if desc.get("rotation") else []
    return keys


def decode_bank(
    desc: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str
) -> tuple[ExpertBank, torch.Tensor | None]:
    """The routed bank (and expert map) of a described layer from its stored tensors."""
    lays = []
    for name in PROJ:
        meta = desc["experts"][name]
        own = {
            k.removeprefix(f"{prefix}.{name}."): v
            for k, v in tensors.items()
            if k.startswith(f"{prefix}.{name}.")
        }
        lays.append(LAYOUTS[meta["kind"]].from_tensors(own, meta))
    biases = {b: tensors[f"{prefix}.{b}_bias"] for b in desc.get("biases", [])}
    widths = tensors.get(f"{prefix}.widths")
    bank = ExpertBank(
        *lays,
        widths=None if widths is None else widths.to(torch.int64),
        biases=biases,
        act=Act(desc.get("act", "swiglu")),
        alpha=float(desc.get("alpha", 1.702)),
        limit=float(desc.get("limit", 7.0)),
        rotation=tensors.get(f"{prefix}.rotation"),
        act_bits=desc.get("act_bits"),
        unrotated=frozenset(int(e) for e in desc.get("unrotated", [])),
    )
    emap = tensors.get(f"{prefix}.expert_map")
    return bank, None if emap is None else emap.to(torch.int64)


def read_compressed_layer(
    adapter, i: int, desc: dict[str, Any], fetch: Callable[[Iterable[str]], dict]
) -> MoELayer:
    """A described (non-stock) layer: router/shared from stock names, experts from the format."""
    part = adapter.router_part(i, fetch(adapter.router_keys(i)))
    bank, emap = decode_bank(desc, fetch(compressed_keys(adapter, i, desc)), adapter.experts_key(i))
    return MoELayer(index=i, experts=bank, expert_map=emap, **part)


def layer_shape(layer: MoELayer) -> list[int]:
    """``[router experts, expert width]``: what the stock config keys must say for this layer (the
    width only matters for layers written under stock names)."""
    return [layer.router.num_experts, layer.experts.width]


def config_with_layers(
    raw_config: dict,
    descs: dict[int, dict | None],
    shapes: dict[int, list[int]],
    *,
    adapter,
    provenance: dict[str, Any] | None,
) -> dict:
    """``config.json`` for an output: the provenance block with per-layer layouts, and either the stock
    expert-count/width keys updated (every spelling present) or ``quantization_config`` for the loader.
    With no provenance and nothing changed, the input config is returned unchanged."""
    cfg = copy.deepcopy(raw_config)
    layers = {str(i): d for i, d in sorted(descs.items()) if d}
    if provenance is not None or layers:
        cfg["moecompress"] = {"format": FORMAT_VERSION, **(provenance or {}), "layers": layers}
    if layers:
        cfg["quantization_config"] = {"quant_method": "moecompress", "format": FORMAT_VERSION}
    # router rows are always stock modules; expert widths only for the layers written under stock names
    counts = {c for c, _ in shapes.values()}
    widths = {w for i, (_, w) in shapes.items() if not descs.get(i)}
    if not widths and counts:
        widths = {int(getattr(adapter.config, adapter.width_key))}
    if len(counts) > 1 or len(widths) > 1:
        raise LayoutError(
            f"layers with different expert counts {sorted(counts)} or widths {sorted(widths)} cannot share one "
            "stock config; write them in the moecompress format"
        )
    if counts:
        for key, value in ((adapter.count_key, counts.pop()), (adapter.width_key, widths.pop())):
            if int(getattr(adapter.config, key)) == value:
                continue
            for k in [k for k in adapter.config_spellings(key) if k in cfg] or [key]:
                cfg[k] = value
    return cfg
