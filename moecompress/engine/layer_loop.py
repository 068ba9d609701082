"""The one streaming loop: a checkpoint, decoder layer by decoder layer, into one or more writers.

For each group of tensors (what lies outside the decoder layers first, then each decoder layer in
order): if the group would overflow a writer's shard buffer, every writer flushes first (so each shard
ends at a layer boundary, which is what ``--resume`` needs) and ``on_flush`` is told the last finished
group; an MoE layer is handed to ``on_moe`` (which reads, transforms and adds its tensors); every other
tensor of the group is read once and copied to every writer. Only one layer is in memory at a time.

The copy is raw: the on-disk names and bytes (:attr:`Checkpoint.raw`), so a quantised input's FP8 or
packed tensors and their scales pass through unchanged; only ``on_moe`` sees the logical (dequantised)
view, and writes an MoE layer that no step changed from its raw tensors too
(:func:`moecompress.io.raw.raw_layer_tensors`).

``moecompress apply`` (:mod:`moecompress.engine.run`) and :func:`rewrite_checkpoint` are both this loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from moecompress.engine.resources import release_freed
from moecompress.io.checkpoint import Checkpoint, open_checkpoint, provenance_block
from moecompress.io.format import config_with_layers, encode_layer, encode_routing, layer_shape
from moecompress.io.outputs import DEFAULT_MAX_SHARD_SIZE, check_output_dir
from moecompress.io.quantized import check_stock_output, output_quantization_config
from moecompress.io.raw import raw_layer_tensors
from moecompress.io.reader import read_groups
from moecompress.io.routing import stored_policy
from moecompress.io.writer import ShardWriter
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
