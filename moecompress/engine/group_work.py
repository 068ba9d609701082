"""A merging step's units of groups (``Chunking('group')``) on whichever rank owns them: unit ``k`` of
``decision.units(size)`` by rank ``k mod N``. Rank 0 takes every unit's parts in unit order
(:func:`moecompress.engine.layer_run._grouped_layer`); the other ranks send theirs through the wire of
:mod:`moecompress.engine.shard` (:func:`moecompress.engine.shard.follow`). Every rank decides the groups
itself (:func:`~moecompress.engine.unit_work.prepare`: the same summaries folded in the same order, the
same decision), so only the units' results travel:

- the unwritten pass (``decision.sweeps == 2``, ``namex``'s refinement): each unit's info, with its shares
  of the held-back outputs; rank 0 folds them in unit order, chooses, and broadcasts the choice
  (:data:`CHOICES`);
- the written pass: each unit's contributions to the reconstruction error (before the merge on its members,
  after it on its output experts, :class:`~moecompress.engine.held_back.ErrPart`) and its output's
  :class:`~moecompress.engine.unit_work.StepPart` (skeleton, info, encoded tensors of a written step).

Rank 0 adds them as one process does, in the same order: the bytes are one process's."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from moecompress.engine import chunks
from moecompress.engine.unit_work import ErrPart, LayerPlan, StepPart, encode_chunk, skeleton
from moecompress.ir import ExpertBank, layer_to

CHOICES = ("unrefined", "complex")
"""The whole-layer choices a decision can make (``GroupDecision.choice``), by their index on the wire."""


def members(lp: LayerPlan, g: int, lo: int, hi: int) -> tuple[list[int], ExpertBank]:
    """Groups ``[lo, hi)``'s input experts (ascending) and their bank, read in runs of consecutive ids, on the
    step's device."""
    step, dec = lp.steps[g], lp.preludes[g]
    mem = dec.members(lo, hi)
    bank = chunks.cat_banks([lp.ckpt.read_experts(lp.idx, a, b) for a, b in chunks.runs(mem)])
    where = torch.device(lp.ctx.device) if step.spec.on_device else torch.device("cpu")
    return mem, layer_to(bank, where) if where.type != "cpu" else bank


def trial(lp: LayerPlan, g: int, lo: int, hi: int) -> dict:
    """The unwritten pass on groups ``[lo, hi)``: the unit's info with every candidate's shares."""
    step = lp.steps[g]
    return step.spec.chunking.unit(lp.preludes[g], lo, hi, members(lp, g, lo, hi)[1], step.config)[1]


def unit_parts(lp: LayerPlan, g: int, lo: int, hi: int, written: bool) -> list[ErrPart | StepPart]:
    """The written pass on groups ``[lo, hi)``: the error contributions of the states up to the merge on the
    members, the merge (``Chunking.unit``), those of the later states on its output experts (through the
    expert map), and the output's part (its tensors encoded when the step is ``written``)."""
    t0 = time.perf_counter()
    steps, step, dec, shells, err = lp.steps, lp.steps[g], lp.preludes[g], lp.shells, lp.err
    mem, bank = members(lp, g, lo, hi)
    out: list[ErrPart | StepPart] = []
    if err is not None:
        rows = torch.full((shells[g].router.num_experts,), bank.num_experts, dtype=torch.long)
        rows[torch.tensor(mem)] = torch.arange(bank.num_experts)
        out += [err.part_rows(state, bank, rows) for state in range(g + 1)]  # the input, the protections
    new, info = step.spec.chunking.unit(dec, lo, hi, bank, step.config)
    del bank
    new = layer_to(chunks.sub_layer(shells[0], new, 0), torch.device("cpu")).experts
    if err is not None:
        n_out = dec.shell.experts.num_experts
        emap = dec.shell.expert_map if dec.shell.expert_map is not None else torch.arange(n_out)
        rows = torch.where((emap >= lo) & (emap < hi), emap - lo, torch.full_like(emap, hi - lo))
        out += [err.part_rows(state, new, rows) for state in range(g + 1, len(steps) + 1)]  # the merge, reports
    stock, writes = None, []
    if written:
        stock, writes = encode_chunk(lp.ckpt, lp.idx, chunks.sub_layer(shells[0], new, 0), lo,
                                     stock=False if dec.shell.expert_map is not None else None)  # fmt: skip
    out.append(StepPart(g, lo, skeleton(new), time.perf_counter() - t0, info, stock=stock, writes=writes))
    return out


def owned(units: list[tuple[int, int]], rank: int, world: int) -> Iterator[tuple[int, int]]:
    """The units rank ``rank`` works (``k mod world``)."""
    return (u for k, u in enumerate(units) if k % world == rank)
