"""MXFP4 experts (``quant_method: mxfp4``, the gpt-oss releases).

The routed experts of each layer are stored as ``mlp.experts.gate_up_proj_blocks`` (``U8``
``[E, 2I, H/32, 16]``: 32 e2m1 values per block, two per byte, the low nibble first) with
``gate_up_proj_scales`` (``U8`` ``[E, 2I, H/32]``: one e8m0 exponent per block, ``2^(s-127)``), and
``down_proj_blocks``/``down_proj_scales`` (``[E, H, I/32, 16]``/``[E, H, I/32]``). The blocks run along
the *input* dimension of ``x @ W`` (out-major); the logical tensors are the bf16 release's
``gate_up_proj`` ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` that the gpt_oss adapter reads.

Dequantisation is transformers' own pure CPU function
(``transformers.integrations.mxfp4.convert_moe_packed_tensors``: FP4 LUT, ``ldexp`` by the exponent,
transpose), applied to one expert at a time, read with safetensors' ``get_slice`` (expert ``e``'s rows
only). Everything else (attention, router, biases, embeddings) is stored unquantised.
"""

from __future__ import annotations

import torch

from moecompress.errors import CheckpointError
from moecompress.io.quantized_base import QEntry
from moecompress.io.reader import ShardReader

BLOCK = 32


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[E', H, R]`` weights (``x @ W`` orientation) of ``[E', R, G, 16]`` blocks and ``[E', R, G]`` scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


class Mxfp4Input:
    method = "mxfp4"

    def __init__(self, qc: dict, where: str) -> None:
        self.where = where

    def scan(self, raw: ShardReader) -> dict[str, QEntry]:
        out: dict[str, QEntry] = {}
        present, d = set(raw.keys), raw.directory
        for k in raw.keys:
            if k.endswith("_scales") and f"{k.removesuffix('_scales')}_blocks" not in present:
                raise CheckpointError(
                    f"{d}: MXFP4 scales {k!r} have no blocks tensor; re-download the checkpoint"
                )
            if not k.endswith("_blocks"):
                continue
            base = k.removesuffix("_blocks")
            s = f"{base}_scales"
            shape = raw.shape(k)
            if raw.dtype(k) != "U8" or len(shape) != 4 or shape[-1] != BLOCK // 2:
                raise CheckpointError(
                    f"{d}: MXFP4 blocks {k!r} are {raw.dtype(k)} {list(shape)}, expected U8 [E, rows, groups, 16]; "
                    "re-download the checkpoint"
                )
            if s not in present:
                raise CheckpointError(
                    f"{d}: MXFP4 blocks {k!r} have no scales {s!r}; re-download the checkpoint"
                )
            if raw.dtype(s) != "U8" or tuple(raw.shape(s)) != tuple(shape[:-1]):
                raise CheckpointError(
                    f"{d}: MXFP4 scales {s!r} are {raw.dtype(s)} {list(raw.shape(s))}, expected U8 "
                    f"{list(shape[:-1])} for blocks {list(shape)}; re-download the checkpoint"
                )
            e, rows, groups, _ = shape
            out[base] = QEntry(shape=(e, groups * BLOCK, rows), raw=(k, s))
        return out

    def decode(self, name: str, entry: QEntry, raw: ShardReader, dtype: torch.dtype) -> torch.Tensor:
        return self.decode_rows(entry, raw, dtype, 0, entry.shape[0])

    def decode_rows(self, entry: QEntry, raw: ShardReader, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Experts ``[start, stop)``, reading only their blocks and scales (one expert at a time)."""
        blocks, scales = entry.raw
        out = torch.empty((stop - start, *entry.shape[1:]), dtype=dtype)
        for e in range(start, stop):
            out[e - start] = dequantize_expert(
                raw.get_rows(blocks, e, e + 1), raw.get_rows(scales, e, e + 1), dtype
            )[0]
        return out

    def without(self, qc: dict, modules: list[str]) -> dict:
        skip = list(qc.get("modules_to_not_convert") or [])
        return {
            **qc,
            "modules_to_not_convert": [
                *skip,
                *(f"{m}.experts" for m in modules if f"{m}.experts" not in skip),
            ],
        }
