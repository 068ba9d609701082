"""The training loop of a stage: seeded batches, AdamW, gradient clipping, held-out loss before and
after (and for early stopping), the loss curve, tokens/s and peak memory.

Deterministic given the seed: batches are drawn from a private generator, the projectors are seeded
(:class:`~moecompress.training.losses.Objective`), the models run in eval mode (no dropout) and on
CPU every kernel is deterministic. Protected experts are restored after each step.

Under ``torchrun`` (``ranks``, the student sharded by :mod:`moecompress.training.fsdp`) every rank draws
the same batches, runs its own share of each batch's sequences and weights its loss by its share of the
positions; the gradients are summed across ranks (the gradient of the global mean loss) and the held-out
loss runs whole on every rank.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from moecompress.engine.distributed import SINGLE, Ranks
from moecompress.methods.distill import sft_loss
from moecompress.training.fsdp import Sharded, my_rows
from moecompress.training.losses import Objective, Teacher, forward_hidden, shift
from moecompress.training.student import LayoutMoE


@dataclass
class TrainResult:
    curve: list[float] = field(default_factory=list)
    heldout_before: float = math.nan
    heldout_after: float = math.nan
    heldout_curve: list[tuple[int, float]] = field(default_factory=list)
    balance_curve: list[float] = field(default_factory=list)
    projector_curve: list[float] = field(default_factory=list)
    steps: int = 0
    stopped_early: bool = False
    tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    peak_memory_mb: float = 0.0


def peak_memory_mb(device: str) -> float:
    """Peak memory of this process (CUDA: allocated on the device; else the peak RSS)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _forward(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_hidden`; an FSDP2 root (:class:`~moecompress.training.fsdp.Sharded`) through its own forward."""
    return model(ids) if isinstance(model, Sharded) else forward_hidden(model, ids)


@torch.no_grad()
def heldout_loss(model: nn.Module, ids: torch.Tensor, batch: int) -> float:
    """Mean next-token cross entropy of ``model`` on ``ids`` (every position counts once)."""
    total, n = 0.0, 0
    device = next(model.parameters()).device
    for s in range(0, len(ids), batch):
        part = ids[s : s + batch].to(device)
        _, logits = _forward(model, part)
        k = part.shape[0] * (part.shape[1] - 1)
        total += float(sft_loss(logits, shift(part))) * k
        n += k
    return total / max(n, 1)


def _rounding(moes: dict[int, LayoutMoE], cfg) -> None:
    for moe in moes.values():
        moe.rounding = None if cfg is None else (cfg.tile, cfg.mode)


def _track(routed: list[nn.Module], on: bool) -> None:
    for m in routed:
        m.track_balance, m.balance = on, None if on else m.balance


def _batches(n: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(n, (min(batch, n),), generator=g) for _ in range(steps)]


def pretrain_projectors(objective: Objective, teacher: Teacher, ids: torch.Tensor, cfg, progress: bool) -> list[float]:
    """Residual stage 1: ``P^{A→T}(P^{T→A}(h^T))`` through the teacher's head; then ``P^{T→A}`` frozen."""
    params = [*objective.p_ta.parameters(), *objective.p_at.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.projector_lr, weight_decay=0.0)
    curve = []
    for idx in tqdm(_batches(len(ids), cfg.batch, cfg.projector_steps, cfg.seed + 1), desc="projector",
                    disable=not progress):  # fmt: skip
        part = ids[idx].to(objective.p_ta.weight.device)
        loss = objective.projector_loss(teacher(part), shift(part))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
    objective.p_ta.requires_grad_(False)
    return curve


def train(
    student: nn.Module,
    moes: dict[int, LayoutMoE],
    params: list[nn.Parameter],
    objective: Objective,
    teacher: Teacher,
    train_ids: torch.Tensor,
    hold_ids: torch.Tensor,
    cfg,
    *,
    device: str = "cpu",
    progress: bool = True,
    state_dir: Path | None = None,
    on_step: Callable[[int], None] | None = None,
    routed: list[nn.Module] = (),
    ranks: Ranks = SINGLE,
) -> TrainResult:
    """Train ``params`` of ``student`` for ``cfg.steps`` steps (fewer when early stopping triggers:
    ``eval_every`` > 0 and the held-out loss did not improve for ``patience`` evaluations; the best
    parameters are then restored). With ``state_dir`` and ``cfg.save_every``, the whole training state
    is saved every ``save_every`` steps and a saved state is resumed (the result is bit-identical to an
    uninterrupted run). ``routed``: routed LoRA wrappers whose router load-balancing term, times
    ``cfg.lora_balance``, is added to the loss (mean over them; LoRA-Mixer). ``ranks``: the FSDP2 ranks
    (see the module docstring; ``student`` is then the sharded root)."""
    res = TrainResult()
    routed = list(routed) if getattr(cfg, "lora_balance", 0) > 0 else []
    saved = _load_state(state_dir)
    if saved is None:
        res.heldout_before = heldout_loss(student, hold_ids, cfg.batch)
        if cfg.method == "residual" and cfg.pretrain_projector:
            res.projector_curve = pretrain_projectors(objective, teacher, train_ids, cfg, progress)
        objective.start_stage2()
    elif cfg.method == "residual" and cfg.pretrain_projector:
        objective.p_ta.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    own = objective.stage2_parameters()
    for p in own:
        p.requires_grad_(True)
    everything = [*params, *own]
    opt = torch.optim.AdamW(everything, lr=cfg.lr, weight_decay=0.0)
    best, best_state, bad, start = res.heldout_before, None, 0, 0
    if saved is not None:
        best, best_state, bad, start = _restore(saved, res, everything, objective, opt)
    t0, c0 = time.perf_counter(), time.thread_time()
    bar = tqdm(_batches(len(train_ids), cfg.batch, cfg.steps, cfg.seed), desc="distill", disable=not progress)
    for step, idx in enumerate(bar, start=1):
        if step <= start:
            continue
        mine = idx if ranks.world_size == 1 else my_rows(idx, ranks)
        share = mine.numel() / idx.numel()  # of the batch's positions (sequences of one length)
        part = train_ids[mine].to(device)
        targets = shift(part)
        t = teacher(part)
        _rounding(moes, cfg.token_rounding)
        _track(routed, True)
        try:
            h_s, logits = _forward(student, part)
        finally:
            _rounding(moes, None)
            _track(routed, False)
        loss = objective(h_s, logits, t, targets)
        if routed:
            balance = torch.stack([m.balance for m in routed]).mean()
            res.balance_curve.append(float(balance.detach()))
            loss = loss + cfg.lora_balance * balance
        if ranks.world_size > 1:
            loss = loss * share
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_([*params, *own], cfg.clip)
        opt.step()
        for moe in moes.values():
            moe.restore_frozen()
        value = float(loss.detach())
        if ranks.world_size > 1:  # the ranks' weighted parts, in rank order (float64)
            value = sum(v[0] for v in ranks.all_gather_f64([value], 1))
        res.curve.append(value)
        res.tokens += idx.numel() * train_ids.shape[1]
        res.steps = step
        bar.set_postfix(loss=f"{res.curve[-1]:.4f}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            held = heldout_loss(student, hold_ids, cfg.batch)
            res.heldout_curve.append((step, held))
            if held < best:
                best, bad = held, 0
                best_state = [p.detach().clone() for p in params]
            else:
                bad += 1
                if bad >= cfg.patience:
                    res.stopped_early = True
                    break
        if state_dir is not None and cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            _save_state(state_dir, step, res, everything, objective, opt, best, best_state, bad)
        if on_step is not None:
            on_step(step)
    bar.close()
    res.seconds, res.cpu_seconds = time.perf_counter() - t0, time.thread_time() - c0
    for p in [*params, *own]:
        p.requires_grad_(False)
    res.heldout_after = heldout_loss(student, hold_ids, cfg.batch)
    if best_state is not None and best < res.heldout_after:
        with torch.no_grad():
            for p, b in zip(params, best_state):
                p.copy_(b)
        res.heldout_after = best
    res.peak_memory_mb = peak_memory_mb(device)
    return res


STATE = "state.safetensors"


def _save_state(state_dir: Path, step, res, params, objective, opt, best, best_state, bad) -> None:
    """Everything a resumed run needs, in one safetensors file (metadata: the JSON part), atomically."""
    tensors = {f"param.{i}": p.detach().contiguous() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            tensors[f"opt.{k}.{i}"] = v.detach().reshape(-1).contiguous()
    tensors.update({f"obj.{k}": v.detach().contiguous() for k, v in objective.state_dict().items()})
    tensors.update({f"best.{i}": b.contiguous() for i, b in enumerate(best_state or [])})
    meta = {"step": step, "best": best, "bad": bad, "has_best": best_state is not None,
            "res": {k: v for k, v in asdict(res).items() if k not in ("seconds", "cpu_seconds")}}  # fmt: skip
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE + ".tmp")
    save_file({k: v.cpu().clone() for k, v in tensors.items()}, str(tmp), metadata={"state": json.dumps(meta)})
    os.replace(tmp, state_dir / STATE)


def _load_state(state_dir: Path | None) -> tuple[dict, dict] | None:
    path = None if state_dir is None else state_dir / STATE
    if path is None or not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["state"])
    return meta, load_file(str(path))


def _restore(saved, res, params, objective, opt):
    meta, t = saved
    for k, v in meta["res"].items():
        setattr(res, k, [tuple(x) for x in v] if k == "heldout_curve" else v)
    objective.load_state_dict({k[4:]: v for k, v in t.items() if k.startswith("obj.")})
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(t[f"param.{i}"])
            state = {k.split(".")[1]: v for k, v in t.items() if k.startswith("opt.") and k.endswith(f".{i}")}
            if state:
                opt.state[p] = {
                    k: (v.reshape(p.shape) if k != "step" else v.reshape(())).to(p.device) for k, v in state.items()
                }
    best_state = [t[f"best.{i}"] for i in range(len(params))] if meta["has_best"] else None
    return meta["best"], best_state, meta["bad"], meta["step"]
