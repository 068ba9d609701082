"""The work of an MoE layer that is one unit (:mod:`moecompress.engine.layer_run`): read whole, every step in
order with every rule it has (a step without ``Chunking``, a router or shared-expert change, statistics that
follow the layer: :mod:`moecompress.engine.follow`), the reconstruction error on the held-back tokens from
whole-layer forwards. A layer held by chunks of experts is :mod:`moecompress.engine.unit_work`'s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moecompress.calibration.cache import load_layer
from moecompress.engine.context import RunContext
from moecompress.engine.follow import follower, split_kept
from moecompress.engine.held_back import forward_by_pieces
from moecompress.engine.protection import RENUMBER_KEY, TopActivation
from moecompress.engine.steps import run_step, step_stats
from moecompress.engine.unit_work import StepPart, WholeStep
from moecompress.io.checkpoint import Checkpoint
from moecompress.io.format import encode_layer, layer_shape
from moecompress.io.raw import raw_layer_tensors, raw_selection
from moecompress.io.routing import stored_policy
from moecompress.ir import MoELayer, layer_to
from moecompress.methods.metrics import relative_error, sqnr_db


def whole_parts(
    ckpt: Checkpoint, rec, entry: Path | None, plans: list[Any], ctx: RunContext, idx: int, written: set[int],
    dequantize: bool,
) -> Iterator[StepPart]:  # fmt: skip
    """MoE layer ``idx`` as one unit: read whole, every step in order with every rule it has (a step without
    ``Chunking``, a router or shared-expert change, statistics that follow the layer:
    :mod:`moecompress.engine.follow`); one :class:`StepPart` per step, its :class:`WholeStep` carrying the
    row and, for a step in ``written``, its tensors. The layer is handed on step by step (what the consumer
    wrote is not held)."""
    dev, host = torch.device(ctx.device), torch.device("cpu")
    layer = ckpt.read_layer(idx)
    kept: list[int] | None = list(range(layer.router.num_experts))  # input experts, while only selected
    stats = {host: load_layer(entry, idx) if entry is not None else {}}  # {}: a data-free run
    if dev != host:
        stats[dev] = {k: v.to(dev) for k, v in stats[host].items()}
    dtype = ctx.dtype
    hx = stats[dev].get("holdout_x")
    hy, top0 = None, TopActivation()
    if hx is not None:  # the original block on the held-back tokens: the reference for every step
        hx = hx.to(dtype)
        hy = forward_by_pieces(layer, hx, dtype, dev, top0)
    errors = {"rel_error": 0.0, "sqnr_db": float("inf"), "massive_ratio": 1.0}  # of the unchanged layer
    follows, version, changed = follower(rec, stats[host], dtype), 0, False  # statistics follow the layer
    for s, step in enumerate(rec.steps):
        where = dev if step.spec.on_device else host
        layer = layer_to(layer, where)
        before_params, before_bytes = layer.num_params(), layer.nbytes()
        t0 = time.perf_counter()
        stats[host] = follows.before(s, step, layer)
        if dev != host and version != follows.version:
            stats[dev], version = {k: v.to(dev) for k, v in stats[host].items()}, follows.version
        new, info = run_step(step, layer, step_stats(step, idx, stats[where], plan=plans[s]))
        info, kept_neurons = split_kept(info)
        follows.after(step, layer, new, kept_neurons)
        secs = time.perf_counter() - t0
        kept = _selection(step, layer, new, info, kept)
        changed = changed or new is not layer
        row = {"layer": idx, "params_before": before_params, "params_after": new.num_params(),
               "bytes_before": before_bytes, "bytes_after": new.nbytes(), "seconds": round(secs, 4),
               "changed": new is not layer}  # fmt: skip
        if hy is not None:
            if new is not layer:  # an unchanged layer keeps the errors it had (the error is cumulative)
                top = TopActivation()
                approx = forward_by_pieces(new, hx, dtype, dev, top)
                errors = {"rel_error": relative_error(hy, approx), "sqnr_db": sqnr_db(hy, approx),
                          "massive_ratio": top.value / top0.value if top0.value > 0 else 1.0}  # fmt: skip
            row.update(errors)
        out = WholeStep(row)
        if s in written:
            keep = not (dequantize or changed)  # a quantised input's layer no step changed: its raw bytes
            out.tensors = raw_layer_tensors(ckpt, idx) if keep else None
            if out.tensors is None and not (keep or dequantize or kept is None):
                out.sel = raw_selection(ckpt, idx, kept, new)  # only experts selected: the kept ones, raw
            if out.tensors is None and out.sel is None:
                out.tensors, out.desc = encode_layer(ckpt.adapter, layer_to(new, host))
                out.encoded = True
            out.shape = layer_shape(new)
            out.protected = sorted(new.protected) if new.protected else None
            out.routing = stored_policy(new) if new.routing else None
        yield StepPart(s, 0, None, secs, info, None, new is not layer, whole=out)
        layer = new


def _selection(step, layer: MoELayer, new: MoELayer, info: dict, kept: list[int] | None) -> list[int] | None:
    """The input experts that ``new`` holds, unchanged, when every step so far only selected experts
    (``Chunking('select')``: ``expert_prune``, protection); ``None`` once a step changed expert weights."""
    if kept is None or new is layer:
        return kept
    mode = step.spec.chunking
    if mode is None or mode.mode != "select":
        return None
    order = info.get(RENUMBER_KEY)
    return kept if order is None else [kept[k] for k in order]
