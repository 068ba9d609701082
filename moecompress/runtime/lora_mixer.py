"""Routed LoRA adapters on attention projections (LoRA-Mixer, METHODS.md §10), as the runtime loads them.

:class:`RoutedLoRALinear` wraps one ``nn.Linear`` ``W`` of a loaded model (module composition on the
instance: the wrapper replaces the attribute, transformers' classes are not touched):

    y = W x + s · Σ_{e ∈ topK(R x)} g_e(x) · B_e A_e x,   g = softmax over the top-K router logits

with ``E`` LoRA experts ``A [E, r, in]``, ``B [E, out, r]``, a router ``R [E, in]`` and ``s = α / r``.
A token uses ``K`` of the ``E`` experts (sparse fusion), so the delta depends on the input and cannot
be merged into ``W``: the adapters are stored beside the checkpoint and wrapped in at load time.

Storage (written by the ``lora_heal`` stage with ``target: attention_routed``):
``config.json`` holds a block ``"moecompress_adapters": {"kind": "lora_mixer", "file":
"adapters/lora_mixer.safetensors", "experts": E, "top_k": K, "rank": r, "scale": s, "modules": [...]}``
and the file holds ``<module>.router``, ``<module>.lora_a``, ``<module>.lora_b`` per wrapped module
(float32). :func:`attach_adapters` is what :func:`moecompress.load` calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from moecompress.errors import CheckpointError
from moecompress.methods.lora import load_balance_loss

CONFIG_KEY = "moecompress_adapters"
FILE = "adapters/lora_mixer.safetensors"
KIND = "lora_mixer"
PARTS = ("router", "lora_a", "lora_b")


class RoutedLoRALinear(nn.Module):
    """``base(x)`` plus the top-K routed sum of ``E`` LoRA experts (see the module docstring)."""

    def __init__(self, base: nn.Linear, experts: int, rank: int, top_k: int, scale: float) -> None:
        super().__init__()
        self.base, self.top_k, self.scale = base, top_k, float(scale)
        out_f, in_f = base.weight.shape
        dev = base.weight.device
        self.router = nn.Parameter(torch.zeros(experts, in_f, device=dev), requires_grad=False)
        self.lora_a = nn.Parameter(torch.zeros(experts, rank, in_f, device=dev), requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(experts, out_f, rank, device=dev), requires_grad=False)
        self.track_balance = False
        """Training: each forward leaves the router's load-balancing term in :attr:`balance`."""
        self.balance: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:  # transformers code may read ``proj.weight`` (dtype, device)
        return self.base.weight

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., E]``: the softmax of the top-K router logits, zero on the other experts."""
        logits = x @ self.router.to(x.dtype).T
        top = logits.topk(self.top_k, dim=-1)
        if self.track_balance:
            self.balance = load_balance_loss(logits, top.indices)
        return torch.zeros_like(logits).scatter(-1, top.indices, top.values.softmax(dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        z = torch.einsum("...i,eri->...er", x, self.lora_a.to(x.dtype)) * self.gates(x).unsqueeze(-1)
        delta = torch.einsum("...er,eor->...o", z, self.lora_b.to(x.dtype))
        return y + (self.scale * delta).to(y.dtype)


def resolve(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """``(parent module, attribute)`` of the submodule called ``name``."""
    *path, attr = name.split(".")
    parent = model
    for part in path:
        parent = getattr(parent, part, None)
        if parent is None:
            raise CheckpointError(f"adapter module {name!r}: the model has no submodule {part!r}")
    return parent, attr


def wrap(model: nn.Module, name: str, experts: int, rank: int, top_k: int, scale: float) -> RoutedLoRALinear:
    """Replace the ``nn.Linear`` called ``name`` by a :class:`RoutedLoRALinear` around it (zero delta)."""
    parent, attr = resolve(model, name)
    base = getattr(parent, attr, None)
    if not isinstance(base, nn.Linear):
        raise CheckpointError(f"adapter module {name!r} is {type(base).__name__}, not a linear projection")
    mod = RoutedLoRALinear(base, experts, rank, top_k, scale)
    setattr(parent, attr, mod)
    return mod


def attach_adapters(model: nn.Module, directory: str | Path) -> int:
    """Wrap the projections the checkpoint's adapter block names and load their tensors; returns how
    many were wrapped (0: the checkpoint has no adapters)."""
    directory = Path(directory)
    block = json.loads((directory / "config.json").read_text()).get(CONFIG_KEY)
    if block is None:
        return 0
    where = f"{directory / 'config.json'}: {CONFIG_KEY}"
    try:
        if block["kind"] != KIND:
            raise CheckpointError(f"{where}: kind {block['kind']!r} is not {KIND!r}")
        experts, rank, top_k = int(block["experts"]), int(block["rank"]), int(block["top_k"])
        scale, modules, file = float(block["scale"]), list(block["modules"]), str(block["file"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: malformed block ({err!r})") from None
    path = (directory / file).resolve()
    if directory.resolve() not in path.parents or not path.is_file():
        raise CheckpointError(f"{where}: adapter file {file!r} is missing from the checkpoint (a step after "
                              "lora_heal target: attention_routed drops it; put that step last)")  # fmt: skip
    tensors = load_file(str(path))
    for name in modules:
        mod = wrap(model, name, experts, rank, top_k, scale)
        with torch.no_grad():
            for part in PARTS:
                key = f"{name}.{part}"
                t = tensors.get(key)
                own = getattr(mod, part)
                if t is None or t.shape != own.shape:
                    got = "missing" if t is None else f"shape {list(t.shape)}"
                    raise CheckpointError(f"{path}: {key} is {got}, expected {list(own.shape)}")
                own.copy_(t)
    return len(modules)
