"""Loading moecompress-format checkpoints through transformers' public quantizer hooks.

``import moecompress`` registers ``quant_method: "moecompress"`` with
``transformers.quantizers.register_quantization_config`` / ``register_quantizer``. When
``AutoModelForCausalLM.from_pretrained`` meets such a checkpoint, it builds the stock model on the
meta device and calls :meth:`MoecompressQuantizer._process_model_before_weight_loading`, which swaps
each described layer's experts module *instance* for a :class:`CompressedExperts` (and a compressed
shared expert's for a :class:`CompressedShared`) whose parameters and buffers are exactly the stored
tensors (``docs/format.md``); transformers then loads them by name. The router, attention and dense
shared experts stay transformers' own modules. No class is patched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from moecompress.errors import CheckpointError
from moecompress.io.format import FORMAT_VERSION, PROJ, decode_bank
from moecompress.layouts import LAYOUTS
from moecompress.reference import expert_forward, experts_forward

METHOD = "moecompress"

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


class CompressedExperts(nn.Module):
    """Routed experts stored in a moecompress layout; called like transformers' experts modules:
    ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``."""

    def __init__(self, desc: dict[str, Any], hidden_size: int) -> None:
        super().__init__()
        self.desc = desc
        e = int(desc["num_experts"])
        for name in PROJ:
            meta = desc["experts"][name]
            if meta.get("kind") not in LAYOUTS:
                raise CheckpointError(f"unknown layout kind {meta.get('kind')!r}; known: {sorted(LAYOUTS)}")
            sub = nn.Module()
            for key, shape in _tensor_shapes(meta).items():
                dtype = _DTYPES.get(
                    meta.get("dtypes", {}).get(key, meta.get("dtype", "float32")), torch.float32
                )
                t = torch.empty(shape, dtype=dtype, device="meta")
                if dtype.is_floating_point:
                    sub.register_parameter(key, nn.Parameter(t, requires_grad=False))
                else:
                    sub.register_buffer(key, t)
            self.add_module(name, sub)
        width = int(desc["experts"]["gate"]["shape"][1])
        for b in desc.get("biases", []):
            n = hidden_size if b == "down" else width
            self.register_parameter(
                f"{b}_bias", nn.Parameter(torch.empty(e, n, device="meta"), requires_grad=False)
            )
        if desc.get("widths"):
            self.register_buffer("widths", torch.empty(e, dtype=torch.int32, device="meta"))
        if desc.get("rotation"):
            dtype = _DTYPES.get(str(desc["rotation"]), torch.float32)
            t = torch.empty(hidden_size, hidden_size, dtype=dtype, device="meta")
            self.register_parameter("rotation", nn.Parameter(t, requires_grad=False))
        if desc.get("expert_map"):
            n_logical = int(desc.get("num_logical_experts", e))
            self.register_buffer("expert_map", torch.empty(n_logical, dtype=torch.int64, device="meta"))

    def bank(self):
        tensors = {f"x.{k}": v for k, v in self.state_dict(keep_vars=True).items()}
        return decode_bank(self.desc, tensors, "x")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        bank, expert_map = self.bank()
        out = experts_forward(bank, hidden_states, top_k_index, top_k_weights, expert_map)
        return out.to(hidden_states.dtype)


class CompressedShared(CompressedExperts):
    """A shared expert stored in a moecompress layout; called like transformers' shared-expert MLPs:
    ``shared(hidden_states [..., H]) -> [..., H]`` (any gate, e.g. Qwen2-MoE's, stays outside)."""

    def forward(self, hidden_states: torch.Tensor):  # type: ignore[override]
        bank, _ = self.bank()
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return expert_forward(bank, 0, x).reshape(hidden_states.shape).to(hidden_states.dtype)


def _tensor_shapes(meta: dict[str, Any]) -> dict[str, list[int]]:
    shapes = meta.get("tensor_shapes")
    if shapes:
        return {k: list(v) for k, v in shapes.items()}
    if meta.get("kind") == "dense":
        return {"weight": list(meta["shape"])}
    raise CheckpointError(f"layout {meta.get('kind')!r} description lacks tensor_shapes")


class MoecompressConfig(QuantizationConfigMixin):
    """``quantization_config`` of moecompress-format checkpoints (layouts live in ``config.moecompress``)."""

    def __init__(self, format: int = FORMAT_VERSION, **kwargs: Any) -> None:
        self.quant_method = METHOD
        self.format = int(format)
        if self.format > FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint format {self.format} is newer than this moecompress understands ({FORMAT_VERSION}); "
                "upgrade moecompress"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": METHOD, "format": self.format}


class MoecompressQuantizer(HfQuantizer):
    """Swaps experts modules for :class:`CompressedExperts` before transformers loads the weights."""

    requires_calibration = False

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _process_model_before_weight_loading(self, model, **kwargs: Any):
        from moecompress.adapters import adapter_class

        config = model.config
        block = getattr(config, "moecompress", None) or {}
        adapter = adapter_class(config.model_type)(config)
        for i, desc in (block.get("layers") or {}).items():
            layer = model.model.layers[int(i)]
            moe = getattr(layer, adapter.module_attr)
            moe.experts = CompressedExperts(desc, int(config.hidden_size))
            if "shared" in desc:
                setattr(moe, adapter.shared_name, CompressedShared(desc["shared"], int(config.hidden_size)))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs: Any) -> bool:
        return False

    @property
    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Register the config and quantizer with transformers (idempotent)."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(MoecompressConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(MoecompressQuantizer)
