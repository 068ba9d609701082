"""The training objectives of the ``distill`` stage, on whole models: what the teacher gives per
batch and how each method turns student and teacher outputs into one loss (the maths is in
:mod:`moecompress.methods.distill`).

Positions: a batch of sequences ``[B, L]`` predicts tokens ``1..L-1`` from the preceding ones, so
every loss is a mean over ``B·(L-1)`` positions. Hidden states are the final (normed) hidden states,
the head's input.

``residual`` (METHODS.md §6): ``h^T`` is the teacher's final hidden state in which the last MoE
layer's routed sum ``Σ_k w_k y_k`` is replaced by the experts' fusion (:func:`fuse_experts`,
``attention`` or ``mean``) — when that layer is the last decoder layer (otherwise the plain final
hidden state, said in the report). Stage 1 pre-trains ``P^{T→A}``, ``P^{A→T}`` (``d_a``) on the
teacher alone, then ``P^{T→A}`` is frozen; stage 2 trains ``P^{A→S}`` with the student.
"""

from __future__ import annotations

import torch
from torch import nn

from moecompress.methods import distill as m
from moecompress.training.student import LayoutMoE, _Capture


def shift(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets ``[B·(L-1)]``."""
    return ids[:, 1:].reshape(-1)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x[:, :-1].reshape(-1, x.shape[-1])


def forward_hidden(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(final hidden [N, D], logits [N, V])`` at the predicting positions."""
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state
    h = _flat(h)
    return h, model.get_output_embeddings()(h)


class Teacher:
    """The frozen teacher: logits and hidden states per batch, with the MoE fusion for ``residual``."""

    def __init__(
        self, model: nn.Module, moes: dict[int, LayoutMoE], fusion: str | None, runner: nn.Module | None = None
    ) -> None:
        self.model, self.fusion = model, fusion
        for moe in moes.values():
            moe.exact = True  # never trained: its parameters are the stored values
        self.runner = runner
        """``ids -> (hidden, logits)`` in place of :func:`forward_hidden` (an FSDP2 root; without fusion)."""
        last = max(moes) if moes else None
        n_layers = len(model.model.layers)
        self.fused = fusion is not None and last == n_layers - 1
        self.last_moe = moes.get(last)
        self.note = None
        if fusion is not None and not self.fused:
            self.note = (f"the last MoE layer ({last}) is not the last decoder layer: h^T is the teacher's "
                         "final hidden state, without expert fusion")  # fmt: skip

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.fused:
            h, logits = forward_hidden(self.model, ids) if self.runner is None else self.runner(ids)
            return {"hidden": h, "logits": logits, "h_t": h}
        cap = _Capture()
        self.last_moe.capture = cap
        seen: dict[str, torch.Tensor] = {}
        layer = self.model.model.layers[-1]
        hook = layer.register_forward_hook(lambda _m, _i, out: seen.update(out=out[0] if isinstance(out, tuple) else out))
        try:
            h, logits = forward_hidden(self.model, ids)
        finally:
            hook.remove()
            self.last_moe.capture = None
        pre = seen["out"].reshape(-1, seen["out"].shape[-1]).float()
        routed = (cap.weights.float().unsqueeze(-1) * cap.outputs).sum(1)
        fused = pre - routed + m.fuse_experts(cap.outputs, cap.weights, self.fusion)
        h_t = self.model.model.norm(fused.reshape(ids.shape[0], ids.shape[1], -1))
        return {"hidden": h, "logits": logits, "h_t": _flat(h_t)}


class Objective(nn.Module):
    """One method's loss; holds the residual method's projectors (seeded, float32)."""

    def __init__(self, cfg, d_s: int, d_t: int, teacher_head: nn.Module, seed: int) -> None:
        super().__init__()
        self.cfg = cfg
        object.__setattr__(self, "teacher_head", teacher_head)  # the teacher's, frozen: not a submodule
        if cfg.method == "residual":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.p_ta = nn.Linear(d_t, cfg.d_a)
                self.p_at = nn.Linear(cfg.d_a, d_t)
                self.p_as = nn.Linear(cfg.d_a, d_s)

    def projector_loss(self, t: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        rec = self.p_at(self.p_ta(t["h_t"].float()))
        return m.projector_loss(t["h_t"].float(), rec, self.teacher_head, targets)

    def start_stage2(self) -> None:
        """``projector_init: teacher``: ``P^{A→S}`` starts as (a copy of) ``P^{A→T}``."""
        if self.cfg.method == "residual" and self.cfg.projector_init == "teacher":
            if self.p_as.weight.shape != self.p_at.weight.shape:
                raise ValueError("projector_init: teacher needs equal student and teacher hidden sizes")
            with torch.no_grad():
                self.p_as.weight.copy_(self.p_at.weight)
                self.p_as.bias.copy_(self.p_at.bias)

    def stage2_parameters(self) -> list[nn.Parameter]:
        """The objective's own trainable parameters in stage 2 (``P^{T→A}`` only without pre-training)."""
        if self.cfg.method != "residual":
            return []
        own = list(self.p_as.parameters())
        return own if self.cfg.pretrain_projector else [*own, *self.p_ta.parameters()]

    def forward(self, h_s: torch.Tensor, logits: torch.Tensor, t: dict, targets: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.method == "sft":
            return m.sft_loss(logits, targets)
        if cfg.method == "kd":
            return m.kd_loss(logits, t["logits"], cfg.temperature)
        if cfg.method == "hidden_mse":
            return m.hidden_mse(h_s, t["hidden"])
        proj = self.p_as(self.p_ta(t["h_t"].float()))
        beta = m.residual_beta(h_s, proj, cfg.d_a, cfg.beta_dims) if cfg.beta else 1.0
        mask = m.teacher_wrong(t["logits"], targets) if cfg.mask else None
        head = self._student_head
        res = m.residual_loss(h_s, proj, head, targets, mask, beta)
        return cfg.lambda_res * res + (1 - cfg.lambda_res) * m.sft_loss(logits, targets)

    def bind_student_head(self, head: nn.Module) -> None:
        object.__setattr__(self, "_student_head", head)  # not a submodule: it belongs to the student
