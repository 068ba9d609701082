"""GPT-OSS: experts are fused on disk in ``x @ W`` orientation with *interleaved* gate/up columns:
``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (gate = columns 0::2, up = 1::2) with
``gate_up_proj_bias`` ``[E, 2I]``, ``mlp.experts.down_proj`` ``[E, I, H]`` with ``down_proj_bias``
``[E, H]``; router ``mlp.router.weight`` + ``mlp.router.bias``. Routing: top-k of the logits, softmax
over the k. Activation: clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``). The released MXFP4
checkpoints (``*_blocks``/``*_scales``, ``quant_method: mxfp4``) are read through
:mod:`moecompress.io.quantized_mxfp4`, which presents exactly these bf16 names and shapes."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moecompress.adapters.base import Adapter, Alloc, Fetch, Rows, dense3, filled, require_stock
from moecompress.errors import LayoutError
from moecompress.ir import Act, ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense

GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss reference implementation


class GptOssAdapter(Adapter):
    model_type = "gpt_oss"
    count_key = "num_local_experts"
    router_module = "router"
    width_key = "intermediate_size"
    module_returns_tuple = True

    def router_spec(self, num_experts: int | None = None) -> RouterSpec:
        return RouterSpec(
            num_experts=num_experts or self.num_experts,
            top_k=int(self.config.num_experts_per_tok),
            gating=Gating.TOPK_SOFTMAX,
        )

    def _p(self, i: int) -> str:
        return f"{self.layer_prefix(i)}mlp"

    def expected_tensors(self, i: int, keys: Iterable[str]) -> tuple[str, dict[str, tuple[int, ...]]]:
        e, n, h, p = self.num_experts, self.expert_width, self.hidden_size, self._p(i)
        return p + ".", {
            f"{p}.router.weight": (e, h),
            f"{p}.router.bias": (e,),
            f"{p}.experts.gate_up_proj": (e, h, 2 * n),
            f"{p}.experts.gate_up_proj_bias": (e, 2 * n),
            f"{p}.experts.down_proj": (e, n, h),
            f"{p}.experts.down_proj_bias": (e, h),
        }

    def router_keys(self, i: int, fmt: str = "hub", *, shared: bool = True) -> list[str]:
        return [f"{self._p(i)}.router.weight", f"{self._p(i)}.router.bias"]

    def router_part(self, i: int, t: dict[str, torch.Tensor], fmt: str = "hub", *, shared: bool = True) -> dict:
        weight = t.pop(f"{self._p(i)}.router.weight")
        return {
            "router": self.router_spec(num_experts=weight.shape[0]),
            "router_weight": weight,
            "router_bias": t.pop(f"{self._p(i)}.router.bias"),
        }

    def build_layer(self, i: int, get: Fetch, fmt: str) -> MoELayer:
        bank = self.build_experts(i, get, lambda name, a, b: get([name])[name][a:b], fmt, 0, self.num_experts)
        return MoELayer(index=i, experts=bank, **self.router_part(i, get(self.router_keys(i))))

    def build_experts(
        self, i: int, get: Fetch, rows: Rows, fmt: str, start: int, stop: int, alloc: Alloc | None = None
    ) -> ExpertBank:
        p = self._p(i)
        gu = rows(f"{p}.experts.gate_up_proj", start, stop)
        gu_b = rows(f"{p}.experts.gate_up_proj_bias", start, stop)
        gate, up = filled(alloc, "gate", gu[..., 0::2].transpose(1, 2)), filled(alloc, "up", gu[..., 1::2].transpose(1, 2))
        del gu
        return ExpertBank(
            gate=Dense(gate),
            up=Dense(up),
            down=Dense(filled(alloc, "down", rows(f"{p}.experts.down_proj", start, stop).transpose(1, 2))),
            biases={
                "gate": gu_b[:, 0::2].contiguous(),
                "up": gu_b[:, 1::2].contiguous(),
                "down": rows(f"{p}.experts.down_proj_bias", start, stop),
            },
            act=Act.SWIGLU_CLAMPED,
            # transformers before 5.2x had no config fields and used gpt-oss' published constants
            alpha=float(getattr(self.config, "swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)),
            limit=float(getattr(self.config, "swiglu_limit", GPT_OSS_SWIGLU_LIMIT)),
        )

    def router_tensors(
        self, layer: MoELayer, *, fused: bool = False, shared: bool = True
    ) -> dict[str, torch.Tensor]:
        p = self._p(layer.index)
        if layer.router_bias is None:
            raise LayoutError(f"gpt_oss layer {layer.index}: the router bias is required")
        return {f"{p}.router.weight": layer.router_weight, f"{p}.router.bias": layer.router_bias}

    def layer_tensors(self, layer: MoELayer, *, fused: bool = False) -> dict[str, torch.Tensor]:
        # GPT-OSS's original format *is* fused, so ``fused`` changes nothing.
        require_stock(layer, self.model_type)
        bank, p = layer.experts, self._p(layer.index)
        if layer.router_bias is None or set(bank.biases) != {"gate", "up", "down"}:
            raise LayoutError(
                f"gpt_oss layer {layer.index}: router bias and gate/up/down biases are required"
            )
        gate = dense3(bank.gate, f"layer {layer.index} gate")
        up = dense3(bank.up, f"layer {layer.index} up")
        e, n, h = gate.shape
        gu = gate.new_empty(e, h, 2 * n)
        gu[..., 0::2] = gate.transpose(1, 2)
        gu[..., 1::2] = up.transpose(1, 2)
        gu_b = bank.biases["gate"].new_empty(e, 2 * n)
        gu_b[:, 0::2] = bank.biases["gate"]
        gu_b[:, 1::2] = bank.biases["up"]
        return {
            f"{p}.router.weight": layer.router_weight,
            f"{p}.router.bias": layer.router_bias,
            f"{p}.experts.gate_up_proj": gu,
            f"{p}.experts.gate_up_proj_bias": gu_b,
            f"{p}.experts.down_proj": dense3(bank.down, f"layer {layer.index} down")
            .transpose(1, 2)
            .contiguous(),
            f"{p}.experts.down_proj_bias": bank.biases["down"],
        }
