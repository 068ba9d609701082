"""The one streaming loop: a checkpoint, decoder layer by decoder layer, into one or more writers.

For each group of tensors (what lies outside the decoder layers first, then each decoder layer in
order): if the group would overflow a writer's shard buffer, every writer flushes first (so each shard
ends at a layer boundary, which is what ``--resume`` needs) and ``on_flush`` is told the last finished
group; an MoE layer is handed to ``on_moe`` (which reads, transforms and adds its tensors); every other
tensor of the group is read once and copied to every writer. Only one layer is in memory at a time.

The copy is raw: the on-disk names and bytes (:attr:`Checkpoint.raw`), so a quantised input's FP8 or
packed tensors and their scales pass through unchanged; only ``on_moe`` sees the logical (dequantised)
view, and writes an MoE layer that no step changed from its raw tensors too
(:func:`raw_layer_tensors`).

``moecompress apply`` (:mod:`moecompress.engine.run`) and :func:`rewrite_checkpoint` are both this loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moecompress.engine.resources import release_freed
from moecompress.io.checkpoint import Checkpoint, open_checkpoint, provenance_block
from moecompress.io.format import config_with_layers, encode_layer, encode_routing, layer_shape
from moecompress.io.quantized import check_stock_output, output_quantization_config
from moecompress.io.reader import read_groups
from moecompress.io.routing import routing_tensors, stored_policy
from moecompress.io.writer import DEFAULT_MAX_SHARD_SIZE, ShardWriter, check_output_dir
from moecompress.ir import MoELayer


def stream_layers(
    ckpt: Checkpoint,
    writers: Sequence[ShardWriter],
    on_moe: Callable[[int], None],
    *,
    start_group: int = 0,
    on_flush: Callable[[int], None] | None = None,
    progress: bool = True,
    desc: str = "layers",
    raw: bool = True,
) -> None:
    """Run the loop described in the module docstring, from group ``start_group`` on; ``raw=False``
    copies a quantised input's other tensors dequantised (its logical view) instead."""
    moe = set(ckpt.moe_layer_indices)
    source = ckpt.raw if raw else ckpt.reader
    groups = ckpt.key_groups(raw=raw)
    for g, (idx, keys) in enumerate(tqdm(groups, desc=desc, unit="layer", disable=not progress)):
        if g < start_group:
            continue
        need = sum(source.nbytes(k) for k in keys)
        if any(w.buffered_bytes and w.buffered_bytes + need > w.max_shard_size for w in writers):
            for w in writers:
                w.flush()
            if on_flush is not None:
                on_flush(g - 1)
        owned: set[str] = set()
        if idx in moe:
            on_moe(idx)
            owned = set(ckpt.raw_moe_keys(idx) if raw else ckpt.moe_keys(idx))
        rest = [k for k in keys if k not in owned]
        for part in read_groups(rest, source.nbytes) if writers else []:
            tensors = source.get_many(part)
            for w in writers:
                w.add_many(tensors)
            del tensors  # written: the next group is read into the memory this one held
            release_freed()


def raw_layer_tensors(ckpt: Checkpoint, idx: int) -> dict | None:
    """The on-disk tensors of MoE layer ``idx`` of a quantised input (to write an unchanged layer in its
    original encoding, byte for byte); ``None`` for any other input (re-encoded as before)."""
    return ckpt.raw.get_many(ckpt.raw_moe_keys(idx)) if ckpt.quantization else None


RAW_RUN = 8
"""Experts of a fused ``[E, ...]`` on-disk tensor copied per piece by :func:`raw_selection`."""

RawWrite = tuple[str, torch.dtype, tuple[int, ...], Callable[[], Iterator[torch.Tensor]]]
"""One tensor to write: name, dtype, shape and a function giving its pieces (read when written)."""


def raw_selection(ckpt: Checkpoint, idx: int, kept: Sequence[int], layer: MoELayer) -> list[RawWrite] | None:
    """MoE layer ``idx`` of a quantised input whose routed experts are a selection of the input's, unchanged
    (``kept``: the input expert ids, in the new order; ``expert_prune``, protection), written in the input's
    on-disk encoding: every kept expert's stored tensors (FP8 weight and ``weight_scale_inv``, packed codes
    and scales, ...) under its new id, the kept rows of fused ``[E, ...]`` tensors (MXFP4 blocks and scales,
    biases), the shared expert's stored tensors as they are, and the router rows and routing-policy
    tensors from ``layer``. ``None`` when the input is not quantised or the layer cannot be written so (a
    quantised router that the selection changed); nothing is read before a tensor is written."""
    if not ckpt.quantization:
        return None
    ad, r, raw = ckpt.adapter, ckpt.reader, ckpt.raw
    e_in = int(ad.num_experts)
    identity = list(kept) == list(range(e_in))
    new_id = {int(old): n for n, old in enumerate(kept)}
    experts = ad.expert_keys(idx, r.keys)
    expert_set = set(experts)
    routing = set(routing_tensors(ad, idx, ckpt.routing.get(idx)))
    router = {} if identity else ad.router_tensors(layer, shared=False)
    out: list[RawWrite] = []

    def whole(name: str) -> Callable[[], Iterator[torch.Tensor]]:
        return lambda: iter([raw.get_many([name])[name]])

    def logical(t: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
        return lambda: iter([t])

    def rows(name: str) -> Callable[[], Iterator[torch.Tensor]]:
        def gen() -> Iterator[torch.Tensor]:
            ids = [int(k) for k in kept]
            a = 0
            while a < len(ids):  # runs of consecutive kept experts, RAW_RUN at a time
                b = a + 1
                while b < len(ids) and b - a < RAW_RUN and ids[b] == ids[b - 1] + 1:
                    b += 1
                yield raw.get_rows(name, ids[a], ids[b - 1] + 1)
                a = b

        return gen

    for k in ckpt.moe_keys(idx):
        if k in routing:
            continue
        names = r.raw_names([k]) if hasattr(r, "raw_names") else [k]
        if k in router:
            if names != [k]:  # a quantised router whose rows change: not in its encoding
                return None
            t = router[k]
            out.append((k, t.dtype, tuple(t.shape), logical(t)))
            continue
        for name in names:
            shape, dtype = tuple(raw.shape(name)), raw.torch_dtype(name)
            if k not in expert_set or identity:
                out.append((name, dtype, shape, whole(name)))
                continue
            e = ad.expert_of(name)
            if e is not None:
                if e in new_id:
                    out.append((ad.renumber_key(name, new_id[e]), dtype, shape, whole(name)))
            elif shape and shape[0] == e_in:
                out.append((name, dtype, (len(kept), *shape[1:]), rows(name)))
            else:
                return None
    for name, t in encode_routing(ad, layer).items():
        out.append((name, t.dtype, tuple(t.shape), logical(t)))
    return out


def write_raw(writer: ShardWriter, writes: list[RawWrite]) -> None:
    """Write :func:`raw_selection`'s tensors, each read as it is written."""
    for name, dtype, shape, pieces in writes:
        writer.add_pieces(name, dtype, shape, pieces())


def rewrite_checkpoint(
    src: str | Path | Checkpoint,
    dst: str | Path,
    fn: Callable[[MoELayer], MoELayer] | None = None,
    *,
    fused: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Stream ``src`` into ``dst`` one decoder layer at a time, passing every MoE layer through ``fn``.

    With ``fn=None`` the output holds byte-identical tensors (in the Hub's per-expert names unless
    ``fused``; a quantised input keeps its on-disk names, encoding and ``quantization_config``).
    Non-weight files (tokenizer, configs) are copied. The output appears atomically.
    """
    check_output_dir(dst, overwrite)
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    descs: dict[int, dict | None] = {}
    shapes: dict[int, list[int]] = {}
    protected: dict[str, list[int]] = {}
    routing: dict[str, dict] = {}
    changed: set[int] = set()
    with ShardWriter(dst, max_shard_size=max_shard_size, overwrite=overwrite) as writer:

        def on_moe(idx: int) -> None:
            layer = original = ckpt.read_layer(idx)
            if fn is not None:
                layer = fn(layer)
            raw = raw_layer_tensors(ckpt, idx) if layer is original else None
            if raw is not None:
                tensors, descs[idx] = raw, None
            elif fused and idx not in ckpt.layouts:
                tensors = {**ckpt.adapter.layer_tensors(layer, fused=True), **encode_routing(ckpt.adapter, layer)}
                descs[idx] = None
            else:
                tensors, descs[idx] = encode_layer(ckpt.adapter, layer)
            if raw is None:
                check_stock_output(ckpt, idx, descs[idx])
                changed.add(idx)
            shapes[idx] = layer_shape(layer)
            if layer.protected:
                protected[str(idx)] = sorted(layer.protected)
            if layer.routing:
                routing[str(idx)] = stored_policy(layer)
            writer.add_many(tensors)

        stream_layers(ckpt, [writer], on_moe, progress=progress)
        for f in ckpt.non_weight_files():
            writer.copy_file(f)
        for name in ckpt.adapter_files():  # attention adapters: fn changes MoE layers only
            writer.copy_file(ckpt.path / name, name)
        cfg = config_with_layers(
            ckpt.raw_config,
            descs,
            shapes,
            adapter=ckpt.adapter,
            provenance=provenance_block(ckpt.raw_config.get("moecompress"), protected, routing),
        )
        writer.write_json("config.json", output_quantization_config(ckpt, cfg, changed))
        return writer.commit()
