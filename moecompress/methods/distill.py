"""Distillation losses as pure tensor functions (no engine imports): KD, hidden-state MSE, SFT and the
residual-learning loss of METHODS.md §6 with its MoE expert fusion.

Shapes: logits ``[N, V]``, hidden states ``[N, D]``, targets ``[N]`` (next-token ids; positions that
have none are dropped by the caller). Every loss is a mean over positions, so it does not depend on
the batch size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sft_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over positions (fp32)."""
    return F.cross_entropy(logits.float(), targets)


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher ‖ student) of the temperature-softened distributions, times ``temperature²`` (so the
    gradient scale does not depend on it, Hinton et al.), mean over positions; 0 when they agree."""
    t = float(temperature)
    log_s = F.log_softmax(student_logits.float() / t, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / t, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean") * t * t


def hidden_mse(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the final hidden states, mean over positions and features."""
    return F.mse_loss(student_hidden.float(), teacher_hidden.float())


def fuse_experts(outputs: torch.Tensor, weights: torch.Tensor, mode: str = "attention") -> torch.Tensor:
    """Fuse each token's expert outputs ``[N, k, D]`` into one vector ``[N, D]``.

    ``attention``: parameter-free scaled dot-product self-attention across the ``k`` experts,
    ``h̃^(m) = Σ_j softmax_j(h^(m)·h^(j) / √D) h^(j)``, then the routing-weighted sum
    ``Σ_m w_m h̃^(m)``; ``mean``: the routing-weighted sum of the plain average of the experts
    (the paper's average-pooling ablation). ``weights`` ``[N, k]`` are the router's top-k weights."""
    w = weights.float().unsqueeze(-1)
    y = outputs.float()
    if mode == "mean":
        fused = y.mean(dim=1, keepdim=True).expand_as(y)
    elif mode == "attention":
        att = torch.softmax(y @ y.transpose(1, 2) / math.sqrt(y.shape[-1]), dim=-1)
        fused = att @ y
    else:
        raise ValueError(f"fusion must be 'attention' or 'mean', got {mode!r}")
    return (fused * w).sum(dim=1)


def residual_beta(student_hidden: torch.Tensor, projected: torch.Tensor, d_a: int) -> torch.Tensor:
    """β = sqrt(d_S / d_A) · mean_i ‖h^S_i‖ / ‖proj_i‖ (a detached scalar)."""
    d_s = student_hidden.shape[-1]
    ratio = student_hidden.float().norm(dim=-1) / projected.float().norm(dim=-1).clamp_min(1e-12)
    return (math.sqrt(d_s / d_a) * ratio.mean()).detach()


def teacher_wrong(teacher_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: where the teacher's top-1 prediction is not the next token."""
    return teacher_logits.argmax(dim=-1) != targets


def residual_loss(
    student_hidden: torch.Tensor,
    projected: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    mask: torch.Tensor | None,
    beta: torch.Tensor | float,
) -> torch.Tensor:
    """L_res = CE(W_S (h^S − β · proj · mask), x): the student's hidden state minus the (scaled)
    projected teacher residual where ``mask`` is set (everywhere when ``None``), through the
    student's head ``head``."""
    r = projected.to(student_hidden.dtype) * beta
    if mask is not None:
        r = r * mask.to(r.dtype).unsqueeze(-1)
    return sft_loss(head(student_hidden - r), targets)


def projector_loss(
    teacher_hidden: torch.Tensor, reconstructed: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor
) -> torch.Tensor:
    """Stage 1 (projector pre-training T->A->T): reconstruction MSE + next-token CE of the
    reconstruction through the teacher's head."""
    return hidden_mse(reconstructed, teacher_hidden) + sft_loss(head(reconstructed), targets)
