"""``lr: auto``: the learning rate is chosen from ``lr_grid`` by the stage's own held-back calibration
sequences (every loss the choice reads is computed on them, every probe batch comes from the training
sequences), deterministically, and leaves the student exactly as it was."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_tiny

import moecompress as mc
from moecompress.errors import RecipeError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.passes.distill import DistillConfig
from moecompress.training import loop
from moecompress.training.losses import Objective, Teacher
from moecompress.training.lr_search import choose_lr
from moecompress.training.student import build_model

CAL = {"source": "random", "samples": 8, "seq_len": 8}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lrauto")
    save_tiny("qwen3_moe", root / "m")
    mc.apply({"model": str(root / "m"), "output": str(root / "p"), "calibration": CAL,
              "steps": [{"heapr": {"ratio": 0.5}}]}, progress=False)  # fmt: skip
    return root / "m", root / "p"


def test_the_choice_reads_only_held_back_tokens_and_restores_the_student(models, monkeypatch):
    tiny, pruned = models
    g = torch.Generator().manual_seed(3)
    train_ids, hold_ids = torch.randint(3, 64, (6, 10), generator=g), torch.randint(64, 128, (2, 10), generator=g)
    t_model, t_moes = build_model(open_checkpoint(tiny))
    student, moes = build_model(open_checkpoint(pruned))
    params = [p for m in moes.values() for p in m.named_stored().values()]
    before = [p.detach().clone() for p in params]
    cfg = DistillConfig(method="sft", steps=8, lr="auto", lr_grid=(1e-1, 1e-4, 1e-2), batch=2)
    scored, taught = [], []
    real_held, teacher = loop.heldout_loss, Teacher(t_model, t_moes, None)

    def held(model, ids, batch):
        value = real_held(model, ids, batch)
        scored.append((ids, value))
        return value

    class Spy:
        def __call__(self, ids):
            taught.append(ids)
            return teacher(ids)

    monkeypatch.setattr(loop, "heldout_loss", held)

    def make():
        return Objective(cfg, 64, 64, t_model.get_output_embeddings(), 0)

    lr, rows = choose_lr(student, moes, params, make, Spy(), train_ids, hold_ids, cfg)
    assert [r["lr"] for r in rows] == [1e-4, 1e-2, 1e-1] and all(r["steps"] == 2 for r in rows)
    assert scored and all(torch.equal(ids, hold_ids) for ids, _ in scored)
    train_rows = {tuple(r) for r in train_ids.tolist()}
    assert taught and all(tuple(r) in train_rows for ids in taught for r in ids.tolist())
    after = [v for _, v in scored][1::2]  # each probe scores before and after
    assert [r["heldout_loss"] for r in rows] == after
    assert lr == min(rows, key=lambda r: r["heldout_loss"])["lr"]
    assert len({r["heldout_loss"] for r in rows}) == 3  # the candidates really differ
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_lr_auto_in_a_recipe_is_deterministic_and_reported(models, tmp_path):
    _, pruned = models
    step = {"distill": {"method": "kd", "steps": 4, "lr": "auto", "lr_grid": [1e-4, 1e-2], "samples": 8,
                        "holdout": 2, "seq_len": 8, "batch": 2}}  # fmt: skip
    outs = []
    for name in ("a", "b"):
        mc.apply({"model": str(pruned), "output": str(tmp_path / name), "calibration": CAL, "steps": [step]},
                 progress=False)  # fmt: skip
        s = json.loads((tmp_path / name / "steps" / "01-distill" / "report.json").read_text())["summary"]
        outs.append((s, load_file(tmp_path / name / "model.safetensors")))
    (s1, t1), (s2, t2) = outs
    assert s1["lr"] in (1e-4, 1e-2) and s1["lr"] == s2["lr"]
    assert [r["lr"] for r in s1["lr_search"]] == [1e-4, 1e-2]
    assert s1["lr_search"] == [{**r, "cpu_seconds": s1["lr_search"][i]["cpu_seconds"]} for i, r in enumerate(s2["lr_search"])]
    assert s1["lr"] == min(s1["lr_search"], key=lambda r: r["heldout_loss"])["lr"]
    assert all(torch.equal(t1[k], t2[k]) for k in t1)


def test_a_bad_lr_is_one_line_naming_the_field(models, tmp_path):
    _, pruned = models
    rec = {"model": str(pruned), "output": str(tmp_path / "x"), "calibration": CAL,
           "steps": [{"distill": {"lr": "fast"}}]}  # fmt: skip
    with pytest.raises(RecipeError) as err:
        mc.apply(rec, dry_run=True, progress=False)
    assert "lr" in str(err.value) and "distill" in str(err.value) and "\n" not in str(err.value).strip()
