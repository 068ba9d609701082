"""Layer-major calibration: a streamed forward sweep and a streamed backward.

Forward: embeddings -> for each decoder layer, materialise only that layer, run every batch through
transformers' own layer module (its MoE block swapped for the instrumented reference forward), record
the statistics, keep the outputs as the next layer's inputs, free the layer.

Backward (only when a gradient statistic is needed): every layer's inputs are kept from the forward
sweep (in RAM, or in a temporary safetensors file per layer when they are large); the LM loss (mean
next-token NLL over the calibration set, held-back sequences excluded) gives the gradient at the head;
then the layers are walked in reverse: materialise, recompute with grad, back-propagate the incoming
gradient, record gradient statistics, pass the input gradient down, free. Memory stays at one layer
plus activations; nothing needs the whole model.

MoE layers listed in ``expert_chunks`` are never held whole: :mod:`moecompress.calibration.chunked` runs
them (both sweeps) with their shell and one chunk of experts at a time, with the same statistics.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from moecompress.calibration.catalogue import backward_needed
from moecompress.calibration.skeleton import Skeleton, all_finite, check_finite, run_batch, to_device
from moecompress.calibration.stats import SPILLED, StatsCollector
from moecompress.calibration.stats_exchange import merge_round
from moecompress.calibration.trace import RoutingTrace
from moecompress.errors import CheckpointError, RecipeError
from moecompress.ir import MoELayer

log = logging.getLogger(__name__)

OFFLOAD_AUTO_BYTES = 2 * 1024**3

PROPAGATE_CHUNKED = (
    "calibration.propagate: compressed compresses each MoE layer whole during calibration, which expert_chunk "
    "splits into chunks of experts; use propagate: original or expert_chunk: off"
)


@dataclass
class Batches:
    """Calibration token ids split into forward batches; ``holdout[b]`` marks held-back batches."""

    ids: list[torch.Tensor]
    holdout: list[bool]

    @classmethod
    def make(cls, token_ids: torch.Tensor, holdout: int, batch_size: int) -> Batches:
        stats, held = token_ids[: len(token_ids) - holdout], token_ids[len(token_ids) - holdout :]
        ids, flags = [], []
        for part, flag in ((stats, False), (held, True)):
            for start in range(0, len(part), batch_size):
                ids.append(part[start : start + batch_size])
                flags.append(flag)
        return cls(ids, flags)

    @property
    def predicted_tokens(self) -> int:
        return sum(int(b.numel() - b.shape[0]) for b, h in zip(self.ids, self.holdout) if not h)


class _InputStore:
    """Each layer's inputs for the backward: in RAM, or one safetensors file per layer on disk."""

    def __init__(self, on_disk: bool) -> None:
        self.on_disk = on_disk
        self._ram: dict[int, list[torch.Tensor]] = {}
        self._dir = tempfile.TemporaryDirectory(prefix="moecompress-acts-") if on_disk else None

    def put(self, i: int, xs: list[torch.Tensor]) -> None:
        if self._dir is None:
            self._ram[i] = [x.clone() for x in xs]
        else:
            save_file(
                {str(b): x.contiguous() for b, x in enumerate(xs)}, str(Path(self._dir.name) / f"{i}.st")
            )

    def get(self, i: int) -> list[torch.Tensor]:
        if self._dir is None:
            return self._ram.pop(i)
        path = Path(self._dir.name) / f"{i}.st"
        d = load_file(str(path))
        path.unlink()
        return [d[str(b)] for b in range(len(d))]

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()


class Group(Protocol):
    """The ranks of a data-parallel calibration (:class:`moecompress.engine.distributed.Ranks`)."""

    rank: int
    world_size: int

    def share(self, n: int) -> list[int]: ...
    def rounds(self, n: int) -> int: ...
    def all_gather_bytes(self, blob: bytes) -> list[bytes]: ...
    def all_gather_buffers(self, blob: bytes) -> list[torch.Tensor]: ...
    def all_gather_f64(self, values: list[float], length: int) -> list[list[float]]: ...
    def all_sum_int(self, value: int) -> int: ...


RANK_0_ALONE = frozenset({"route_attrib"})
"""Statistics no split of the calibration collects (the ``route_attrib`` trace follows the first tokens of the
run, layer after layer, whichever rank's batches hold them): under ``torchrun`` rank 0 calibrates alone while the
other ranks wait, and they read its cache entry (:func:`moecompress.engine.executor.calibrate_stats`)."""


def _check_parallel(needs, chunks: Mapping[int, int], sharded: Callable[[int], bool],
                    shard_backward: Callable[[int], bool]) -> None:  # fmt: skip
    if "route_attrib" in needs:
        raise RecipeError("route_attrib (attribute_routing) is not collected across ranks: rank 0 calibrates alone")
    held = sorted(i for i in chunks if not sharded(i))
    if not held and backward_needed(set(needs)):
        held = sorted(i for i in chunks if not shard_backward(i))
        why = ("their streamed backward needs a statistic the ranks cannot collect by chunks of experts bit for bit "
               "(expert_out_gram_fisher; down_in_grad_cov_pooled by chunks that are not unions of the layer's 8 "
               "fixed blocks of experts: make expert_chunk a multiple of ceil(experts / 8))")  # fmt: skip
    else:
        why = ("the statistics needed cannot be collected with the experts split over ranks "
               "(down_in_cov_pooled by chunks that are not unions of the layer's 8 fixed blocks "
               "of experts: make expert_chunk a multiple of ceil(experts / 8)) or calibration.parallel is "
               "batches")  # fmt: skip
    if held:
        raise RecipeError(
            f"layers {held} are calibrated by chunks of experts (expert_chunk), but {why}; run one "
            "process, or expert_chunk: off"
        )


class _BaseStream:
    """``router_sample_base`` under ``calibration.propagate: compressed``: the input checkpoint's own hidden
    states for the first batches that hold the ``io_sample`` tokens, carried through the *unmodified* layers.
    Until a step changes a layer they are the main stream's (``hidden is None``: nothing is run twice);
    afterwards each layer runs once more on those batches only. Cost: ``⌈sample_tokens / batch tokens⌉``
    batches' extra forward per layer after the first changed one, and their hidden states held twice."""

    def __init__(self, batches: Batches, sample_tokens: int) -> None:
        self.n, have = 0, 0
        while self.n < len(batches.ids) and have < sample_tokens and not batches.holdout[self.n]:
            have += batches.ids[self.n].numel()
            self.n += 1
        self.hidden: list[torch.Tensor] | None = None

    def run(self, skel: Skeleton, i: int, moe: MoELayer | None, kwargs, sample_tokens: int):
        """``(outputs, router logits of the io_sample tokens or None)`` of unmodified layer ``i``."""
        col = StatsCollector(moe, {"router_sample"}, sample_tokens) if moe is not None else None
        mod = skel.layer(i, moe, col)
        with torch.no_grad():
            outs = [run_batch(mod, x, *kwargs[b][i], skel.device) for b, x in enumerate(self.hidden or [])]
        return outs, (col.result().get("router_sample") if col is not None else None)


def _check_outputs(i: int, outs: list[torch.Tensor]) -> None:
    if not all(all_finite(o if isinstance(o, torch.Tensor) else o[0]) for o in outs):
        raise CheckpointError(
            f"decoder layer {i}: its output holds NaN/Inf (its attention or norm weights, or its inputs, are "
            "not finite); the checkpoint is damaged, or calibration.dtype overflows: try float32"
        )


OnLayer = Callable[[int, MoELayer, dict[str, torch.Tensor]], "MoELayer | None"]
"""Called after layer ``i``'s forward statistics; may return a layer to propagate with instead."""


def run_calibration(
    skel: Skeleton,
    batches: Batches,
    needs: frozenset[str] | set[str],
    *,
    sample_tokens: int = 512,
    offload: str = "auto",
    save_forward: Callable[[int, dict[str, torch.Tensor]], None],
    save_backward: Callable[[int, dict[str, torch.Tensor]], None],
    save_experts: Callable[[int, int, dict[str, torch.Tensor]], None] | None = None,
    on_layer: OnLayer | None = None,
    progress: bool = True,
    expert_chunks: Mapping[int, int] | None = None,
    ranks: Group | None = None,
    shard_experts: bool = True,
) -> dict:
    """Run the sweep(s); statistics are handed to ``save_*`` layer by layer. Returns a summary.
    ``expert_chunks``: MoE layer -> experts per chunk, the layers run by chunks of experts
    (:mod:`moecompress.calibration.chunked`; the others are held whole). ``ranks``: data-parallel over
    ``torch.distributed`` ranks (:mod:`moecompress.engine.distributed`): this rank runs the batches
    ``b % world_size == rank``; with ``shard_experts`` (``calibration.parallel: auto``) each MoE layer
    that :func:`~moecompress.calibration.expert_sharded.shardable` allows is forwarded with its experts split
    over the ranks instead (:mod:`moecompress.calibration.expert_sharded`); rank 0 (every rank, data-parallel)
    ends with the statistics of one process, bit for bit.
    ``save_experts(i, a, stats)``: the per-expert covariances of a chunked layer, and under ``ranks`` of every
    expert-sharded layer, chunk by chunk
    (:func:`moecompress.calibration.chunked.forward_layer`); ``None``: in its ``save_forward``."""
    from moecompress.calibration import chunked, expert_sharded  # they build on this module's helpers

    ckpt = skel.ckpt
    moe_layers = set(ckpt.moe_layer_indices)
    chunks = {i: n for i, n in (expert_chunks or {}).items() if i in moe_layers}
    if chunks and on_layer is not None:
        raise RecipeError(PROPAGATE_CHUNKED)
    group = ranks if ranks is not None and ranks.world_size > 1 else None

    def sharded(i: int) -> bool:
        if group is None or not shard_experts:
            return False
        size = chunks.get(i, expert_sharded.default_size(ckpt, group.world_size, needs))
        return expert_sharded.shardable(needs, on_layer, ckpt, i, size)

    # under ranks, a sharded layer's per-expert covariances are written chunk by chunk (as expert_chunk's
    # are): rank 0 never holds the layer's, and every cache layout loads the same rows (cache.ExpertRows)
    spilled = save_experts is not None and bool(set(needs) & set(SPILLED))

    def shard_backward(i: int) -> bool:
        if group is None or not shard_experts:
            return False
        size = chunks.get(i, expert_sharded.default_size(ckpt, group.world_size, needs))
        return expert_sharded.backward_shardable(needs, ckpt, i, size)

    if group is not None:
        _check_parallel(needs, chunks, sharded, shard_backward)
        if on_layer is not None and "router_sample_base" in needs:
            raise RecipeError("router_sample_base (router_robustness) under calibration.propagate: compressed is not "
                              "collected data-parallel yet; run one process")  # fmt: skip
    mine = group.share(len(batches.ids)) if group is not None else list(range(len(batches.ids)))
    rounds = group.rounds(len(batches.ids)) if group is not None else len(mine)
    backward = backward_needed(set(needs))
    captured = [skel.capture(batches.ids[b]) for b in mine]
    skel.release_embeddings()
    hidden = [h for h, _ in captured]
    kwargs = [kw for _, kw in captured]
    del captured
    n_layers = len(skel.meta_layers)
    trace = RoutingTrace() if "route_attrib" in needs else None
    act_bytes = sum(h.numel() * h.element_size() for h in hidden) * n_layers
    if group is not None:
        act_bytes = group.all_sum_int(act_bytes)
    store = None
    if backward:
        on_disk = offload == "disk" or (offload == "auto" and act_bytes > OFFLOAD_AUTO_BYTES)
        store = _InputStore(on_disk)
        log.info(
            "streamed backward: keeping %.1f MB of layer inputs %s",
            act_bytes / 1e6,
            "on disk" if on_disk else "in RAM",
        )
    base = _BaseStream(batches, sample_tokens) if on_layer is not None and "router_sample_base" in needs else None
    try:
        for i in tqdm(range(n_layers), desc="calibrate (forward)", unit="layer", disable=not progress):
            if store is not None:
                store.put(i, hidden)
            apart = base is not None and base.hidden is not None  # the base stream differs from this one
            if i in moe_layers and sharded(i):
                size = chunks.get(i, expert_sharded.default_size(ckpt, group.world_size, needs))
                outs, col = expert_sharded.forward_layer(skel, i, size, group, hidden, kwargs, batches.holdout, needs,
                                                         sample_tokens, save_experts=save_experts if i in chunks or spilled else None)  # fmt: skip
                _check_outputs(i, outs)
                st = col.result() if group.rank == 0 else {}  # rank 0 keeps the layer's statistics
                if "router_sample_base" in needs and "router_sample" in st:  # propagate: original
                    st["router_sample_base"] = st["router_sample"].clone()
                save_forward(i, st)
                hidden, col, st = outs, None, None
                continue
            if i in chunks:
                outs, col = chunked.forward_layer(skel, i, chunks[i], hidden, kwargs, batches.holdout, needs,
                                                  sample_tokens, keep_inputs=trace is not None,
                                                  save_experts=save_experts)  # fmt: skip
                _check_outputs(i, outs)
                if trace is not None:
                    trace.after_layer(i, hidden, outs, batches.holdout, col)
                st = col.result()
                if "router_sample_base" in needs and "router_sample" in st:  # no propagation on chunked layers
                    st["router_sample_base"] = st["router_sample"].clone()
                save_forward(i, st)
                hidden, col, st = outs, None, None
                continue
            moe = ckpt.read_layer(i) if i in moe_layers else None
            if moe is not None:
                check_finite(moe)
            base_outs, base_logits = None, None
            if base is not None and apart:
                base_outs, base_logits = base.run(skel, i, moe, kwargs, sample_tokens)
            col = StatsCollector(moe, needs, sample_tokens, rounds=group is not None) if moe is not None else None
            total = StatsCollector(moe, needs, sample_tokens) if group is not None and moe is not None else None
            # the routed experts cast into the chunk buffer (reused layer after layer), not into fresh memory
            mod = skel.layer(i, None if moe is None else chunked.cast_into(moe, skel.chunk_buffer, skel.dtype, skel.device), col)
            outs = []
            with torch.no_grad():
                for b in range(rounds):  # b: this rank's batch; every rank takes part in every round
                    if b < len(hidden):
                        if col is not None:
                            col.mode = "holdout" if batches.holdout[mine[b]] else "stats"
                        args, kw = kwargs[b][i]
                        outs.append(run_batch(mod, hidden[b], args, kw, skel.device))
                    if total is not None:
                        merge_round(group, col, total)
            del mod
            col = total if total is not None else col
            _check_outputs(i, outs)
            if trace is not None:
                trace.after_layer(i, hidden, outs, batches.holdout, col)
            replacement = None
            if col is not None:
                stats = col.result()
                own = base_logits if apart else stats.get("router_sample")
                if "router_sample_base" in needs and own is not None:  # the input checkpoint's own routing
                    stats["router_sample_base"] = own.clone()
                save_forward(i, stats)
                replacement = on_layer(i, moe, stats) if on_layer is not None else None
                if replacement is not None:
                    if base is not None and not apart and replacement is not moe:
                        base.hidden = outs[: base.n]  # the unmodified layer's outputs: the streams part here
                    with torch.no_grad():
                        mod = skel.layer(i, replacement, None)
                        outs = [run_batch(mod, x, *kwargs[b][i], skel.device) for b, x in enumerate(hidden)]
                        del mod
                del stats
            if base is not None and apart:
                base.hidden = base_outs
            del replacement
            # drop every reference to this layer before the next one is read: peak = one layer
            moe = col = None
            hidden = outs
        loss = None
        if store is not None:
            loss = _backward(skel, batches, needs, hidden, kwargs, store, save_backward, progress, chunks,
                             (group, mine, rounds), shard_backward, sample_tokens)  # fmt: skip
    finally:
        if store is not None:
            store.close()
    return {"batches": len(batches.ids), "backward": backward, "loss": loss, "activation_bytes": act_bytes}


def _backward(skel, batches, needs, hidden, kwargs, store, save_backward, progress, chunks, share,
              shard_backward: Callable[[int], bool], sample_tokens: int = 512) -> float:  # fmt: skip
    from moecompress.calibration import chunked, expert_sharded, moe_backward

    group, mine, rounds = share
    ckpt = skel.ckpt
    moe_layers = set(ckpt.moe_layer_indices)
    skel.load_head()
    total = batches.predicted_tokens
    grads: dict[int, torch.Tensor] = {}
    loss = 0.0
    parts: list[float] = []
    for b, h in enumerate(hidden):
        if not batches.holdout[mine[b]]:
            part, g = skel.lm_loss_and_grad(h, batches.ids[mine[b]], total)
            grads[b] = g.cpu()
            loss += part
            parts += [float(mine[b]), part]
    del hidden
    if group is not None:  # the loss summed in batch order, as one process sums it
        every = [p for rank in group.all_gather_f64(parts, 2 * rounds) for p in zip(rank[::2], rank[1::2])]
        loss = 0.0
        for _, part in sorted(every):
            loss += part
    for i in tqdm(
        reversed(range(len(skel.meta_layers))),
        desc="calibrate (backward)",
        unit="layer",
        total=len(skel.meta_layers),
        disable=not progress,
    ):
        inputs = store.get(i)
        if i in moe_layers and (i in chunks or moe_backward.canonical(ckpt, i, needs)):
            if group is not None and shard_backward(i):
                size = chunks.get(i, expert_sharded.default_size(ckpt, group.world_size, needs))
                col = expert_sharded.backward_layer(skel, i, size, group, inputs, kwargs, grads, needs, share, sample_tokens)
            elif i in chunks:  # one process (under torchrun a chunked layer is sharded or refused)
                col = moe_backward.by_chunks(skel, i, chunks[i], inputs, kwargs, grads, needs, sample_tokens)
            else:
                col = moe_backward.whole_layer(skel, i, inputs, kwargs, grads, needs, sample_tokens, group, rounds)
            save_backward(i, col.result() if group is None or group.rank == 0 or not shard_backward(i) else {})
            inputs = col = None
            continue
        moe = ckpt.read_layer(i) if i in moe_layers else None
        col = StatsCollector(moe, needs, sample_tokens, rounds=group is not None) if moe is not None else None
        merged = StatsCollector(moe, needs, sample_tokens) if group is not None and moe is not None else None
        if col is not None:
            col.mode = "backward"
        mod = skel.layer(i, None if moe is None else chunked.cast_into(moe, skel.chunk_buffer, skel.dtype, skel.device), col)
        dev = skel.device
        for b in grads if group is None else range(rounds):
            if b in grads:
                x = inputs[b].detach().to(dev).requires_grad_(True)
                args, kw = to_device(kwargs[b][i], dev)
                with torch.enable_grad():
                    out = mod(x, *args, **kw)
                    out.backward(grads[b].to(dev))
                grads[b] = x.grad.cpu()
            if merged is not None:
                merge_round(group, col, merged)
        # the autograd graph of `out` holds the gradient hooks, which hold the collector and the layer
        mod = inputs = out = x = None
        col = merged if merged is not None else col
        if col is not None:
            save_backward(i, col.result())
        moe = col = None
    return loss
