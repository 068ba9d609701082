"""Expert-chunked calibration: an MoE decoder layer run while holding only a chunk of its experts.

Every supported decoder layer adds its MoE block's output to the residual stream last
(``out = h1 + MoE(u)``, ``h1`` the residual after attention, ``u`` the post-attention norm of it;
``tests/test_chunked_calibration.py`` checks it for every adapter). So a layer listed in
``RunContext.expert_chunks`` runs in two phases, holding the layer's *shell*
(:meth:`~moecompress.io.checkpoint.Checkpoint.read_layer_shell`: router, score bias, shared expert) and
one chunk of experts (:meth:`~moecompress.io.checkpoint.Checkpoint.read_experts`) at a time:

**Forward.** transformers' decoder layer runs every batch with its MoE block replaced (on our own module
instance) by :class:`RecordingMoE`, which keeps ``u_b`` and returns zeros, so the layer returns ``h1_b``.
The router runs once per batch (``on_input``/``on_route``); then chunks outer, batches inner (each chunk
is read once per sweep), every chunk's experts add their weighted partials to the batch's fp32
accumulators (:func:`~moecompress.reference.expert_partials`, in the whole-layer order, so the sums are
bit-identical) with the collector's ``on_expert`` for those experts; last, per batch, the shared expert,
the cast, ``on_output``, and the layer output ``h1_b + moe_b``. Statistics equal the whole layer's bit for
bit; the sums pooled over experts too (``down_in_cov_pooled``, kept by fixed blocks of experts:
``stats.POOLED_BY_BLOCK``) when the chunks are unions of blocks, else the same float64 terms in another order
(``cache.CHUNK_ORDERED``).

**Backward** (reversed layers, the incoming gradient ``g_b`` w.r.t. the layer output): the expert-by-expert
backward of :mod:`~moecompress.calibration.moe_backward` with chunks outer (``by_chunks``). ``u_b`` is recorded and routed
once per batch; for each chunk (read once) and batch, each of the chunk's experts is back-propagated from
leaves of its tokens' ``u_b`` rows and routing weights with ``g_b`` (the collector's hooks give its
gradient statistics), its input gradient added to the batch's fp32 ``gu_b`` in expert order; then per
batch the shared expert, the router (from the weight gradients) and the recomputed decoder layer
(``backward([h1_b, u_b], [g_b, gu_b])``), which gives ``x_b``'s gradient, the next layer's ``g``. So the
gradients and gradient statistics are the bits of the layer held whole (which runs the same backward batch
by batch), ``down_in_grad_cov_pooled`` too when the chunks are unions of its blocks of experts
(``stats.POOLED_BY_BLOCK``; else its float64 terms in another order).

Held, besides the shell and one chunk: every batch's ``u_b`` and ``h1_b`` and the fp32 accumulators
(forward), ``u_b`` and fp32 ``gu_b`` (backward); ``engine/resources.py`` counts them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moecompress.calibration.chunk_buffer import ChunkBuffer
from moecompress.calibration.skeleton import all_finite, check_bank_finite, check_finite, run_batch, to_device
from moecompress.calibration.stats import StatsCollector
from moecompress.errors import CheckpointError
from moecompress.ir import ExpertBank, MoELayer, cast_layer, layer_to
from moecompress.layouts.dense import Dense
from moecompress.reference import expert_partials, physical_ids, route_logits, shared_forward


class RecordingMoE(nn.Module):
    """MoE block stand-in: keeps its input (``seen``) and returns zeros, so the decoder layer returns the
    residual stream before the MoE output is added."""

    def __init__(self, returns_tuple: bool = False) -> None:
        super().__init__()
        self.returns_tuple = returns_tuple
        self.seen: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor):
        self.seen = hidden_states
        zero = torch.zeros_like(hidden_states)
        return (zero, None) if self.returns_tuple else zero


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def ready_bank(bank: ExpertBank, dtype: torch.dtype, device: torch.device) -> ExpertBank:
    """``bank`` in the compute dtype on ``device`` (what ``cast_layer`` and ``layer_to`` do to a layer)."""
    return dataclasses.replace(
        bank,
        gate=bank.gate.cast(dtype).to(device),
        up=bank.up.cast(dtype).to(device),
        down=bank.down.cast(dtype).to(device),
        widths=_to(bank.widths, device),
        biases={k: v.to(device=device, dtype=dtype) for k, v in bank.biases.items()},
        rotation=_to(bank.rotation, device),
    )


def ready_shell(shell: MoELayer, dtype: torch.dtype, device: torch.device) -> MoELayer:
    """The shell (routed experts on ``meta``) in the compute dtype on ``device`` (as ``cast_layer`` and
    ``layer_to`` make a whole layer; ``score_bias`` keeps its dtype); its experts stay meta."""

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return shell.replace(
        shared=None if shell.shared is None else ready_bank(shell.shared, dtype, device),
        router_weight=cast(shell.router_weight),
        router_bias=cast(shell.router_bias),
        score_bias=_to(shell.score_bias, device),
        shared_gate=cast(shell.shared_gate),
        expert_map=_to(shell.expert_map, device),
        routing_similarity=_to(shell.routing_similarity, device),
    )


def _plain(bank: ExpertBank) -> bool:
    """A bank of dense experts in their full widths, no rotation: what :meth:`ChunkBuffer.take`'s tensors hold."""
    lays = (bank.gate, bank.up, bank.down)
    return all(isinstance(x, Dense) for x in lays) and bank.widths is None and bank.rotation is None


def read_into(ckpt, i: int, a: int, b: int, buf: ChunkBuffer, dtype, device, check: bool) -> ExpertBank:
    """Routed experts ``[a, b)`` of MoE layer ``i`` in ``dtype`` on ``device``, copied into ``buf``'s tensors as
    they are read (:data:`~moecompress.adapters.base.Alloc`; checked for NaN/Inf when ``check``): bit for bit
    ``ready_bank(ckpt.read_experts(i, a, b), dtype, device)``."""
    bank = ckpt.read_experts(i, a, b, alloc=lambda proj, shape: buf.take(proj, shape, dtype, device))
    if check and not all(all_finite(getattr(bank, p).weight) for p in ("gate", "up", "down")):
        _not_finite(ckpt, i, a, b, dtype)
    return ready_bank(bank, dtype, device)  # (biases; weights already in dtype on device are kept as they are)


def _not_finite(ckpt, i: int, a: int, b: int, dtype) -> None:
    """Experts ``[a, b)`` hold NaN/Inf in ``dtype``: the checkpoint's expert named if its weights do, else the
    overflow of the compute dtype."""
    bank = ckpt.read_experts(i, a, b)
    check_bank_finite(i, bank, first=a)
    big = next((p for p in ("gate", "up", "down") if not all_finite(getattr(bank, p).weight.to(dtype))), "gate")
    raise CheckpointError(
        f"layer {i}: experts {a}..{b - 1} {big}_proj hold weights beyond the range of calibration.dtype "
        f"{str(dtype).removeprefix('torch.')}; set calibration.dtype: bfloat16 or float32"
    )


def cast_into(layer: MoELayer, buf: ChunkBuffer, dtype: torch.dtype, device: torch.device) -> MoELayer:
    """``layer_to(cast_layer(layer, dtype), device)``, bit for bit, with a dense routed bank that needs a cast
    or a move copied into ``buf``'s tensors instead of fresh ones (a Qwen3-30B layer in float32 is 2.4 GB); valid
    until the next chunk or layer is read into ``buf``. The layer held whole in calibration, one process or
    data-parallel (:func:`~moecompress.calibration.sweep.run_calibration`)."""
    bank = layer.experts
    w = bank.gate.weight if isinstance(bank.gate, Dense) else None
    if not _plain(bank) or w is None or (w.dtype == dtype and w.device == device):
        return layer_to(cast_layer(layer, dtype), device)
    moved = {p: Dense(buf.take(p, tuple(getattr(bank, p).weight.shape), dtype, device).copy_(getattr(bank, p).weight))
             for p in ("gate", "up", "down")}  # fmt: skip
    # the rest cast and moved as always (the experts' tensors, already in dtype on device, are kept as they are)
    return layer_to(cast_layer(layer.replace(experts=dataclasses.replace(bank, **moved)), dtype), device)


class ChunkedLayer:
    """MoE layer ``i`` of ``skel``'s checkpoint in chunks of ``size`` experts, each read into ``buffer``
    (default ``skel.chunk_buffer``, which the calibration's chunked layers share): a chunk's bank is valid until
    the next chunk is read into the buffer."""

    def __init__(self, skel, i: int, size: int, buffer: ChunkBuffer | None = None) -> None:
        self.skel, self.i = skel, i
        self.buffer = skel.chunk_buffer if buffer is None else buffer
        self.dtype, self.device = skel.dtype, skel.device
        shell = skel.ckpt.read_layer_shell(i)
        check_finite(shell, experts=False)
        self.shell = ready_shell(shell, self.dtype, self.device)
        e = shell.experts.num_experts
        self.ranges = [(a, min(a + size, e)) for a in range(0, e, size)]
        self.recorder = RecordingMoE(skel.ckpt.adapter.module_returns_tuple)

    def collector(self, needs, sample_tokens: int = 512, spill: bool = False) -> StatsCollector:
        return StatsCollector(self.shell, needs, sample_tokens, spill=spill)

    def chunks(self, check: bool):
        """``(first expert, bank)`` for every chunk, each read (and checked) when it is reached."""
        for k in range(len(self.ranges)):
            yield self.chunk(k, check)

    def chunk(self, k: int, check: bool) -> tuple[int, ExpertBank]:
        """``(first expert, bank)`` of chunk ``k``, read (and checked) now."""
        a, b = self.ranges[k]
        return a, read_into(self.skel.ckpt, self.i, a, b, self.buffer, self.dtype, self.device, check)

    def module(self) -> nn.Module:
        return self.skel.layer(self.i, block=self.recorder)

    def route(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits, ids, weights, physical ids)`` of one batch's MoE input ``u`` ``[T, H]``."""
        logits, ids, w = route_logits(self.shell, u)
        return logits, ids, w, physical_ids(ids, self.shell.router.num_experts, self.shell.expert_map)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def forward_layer(skel, i: int, size: int, hidden: list, kwargs: list, holdout: list[bool], needs,
                  sample_tokens: int, keep_inputs: bool, save_experts=None) -> tuple[list[torch.Tensor], StatsCollector]:  # fmt: skip
    """Layer ``i``'s outputs for every batch of ``hidden`` and its forward statistics' collector.
    ``hidden[b]`` is released (set to ``None``) once recorded unless ``keep_inputs``. ``save_experts(i, a,
    stats)``: given, the per-expert covariances (:data:`~moecompress.calibration.stats.SPILLED`) of every
    expert ``a`` of a chunk are handed to it, expert by expert, once the chunk is done, and not held (the
    collector's ``result`` has the rest)."""
    layer = ChunkedLayer(skel, i, size)
    col, dev, cpu = layer.collector(needs, sample_tokens, spill=save_experts is not None), skel.device, torch.device("cpu")
    mod = layer.module()
    h1s, us = [], []
    with torch.no_grad():
        for b, x in enumerate(hidden):
            args, kw = kwargs[b][i]
            h1s.append(run_batch(mod, x, args, kw, dev))
            us.append(_flat(layer.recorder.seen).to(cpu))
            layer.recorder.seen = None
            if not keep_inputs:
                hidden[b] = None
        del mod
        states, phys, outs, accs = [], [], [], []
        for b, u in enumerate(us):  # the router once per batch, in batch order (token offsets, samples)
            col.mode = "holdout" if holdout[b] else "stats"
            u = u.to(dev)
            col.on_input(u)
            logits, ids, w, p = layer.route(u)
            col.on_route(logits, ids, w)
            states.append(col.batch_state())
            phys.append(p)
            outs.append(torch.zeros(u.shape, dtype=torch.float32, device=dev))
            accs.append({"out": outs[-1]})  # one fp32 accumulator: 0 + (0 + partials) == 0 + partials, bit for bit
        for first, bank in layer.chunks(check=True):  # chunks outer: each is read once
            for b, u in enumerate(us):
                col.mode = "holdout" if holdout[b] else "stats"
                u = u.to(dev)
                col.resume_batch(states[b], u)
                _, _, w = states[b]
                expert_partials(bank, u, phys[b], w, outs[b], accs[b], col, first)
            col.mode = "stats"
            col.sample_chunk(first, bank)  # expert_out_gram: the chunk's experts on the io_sample tokens
            if save_experts is not None:  # expert by expert: one expert's rows and writer copy at a time
                for e in range(first, first + bank.num_experts):
                    save_experts(i, e, col.spill(e, e + 1))
            del bank
        result = []
        for b, u in enumerate(us):
            col.mode = "holdout" if holdout[b] else "stats"
            u = u.to(dev)
            col.resume_batch(states[b], u)
            out = outs[b]
            for space, value in accs[b].items():
                if value is not out:
                    out += layer.shell.experts.down.decode(space, value).float()
            if layer.shell.shared is not None:
                out = out + shared_forward(layer.shell, u, col)
            moe = out.to(u.dtype)
            col.on_output(moe)
            h1 = h1s[b]
            result.append(h1 + to_device(moe, cpu).reshape(h1.shape))
            h1s[b] = us[b] = outs[b] = accs[b] = None
    return result, col
