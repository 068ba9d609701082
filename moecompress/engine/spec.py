"""What a pass is to the engine: its configuration model, its pure function and what it declares.

A pass is a pure function ``(layer, stats, cfg) -> (layer, info)`` in its own file under
:mod:`moecompress.passes`, described by one :class:`PassSpec`::

    class MyConfig(PassConfig):
        ratio: float = Field(0.25, gt=0, lt=1)

    def my_pass(layer: MoELayer, stats: LayerStats, cfg: MyConfig) -> tuple[MoELayer, dict]:
        ...

    SPEC = PassSpec("my_pass", MyConfig, my_pass, needs={"act_sq_mean"}, emits=my_pass_emits)

The built-in specs are listed in the explicit table :data:`moecompress.passes.BUILTIN_PASSES`;
``moecompress.apply(..., passes=[SPEC])`` adds others (plugins, tests). Nothing registers itself.

Fields of a spec:

- ``needs``: names from :data:`moecompress.calibration.catalogue.CATALOGUE`. The step receives a
  :class:`LayerStats` holding exactly these (with the companion tensors the catalogue lists); reading
  anything else fails in every run, whatever the statistics cache holds. ``needs_fn(cfg)`` narrows
  them to what a configuration uses (no backward sweep for input-only whitening).
- ``emits(layer, cfg) -> layer``: on shapes only (``meta`` tensors), the layer this step would produce
  (layout kinds, widths, expert count, expert map, rotation). The dry run feeds it to the next step's
  ``check``, so impossible chains fail before any weight or token is read. ``None``: the step leaves
  every shape as it is.
- ``check(layer, cfg)``: raises :class:`~moecompress.errors.PassError` when the step cannot take
  ``layer`` (a meta layer in the dry run, the real one at run time).
- ``plan(all_stats, cfg) -> {layer: decision}``: decisions across layers (global rankings, budgets);
  the decision for layer ``i`` arrives as ``stats.plan``. ``protects(decision) -> ids``: for a step
  whose plan decides protection, the experts it protects, so later plans see them in
  ``stats.protected``. ``plans(cfg) -> bool``: whether a step with this configuration decides across
  layers (default: whenever ``plan`` is set); ``calibration.propagate: compressed`` refuses only those.
- ``summarize(infos, cfg) -> {"summary", "warnings", "plots"}``: the step report's summary.
- ``report_only``: the step only reports (``analyze``); it never writes a checkpoint.
- ``extras``: optional dependency groups the step needs (``("decompose",)``), or ``extras(cfg)`` giving them for a
  configuration (:meth:`PassSpec.extras_for`): checked in the dry run.
- ``stage``: a :class:`StageSpec` makes the step a *whole-model stage* (``distill``): it is not run per
  layer; the recipe is cut into segments there (:mod:`moecompress.engine.segments`, ``docs/training.md``).
- ``on_device``: the pass's maths are device-generic (every tensor it creates follows its inputs'
  device), so it runs on the run's compute device (``calibration.device``); other passes get the layer
  and its statistics on the host.
- ``workspace(layer, cfg) -> bytes``: memory the step allocates on one layer beyond its input and
  output layers (stacked or whitened copies, solver state), from shapes: the dry run's memory estimate
  adds it (``None``: nothing beyond them).
- ``chunking``: a :class:`Chunking`, how the step runs on a layer held by chunks of experts
  (``RunContext.expert_chunks``, :mod:`moecompress.engine.chunks`); ``None``: the step needs every expert
  at once and is refused on such a layer in the dry run.
- ``alters``: what the step changes in a layer (:data:`ALTERS`; a set, or ``cfg -> set``): ``routing``
  (router rows, which experts exist or which physical expert a token reaches),
  ``neurons`` (neuron subsets of the experts; the pass lists each expert's kept neurons in
  ``info[KEPT_NEURONS]``), ``weights`` (routed-expert weight values), ``shared`` (the shared expert).
  Later steps' statistics follow it (:mod:`moecompress.engine.follow`). ``None``: anything but the
  MoE input (a plugin that does not say); a report-only step alters nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from moecompress.calibration.catalogue import CATALOGUE, tensor_names
from moecompress.errors import MissingStatError
from moecompress.extras import EXTRAS
from moecompress.ir import MoELayer


class PassConfig(BaseModel):
    """Base of every pass's configuration: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class LayerStats(Mapping[str, torch.Tensor]):
    """The statistics one step may read for one MoE layer: exactly those it declared, read-only.

    ``plan`` is the step's cross-layer decision for this layer; ``protected`` (in plans) the expert ids
    protected before this step (passes read ``layer.protected``, which is authoritative)."""

    index: int
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    declared: frozenset[str] | None = None
    plan: Any = None
    protected: frozenset[int] = frozenset()
    step: str = "this step"
    prelude: Any = None
    """On a chunk of a layer held by chunks of experts, what the step's ``Chunking.prelude`` computed once
    for the layer (made the chunk's by its ``chunk(a, b)``, if it has one); ``None`` on a whole layer."""
    first: int = 0
    """On a chunk of a layer held by chunks of experts, its first expert in the step's input (both sweeps of a
    two-phase step); ``0`` on a whole layer."""
    team: Any = None
    """On a unit of a layer whose units are worked at the same time, one per rank (``Chunking.team``): how
    the units exchange tensors (:class:`moecompress.engine.team.Team`); ``None`` otherwise."""

    def __post_init__(self) -> None:
        names = frozenset(self.tensors) if self.declared is None else self.declared
        kept = {k: v for k, v in self.tensors.items() if k in names}
        object.__setattr__(self, "declared", names)
        object.__setattr__(self, "tensors", MappingProxyType(kept))

    @classmethod
    def view(
        cls,
        index: int,
        available: Mapping[str, torch.Tensor],
        needs: Iterable[str],
        *,
        step: str = "this step",
        plan: Any = None,
        protected: frozenset[int] = frozenset(),
        prelude: Any = None,
        first: int = 0,
        team: Any = None,
    ) -> LayerStats:
        """The read-only view of ``available`` (a cache entry's layer) holding the statistics ``needs``
        names, with their companion tensors (``io_sample`` -> ``io_sample_x``, ``io_sample_y``)."""
        return cls(index, available, tensor_names(needs), plan, protected, step, prelude, first, team)

    def _declared(self, name: str) -> None:
        if name not in self.declared:  # type: ignore[operator]
            known = "" if name in CATALOGUE or name in tensor_names(CATALOGUE) else " (not in the catalogue)"
            raise MissingStatError(
                f"{self.step} reads statistic {name!r}{known} that it does not declare; add it to the "
                f"pass's needs (declared: {', '.join(sorted(self.declared)) or 'none'})"  # type: ignore[arg-type]
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        self._declared(name)
        if name not in self.tensors:
            raise MissingStatError(
                f"layer {self.index}: statistic {name!r} was not collected for {self.step} "
                f"(collected: {', '.join(sorted(self.tensors)) or 'none'})"
            )
        return self.tensors[name]

    def get(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """A declared statistic, or ``default`` when it was declared but not produced (e.g. shared-expert
        statistics of a model without shared experts)."""
        self._declared(name)
        return self.tensors.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def with_tensors(self, **tensors: torch.Tensor) -> LayerStats:
        """The same view with some declared statistics replaced (a pass recomputing one for its input)."""
        for name in tensors:
            self._declared(name)
        return replace(self, tensors={**self.tensors, **tensors})


ALTERS = frozenset({"routing", "neurons", "weights", "shared"})
"""What a step may change in an MoE layer (``PassSpec.alters``)."""

KEPT_NEURONS = "_kept_neurons"
"""``info`` key of a ``neurons`` step: per physical expert, the input neuron ids it kept, in order. The
engine takes it out of the info (reports never carry it)."""

PassFn = Callable[[MoELayer, LayerStats, Any], "tuple[MoELayer, dict]"]


@dataclass(frozen=True)
class Chunking:
    """How a step runs on an MoE layer held by chunks of experts (:mod:`moecompress.engine.chunks`).

    - ``"expert"``: the result for an expert depends only on that expert and its statistics; the pass
      runs on every chunk's sub-layer (experts ``a..b``, their router rows, per-expert statistics and a
      per-expert plan sliced, protected ids shifted) and ``merge(infos, bounds, cfg)`` makes the
      layer's ``info`` from the chunks' infos (``bounds``: each chunk's ``(a, b)``); the router and the
      shared expert are left as they are.
    - ``"select"``: the pass decides from the statistics alone and changes only which experts exist
      (``info["kept_experts"]``, old ids in the new order; absent: all), the router rows and the
      protection: it runs once per layer on the layer's *shell* (routed experts on the ``meta`` device)
      and the engine applies the selection to every chunk.

    ``refuse(cfg) -> reason | None``: a configuration that cannot run by chunks although the pass can
    (``heapr`` ranking the neurons of a layer without a plan), with the fix. ``kind(shell, stats, cfg)``:
    for an ``expert`` step whose output layout can differ between chunks (pruning: a chunk whose experts
    all keep their width), what the whole layer becomes (``unchanged``, ``dense``, ``ragged``), from the
    statistics alone; the chunks are written in that form.

    ``refuse_layer(shell, cfg) -> reason | None``: as ``refuse``, for a configuration that cannot run by
    chunks on this layer (``codequant`` quantising a layer's shared expert); ``shell`` may be ``meta``.
    ``prelude(shell, stats, cfg) -> value``: for an ``expert`` step, work that depends on the layer's
    shell and statistics but not on its routed experts (``codequant``'s rotation of the MoE input and the
    routing of its calibration tokens), done once per layer (in
    :func:`moecompress.engine.unit_work.prepare`) rather than once per chunk; each chunk's step reads
    it as ``stats.prelude``: ``value.chunk(a, b)`` when the value has such a method (experts ``[a, b)``
    of the step's input), else ``value`` itself. A whole-layer run never calls it (``stats.prelude`` is
    ``None``): a pass computes the same thing itself, with the same function, so that the outputs can
    match.
    ``exact(cfg) -> bool``: whether the chunks give the whole layer's bytes (``None``: always). Under
    ``torchrun`` a layer is shared out by chunks only when every step is exact (``expert_chunk: N`` or
    ``auto`` still chunks the others, by request), or is a ``team`` step.
    ``team(cfg) -> bool``: a step that is not exact by chunks worked one after another but is when the
    chunks are worked at the same time and exchange tensors (``codequant``'s fine-tuning of every expert
    against the block's output): under ``N > 1`` ranks the layer (not chunked by request) then goes in ``N``
    units, unit ``k`` on rank ``k``, and each unit's step reads ``stats.team``
    (:class:`~moecompress.engine.team.Team`) to gather the other units' tensors; its output is the whole
    layer's (:func:`moecompress.engine.units.unit_size` says when).

    ``gather(sub, stats, cfg, acc) -> acc`` and ``fit(acc, shell, stats, cfg) -> value``: an ``expert``
    step in two phases, for what every expert of the layer shapes (``tdmoe``'s shared Tucker factors). In
    :func:`~moecompress.engine.unit_work.prepare`, a first sweep reads every chunk of the layer (the
    earlier ``select`` steps applied) and folds it into ``acc`` (``None`` before the first chunk; chunks
    in order, ``stats`` the chunk's as in the second sweep); ``fit`` then makes, once per layer and with
    the layer's whole statistics, the value each chunk's step reads as ``stats.prelude``, exactly as a
    ``prelude``'s (a step has one or the other). An earlier ``expert`` step that changes the layer would
    have to run twice on every chunk: the dry run refuses it unless ``calibration.recalibrate: auto``
    starts a new segment at the gathering step (:func:`moecompress.engine.follow.cuts`).
    ``take(acc) -> {name: tensor}`` and ``add(acc, part) -> acc``: a first sweep by *blocks* instead of by
    chunks: the layer's experts in :func:`~moecompress.ir.fold_blocks`' fixed blocks (independent of the chunk size and of
    the ranks), each block folded by ``gather`` into a partial of its own that ``take`` hands out (as
    tensors, the partial then cleared; ``{}``: nothing gathered) and ``add`` folds into the layer's total,
    in block order (``acc`` may be ``None``: a rank that gathered nothing yet). Under ``torchrun`` each rank
    gathers its blocks and every rank adds every block's partial in block order
    (:func:`~moecompress.engine.unit_work.gather`), so the total, and the output, are one process's. A
    configuration whose ``pairs(cfg)`` is true sweeps pairs of chunks instead (every rank repeats it).
    ``reads(cfg) -> bool``: whether the first sweep reads the experts (``None``: always); a configuration
    whose ``fit`` needs nothing gathered (a merge grouping by the router's logits) skips it: ``fit(None, ...)``.
    ``phased(cfg, units) -> bool``: whether this configuration runs its two phases on a layer held by chunks
    by request (``units`` false) or shared out by units under ``torchrun`` (``units`` true); where it does not,
    its ``prelude`` (it may have one then) is its chunks' value (``None``: always two phases, no prelude).
    ``svd_experts``' balanced ranks decide every expert's rank from the whole layer on units, where each rank
    keeps the factors it gathered, and from the chunk's share of the total on chunks by request.
    ``workspace(chunk, cfg) -> bytes``: the step's workspace on a chunk's sub-layer when it differs from
    ``PassSpec.workspace`` on it (both phases of a two-phase step: its accumulators and its fit); the dry
    run's chunk estimate uses it.

    ``"group"`` (expert merging: ``namex``, ``merge_experts``): the pass turns groups of experts into one
    each, groups that need not be contiguous in expert id. ``gather``/``fit`` as above, but ``fit`` returns
    the layer's *decision*: ``decision.shell`` the layer after the step (router, expert map; experts on
    ``meta``), ``decision.units(size)`` consecutive output experts ``[lo, hi)`` whose members number at most
    ``size`` (a larger group alone), ``decision.members(lo, hi)`` their input experts, ascending. The second
    sweep's units are those: the members are read (runs of consecutive ids at a time),
    ``unit(decision, lo, hi, bank, cfg) -> (bank, info)`` makes output experts ``[lo, hi)``, and
    ``merge(infos, bounds, decision)`` the layer's info; ``decision.fold(info)`` takes each unit's running
    sums out of its info as it comes. ``decision.sweeps == 2``: a choice on the whole layer (``namex``'s
    refinement, kept only if it lowers the layer's held-back error) first takes an unwritten pass over the
    units (``unit`` returns no bank), then ``decision.choose(infos)``. It must be the first step of its
    segment that changes the layer and the last (report-only steps aside). Its ``workspace(layer, cfg, n)``
    gets the whole layer (``meta``) and the chunk size: the gathered summaries and one unit's merge.
    ``pairs(cfg) -> bool`` and ``pair(sub_a, sub_b, cfg, (row_a, row_b), experts, acc) -> acc``: a first
    sweep over every pair of chunks ``a ≤ b`` instead (``similarity: weight``: the experts' weight Gram),
    two chunks held at once (``sub_b is sub_a`` on the diagonal, where ``gather`` is also called, in chunk
    order); ``row_*`` the chunk's first expert in the layer, ``experts`` the layer's routed experts."""

    mode: str
    merge: Callable[[list[dict], list[tuple[int, int]], Any], dict] | None = None
    refuse: Callable[[Any], str | None] | None = None
    kind: Callable[[MoELayer, LayerStats, Any], str] | None = None
    refuse_layer: Callable[[MoELayer, Any], str | None] | None = None
    prelude: Callable[[MoELayer, LayerStats, Any], Any] | None = None
    exact: Callable[[Any], bool] | None = None
    gather: Callable[[MoELayer, LayerStats, Any, Any], Any] | None = None
    fit: Callable[[Any, MoELayer, LayerStats, Any], Any] | None = None
    workspace: Callable[..., int] | None = None
    unit: Callable[[Any, int, int, Any, Any], tuple[Any, dict]] | None = None
    pairs: Callable[[Any], bool] | None = None
    pair: Callable[..., Any] | None = None
    take: Callable[[Any], dict[str, torch.Tensor]] | None = None
    add: Callable[[Any, dict[str, torch.Tensor]], Any] | None = None
    phased: Callable[[Any, bool], bool] | None = None
    reads: Callable[[Any], bool] | None = None
    team: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("expert", "select", "group"):
            raise ValueError(f"Chunking mode must be 'expert', 'select' or 'group', got {self.mode!r}")
        if self.mode in ("expert", "group") and self.merge is None:
            raise ValueError(f"Chunking({self.mode!r}) needs merge(infos, bounds, cfg) -> info")
        if self.mode == "group" and (self.gather is None or self.unit is None):
            raise ValueError("Chunking('group') needs gather, fit and unit")
        if (self.gather is None) != (self.fit is None) or (self.gather is not None and self.mode == "select"):
            raise ValueError("Chunking: gather and fit come together, on an 'expert' or 'group' step")
        if (self.pairs is None) != (self.pair is None) or (self.pair is not None and self.gather is None):
            raise ValueError("Chunking: pairs and pair come together, on a step with gather")
        if (self.take is None) != (self.add is None) or (self.take is not None and self.gather is None):
            raise ValueError("Chunking: take and add come together, on a step with gather")
        if self.gather is not None and self.prelude is not None and self.phased is None:
            raise ValueError("Chunking: a step has a prelude or gather/fit, not both (unless phased chooses)")
        if self.phased is not None and self.gather is None:
            raise ValueError("Chunking: phased chooses between gather/fit and the prelude; it needs gather")

    def phases(self, cfg: Any, units: bool) -> bool:
        """Whether the step runs its two phases (``gather``/``fit``) on a layer held by chunks (``phased``)."""
        return self.gather is not None and (self.phased is None or self.phased(cfg, units))


def shifted_ids(infos: list[dict], bounds: list[tuple[int, int]], key: str) -> list[int]:
    """The expert ids listed under ``key`` in chunk infos, shifted to the layer's numbering (what a
    :class:`Chunking` ``merge`` uses; ``bounds``: each chunk's ``(a, b)``)."""
    return sorted(int(x) + a for info, (a, _) in zip(infos, bounds) for x in info.get(key, []))


@dataclass(frozen=True)
class StageJob:
    """What a whole-model stage is given: its input checkpoint (the previous segment's output, or the
    recipe's input), the teacher (the recipe's input unless the step names one), the directory to
    write its checkpoint into, the recipe's calibration settings and the run's device."""

    label: str
    config: Any
    input_dir: Any
    teacher_dir: Any
    output_dir: Any
    calibration: Any
    max_shard_size: int | str = "5GB"
    device: str = "cpu"
    progress: bool = True
    state_dir: Any = None
    """Where the stage may keep its resumable state (kept by a failed run, removed when it finishes)."""
    ranks: Any = None
    """The run's :class:`~moecompress.engine.distributed.Ranks` (``None``: one process); under ``torchrun``
    every rank runs the stage and rank 0 alone writes ``output_dir`` (``moecompress/training/fsdp.py``)."""


@dataclass(frozen=True)
class StageSpec:
    """``run(job) -> report`` writes ``job.output_dir`` (same layouts) and returns the step report's
    ``summary``/``plots``/``warnings``; ``memory(job, student_bytes, teacher_bytes, world_size) -> bytes``
    is the dry run's estimate of its peak memory (one rank's under ``torchrun``)."""

    run: Callable[[StageJob], dict]
    memory: Callable[[StageJob, int, int, int], int]


@dataclass(frozen=True)
class PassSpec:
    """A recipe step: see the module docstring for every field."""

    name: str
    config: type[PassConfig]
    fn: PassFn
    needs: frozenset[str] = frozenset()
    emits: Callable[[MoELayer, Any], MoELayer] | None = None
    check: Callable[[MoELayer, Any], None] | None = None
    plan: Callable[[dict[int, LayerStats], Any], dict[int, Any]] | None = None
    protects: Callable[[Any], Iterable[int]] | None = None
    summarize: Callable[[dict[int, dict], Any], dict] | None = None
    needs_fn: Callable[[Any], Iterable[str]] | None = None
    report_only: bool = False
    extras: tuple[str, ...] | Callable[[Any], Iterable[str]] = ()
    stage: StageSpec | None = None
    on_device: bool = False
    workspace: Callable[[MoELayer, Any], int] | None = None
    chunking: Chunking | None = None
    plans: Callable[[Any], bool] | None = None
    alters: frozenset[str] | Callable[[Any], Iterable[str]] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "needs", frozenset(self.needs))
        unknown = sorted(self.needs - set(CATALOGUE))
        if unknown:
            raise ValueError(f"pass {self.name!r} needs unknown statistics {unknown}; known: {sorted(CATALOGUE)}")
        bad = [] if callable(self.extras) else sorted(set(self.extras) - set(EXTRAS))
        if bad:
            raise ValueError(f"pass {self.name!r} names unknown extras {bad}; known: {sorted(EXTRAS)}")
        if isinstance(self.alters, (set, frozenset)):
            object.__setattr__(self, "alters", frozenset(self.alters))
            if not self.alters <= ALTERS:
                raise ValueError(f"pass {self.name!r} alters unknown parts {sorted(self.alters - ALTERS)}")

    def needs_for(self, cfg: Any) -> frozenset[str]:
        """The statistics a step with configuration ``cfg`` needs."""
        return self.needs if self.needs_fn is None else frozenset(self.needs_fn(cfg)) & self.needs

    def extras_for(self, cfg: Any) -> tuple[str, ...]:
        """The optional dependency groups a step with configuration ``cfg`` needs (see ``extras``)."""
        if not callable(self.extras):
            return tuple(self.extras)
        got = tuple(self.extras(cfg))
        bad = sorted(set(got) - set(EXTRAS))
        if bad:
            raise ValueError(f"pass {self.name!r} names unknown extras {bad}; known: {sorted(EXTRAS)}")
        return got

    def alters_for(self, cfg: Any) -> frozenset[str]:
        """What a step with configuration ``cfg`` changes in a layer (see ``alters``)."""
        if self.report_only:
            return frozenset()
        if self.alters is None:
            return ALTERS - {"neurons"}
        parts = self.alters if isinstance(self.alters, frozenset) else frozenset(self.alters(cfg))
        if not parts <= ALTERS:
            raise ValueError(f"pass {self.name!r} alters unknown parts {sorted(parts - ALTERS)}")
        return parts

    def plans_for(self, cfg: Any) -> bool:
        """Whether a step with configuration ``cfg`` makes a cross-layer decision."""
        return self.plan is not None and (self.plans is None or bool(self.plans(cfg)))

    def emitted(self, layer: MoELayer, cfg: Any) -> MoELayer:
        """The layer this step would produce from ``layer`` (shapes only; see ``emits``)."""
        if self.report_only or self.emits is None:
            return layer
        return self.emits(layer, cfg)

    @property
    def summary(self) -> str:
        doc = (self.fn.__doc__ or "").strip().splitlines()
        return doc[0] if doc else ""
