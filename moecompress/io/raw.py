"""A quantised input's MoE layer written in its on-disk encoding: an unchanged layer byte for byte, a
selection of its experts (``expert_prune``, protection) as the kept experts' stored tensors under their
new ids. The layer loop (:mod:`moecompress.engine.layer_run`) writes these instead of re-encoding."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from moecompress.io.checkpoint import Checkpoint
from moecompress.io.format import encode_routing
from moecompress.io.routing import routing_tensors
from moecompress.io.writer import ShardWriter
from moecompress.ir import MoELayer


def raw_layer_tensors(ckpt: Checkpoint, idx: int) -> dict | None:
    """The on-disk tensors of MoE layer ``idx`` of a quantised input (to write an unchanged layer in its
    original encoding, byte for byte); ``None`` for any other input (re-encoded as before)."""
    return ckpt.raw.get_many(ckpt.raw_moe_keys(idx)) if ckpt.quantization else None


RAW_RUN = 8
"""Experts of a fused ``[E, ...]`` on-disk tensor copied per piece by :func:`raw_selection`."""

RawWrite = tuple[str, torch.dtype, tuple[int, ...], Callable[[], Iterator[torch.Tensor]]]
"""One tensor to write: name, dtype, shape and a function giving its pieces (read when written)."""


def raw_selection(ckpt: Checkpoint, idx: int, kept: Sequence[int], layer: MoELayer) -> list[RawWrite] | None:
    """MoE layer ``idx`` of a quantised input whose routed experts are a selection of the input's, unchanged
    (``kept``: the input expert ids, in the new order; ``expert_prune``, protection), written in the input's
    on-disk encoding: every kept expert's stored tensors (FP8 weight and ``weight_scale_inv``, packed codes
    and scales, ...) under its new id, the kept rows of fused ``[E, ...]`` tensors (MXFP4 blocks and scales,
    biases), the shared expert's stored tensors as they are, and the router rows and routing-policy
    tensors from ``layer``. ``None`` when the input is not quantised or the layer cannot be written so (a
    quantised router that the selection changed); nothing is read before a tensor is written."""
    if not ckpt.quantization:
        return None
    ad, r, raw = ckpt.adapter, ckpt.reader, ckpt.raw
    e_in = int(ad.num_experts)
    identity = list(kept) == list(range(e_in))
    new_id = {int(old): n for n, old in enumerate(kept)}
    experts = ad.expert_keys(idx, r.keys)
    expert_set = set(experts)
    routing = set(routing_tensors(ad, idx, ckpt.routing.get(idx)))
    router = {} if identity else ad.router_tensors(layer, shared=False)
    out: list[RawWrite] = []

    def whole(name: str) -> Callable[[], Iterator[torch.Tensor]]:
        return lambda: iter([raw.get_many([name])[name]])

    def logical(t: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
        return lambda: iter([t])

    def rows(name: str) -> Callable[[], Iterator[torch.Tensor]]:
        def gen() -> Iterator[torch.Tensor]:
            ids = [int(k) for k in kept]
            a = 0
            while a < len(ids):  # runs of consecutive kept experts, RAW_RUN at a time
                b = a + 1
                while b < len(ids) and b - a < RAW_RUN and ids[b] == ids[b - 1] + 1:
                    b += 1
                yield raw.get_rows(name, ids[a], ids[b - 1] + 1)
                a = b

        return gen

    for k in ckpt.moe_keys(idx):
        if k in routing:
            continue
        names = r.raw_names([k]) if hasattr(r, "raw_names") else [k]
        if k in router:
            if names != [k]:  # a quantised router whose rows change: not in its encoding
                return None
            t = router[k]
            out.append((k, t.dtype, tuple(t.shape), logical(t)))
            continue
        for name in names:
            shape, dtype = tuple(raw.shape(name)), raw.torch_dtype(name)
            if k not in expert_set or identity:
                out.append((name, dtype, shape, whole(name)))
                continue
            e = ad.expert_of(name)
            if e is not None:
                if e in new_id:
                    out.append((ad.renumber_key(name, new_id[e]), dtype, shape, whole(name)))
            elif shape and shape[0] == e_in:
                out.append((name, dtype, (len(kept), *shape[1:]), rows(name)))
            else:
                return None
    for name, t in encode_routing(ad, layer).items():
        out.append((name, t.dtype, tuple(t.shape), logical(t)))
    return out


def write_raw(writer: ShardWriter, writes: list[RawWrite]) -> None:
    """Write :func:`raw_selection`'s tensors, each read as it is written."""
    for name, dtype, shape, pieces in writes:
        writer.add_pieces(name, dtype, shape, pieces())
