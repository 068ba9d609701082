"""Pass registry: step name -> (config model, pure function, statistics it needs, optional plan/check).

A pass is a pure function ``(layer, stats, cfg) -> (layer, info)``::

    class MyConfig(PassConfig):
        ratio: float = Field(gt=0, lt=1)

    @register_pass("my_pass", MyConfig, needs={"act_sq_mean"})
    def my_pass(layer: MoELayer, stats: LayerStats, cfg: MyConfig) -> tuple[MoELayer, dict]:
        ...

- ``needs``: names from :data:`moecompress.calibration.stats.CATALOGUE`; the executor collects exactly
  these (forward, or the streamed backward for gradient statistics) and hands them over per layer.
  ``needs_fn(cfg)`` (optional) narrows them to what a configuration uses (e.g. no backward sweep for
  input-only whitening); ``needs`` is then the union over every configuration.
- ``plan(all_stats: dict[int, LayerStats], cfg) -> dict[int, Any]``: decisions across layers (global
  rankings, budgets); the result for layer ``i`` arrives as ``stats.plan``.
- ``check(layer, cfg) -> None``: runs in the dry run on a layer of ``meta`` tensors (shapes only) and
  raises :class:`~moecompress.errors.PassError` when the recipe is impossible.
- ``modifies_experts``: whether the pass may change expert weights (protection checks use it).
- ``report_only``: the step only reports (``analyze``); it never writes a checkpoint.
- ``protects(decision) -> ids``: for a step whose plan decides protection (``protect_super_experts``),
  the expert ids its plan protects in that layer, so that the plans of later steps already see them in
  ``stats.protected`` (budgets across layers must leave protected experts out).
- ``summarize(infos: dict[int, dict], cfg) -> dict``: turns the per-layer ``info`` dicts into the step
  report's ``summary``, ``warnings`` and extra ``plots`` (keys of the returned dict).

Passes register themselves when :mod:`moecompress.passes` is imported; the registry is a static
table filled at import time, not mutable run state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from moecompress.errors import MissingStatError, RecipeError
from moecompress.ir import MoELayer


class PassConfig(BaseModel):
    """Base of every pass's configuration: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class LayerStats:
    """Calibration statistics of one MoE layer, plus the pass's plan decision for it."""

    index: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    plan: Any = None
    protected: frozenset[int] = frozenset()
    """In plans: expert ids protected before this step (the checkpoint's record plus earlier steps'
    ``protects``). Passes read ``layer.protected`` instead, which is authoritative."""

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise MissingStatError(
                f"layer {self.index}: statistic {name!r} was not collected; declare it in the pass's needs "
                f"(available: {', '.join(sorted(self.tensors)) or 'none'})"
            )
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def get(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.tensors.get(name, default)


PassFn = Callable[[MoELayer, LayerStats, Any], "tuple[MoELayer, dict]"]


@dataclass(frozen=True)
class PassSpec:
    name: str
    config: type[PassConfig]
    fn: PassFn
    needs: frozenset[str]
    modifies_experts: bool = True
    report_only: bool = False
    plan: Callable[[dict[int, LayerStats], Any], dict[int, Any]] | None = None
    check: Callable[[MoELayer, Any], None] | None = None
    summarize: Callable[[dict[int, dict], Any], dict] | None = None
    protects: Callable[[Any], Iterable[int]] | None = None
    needs_fn: Callable[[Any], Iterable[str]] | None = None

    def needs_for(self, cfg: Any) -> frozenset[str]:
        """The statistics a step with configuration ``cfg`` needs."""
        return self.needs if self.needs_fn is None else frozenset(self.needs_fn(cfg)) & self.needs

    @property
    def summary(self) -> str:
        doc = (self.fn.__doc__ or "").strip().splitlines()
        return doc[0] if doc else ""


_REGISTRY: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    config: type[PassConfig],
    *,
    needs: Iterable[str] = (),
    modifies_experts: bool = True,
    report_only: bool = False,
    plan: Callable | None = None,
    check: Callable | None = None,
    summarize: Callable | None = None,
    protects: Callable | None = None,
    needs_fn: Callable | None = None,
) -> Callable[[PassFn], PassFn]:
    """Decorator registering a pass under ``name`` (a recipe step key)."""

    def deco(fn: PassFn) -> PassFn:
        from moecompress.calibration.stats import CATALOGUE

        if name in _REGISTRY:
            raise ValueError(f"pass {name!r} is registered twice")
        unknown = sorted(set(needs) - set(CATALOGUE))
        if unknown:
            raise ValueError(f"pass {name!r} needs unknown statistics {unknown}; known: {sorted(CATALOGUE)}")
        _REGISTRY[name] = PassSpec(
            name=name,
            config=config,
            fn=fn,
            needs=frozenset(needs),
            modifies_experts=modifies_experts,
            report_only=report_only,
            plan=plan,
            check=check,
            summarize=summarize,
            protects=protects,
            needs_fn=needs_fn,
        )
        return fn

    return deco


def _load_builtin_passes() -> None:
    import moecompress.passes  # noqa: F401  (registers the built-in passes)


def get_pass(name: str) -> PassSpec:
    _load_builtin_passes()
    if name not in _REGISTRY:
        raise RecipeError(f"unknown step {name!r}; available: {', '.join(available_passes())}")
    return _REGISTRY[name]


def available_passes() -> list[str]:
    _load_builtin_passes()
    return sorted(_REGISTRY)
