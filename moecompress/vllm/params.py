"""Stored tensors as vLLM parameters: shared by the MoE method (:mod:`moecompress.vllm.plugin`) and the
shared-expert method (:mod:`moecompress.vllm.shared`). Imports no vLLM."""

from __future__ import annotations

import torch
from torch import nn

from moecompress.errors import CheckpointError


def frozen_parameters(module: nn.Module, where: str, field: str) -> dict[str, nn.Parameter]:
    """Materialise ``module`` (built on the meta device) where vLLM builds the model, turn its integer
    buffers into frozen parameters (so that weight tracking covers them), give each parameter the
    ``weight_loader`` a model's own loader calls (``moecompress.vllm.plugin.OWN_LOADERS``); returns them by local name."""
    device = torch.get_default_device()
    module.to_empty(device=device if device.type != "meta" else "cpu")
    for sub in module.modules():
        for name in list(sub._buffers):
            t = sub._buffers.pop(name)
            sub.register_parameter(name, nn.Parameter(t, requires_grad=False))
        for p in sub._parameters.values():
            p.requires_grad_(False)
    own = dict(module.named_parameters())
    for name, param in own.items():
        param.weight_loader = _checked_copy(f"{where}.{name}", field)
    return own


def _checked_copy(where: str, field: str):
    """A parameter's ``weight_loader``: copy the stored tensor in after checking its shape and dtype."""

    def load(param: nn.Parameter, w: torch.Tensor) -> None:
        if tuple(w.shape) != tuple(param.shape) or w.dtype != param.dtype:
            raise CheckpointError(
                f"{where}: stored {tuple(w.shape)} {w.dtype}, but {field} declares "
                f"{tuple(param.shape)} {param.dtype}; the output was edited or damaged: re-run the recipe"
            )
        param.data.copy_(w)

    return load
