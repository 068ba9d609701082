"""The ``distill`` stage under two ``torch.distributed`` ranks (gloo, one thread each): FSDP2 training
(``moecompress/training/fsdp.py``) against one process, and a rank that dies while training.

Not byte-identical: each rank's gradient is reduce-scattered (summed) in another order than one process's
backward adds the batch, and the loss is a weighted sum of per-rank means; the float32 results agree within
a tolerance that grows with the steps (``docs/training.md``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import yaml
from rank_helpers import free_port, rank_env
from safetensors.torch import load_file
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.distributed import Launch
from moecompress.engine.executor import apply
from moecompress.errors import Interrupted, RecipeError

CAL = {"source": "random", "samples": 8, "seq_len": 8, "batch_size": 4}
STEPS = 3
LR = 1e-3
DISTILL = {"method": "kd", "steps": STEPS, "lr": LR, "samples": 10, "holdout": 2, "seq_len": 8, "batch": 4}

# rank 1 dies (as a killed process does) in its 2nd training step
DIE = r"""
import os, sys
from moecompress.training import loop
from moecompress.cli import main
forward, calls = loop._forward, []
def dying(*a, **k):
    calls.append(1)
    if len(calls) == 3:  # 1: the held-out loss before, 2: step 1, 3: step 2
        os._exit(9)
    return forward(*a, **k)
loop._forward = dying
sys.exit(main(sys.argv[1:]))
"""


def _two_ranks(recipe, die: bool = False, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """``moecompress apply`` as ranks 0 and 1 (rank 1 runs ``DIE`` with ``die``)."""
    port, procs = free_port(), []
    for rank in (0, 1):
        code = ["-c", DIE] if die and rank == 1 else ["-m", "moecompress.cli"]
        procs.append(subprocess.Popen([sys.executable, *code, "apply", str(recipe), "--quiet"], env=rank_env(rank, 2, port),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


PROTECT = {
    "protect_super_experts": {"auto": False, "manual": [{"layer": i, "experts": [0]} for i in range(2)]}
}


def _recipes(tmp_path, name: str, distill: dict, stage: str = "distill", protect: bool = False) -> list:
    heapr = {"ratio": 0.5, **({"layout": "uniform"} if protect else {})}  # else ragged rows (uneven shards)
    steps = [*([PROTECT] if protect else []), {"heapr": heapr}, {stage: distill}]
    paths = []
    for tag in ("one", "two"):
        rec = {"model": str(tmp_path / "model"), "output": str(tmp_path / f"{name}-{tag}"), "emit": "every_step",
               "calibration": {**CAL, "cache_dir": str(tmp_path / f"cache-{name}-{tag}")}, "steps": steps}  # fmt: skip
        (tmp_path / f"{name}-{tag}.yaml").write_text(yaml.safe_dump(rec))
        paths.append(tmp_path / f"{name}-{tag}.yaml")
    return paths


@pytest.fixture
def model(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model", num_hidden_layers=2)
    return tmp_path


def _step(out, name: str):
    (path,) = (out / "steps").glob(f"*-{name}")
    return path


def _summary(out, stage: str = "distill") -> dict:
    return json.loads((_step(out, stage) / "report.json").read_text())["summary"]


@pytest.mark.slow  # 2 ranks end to end (~40 s on one core each)
@pytest.mark.parametrize(
    ("stage", "extra"),
    [
        ("distill", {"trainable": "compressed"}),  # with protected experts, restored on each rank's rows
        ("distill", {"trainable": "all"}),
        # per-expert LoRA (merged), lr: auto's probes and early-stopping evaluations on the sharded student
        ("lora_heal", {"lr": "auto", "lr_grid": [LR / 3, LR], "lr_probe_steps": 1, "eval_every": 2}),
    ],
    ids=["compressed", "all", "lora_heal"],
)
def test_two_rank_fsdp_distill_matches_one_process(model, stage, extra):
    """heapr (the layer loop over both ranks, bit-identical) then distill with FSDP2: every written tensor
    equals one process's within the float32 tolerance, the loss curve too; held-out loss before is exact."""
    name = f"d{stage}{extra.get('trainable', '')}"
    protect = extra.get("trainable") == "compressed"
    one, two = _recipes(model, name, {**DISTILL, **extra}, stage, protect=protect)
    mc.apply(str(one), progress=False)
    runs = _two_ranks(two)
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-3000:] for r in runs]
    a, b = model / f"{name}-one", model / f"{name}-two"
    pruned_a, pruned_b = (
        _tensors(_step(a, "heapr") / "checkpoint"),
        _tensors(_step(b, "heapr") / "checkpoint"),
    )
    assert all(torch.equal(pruned_a[k], pruned_b[k]) for k in pruned_a)  # the layer-loop segment: same bits
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    eps = torch.finfo(torch.float32).eps
    # The gradients agree to float32 reduction-order rounding (~eps × sqrt(summands)); AdamW normalises each
    # element's update (|update| <= ~lr), which amplifies that rounding where an element's gradient is a
    # near-cancelling sum: per element the bound is rtol 1e-5·sqrt(steps) plus 1 % of the largest AdamW move
    # (lr × steps); over a tensor, the difference of the two updates is below 1e-3 of the update itself.
    moved, diff, step = 0, 0.0, 0.0
    for k in ta:
        x, y, x0 = ta[k].float(), tb[k].float(), pruned_a[k].float()
        tol = 1e-5 * math.sqrt(STEPS) * x.abs() + 0.01 * LR * STEPS + eps
        assert bool(((x - y).abs() <= tol).all()), (k, float((x - y).abs().max()))
        moved += int(not torch.equal(x, x0))
        diff, step = diff + float(((y - x0) - (x - x0)).pow(2).sum()), step + float((x - x0).pow(2).sum())
    assert moved and step > 0, "distill moved nothing"
    assert math.sqrt(diff) <= 1e-3 * math.sqrt(step), (math.sqrt(diff), math.sqrt(step))
    sa, sb = _summary(a, stage), _summary(b, stage)
    assert sa["heldout_loss_before"] == sb["heldout_loss_before"] and sa["lr"] == sb["lr"]
    assert len(sa["loss_curve"]) == len(sb["loss_curve"]) == STEPS
    for u, v in zip(sa["loss_curve"], sb["loss_curve"]):
        assert abs(u - v) <= 1e-5 * math.sqrt(STEPS) * abs(u) + eps
    assert sa["trainable_params"] == sb["trainable_params"] and sa["train_tokens"] == sb["train_tokens"]
    assert (sa["teacher_sharded"], sb["teacher_sharded"]) == (False, True)  # 1/N of the teacher on each rank


@pytest.mark.slow
def test_a_rank_killed_while_training_fails_cleanly(model):
    """Rank 1 dies in its 2nd training step: rank 0 stops with one ``Interrupted`` line; no output appears,
    only the finished layer-loop segment is kept for ``--resume``."""
    _, two = _recipes(model, "k", DISTILL)
    runs = _two_ranks(two, die=True)
    assert runs[1].returncode == 9
    assert runs[0].returncode == Interrupted.exit_code, runs[0].stderr[-2000:]
    lines = runs[0].stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 of 2:"), lines
    assert not (model / "k-two").exists() and not (model / ".k-two.partial").exists()
    kept = sorted(p.name for p in (model / ".k-two.segments").iterdir())
    assert len(kept) == 1 and kept[0].startswith("01-heapr-"), kept


def test_unsupported_stage_settings_are_refused_under_torchrun(model):
    """Before the process group starts: one line naming the step and the setting."""
    rec = {"model": str(model / "model"), "output": str(model / "r"), "calibration": CAL,
           "steps": [{"distill": {**DISTILL, "method": "residual"}}]}  # fmt: skip
    with pytest.raises(RecipeError, match=r"distill.*method: residual.*does not run under torchrun yet"):
        apply(rec, progress=False, launch=Launch(0, 2, 0))
    assert not (model / "r").exists()


def test_the_dry_run_estimates_a_stage_per_rank_under_torchrun(model):
    """FSDP2 splits the weights, gradients and AdamW state: the dry run's estimate is one rank's, so a
    memory_limit between the two refuses one process and lets 2 ranks through (a dry run starts no group)."""
    from moecompress.engine import segments
    from moecompress.engine.executor import _coerce
    from moecompress.io.checkpoint import open_checkpoint

    steps = [{"heapr": {"ratio": 0.5}}, {"distill": DISTILL}]
    rec = {"model": str(model / "model"), "output": str(model / "r"), "calibration": CAL, "steps": steps}
    plans = [apply(rec, dry_run_only=True, launch=la).report["dry_run"] for la in (Launch(), Launch(0, 2, 0))]
    one, two = (p["stage_memory_bytes"]["step 2 (distill)"] for p in plans)
    assert 0 < two < one
    # the stage's own check (a tiny model's calibration estimate is larger than its stage's, so the whole
    # dry run would stop at the calibration first)
    ckpt = open_checkpoint(model / "model")

    def check(limit: int, launch: Launch) -> dict:
        limited = _coerce({**rec, "calibration": {**CAL, "memory_limit": limit}}, (), ())
        return segments.stage_plan(limited, ckpt, plans[0], launch)

    with pytest.raises(RecipeError, match=r"step 2 \(distill\): training needs about [0-9.]+ GiB of memory \("):
        check((one + two) // 2, Launch())
    assert check((one + two) // 2, Launch(0, 2, 0))["stage_memory_bytes"]["step 2 (distill)"] == two
    with pytest.raises(RecipeError, match=r"training needs about [0-9.]+ GiB of memory per rank of 2 \("):
        check(two - 1, Launch(1, 2, 1))
    assert not (model / "r").exists()
