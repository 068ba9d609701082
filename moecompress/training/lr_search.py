"""``lr: auto``: the stage's learning rate chosen from a small grid by its own held-back calibration
tokens — never the evaluation text.

For every candidate ``lr`` of ``lr_grid`` a probe trains the student from its initial state for
``lr_probe_steps`` steps (0: ``steps // 4``, at least 1) on the stage's training sequences, with the
run's seed (so the probe sees the first batches the real run sees; residual: stage-1 projector
pre-training shortened to the probe's steps), then scores the next-token cross entropy on the
stage's held-back sequences (``hold_ids``: the last ``holdout`` of the ``samples`` drawn from the
calibration split of ``data``). The student is restored bit-identically after each probe and the
objective (with its seeded projectors) is rebuilt, so the choice is a deterministic function of the
seed: the lowest held-back loss wins, ties (and non-finite losses) going to the smaller lr.

Cost: ``len(lr_grid) × lr_probe_steps`` extra steps, reported as ``lr_search`` in the step report
(each candidate's held-back loss and CPU seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from moecompress.engine.distributed import SINGLE, Ranks
from moecompress.training.loop import train
from moecompress.training.losses import Objective, Teacher
from moecompress.training.student import LayoutMoE


def probe_steps(cfg) -> int:
    """Steps per candidate."""
    return cfg.lr_probe_steps or max(1, cfg.steps // 4)


def choose_lr(
    student: nn.Module,
    moes: dict[int, LayoutMoE],
    params: list[nn.Parameter],
    make_objective: Callable[[], Objective],
    teacher: Teacher,
    train_ids: torch.Tensor,
    hold_ids: torch.Tensor,
    cfg,
    *,
    device: str = "cpu",
    routed: list[nn.Module] = (),
    ranks: Ranks = SINGLE,
) -> tuple[float, list[dict]]:
    """``(chosen lr, one row per candidate)``; ``params`` are left exactly as they were. ``ranks``: the
    FSDP2 ranks (every rank scores the whole held-back set, so every rank chooses the same lr)."""
    n = probe_steps(cfg)
    init = [p.detach().clone() for p in params]
    rows = []
    for lr in sorted(cfg.lr_grid):
        probe = cfg.model_copy(update={"lr": lr, "steps": n, "eval_every": 0, "save_every": 0,
                                       "projector_steps": min(cfg.projector_steps, n)})  # fmt: skip
        res = train(student, moes, params, make_objective(), teacher, train_ids, hold_ids, probe, device=device,
                    progress=False, routed=routed, ranks=ranks)  # fmt: skip
        with torch.no_grad():
            for p, v in zip(params, init):
                p.copy_(v)
        rows.append({"lr": lr, "steps": n, "heldout_loss": res.heldout_after, "cpu_seconds": round(res.cpu_seconds, 3)})
    best = min(rows, key=lambda r: (r["heldout_loss"] if math.isfinite(r["heldout_loss"]) else math.inf, r["lr"]))
    return best["lr"], rows
