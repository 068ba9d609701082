"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), read with the library itself.

The ``quantization_config`` is parsed by compressed-tensors' ``QuantizationConfig``; every config group
(scheme) is decoded by its format's compressor (``BaseCompressor.get_value_from_registry(format)``,
``compression_param_names`` and ``decompress``), with the module matching of the library's own
model-free dequantiser (``CompressedTensorsDequantizer``): a module is quantised by the first scheme
whose ``targets`` match it (``Linear`` or ``re:`` patterns, by ``match_name``) and that no ``ignore``
entry matches. A scheme's format is its own ``format``, else the config's (unless ``mixed-precision``),
else inferred for ``Linear``. Read: ``float-quantized`` (FP8 ``weight`` + ``weight_scale`` per tensor,
channel or block) and ``pack-quantized`` (int4/int8 ``weight_packed`` + ``weight_scale``
[+ ``weight_zero_point``] + ``weight_shape``); any other format, a sparsity or transform config, or a
status other than ``compressed`` is refused with one line.
"""

from __future__ import annotations

import math
import re

import torch

from moecompress.errors import CheckpointError
from moecompress.extras import require
from moecompress.io.quantized_base import FIX, QEntry
from moecompress.io.reader import ShardReader

FORMATS = ("float-quantized", "pack-quantized")
ACTIVATION_QPARAMS = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")
"""static activation parameters stored beside a weight: passed through with it, hidden from the view."""
ROOTS = {"float-quantized": "weight", "pack-quantized": "weight_packed"}


class CompressedTensorsInput:
    method = "compressed-tensors"

    def __init__(self, qc: dict, where: str) -> None:
        require("compressed-tensors", "reading a compressed-tensors checkpoint")
        import pydantic
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.compressors.format import infer_module_format
        from compressed_tensors.quantization import QuantizationConfig

        self.where = where
        try:
            config = QuantizationConfig.model_validate(qc)
        except (pydantic.ValidationError, ValueError) as err:
            first = str(err).strip().splitlines()[0]
            raise CheckpointError(
                f"{where}: quantization_config is not a compressed-tensors config ({first})"
            ) from None
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise CheckpointError(
                    f"{where}: quantization_config.{key} is set; it is not read by moecompress; {FIX}"
                )
        status = str(getattr(config.quantization_status, "value", config.quantization_status))
        if status != "compressed":
            raise CheckpointError(
                f"{where}: quantization_config.quantization_status is {status!r}; moecompress reads compressed "
                f"checkpoints only; {FIX}"
            )
        top = getattr(config.format, "value", config.format)
        self.ignore = list(config.ignore or [])
        self.schemes = []  # (group name, scheme, format, compressor, param names)
        for name, scheme in config.config_groups.items():
            if scheme.weights is None:
                raise CheckpointError(
                    f"{where}: config group {name!r} quantises no weights; it is not read; {FIX}"
                )
            fmt = scheme.format or (top if top not in (None, "mixed-precision") else None)
            fmt = str(
                getattr(fmt, "value", fmt) if fmt else infer_module_format(torch.nn.Linear, scheme).value
            )
            if fmt not in FORMATS:
                raise CheckpointError(
                    f"{where}: config group {name!r} uses the compressed-tensors format {fmt!r}; moecompress reads "
                    f"{' and '.join(FORMATS)}; {FIX}"
                )
            compressor = BaseCompressor.get_value_from_registry(fmt)
            self.schemes.append(
                (name, scheme, fmt, compressor, tuple(compressor.compression_param_names(scheme)))
            )

    # -- matching --------------------------------------------------------------------------------
    def _ignored(self, module: str) -> bool:
        from compressed_tensors.utils.match import match_name

        return any(match_name(module, ign) for ign in self.ignore)

    def _scheme_of(self, module: str):
        from compressed_tensors.utils.match import match_name

        for entry in self.schemes:
            if "Linear" in entry[1].targets or any(match_name(module, t) for t in entry[1].targets):
                return entry
        return None

    def scan(self, raw: ShardReader) -> dict[str, QEntry]:
        present = set(raw.keys)
        found: dict[str, tuple] = {}
        for k in raw.keys:
            module, _, param = k.rpartition(".")
            if param == "weight_packed" or (param == "weight" and raw.dtype(k).startswith("F8_")):
                if self._ignored(module):
                    raise CheckpointError(
                        f"{raw.directory}: {k!r} is stored quantised but quantization_config.ignore matches "
                        f"module {module!r}; fix the ignore list or re-download the checkpoint"
                    )
                scheme = self._scheme_of(module)
                if scheme is None or ROOTS[scheme[2]] != param:
                    raise CheckpointError(
                        f"{raw.directory}: {k!r} is stored quantised but no config group of quantization_config "
                        f"targets module {module!r} in that format; fix config_groups or re-download the checkpoint"
                    )
                found[module] = scheme
        shapes = self._logical_shapes(raw, found, present)
        out = {}
        for m, s in found.items():
            names = [f"{m}.{p}" for p in s[4]]
            names += [f"{m}.{q}" for q in ACTIVATION_QPARAMS if f"{m}.{q}" in present and q not in s[4]]
            out[f"{m}.weight"] = QEntry(shape=shapes[m], raw=tuple(names), info=s)
        return out

    def _logical_shapes(self, raw: ShardReader, found: dict, present: set[str]) -> dict[str, tuple[int, ...]]:
        d = raw.directory
        for m, (group, _, fmt, _, params) in found.items():
            for p in params:
                if f"{m}.{p}" not in present:
                    raise CheckpointError(
                        f"{d}: module {m!r} (config group {group!r}, {fmt}) has no {f'{m}.{p}'!r}; "
                        "re-download the checkpoint"
                    )
        packed = [f"{m}.weight_shape" for m, s in found.items() if s[2] == "pack-quantized"]
        stored = raw.get_many(packed) if packed else {}  # a few bytes each, read once at open
        shapes = {}
        for m, (group, scheme, fmt, _, _) in found.items():
            if fmt == "pack-quantized":
                t = stored[f"{m}.weight_shape"]
                if t.numel() != 2 or t.is_floating_point():
                    raise CheckpointError(
                        f"{d}: {f'{m}.weight_shape'!r} is {t.tolist()}, not an integer [out, in]"
                    )
                shape = (int(t[0]), int(t[1]))
                cols = math.ceil(shape[1] * scheme.weights.num_bits / 32)
                got = raw.shape(f"{m}.weight_packed")
                if raw.dtype(f"{m}.weight_packed") != "I32" or tuple(got) != (shape[0], cols):
                    raise CheckpointError(
                        f"{d}: {f'{m}.weight_packed'!r} is {raw.dtype(f'{m}.weight_packed')} {list(got)}, expected "
                        f"I32 {[shape[0], cols]} for weight_shape {list(shape)} at {scheme.weights.num_bits} bits"
                    )
            else:
                shape = tuple(raw.shape(f"{m}.weight"))
                want = {8: "F8_E4M3"}.get(scheme.weights.num_bits if scheme.weights.type == "float" else 0)
                if want is None or raw.dtype(f"{m}.weight") != want or len(shape) != 2:
                    raise CheckpointError(
                        f"{d}: {f'{m}.weight'!r} is {raw.dtype(f'{m}.weight')} {list(shape)}; config group {group!r} "
                        f"({fmt}, {scheme.weights.type} {scheme.weights.num_bits} bits) is not read from it; {FIX}"
                    )
            self._check_scale(raw, m, group, scheme, shape)
            shapes[m] = shape
        return shapes

    def _check_scale(self, raw: ShardReader, m: str, group: str, scheme, shape: tuple[int, ...]) -> None:
        w = scheme.weights
        strategy = str(getattr(w.strategy, "value", w.strategy))
        out, inp = shape
        want = {
            "tensor": [(1,), ()],
            "channel": [(out, 1)],
            "group": [(out, math.ceil(inp / w.group_size))] if w.group_size else [],
            "block": [(math.ceil(out / w.block_structure[0]), math.ceil(inp / w.block_structure[1]))]
            if w.block_structure
            else [],
        }.get(strategy)
        s = f"{m}.weight_scale"
        got = tuple(raw.shape(s))
        if want is None:
            raise CheckpointError(
                f"{raw.directory}: config group {group!r} uses strategy {strategy!r}, not read; {FIX}"
            )
        if got not in want or not raw.torch_dtype(s).is_floating_point:
            raise CheckpointError(
                f"{raw.directory}: {s!r} is {raw.dtype(s)} {list(got)}, expected a float scale of shape "
                f"{list(want[0]) if want else '?'} ({strategy} strategy, weight {list(shape)}); re-download the checkpoint"
            )

    # -- reading ---------------------------------------------------------------------------------
    def decode(self, name: str, entry: QEntry, raw: ShardReader, dtype: torch.dtype) -> torch.Tensor:
        _, scheme, _, compressor, _ = entry.info
        module = name.removesuffix(".weight")
        t = raw.get_many(entry.raw)
        local = {n[len(module) + 1 :]: v for n, v in t.items()}
        return compressor.decompress(local, scheme)["weight"].to(dtype)

    def without(self, qc: dict, modules: list[str]) -> dict:
        ignore = list(qc.get("ignore") or [])
        new = [f"re:^{re.escape(m)}\\..*" for m in modules]
        return {**qc, "ignore": [*ignore, *(p for p in new if p not in ignore)]}
