"""The streamed backward through an MoE decoder layer, its MoE part expert by expert in one fixed order.

For layer ``i`` and batch ``b``, with ``g_b`` the gradient w.r.t. the layer's output (``out = h1 + MoE(u)``,
see :mod:`moecompress.calibration.chunked`):

1. :func:`record`: the decoder layer runs from a leaf ``x_b`` with grad and the MoE block replaced by
   :class:`~moecompress.calibration.chunked.RecordingMoE`; it gives ``u_b``, the MoE input;
2. :func:`open_batch`: ``u_b`` is routed once (no grad): routing weights ``w_b`` and physical ids;
3. :func:`chunk_terms`: each expert ``q`` a slot reaches, in expert order, from leaves ``u_b[tok_q]`` and
   ``w_b[tok_q, slot_q]``: ``y = E_q(u)``, and ``w·y`` is back-propagated with ``g_b[tok_q]``
   (:class:`GradTerm`; the collector's ``on_expert`` sees the expert's down input, whose hook gives its
   gradient statistics). :func:`add_grad_term` adds each term's input gradient to ``gu_b`` (fp32) with one
   ``index_add_`` per expert, in expert order, and puts its weight gradient in place;
4. :func:`close_batch`: the shared expert's VJP and then the router's (from the weight gradients) are added
   to ``gu_b``; the decoder layer is recomputed from ``x_b`` with grad, and
   ``backward([out, u], [g_b, gu_b])`` gives ``x_b``'s gradient, the next layer's ``g``.

An expert's term depends only on its own tokens, so whichever experts are held together — the whole layer
batch by batch (:func:`whole_layer`), chunks of experts with chunks outer (``expert_chunk``,
:func:`by_chunks`), or chunks spread over ``torch.distributed`` ranks
(:func:`moecompress.calibration.expert_sharded.backward_layer`) — the gradients and the per-expert
gradient statistics are the same bits. (An autograd graph over the whole block, the older path, adds the
experts' input gradients in the order autograd visits them, which no split can reproduce.)

Used for every MoE layer stored in stock tensors whose recipe needs no statistic of :data:`NOT_CANONICAL`;
the others keep the whole block's autograd graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moecompress.calibration.chunked import ChunkedLayer
from moecompress.calibration.skeleton import to_device
from moecompress.calibration.stats import StatsCollector
from moecompress.calibration.stats_exchange import merge_round
from moecompress.ir import ExpertBank
from moecompress.reference import expert_forward, shared_forward

NOT_CANONICAL = frozenset({"expert_out_gram_fisher", "route_attrib"})
"""Statistics the expert-by-expert backward does not collect (Ward's gradient-weighted sample, the routing
trace): a layer whose recipe needs one keeps the whole block's autograd graph."""

NOT_SHARDED = NOT_CANONICAL
"""Statistics the backward with chunks outer does not give bit for bit: under ``torchrun`` such a layer's
backward runs data-parallel. (``down_in_grad_cov_pooled``, a sum over experts, is kept by fixed blocks of
experts, ``stats.POOLED_BY_BLOCK``: chunks that are unions of blocks give its bits.)"""


def canonical(ckpt, i: int, needs) -> bool:
    """Whether MoE layer ``i``'s backward runs expert by expert here: stock tensors and no
    :data:`NOT_CANONICAL` statistic."""
    return i not in ckpt.layouts and not (set(needs) & NOT_CANONICAL)


@dataclass(frozen=True)
class GradTerm:
    """One expert's part of the MoE block's VJP: ``x`` (fp32 ``[n, H]``) goes to the rows ``tok`` of the
    input gradient, ``w`` (fp32 ``[n]``) is the gradient of the routing weights ``[tok, slot]``."""

    expert: int
    tok: torch.Tensor
    slot: torch.Tensor
    x: torch.Tensor
    w: torch.Tensor


@dataclass
class Pending:
    """One batch between :func:`open_batch` and :func:`close_batch`: its MoE input ``u`` and output gradient
    ``g`` (``[T, H]``), routing, and (on the process that finishes it) the fp32 gradient accumulators."""

    u: torch.Tensor
    g: torch.Tensor
    weights: torch.Tensor
    phys: torch.Tensor
    gu: torch.Tensor | None = None
    wgrad: torch.Tensor | None = None


def expert_grad_terms(bank: ExpertBank, u: torch.Tensor, p: Pending, observer=None, first: int = 0) -> Iterator[GradTerm]:
    """The :class:`GradTerm` of every expert of ``bank`` (physical experts ``first, first + 1, …``) that a
    slot of ``p.phys`` reaches, in expert order; ``u`` is ``p.u`` on the compute device."""
    g = p.g.to(u.device)
    for q in torch.unique(p.phys).tolist():
        e = q - first
        if not 0 <= e < bank.num_experts:
            continue
        tok, slot = torch.where(p.phys == q)
        xq = u[tok].detach().requires_grad_(True)
        wq = p.weights[tok, slot].detach().float().requires_grad_(True)
        seen: list[torch.Tensor] = []
        with torch.enable_grad():
            y = expert_forward(bank, e, xq, seen.append)
            if observer is not None:
                observer.on_expert(q, tok, slot, seen[0], y)
            (y.float() * wq[:, None]).backward(g[tok].float())
        assert xq.grad is not None and wq.grad is not None
        yield GradTerm(q, tok, slot, xq.grad.float(), wq.grad)


def add_grad_term(term: GradTerm, p: Pending) -> None:
    """Add ``term`` to ``p``'s accumulators (terms added in expert order give the bits of every split)."""
    assert p.gu is not None and p.wgrad is not None
    p.gu.index_add_(0, term.tok, term.x)
    p.wgrad[term.tok, term.slot] = term.w


def record(layer, mod, x: torch.Tensor, args: tuple, kw: dict, dev: torch.device) -> torch.Tensor:
    """``u_b`` ``[T, H]`` on the host: the decoder layer ``mod`` (with ``layer.recorder``) run from a leaf
    with grad, as :func:`close_batch` recomputes it, so that the two make the same bits."""
    leaf = x.detach().to(dev).requires_grad_(True)
    args, kw = to_device((args, kw), dev)
    with torch.enable_grad():
        mod(leaf, *args, **kw)
    u = layer.recorder.seen
    layer.recorder.seen = None
    return u.detach().reshape(-1, u.shape[-1]).cpu()


def open_batch(layer, u: torch.Tensor, g: torch.Tensor, col, dev: torch.device, finish: bool) -> Pending:
    """Route ``u`` once; ``col`` (or ``None``) sees the batch's input and output gradient (``out_grad_cov``,
    in batch order); ``finish``: this process adds the terms and closes the batch."""
    g = g.reshape(-1, g.shape[-1])
    ud = u.to(dev)
    with torch.no_grad():
        _, _, w, phys = layer.route(ud)
    if col is not None:
        col.on_input(ud)
        col.on_output_grad(g.to(dev))
    p = Pending(u, g, w, phys)
    if finish:
        p.gu = torch.zeros(u.shape, dtype=torch.float32, device=dev)
        p.wgrad = torch.zeros_like(w, dtype=torch.float32)
    return p


def chunk_terms(bank: ExpertBank, first: int, p: Pending, col, dev: torch.device) -> list[GradTerm]:
    """The terms of the experts of ``bank`` (from expert ``first``) for batch ``p``, in expert order; ``col``'s
    partials of the sums pooled by blocks of experts end with them (:meth:`StatsCollector.end_terms`)."""
    terms = list(expert_grad_terms(bank, p.u.to(dev), p, col, first))
    if col is not None:
        col.end_terms()
    return terms


def close_batch(layer, mod, x: torch.Tensor, args: tuple, kw: dict, p: Pending, col, dev: torch.device) -> torch.Tensor:
    """Add the shared expert's and the router's VJPs to ``p.gu``, then back-propagate ``p.g`` and ``p.gu``
    through the recomputed decoder layer ``mod``: ``x``'s gradient on the host."""
    assert p.gu is not None and p.wgrad is not None
    shell = layer.shell
    if shell.shared is not None:
        leaf = p.u.detach().to(dev).requires_grad_(True)
        with torch.enable_grad():
            shared_forward(shell, leaf, col).backward(p.g.to(dev).float())
        assert leaf.grad is not None
        p.gu += leaf.grad.float()
    leaf = p.u.detach().to(dev).requires_grad_(True)
    with torch.enable_grad():
        _, _, w, _ = layer.route(leaf)
        if w.requires_grad:
            w.backward(p.wgrad.to(w.dtype))
    if leaf.grad is not None:
        p.gu += leaf.grad.float()
    leaf = x.detach().to(dev).requires_grad_(True)
    args, kw = to_device((args, kw), dev)
    with torch.enable_grad():
        out = mod(leaf, *args, **kw)
        u = layer.recorder.seen
        layer.recorder.seen = None
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.backward([out, u], [p.g.to(dev).to(out.dtype).reshape(out.shape), p.gu.to(u.dtype).reshape(u.shape)])
    assert leaf.grad is not None
    return leaf.grad.cpu()


def whole_layer(skel, i: int, inputs: list, kwargs: list, grads: dict, needs, sample_tokens: int,
                group=None, rounds: int = 0):  # fmt: skip
    """The backward through MoE layer ``i`` held whole, batch by batch: ``grads[b]`` become the gradients
    w.r.t. ``inputs[b]``; returns the gradient statistics' collector. ``group``: data-parallel over ranks,
    this rank's batches in ``rounds`` rounds, the statistics merged round by round as one process adds them."""
    layer = ChunkedLayer(skel, i, 1 << 62)  # one chunk: every expert, in the buffer the forward cast the layer into
    _, bank = layer.chunk(0, check=False)
    col = StatsCollector(layer.shell, needs, sample_tokens, rounds=group is not None)
    col.mode = "backward"
    merged = StatsCollector(layer.shell, needs, sample_tokens) if group is not None else None
    mod, dev = layer.module(), skel.device
    for b in grads if group is None else range(rounds):
        if b in grads:
            args, kw = kwargs[b][i]
            p = open_batch(layer, record(layer, mod, inputs[b], args, kw, dev), grads[b], col, dev, finish=True)
            for term in chunk_terms(bank, 0, p, col, dev):
                add_grad_term(term, p)
            grads[b] = close_batch(layer, mod, inputs[b], args, kw, p, col, dev)
        if merged is not None:
            merge_round(group, col, merged)
    return merged if merged is not None else col


def by_chunks(skel, i: int, size: int, inputs: list, kwargs: list, grads: dict, needs,
                   sample_tokens: int = 512) -> StatsCollector:  # fmt: skip
    """The backward through MoE layer ``i`` by chunks of ``size`` experts, chunks outer (``expert_chunk``, one
    process): ``grads[b]`` (w.r.t. its output) become the gradients w.r.t. its input ``inputs[b]``; returns the
    gradient statistics' collector."""
    layer = ChunkedLayer(skel, i, size)
    col, dev = layer.collector(needs, sample_tokens), skel.device
    col.mode = "backward"
    mod = layer.module()
    pend = {}
    for b in grads:
        args, kw = kwargs[b][i]
        pend[b] = open_batch(layer, record(layer, mod, inputs[b], args, kw, dev), grads[b], col, dev, finish=True)
    mod = None  # not held while the chunks are: read again for the last recomputation
    for first, bank in layer.chunks(check=False):
        for b in grads:
            for term in chunk_terms(bank, first, pend[b], col, dev):
                add_grad_term(term, pend[b])
        col.sample_chunk(first, bank)  # expert_out_gram_fisher: the chunk's experts on the Ward tokens
        del bank
    mod = layer.module()
    for b in grads:
        args, kw = kwargs[b][i]
        grads[b] = close_batch(layer, mod, inputs[b], args, kw, pend[b], col, dev)
        pend[b] = None
    return col
