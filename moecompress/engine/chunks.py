"""MoE layers held by chunks of experts: the chunk sub-layer, what a step reads of it, and how chunks
join back into the layer that a whole-layer run would have produced.

A layer listed in ``RunContext.expert_chunks`` is never held whole (:mod:`moecompress.engine.layer_run`):
its *shell* (router, score bias, shared expert, protection, routing policy; routed experts on the
``meta`` device) is read once, then experts ``[a, b)`` at a time. For one chunk:

- :func:`sub_layer` is a valid :class:`MoELayer` of the chunk's experts: their router rows (and router and
  score biases), the shell's shared expert, the protected ids that fall in the chunk shifted by ``-a``; its
  router spec keeps only what a layer of that many experts can mean (``top_k`` capped, no groups): the
  per-expert passes that run on it never route (routing, for the reconstruction error, uses the shell);
- :func:`slice_stats` gives the step the statistics of those experts: every catalogue statistic with an
  expert dimension ``E`` (``[E]``, ``[E, I]``, ``[E, H, H]``, ...) is narrowed along it, the others
  (``[H, H]``, the held-back tokens, ...) are passed whole; a per-expert plan (a ``[E]`` tensor such as
  heapr's widths) is narrowed the same way;
- :func:`take` applies a selection (``expert_prune``'s kept experts, decided once on the shell) to a
  chunk's bank.

:func:`join_bank` makes, from the chunks' output banks, the bank of the whole output layer on the
``meta`` device, with its small index vectors (live widths, members) real: encoding it
(:func:`moecompress.io.format.encode_layer`) gives the whole layer's tensor names, shapes, dtypes and
description, exactly as a whole-layer run writes them, while the chunks' bytes go to the writer as they
are produced. The ``merge_*`` functions make a layer's step ``info`` from its chunks' infos.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moecompress.calibration.catalogue import CATALOGUE
from moecompress.errors import PassError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts import LAYOUTS
from moecompress.layouts.base import Layout
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged

PROJ = ("gate", "up", "down")


def bounds(num_experts: int, size: int) -> list[tuple[int, int]]:
    """``[(0, size), (size, 2 size), ...]`` covering ``num_experts`` experts."""
    return [(a, min(a + size, num_experts)) for a in range(0, num_experts, size)]


def _expert_dims() -> dict[str, int]:
    """Stored statistic name -> position of its expert dimension (statistics of one tensor only)."""
    out = {}
    for name, info in CATALOGUE.items():
        groups = re.findall(r"\[([^\]]*)\]", info.shape)
        if info.tensors or len(groups) != 1:
            continue  # companions (io_sample, holdout, route_attrib) have no expert dimension of this layer
        dims = [d.strip() for d in groups[0].split(",") if d.strip()]
        if "E" in dims:
            out[name] = dims.index("E")
    return out


EXPERT_DIMS = _expert_dims()


def slice_stats(
    stats: Mapping[str, torch.Tensor], num_experts: int, a: int, b: int
) -> dict[str, torch.Tensor]:
    """Experts ``[a, b)``'s view of a layer's statistics (see the module docstring); a statistic whose
    expert dimension is not ``num_experts`` long (collected before experts were removed) is passed whole,
    as a whole-layer run passes it."""
    out = {}
    for name, t in stats.items():
        d = EXPERT_DIMS.get(name)
        fits = d is not None and t.dim() > d and t.shape[d] == num_experts
        out[name] = t.narrow(d, a, b - a) if fits else t  # type: ignore[arg-type]
    return out


def slice_plan(plan: Any, num_experts: int, a: int, b: int) -> Any:
    """A step's per-layer decision for experts ``[a, b)``: an ``[E, ...]`` tensor narrowed, else as is."""
    if isinstance(plan, torch.Tensor) and plan.dim() >= 1 and plan.shape[0] == num_experts:
        return plan[a:b]
    return plan


def chunk_router(layer: MoELayer, n: int):
    spec = layer.router
    return dataclasses.replace(spec, num_experts=n, top_k=min(spec.top_k, n), n_group=None, topk_group=None,
                               group_score=None)  # fmt: skip


def sub_layer(shell: MoELayer, bank: ExpertBank, a: int) -> MoELayer:
    """The chunk of ``shell``'s experts ``[a, a + bank.num_experts)`` holding ``bank`` (module docstring)."""
    if shell.expert_map is not None:
        raise PassError(
            f"layer {shell.index}: merged experts (expert_map) cannot be held by chunks of experts"
        )
    b = a + bank.num_experts

    def rows(t):
        return None if t is None else t[a:b]

    return shell.replace(
        router=chunk_router(shell, bank.num_experts), router_weight=shell.router_weight[a:b],
        router_bias=rows(shell.router_bias), score_bias=rows(shell.score_bias), experts=bank,
        protected=frozenset(p - a for p in shell.protected if a <= p < b), routing=None, routing_similarity=None,
    )  # fmt: skip


def meta_bank(bank: ExpertBank, a: int, b: int) -> ExpertBank:
    """Experts ``[a, b)`` of a dense (``meta``) bank: the shell's experts narrowed (dry-run estimates)."""
    lays = [Dense(getattr(bank, p).dense()[a:b]) for p in PROJ]
    return ExpertBank(*lays, biases={k: v[a:b] for k, v in bank.biases.items()}, act=bank.act, alpha=bank.alpha,
                      limit=bank.limit)  # fmt: skip


def cat_banks(banks: list[ExpertBank]) -> ExpertBank:
    """Dense banks' experts one after the other (a unit of groups' members, read in runs of ids)."""
    first = banks[0]
    if len(banks) == 1:
        return first
    for b in banks:
        if not all(isinstance(getattr(b, p), Dense) for p in PROJ) or b.widths is not None or b.rotation is not None:
            raise PassError("only dense experts can be read group by group")
    lays = [Dense(torch.cat([getattr(b, p).dense() for b in banks])) for p in PROJ]
    biases = {k: torch.cat([b.biases[k] for b in banks]) for k in first.biases}
    return ExpertBank(*lays, biases=biases, act=first.act, alpha=first.alpha, limit=first.limit)


def runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending ``ids`` as runs ``[a, b)`` of consecutive ids."""
    out: list[tuple[int, int]] = []
    for e in ids:
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


# -- selections --------------------------------------------------------------------------------------
def _take_layout(lay: Layout, idx: torch.Tensor, keep: list[int]) -> Layout:
    if isinstance(lay, Dense):
        return Dense(lay.weight.index_select(0, idx))
    if isinstance(lay, Ragged):
        rows = torch.cat([lay.live(e) for e in keep]) if keep else lay.rows[:0]
        return dataclasses.replace(lay, rows=rows, widths=lay.widths.index_select(0, idx))
    raise PassError(f"a selection of experts cannot take experts of a {lay.kind!r} layout by chunks")


def take(bank: ExpertBank, keep: list[int]) -> ExpertBank:
    """Experts ``keep`` (ascending local ids) of a chunk's bank, as ``expert_prune`` takes them."""
    idx = torch.tensor(
        keep, dtype=torch.long, device=bank.gate.tensors()[next(iter(bank.gate.tensors()))].device
    )
    return ExpertBank(
        *(_take_layout(getattr(bank, p), idx, keep) for p in PROJ),
        widths=None if bank.widths is None else bank.widths.index_select(0, idx.to(bank.widths.device)),
        biases={k: v.index_select(0, idx.to(v.device)) for k, v in bank.biases.items()},
        act=bank.act, alpha=bank.alpha, limit=bank.limit,
    )  # fmt: skip


def selected(kept: Sequence[int] | None, start: int, stop: int) -> tuple[list[int], int]:
    """A chunk holding experts ``[start, stop)`` of a step's input, after a selection ``kept`` (old ids in
    the new order, ascending): the local ids it keeps and the new id of its first expert."""
    if kept is None:
        return list(range(stop - start)), start
    if any(x >= y for x, y in itertools.pairwise(kept)):
        raise PassError("the step reorders experts, which a layer held by chunks of experts cannot follow")
    local = [k - start for k in kept if start <= k < stop]
    return local, sum(1 for k in kept if k < start)


def as_kind(before: MoELayer, after: MoELayer, kind: str | None) -> MoELayer:
    """A chunk's output in the layer's output ``kind`` (a chunk whose experts all kept their width is
    unchanged, or dense, while the layer is ragged: as a ragged chunk of full widths, as the whole-layer
    pruning writes them)."""
    if kind is None or kind == "dense":
        return after
    if kind == "unchanged":
        if after is not before:
            raise PassError(
                f"layer {before.index}: a chunk changed although the layer's plan changes nothing"
            )
        return after
    bank = after.experts
    lays = [getattr(bank, p) for p in PROJ]
    if all(isinstance(x, Ragged) for x in lays):
        return after
    width = before.experts.width
    new = []
    for lay, axis in zip(lays, ("out", "out", "in")):
        w = lay.weight if axis == "out" else lay.weight.transpose(1, 2)  # type: ignore[attr-defined]
        n, live, h = w.shape
        new.append(
            Ragged(
                w.reshape(n * live, h).contiguous(), torch.full((n,), live, dtype=torch.int64), width, axis
            )
        )
    biases = {}
    for k, b in bank.biases.items():
        biases[k] = (
            b
            if k == "down" or b.shape[1] == width
            else torch.cat([b, b.new_zeros(b.shape[0], width - b.shape[1])], 1)
        )
    return after.replace(
        experts=ExpertBank(*new, biases=biases, act=bank.act, alpha=bank.alpha, limit=bank.limit)
    )


# -- joining chunks ----------------------------------------------------------------------------------
def _index_vector(name: str, t: torch.Tensor) -> bool:
    """Per-expert index vectors (live widths, members): small, joined for real."""
    return t.dim() == 1 and not t.is_floating_point()


def join_tensors(
    parts: list[dict[str, torch.Tensor]], shared: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """One layout's (or bank's) tensors from its chunks': index vectors concatenated for real (``members``,
    which index the compressed experts in expert-id order, offset by the earlier chunks' count), the
    ``shared`` ones (``Layout.shared``: the same in every chunk) once, every other tensor as a ``meta``
    tensor of the concatenated shape (along the first dimension)."""
    out: dict[str, torch.Tensor] = {}
    names = [n for n in dict.fromkeys(k for p in parts for k in p)]
    for name in names:
        have = [p[name] for p in parts if name in p]
        if name in shared:
            if len(have) != len(parts) or len({(tuple(t.shape), t.dtype) for t in have}) > 1:
                raise PassError(f"the chunks' shared tensor {name!r} differs in shape between chunks")
            out[name] = torch.empty_like(have[0], device="meta")
            continue
        if _index_vector(name, have[0]):
            if name.endswith("members"):
                fixed, seen = [], 0
                for t in have:
                    t = t.to("cpu")
                    fixed.append(torch.where(t >= 0, t + seen, t))
                    seen += int((t >= 0).sum())
                have = fixed
            out[name] = torch.cat([t.to("cpu") for t in have])
        else:
            rows = sum(int(t.shape[0]) for t in have)
            out[name] = torch.empty((rows, *have[0].shape[1:]), dtype=have[0].dtype, device="meta")
    return out


def join_bank(banks: list[ExpertBank]) -> ExpertBank:
    """The whole output bank (``meta``, index vectors real) of the chunks' output ``banks``."""
    first = banks[0]
    lays = []
    for p in PROJ:
        kinds = {getattr(b, p).kind for b in banks}
        if len(kinds) > 1:
            raise PassError(f"the chunks' {p} projections have different layouts {sorted(kinds)}")
        lay = getattr(first, p)
        meta = {**lay.meta(), "shape": [sum(getattr(b, p).shape[0] for b in banks), *lay.shape[1:]]}
        lays.append(
            LAYOUTS[lay.kind].from_tensors(join_tensors([getattr(b, p).tensors() for b in banks], lay.shared), meta)
        )
    widths = None
    if any(b.widths is not None for b in banks):
        widths = torch.cat([
            b.widths.to("cpu", torch.int64) if b.widths is not None else torch.full((b.num_experts,), b.width)
            for b in banks
        ])  # fmt: skip
    biases = join_tensors([dict(b.biases) for b in banks]) if first.biases else {}
    # a rotation of the bank's input (codequant) is the layer's, the same in every chunk; the experts that
    # read the unrotated input are renumbered into the layer
    if len({(b.rotation is None, None if b.rotation is None else tuple(b.rotation.shape), b.act_bits)
            for b in banks}) > 1:  # fmt: skip
        raise PassError("the chunks' experts do not share one input rotation and activation quantiser")
    unrotated, seen = set(), 0
    for b in banks:
        unrotated |= {e + seen for e in b.unrotated}
        seen += b.num_experts
    return ExpertBank(
        *lays,
        widths=widths,
        biases=biases,
        act=first.act,
        alpha=first.alpha,
        limit=first.limit,
        rotation=None if first.rotation is None else torch.empty_like(first.rotation, device="meta"),
        act_bits=first.act_bits,
        unrotated=frozenset(unrotated),
    )
