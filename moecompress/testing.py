"""Tiny random MoE checkpoints built with transformers' own model classes (seconds, no download).

Used by the tests, the benchmarks and the README quickstart::

    from moecompress.testing import save_tiny
    save_tiny("qwen3_moe", "tiny-qwen3moe")      # any of MODEL_TYPES

Every parameter and buffer is re-drawn so that no expert, bias or router row is degenerate (the
default initialisation leaves some at zero, which would hide routing bugs behind ties).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

COMMON = dict(
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# One config per adapter; each exercises that architecture's quirks.
TINY: dict[str, dict] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True
    ),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "deepseek_v2": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_shared_experts=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=16),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.05),
}
MODEL_TYPES = sorted(TINY)

VLLM_TINY = {
    "deepseek_v2": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_key_value_heads": 4},
    "deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_key_value_heads": 4,
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "qwen2_moe": {"num_attention_heads": 2},
    "olmoe": {"num_attention_heads": 2},
}  # fmt: skip
"""Overrides of :data:`TINY` for a tiny model that vLLM's CPU build runs (default: ``head_dim=32``; see
:func:`vllm_tiny`). vLLM's CPU attention has no kernel for head_dim 16 (the tiny default): head_dim 32, or
half the heads where the config derives it. Its CPU MLA decode kernel runs only kv_lora_rank 512 +
qk_rope_head_dim 64 (DeepSeek's real sizes). vLLM's DeepSeek-V3 routes as transformers' only with the real
config's ``topk_method`` and ``scoring_func``."""


def vllm_tiny(model_type: str) -> dict:
    """:data:`VLLM_TINY`'s overrides for ``model_type`` (``max_position_embeddings`` 256 included)."""
    return {"max_position_embeddings": 256, **VLLM_TINY.get(model_type, {"head_dim": 32})}


def vllm_engine_args(config: dict) -> dict:
    """Extra ``vllm.LLM`` arguments for a model whose ``config.json`` is ``config`` on vLLM's CPU build: for
    DeepSeek's MLA the ``CPU_MLA`` backend (AMX MLA takes bfloat16 only) and PyTorch's rotary embedding
    (vLLM 0.32's CPU op is wrong on the ``[tokens, heads, dim]`` queries MLA passes, right on
    ``[tokens, heads * dim]``; ``docs/serving.md``)."""
    if "kv_lora_rank" not in config:
        return {}
    return {"attention_backend": "CPU_MLA", "compilation_config": {"custom_ops": ["-rotary_embedding"]}}


def tiny_config(model_type: str, **overrides):
    """A transformers config of ``model_type`` with tiny sizes; ``overrides`` replace any key."""
    if model_type not in TINY:
        raise ValueError(f"no tiny config for {model_type!r}; choose one of {MODEL_TYPES}")
    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(model_type, **{**COMMON, **TINY[model_type], **overrides})


def tiny_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised model whose every parameter and buffer is non-degenerate."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # routers get a larger scale so routing is decisive (no near-ties)
                scale = 0.5 if (".gate." in name or ".router." in name or "e_score" in name) else 0.08
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def save_tiny(
    model_type: str, path: str | Path, *, fused: bool = False, max_shard_size: str | None = None, **kw
):
    """Build :func:`tiny_model` and ``save_pretrained`` it (Hub key names unless ``fused``)."""
    model = tiny_model(model_type, **kw)
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, save_original_format=not fused, **extra)
    return model


def reference_logits(original: str | Path, ckpt_dir: str | Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of transformers' stock model of ``original`` with every MoE block replaced by the
    reference forward of the layer read back from ``ckpt_dir`` (the layer-wise oracle a compressed
    checkpoint loaded through the quantizer must match)."""
    from moecompress.calibration.skeleton import InstrumentedMoE
    from moecompress.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(ckpt_dir)
    model = AutoModelForCausalLM.from_pretrained(original).eval()
    for i in ckpt.moe_layer_indices:
        model.model.layers[i].mlp = InstrumentedMoE(ckpt.read_layer(i))
    with torch.no_grad():
        return model(ids).logits


def layer_statistics(layer, needs, *, tokens: int = 192, seed: int = 0, sample_tokens: int = 512) -> dict:
    """Every statistic in ``needs`` (plus the always-collected ones) of one MoE layer, computed by the
    real collector on random hidden states; gradient statistics use the loss ``‖MoE(x)‖² / 2T`` as a
    stand-in for the LM loss. For tests of passes without a calibration run."""
    from moecompress.calibration.catalogue import backward_needed
    from moecompress.calibration.stats import StatsCollector
    from moecompress.reference import moe_forward

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer.hidden_size, generator=g).to(layer.experts.gate.dtype)
    fwd = StatsCollector(layer, set(needs), sample_tokens)
    with torch.no_grad():
        for mode, part in (("stats", x[: 3 * tokens // 4]), ("holdout", x[3 * tokens // 4 :])):
            fwd.mode = mode
            fwd.on_input(part)
            fwd.on_output(moe_forward(layer, part, fwd))
    if "route_attrib" in needs:  # one layer as the whole stream: x is layer 0's input and its MoE input
        from moecompress.calibration.trace import RoutingTrace

        part = x[: 3 * tokens // 4]
        RoutingTrace().after_layer(0, [part], [part + moe_forward(layer, part)], [False], fwd)
    out = fwd.result()
    if "router_sample_base" in needs:  # one layer, no propagation: the base routing is router_sample
        out["router_sample_base"] = out["router_sample"].clone()
    if backward_needed(set(needs)):
        bwd = StatsCollector(layer, set(needs), sample_tokens)
        bwd.mode = "backward"
        xg = x[: 3 * tokens // 4].clone().requires_grad_(True)
        with torch.enable_grad():
            bwd.on_input(xg)
            y = moe_forward(layer, xg, bwd)
            bwd.on_output(y)
            (y.float().pow(2).sum() / (2 * len(xg))).backward()
        out.update({k: v for k, v in bwd.result().items() if k not in out})
    return out
