"""``lora_heal``: heal a compressed model with per-expert LoRA adapters on its compressed experts
(LoRA-Mixer-style healing, METHODS.md §10), trained with the ``distill`` losses and merged back into
the stored tensors — exactly, since only dense and ragged experts are accepted (the dry run refuses
other layouts). A whole-model stage (``docs/training.md``); no calibration statistics.

Example step::

    - lora_heal: {method: kd, lora_rank: 8, steps: 200, lr: 1.0e-3}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from moecompress.engine.spec import PassSpec
from moecompress.passes.distill import STAGE, DistillConfig, check


class LoraHealConfig(DistillConfig):
    trainable: Literal["lora"] = Field("lora", description="always lora: per-expert LoRA merged back")


def lora_heal(layer, stats, cfg: LoraHealConfig):
    """Heal the compressed experts with merged per-expert LoRA adapters: a whole-model stage."""
    from moecompress.passes.distill import distill

    return distill(layer, stats, cfg)


SPEC = PassSpec("lora_heal", LoraHealConfig, lora_heal, check=check, stage=STAGE)
