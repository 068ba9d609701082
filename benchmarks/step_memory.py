"""The dry run's memory estimates against measured peaks, per built-in pass, at Qwen3-30B-A3B MoE shapes.

    python benchmarks/step_memory.py                      # every pass listed in PASSES
    python benchmarks/step_memory.py --passes heapr rtn   # some of them

One synthetic checkpoint: ``qwen3_moe`` with one decoder layer whose MoE block has Qwen3-30B-A3B's shapes
(hidden 2048, 128 experts of width 768, top-8; 1.2 GB of bf16 expert weights), random weights, small
vocabulary and attention. For each pass, two fresh processes: ``moecompress.calibrate`` (its peak RSS
against the dry run's ``calibration_memory_bytes``), then ``moecompress.apply`` reusing that statistics
cache (its peak RSS against the largest ``step_memory`` of the dry run). Peak RSS is the child's
``VmHWM`` (:func:`moecompress.engine.peak.peak_rss_bytes`; ``ru_maxrss`` carries the parent's peak across
``fork`` and ``exec``, which made every child report the 5.7 GiB of the process that built the checkpoint). Prints one JSON line per pass and a Markdown table; the acceptance is each estimate
within 25 % of its measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GiB = 1024**3
PASSES = {
    "identity": {},
    "analyze": {},
    "protect_super_experts": {},
    "heapr": {"ratio": 0.25},
    "neuron_prune": {"ratio": 0.25},
    "expert_prune": {"ratio": 0.25},
    "rtn": {"bits": 4},
    "svd_experts": {"ratio": 0.4},
    "tdmoe": {"ratio": 0.4},
    "namex": {"ratio": 0.5},
    "merge_experts": {"ratio": 0.5},
    "codequant": {"bits": 4},
    "gptq": {"bits": 4},
    "capacity_drop": {},
    "sere": {},
    "routing_report": {},
    "expert_structure": {},
    "choose_groups": {},
    "router_robustness": {},
}
CAL = {"source": "random", "samples": 16, "seq_len": 128, "dtype": "bfloat16"}

WORKER = r"""
import json, sys
import moecompress as mc
from moecompress.engine.peak import peak_rss_bytes
mode, rec = sys.argv[1], json.loads(sys.argv[2])
if mode == "calibrate":
    mc.calibrate(rec, progress=False)
else:
    mc.apply(rec, progress=False)
print(json.dumps({"peak": peak_rss_bytes()}))
"""


def build(path: Path) -> None:
    import torch

    from moecompress.testing import save_tiny

    save_tiny("qwen3_moe", path, dtype=torch.bfloat16, hidden_size=2048, moe_intermediate_size=768,
              num_experts=128, num_experts_per_tok=8, num_hidden_layers=1, vocab_size=512,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768)  # fmt: skip


def child(mode: str, rec: dict) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    out = subprocess.run(
        [sys.executable, "-c", WORKER, mode, json.dumps(rec)], capture_output=True, text=True, env=env
    )
    if out.returncode:
        raise RuntimeError(
            f"{mode} failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def measure(name: str, cfg: dict, model: Path, root: Path) -> dict:
    import moecompress as mc

    rec = {"model": str(model), "output": str(root / f"out-{name}"), "steps": [{name: cfg}],
           "calibration": {**CAL, "cache_dir": str(root / f"cache-{name}")}}  # fmt: skip
    dry = mc.apply(rec, dry_run=True, progress=False).report["dry_run"]
    cal_peak = child("calibrate", rec)
    step_peak = child("apply", rec)
    step_est = max((v["bytes"] for v in dry["step_memory"].values()), default=0)
    row = {"pass": name, "config": cfg,
           "calibration_estimate_gib": round(dry["calibration_memory_bytes"] / GiB, 2),
           "calibration_peak_gib": round(cal_peak / GiB, 2),
           "step_estimate_gib": round(step_est / GiB, 2), "step_peak_gib": round(step_peak / GiB, 2)}  # fmt: skip
    row["calibration_ratio"] = round(dry["calibration_memory_bytes"] / cal_peak, 2)
    row["step_ratio"] = round(step_est / step_peak, 2)
    subprocess.run(["rm", "-rf", str(root / f"out-{name}"), str(root / f"cache-{name}")], check=False)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", nargs="*", default=list(PASSES))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    from moecompress.errors import MoecompressError

    root = Path(args.workdir or tempfile.mkdtemp(prefix="step-memory-"))
    model = root / "model"
    if not model.exists():
        build(model)
    rows = []
    for name in args.passes:
        try:
            rows.append(measure(name, PASSES[name], model, root))
        except (RuntimeError, MoecompressError) as err:
            rows.append({"pass": name, "error": str(err)})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| pass | calibration est. / peak (GiB) | step est. / peak (GiB) | est./peak (cal, step) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['pass']} | failed: {r['error']} | | |")
            continue
        print(f"| {r['pass']} | {r['calibration_estimate_gib']} / {r['calibration_peak_gib']} | "
              f"{r['step_estimate_gib']} / {r['step_peak_gib']} | {r['calibration_ratio']}, {r['step_ratio']} |")  # fmt: skip


if __name__ == "__main__":
    main()
