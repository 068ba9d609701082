"""``--resume`` after ``kill -9`` produces byte-identical output to an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from tiny import save_tiny

import moecompress as mc
from moecompress.errors import ResumeError

# A subprocess running a slow copy of `identity` (so there is time to kill it mid-run), given to apply()
# as a plugin pass: `python -c RUNNER RECIPE [--resume]`.
RUNNER = r"""
import os, sys, time
import moecompress as mc
class C(mc.PassConfig):
    pass
def slow(layer, stats, cfg):
    time.sleep(0.3)
    with open(os.environ["SLOW_LOG"], "a") as f:
        f.write(f"{layer.index}\n")
    return layer, {}
mc.apply(sys.argv[1], passes=[mc.PassSpec("slow_identity", C, slow)], resume="--resume" in sys.argv, progress=False)
"""


def _run(args, log, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SLOW_LOG": str(log)}
    return subprocess.Popen([sys.executable, "-c", RUNNER, *args], env=env, **kw)


def _hashes(path):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.suffix in (".safetensors", ".json") and p.name not in ("report.json",)
    }


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_kill_9_then_resume_is_byte_identical(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model", num_hidden_layers=8)
    recipe = {
        "model": str(tmp_path / "model"),
        "output": str(tmp_path / "out"),
        "calibration": {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 2},
        "max_shard_size": "120KB",  # about one decoder layer: a flush (and a journal entry) per layer
        "steps": [{"slow_identity": {}}],
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    ref = {**recipe, "output": str(tmp_path / "ref")}
    (tmp_path / "ref.yaml").write_text(yaml.safe_dump(ref))
    assert _run([str(tmp_path / "ref.yaml")], tmp_path / "ref.log").wait(timeout=300) == 0

    journal = tmp_path / ".out.partial" / "journal.json"
    proc = _run([str(tmp_path / "r.yaml")], tmp_path / "first.log")
    deadline = time.time() + 240
    while time.time() < deadline:
        if journal.exists() and json.loads(journal.read_text())["done_group"] >= 3:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the run never journaled three layers")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (tmp_path / "out").exists(), "a killed run must not leave an output directory"
    done = json.loads(journal.read_text())["done_group"]
    assert 3 <= done < 9

    log = tmp_path / "resumed.log"
    assert _run([str(tmp_path / "r.yaml"), "--resume"], log).wait(timeout=300) == 0
    resumed = [int(x) for x in log.read_text().split()]
    # group 0 holds the non-layer tensors, so group g is decoder layer g - 1: resume starts at layer `done`
    assert resumed and min(resumed) == done, f"resume redid durable layers: {resumed} (done {done})"
    assert not (tmp_path / ".out.partial").exists()
    got, want = _hashes(tmp_path / "out"), _hashes(tmp_path / "ref")
    assert any(k.endswith(".safetensors") for k in want) and len(want) >= 4
    assert got == want


def _recipe(tmp_path, out="out", steps=None):
    return {
        "model": str(tmp_path / "model"),
        "output": str(tmp_path / out),
        "calibration": {"source": "random", "samples": 4, "seq_len": 8},
        "steps": steps or [{"heapr": {"ratio": 0.25, "scope": "layer"}}],
    }


class _Crash(mc.PassConfig):
    pass


def _crash(layer, stats, cfg):
    raise RuntimeError("killed")  # a crash before anything is durable (no shard flushed, no journal)


CRASH = mc.PassSpec("crash", _Crash, _crash)


def test_resume_with_nothing_durable_starts_over(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model")
    ref = mc.apply(_recipe(tmp_path, "ref"), progress=False).output_dir
    rec = _recipe(tmp_path)
    res = mc.apply(rec, resume=True, progress=False)  # no output, no journal: an ordinary run
    assert _hashes(res.output_dir) == _hashes(ref)
    # a crash before the first flush leaves a staging directory but no journal
    with pytest.raises(RuntimeError, match="killed"):
        mc.apply(_recipe(tmp_path, "out2", [{"crash": {}}]), passes=[CRASH], progress=False)
    staging = tmp_path / ".out2.partial"
    assert staging.is_dir() and not (staging / "journal.json").exists()
    res = mc.apply(_recipe(tmp_path, "out2"), resume=True, progress=False)
    assert _hashes(res.output_dir) == _hashes(ref) and not staging.exists()


def test_resume_of_a_finished_output_does_nothing(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model")
    rec = _recipe(tmp_path)
    out = mc.apply(rec, progress=False).output_dir
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    res = mc.apply(rec, resume=True, progress=False)
    assert res.resumed_finished and res.report["recipe_hash"] == mc.load_recipe(rec).fingerprint()
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    other = _recipe(tmp_path, steps=[{"heapr": {"ratio": 0.5, "scope": "layer"}}])
    with pytest.raises(ResumeError, match="made by a different recipe"):
        mc.apply(other, resume=True, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_resume_refuses_another_recipes_journal(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model")
    staging = tmp_path / ".out.partial"
    staging.mkdir()
    (staging / "journal.json").write_text(json.dumps({"recipe": "another", "done_group": 0}))
    with pytest.raises(ResumeError, match="different recipe"):
        mc.apply(_recipe(tmp_path), resume=True, progress=False)
    (staging / "journal.json").write_text("{not json")
    with pytest.raises(ResumeError, match="damaged"):
        mc.apply(_recipe(tmp_path), resume=True, progress=False)
    assert not (tmp_path / "out").exists()
