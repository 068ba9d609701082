"""moecompress: compress Hugging Face Mixture-of-Experts checkpoints, layer by layer.

Public API (importing this package never loads weights and never imports triton)::

    import moecompress as mc
    ckpt = mc.open_checkpoint("path/or/hub-id")
    layer = ckpt.read_layer(ckpt.moe_layer_indices[0])
    y = mc.moe_forward(layer, x)          # x: [T, H]
"""

from __future__ import annotations

from moecompress._version import __version__
from moecompress.engine.executor import RunResult
from moecompress.engine.executor import apply as _apply
from moecompress.engine.executor import calibrate as _calibrate
from moecompress.engine.layer_loop import rewrite_checkpoint
from moecompress.engine.recipe import Recipe, load_recipe, parse_override
from moecompress.engine.spec import LayerStats, PassConfig, PassSpec
from moecompress.errors import (
    AdapterError,
    CheckpointError,
    LayoutError,
    MoecompressError,
    OutputExistsError,
    RoutingError,
)
from moecompress.io.checkpoint import Checkpoint, open_checkpoint
from moecompress.ir import Act, ExpertBank, Gating, GroupScore, MoELayer, RouterSpec
from moecompress.layouts import Dense, Layout
from moecompress.passes import BUILTIN_PASSES
from moecompress.reference import moe_forward, route

# `import moecompress` lets plain `AutoModelForCausalLM.from_pretrained` load moecompress-format
# checkpoints, through transformers' public quantizer registration (no patching).
from moecompress.runtime.quantizer import register as _register_quantizer

_register_quantizer()


def apply(
    recipe, overrides=(), *, passes=(), dry_run=False, resume=False, overwrite=False, progress=True, **fields
) -> RunResult:
    """Run a recipe (path, dict or :class:`~moecompress.engine.recipe.Recipe`) and return a ``RunResult``.

    ``overrides`` are ``"key=value"`` strings or a ``{"dotted.key": value}`` mapping; extra keyword
    arguments are top-level overrides with ``__`` for dots (``calibration__samples=16``). ``passes``:
    extra steps (a list of :class:`PassSpec`) besides :data:`BUILTIN_PASSES`.
    """
    if fields:
        merged = (
            dict(overrides)
            if isinstance(overrides, dict)
            else {".".join(k): v for k, v in map(parse_override, overrides)}
        )
        overrides = {**merged, **{k.replace("__", "."): v for k, v in fields.items()}}
    return _apply(
        recipe, overrides, passes=passes, dry_run_only=dry_run, resume=resume, overwrite=overwrite,
        progress=progress,
    )  # fmt: skip


def load(path, *, dtype=None, device="cpu", routing=None, dequantize=None, static=None):
    """Load a checkpoint written by moecompress (stock or compressed) as a transformers model;
    ``routing`` switches or changes its routing policies (``docs/routing.md``); ``dequantize``
    (``"float16"``...) decodes quantised experts once at load, memory for CPU speed; ``static=True``
    prepares the static-shape forward ``torch.compile`` traces (``docs/serving.md``)."""
    from moecompress.runtime.loading import load as _load

    return _load(path, dtype=dtype, device=device, routing=routing, dequantize=dequantize, static=static)


def set_routing(model, routing):
    """Switch or change the routing policies of a loaded model (``"off"``, ``"stored"`` or knobs such as
    ``{"sere": {"select_top": 1}}``); see :func:`moecompress.runtime.routing.set_routing`."""
    from moecompress.runtime.routing import set_routing as _set

    return _set(model, routing)


def evaluate(model, *, against=None, texts=None, max_tokens=8192, seq_len=256, **kwargs):
    """Perplexity, tokens/s and, with ``against``, KL and top-1 agreement on held-out text (a JSON-able
    dict); see :func:`moecompress.tools.evaluation.evaluate`."""
    from moecompress.tools.evaluation import evaluate as _evaluate

    return _evaluate(model, against=against, texts=texts, max_tokens=max_tokens, seq_len=seq_len, **kwargs)


def calibrate(recipe, overrides=(), *, passes=(), progress=True):
    """Compute (or find cached) calibration statistics only; returns the cache entry directory."""
    return _calibrate(recipe, overrides, passes=passes, progress=progress)


__all__ = [
    "BUILTIN_PASSES",
    "Act",
    "AdapterError",
    "Checkpoint",
    "CheckpointError",
    "Dense",
    "ExpertBank",
    "Gating",
    "GroupScore",
    "LayerStats",
    "Layout",
    "LayoutError",
    "MoELayer",
    "MoecompressError",
    "OutputExistsError",
    "PassConfig",
    "PassSpec",
    "Recipe",
    "RouterSpec",
    "RoutingError",
    "RunResult",
    "__version__",
    "apply",
    "calibrate",
    "evaluate",
    "load",
    "load_recipe",
    "moe_forward",
    "open_checkpoint",
    "rewrite_checkpoint",
    "route",
    "set_routing",
]
