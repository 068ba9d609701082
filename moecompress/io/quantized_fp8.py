"""FP8 e4m3 with block scales (``quant_method: fp8``, DeepSeek-V3/R1 and Qwen3-FP8 layout).

Every quantised Linear stores ``X.weight`` (``F8_E4M3`` ``[out, in]``) and ``X.weight_scale_inv``
(``F32`` ``[ceil(out/b0), ceil(in/b1)]`` for ``weight_block_size: [b0, b1]``); the weight is
``w.float() * scale_inv`` with every scale broadcast over its block, the last block of each dimension
partial when the size is not a multiple (DeepSeek's own ``weight_dequant`` rule). Modules stored
unquantised (embeddings, norms, routers, ``lm_head``) have no scale and are passed through.

Hand-written rather than transformers' ``Fp8Dequantize``: that op derives the block size from the
scale grid (``rows // scale_rows``), which is wrong as soon as a dimension is not a multiple of the
block (``kv_a_proj_with_mqa`` ``[576, 7168]`` in DeepSeek-V3 has a 5-row scale grid), and it is
private API. Static activation scales (``X.input_scale``) travel with their weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moecompress.errors import CheckpointError
from moecompress.io.quantized_base import FIX, QEntry
from moecompress.io.reader import ShardReader

FP8_DTYPES = {"e4m3": "F8_E4M3"}
SCALE_DTYPES = ("F32", "BF16", "F16")


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """``w.float() * scale_inv`` broadcast over ``block``-sized blocks (the last ones partial), float32."""
    b0, b1 = block
    rows, cols = w.shape
    s0, s1 = scale_inv.shape
    pad_r, pad_c = s0 * b0 - rows, s1 * b1 - cols
    wf = torch.nn.functional.pad(w.float(), (0, pad_c, 0, pad_r)) if pad_r or pad_c else w.float()
    out = (wf.view(s0, b0, s1, b1) * scale_inv.float()[:, None, :, None]).view(s0 * b0, s1 * b1)
    return out[:rows, :cols].contiguous() if pad_r or pad_c else out


class Fp8Block:
    method = "fp8"

    def __init__(self, qc: dict, where: str) -> None:
        self.where = where
        fmt = qc.get("fmt", "e4m3")
        if fmt not in FP8_DTYPES:
            raise CheckpointError(
                f"{where}: quantization_config.fmt {fmt!r} is not read (only e4m3 FP8 releases); {FIX}"
            )
        block = qc.get("weight_block_size")
        if not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise CheckpointError(
                f"{where}: quantization_config.weight_block_size is {block!r}; moecompress reads block-scaled "
                f"FP8 (e.g. [128, 128]) only; {FIX}"
            )
        self.fp8 = FP8_DTYPES[fmt]
        self.block = (int(block[0]), int(block[1]))

    def scan(self, raw: ShardReader) -> dict[str, QEntry]:
        out: dict[str, QEntry] = {}
        present = set(raw.keys)
        for k in raw.keys:
            if k.endswith(".weight_scale_inv"):
                w = k.removesuffix("_scale_inv")
                if w not in present or not raw.dtype(w).startswith("F8_"):
                    raise CheckpointError(
                        f"{raw.directory}: tensor {k!r} is a block scale but {w!r} is "
                        f"{'missing' if w not in present else raw.dtype(w) + ', not FP8'}; re-download the checkpoint"
                    )
                continue
            if not raw.dtype(k).startswith("F8_"):
                continue
            out[k] = self._entry(raw, k, present)
        return out

    def _entry(self, raw: ShardReader, k: str, present: set[str]) -> QEntry:
        d = raw.directory
        if not k.endswith(".weight"):
            raise CheckpointError(f"{d}: tensor {k!r} is FP8 but not a module weight; {FIX}")
        if raw.dtype(k) != self.fp8:
            raise CheckpointError(
                f"{d}: tensor {k!r} is {raw.dtype(k)}, but quantization_config says {self.fp8} weights; "
                "fix quantization_config.fmt or re-download the checkpoint"
            )
        shape = raw.shape(k)
        if len(shape) != 2:
            raise CheckpointError(
                f"{d}: FP8 tensor {k!r} has shape {list(shape)}; block-scaled weights are 2-D"
            )
        s = f"{k}_scale_inv"
        if s not in present:
            raise CheckpointError(
                f"{d}: FP8 tensor {k!r} has no block scale {s!r}; re-download the checkpoint"
            )
        want = [-(-shape[0] // self.block[0]), -(-shape[1] // self.block[1])]
        if raw.dtype(s) not in SCALE_DTYPES or list(raw.shape(s)) != want:
            raise CheckpointError(
                f"{d}: block scale {s!r} is {raw.dtype(s)} {list(raw.shape(s))}, expected F32 {want} for weight "
                f"{list(shape)} in {list(self.block)} blocks; re-download the checkpoint"
            )
        act = k.removesuffix("weight") + "input_scale"
        return QEntry(shape=shape, raw=(k, s, *([act] if act in present else [])))

    def decode(self, name: str, entry: QEntry, raw: ShardReader, dtype: torch.dtype) -> torch.Tensor:
        t = raw.get_many(entry.raw[:2])
        return dequantize_fp8_block(t[entry.raw[0]], t[entry.raw[1]], self.block).to(dtype)

    def without(self, qc: dict, modules: list[str]) -> dict:
        # transformers skips a module when a pattern matches its name up to a module boundary; a list
        # replaces its default skips, so keep lm_head skipped as the default would.
        skip = qc.get("modules_to_not_convert")
        skip = list(skip) if skip else ["lm_head"]
        return {**qc, "modules_to_not_convert": [*skip, *(m for m in modules if m not in skip)]}
