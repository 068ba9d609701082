"""Test-side alias of :mod:`moecompress.testing` (tiny checkpoints from transformers' classes)."""

from moecompress.testing import (
    COMMON,
    MODEL_TYPES,
    TINY,
    reference_logits,
    save_tiny,
    tiny_config,
    tiny_model,
)

__all__ = ["COMMON", "MODEL_TYPES", "TINY", "reference_logits", "save_tiny", "tiny_config", "tiny_model"]
