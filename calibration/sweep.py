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
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from moecompress.calibration.catalogue import backward_needed
from moecompress.calibration.skeleton import Skeleton
from moecompress.calibration.stats import StatsCollector
from moecompress.calibration.trace import RoutingTrace
from moecompress.errors import CheckpointError
from moecompress.ir import MoELayer

log = logging.getLogger(__name__)

OFFLOAD_AUTO_BYTES = 2 * 1024**3


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


def check_finite(layer: MoELayer) -> None:
    """:class:`CheckpointError` naming the layer, projection and expert of the first NaN/Inf weight of
    the MoE block (found before it poisons every later layer's statistics)."""
    for bank_name, bank in (("expert", layer.experts), ("shared expert", layer.shared)):
        if bank is None:
            continue
        for proj in ("gate", "up", "down"):
            for name, t in getattr(bank, proj).tensors().items():
                if not t.is_floating_point() or bool(torch.isfinite(t).all()):
                    continue
                bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(1) if t.dim() == 3 else None
                which = f" {int(bad.nonzero()[0])}" if bad is not None and bank_name == "expert" else ""
                raise CheckpointError(
                    f"layer {layer.index}: {bank_name}{which} {proj}_proj ({name}) holds NaN/Inf weights; the "
                    "checkpoint is damaged: re-download or re-export it"
                )
    for name in ("router_weight", "router_bias", "score_bias", "shared_gate"):
        t = getattr(layer, name)
        if t is not None and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"layer {layer.index}: the router's {name} holds NaN/Inf; the checkpoint is damaged")


def _check_outputs(i: int, outs: list[torch.Tensor]) -> None:
    if not all(bool(torch.isfinite(o if isinstance(o, torch.Tensor) else o[0]).all()) for o in outs):
        raise CheckpointError(
            f"decoder layer {i}: its output holds NaN/Inf (its attention or norm weights, or its inputs, are "
            "not finite); the checkpoint is damaged, or calibration.dtype overflows: try float32"
        )


def to_device(obj, device: torch.device):
    """``obj`` (a tensor, or tuples, lists and dicts of them) with every tensor on ``device``: the
    activations stay on the host and visit the compute device one batch at a time."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def _run(mod, x: torch.Tensor, args: tuple, kw: dict, device: torch.device):
    """One batch through a materialised decoder layer on ``device``; the output back on the host (on the
    CPU every move is a no-op)."""
    return to_device(mod(x.to(device), *to_device(args, device), **to_device(kw, device)), torch.device("cpu"))


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
    on_layer: OnLayer | None = None,
    progress: bool = True,
) -> dict:
    """Run the sweep(s); statistics are handed to ``save_*`` layer by layer. Returns a summary."""
    ckpt = skel.ckpt
    moe_layers = set(ckpt.moe_layer_indices)
    backward = backward_needed(set(needs))
    captured = [skel.capture(ids) for ids in batches.ids]
    hidden = [h for h, _ in captured]
    kwargs = [kw for _, kw in captured]
    del captured
    n_layers = len(skel.meta_layers)
    trace = RoutingTrace() if "route_attrib" in needs else None
    act_bytes = sum(h.numel() * h.element_size() for h in hidden) * n_layers
    store = None
    if backward:
        on_disk = offload == "disk" or (offload == "auto" and act_bytes > OFFLOAD_AUTO_BYTES)
        store = _InputStore(on_disk)
        log.info(
            "streamed backward: keeping %.1f MB of layer inputs %s",
            act_bytes / 1e6,
            "on disk" if on_disk else "in RAM",
        )
    try:
        for i in tqdm(range(n_layers), desc="calibrate (forward)", unit="layer", disable=not progress):
            if store is not None:
                store.put(i, hidden)
            moe = ckpt.read_layer(i) if i in moe_layers else None
            if moe is not None:
                check_finite(moe)
            col = StatsCollector(moe, needs, sample_tokens) if moe is not None else None
            mod = skel.layer(i, moe, col)
            outs = []
            with torch.no_grad():
                for b, x in enumerate(hidden):
                    if col is not None:
                        col.mode = "holdout" if batches.holdout[b] else "stats"
                    args, kw = kwargs[b][i]
                    outs.append(_run(mod, x, args, kw, skel.device))
            del mod
            _check_outputs(i, outs)
            if trace is not None:
                trace.after_layer(i, hidden, outs, batches.holdout, col)
            if col is not None:
                stats = col.result()
                save_forward(i, stats)
                replacement = on_layer(i, moe, stats) if on_layer is not None else None
                if replacement is not None:
                    with torch.no_grad():
                        mod = skel.layer(i, replacement, None)
                        outs = [_run(mod, x, *kwargs[b][i], skel.device) for b, x in enumerate(hidden)]
                        del mod
                del replacement, stats
            # drop every reference to this layer before the next one is read: peak = one layer
            moe = col = None
            hidden = outs
        loss = None
        if store is not None:
            loss = _backward(skel, batches, needs, hidden, kwargs, store, save_backward, progress)
    finally:
        if store is not None:
            store.close()
    return {"batches": len(batches.ids), "backward": backward, "loss": loss, "activation_bytes": act_bytes}


def _backward(skel, batches, needs, hidden, kwargs, store, save_backward, progress) -> float:
    ckpt = skel.ckpt
    moe_layers = set(ckpt.moe_layer_indices)
    skel.load_head()
    total = batches.predicted_tokens
    grads: dict[int, torch.Tensor] = {}
    loss = 0.0
    for b, h in enumerate(hidden):
        if not batches.holdout[b]:
            part, g = skel.lm_loss_and_grad(h, batches.ids[b], total)
            grads[b] = g.cpu()
            loss += part
    del hidden
    for i in tqdm(
        reversed(range(len(skel.meta_layers))),
        desc="calibrate (backward)",
        unit="layer",
        total=len(skel.meta_layers),
        disable=not progress,
    ):
        inputs = store.get(i)
        moe = ckpt.read_layer(i) if i in moe_layers else None
        col = StatsCollector(moe, needs) if moe is not None else None
        if col is not None:
            col.mode = "backward"
        mod = skel.layer(i, moe, col)
        dev = skel.device
        for b in grads:
            x = inputs[b].detach().to(dev).requires_grad_(True)
            args, kw = to_device(kwargs[b][i], dev)
            with torch.enable_grad():
                out = mod(x, *args, **kw)
                out.backward(grads[b].to(dev))
            grads[b] = x.grad.cpu()
        # the autograd graph of `out` holds the gradient hooks, which hold the collector and the layer
        mod = inputs = out = x = None
        if col is not None:
            save_backward(i, col.result())
        moe = col = None
    return loss
