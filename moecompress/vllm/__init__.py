"""vLLM plugin: serve moecompress-format outputs (``quant_method: "moecompress"``) with vLLM.

Installed with ``pip install moecompress[vllm]``; vLLM finds it through the ``vllm.general_plugins``
entry point (``moecompress = "moecompress.vllm:register"``) and calls :func:`register` in every process
it starts. Importing ``moecompress`` (or this package) never imports vLLM: only :func:`register` and
:mod:`moecompress.vllm.plugin` do.

What it does (``docs/serving.md``, "vLLM"): the config of ``quant_method: "moecompress"`` reads the
output's ``moecompress`` block from the model's ``config.json`` (and checks the shards' headers with
:mod:`moecompress.io.verify`), gives every linear layer vLLM's ``UnquantizedLinearMethod``, stock MoE
layers vLLM's own ``UnquantizedFusedMoEMethod`` and every described MoE layer one
:class:`~moecompress.vllm.plugin.MoecompressMoEMethod`, whose ``apply`` runs the layer's
:class:`~moecompress.runtime.quantizer.CompressedExperts` (the same dispatch as transformers: the lean
CPU path, Triton kernels on CUDA) behind an opaque custom op ``torch.ops.moecompress.vllm_experts``, so
that vLLM's Dynamo compilation of the CPU build does not trace its data-dependent loop.
"""

from __future__ import annotations

METHOD = "moecompress"  # the same as moecompress.runtime.quantizer.METHOD (not imported: no torch here)


def register() -> None:
    """Register ``quant_method: "moecompress"`` with vLLM (idempotent; the entry point's target)."""
    from moecompress.vllm.plugin import register as _register

    _register()


__all__ = ["METHOD", "register"]
