"""The ``distill`` / ``lora_heal`` stage under ``torchrun``: the student trained with FSDP2
(``torch.distributed.fsdp.fully_shard``) over the process group :func:`moecompress.engine.distributed.start`
began, data-parallel (``docs/training.md``, ``docs/distributed.md``).

- **Units.** Every decoder layer (attention + :class:`~moecompress.training.student.LayoutMoE`) is one
  FSDP2 unit, sharded as soon as it is read (:func:`sharded_student`), then :class:`Sharded` (a root module
  holding the student) takes what is left: embeddings, final norm, head. FSDP2 shards per parameter (dim 0, ``torch.chunk``), so a unit may hold trainable and
  frozen parameters together (frozen ones get no gradient and no reduce-scatter); ``requires_grad`` is set
  on the trainable parameters *before* sharding, since FSDP2 builds each unsharded parameter once.
- **Data.** Every rank draws the same seeded batch indices; rank ``r`` takes the ``r``-th of
  ``torch.tensor_split(indices, N)`` (fixed order, disjoint) and runs the teacher and the student on it.
  Its loss (a mean over its positions) is weighted by its share of the batch's positions and the gradients
  are *summed* across ranks (divide factor 1), so the gradient is one process's mean-loss gradient; the
  logged loss is the float64 sum of the weighted parts in rank order.
- **Activation checkpointing.** Each decoder layer of the student runs its forward again in the backward
  (``torch.distributed._composable.checkpoint``): autograd would otherwise keep every layer's unsharded
  float32 weights (the stored-dtype casts the matmuls save) to the end of the forward, the whole student on
  every rank. The recomputation gives the same values, so the gradients are those without it.
- **Teacher.** Frozen, sharded the same way as it is built (:func:`sharded_teacher`): no rank holds it whole.
- **Writing.** Rank 0 gathers the full state dict (``get_model_state_dict``, full and CPU-offloaded),
  builds a plain student a layer at a time, each layer taking its gathered tensors as it is read
  (:func:`plain_student`), and writes it as one process does; the other ranks write nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from moecompress.errors import Interrupted, PassError
from moecompress.training.losses import forward_hidden


def unsupported(cfg) -> str | None:
    """Why a stage config cannot train under ``torchrun`` (``None``: it can)."""
    if cfg.method == "residual":
        return "method: residual (its beta and mask normalise over the whole batch)"
    if cfg.token_rounding is not None:
        return "token_rounding (tiles are rounded over the whole batch)"
    if cfg.trainable == "lora" and cfg.target != "experts":
        return f"target: {cfg.target} (attention LoRA wrappers are not sharded)"
    if cfg.save_every:
        return "save_every (the resumable training state is one process's)"
    return None


class Sharded(nn.Module):
    """The FSDP2 root: ``forward(ids)`` is :func:`forward_hidden` of the student, so the root unit's hooks
    run around the whole forward (``forward_hidden`` calls the inner model and the head directly)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return forward_hidden(self.lm, ids)


def sharded_student(ckpt, device: str, trainable_of: Callable[[int, nn.Module], list[nn.Parameter]],
                    everything: bool) -> tuple[nn.Module, dict, Sharded, list[nn.Parameter]]:
    """The student of ``ckpt`` sharded a decoder layer at a time as it is built (a rank holds ``1/N`` of it
    and one layer whole), each layer's forward checkpointed. ``trainable_of(i, moe)``: MoE layer ``i``'s
    trainable tensors (called before the layer is sharded: ``requires_grad`` is fixed before FSDP2 sees it);
    ``everything`` (``trainable: all``) adds every other parameter. Returns ``(model, moes, root, params)``,
    ``params`` the sharded trainable parameters in one process's order (the MoE tensors layer by layer, then
    the others in the model's order)."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    from moecompress.training.student import LayoutMoE, build_model

    order: list[str] = []

    def on_layer(i: int, layer: nn.Module) -> None:
        layer.requires_grad_(False)
        mine = [p for m in layer.modules() if isinstance(m, LayoutMoE) for p in trainable_of(i, m)]
        names = {id(p): n for n, p in layer.named_parameters()}
        order.extend(f"model.layers.{i}.{names[id(p)]}" for p in mine)
        for p in mine:
            p.requires_grad_(True)
        if everything:
            for n, p in layer.named_parameters():
                p.requires_grad_(p.requires_grad or ".params." not in n)
        checkpoint(layer)  # recomputed in the backward: one layer's float32 weights held at a time
        fully_shard(layer)

    model, moes = build_model(ckpt, device, on_layer=on_layer)
    if everything:
        order += [n for n, _ in model.named_parameters() if ".params." not in n]
    want = set(order)
    for n, p in model.named_parameters():  # build_model froze everything after the layers were sharded
        p.requires_grad_(n in want)
    root = Sharded(model)
    fully_shard(root)
    for unit in [*model.model.layers, root]:
        unit.set_gradient_divide_factor(1.0)  # summed: each rank's loss is already weighted by its share
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM or AVG)
    now = dict(model.named_parameters())
    return model, moes, root, [now[n] for n in order]


def sharded_teacher(ckpt, device: str) -> tuple[nn.Module, dict, Sharded]:
    """The frozen teacher of ``ckpt``, each decoder layer sharded as soon as it is built (a rank holds its
    1/N of the teacher and one layer whole while building), then the root: ``(model, moes, root)``; run it
    through ``root`` (FSDP2 gathers one layer at a time and frees it after its forward)."""
    from torch.distributed.fsdp import fully_shard

    from moecompress.training.student import build_model

    model, moes = build_model(ckpt, device, on_layer=lambda _i, layer: fully_shard(layer.requires_grad_(False)))
    root = Sharded(model.requires_grad_(False))
    fully_shard(root)
    return model, moes, root


def my_rows(idx: torch.Tensor, ranks) -> torch.Tensor:
    """This rank's share of a batch's sequence indices (the ``rank``-th of ``N`` contiguous parts)."""
    return torch.tensor_split(idx, ranks.world_size)[ranks.rank]


def full_state(root: Sharded) -> dict[str, torch.Tensor]:
    """The student's full state dict on CPU (rank 0; empty elsewhere), by the student's own names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("lm."): v for k, v in sd.items()}


def plain_student(ckpt, cfg, state: dict[str, torch.Tensor]):
    """A one-process student of ``ckpt`` (with the stage's expert LoRA) holding ``state``: what rank 0 writes.
    Each decoder layer takes its gathered tensors (``assign``) as soon as it is read, so the tensors read
    from the checkpoint are held one layer at a time beside ``state``; ``state`` is emptied."""
    from moecompress.training.student import LayoutMoE, build_model

    keys = set(state)

    def take(i: int, layer: nn.Module) -> None:
        if cfg.trainable == "lora":
            for m in layer.modules():
                if isinstance(m, LayoutMoE):
                    m.attach_lora(cfg.lora_rank, cfg.lora_alpha, cfg.seed + i)
        pre = f"model.layers.{i}."
        own = layer.state_dict()
        layer.load_state_dict({k[len(pre) :]: state.pop(k) for k in list(state) if k.startswith(pre)
                               and k[len(pre) :] in own}, strict=False, assign=True)  # fmt: skip

    model, moes = build_model(ckpt, "cpu", on_layer=take)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    state.clear()
    left = [k for k in own if k not in keys and not k.endswith("inv_freq")]
    if left:
        raise PassError(f"the gathered state misses {left[:3]}")
    return model, moes


WIRE = ("gloo", "nccl", "connection", "peer", "timed out", "timeout")
"""What the message of a collective that failed because another rank went says (gloo raises a plain
``RuntimeError``); any other error goes through unchanged."""


@contextmanager
def collectives(ranks, label: str) -> Iterator[None]:
    """FSDP2's own collectives failing (another rank died) as :class:`Interrupted`, one line."""
    try:
        yield
    except RuntimeError as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        if not isinstance(err, torch.distributed.DistError) and not any(w in first.lower() for w in WIRE):
            raise
        raise Interrupted(
            f"rank {ranks.rank} of {ranks.world_size}: {label}: training failed, another rank "
            f"stopped or is unreachable ({first})"
        ) from None
