"""Expert-sharded calibration: under ``N`` ``torch.distributed`` ranks, each MoE layer's experts are split
over the ranks, and a rank reads, holds and runs only its own (``calibration.parallel: auto``).

It is the two-phase forward of :mod:`moecompress.calibration.chunked` spread over the ranks. Rank ``r``
owns the batches ``b % N == r`` (as in data-parallel calibration) and the chunks of experts ``k % N == r``
(``expert_chunk``'s size, else ``ceil(E / (N · UNITS_PER_RANK))``). For MoE layer ``i``:

1. each rank runs its own batches through the decoder layer with :class:`~.chunked.RecordingMoE`: it keeps
   ``h1_b`` (the residual after attention) and the MoE input ``u_b``;
2. the ``u_b`` are all-gathered round by round (one batch per rank): every rank has every batch's input;
3. every rank routes every batch in batch order and records what belongs to no expert (``on_input``,
   ``on_route``): the same values on every rank, those of one process;
4. in round ``j`` the ranks hold chunks ``jN .. jN+N-1``; per batch each makes its chunk's weighted expert
   outputs (:func:`~moecompress.reference.expert_terms`; its collector sees its experts), the terms of a
   group of consecutive batches are all-gathered at once (:func:`batch_groups`; safetensors, no pickle, read
   as views into the received bytes), started ahead (:class:`~.gather_ahead.GatherAhead`: the rank computes
   the next group's terms meanwhile), and every rank adds every chunk's terms in chunk order, which is expert
   order, to each batch's fp32 accumulators: the additions of one process, bit for bit;
5. rank 0 finishes every batch (shared expert, ``on_output``), the others their own; each rank returns
   ``h1_b + moe_b`` for its own batches;
6. per-expert statistics reach rank 0, which keeps the layer's: spilled covariances
   (``save_experts``) chunk by chunk in chunk order, the other per-expert rows (sums, counts, maxima)
   expert by expert at the end (:meth:`~moecompress.calibration.stats.StatsCollector.expert_rows`), with
   the rows of the sums kept by blocks of experts (``down_in_cov_pooled``, :data:`BY_BLOCKS`: the chunks
   are then unions of blocks) and the chunk's experts' outputs on the Ward tokens (``expert_out_gram``: each
   rank samples its chunks as ``calibration/chunked.py`` does; rank 0 makes the Gram).

So rank 0's statistics are one process's, bit for bit, for every statistic but the routing trace
(``route_attrib``), and the layers :func:`shardable` refuses run data-parallel instead. Traffic per layer and rank: every batch's MoE input once
and the weighted outputs of the other ranks' experts (``(N-1)/N`` of ``T·k`` rows of ``H`` fp32). Held
per rank: its chunk, the layer's shell and attention, every batch's ``u_b``, the fp32 accumulators of the
batches it finishes, and its own ``h1_b``; the per-expert covariances of its own experts only, except on
rank 0, which keeps the layer's statistics as one process does.
"""

from __future__ import annotations

import functools

import torch
from safetensors.torch import save

from moecompress.calibration import moe_backward as mb
from moecompress.calibration.chunked import ChunkedLayer, _flat
from moecompress.calibration.gather_ahead import GatherAhead
from moecompress.calibration.skeleton import run_batch, to_device
from moecompress.calibration.stats import POOLED_BY_BLOCK
from moecompress.io.shard_format import load_buffer
from moecompress.ir import fold_block_size
from moecompress.reference import Term, add_term, expert_terms, shared_forward

NOT_SHARDED = frozenset({"route_attrib"})
"""Statistics an expert-sharded layer does not give bit for bit: calibration stays data-parallel."""

BY_BLOCKS = frozenset(POOLED_BY_BLOCK)
"""Statistics summed over experts by fixed blocks (:data:`~moecompress.calibration.stats.POOLED_BY_BLOCK`):
sharded when the chunks are unions of blocks (:func:`aligned`), each block's row sent by its owner; the
forward's is ``down_in_cov_pooled``, the backward's ``down_in_grad_cov_pooled``."""
GRAD_BY_BLOCKS = frozenset({"down_in_grad_cov_pooled"}) & BY_BLOCKS


UNITS_PER_RANK = 2
"""A layer's experts in ``N · UNITS_PER_RANK`` chunks when the run does not chunk it (calibration here, the layer
loop in :func:`moecompress.engine.units.unit_size`): each rank holds half its share of a layer at a time (rtn
at Qwen3-30B widths, 2 ranks: per-rank peak 0.66 → 0.59 of one process's, `benchmarks/RESULTS.md`)."""


GATHER_BYTES = 64 << 20
"""What one all-gather of expert terms carries at most per rank (estimated; a batch whose terms are larger goes
alone). A batch's work differs by rank (its tokens' routing to each rank's experts), so a gather per batch made
each rank wait for the slower one batch by batch: a group of batches per gather waits once for the group (heapr,
Qwen3-30B widths, 2 ranks, 2 layers, py-spy: both ranks' seconds in calibration's gathers 4.5 -> 4.2; the rest is
the ranks' imbalance per round of chunks, `benchmarks/RESULTS.md`)."""


def batch_groups(tokens: list[int], row_bytes: int, world: int, budget: int | None = None) -> list[list[int]]:
    """Consecutive batches (``tokens[b]`` tokens each) in groups whose terms, ``tokens · row_bytes / world``
    bytes per rank, stay within ``budget`` (default :data:`GATHER_BYTES`; a batch above it alone). Every rank
    computes the same groups from the batches' shapes, which every rank has: the gathers match."""
    budget = GATHER_BYTES if budget is None else budget
    groups: list[list[int]] = []
    held = budget + 1
    for b, t in enumerate(tokens):
        size = t * row_bytes // max(world, 1)
        if held + size > budget:
            groups.append([])
            held = 0
        groups[-1].append(b)
        held += size
    return groups


def _loaded(parts: list[torch.Tensor], batches: list[int], rank: int) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Every other rank's terms of ``batches`` (gathered :func:`_terms_blob` / :func:`_grad_blob`; views into the
    received bytes), by rank, then batch; this rank's own are not read (it adds the terms it made)."""
    out = []
    for r, got in enumerate(parts):
        by_batch: dict[int, dict[str, torch.Tensor]] = {b: {} for b in batches}
        for key, v in (load_buffer(got) if r != rank else {}).items():
            b, _, rest = key.partition(":")
            by_batch[int(b)][rest] = v
        out.append(by_batch)
    return out


def _aligned(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of received safetensors bytes, copied: they enter matmuls (the router, the experts), and a
    view into the bytes is only 8-byte aligned, which changed the router's statistics in their last bits
    (``tests/test_expert_sharded.py``). Terms are only added (``index_add_``): they stay views."""
    return {k: v.clone() for k, v in load_buffer(buf).items()}


def default_size(ckpt, world: int, needs=()) -> int:
    """Experts per chunk of a layer the run does not chunk: ``ceil(E / (N · UNITS_PER_RANK))``; where a
    statistic is summed by blocks of experts (:data:`BY_BLOCKS`), the largest multiple of the block size not
    above it (one block at least), so that every chunk is a union of blocks."""
    e = int(ckpt.adapter.num_experts)
    size = -(-e // (world * UNITS_PER_RANK))
    if BY_BLOCKS & set(needs):
        block = fold_block_size(e)
        size = block * max(1, size // block)
    return size


def aligned(ckpt, size: int) -> bool:
    """Whether chunks of ``size`` experts are unions of :func:`~moecompress.ir.fold_blocks`' blocks."""
    return size % fold_block_size(int(ckpt.adapter.num_experts)) == 0 or size >= int(ckpt.adapter.num_experts)


def backward_shardable(needs, ckpt, i: int, size: int) -> bool:
    """Whether MoE layer ``i``'s streamed backward can run with its experts split over the ranks in chunks of
    ``size``: the expert-by-expert backward (:func:`~moecompress.calibration.moe_backward.canonical`), no
    :data:`~moecompress.calibration.moe_backward.NOT_SHARDED` statistic, and chunks that are unions of blocks
    where a statistic is summed by blocks (:data:`BY_BLOCKS`)."""
    if not mb.canonical(ckpt, i, needs) or set(needs) & mb.NOT_SHARDED:
        return False
    return not (GRAD_BY_BLOCKS & set(needs)) or aligned(ckpt, size)


def shardable(needs, on_layer, ckpt, i: int, size: int) -> bool:
    """Whether MoE layer ``i`` can be calibrated with its experts split over the ranks in chunks of ``size``:
    stock tensors, ``propagate: original`` (no ``on_layer``), none of :data:`NOT_SHARDED` needed, and chunks
    that are unions of blocks where a statistic is summed by blocks (:data:`BY_BLOCKS`, :func:`aligned`)."""
    if on_layer is not None or i in ckpt.layouts or set(needs) & NOT_SHARDED:
        return False
    return not ((BY_BLOCKS - GRAD_BY_BLOCKS) & set(needs)) or aligned(ckpt, size)


def _terms_blob(terms: dict[int, list[Term]]) -> bytes:
    """A group's terms by batch (``{b: terms}``) as safetensors (``"b:expert.space"``)."""
    out = {}
    for b, ts in terms.items():
        for t in ts:
            out[f"{b}:{t.expert}.{t.space}"] = t.part.cpu()
            if t.bias is not None:
                out[f"{b}:{t.expert}.bias"] = t.bias.cpu()
    return save(out)


def _add_blob(got: dict[str, torch.Tensor], phys: torch.Tensor, out: torch.Tensor, acc: dict, dev: torch.device) -> None:
    """Add a rank's terms of one batch (:func:`_loaded`) in expert order, as :func:`expert_terms` made them."""
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in got.items():
        q, _, kind = key.partition(".")
        experts.setdefault(int(q), {})[kind] = v
    for q in sorted(experts):
        parts = experts[q]
        bias = parts.pop("bias", None)
        ((space, part),) = parts.items()
        tok = torch.where(phys == q)[0]
        add_term(Term(q, tok, space, part.to(dev), None if bias is None else bias.to(dev)), out, acc)


def forward_layer(skel, i: int, size: int, group, hidden: list, kwargs: list, holdout: list[bool], needs,
                  sample_tokens: int, save_experts=None) -> tuple[list[torch.Tensor], object]:  # fmt: skip
    """Layer ``i``'s outputs for this rank's batches (``hidden[j]`` is global batch ``group.share(n)[j]``,
    released once recorded) and its forward statistics' collector (complete on rank 0)."""
    n, world, rank = len(holdout), group.world_size, group.rank
    mine = group.share(n)
    layer = ChunkedLayer(skel, i, size)
    # ranks other than 0 keep the per-expert covariances of their own experts only (spilled, then sent)
    spill = save_experts is not None or rank > 0
    col, dev, cpu = layer.collector(needs, sample_tokens, spill=spill), skel.device, torch.device("cpu")
    mod = layer.module()
    h1s, us = [], [None] * n
    with torch.no_grad():
        for k in range(group.rounds(n)):  # attention on this rank's batches; the MoE inputs to every rank
            blob = save({})
            if k < len(hidden):
                args, kw = kwargs[k][i]
                h1s.append(run_batch(mod, hidden[k], args, kw, dev))
                blob = save({"u": _flat(layer.recorder.seen).to(cpu).contiguous()})
                layer.recorder.seen = hidden[k] = None
            for r, got in enumerate(group.all_gather_buffers(blob)):
                if got := _aligned(got):
                    us[k * world + r] = got["u"]
        del mod
        finish = range(n) if rank == 0 else mine  # rank 0 keeps the layer's statistics
        states, phys, outs, accs = [], [], {}, {}
        for b, u in enumerate(us):  # the router once per batch, in batch order, on every rank
            col.mode = "holdout" if holdout[b] else "stats"
            u = u.to(dev)
            col.on_input(u)
            logits, ids, w, p = layer.route(u)
            col.on_route(logits, ids, w)
            states.append(col.batch_state())
            phys.append(p)
        for b in finish:
            outs[b] = torch.zeros(us[b].shape, dtype=torch.float32, device=dev)
            accs[b] = {"out": outs[b]}
        chunks = len(layer.ranges)
        row = layer.shell.router.top_k * us[0].shape[-1] * 4 if us else 0  # a term's row: H fp32
        groups = batch_groups([u.shape[0] for u in us], row, world)

        def add(batches: list[int], terms: dict[int, list[Term]], parts: list[torch.Tensor]) -> None:
            got = _loaded(parts, batches, rank)
            for b in batches:
                if b not in outs:
                    continue
                for r in range(world):
                    if r == rank:
                        for t in terms[b]:
                            add_term(t, outs[b], accs[b])
                    else:
                        _add_blob(got[r][b], phys[b], outs[b], accs[b], dev)

        with GatherAhead(group) as ahead:
            for j in range(-(-chunks // world)):  # round j: chunk jN + r on rank r
                k = j * world + rank
                first, bank = layer.chunk(k, check=True) if k < chunks else (0, None)
                for batches in groups:
                    terms: dict[int, list[Term]] = {b: [] for b in batches}
                    for b in batches:
                        if bank is not None:
                            col.mode = "holdout" if holdout[b] else "stats"
                            u = us[b].to(dev)
                            col.resume_batch(states[b], u)
                            terms[b] = list(expert_terms(bank, u, phys[b], states[b][2], col, first))
                    ahead.start(_terms_blob(terms), functools.partial(add, batches, terms))
                    del terms
                if bank is not None:  # expert_out_gram: the chunk's experts on the Ward tokens (every rank has them)
                    col.mode = "stats"
                    col.sample_chunk(first, bank)
                bank = None
                if save_experts is not None:
                    ahead.drain()  # point to point next: no gather in flight
                    _spilled(group, layer, col, save_experts, i, j)
        _expert_rows(group, layer, col)
        result = []
        for b in finish:
            col.mode = "holdout" if holdout[b] else "stats"
            u = us[b].to(dev)
            col.resume_batch(states[b], u)
            out = outs[b]
            for space, value in accs[b].items():
                if value is not out:
                    out += layer.shell.experts.down.decode(space, value).float()
            if layer.shell.shared is not None:
                out = out + shared_forward(layer.shell, u, col)
            moe = out.to(u.dtype)
            col.on_output(moe)
            if b in mine:
                h1 = h1s[mine.index(b)]
                result.append(h1 + to_device(moe, cpu).reshape(h1.shape))
            outs[b] = accs[b] = us[b] = None
    return result, col


def _spilled(group, layer: ChunkedLayer, col, save_experts, i: int, j: int) -> None:
    """Round ``j``'s spilled covariances to rank 0, which saves them in chunk (expert) order."""
    world, rank = group.world_size, group.rank
    for r in range(world):
        k = j * world + r
        if k >= len(layer.ranges):
            break
        a, b = layer.ranges[k]
        for e in range(a, b):
            if r == rank:
                rows = col.spill(e, e + 1)
                if rank == 0:
                    save_experts(i, e, rows)
                else:
                    group.send_bytes(save(rows), 0)
            elif rank == 0:
                save_experts(i, e, load_buffer(group.recv_buffer(r)))


def _expert_rows(group, layer: ChunkedLayer, col) -> None:
    """The per-expert rows of the other ranks' chunks to rank 0, expert by expert, in chunk order."""
    world, rank = group.world_size, group.rank
    for k, (a, b) in enumerate(layer.ranges):
        owner = k % world
        if owner == 0:
            continue
        for e in range(a, b):
            if rank == owner:
                group.send_bytes(save(col.expert_rows(e, e + 1)), 0)
            elif rank == 0:
                col.put_expert_rows(e, e + 1, load_buffer(group.recv_buffer(owner)))


def _grad_blob(terms: dict[int, list[mb.GradTerm]]) -> bytes:
    """A group's gradient terms by batch (``{b: terms}``) as safetensors (``"b:expert.x"``, ``"b:expert.w"``)."""
    out = {}
    for b, ts in terms.items():
        for t in ts:
            out[f"{b}:{t.expert}.x"], out[f"{b}:{t.expert}.w"] = t.x.cpu(), t.w.cpu()
    return save(out)


def _add_grad_blob(got: dict[str, torch.Tensor], p: mb.Pending, dev: torch.device) -> None:
    """Add a rank's terms of one batch (:func:`_loaded`) in expert order, as
    :func:`~.moe_backward.expert_grad_terms` made them (their rows follow from the batch's routing, the same on
    every rank)."""
    for q in sorted({int(key.partition(".")[0]) for key in got}):
        tok, slot = torch.where(p.phys == q)
        mb.add_grad_term(mb.GradTerm(q, tok, slot, got[f"{q}.x"].to(dev), got[f"{q}.w"].to(dev)), p)


def backward_layer(skel, i: int, size: int, group, inputs: list, kwargs: list, grads: dict, needs, share,
                   sample_tokens: int):  # fmt: skip
    """The streamed backward through MoE layer ``i`` with its experts split over the ranks: this rank's
    ``grads[k]`` (local batch ``k``, w.r.t. the layer's output) become the gradients w.r.t. ``inputs[k]``;
    returns the gradient statistics' collector (complete on rank 0).

    The expert-by-expert backward of :mod:`~moecompress.calibration.moe_backward`, spread as
    :func:`forward_layer` spreads the forward: each rank records its own batches' ``u_b`` and all-gathers
    them with their gradients ``g_b`` round by round; every rank routes every batch; in round ``j`` rank
    ``r`` reads chunk ``jN + r`` and makes its experts' terms for every batch (its collector sees their
    gradient statistics), the terms are all-gathered and each batch's owner adds them in chunk order, which
    is expert order; rank 0 sees every batch's ``g_b`` (``out_grad_cov``) and receives the other ranks'
    per-expert rows. Then each rank closes its own batches (shared expert, router, the recomputed decoder
    layer). Rank 0's statistics and every gradient are one process's bits."""
    _, mine, rounds = share
    world, rank, dev = group.world_size, group.rank, skel.device
    layer = ChunkedLayer(skel, i, size)
    col = layer.collector(needs, sample_tokens)
    col.mode = "backward"
    mod = layer.module()
    us: dict[int, torch.Tensor] = {}
    gs: dict[int, torch.Tensor] = {}
    for k in range(rounds):
        blob = save({})
        if k in grads:
            args, kw = kwargs[k][i]
            u = mb.record(layer, mod, inputs[k], args, kw, dev)
            blob = save({"u": u.contiguous(), "g": _flat(grads[k]).cpu().contiguous()})
            del u
        for r, got in enumerate(group.all_gather_buffers(blob)):
            if got := _aligned(got):
                us[k * world + r], gs[k * world + r] = got["u"], got["g"]
    mod = None  # not held while the chunks are: read again for the last recomputation
    own = {mine[k] for k in grads}
    order = sorted(us)
    tokens = {b: int(us[b].shape[0]) for b in order}
    us_width = int(us[order[0]].shape[-1]) if order else 0
    pend = {b: mb.open_batch(layer, us[b], gs[b], col if rank == 0 else None, dev, finish=b in own) for b in order}
    del us, gs
    chunks = len(layer.ranges)
    row = layer.shell.router.top_k * (us_width + 1) * 4  # a term's row: x (H fp32) and w (fp32)
    groups = [[order[b] for b in g] for g in batch_groups([tokens[b] for b in order], row, world)]

    def add(batches: list[int], terms: dict[int, list[mb.GradTerm]], parts: list[torch.Tensor]) -> None:
        got = _loaded(parts, batches, rank)
        for b in batches:
            p = pend[b]
            if p.gu is None:
                continue
            for r in range(world):
                if r == rank:
                    for t in terms[b]:
                        mb.add_grad_term(t, p)
                else:
                    _add_grad_blob(got[r][b], p, dev)

    with GatherAhead(group) as ahead:
        for j in range(-(-chunks // world)):  # round j: chunk jN + r on rank r
            k = j * world + rank
            first, bank = layer.chunk(k, check=False) if k < chunks else (0, None)
            for batches in groups:
                terms = {b: mb.chunk_terms(bank, first, pend[b], col, dev) if bank is not None else [] for b in batches}
                ahead.start(_grad_blob(terms), functools.partial(add, batches, terms))
                del terms
            bank = None
    _expert_rows(group, layer, col)
    for b in order:
        if b not in own:
            pend[b] = None
    mod = layer.module()
    for k in grads:
        args, kw = kwargs[k][i]
        grads[k] = mb.close_batch(layer, mod, inputs[k], args, kw, pend[mine[k]], col, dev)
        pend[mine[k]] = None
    return col
