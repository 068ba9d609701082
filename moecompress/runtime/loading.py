"""``moecompress.load``: a transformers model from any checkpoint moecompress writes.

Stock checkpoints load with plain transformers; compressed ones through the ``moecompress``
quantizer that importing this package registers with transformers. Either way the checkpoint is
verified first (:func:`check_output`: ``config.json`` against the shard headers, no weight read), and
an MoE tensor that transformers still reports missing after loading is an error, never a randomly
initialised expert.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from moecompress.errors import CheckpointError

logger = logging.getLogger(__name__)


def load(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    routing: Any = None,
    dequantize: str | None = None,
    static: bool | None = None,
):
    """Load ``path`` (directory or Hub id) as a ``transformers`` causal LM in eval mode. ``routing``:
    ``None`` applies the routing policies the checkpoint stores, ``"off"`` none, a mapping such as
    ``{"capacity_drop": {"gamma": 1.0}}`` sets those knobs on every MoE layer
    (:func:`moecompress.runtime.routing.set_routing`). ``dequantize`` (``"float16"``, ``"bfloat16"``,
    ``"float32"``) trades memory for CPU speed: quantised experts (``codebook``, ``rtn``) are decoded once
    into dense weights of that dtype instead of per call (:func:`set_dequantize`). The compressed experts
    are prepared for serving on ``device`` before this returns (:func:`prepare`; ``static=True`` also
    builds the static-shape forward ``torch.compile`` then traces, ``docs/serving.md``)."""
    from transformers import AutoModelForCausalLM

    from moecompress.io.hub import resolve_checkpoint_dir
    from moecompress.runtime.routing import set_routing

    directory = resolve_checkpoint_dir(path)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json; pass a checkpoint directory")
    adapter = check_output(directory)
    kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype) if isinstance(dtype, str) else dtype}
    kwargs.update(hub_kernel_free(directory, torch.device(device), dequantize is not None))
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(directory), trust_remote_code=False, output_loading_info=True, **kwargs
        )
    except (ValueError, OSError, ImportError) as err:
        if "quantization_config" in kwargs or not _is_hub_kernel_error(err):
            raise
        # transformers could not fetch its MXFP4 hub kernel (offline, not cached): decode instead
        logger.warning("%s: the MXFP4 hub kernel is unavailable (%s); loading the experts dequantised", directory, err)
        kwargs.update(hub_kernel_free(directory, torch.device("cpu"), True))
        model, info = AutoModelForCausalLM.from_pretrained(
            str(directory), trust_remote_code=False, output_loading_info=True, **kwargs
        )
    if adapter is not None:
        refuse_missing(adapter, info.get("missing_keys", ()), directory)
    if "dtype" in kwargs:
        cast_compressed(model, kwargs["dtype"])
    from moecompress.runtime.lora_mixer import attach_adapters

    attach_adapters(model, directory)  # routed LoRA adapters (lora_heal target: attention_routed), if stored
    if routing is not None:
        set_routing(model, routing)
    if dequantize is not None:
        set_dequantize(model, dequantize)
    return prepare(model.to(device).eval(), static=static)


def prepare(model, *, static: bool | None = None):
    """Prepare every :class:`~moecompress.runtime.quantizer.CompressedExperts` of ``model`` for serving
    where its tensors are, once (:meth:`CompressedExperts.prepare`); ``static=True`` adds the static-shape
    forward (no host sync, traced by ``torch.compile``; quantised and factorised experts decoded to dense
    once), ``False`` leaves it out, ``None`` builds it only on CUDA where no Triton kernel serves the
    layer. Call it again after moving the model or changing stored tensors in place. Returns ``model``."""
    from moecompress.runtime.quantizer import CompressedExperts

    if static not in (None, True, False):
        raise ValueError(f"prepare: static={static!r}; pass True, False or None")
    for module in model.modules():
        if isinstance(module, CompressedExperts):
            module.prepare(static=static)
    return model


def hub_kernel_free(directory: Path, device: torch.device, dequantize: bool) -> dict[str, Any]:
    """``from_pretrained`` keywords that keep transformers from fetching Hub kernels it cannot use.

    transformers runs MXFP4 experts (gpt-oss) through the Hub kernel
    ``kernels-community/gpt-oss-triton-kernels``, which it downloads on first use: offline, or with the kernel
    not cached, loading fails. On a device other than CUDA (or when the caller asked for dequantised
    experts) the kernel buys nothing, so the experts are dequantised at load time with transformers' own
    ``Mxfp4Config(dequantize=True)``, the same values our reader gives. FP8 and compressed-tensors load on
    the CPU without Hub kernels and are left to transformers."""
    cfg = json.loads((directory / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "mxfp4" or (device.type == "cuda" and not dequantize):
        return {}
    from transformers import Mxfp4Config

    kept = {k: qc[k] for k in ("modules_to_not_convert",) if k in qc}
    return {"quantization_config": Mxfp4Config(dequantize=True, **kept)}


def _is_hub_kernel_error(err: Exception) -> bool:
    return "kernel" in str(err).lower()


def cast_compressed(model, dtype: torch.dtype) -> None:
    """Cast the floating tensors of every compressed experts module (rows, centroids, scales, factors,
    biases) to ``dtype``, as ``from_pretrained(dtype=)`` does for transformers' own weights and skips for
    quantizer modules; integer codes stay as stored. Without it a float32 model kept bfloat16 experts and
    its CUDA kernels computed in bfloat16."""
    from moecompress.runtime.quantizer import CompressedExperts

    for m in model.modules():
        if isinstance(m, CompressedExperts):
            m.to(dtype)


def set_dequantize(model, dtype: str | None) -> int:
    """Decode the quantised experts of every compressed block of ``model`` once into dense ``dtype``
    weights (``None``: back to decoding the hit experts per call); returns the number of blocks set.
    Memory: the decoded experts of every such layer, in ``dtype``, on top of the stored codes."""
    from moecompress.runtime.lean import DEQUANTIZE
    from moecompress.runtime.quantizer import CompressedExperts

    if dtype is not None and dtype not in DEQUANTIZE:
        raise CheckpointError(f"dequantize={dtype!r}: use one of {sorted(DEQUANTIZE)} or None")
    mods = [m for m in model.modules() if isinstance(m, CompressedExperts)]
    for m in mods:
        m.dense_dtype = None if dtype is None else DEQUANTIZE[dtype]
        m.__dict__.pop("_prepared", None)  # prepared again, in the new dtype, on the next call
    return len(mods)


def check_output(directory: Path):
    """Raise :class:`CheckpointError` (the first problem :func:`moecompress.io.verify.verify_checkpoint`
    finds) unless ``directory`` loads as its ``config.json`` says; returns the checkpoint's adapter, or
    ``None`` for a model type moecompress has no adapter for and did not write (left to transformers)."""
    from moecompress.adapters import ADAPTERS
    from moecompress.io.checkpoint import open_checkpoint
    from moecompress.io.verify import verify_checkpoint

    cfg_path = directory / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{cfg_path}: not readable JSON ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    qc = raw.get("quantization_config")
    quant_method = qc.get("quant_method") if isinstance(qc, dict) else None
    if raw.get("model_type") not in ADAPTERS and "moecompress" not in raw and quant_method != "moecompress":
        return None
    ckpt = open_checkpoint(directory, validate=False)  # refuses an unreadable moecompress block itself
    problems = verify_checkpoint(ckpt.adapter, raw.get("moecompress"), ckpt.reader, quant_method=quant_method)
    if problems:
        raise problems[0].error(directory)
    return ckpt.adapter


def refuse_missing(adapter, missing, directory: Path) -> None:
    """Raise unless every tensor of every MoE block (router, experts, shared expert) was loaded: what
    transformers reports missing it initialises randomly."""
    blocks = tuple(f"{adapter.layer_prefix(i)}{adapter.module_attr}." for i in adapter.moe_layer_indices)
    ours = sorted(k for k in missing if k.startswith(blocks))
    if ours:
        more = f" (and {len(ours) - 1} more)" if len(ours) > 1 else ""
        raise CheckpointError(
            f"{directory}: transformers found no stored value for {ours[0]!r}{more} and would initialise it "
            "randomly; re-download the checkpoint or re-run the recipe that wrote it"
        )
