"""LoRA on the attention projections for ``lora_heal`` (``target: attention_routed | attention``).

``attention_routed`` (LoRA-Mixer, METHODS.md §10): each targeted projection ``W`` of every decoder
layer's attention becomes a :class:`~moecompress.runtime.lora_mixer.RoutedLoRALinear` with
``lora_experts`` LoRA experts of rank ``lora_rank`` and a router choosing ``lora_top_k`` of them per
token. Trainable per projection: ``E·r·(in + out) + E·in``. Stored as adapters (not mergeable).

``attention`` (the baseline): one plain LoRA ``W + (α/r')·B A`` per projection, at **equal trainable
parameters**: ``r' = round((E·r·(in + out) + E·in) / (in + out))`` (:func:`equal_rank`; the
difference is below ``(in + out) / 2`` per projection). Merged into ``W`` on writing, so the output
is a stock checkpoint; the training forward rounds the merged weight to its stored dtype (what is
written is what trained).

Initialisation (seeded, per module): ``A ~ N(0, 1/in)``, router ``~ N(0, 1/in)``, ``B = 0``, so the
initial output is bit-identical to the base model's. Only the paper's parts that apply to healing
are implemented: soft top-K routing trained end to end with the distill losses; its domain-label
hard routing, ``L_preserve`` and the router loss RSL (whose entropy sign the guide flags) are not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moecompress.errors import PassError
from moecompress.runtime.lora_mixer import (
    CONFIG_KEY,
    FILE,
    KIND,
    PARTS,
    RoutedLoRALinear,
    attach_adapters,
    wrap,
)


def equal_rank(experts: int, rank: int, in_f: int, out_f: int) -> int:
    """The plain LoRA rank whose ``r'·(in + out)`` parameters are nearest to a routed projection's."""
    routed = experts * rank * (in_f + out_f) + experts * in_f
    return max(1, round(routed / (in_f + out_f)))


class PlainLoRALinear(nn.Module):
    """``F.linear(x, W + s·B A, bias)``, the merged weight rounded to ``W``'s dtype (straight through)."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, stored: torch.dtype) -> None:
        super().__init__()
        self.base, self.scale, self.stored = base, float(scale), stored
        out_f, in_f = base.weight.shape
        dev = base.weight.device
        self.lora_a = nn.Parameter(torch.zeros(rank, in_f, device=dev), requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(out_f, rank, device=dev), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def merged(self) -> torch.Tensor:
        w = self.base.weight + self.scale * (self.lora_b @ self.lora_a)
        return w if self.stored == w.dtype else w.to(self.stored).to(w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.merged(), self.base.bias)


def targets(model: nn.Module, modules: tuple[str, ...]) -> list[str]:
    """Names of the targeted linear projections of every decoder layer's attention, in layer order."""
    out = []
    for i, layer in enumerate(model.model.layers):
        attr = next((a for a in ("self_attn", "attention", "attn") if hasattr(layer, a)), None)
        attn = getattr(layer, attr) if attr is not None else None
        for m in modules:
            if attn is None or not isinstance(getattr(attn, m, None), nn.Linear):
                raise PassError(f"lora_heal: field 'lora_modules': decoder layer {i} has no linear attention "
                                f"projection {m!r}; name the attention's projections (e.g. q_proj, o_proj)")  # fmt: skip
            out.append(f"model.layers.{i}.{attr}.{m}")
    return out


def attach(model: nn.Module, cfg, stored: dict[str, torch.dtype]) -> tuple[dict[str, nn.Module], list[nn.Parameter]]:
    """Wrap the targeted projections (``cfg.target``); returns ``(wrappers by name, their parameters)``.
    ``stored``: each projection weight's stored dtype, by its state-dict name."""
    mods: dict[str, nn.Module] = {}
    for j, name in enumerate(targets(model, tuple(cfg.lora_modules))):
        base = model.get_submodule(name)
        out_f, in_f = base.weight.shape
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed * 100003 + j)
            a = torch.randn(cfg.lora_experts, cfg.lora_rank, in_f) / math.sqrt(in_f)
            router = torch.randn(cfg.lora_experts, in_f) / math.sqrt(in_f)
            if cfg.target == "attention_routed":
                mod = wrap(model, name, cfg.lora_experts, cfg.lora_rank, cfg.lora_top_k, cfg.lora_alpha / cfg.lora_rank)
                with torch.no_grad():
                    mod.lora_a.copy_(a)
                    mod.router.copy_(router)
            else:
                r = equal_rank(cfg.lora_experts, cfg.lora_rank, in_f, out_f)
                mod = PlainLoRALinear(base, r, cfg.lora_alpha / r, stored.get(name + ".weight", base.weight.dtype))
                with torch.no_grad():
                    mod.lora_a.copy_(torch.randn(r, in_f) / math.sqrt(in_f))
                parent, attr = name.rsplit(".", 1)
                setattr(model.get_submodule(parent), attr, mod)
        mods[name] = mod
    params = [p for m in mods.values() for n, p in m.named_parameters() if not n.startswith("base.")]
    return mods, params


def merged_weights(mods: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """``target: attention``: the merged projection weights by their state-dict name (written stock)."""
    return {f"{n}.weight": m.merged().detach() for n, m in mods.items() if isinstance(m, PlainLoRALinear)}


def stored_adapters(model: nn.Module, ckpt) -> tuple[dict[str, RoutedLoRALinear], dict | None]:
    """The routed adapters ``ckpt`` already stores (an earlier ``lora_heal`` with ``target:
    attention_routed``), wrapped into ``model`` as :func:`moecompress.load` does, so the training
    forward is the loaded model's; ``(wrappers by name, the config block)``, ``({}, None)`` without."""
    if not isinstance(ckpt.raw_config.get(CONFIG_KEY), dict):
        return {}, None
    attach_adapters(model, ckpt.path)
    block = ckpt.raw_config[CONFIG_KEY]
    return {n: model.get_submodule(n) for n in block["modules"]}, dict(block)


def adapter_parameters(mods: dict[str, nn.Module]) -> list[nn.Parameter]:
    """The trainable tensors of attention wrappers (never the wrapped base projection)."""
    return [p for m in mods.values() for n, p in m.named_parameters() if not n.startswith("base.")]


def checkpoint_names(trained: dict[str, torch.Tensor], mods: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Model parameter names -> checkpoint keys: a wrapper's ``<name>.base.weight`` is the checkpoint's
    ``<name>.weight``; the wrappers' own tensors are not checkpoint keys (written as adapters)."""
    out = {}
    for k, v in trained.items():
        owner = next((n for n in mods if k.startswith(n + ".")), None)
        if owner is None:
            out[k] = v
        elif k.startswith(owner + ".base."):
            out[owner + k[len(owner) + 5 :]] = v
    return out


def adapter_payload(mods: dict[str, nn.Module], cfg, block: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The routed adapters' tensors (float32) and the config block to store (``block``: the stored one
    of adapters the checkpoint already had; else built from ``cfg``)."""
    tensors = {f"{n}.{p}": getattr(m, p).detach().float().cpu().contiguous() for n, m in mods.items()
               if isinstance(m, RoutedLoRALinear) for p in PARTS}  # fmt: skip
    if block is None:
        block = {"kind": KIND, "file": FILE, "experts": cfg.lora_experts, "top_k": cfg.lora_top_k,
                 "rank": cfg.lora_rank, "scale": cfg.lora_alpha / cfg.lora_rank, "modules": list(mods)}  # fmt: skip
    return tensors, {CONFIG_KEY: block}
