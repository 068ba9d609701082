"""Architecture adapters, one file per ``model_type``; see :mod:`moecompress.adapters.base`.

An unknown ``model_type`` is an error, never a guess from substrings.
"""

from __future__ import annotations

from moecompress.adapters.base import Adapter, PerExpertAdapter
from moecompress.adapters.deepseek_v2 import DeepseekV2Adapter
from moecompress.adapters.deepseek_v3 import DeepseekV3Adapter
from moecompress.adapters.gpt_oss import GptOssAdapter
from moecompress.adapters.mixtral import MixtralAdapter
from moecompress.adapters.olmoe import OlmoeAdapter
from moecompress.adapters.phimoe import PhimoeAdapter
from moecompress.adapters.qwen2_moe import Qwen2MoeAdapter
from moecompress.adapters.qwen3_moe import Qwen3MoeAdapter
from moecompress.errors import AdapterError

ADAPTERS: dict[str, type[Adapter]] = {
    cls.model_type: cls
    for cls in (
        MixtralAdapter,
        Qwen2MoeAdapter,
        Qwen3MoeAdapter,
        OlmoeAdapter,
        DeepseekV2Adapter,
        DeepseekV3Adapter,
        GptOssAdapter,
        PhimoeAdapter,
    )
}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_class(model_type: str | None) -> type[Adapter]:
    if model_type not in ADAPTERS:
        raise AdapterError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return ADAPTERS[model_type]


__all__ = ["ADAPTERS", "Adapter", "PerExpertAdapter", "adapter_class", "supported_model_types"]
