"""``benchmarks/gpu_device_check.py`` runs every check: ``--device cpu`` is the same harness CPU against
CPU (errors exactly 0), so a GPU session spends no device time on a script that stops at once (issue 33:
its ``heapr`` -> ``svd_experts`` recipe was refused by the dry run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_check_runs_on_cpu(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_device_check.py"), "--device", "cpu", "--small",
         "--models", "qwen3_moe,gpt_oss"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    checks = [x for x in lines if x["check"] == "stats+passes"]
    assert {(x["model_type"], x["recipe"]) for x in checks} == {
        (m, n) for m in ("qwen3_moe", "gpt_oss") for n in ("heapr", "svd_experts")
    }
    assert all(x["accepted"] for x in lines if x["check"] == "dry_run")
    for x in checks:  # the same device twice: bit-identical statistics and outputs
        assert x["output_logits_rel_error"] == 0.0 and set(x["stats_rel_error"].values()) == {0.0}
    assert {"act_sq_mean", "grad_sq_mean"} <= set(checks[0]["stats_rel_error"])
    assert next(x for x in lines if x["check"] == "timing")["seconds_device"] > 0
    assert lines[-1] == {**lines[-1], "check": "done", "failed": 0}


def test_without_cuda_it_says_so():
    import torch

    if torch.cuda.is_available():
        return
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_device_check.py")], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["check"] == "none"
