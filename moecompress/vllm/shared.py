"""A compressed shared expert in vLLM (DeepSeek-V2/V3's ``shared_experts``, Qwen2-MoE's ``shared_expert``).

vLLM builds a shared expert as an MLP of two linear layers, ``gate_up_proj`` (gate and up, merged) then
``down_proj``, with its activation between them, and calls it itself (the MoE runner's ``SharedExperts``).
Its quantization method reaches those two linear layers only, so the shared expert is served through them:

- ``down_proj``'s method registers the layer's :class:`~moecompress.runtime.quantizer.CompressedShared`
  (the stored tensors, as parameters with a checking ``weight_loader``) as its submodule ``moecompress``;
  the checkpoint's ``<shared>.<proj>.<tensor>`` names are mapped there (:func:`shared_rename`). Not
  ``gate_up_proj``: the models' loaders rewrite any name containing ``up_proj``.
- after loading, the three projections are decoded once into dense weights in the activations' dtype
  (the gate/up rows of a ragged expert cut to its live width); ``gate_up_proj`` returns ``x @ [gate; up]ᵀ``,
  ``down_proj`` ``h @ downᵀ``. So vLLM serves the shared expert's values exactly, at a dense expert's
  memory plus its stored tensors (kept: weight tracking covers them): one expert per layer.

Refused at load with one line (:func:`moecompress.io.servability.shared_refusal`): a shared expert with an
online rotation or quantised activations (the dense weights would need them folded in), biases, or an
activation other than SwiGLU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearMethodBase

from moecompress.runtime.quantizer import CompressedShared
from moecompress.vllm.params import frozen_parameters

ATTR = "moecompress"


@dataclass
class SharedSlot:
    """One layer's shared expert, between its two linear layers' methods."""

    desc: dict[str, Any]
    hidden: int
    field: str
    module: CompressedShared | None = None
    dtype: torch.dtype = torch.float32  # vLLM's params_dtype, the activations'
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    def decode(self) -> None:
        """The dense ``gate_up`` ``[2w, H]`` and ``down`` ``[H, w]`` weights (``w``: the live width), once."""
        if self.weights:
            return
        bank, _ = self.module.bank()
        gate, up, down = (getattr(bank, p).dense()[0] for p in ("gate", "up", "down"))
        width = int(bank.widths[0]) if bank.widths is not None else gate.shape[0]
        self.weights["gate_up"] = torch.cat([gate[:width], up[:width]]).to(self.dtype).contiguous()
        self.weights["down"] = down[:, :width].to(self.dtype).contiguous()


def shared_rename(keys) -> dict[re.Pattern, str]:
    """Checkpoint names -> vLLM's: ``<key>.<tensor>`` -> ``<key>.down_proj.moecompress.<tensor>`` for each
    layer's shared-expert key prefix (``adapter.shared_key``), the stock ``*_proj.weight`` names excluded."""
    return {
        re.compile(rf"^{re.escape(key)}\.(?!(?:gate_proj|up_proj|down_proj|gate_up_proj)\.)"): rf"{key}.down_proj.{ATTR}."
        for key in keys
    }  # fmt: skip


class SharedLinearMethod(LinearMethodBase):
    """``gate_up_proj`` (``role="gate_up"``) or ``down_proj`` (``role="down"``) of a compressed shared expert."""

    def __init__(self, slot: SharedSlot, role: str) -> None:
        self.slot, self.role = slot, role

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):  # fmt: skip
        if self.role != "down":
            return
        module = CompressedShared(self.slot.desc, self.slot.hidden, self.slot.field)
        frozen_parameters(module, layer.prefix if hasattr(layer, "prefix") else self.slot.field, self.slot.field)
        layer.add_module(ATTR, module)
        self.slot.module, self.slot.dtype = module, params_dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Decode the three projections once (whichever of the two layers comes first) and keep this layer's
        dense weight as a buffer of its own (what compiled graphs read)."""
        self.slot.decode()
        layer.register_buffer(f"{ATTR}_weight", self.slot.weights[self.role], persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, getattr(layer, f"{ATTR}_weight").to(x.dtype))
