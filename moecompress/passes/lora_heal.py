"""``lora_heal``: heal a compressed model with LoRA adapters trained with the ``distill`` losses
(METHODS.md §10; a whole-model stage, ``docs/training.md``; no calibration statistics). ``target``:

- ``experts`` (default): per-expert LoRA on the compressed experts, ``ΔW_e = (α/r)·B_e A_e``, merged
  back into the stored tensors exactly (dense and ragged experts only; the dry run refuses others);
- ``attention_routed`` (LoRA-Mixer): ``lora_experts`` LoRA experts per attention projection
  (``lora_modules``) and a router picking ``lora_top_k`` of them per token,
  ``y = W x + (α/r)·Σ_{e∈topK} softmax(R x)_e B_e A_e x``; input-dependent, so stored as adapters
  (``adapters/lora_mixer.safetensors`` + a ``config.json`` block) that ``moecompress.load`` wraps in;
- ``attention``: the baseline, one plain LoRA per projection at equal trainable parameters
  (``r' = round((E·r·(in+out) + E·in)/(in+out))``), merged into the weights: a stock output.

``B = 0`` at the start, so the first forward is the compressed model's, bit for bit. Any expert
layout works with the attention targets. Example step::

    - lora_heal: {method: kd, target: attention_routed, lora_experts: 4, lora_top_k: 2, lora_rank: 8, lr: auto}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from moecompress.engine.spec import PassSpec
from moecompress.passes.distill import STAGE, DistillConfig, check


class LoraHealConfig(DistillConfig):
    trainable: Literal["lora"] = Field("lora", description="always lora (target says where)")


def lora_heal(layer, stats, cfg: LoraHealConfig):
    """Heal the compressed model with LoRA adapters (experts, routed attention or plain attention): a
    whole-model stage."""
    from moecompress.passes.distill import distill

    return distill(layer, stats, cfg)


SPEC = PassSpec("lora_heal", LoraHealConfig, lora_heal, check=check, stage=STAGE, alters=frozenset())
