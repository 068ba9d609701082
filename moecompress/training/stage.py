"""The ``distill`` stage end to end: data, student and teacher, training, writing, the report; and the
dry run's memory estimate.

Memory (one device, float32): the student's and the teacher's weights (4 bytes a parameter each),
gradients and the two AdamW moments of the trainable parameters (bounded by the whole student:
3 × 4 bytes a parameter), and the activations autograd keeps for one batch, about
``batch × seq_len × 4 bytes × (layers × (16·hidden + 4·top_k·expert_width + heads·seq_len) + 6·vocab)``
(attention, the routed experts' gate/up/activation, the attention probabilities, the student's and the
teacher's logits with their softmax and gradient). A stage estimated above
``calibration.memory_limit`` (or what the machine has) is refused in the dry run with the figure.

Under ``torchrun`` (FSDP2, ``N`` ranks) one rank's peak is the largest of: training, ``(weights +
optimiser + activations) / N`` plus about three decoder layers' float32 weights in flight (the
all-gather's buffers and the unsharded parameters; the student and the teacher are sharded a layer at a
time as they are read); writing (rank 0), the gathered student plus one layer. Measured on a
6-layer student: 5.3 GiB per rank against 9.4 GiB for one process (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from pathlib import Path

import torch

from moecompress.calibration.sources import load_token_ids
from moecompress.engine.distributed import SINGLE
from moecompress.errors import CheckpointError, PassError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.runtime.lora_mixer import CONFIG_KEY, RoutedLoRALinear
from moecompress.training.attention_lora import stored_adapters
from moecompress.training.fsdp import collectives, full_state, plain_student, sharded_student, sharded_teacher
from moecompress.training.loop import train
from moecompress.training.losses import Objective, Teacher
from moecompress.training.student import build_model, group_of, non_moe_parameters
from moecompress.training.write import write_trained


def _cfg(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def memory_estimate(job, student_bytes: int, teacher_bytes: int, world: int = 1) -> int:
    """Estimated peak bytes of the stage (see the module docstring); under ``world`` > 1 ranks, one rank's."""
    cfg, c = job.config, _cfg(job.teacher_dir)
    text = c.get("text_config") or c
    hidden = int(text.get("hidden_size") or 0)
    layers = int(text.get("num_hidden_layers") or 0)
    vocab = int(text.get("vocab_size") or 0)
    heads = int(text.get("num_attention_heads") or 1)
    k = int(text.get("num_experts_per_tok") or 1)
    width = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 0)
    per_byte = 4 / 2  # stored weights are mostly 16-bit; float32 in training
    weights = int((student_bytes + teacher_bytes) * per_byte)
    optimiser = 3 * int(student_bytes * per_byte)
    tokens = cfg.batch * cfg.seq_len
    act = 4 * tokens * (layers * (16 * hidden + 4 * k * width + heads * cfg.seq_len) + 6 * vocab)
    if world <= 1:
        return weights + optimiser + act
    student, teacher = int(student_bytes * per_byte), int(teacher_bytes * per_byte)
    layer = max(student, teacher) // max(layers, 1)
    train = (weights + optimiser + act) // world + 3 * layer  # FSDP2: ~3 layers in flight (gather buffers)
    write = student + layer  # rank 0: the gathered student, and the layer of the plain student being read
    return max(train, write)


def check_teacher(student_dir: Path, teacher_dir: Path, label: str) -> None:
    """The teacher must share the student's vocabulary (and tokenizer, when both carry one)."""
    s, t = _cfg(student_dir), _cfg(teacher_dir)
    sv, tv = (s.get("text_config") or s).get("vocab_size"), (t.get("text_config") or t).get("vocab_size")
    if sv != tv:
        raise PassError(f"{label}: field 'teacher': vocabulary {tv} differs from the student's {sv}; "
                        "name a teacher with the same tokenizer")  # fmt: skip
    a, b = Path(student_dir) / "tokenizer.json", Path(teacher_dir) / "tokenizer.json"
    if a.is_file() and b.is_file() and _digest(a) != _digest(b):
        raise PassError(f"{label}: field 'teacher': {b} differs from the student's tokenizer; name a teacher "
                        "with the same tokenizer")  # fmt: skip


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _moe_trainable(i: int, moe, cfg) -> list[torch.nn.Parameter]:
    """The trainable tensors of MoE layer ``i`` (``trainable: lora`` attaches its LoRA; otherwise the
    protected experts' elements are recorded for restoring)."""
    if cfg.trainable == "lora":
        return moe.attach_lora(cfg.lora_rank, cfg.lora_alpha, cfg.seed + i)
    moe.freeze_protected()
    return [p for name, p in moe.named_stored().items() if cfg.trainable == "all" or group_of(name) == cfg.trainable]


def _parameters(model, moes, cfg, ckpt) -> tuple[list[torch.nn.Parameter], dict]:
    """The trainable parameters; and the attention LoRA wrappers by name (``target`` attention*, and
    the routed adapters ``ckpt`` already stores: wrapped in, trained unless ``train_adapters: false``)."""
    from moecompress.training.attention_lora import adapter_parameters, attach, stored_adapters

    held, _ = stored_adapters(model, ckpt)
    if cfg.trainable == "lora" and cfg.target != "experts":
        if held and cfg.target == "attention":
            raise PassError("field 'target': the input already has routed attention adapters (an "
                            "earlier target: attention_routed); use target: attention_routed to train them on")  # fmt: skip
        if held:  # target: attention_routed again: the stored adapters train on (no second set)
            return adapter_parameters(held), held
        keys = set(ckpt.reader.keys)
        stored = {k: ckpt.reader.torch_dtype(k) for k in keys if k.endswith(".weight") and "attn" in k}
        mods, params = attach(model, cfg, stored)
        return params, mods
    trainable, out = cfg.trainable, []
    if held and cfg.train_adapters:
        out += adapter_parameters(held)
    for i, moe in moes.items():
        out += _moe_trainable(i, moe, cfg)
    if trainable == "all":
        skip = {id(p) for p in [*out, *adapter_parameters(held)]}  # adapters: only with train_adapters
        out += [p for p in non_moe_parameters(model).values() if id(p) not in skip]
    return out, held


def run_distill(job) -> dict:
    """Train, write ``job.output_dir``, return the report's summary, plots and warnings."""
    cfg, cal = job.config, job.calibration
    try:
        student_ck, teacher_ck = open_checkpoint(job.input_dir), open_checkpoint(job.teacher_dir)
    except CheckpointError as err:
        raise PassError(f"{job.label}: {err}") from None
    check_teacher(job.input_dir, job.teacher_dir, job.label)
    source = cfg.data or cal.source
    ids = load_token_ids(source, model_dir=teacher_ck.path, samples=cfg.samples, seq_len=cfg.seq_len, seed=cfg.seed)
    train_ids, hold_ids = ids[: -cfg.holdout], ids[-cfg.holdout :]
    device = job.device
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    ranks = job.ranks or SINGLE
    fusion = cfg.fusion if cfg.method == "residual" else None
    if ranks.world_size > 1 and fusion is None and not isinstance(teacher_ck.raw_config.get(CONFIG_KEY), dict):
        teacher_model, teacher_moes, root = sharded_teacher(teacher_ck, device)  # built first: 1/N of it held
    else:
        teacher_model, teacher_moes = build_model(teacher_ck, device)
        stored_adapters(teacher_model, teacher_ck)  # a teacher with routed adapters is the model they make
        root = None
    teacher = Teacher(teacher_model, teacher_moes, fusion, runner=root)
    teacher_sharded = root is not None
    if ranks.world_size > 1:  # FSDP2 (training/fsdp.py): the student sharded, each rank a share of a batch
        if isinstance(student_ck.raw_config.get(CONFIG_KEY), dict):
            raise PassError(f"{job.label}: the input stores routed attention adapters, which are not sharded "
                            "under torchrun; run one process")  # fmt: skip
        if cfg.batch < ranks.world_size:
            raise PassError(f"{job.label}: batch {cfg.batch} is smaller than the {ranks.world_size} ranks; "
                            "raise batch or run fewer ranks")  # fmt: skip
        student, moes, model, params = sharded_student(student_ck, device, lambda i, m: _moe_trainable(i, m, cfg),
                                                       cfg.trainable == "all")  # fmt: skip
        mods: dict = {}
    else:
        student, moes = build_model(student_ck, device)
        params, mods = _parameters(student, moes, cfg, student_ck)
        model = student
    d_s, d_t = student.config.hidden_size, teacher_model.config.hidden_size
    if cfg.method == "hidden_mse" and d_s != d_t:
        raise PassError(f"{job.label}: hidden_mse needs equal hidden sizes (student {d_s}, teacher {d_t}); use kd")
    if cfg.method == "residual" and cfg.projector_init == "teacher" and d_s != d_t:
        raise PassError(f"{job.label}: projector_init: teacher needs equal hidden sizes (student {d_s}, teacher {d_t})")

    def make_objective(c=cfg) -> Objective:
        obj = Objective(c, d_s, d_t, teacher_model.get_output_embeddings(), c.seed).to(device)
        obj.bind_student_head(student.get_output_embeddings())
        return obj

    own = {id(p) for p in params}
    n_trainable = sum(p.numel() for p in params)  # (sharded: the global shapes)
    routed = [m for m in mods.values() if isinstance(m, RoutedLoRALinear) and id(m.router) in own]
    searched = []
    if cfg.lr == "auto":
        from moecompress.training.lr_search import choose_lr

        with collectives(ranks, job.label) if ranks.world_size > 1 else nullcontext():
            lr, searched = choose_lr(model, moes, params, make_objective, teacher, train_ids, hold_ids, cfg,
                                     device=device, routed=routed, ranks=ranks)  # fmt: skip
        cfg = cfg.model_copy(update={"lr": lr})
    state = None if job.state_dir is None else Path(job.state_dir)
    with collectives(ranks, job.label) if ranks.world_size > 1 else nullcontext():
        res = train(model, moes, params, make_objective(cfg), teacher, train_ids, hold_ids, cfg, device=job.device,
                    progress=job.progress, state_dir=state, routed=routed, ranks=ranks)  # fmt: skip
        note = teacher.note
        teacher = teacher_model = teacher_moes = root = None  # not held while the student is gathered and written
        gathered = full_state(model) if ranks.world_size > 1 else None
    if gathered is not None:  # rank 0 gathers the whole student and writes as one process; the others nothing
        del model, student, moes, params
        student, moes = plain_student(student_ck, cfg, gathered) if ranks.is_writer else (None, {})
    trained = non_moe_parameters(student) if cfg.trainable == "all" and student is not None else {}
    adapters = None
    if mods:
        from moecompress.training.attention_lora import adapter_payload, checkpoint_names, merged_weights

        trained = {**checkpoint_names(trained, mods), **merged_weights(mods)}
        routed = {n: m for n, m in mods.items() if isinstance(m, RoutedLoRALinear)}
        if routed:
            adapters = adapter_payload(routed, cfg, student_ck.raw_config.get(CONFIG_KEY))
    if ranks.is_writer:
        write_trained(student_ck, moes, trained, Path(job.output_dir), max_shard_size=job.max_shard_size,
                      adapters=adapters)  # fmt: skip
    summary = {
        "method": cfg.method,
        "trainable": cfg.trainable,
        "target": cfg.target if cfg.trainable == "lora" else None,
        "lr": cfg.lr,
        "lr_search": searched,
        "trainable_params": n_trainable,
        "steps": res.steps,
        "stopped_early": res.stopped_early,
        "train_tokens": res.tokens,
        "heldout_loss_before": res.heldout_before,
        "heldout_loss_after": res.heldout_after,
        "heldout_ppl_before": float(torch.tensor(res.heldout_before).exp()),
        "heldout_ppl_after": float(torch.tensor(res.heldout_after).exp()),
        "loss_first": res.curve[0] if res.curve else None,
        "loss_last": res.curve[-1] if res.curve else None,
        "loss_curve": res.curve,
        "heldout_curve": res.heldout_curve,
        "projector_curve": res.projector_curve,
        "lora_balance": cfg.lora_balance if routed else None,
        "balance_first": res.balance_curve[0] if res.balance_curve else None,
        "balance_last": res.balance_curve[-1] if res.balance_curve else None,
        "tokens_per_second": res.tokens / res.seconds if res.seconds > 0 else None,
        "train_seconds": round(res.seconds, 3),
        "train_cpu_seconds": round(res.cpu_seconds, 3),
        "peak_memory_mb": round(res.peak_memory_mb, 1),
        "data": source,
        "teacher": "the recipe's model" if cfg.teacher is None else cfg.teacher,
        "teacher_sharded": teacher_sharded,
    }
    plots = []
    if res.curve:
        plots.append({"file": "loss.png", "kind": "line", "data": res.curve, "title": f"{cfg.method} loss per step",
                      "xlabel": "step", "ylabel": "loss"})  # fmt: skip
    warnings = [note] if note else []
    if res.heldout_after > res.heldout_before:
        warnings.append(f"the held-out loss rose ({res.heldout_before:.4f} -> {res.heldout_after:.4f}); "
                        "lower lr or steps")  # fmt: skip
    return {"summary": summary, "plots": plots, "warnings": warnings, "seconds": res.seconds,
            "peak_rss_mb": res.peak_memory_mb}  # fmt: skip
