"""Writing a trained student: the same layouts as its input, re-encoded from the trained tensors.

Decoder layer by decoder layer (as :func:`moecompress.engine.layer_loop.stream_layers`, shards end at
layer boundaries): each MoE layer is :meth:`LayoutMoE.layer` encoded with
:func:`moecompress.io.format.encode_layer`; every other tensor is copied from the input, or taken from
the trained model (in its stored dtype) when ``trained`` holds it (``trainable: all``). The config,
tokenizer and licence files follow the input (:func:`moecompress.io.checkpoint.provenance_block`).
``adapters`` (``lora_heal`` with ``target: attention_routed``): ``(tensors, config block)`` — the
tensors go to their own safetensors file inside the checkpoint (not a shard), the block into
``config.json``, in the same atomic commit (:mod:`moecompress.runtime.lora_mixer`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from moecompress.io.checkpoint import Checkpoint, provenance_block
from moecompress.io.format import config_with_layers, encode_layer, layer_shape
from moecompress.io.routing import stored_policy
from moecompress.io.writer import ShardWriter
from moecompress.training.student import LayoutMoE


def write_trained(
    ckpt: Checkpoint,
    moes: dict[int, LayoutMoE],
    trained: dict[str, torch.Tensor],
    out_dir: Path,
    *,
    max_shard_size: int | str = "5GB",
    adapters: tuple[dict[str, torch.Tensor], dict] | None = None,
) -> Path:
    """Write the trained student of ``ckpt`` into ``out_dir`` (atomically); returns it."""
    descs: dict[int, dict | None] = {}
    shapes: dict[int, list[int]] = {}
    protected: dict[str, list[int]] = {}
    routing: dict[str, dict] = {}
    with ShardWriter(out_dir, max_shard_size=max_shard_size, overwrite=True) as writer:
        for idx, keys in ckpt.key_groups():
            need = sum(ckpt.reader.nbytes(k) for k in keys)
            if writer.buffered_bytes and writer.buffered_bytes + need > writer.max_shard_size:
                writer.flush()
            owned: set[str] = set()
            if idx in moes:
                layer = moes[idx].layer()
                tensors, descs[idx] = encode_layer(ckpt.adapter, layer)
                shapes[idx] = layer_shape(layer)
                if layer.protected:
                    protected[str(idx)] = sorted(layer.protected)
                if layer.routing:
                    routing[str(idx)] = stored_policy(layer)
                writer.add_many(tensors)
                owned = set(ckpt.moe_keys(idx))
            rest = [k for k in keys if k not in owned]
            if rest:
                tensors = ckpt.reader.get_many(rest)
                for k in rest:
                    if k in trained:
                        tensors[k] = trained[k].detach().to("cpu", tensors[k].dtype).contiguous()
                writer.add_many(tensors)
        for f in ckpt.non_weight_files():
            writer.copy_file(f)
        cfg = config_with_layers(
            ckpt.raw_config, descs, shapes, adapter=ckpt.adapter,
            provenance=provenance_block(ckpt.raw_config.get("moecompress"), protected, routing),
        )  # fmt: skip
        if adapters is not None:
            tensors, block = adapters
            (name,) = {b["file"] for b in block.values()}
            with tempfile.TemporaryDirectory() as tmp:
                save_file(tensors, str(Path(tmp) / "a.safetensors"))
                writer.copy_file(Path(tmp) / "a.safetensors", name)
            cfg = {**cfg, **block}
        writer.write_json("config.json", cfg)
        return writer.commit()
