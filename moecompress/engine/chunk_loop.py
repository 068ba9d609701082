"""One MoE layer of a recipe run held by chunks of experts (``RunContext.expert_chunks``).

The layer's shell is read once (:meth:`Checkpoint.read_layer_shell`); the ``select`` steps
(:class:`~moecompress.engine.spec.Chunking`) run on it with the layer's whole statistics and decide which
experts survive. Then, chunk by chunk, experts ``[a, b)`` are read (:meth:`Checkpoint.read_experts`),
taken through every step in order (``expert`` steps on the chunk's sub-layer, selections applied), and
each written step's writer receives the chunk's tensors at once: per-expert names under their new ids,
fused ``[E, ...]`` tensors as segments (:meth:`ShardWriter.append`). The chunk is then freed. At the end
the whole output layer, on the ``meta`` device (:func:`moecompress.engine.chunks.join_bank`), gives the
router tensors, the index vectors, the description, the shapes and the report rows, as a whole-layer run
(:meth:`RecipeRun.moe_layer`) records them. The reconstruction error on the held-back tokens is a sum
over the chunks (the router and the shared expert once). A quantised input's layer that only selections
touched is written in its on-disk encoding (:func:`moecompress.engine.layer_loop.raw_selection`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.nn.functional as F

from moecompress.calibration.cache import load_layer
from moecompress.engine import chunks
from moecompress.engine.layer_loop import raw_selection, write_raw
from moecompress.engine.protection import RENUMBER_KEY, TopActivation
from moecompress.engine.resources import release_freed, rss_mb
from moecompress.engine.steps import run_step, step_stats
from moecompress.errors import MoecompressError, PassError
from moecompress.io.format import encode_bank, encode_layer, encode_routing, is_stock, layer_shape
from moecompress.io.quantized import check_stock_output
from moecompress.io.routing import stored_policy
from moecompress.ir import ExpertBank, MoELayer, cast_layer, layer_to
from moecompress.layouts import LAYOUTS
from moecompress.methods.metrics import relative_error, sqnr_db
from moecompress.reference import expert_forward, experts_forward, route
from moecompress.report.write import json_safe

RecipeRun = Any
"""The run's state (:class:`moecompress.engine.run.RecipeRun`, which calls this module: not imported here)."""


def _shell_step(step, shell: MoELayer, st) -> tuple[MoELayer, dict]:
    """A ``select`` step on the layer's shell, with errors naming the step and the layer."""
    try:
        new, info = step.spec.fn(shell, st, step.config)
    except MoecompressError as err:
        raise PassError(f"{step.label}, layer {shell.index}: {err}") from None
    if step.spec.report_only:
        return shell, info
    kept = info.get(RENUMBER_KEY)
    gone = sorted(p for p in shell.protected if kept is not None and p not in set(kept))
    if gone:
        raise PassError(f"{step.label}, layer {shell.index}: protected expert {gone[0]} was removed")
    return new, info


def skeleton(bank: ExpertBank) -> ExpertBank:
    """``bank`` on the ``meta`` device but for its small index vectors (what joining chunks needs)."""

    def light(t: torch.Tensor) -> torch.Tensor:
        return (
            t.to("cpu") if t.dim() == 1 and not t.is_floating_point() else torch.empty_like(t, device="meta")
        )

    lays = [LAYOUTS[lay.kind].from_tensors({k: light(t) for k, t in lay.tensors().items()}, lay.meta())
            for lay in (bank.gate, bank.up, bank.down)]  # fmt: skip
    return ExpertBank(
        *lays, widths=None if bank.widths is None else bank.widths.to("cpu"),
        biases={k: light(v) for k, v in bank.biases.items()}, act=bank.act, alpha=bank.alpha, limit=bank.limit,
    )  # fmt: skip


def _with_shared(layer: MoELayer, acc: torch.Tensor, x: torch.Tensor, top: TopActivation) -> torch.Tensor:
    """The routed experts' sum ``acc`` plus the shared expert, as :func:`moecompress.reference.moe_forward`."""
    out = acc
    if layer.shared is not None:
        seen: list[torch.Tensor] = []
        s = expert_forward(layer.shared, 0, x, seen.append)
        top.on_shared(seen[0], s)
        s = s.float()
        if layer.shared_gate is not None:
            s = s * torch.sigmoid(F.linear(x.float(), layer.shared_gate.float()))
        out = out + s
    return out.to(x.dtype)


def _bank_to(bank: ExpertBank, dev) -> ExpertBank:
    return dataclasses.replace(
        bank, gate=bank.gate.to(dev), up=bank.up.to(dev), down=bank.down.to(dev),
        widths=None if bank.widths is None else bank.widths.to(dev), biases={k: v.to(dev) for k, v in bank.biases.items()},
    )  # fmt: skip


def _router_part(shell: MoELayer, dev, dtype) -> MoELayer:
    """The shell in the compute dtype with its router and shared expert on ``dev`` (experts stay ``meta``)."""
    cast = cast_layer(shell, dtype)

    def t(x):
        return None if x is None else x.to(dev)

    shared = None if cast.shared is None else _bank_to(cast.shared, dev)
    return cast.replace(router_weight=t(cast.router_weight), router_bias=t(cast.router_bias),
                        score_bias=t(cast.score_bias), shared=shared, shared_gate=t(cast.shared_gate))  # fmt: skip


class _Errors:
    """Per state (0: the original layer, s + 1: after step s) the routing of the held-back tokens, the
    routed experts' running sum over chunks and the top activation."""

    def __init__(self, shells: list[MoELayer], hx: torch.Tensor, dev, dtype) -> None:
        self.hx, self.dev, self.dtype = hx, dev, dtype
        cache: dict[int, tuple] = {}
        self.shells = [_router_part(s, dev, dtype) for s in shells]
        self.routes = []
        for s, cast in zip(shells, self.shells):
            if id(s) not in cache:
                cache[id(s)] = route(cast, hx)
            self.routes.append(cache[id(s)])
        self.acc = [torch.zeros(hx.shape, dtype=torch.float32, device=dev) for _ in shells]
        self.tops = [TopActivation() for _ in shells]

    def add(self, state: int, bank: ExpertBank, start: int) -> None:
        ids, w = self.routes[state]
        n = bank.num_experts
        local = torch.where((ids >= start) & (ids < start + n), ids - start, torch.full_like(ids, n))
        b = cast_layer(
            layer_to(chunks.sub_layer(self.shells[state], bank, start), self.dev), self.dtype
        ).experts
        # (the sub-layer holds the state's router rows and shared expert, already on the device)
        self.acc[state] += experts_forward(b, self.hx, local, w, None, self.tops[state])

    def output(self, state: int) -> torch.Tensor:
        return _with_shared(self.shells[state], self.acc[state], self.hx, self.tops[state])


def chunked_layer(run: RecipeRun, idx: int, size: int) -> None:
    """MoE layer ``idx`` of ``run`` by chunks of ``size`` experts (module docstring)."""
    ckpt, ctx, steps = run.ckpt, run.ctx, run.rec.steps
    dev, host = torch.device(ctx.device), torch.device("cpu")
    shell0 = ckpt.read_layer_shell(idx)
    stats = {host: load_layer(run.entry, idx) if run.entry is not None else {}}
    if dev != host:
        stats[dev] = {k: v.to(dev) for k, v in stats[host].items()}
    plans = [run.plans.get(s.number, {}).get(idx) for s in steps]
    secs = [0.0] * len(steps)
    shells, kept_of, kinds, infos = [shell0], [], [], {}
    for s, step in enumerate(steps):  # the selections, once per layer, on the shell
        mode = step.spec.chunking
        if mode is None:
            raise PassError(
                f"{step.label}, layer {idx}: the step needs every expert at once; use expert_chunk: off"
            )
        t0 = time.perf_counter()
        st = step_stats(step, idx, stats[host], plan=plans[s])
        if mode.mode == "select":
            new, infos[s] = _shell_step(step, shells[-1], st)
            kept_of.append(infos[s].get(RENUMBER_KEY) if new is not shells[-1] else None)
            kinds.append(None)
        else:
            new = shells[-1]
            kept_of.append(None)
            kinds.append(mode.kind(shells[-1], st, step.config) if mode.kind is not None else None)
        secs[s] += time.perf_counter() - t0
        shells.append(new)
    hx = stats[dev].get("holdout_x")
    err = _Errors(shells, hx.to(ctx.dtype), dev, ctx.dtype) if hx is not None else None
    raw = _raw_writes(run, idx, steps, shells, kept_of)
    for s, writes in raw.items():
        write_raw(run.writers[steps[s].number], writes)
    written = [s for s, step in enumerate(steps) if step.number in run.writers and s not in raw]
    if err is None and not written and all(step.spec.chunking.mode == "select" for step in steps):
        parts, bank = [], shell0.experts  # nothing needs the experts' values: no chunk is read
        for kept in kept_of:
            bank = bank if kept is None else chunks.take(bank, list(kept))
            parts.append([bank])
        no_infos: list[list[dict]] = [[] for _ in steps]
        changed = [shells[s + 1] is not shells[s] for s in range(len(steps))]
        return _finish(run, idx, shells, parts, infos, no_infos, [[] for _ in steps], changed, secs, written, {},
                       None, raw)  # fmt: skip
    stock: dict[int, bool] = {}
    parts: list[list[ExpertBank]] = [[] for _ in steps]
    changed = [shells[s + 1] is not shells[s] for s in range(len(steps))]
    bnds: list[list[tuple[int, int]]] = [[] for _ in steps]
    chunk_infos: list[list[dict]] = [[] for _ in steps]
    for a, b in chunks.bounds(shell0.router.num_experts, size):
        cur: MoELayer | None = chunks.sub_layer(shell0, ckpt.read_experts(idx, a, b), a)
        g0 = a
        if err is not None:
            err.add(0, cur.experts, g0)
        for s, step in enumerate(steps):
            if cur is None:
                break
            t0 = time.perf_counter()
            if step.spec.chunking.mode == "select":  # type: ignore[union-attr]
                local, g0 = chunks.selected(kept_of[s], g0, g0 + cur.experts.num_experts)
                bank = (
                    cur.experts if kept_of[s] is None else chunks.take(cur.experts, local) if local else None
                )
                new = None if bank is None else chunks.sub_layer(shells[s + 1], bank, g0)
            else:
                where = dev if step.spec.on_device else host
                cur = layer_to(cur, where)
                n, e_s = cur.experts.num_experts, shells[s].router.num_experts
                st = step_stats(step, idx, chunks.slice_stats(stats[where], e_s, g0, g0 + n),
                                plan=chunks.slice_plan(plans[s], e_s, g0, g0 + n))  # fmt: skip
                new, info = run_step(step, cur, st)
                new = chunks.as_kind(cur, new, kinds[s])
                if new.router_weight is not cur.router_weight or new.shared is not cur.shared:
                    raise PassError(f"{step.label}, layer {idx}: the step changed the router or the shared expert, "
                                    "which a layer held by chunks of experts cannot follow; use expert_chunk: off")  # fmt: skip
                changed[s] = changed[s] or new is not cur
                chunk_infos[s].append(info)
                bnds[s].append((g0, g0 + n))
            secs[s] += time.perf_counter() - t0
            if new is not None:
                parts[s].append(skeleton(new.experts))
                if err is not None:
                    err.add(s + 1, new.experts, g0)
                if s in written:
                    _write_chunk(run, idx, step.number, layer_to(new, host), g0, stock)
            run.peak[step.number] = max(run.peak[step.number], rss_mb())
            cur = new
        del cur
        release_freed()  # the chunk's memory back to the system before the next chunk is read
    _finish(run, idx, shells, parts, infos, chunk_infos, bnds, changed, secs, written, stock, err, raw)


def _raw_writes(run: RecipeRun, idx: int, steps, shells, kept_of) -> dict[int, list]:
    """The written steps whose layer only selections made, on a quantised input: its on-disk tensors."""
    if run.dequantize or not run.ckpt.quantization:
        return {}
    out, kept = {}, list(range(shells[0].router.num_experts))
    for s, step in enumerate(steps):
        if step.spec.chunking.mode != "select":
            break
        if kept_of[s] is not None:
            kept = [kept[k] for k in kept_of[s]]
        if step.number in run.writers:
            writes = raw_selection(run.ckpt, idx, kept, shells[s + 1])
            if writes is not None:
                out[s] = writes
    return out


def _write_chunk(
    run: RecipeRun, idx: int, number: int, out: MoELayer, g0: int, stock: dict[int, bool]
) -> None:
    """One chunk's routed experts of a written step: per-expert names under their ids in the layer,
    fused ``[E, ...]`` tensors as segments; index vectors and the router come with the whole layer."""
    ad, w = run.ckpt.adapter, run.writers[number]
    mode = stock.setdefault(number, is_stock(out, ad))
    if is_stock(out, ad) != mode:
        raise PassError(
            f"layer {idx}: the chunks' outputs do not share one on-disk form; use expert_chunk: off"
        )
    if mode:
        skip = set(ad.router_keys(idx))
        tensors = ad.layer_tensors(out)
    else:
        skip, tensors = set(), {}
        encode_bank(out.experts, ad.experts_key(idx), tensors)
    for name, t in tensors.items():
        if name in skip or (t.dim() == 1 and not t.is_floating_point()):
            continue
        e = ad.expert_of(name)
        if mode and e is not None:
            w.add(ad.renumber_key(name, e + g0), t)
        else:
            w.append(name, t)


def _finish(
    run, idx, shells, parts, infos, chunk_infos, bnds, changed, secs, written, stock, err, raw
) -> None:
    """Report rows, infos and the written layers' whole-layer bookkeeping (module docstring)."""
    steps = run.rec.steps
    before = shells[0]
    errors = {"rel_error": 0.0, "sqnr_db": float("inf"), "massive_ratio": 1.0}
    hy = err.output(0) if err is not None else None
    for s, step in enumerate(steps):
        if step.spec.report_only:
            new = before
        else:
            new = shells[s + 1].replace(experts=chunks.join_bank(parts[s]))
        if s not in infos:
            infos[s] = step.spec.chunking.merge(chunk_infos[s], bnds[s], step.config)
        row = {
            "layer": idx, "params_before": before.num_params(), "params_after": new.num_params(),
            "bytes_before": before.nbytes(), "bytes_after": new.nbytes(), "seconds": round(secs[s], 4),
            "changed": changed[s],
        }  # fmt: skip
        if err is not None:
            if changed[s]:
                approx = err.output(s + 1)
                top0, top = err.tops[0].value, err.tops[s + 1].value
                errors = {"rel_error": relative_error(hy, approx), "sqnr_db": sqnr_db(hy, approx),
                          "massive_ratio": top / top0 if top0 > 0 else 1.0}  # fmt: skip
            row.update(errors)
        run.rows[step.number].append(row)
        run.infos[step.number][idx] = json_safe(infos[s])
        if step.number in run.writers:
            _record(run, idx, step.number, new, s in raw, stock.get(step.number))
        run.seconds[step.number] += secs[s]
        before = new


def _record(run, idx: int, number: int, new: MoELayer, raw: bool, stock: bool | None) -> None:
    """The whole layer's part of a written step: router, index vectors, description, shapes."""
    ad, w = run.ckpt.adapter, run.writers[number]
    if raw:
        run.descs[number][idx] = None
        run.kept_raw.setdefault(number, set()).add(idx)
    else:
        tensors, desc = encode_layer(ad, new)
        if stock is not None and (desc is None) != stock:
            raise PassError(
                f"layer {idx}: the chunks' on-disk form disagrees with the layer's; use expert_chunk: off"
            )
        if desc is None:
            tensors = {**ad.layer_tensors(new), **encode_routing(ad, new)}
        for name, t in tensors.items():
            if t.device.type != "meta":
                w.add(name, t)
            elif name in w.pending:
                w.end(name, t.shape)
            elif not w.written(name):
                raise PassError(f"layer {idx}: tensor {name!r} of the layer was not written by its chunks")
        check_stock_output(run.ckpt, idx, desc, run.dequantize)
        run.descs[number][idx] = desc
    run.shapes[number][idx] = layer_shape(new)
    if new.protected:
        run.protected[number][str(idx)] = sorted(new.protected)
    if new.routing:
        run.routing[number][str(idx)] = stored_policy(new)
