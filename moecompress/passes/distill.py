"""``distill``: a whole-model training stage that heals the compressed model against a teacher.

The student is the model as the earlier steps left it, in its compressed layout: what trains is what
the layout stores (ragged rows, Tucker factors and cores, low-rank factors, codebook centroids with
the codes fixed, RTN scales, merged experts), never a dense copy. The teacher is the recipe's input
checkpoint (``teacher:`` names another with the same tokenizer). Methods: ``kd`` (KL to the teacher's
logits), ``hidden_mse`` (final hidden states), ``sft`` (next-token cross entropy) and ``residual``
(METHODS.md §6, with the ablation switches ``beta``, ``mask``, ``pretrain_projector``, ``fusion``).
Training data: ``data`` (a calibration source; default the recipe's ``calibration.source``),
``samples`` sequences of ``seq_len`` tokens, the last ``holdout`` held back for the before/after loss
and early stopping. ``lr: auto`` picks the learning rate from ``lr_grid`` by short probe runs scored on
those held-back sequences (never the evaluation text; :mod:`moecompress.training.lr_search`).
No calibration statistics. See ``docs/training.md``.

Example step::

    - distill: {method: kd, trainable: compressed, steps: 200, lr: 1.0e-4, batch: 4, seq_len: 256}
    - distill: {method: sft, steps: 200, lr: auto}   # lr from lr_grid by the held-back loss
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from moecompress.engine.spec import PassConfig, PassSpec, StageSpec
from moecompress.errors import PassError


class TokenRounding(PassConfig):
    tile: int = Field(128, ge=1, description="each expert's token count is rounded to a multiple of this")
    mode: Literal["nr", "up", "down"] = Field("nr", description="nearest, up or down")


class DistillConfig(PassConfig):
    method: Literal["kd", "hidden_mse", "sft", "residual"] = Field("kd", description="training loss")
    trainable: Literal["compressed", "router", "all", "lora"] = Field(
        "compressed", description="compressed: the experts' stored tensors; router: router rows; all: "
        "everything (the non-MoE weights too); lora: per-expert LoRA merged back (dense/ragged experts)"
    )
    token_rounding: TokenRounding | None = Field(
        None, description="SonicMoE token rounding in the student's training forward (default: exact top-k)"
    )
    target: Literal["experts", "attention_routed", "attention"] = Field(
        "experts", description="lora: experts: per-expert LoRA merged into the experts; attention_routed: "
        "LoRA-Mixer routed LoRA experts on the attention projections, stored as adapters; attention: plain "
        "LoRA on the same projections at equal trainable parameters, merged"
    )
    lora_rank: int = Field(8, ge=1, description="lora: rank r of each LoRA (attention: of each routed expert)")
    lora_alpha: float = Field(16.0, gt=0, description="lora: the delta is scaled by alpha / r")
    lora_experts: int = Field(4, ge=1, description="attention_routed: LoRA experts per projection")
    lora_top_k: int = Field(2, ge=1, description="attention_routed: LoRA experts each token uses")
    train_adapters: bool = Field(
        True, description="routed attention adapters the input already stores (an earlier lora_heal target: "
        "attention_routed) train with the selected tensors and are written back; false: kept fixed (in the forward)"
    )
    lora_balance: float = Field(
        0.01, ge=0, description="attention_routed: weight α of LoRA-Mixer's router load-balancing loss "
        "α·E·Σ_e f_e·p̄_e per routed projection (mean over them); 0: off"
    )
    lora_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1,
        description="attention targets: the attention's linear projections that get LoRA",
    )  # fmt: skip
    steps: int = Field(100, ge=0, description="optimiser steps")
    lr: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        1e-4, description="AdamW learning rate, or auto: the lr_grid value with the lowest held-back loss"
    )
    lr_grid: tuple[Annotated[float, Field(gt=0)], ...] = Field(
        (1e-4, 3e-4, 1e-3, 3e-3), min_length=1, description="lr: auto: the candidates"
    )
    lr_probe_steps: int = Field(0, ge=0, description="lr: auto: steps per candidate (0: steps // 4, at least 1)")
    batch: int = Field(4, ge=1, description="sequences per step")
    seq_len: int = Field(256, ge=2, description="tokens per sequence")
    samples: int = Field(64, ge=2, description="sequences drawn from data (training + held back)")
    holdout: int = Field(8, ge=1, description="sequences held back for the held-out loss and early stopping")
    data: str | None = Field(None, description="calibration source of the training text (default: calibration.source)")
    teacher: str | None = Field(None, description="teacher checkpoint (default: the recipe's model)")
    seed: int = Field(0, ge=0)
    clip: float = Field(1.0, ge=0, description="gradient-norm clipping (0: off)")
    eval_every: int = Field(0, ge=0, description="held-out loss every N steps for early stopping (0: off)")
    save_every: int = Field(0, ge=0, description="save the training state every N steps: --resume continues there")
    patience: int = Field(2, ge=1, description="evaluations without improvement before stopping")
    temperature: float = Field(1.0, gt=0, description="kd: softmax temperature")
    d_a: int = Field(64, ge=1, description="residual: projector width d_A")
    lambda_res: float = Field(0.5, ge=0, le=1, description="residual: weight λ of L_res against SFT")
    beta: bool = Field(
        False, description="residual: the paper's β (true) pins the residual's norm at sqrt(d_S/d_A)·‖h^S‖; "
        "false (default, issue 38): β = 1, the residual's scale is P^{A→S}'s (generalises better)"
    )
    mask: bool = Field(True, description="residual: only where the teacher's top-1 is wrong (false: everywhere)")
    pretrain_projector: bool = Field(True, description="residual: stage-1 projector pre-training")
    projector_steps: int = Field(50, ge=0, description="residual: stage-1 steps")
    projector_lr: float = Field(1e-3, gt=0, description="residual: stage-1 learning rate")
    fusion: Literal["attention", "mean"] = Field("attention", description="residual: MoE teacher expert fusion")
    beta_dims: bool = Field(True, description="residual: β includes the sqrt(d_S/d_A) factor (false: norm-matched)")
    projector_init: Literal["random", "teacher"] = Field(
        "random", description="residual: P^{A→S} starts random, or as the pre-trained P^{A→T} (needs d_S = d_T)"
    )

    @model_validator(mode="after")
    def _holdout_fits(self) -> DistillConfig:
        if self.holdout >= self.samples:
            raise ValueError(f"holdout={self.holdout} must be smaller than samples={self.samples}")
        if self.target != "experts" and self.trainable != "lora":
            raise ValueError(f"target={self.target} needs trainable: lora (or the lora_heal step)")
        if self.lora_top_k > self.lora_experts:
            raise ValueError(f"lora_top_k={self.lora_top_k} exceeds lora_experts={self.lora_experts}")
        return self


def distill(layer, stats, cfg: DistillConfig):
    """Heal the compressed model against a teacher (kd, hidden_mse, sft, residual): a whole-model stage."""
    raise PassError("distill is a whole-model stage: the engine runs it between segments, never per layer")


def check(layer, cfg: DistillConfig) -> None:
    """``trainable: lora`` needs layouts a LoRA delta can be merged into, ``token_rounding`` a softmax
    top-k router (the dry run sees the layer the earlier steps emit)."""
    spec = layer.router
    if cfg.token_rounding is not None and (spec.gating.value != "softmax_topk" or spec.n_group is not None):
        raise PassError(f"token_rounding needs a softmax top-k router without expert groups (this layer's "
                        f"gating is {spec.gating.value}); remove token_rounding")  # fmt: skip
    if cfg.trainable == "lora" and cfg.target == "experts":
        from moecompress.training.lora import lora_problem

        why = lora_problem(layer)
        if why is not None:
            raise PassError(why)


def _run(job) -> dict:
    from moecompress.training.stage import run_distill

    return run_distill(job)


def _memory(job, student_bytes: int, teacher_bytes: int, world: int = 1) -> int:
    from moecompress.training.stage import memory_estimate

    return memory_estimate(job, student_bytes, teacher_bytes, world)


STAGE = StageSpec(run=_run, memory=_memory)
SPEC = PassSpec("distill", DistillConfig, distill, check=check, stage=STAGE, alters=frozenset())
