"""Statistics follow the layer: in an MoE layer, the statistics a step reads describe the layer as the
earlier steps of the recipe left it (issue 34).

Calibration measures each layer once, on the input checkpoint. After a step that changes parts of the
layer (``PassSpec.alters``), every statistic depending on those parts (:data:`calibration.mapping.DEPENDS`)
is brought up to date before a later step reads it, by one rule per statistic:

- ``keep``: it does not depend on what changed (the router after a neuron subset, the MoE input);
- ``map``: a neuron subset maps it exactly (``act_sq_mean``, ``down_in_cov``: the kept neurons' entries;
  ``down_in_cov_pooled``: rebuilt from ``down_in_cov``, which calibration then also collects);
- ``sample``: it is computed from the stored ``io_sample_x`` tokens alone (``io_sample``, ``expert_out_gram``):
  recomputed on the changed layer from them;
- ``replay``: any other forward statistic: the changed layer is replayed on the layer's own calibration
  inputs (``moe_inputs``, which calibration then keeps: ``[T, H]`` per layer, counted in the dry run);
- ``refuse``: gradient statistics (a backward through the changed model) and ``route_attrib`` (a trace
  through the changed earlier layers), and a cross-layer plan made on statistics an earlier step changes:
  refused in the dry run, naming both steps and the fix.

:func:`verdicts` is the dry run's view (also what calibration must collect, :func:`extra_needs`);
:class:`Follower` does it in the layer loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moecompress.calibration.catalogue import CATALOGUE, tensor_names
from moecompress.calibration.mapping import DEPENDS, NEURON_MAPPED, NEURONS, SAMPLED, map_neurons
from moecompress.engine.spec import KEPT_NEURONS
from moecompress.errors import PassError, RecipeError
from moecompress.ir import MoELayer, cast_layer, layer_to
from moecompress.reference import moe_forward

_KEEP_ALWAYS = ("holdout_x", "moe_inputs", "router_sample", "router_sample_base", "io_sample_x")


def _refusal(name: str) -> bool:
    return CATALOGUE[name].kind == "backward" or name == "route_attrib"


def verdicts(steps: Sequence[Any], *, recalibrate: bool | str = False) -> list[dict[str, str]]:
    """Per step, the rule for every statistic it reads (``keep``, ``map``, ``sample``, ``replay``). A
    statistic that cannot follow the layer raises :class:`RecipeError` naming both steps and the fix; with
    ``recalibrate`` the step starts a new segment instead (:func:`cuts`), calibrated afresh, all ``keep``.
    ``recalibrate="chunks"`` (``Recipe.recalibrates`` under ``expert_chunk: N``): every statistic that
    would have to follow the layer starts a new segment too, because a layer held by chunks of experts
    cannot map or replay them; every rule is then ``keep``."""
    return _walk(steps, recalibrate)[0]


def cuts(steps: Sequence[Any], strict: bool = False) -> list[int]:
    """``calibration.recalibrate: auto``: the indices of the steps that start a new per-layer segment,
    calibrated afresh on the previous segment's output, because a statistic they read cannot follow the
    layer through the earlier steps (a backward or a trace through the changed model, a cross-layer plan);
    ``strict``: also every step reading a statistic that would be mapped, sampled or replayed."""
    return _walk(steps, "chunks" if strict else True)[1]


def _cannot_follow(step: Any, stale: dict[str, Any], mapped: dict[str, Any]) -> str | None:
    for name in sorted(step.needs):
        if name in stale and _refusal(name):
            return _why(step, stale[name], name)
    if step.spec.plans_for(step.config):
        for name in sorted(step.needs):
            by = stale.get(name, mapped.get(name))
            if by is not None:
                return (
                    f"{step.label} decides across layers (a plan) from statistic {name!r}, which {by.label} "
                    f"changes; put {step.spec.name} before step {by.number} ({by.spec.name}), use a "
                    "configuration that decides per layer, or set calibration.recalibrate: auto"
                )
    return None


def _walk(steps: Sequence[Any], recalibrate: bool | str) -> tuple[list[dict[str, str]], list[int]]:
    mapped: dict[str, Any] = {}  # statistic -> the neuron-subset step that mapped it (still exact)
    stale: dict[str, Any] = {}  # statistic -> the step that changed what it depends on
    out: list[dict[str, str]] = []
    cut: list[int] = []
    changer = None  # the segment's first per-expert step that changes the layer
    alterer = grouper = None  # the segment's first step that changes the layer; its merge by units of groups
    for index, step in enumerate(steps):
        if step.spec.stage is not None:  # the next segment is calibrated on the stage's output
            mapped, stale, changer, alterer, grouper = {}, {}, None, None, None
            out.append({})
            continue
        why = _cannot_follow(step, stale, mapped)
        if why is None and recalibrate == "chunks" and any(n in stale or n in mapped for n in step.needs):
            why = "held by chunks"  # strict: nothing follows the layer, the step reads a fresh calibration
        if why is None and recalibrate == "chunks" and changer is not None and _gathers(step):
            why = "held by chunks"  # its first sweep would rerun the earlier step on every chunk
        alters = not step.spec.report_only and bool(step.spec.alters_for(step.config))
        if why is None and recalibrate == "chunks" and alters and (grouper is not None or (alterer is not None and _groups(step))):
            why = "held by chunks"  # a merge by units of groups reads the segment's input experts, and writes them
        if why is not None:
            if not recalibrate:
                raise RecipeError(why)
            mapped, stale, changer = {}, {}, None  # a new segment: this step reads a fresh calibration of its input
            alterer = grouper = None
            cut.append(index)
        if changer is None and _changes_experts(step):
            changer = step
        if alters:
            alterer = alterer or step
            grouper = grouper or (step if _groups(step) else None)
        rules: dict[str, str] = {}
        for name in sorted(step.needs):
            by = stale.get(name, mapped.get(name))
            if by is None:
                rules[name] = "keep"
            else:
                rules[name] = "map" if name not in stale else "sample" if name in SAMPLED else "replay"
        out.append(rules)
        if "replay" in rules.values():  # the replay makes every forward statistic fresh
            stale = {n: s for n, s in stale.items() if _refusal(n)}
        alters = step.spec.alters_for(step.config)
        for name, parts in DEPENDS.items():
            if not parts & alters:
                continue
            if alters == {NEURONS} and name in NEURON_MAPPED and name not in stale:
                mapped[name] = step
            else:
                stale[name] = step
                mapped.pop(name, None)
    return out, cut


def _gathers(step: Any, units: bool = False) -> bool:
    """A two-phase step on a layer held by chunks by request (``units``: shared out by units under
    ``torchrun``; ``Chunking.phases``): its first sweep reads the layer's experts."""
    return step.spec.chunking is not None and step.spec.chunking.phases(step.config, units)


def _groups(step: Any) -> bool:
    """A merging step by chunks (``Chunking('group')``): its units are groups of the input's experts."""
    return step.spec.chunking is not None and step.spec.chunking.mode == "group"


def _changes_experts(step: Any) -> bool:
    """A per-expert (or merging) step by chunks (``Chunking`` mode ``expert``, ``group``) that changes the layer."""
    mode = step.spec.chunking
    return (mode is not None and mode.mode in ("expert", "group") and not step.spec.report_only
            and bool(step.spec.alters_for(step.config)))  # fmt: skip


def segment_of(steps: Sequence[Any], recalibrate: bool | str = False) -> list[int]:
    """Per step, the number of its segment among the cuts ``recalibrate`` makes (stages aside)."""
    fresh = set(_walk(steps, recalibrate)[1]) if recalibrate else set()
    out, seg = [], 0
    for index in range(len(steps)):
        seg += index in fresh
        out.append(seg)
    return out


def gather_conflict(
    steps: Sequence[Any], recalibrate: bool | str = False, units: bool = False
) -> tuple[Any, Any] | None:
    """``(earlier, step)``: a two-phase step (``Chunking.gather``) after a per-expert step of its segment that
    changes the layer, which its first sweep would have to rerun on every chunk (``None``: none); ``units``:
    on a layer shared out by units under ``torchrun`` rather than chunked by request."""
    fresh = set(_walk(steps, recalibrate)[1]) if recalibrate else set()
    changer = None
    for index, step in enumerate(steps):
        if index in fresh or step.spec.stage is not None:
            changer = None
        if changer is not None and _gathers(step, units):
            return changer, step
        if changer is None and _changes_experts(step):
            changer = step
    return None


def _why(step: Any, by: Any, name: str) -> str:
    kind = "a backward pass" if CATALOGUE[name].kind == "backward" else "a trace through the earlier layers"
    return (
        f"{step.label} reads statistic {name!r}, which {by.label} changes and which needs {kind} through the "
        f"changed model; put {step.spec.name} before step {by.number} ({by.spec.name}), or set "
        "calibration.recalibrate: auto (the recipe is cut there and calibrated again on the changed model)"
    )


def extra_needs(steps: Sequence[Any], recalibrate: bool | str = False) -> frozenset[str]:
    """What calibration must collect beyond the steps' needs for :func:`verdicts`' rules (none when the
    recipe is refused: the dry run says why)."""
    try:
        rules = verdicts(steps, recalibrate=recalibrate)
    except RecipeError:
        return frozenset()
    extra: set[str] = set()
    for r in rules:
        if "replay" in r.values():
            extra.add("moe_inputs")
        if r.get("down_in_cov_pooled") == "map":
            extra.add("down_in_cov")
    return frozenset(extra)


UNIT_MAPPED = NEURON_MAPPED - {"down_in_cov_pooled"}
"""The mapped statistics a unit of experts maps itself (:func:`by_units`): per expert, so a unit's rows
mapped are the whole layer's mapping's rows, bit for bit (a copy of the kept neurons' entries)."""


def by_units(steps: Sequence[Any], recalibrate: bool | str = False) -> bool:
    """Whether every statistic of the recipe follows the layer on units of experts: each rule ``keep``, or
    ``map`` of a per-expert statistic (:data:`UNIT_MAPPED`; :func:`~moecompress.engine.unit_work.chunk_parts`
    maps a unit's rows after each neuron-subset step). ``heapr → gptq`` does (``down_in_cov`` mapped);
    a replayed or re-sampled statistic, or the pooled covariance, needs the whole layer."""
    try:
        rules = verdicts(steps, recalibrate=recalibrate)
    except RecipeError:
        return False
    return all(v == "keep" or (v == "map" and n in UNIT_MAPPED) for r in rules for n, v in r.items())


def mapped_later(steps: Sequence[Any], s: int, recalibrate: bool | str = False) -> set[str]:
    """The statistics a step after step ``s`` reads mapped (rule ``map``)."""
    rules = verdicts(steps, recalibrate=recalibrate)
    return {n for r in rules[s + 1 :] for n, v in r.items() if v == "map"}


def required(steps: Sequence[Any], recalibrate: bool | str = False) -> bool:
    """Whether any statistic of the recipe is mapped, recomputed or replayed (the layer is then held
    whole: not by chunks of experts, not sharded over ranks)."""
    try:
        return any(v != "keep" for r in verdicts(steps, recalibrate=recalibrate) for v in r.values())
    except RecipeError:
        return False


def replay(
    layer: MoELayer, xs: torch.Tensor, names: set[str], *, sample_tokens: int, dtype: torch.dtype,
    batch_tokens: int = 4096,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The forward statistics ``names`` of ``layer`` on its MoE inputs ``xs`` ``[T, H]`` (the calibration's
    collector, batches of ``batch_tokens``)."""
    from moecompress.calibration.stats import StatsCollector

    run = cast_layer(layer_to(layer, torch.device("cpu")), dtype)
    col = StatsCollector(run, names, sample_tokens)
    with torch.no_grad():
        for a in range(0, xs.shape[0], batch_tokens):  # as calibration's instrumented block calls it
            x = xs[a : a + batch_tokens].to(dtype)
            col.on_input(x)
            col.on_output(moe_forward(run, x, col))
    return col.result()


class Follower:
    """One MoE layer's statistics in the layer loop, brought up to date for each step (module docstring).

    ``stats``: the layer's calibration statistics (host tensors); ``rules``: :func:`verdicts` of the
    recipe's steps, in order."""

    def __init__(self, stats: Mapping[str, torch.Tensor], rules: list[dict[str, str]], *, sample_tokens: int,
                 dtype: torch.dtype, batch_tokens: int = 4096) -> None:  # fmt: skip
        self.stats = dict(stats)
        self.rules = rules
        self.sample_tokens, self.dtype, self.batch_tokens = sample_tokens, dtype, batch_tokens
        self.stale: set[str] = set()
        self.version = 0  # bumped on every change (device copies are remade)

    def before(self, n: int, step: Any, layer: MoELayer) -> dict[str, torch.Tensor]:
        """The statistics step ``n`` (0-based) reads, up to date for ``layer``."""
        rules = self.rules[n] if n < len(self.rules) else {}
        todo = {name for name in step.needs if name in self.stale}
        if not todo:
            return self.stats
        replays = {name for name in todo if rules.get(name) == "replay"}
        if replays or any(rules.get(name) not in ("sample", "replay") for name in todo):
            self._replay(step, layer)
        else:
            self._sample(layer, todo)
        self.version += 1
        return self.stats

    def _replay(self, step: Any, layer: MoELayer) -> None:
        if "moe_inputs" not in self.stats:  # the dry run collects them whenever a rule says replay
            raise PassError(
                f"{step.label}, layer {layer.index}: statistics {sorted(self.stale & set(step.needs))} describe "
                "the layer before an earlier step changed it, and its calibration inputs were not kept; this is a bug"
            )
        names = {n for n in self.stale if n in DEPENDS and not _refusal(n)}
        fresh = replay(layer, self.stats["moe_inputs"], names, sample_tokens=self.sample_tokens, dtype=self.dtype,
                       batch_tokens=self.batch_tokens)  # fmt: skip
        keep = {k: v for k, v in self.stats.items() if k in _KEEP_ALWAYS}
        self.stats.update({k: v for k, v in fresh.items() if k not in keep})
        self.stale -= names

    def _sample(self, layer: MoELayer, names: set[str]) -> None:
        xs = self.stats["io_sample_x"]
        fresh = replay(layer, xs, names, sample_tokens=self.sample_tokens, dtype=self.dtype, batch_tokens=len(xs))
        for name in tensor_names(names) - {"io_sample_x"}:
            if name in fresh:
                self.stats[name] = fresh[name]
        self.stale -= names

    def after(self, step: Any, old: MoELayer, new: MoELayer, kept: list[list[int]] | None) -> None:
        """``step`` turned ``old`` into ``new``; ``kept``: its kept neurons (a ``neurons`` step)."""
        alters = step.spec.alters_for(step.config)
        if new is old or not alters:
            return
        hit = {name for name in DEPENDS if DEPENDS[name] & alters and _present(self.stats, name)}
        if alters == {NEURONS} and kept is not None:
            maps = {n: self.stats[n] for n in NEURON_MAPPED if n in hit and n not in self.stale and n in self.stats}
            if "down_in_cov_pooled" in maps and "down_in_cov" not in maps:
                maps.pop("down_in_cov_pooled")
            if maps:
                counts = _physical_counts(new, self.stats.get("expert_counts"), len(kept))
                self.stats.update(map_neurons(maps, kept, new.experts.width, counts))
                hit -= set(maps)
        self.stale |= hit
        self.version += 1


def _present(stats: Mapping[str, torch.Tensor], name: str) -> bool:
    return any(t in stats for t in tensor_names([name]))


def _physical_counts(layer: MoELayer, counts: torch.Tensor | None, n: int) -> torch.Tensor:
    if counts is None:
        return torch.ones(n)
    if layer.expert_map is None:
        return counts
    return torch.zeros(n, dtype=counts.dtype).index_add_(0, layer.expert_map.to(torch.int64), counts)


def split_kept(info: dict) -> tuple[dict, list[list[int]] | None]:
    """A step's ``info`` without its kept neurons (``KEPT_NEURONS``: never in reports), and those."""
    if KEPT_NEURONS not in info:
        return info, None
    rest = dict(info)
    return rest, rest.pop(KEPT_NEURONS)


def follower(rec: Any, stats: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Follower:
    """The :class:`Follower` of one layer of recipe ``rec`` (batches as calibration's)."""
    c = rec.calibration
    return Follower(stats, verdicts(rec.steps, recalibrate=rec.recalibrates), sample_tokens=c.sample_tokens, dtype=dtype,
                    batch_tokens=c.batch_size * c.seq_len)  # fmt: skip
