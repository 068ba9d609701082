"""The ``distill`` stage: oracles on tiny models (zero learning rate, zero KD loss, one step by hand,
the written checkpoint's logits) and the segmented engine (chains, resume, dry-run errors)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.spec import PassSpec, StageSpec
from moecompress.errors import PassError, RecipeError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.passes.distill import DistillConfig
from moecompress.training.loop import _batches, train
from moecompress.training.losses import Objective, Teacher, forward_hidden
from moecompress.training.student import build_model, flatten
from moecompress.training.write import write_trained

CAL = {"source": "random", "samples": 8, "seq_len": 8}
SMALL = {"steps": 2, "lr": 1e-3, "samples": 6, "holdout": 2, "seq_len": 8, "batch": 2}


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _recipe(model, out, steps, **kw):
    return {"model": str(model), "output": str(out), "calibration": CAL, "steps": steps, **kw}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("distill") / "m"
    save_tiny("qwen3_moe", path)
    return path


@pytest.fixture(scope="module")
def pruned(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned") / "p"
    mc.apply(_recipe(tiny, out, [{"heapr": {"ratio": 0.5}}]), progress=False)
    return out


def test_zero_lr_leaves_every_stored_tensor_bit_identical(tiny, tmp_path):
    out = tmp_path / "o"
    steps = [{"heapr": {"ratio": 0.5}}, {"distill": {**SMALL, "lr": 0.0, "trainable": "all"}}]
    mc.apply(_recipe(tiny, out, steps, emit="every_step"), progress=False)
    before, after = _tensors(out / "steps" / "01-heapr" / "checkpoint"), _tensors(out)
    assert set(before) == set(after) and any("rows" in k for k in after)  # the ragged layout is kept
    for k in before:
        assert torch.equal(before[k], after[k]), k
    report = json.loads((out / "steps" / "02-distill" / "report.json").read_text())
    assert report["summary"]["steps"] == 2 and len(report["summary"]["loss_curve"]) == 2
    assert report["summary"]["heldout_loss_before"] == report["summary"]["heldout_loss_after"]


def test_student_equal_to_its_teacher_has_zero_kd_loss(tiny):
    ckpt = open_checkpoint(tiny)
    student, _ = build_model(ckpt)
    teacher_model, moes = build_model(ckpt)
    teacher = Teacher(teacher_model, moes, None)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    h, logits = forward_hidden(student, ids)
    obj = Objective(DistillConfig(method="kd"), 64, 64, teacher_model.get_output_embeddings(), 0)
    assert float(obj(h, logits, teacher(ids), ids[:, 1:].reshape(-1))) == 0.0
    other = Objective(DistillConfig(method="hidden_mse"), 64, 64, teacher_model.get_output_embeddings(), 0)
    assert float(other(h, logits, teacher(ids), ids[:, 1:].reshape(-1))) == 0.0


def test_one_step_matches_a_hand_written_backward_and_adamw_step(pruned, tiny):
    cfg = DistillConfig(method="kd", steps=1, lr=1e-3, batch=3, clip=0.0, seed=5, temperature=2.0)
    ids = torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    train_ids, hold = ids[:6], ids[6:]
    teacher_model, tmoes = build_model(open_checkpoint(tiny))
    student, moes = build_model(open_checkpoint(pruned))
    hand = copy.deepcopy(student)
    params = [p for m in moes.values() for p in m.named_stored().values()]
    obj = Objective(cfg, 64, 64, teacher_model.get_output_embeddings(), 0)
    train(student, moes, params, obj, Teacher(teacher_model, tmoes, None), train_ids, hold, cfg, progress=False)

    hp = [p for n, p in hand.named_parameters() if ".params." in n]
    for p in hp:
        p.requires_grad_(True)
    part = train_ids[_batches(6, 3, 1, 5)[0]]
    with torch.no_grad():
        t_logits = teacher_model(part).logits[:, :-1] / 2.0
    s_logits = hand(part).logits[:, :-1] / 2.0
    p_t = t_logits.log_softmax(-1)
    loss = (p_t.exp() * (p_t - s_logits.log_softmax(-1))).sum(-1).mean() * 4.0
    opt = torch.optim.AdamW(hp, lr=1e-3, weight_decay=0.0)
    loss.backward()
    opt.step()
    trained = [p for n, p in student.named_parameters() if ".params." in n]
    moved = 0
    for a, b in zip(trained, hp):
        # AdamW divides each element's gradient by its own magnitude (+ eps 1e-8): where the gradient is a
        # near-cancelling sum near eps, float32 rounding of the two backward formulas (kd_loss's exact
        # softmax difference, autograd's here) changes the step by up to ~0.01·lr; elsewhere 1e-3·lr
        small = b.grad.abs() < 1e-7
        atol = torch.where(small, 1e-2 * 1e-3, 1e-3 * 1e-3)
        assert ((a - b).abs() <= atol).all(), "the stage's step differs from the hand-written one"
        moved += int((a != b.detach()).sum() == 0)
    assert any(not torch.equal(a, b) for a, b in zip(trained, [p for n, p in copy.deepcopy(hand).named_parameters()
               if ".params." in n])) or moved  # fmt: skip
    before = dict(build_model(open_checkpoint(pruned))[0].named_parameters())
    changed = [n for n, p in student.named_parameters() if ".params." in n and not torch.equal(p, before[n])]
    assert changed, "one step at lr 1e-3 moved nothing"


@pytest.mark.parametrize("trainable", ["compressed", "all", "lora"])
def test_the_written_checkpoint_loads_and_gives_the_students_logits(pruned, tiny, tmp_path, trainable):
    cfg = DistillConfig(method="sft", steps=2, lr=1e-2, batch=2, trainable=trainable)
    ids = torch.randint(3, 128, (6, 16), generator=torch.Generator().manual_seed(2))
    teacher_model, tmoes = build_model(open_checkpoint(tiny))
    ckpt = open_checkpoint(pruned)
    student, moes = build_model(ckpt)
    params = [p for m in moes.values() for p in m.named_stored().values()]
    if trainable == "lora":
        params = [p for i, m in moes.items() for p in m.attach_lora(2, 4.0, i)]
    if trainable == "all":
        params += [p for n, p in student.named_parameters() if ".params." not in n]
    obj = Objective(cfg, 64, 64, teacher_model.get_output_embeddings(), 0)
    train(student, moes, params, obj, Teacher(teacher_model, tmoes, None), ids[:4], ids[4:], cfg, progress=False)
    trained = {n: p for n, p in student.named_parameters() if ".params." not in n} if trainable == "all" else {}
    write_trained(ckpt, moes, trained, tmp_path / "w")
    loaded = mc.load(tmp_path / "w")
    with torch.no_grad():
        want, got = student(ids).logits, loaded(ids).logits
    tol = torch.finfo(torch.float32).eps * 64 * 3 * float(want.abs().max())  # hidden × layers roundings
    assert (want - got).abs().max() <= tol
    if trainable == "all":
        old, new = _tensors(pruned), _tensors(tmp_path / "w")
        assert not torch.equal(old["model.embed_tokens.weight"], new["model.embed_tokens.weight"])


def test_protect_heapr_distill_codequant_runs_and_loads(tiny, tmp_path):
    out = tmp_path / "o"
    steps = [
        {"protect_super_experts": {"auto": False, "manual": [{"layer": i, "experts": [0]} for i in range(3)]}},
        {"heapr": {"ratio": 0.5, "layout": "uniform"}},
        {"distill": {**SMALL, "method": "residual", "projector_steps": 2, "d_a": 8}},
        {"codequant": {"bits": 2, "rotation": "hadamard", "kmeans_iters": 3, "finetune_steps": 0, "group": 16}},
    ]
    result = mc.apply(_recipe(tiny, out, steps, emit="every_step"), progress=False)
    assert [s["name"] for s in result.report["steps"]] == ["protect_super_experts", "heapr", "distill", "codequant"]
    model = mc.load(out)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 20]])).logits).all()
    heapr_out, distilled = open_checkpoint(out / "steps" / "02-heapr" / "checkpoint"), open_checkpoint(
        out / "steps" / "03-distill" / "checkpoint")  # fmt: skip
    for i in range(3):
        a, b = heapr_out.read_layer(i), distilled.read_layer(i)
        assert b.protected == frozenset({0})
        for p in ("gate", "up", "down"):
            assert torch.equal(getattr(a.experts, p).expert(0), getattr(b.experts, p).expert(0))
            assert not torch.equal(getattr(a.experts, p).expert(1), getattr(b.experts, p).expert(1))
    assert json.loads((out / "report.json").read_text())["recipe_hash"]
    again = mc.apply(_recipe(tiny, out, steps, emit="every_step"), resume=True, progress=False)
    assert again.resumed_finished


def test_rtn_after_distill(pruned, tmp_path):
    out = tmp_path / "o"
    mc.apply(_recipe(pruned, out, [{"distill": SMALL}, {"rtn": {"bits": 4}}]), progress=False)
    layer = open_checkpoint(out).read_layer(0)
    assert layer.experts.gate.kind == "rtn"


def test_methods_are_deterministic_given_the_seed(pruned, tiny, tmp_path):
    extra = {"method": "residual", "beta": False, "mask": False, "pretrain_projector": False, "fusion": "mean", "d_a": 8}
    steps = [{"distill": {**SMALL, **extra, "teacher": str(tiny)}}]
    a, b = tmp_path / "a", tmp_path / "b"
    mc.apply(_recipe(pruned, a, steps), progress=False)
    mc.apply(_recipe(pruned, b, steps), progress=False)
    ta, tb = _tensors(a), _tensors(b)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert any(not torch.equal(ta[k], v) for k, v in _tensors(pruned).items())


def test_dry_run_errors_are_one_line(tiny, tmp_path):
    bad = _recipe(tiny, tmp_path / "o", [{"distill": {**SMALL, "teacher": str(tmp_path / "nowhere")}}])
    with pytest.raises(RecipeError, match=r"step 1 \(distill\): field 'teacher'"):
        mc.apply(bad, dry_run=True)
    plan = mc.apply(_recipe(tiny, tmp_path / "o", [{"heapr": {"ratio": 0.5}}, {"distill": SMALL}]),
                    dry_run=True).report["dry_run"]  # fmt: skip
    need = plan["stage_memory_bytes"]["step 2 (distill)"]
    assert need > 0
    cal = {**CAL, "memory_limit": need - 1}
    if plan["calibration_memory_bytes"] < need - 1:
        with pytest.raises(RecipeError, match=r"step 2 \(distill\): training needs about"):
            mc.apply(_recipe(tiny, tmp_path / "o", [{"heapr": {"ratio": 0.5}}, {"distill": SMALL}], calibration=cal),
                     dry_run=True)  # fmt: skip
    assert not (tmp_path / "o").exists()
    with pytest.raises(RecipeError, match="holdout=10 must be smaller"):
        mc.apply(_recipe(tiny, tmp_path / "o", [{"distill": {**SMALL, "holdout": 10}}]), dry_run=True)


def test_resume_does_not_redo_a_finished_segment(tiny, tmp_path):
    calls: list[int] = []
    fails = [True]

    class C(mc.PassConfig):
        pass

    def count(layer, stats, cfg):
        calls.append(layer.index)
        return layer, {}

    def boom(job):
        if fails[0]:
            fails[0] = False
            raise PassError(f"{job.label}: planned failure")
        return __import__("moecompress.training.stage", fromlist=["_"]).run_distill(job)

    def memory(job, s, t, world):
        return 0

    from moecompress.passes.distill import DistillConfig as Cfg

    specs = [PassSpec("count", C, count), PassSpec("boom", Cfg, count, stage=StageSpec(run=boom, memory=memory))]
    rec = _recipe(tiny, tmp_path / "o", [{"count": {}}, {"boom": SMALL}])
    with pytest.raises(PassError, match="finished segments are kept"):
        mc.apply(rec, passes=specs, progress=False)
    assert len(calls) == 3 and not (tmp_path / "o").exists()
    mc.apply(rec, passes=specs, resume=True, progress=False)
    assert len(calls) == 3, "the finished per-layer segment was run again"
    assert (tmp_path / "o" / "config.json").is_file()
    assert not (tmp_path / ".o.segments").exists()


def test_kd_temperature_scales_as_documented():
    s, t = torch.randn(5, 7), torch.randn(5, 7)
    from moecompress.methods.distill import kd_loss

    want = F.kl_div(F.log_softmax(s / 3, -1), F.log_softmax(t / 3, -1), log_target=True, reduction="sum") / 5 * 9
    assert torch.allclose(kd_loss(s, t, 3.0), want, rtol=1e-6)


def _token_round_loop(p, k, tile, mode):  # METHODS.md §9's reference code, verbatim in spirit
    t, e = p.shape
    sel = torch.zeros_like(p, dtype=torch.bool).scatter_(1, p.topk(k, -1).indices, True)
    f = sel.sum(0).float()
    r = {"nr": torch.round, "up": torch.ceil, "down": torch.floor}[mode](f / tile) * tile
    order = torch.where(sel, p, p - 1.0).argsort(dim=0, descending=True, stable=True)
    keep = torch.zeros_like(sel)
    for j in range(e):
        keep[order[: int(min(r[j], t)), j], j] = True
    return keep


@pytest.mark.parametrize("mode", ["nr", "up", "down"])
def test_token_rounding_matches_the_reference_loop(mode):
    from moecompress.methods.token_rounding import token_round

    p = torch.randn(300, 8, generator=torch.Generator().manual_seed(3)).softmax(-1)
    keep = token_round(p, 2, 16, mode)
    assert torch.equal(keep, _token_round_loop(p, 2, 16, mode))
    counts = keep.sum(0)
    assert bool(((counts % 16 == 0) | (counts == 300)).all())
    exact = torch.zeros_like(keep).scatter_(1, p.topk(2, -1).indices, True)
    assert torch.equal(token_round(p, 2, 1, mode), exact)  # tile 1: exact token choice


def test_token_rounding_trains_and_the_heldout_uses_exact_routing(pruned, tmp_path):
    out = tmp_path / "o"
    step = {**SMALL, "lr": 0.0, "token_rounding": {"tile": 4, "mode": "up"}}
    mc.apply(_recipe(pruned, out, [{"distill": step}]), progress=False)
    s = json.loads((out / "steps" / "01-distill" / "report.json").read_text())["summary"]
    assert s["heldout_loss_before"] == s["heldout_loss_after"] and len(s["loss_curve"]) == 2
    plain = tmp_path / "p"
    mc.apply(_recipe(pruned, plain, [{"distill": {**SMALL, "lr": 0.0}}]), progress=False)
    p = json.loads((plain / "steps" / "01-distill" / "report.json").read_text())["summary"]
    assert p["loss_curve"] != s["loss_curve"], "rounding changed nothing in the training forward"


def test_lora_heal_merges_into_ragged_rows_and_spares_protected_experts(tiny, tmp_path):
    out = tmp_path / "o"
    steps = [{"protect_super_experts": {"auto": False, "manual": [{"layer": 0, "experts": [0]}]}},
             {"heapr": {"ratio": 0.5}}, {"lora_heal": {**SMALL, "lr": 1e-2, "lora_rank": 2}}]  # fmt: skip
    mc.apply(_recipe(tiny, out, steps, emit="every_step"), progress=False)
    a, b = open_checkpoint(out / "steps" / "02-heapr" / "checkpoint"), open_checkpoint(out)
    la, lb = a.read_layer(0), b.read_layer(0)
    assert lb.experts.gate.kind == "ragged" and torch.equal(la.experts.widths, lb.experts.widths)
    assert torch.equal(la.experts.down.expert(0), lb.experts.down.expert(0))
    assert not torch.equal(la.experts.down.expert(1), lb.experts.down.expert(1))
    with pytest.raises(PassError, match=r"step 2 \(lora_heal\), layer 0: trainable: lora merges into dense or ragged"):
        mc.apply(_recipe(tiny, tmp_path / "x", [{"rtn": {"bits": 4}}, {"lora_heal": SMALL}]), dry_run=True)


def test_a_killed_training_resumes_from_its_last_saved_step_bit_identically(pruned, tiny, tmp_path):
    cfg = DistillConfig(method="residual", steps=4, lr=1e-2, batch=2, save_every=2, d_a=8, projector_steps=2)
    ids = torch.randint(3, 128, (6, 8), generator=torch.Generator().manual_seed(4))

    def run(state_dir, on_step=None):
        teacher_model, tmoes = build_model(open_checkpoint(tiny))
        student, moes = build_model(open_checkpoint(pruned))
        params = [p for m in moes.values() for p in m.named_stored().values()]
        obj = Objective(cfg, 64, 64, teacher_model.get_output_embeddings(), 0)
        obj.bind_student_head(student.get_output_embeddings())
        res = train(student, moes, params, obj, Teacher(teacher_model, tmoes, "attention"), ids[:4], ids[4:], cfg,
                    progress=False, state_dir=state_dir, on_step=on_step)  # fmt: skip
        return res, [p.detach().clone() for p in params]

    whole, want = run(None)

    def die(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "state", die)
    assert (tmp_path / "state" / "state.safetensors").is_file()
    resumed, got = run(tmp_path / "state")
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert resumed.curve == whole.curve and resumed.heldout_after == whole.heldout_after


def test_token_rounding_on_a_grouped_router_fails_in_the_dry_run(tmp_path):
    save_tiny("deepseek_v3", tmp_path / "m")
    step = {"distill": {**SMALL, "token_rounding": {"tile": 8}}}
    with pytest.raises(PassError, match=r"step 1 \(distill\), layer 1: token_rounding needs a softmax top-k"):
        mc.apply(_recipe(tmp_path / "m", tmp_path / "o", [step]), dry_run=True)


def test_a_layout_moe_keeps_the_layers_structure_not_a_second_copy_of_its_tensors(tiny):
    """The trained tensors live in ``params`` alone: the template holds them on ``meta``."""
    ckpt = open_checkpoint(tiny)
    _, moes = build_model(ckpt)
    for i, moe in moes.items():
        flat = flatten(moe.template)
        assert moe.stored_dtype and all(flat[n].is_meta for n in moe.stored_dtype)
        want = flatten(ckpt.read_layer(i))
        got = flatten(moe.layer())
        assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)


def test_a_teacher_reads_its_stored_values_without_the_dtype_round_trip(tmp_path):
    """bf16 stored values are float32 exactly: the teacher skips the cast (no whole-weight copy) and gives
    the same bits as the round trip; a student (trained values off the bf16 grid) keeps it."""
    save_tiny("qwen3_moe", tmp_path / "bf16", dtype=torch.bfloat16)
    model, moes = build_model(open_checkpoint(tmp_path / "bf16"))
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    h, logits = forward_hidden(model, ids)  # as a student: through the stored dtype
    moe = next(iter(moes.values()))
    name = next(n for n, dt in moe.stored_dtype.items() if dt == torch.bfloat16)
    assert moe.tensor(name).data_ptr() != moe.named_stored()[name].data_ptr()
    t = Teacher(model, moes, None)(ids)
    assert all(m.exact for m in moes.values())
    assert moe.tensor(name).data_ptr() == moe.named_stored()[name].data_ptr()
    assert torch.equal(t["logits"], logits) and torch.equal(t["hidden"], h)
