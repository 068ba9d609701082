"""``calibration.device: cuda`` against the CPU, for a session lent a GPU (one short script).

    python benchmarks/gpu_device_check.py                 # on the GPU machine: one JSON line per check
    python benchmarks/gpu_device_check.py --device cpu    # the same checks CPU against CPU (a smoke run: errors 0)

Checks, on tiny checkpoints built with transformers' classes (Qwen3-MoE, DeepSeek-V3, Mixtral, GPT-OSS),
each recipe separately (every recipe passes the dry run first; its verdict is printed as a ``dry_run``
line, and a refused recipe is reported and skipped, not fatal):

1. calibration statistics on the device equal the CPU's within float32 reduction tolerance (relative
   error printed; the CPU's own run-to-run error is 0): ``heapr`` alone gives the streamed backward's
   ``act_sq_mean``/``grad_sq_mean``, ``svd_experts`` alone the forward's ``input_cov``/``down_in_cov_pooled``;
2. every pass marked ``on_device`` (``PassSpec.on_device``: ``svd_experts``) and ``heapr`` give the same
   output on both devices: the output loads and its logits' relative difference is printed;
3. time of calibration + ``svd_experts`` on a larger synthetic checkpoint, CPU vs the device
   (``--timing-scale s`` divides its sizes by ``s``; ``--small`` is ``s = 4``; at ``s = 1`` the CPU side
   takes minutes on one core).

(``heapr`` followed by ``svd_experts`` in one recipe is refused by the dry run: heapr's non-uniform prune
leaves ragged experts that svd_experts cannot factorise, so the two run as separate recipes.) A check that
raises prints ``{"check": ..., "error": ...}`` and the others still run; the exit status is 1 then.
Checks past ``--budget-s`` are printed as skipped. Without CUDA (and ``--device cuda``) it says so and
exits 0. Record the output in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import moecompress as mc
from moecompress.calibration.cache import load_layer
from moecompress.passes import BUILTIN_PASSES
from moecompress.testing import save_tiny

RECIPES: dict[str, list] = {
    "heapr": [{"heapr": {"ratio": 0.25}}],  # forward + streamed backward statistics
    "svd_experts": [{"svd_experts": {"ratio": 0.3}}],  # the on_device pass; forward statistics
}
MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def recipe(model: Path, out: Path, device: str, steps: list, samples: int, seq_len: int) -> dict:
    return {"model": str(model), "output": str(out), "steps": steps,
            "calibration": {"source": "random", "samples": samples, "seq_len": seq_len, "device": device,
                            "dtype": "float32", "cache_dir": str(out.parent / f"cache-{out.name}")}}  # fmt: skip


def run(model: Path, out: Path, device: str, steps: list, samples: int = 16, seq_len: int = 32):
    t = time.perf_counter()
    res = mc.apply(recipe(model, out, device, steps, samples, seq_len), progress=False)
    return res, time.perf_counter() - t


def dry_run(model: Path, root: Path, device: str, name: str) -> dict:
    """The dry run's verdict on recipe ``name`` for ``model`` on ``device`` (refusals are returned, not raised)."""
    rec = recipe(model, root / f"dry-{name}-{device}", device, RECIPES[name], 16, 32)
    try:
        rep = mc.apply(rec, dry_run=True, progress=False).report.get("dry_run", {})
        return {"accepted": True, "device": rep.get("device")}
    except mc.MoecompressError as exc:
        return {"accepted": False, "why": f"{type(exc).__name__}: {exc}"}


def compare(root: Path, model_type: str, name: str, device: str) -> dict:
    """Recipe ``name`` on ``model_type`` on the CPU and on ``device``: statistics and output logits."""
    model = root / model_type
    if not (model / "config.json").exists():
        save_tiny(model_type, model)
    out = {"check": "stats+passes", "model_type": model_type, "recipe": name, "device": device}
    verdict = dry_run(model, root, device, name)
    print(json.dumps({"check": "dry_run", "model_type": model_type, "recipe": name, **verdict}), flush=True)
    if not verdict["accepted"]:
        return {**out, "skipped": "refused by the dry run"}
    ref, t_ref = run(model, root / f"{model_type}-{name}-ref", "cpu", RECIPES[name])  # own outputs and caches:
    got, t_got = run(model, root / f"{model_type}-{name}-dev", device, RECIPES[name])  # no cache hit, also cpu/cpu
    worst: dict[str, float] = {}
    for i in mc.open_checkpoint(model).moe_layer_indices:
        a, b = load_layer(ref.cache_entry, i), load_layer(got.cache_entry, i)
        for k in a:
            if a[k].is_floating_point():
                worst[k] = max(worst.get(k, 0.0), rel(b[k], a[k]))
    m_ref, m_got = mc.load(ref.output_dir), mc.load(got.output_dir)
    ids = torch.randint(0, m_ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = rel(m_got(ids).logits, m_ref(ids).logits)
    return {**out, "stats_rel_error": worst, "output_logits_rel_error": logits, "seconds_cpu": round(t_ref, 2),
            "seconds_device": round(t_got, 2)}  # fmt: skip


def timing(root: Path, device: str, f: int) -> dict:
    """Calibration (forward statistics) and svd_experts on a mid-sized Qwen3-MoE (sizes divided by ``f``),
    CPU and ``device``."""
    hidden, inter, experts, samples, seq = 1024 // f, 512 // f, 64 // f, 64 // f, 256 // f
    model = root / "mid"
    save_tiny("qwen3_moe", model, hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
              num_experts_per_tok=8, num_hidden_layers=4, intermediate_size=2 * hidden)  # fmt: skip
    out = {"check": "timing", "recipe": "svd_experts",
           "shape": f"qwen3_moe hidden {hidden}, {experts} experts x {inter}, top-8, 4 layers, {samples} x {seq} tokens"}
    for label, dev in (("cpu", "cpu"), ("device", device)):
        _, secs = run(model, root / f"mid-{label}", dev, RECIPES["svd_experts"], samples=samples, seq_len=seq)
        out[f"seconds_{label}"] = round(secs, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="device compared with the CPU (default cuda; cpu: smoke run)")
    ap.add_argument("--models", default=",".join(MODEL_TYPES), help="comma-separated model types")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {sorted(RECIPES)}")
    ap.add_argument("--timing-scale", type=int, default=1, help="divide the timing check's sizes by this")
    ap.add_argument("--small", action="store_true", help="--timing-scale 4")
    ap.add_argument("--no-timing", action="store_true", help="skip the timing check")
    ap.add_argument("--budget-s", type=float, default=240.0, help="checks not started by then are skipped")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"check": "none", "why": "no CUDA device: nothing to compare"}))
        return 0
    names = [n for n in args.recipes.split(",") if n]
    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        ap.error(f"unknown recipes {unknown}; known: {sorted(RECIPES)}")
    print(json.dumps({"check": "setup", "device": args.device, "on_device_passes":
                      sorted(n for n, s in BUILTIN_PASSES.items() if s.on_device),
                      "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                      "torch": torch.__version__, "moecompress": mc.__version__}), flush=True)  # fmt: skip
    t0, failed = time.perf_counter(), 0
    jobs = [(f"{mt}/{n}", compare, (mt, n, args.device)) for mt in args.models.split(",") if mt for n in names]
    if not args.no_timing:
        jobs.append(("timing", timing, (args.device, 4 if args.small else max(1, args.timing_scale))))
    with tempfile.TemporaryDirectory() as tmp:
        for label, fn, fargs in jobs:
            if time.perf_counter() - t0 > args.budget_s:
                print(json.dumps({"check": label, "skipped": f"past --budget-s {args.budget_s:g}"}), flush=True)
                continue
            try:
                line = fn(Path(tmp), *fargs)
            except Exception as exc:  # one broken check must not hide the others
                failed += 1
                line = {"check": label, "error": f"{type(exc).__name__}: {exc}",
                        "where": traceback.format_exc(limit=-3).strip().splitlines()[-4:]}  # fmt: skip
            print(json.dumps(line), flush=True)
    print(json.dumps({"check": "done", "failed": failed, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
