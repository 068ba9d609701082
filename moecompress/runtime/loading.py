"""``moecompress.load``: a transformers model from any checkpoint moecompress writes.

Stock checkpoints load with plain transformers; compressed ones through the ``moecompress``
quantizer that importing this package registers with transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moecompress.errors import CheckpointError


def load(path: str | Path, *, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"):
    """Load ``path`` (directory or Hub id) as a ``transformers`` causal LM in eval mode."""
    from transformers import AutoModelForCausalLM

    from moecompress.io.hub import resolve_checkpoint_dir

    directory = resolve_checkpoint_dir(path)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json; pass a checkpoint directory")
    kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype) if isinstance(dtype, str) else dtype}
    model = AutoModelForCausalLM.from_pretrained(str(directory), trust_remote_code=False, **kwargs)
    return model.to(device).eval()
