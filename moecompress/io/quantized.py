"""Quantised releases read directly: a *logical* view of a checkpoint whose weights are stored quantised.

:class:`QuantizedReader` wraps the byte-level :class:`~moecompress.io.reader.ShardReader` and presents
what a bf16 release of the same model would hold: the unquantised tensor names (``X.weight`` for
``X.weight`` + ``X.weight_scale_inv``, ``X.weight`` for compressed-tensors' ``X.weight_packed`` +
``X.weight_scale`` + ``X.weight_shape``, ``mlp.experts.gate_up_proj`` for gpt-oss'
``gate_up_proj_blocks`` + ``gate_up_proj_scales``), their logical shapes and the compute dtype
(``config.json``'s ``dtype``/``torch_dtype``). :meth:`QuantizedReader.get_many` dequantises on access,
one tensor (one expert) at a time, so reading a layer costs one expert's raw bytes transiently on top of
the dequantised result. The adapters, the calibration skeleton and the dry run see only this view.

Formats (one module each, one table here; ``docs/format.md`` "Quantised inputs"):

- ``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-V3/R1, Qwen3-FP8): :mod:`.quantized_fp8`;
- ``quant_method: compressed-tensors``, ``float-quantized`` and ``pack-quantized`` schemes (read with the
  ``compressed-tensors`` library): :mod:`.quantized_ct`;
- ``quant_method: mxfp4`` (gpt-oss): :mod:`.quantized_mxfp4`.

Every other ``quant_method`` is refused at open time with one line naming it and the fix. Shapes,
dtypes and scales are validated from the headers when the checkpoint is opened.

Pass-through: the raw tensors stay reachable (``Checkpoint.raw``, :meth:`QuantizedReader.raw_names`), so
everything a recipe does not change is written in its original encoding, byte for byte, and
:func:`output_quantization_config` keeps the input's ``quantization_config`` minus the MoE blocks that
were rewritten in the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from moecompress.errors import CheckpointError, LayoutError, RecipeError
from moecompress.io.quantized_base import FIX, QEntry, QuantFormat
from moecompress.io.quantized_ct import CompressedTensorsInput
from moecompress.io.quantized_fp8 import Fp8Block
from moecompress.io.quantized_mxfp4 import Mxfp4Input
from moecompress.io.reader import SAFETENSORS_DTYPES, ShardReader

__all__ = ["FIX", "QEntry", "QuantFormat", "QuantizedReader", "output_quantization_config", "quant_format"]

DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
READERS: dict[str, type[QuantFormat]] = {
    "fp8": Fp8Block, "compressed-tensors": CompressedTensorsInput, "mxfp4": Mxfp4Input,
}  # fmt: skip
READ_METHODS = tuple(READERS)


def quant_format(raw_config: dict, where: str) -> QuantFormat | None:
    """The reader of ``raw_config``'s ``quantization_config`` (``None``: not quantised, or moecompress's
    own format); any other method is a one-line :class:`CheckpointError`."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "moecompress":
        return None
    if method in READERS:
        return READERS[method](qc, where)
    raise CheckpointError(
        f"{where}: quantization_config.quant_method {method!r} is not read by moecompress (it reads "
        f"{', '.join(READ_METHODS)}: FP8 block-scaled, compressed-tensors float-quantized/pack-quantized, "
        f"gpt-oss MXFP4); {FIX}"
    )


def logical_dtype(raw_config: dict) -> torch.dtype:
    """The compute dtype a quantised checkpoint is dequantised into: ``config.json``'s ``dtype`` (or
    ``torch_dtype``) when it is a floating-point dtype, else bfloat16."""
    name = raw_config.get("dtype") or raw_config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


class QuantizedReader:
    """The logical view of a quantised checkpoint: the :class:`ShardReader` API with unquantised names,
    shapes and dtypes, dequantising on access (see the module docstring)."""

    def __init__(self, raw: ShardReader, fmt: QuantFormat, dtype: torch.dtype) -> None:
        self.raw, self.fmt, self.compute_dtype = raw, fmt, dtype
        self.directory = raw.directory
        self._q = fmt.scan(raw)
        root = {e.raw[0]: name for name, e in self._q.items()}
        hidden = {n for e in self._q.values() for n in e.raw}
        self._keys = [root.get(k, k) for k in raw.keys if k in root or k not in hidden]
        self._keyset = set(self._keys)

    @property
    def quantized(self) -> list[str]:
        """Logical names of the tensors stored quantised."""
        return list(self._q)

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self._keyset

    def shape(self, name: str) -> tuple[int, ...]:
        return self._q[name].shape if name in self._q else self.raw.shape(name)

    def torch_dtype(self, name: str) -> torch.dtype:
        return self.compute_dtype if name in self._q else self.raw.torch_dtype(name)

    def dtype(self, name: str) -> str:
        return DTYPE_NAMES[self.compute_dtype] if name in self._q else self.raw.dtype(name)

    def meta(self, name: str) -> torch.Tensor:
        return torch.empty(self.shape(name), dtype=self.torch_dtype(name), device="meta")

    def nbytes(self, name: str) -> int:
        """Bytes of the dequantised tensor (what it costs in memory once read)."""
        if name in self._q:
            return math.prod(self._q[name].shape) * self.compute_dtype.itemsize
        return self.raw.nbytes(name)

    @property
    def shards(self) -> list[str]:
        return self.raw.shards

    def raw_names(self, names: Iterable[str]) -> list[str]:
        """The on-disk tensors behind logical ``names`` (payload, scales, ... of each quantised one)."""
        return [n for name in names for n in (self._q[name].raw if name in self._q else (name,))]

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The logical tensors ``names``; quantised ones are read and dequantised one at a time."""
        names = list(names)
        plain = [n for n in names if n not in self._q]
        for n in plain:
            if n not in self:
                raise CheckpointError(f"tensor {n!r} is not in the checkpoint at {self.directory}")
        got = self.raw.get_many(plain) if plain else {}
        out: dict[str, torch.Tensor] = {}
        for n in names:
            out[n] = (
                got.pop(n)
                if n not in self._q
                else self.fmt.decode(n, self._q[n], self.raw, self.compute_dtype)
            )
        return out


    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the first dimension of logical tensor ``name``, dequantised; a format
        with ``decode_rows`` (MXFP4's fused experts) reads only those rows' bytes."""
        if name not in self._q:
            if name not in self:
                raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.directory}")
            return self.raw.get_rows(name, start, stop)
        decode_rows = getattr(self.fmt, "decode_rows", None)
        if decode_rows is not None:
            return decode_rows(self._q[name], self.raw, self.compute_dtype, start, stop)
        return self.fmt.decode(name, self._q[name], self.raw, self.compute_dtype)[start:stop].clone()


def moe_block(adapter, i: int) -> str:
    """Module name of the MoE block of layer ``i`` (what a rewritten layer takes out of quantisation)."""
    return f"{adapter.layer_prefix(i)}{adapter.module_attr}"


def output_quantization_config(ckpt, cfg: dict, changed: Iterable[int], dequantized: bool = False) -> dict:
    """``cfg`` (an output's config.json) with the input's ``quantization_config`` kept for what was
    copied in its original encoding, minus the MoE blocks of the ``changed`` layers (written in the
    compute dtype); without it when every tensor was written dequantised."""
    fmt = getattr(ckpt.reader, "fmt", None)
    qc = cfg.get("quantization_config")
    if fmt is not None and dequantized and isinstance(qc, dict) and qc.get("quant_method") == fmt.method:
        return {k: v for k, v in cfg.items() if k != "quantization_config"}  # (moecompress's own one stays)
    changed = sorted(set(changed))
    if fmt is None or not changed or not isinstance(qc, dict) or qc.get("quant_method") != fmt.method:
        return cfg
    return {**cfg, "quantization_config": fmt.without(qc, [moe_block(ckpt.adapter, i) for i in changed])}


def dequantized_output(ckpt, mode: str, nonstock: tuple[str, int] | None) -> bool:
    """Whether a run writes a quantised input's untouched tensors dequantised (``quantized_input``:
    ``dequantize``; ``auto`` when a written step needs the moecompress format, ``nonstock`` = its label and
    a layer), so that moecompress layouts and the input's quantizer never meet in one checkpoint
    (transformers loads a model through one quantizer). ``keep`` with such a step is refused here, in the
    dry run."""
    fmt = getattr(ckpt.reader, "fmt", None)
    if fmt is None:
        return False
    if mode == "keep" and nonstock is not None:
        step, idx = nonstock
        raise RecipeError(
            f"{step}, layer {idx}: its output needs the moecompress format, which cannot be combined with the "
            f"input's {fmt.method} quantization in one checkpoint, and quantized_input is 'keep'; set "
            "quantized_input: dequantize (every tensor written in the compute dtype), use passes whose output "
            f"stays in stock tensors (e.g. expert_prune), or {FIX}"
        )
    return mode == "dequantize" or (mode == "auto" and nonstock is not None)


def check_stock_output(ckpt, idx: int, desc: dict | None, dequantized: bool = False) -> None:
    """Refuse a layer written in the moecompress format beside a quantised input's kept encoding: its
    loader and the input's quantizer cannot both apply (transformers loads a model through one quantizer)."""
    fmt = getattr(ckpt.reader, "fmt", None)
    if fmt is not None and desc and not dequantized:
        kind = ((desc.get("experts") or {}).get("gate") or {}).get("kind", "compressed")
        raise LayoutError(
            f"layer {idx} would be written in the moecompress format ({kind} layout), which cannot be combined "
            f"with the input's {fmt.method} quantization in one checkpoint; on a quantised input use passes whose output stays in stock tensors "
            f"(e.g. expert_prune), or {FIX}"
        )
