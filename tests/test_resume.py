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

# A subprocess that registers a slow copy of `identity` (so there is time to kill it mid-run) and then
# runs the real CLI entry point with the given arguments.
RUNNER = r"""
import os, sys, time
from moecompress.registry import PassConfig, register_pass
class C(PassConfig):
    pass
@register_pass("slow_identity", C, modifies_experts=False)
def slow(layer, stats, cfg):
    time.sleep(0.3)
    with open(os.environ["SLOW_LOG"], "a") as f:
        f.write(f"{layer.index}\n")
    return layer, {}
from moecompress.cli import main
sys.exit(main(sys.argv[1:]))
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
    assert _run(["apply", str(tmp_path / "ref.yaml"), "-q"], tmp_path / "ref.log").wait(timeout=300) == 0

    journal = tmp_path / ".out.partial" / "journal.json"
    proc = _run(["apply", str(tmp_path / "r.yaml"), "-q"], tmp_path / "first.log")
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
    assert _run(["apply", str(tmp_path / "r.yaml"), "--resume", "-q"], log).wait(timeout=300) == 0
    resumed = [int(x) for x in log.read_text().split()]
    # group 0 holds the non-layer tensors, so group g is decoder layer g - 1: resume starts at layer `done`
    assert resumed and min(resumed) == done, f"resume redid durable layers: {resumed} (done {done})"
    assert not (tmp_path / ".out.partial").exists()
    got, want = _hashes(tmp_path / "out"), _hashes(tmp_path / "ref")
    assert any(k.endswith(".safetensors") for k in want) and len(want) >= 4
    assert got == want


def test_resume_refuses_another_recipe_and_missing_runs(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model")
    rec = {
        "model": str(tmp_path / "model"),
        "output": str(tmp_path / "out"),
        "calibration": {"source": "random", "samples": 4, "seq_len": 8},
        "steps": [{"identity": {}}],
    }
    with pytest.raises(ResumeError, match="nothing to resume"):
        mc.apply(rec, resume=True, progress=False)
    staging = tmp_path / ".out.partial"
    staging.mkdir()
    (staging / "journal.json").write_text(json.dumps({"recipe": "another", "done_group": 0}))
    with pytest.raises(ResumeError, match="different recipe"):
        mc.apply(rec, resume=True, progress=False)
