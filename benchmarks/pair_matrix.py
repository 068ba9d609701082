"""Every ordered pair of built-in steps on the tiny checkpoints: does the dry run's verdict hold? (issue 34)

For each architecture and each ordered pair ``[a, b]`` of :data:`STEPS` (the built-in per-layer steps,
heapr in both layouts, with the settings a new user would write), the recipe is dry-run, then run, and
its output loaded and run on a few tokens. Each pair is one of:

- ``run``: the dry run accepts it, the run finishes, the output loads (or the recipe writes none);
- ``refused``: the dry run refuses it with a one-line error (before any token is read);
- ``late``: the dry run accepts it and the run fails with a one-line error (after calibration);
- ``crash``: any traceback (dry run, run or load), or an output that does not load.

    python benchmarks/pair_matrix.py --arch qwen3_moe deepseek_v3 --json out.json
    python benchmarks/pair_matrix.py --arch all --workers 2

Only the public API is used (``apply``, ``load``, ``testing.save_tiny``, ``MoecompressError``), so the same
script measures an older checkout (``PYTHONPATH=old-checkout python benchmarks/pair_matrix.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

CAL = {"source": "random", "samples": 4, "seq_len": 16, "batch_size": 2, "sample_tokens": 64}

STEPS: dict[str, dict] = {
    "identity": {"identity": {}},
    "analyze": {"analyze": {}},
    "protect_super_experts": {"protect_super_experts": {}},
    "ablate_experts": {"ablate_experts": {"experts": [{"layer": 0, "experts": [0]}]}},
    "expert_prune": {"expert_prune": {"ratio": 0.25}},
    "heapr": {"heapr": {"ratio": 0.25}},
    "heapr_uniform": {"heapr": {"ratio": 0.25, "layout": "uniform"}},
    "neuron_prune": {"neuron_prune": {"ratio": 0.25}},
    "tdmoe": {"tdmoe": {"ratio": 0.4}},
    "svd_experts": {"svd_experts": {"ratio": 0.4}},
    "decompose": {"decompose": {"ratio": 0.4}},
    "codequant": {"codequant": {"bits": 4, "finetune_steps": 2}},
    "rtn": {"rtn": {"bits": 4}},
    "gptq": {"gptq": {"bits": 4}},
    "namex": {"namex": {"ratio": 0.25}},
    "merge_experts": {"merge_experts": {"ratio": 0.25}},
    "capacity_drop": {"capacity_drop": {}},
    "sere": {"sere": {}},
    "routing_report": {"routing_report": {}},
    "expert_structure": {"expert_structure": {}},
    "choose_groups": {"choose_groups": {"ratio": 0.25}},
    "attribute_routing": {"attribute_routing": {}},
    "router_robustness": {"router_robustness": {}},
}
"""Every built-in per-layer step (the training stages distill / lora_heal excluded: whole-model runs)."""

COMMON = ["heapr", "heapr_uniform", "neuron_prune", "expert_prune", "svd_experts", "tdmoe", "namex", "merge_experts",
          "rtn", "gptq", "codequant", "capacity_drop", "sere", "protect_super_experts"]
"""The 14 common steps of issue 34's measurement (196 ordered pairs per architecture)."""

FAST = [
    ("expert_prune", "gptq"), ("namex", "gptq"), ("merge_experts", "gptq"), ("heapr_uniform", "gptq"),
    ("heapr", "gptq"), ("heapr_uniform", "svd_experts"), ("expert_prune", "neuron_prune"),
    ("namex", "expert_prune"), ("heapr_uniform", "codequant"), ("namex", "rtn"), ("expert_prune", "heapr"),
    ("heapr", "expert_prune"),
]  # fmt: skip
"""The natural chains of issue 34 (the default suite's subset)."""


def triples(n: int = 40, seed: int = 34) -> list[tuple[str, str, str]]:
    """A fixed sample of ``n`` ordered triples of :data:`COMMON` steps (no step twice in a row)."""
    import random

    pool = [(a, b, c) for a in COMMON for b in COMMON for c in COMMON if a != b and b != c]
    return random.Random(seed).sample(pool, n)


def classify(model: Path, steps: list[dict], out: Path) -> tuple[str, str]:
    """``(verdict, detail)`` of one recipe on one checkpoint (module docstring)."""
    import torch

    import moecompress as mc
    from moecompress.errors import MoecompressError

    rec = {"model": str(model), "output": str(out), "calibration": dict(CAL), "steps": steps}
    try:
        mc.apply(rec, dry_run=True, progress=False)
    except MoecompressError as err:
        return ("refused" if "\n" not in str(err) else "crash"), str(err)
    except Exception:  # a traceback is what is measured
        return "crash", traceback.format_exc(limit=-3)
    try:
        mc.apply(rec, progress=False)
    except MoecompressError as err:
        return "late", str(err)
    except Exception:
        return "crash", traceback.format_exc(limit=-3)
    if any(out.glob("*.safetensors")):
        try:
            ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                logits = mc.load(out)(ids).logits
            if not bool(torch.isfinite(logits).all()):
                return "crash", "the output loads but its logits are not finite"
        except Exception:
            return "crash", "the output does not load: " + traceback.format_exc(limit=-2)
    return "run", ""


def _one(args: tuple) -> dict:
    arch, chain, root = args
    model = Path(root) / arch
    work = Path(tempfile.mkdtemp(dir=root))
    t0 = time.perf_counter()
    try:
        verdict, detail = classify(model, [STEPS[x] for x in chain], work / "out")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"arch": arch, "pair": list(chain), "verdict": verdict, "detail": detail[:400],
            "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip


def matrix(archs: list[str], pairs: list[tuple[str, ...]], root: Path, workers: int = 1) -> list[dict]:
    """Every chain (pair or triple) on every architecture (tiny checkpoints saved under ``root``)."""
    from moecompress.testing import save_tiny

    for arch in archs:
        if not (root / arch).exists():
            save_tiny(arch, root / arch)
    todo = [(arch, chain, str(root)) for arch in archs for chain in pairs]
    if workers <= 1:
        return [_one(t) for t in todo]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_one, todo, chunksize=4))


def counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        c = out.setdefault(r["arch"], {"run": 0, "refused": 0, "late": 0, "crash": 0})
        c[r["verdict"]] += 1
    return out


def main() -> None:
    from moecompress.testing import MODEL_TYPES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=["qwen3_moe", "deepseek_v3"], help="model types, or all")
    p.add_argument("--steps", choices=["all", "common", "rest", "fast", "triples"], default="all",
                   help="pairs of every built-in step (STEPS), of the 14 common ones (COMMON), the pairs of all "
                   "with another step (rest), the natural chains (FAST), or 40 sampled triples of common steps")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    a = p.parse_args()
    archs = MODEL_TYPES if a.arch == ["all"] else a.arch
    names = COMMON if a.steps == "common" else list(STEPS)
    pairs = {"fast": FAST, "triples": triples()}.get(a.steps) or [(x, y) for x in names for y in names]
    if a.steps == "rest":
        pairs = [(x, y) for x in STEPS for y in STEPS if x not in COMMON or y not in COMMON]
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        rows = matrix(archs, pairs, Path(root), a.workers)
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    for arch, c in counts(rows).items():
        print(f"{arch:12s} " + " ".join(f"{k} {v}" for k, v in c.items()))
    for r in rows:
        if r["verdict"] in ("late", "crash"):
            print(f"{r['verdict']:6s} {r['arch']} {r['pair']}: {r['detail'].strip().splitlines()[-1][:200]}")
    print(f"{len(rows)} recipes in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
