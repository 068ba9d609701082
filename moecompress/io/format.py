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
    <shared>.<...>                      a compressed shared expert, the same names under its module path

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

from moecompress.errors import CheckpointError, LayoutError
from moecompress.io.routing import SIMILARITY, routing_prefix
from moecompress.ir import Act, ExpertBank, MoELayer
from moecompress.layouts import LAYOUTS
from moecompress.layouts.dense import Dense

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
    full = bank.widths is None or (not bank.widths.is_meta and bool((bank.widths == bank.width).all()))
    shared_dense = _dense_bank(layer.shared)
    plain = bank.rotation is None and bank.act_bits is None
    return dense and full and shared_dense and plain and layer.expert_map is None


def _dense_bank(bank: ExpertBank | None) -> bool:
    return bank is None or all(isinstance(lay, Dense) for lay in (bank.gate, bank.up, bank.down))


def encode_bank(bank: ExpertBank, p: str, out: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Add ``bank``'s tensors under prefix ``p`` to ``out``; return its description."""
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
        for key, t in stored.items():
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
    return desc


def encode_layer(adapter, layer: MoELayer) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """On-disk tensors of ``layer`` and its description (``None`` for a stock layer). A compressed
    shared expert is stored like the routed bank, under the shared module's path (``desc["shared"]``)."""
    if is_stock(layer, adapter):
        return {**adapter.layer_tensors(layer), **encode_routing(adapter, layer)}, None
    shared_stock = _dense_bank(layer.shared)
    out = adapter.router_tensors(layer, shared=shared_stock)
    out.update(encode_routing(adapter, layer))
    p = adapter.experts_key(layer.index)
    desc = encode_bank(layer.experts, p, out)
    if layer.expert_map is not None:
        out[f"{p}.expert_map"] = layer.expert_map.to(torch.int64)
        desc["expert_map"] = True
        desc["num_logical_experts"] = int(layer.expert_map.numel())
    if not shared_stock:
        desc["shared"] = encode_bank(layer.shared, adapter.shared_key(layer.index), out)  # type: ignore[arg-type]
    return out, desc


def encode_routing(adapter, layer: MoELayer) -> dict[str, torch.Tensor]:
    """SERE's similarity, under the routing-policy module's path (``moecompress.io.routing``)."""
    if layer.routing_similarity is None:
        return {}
    return {f"{routing_prefix(adapter, layer.index)}.{SIMILARITY}": layer.routing_similarity.float().contiguous()}


def _bank_keys(i: int, p: str, desc: dict[str, Any]) -> list[str]:
    keys = []
    for name in PROJ:
        meta = desc["experts"][name]
        if LAYOUTS.get(meta.get("kind")) is None:
            raise CheckpointError(
                f"layer {i}: unknown layout kind {meta.get('kind')!r}; known: {sorted(LAYOUTS)}"
            )
        keys += [f"{p}.{name}.{k}" for k in meta.get("tensors", ["weight"])]
    keys += [f"{p}.{b}_bias" for b in desc.get("biases", [])]
    keys += [f"{p}.widths"] if desc.get("widths") else []
    keys += [f"{p}.expert_map"] if desc.get("expert_map") else []
    keys += [f"{p}.rotation"] if desc.get("rotation") else []
    return keys


def compressed_keys(adapter, i: int, desc: dict[str, Any]) -> list[str]:
    """The expert tensor names a described layer stores (for validation and copying)."""
    keys = _bank_keys(i, adapter.experts_key(i), desc)
    if "shared" in desc:
        keys += _bank_keys(i, adapter.shared_key(i), desc["shared"])
    return keys


def stock_keys(adapter, i: int, desc: dict[str, Any]) -> list[str]:
    """The stock-named tensors of a described layer (router, biases, an uncompressed shared expert)."""
    return adapter.router_keys(i, shared="shared" not in desc)


def decode_bank(
    desc: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str
) -> tuple[ExpertBank, torch.Tensor | None]:
    """A described bank (and its expert map) from its stored tensors under ``prefix``."""
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
    """A described (non-stock) layer: router (and a dense shared expert) from stock names, the routed
    experts (and a compressed shared expert) from the format."""
    shared_stock = "shared" not in desc
    part = adapter.router_part(i, fetch(stock_keys(adapter, i, desc)), shared=shared_stock)
    tensors = fetch(compressed_keys(adapter, i, desc))
    bank, emap = decode_bank(desc, tensors, adapter.experts_key(i))
    if not shared_stock:
        part["shared"] = decode_bank(desc["shared"], tensors, adapter.shared_key(i))[0]
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
    if layers or (provenance or {}).get("routing"):  # the moecompress runtime loads layouts and policies
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
