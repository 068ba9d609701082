"""CPU seconds of one CodeQuant fine-tuning step per expert at DeepSeek-V3 shapes (hidden 7168, expert width
2048: gate/up ``[2048, 7168]``, down ``[7168, 2048]``, whole-row codebooks, 4 bits), the code of a git
revision (``--legacy REV``: its ``methods/codebooks.py`` loaded from ``git show``) against the working
tree's, interleaved in one process, best of ``--repeat``.

Setup: ``--experts`` bf16 experts ``N(0, 0.02²)`` (2 by default), a softmax top-1 router, ``--tokens``
calibration tokens ``N(0, 1)`` (128: 64 routed tokens per expert, what 512 ``io_sample`` tokens give each
of 64 experts at top-8; the pass's 3/4 fit, 1/4 validation split). The parts are built as the pass builds
them (:func:`cluster`, ``keep_sorted``); each timed call gets fresh copies. A step's cost is
``(t(steps) − t(0)) / steps / experts``, in CPU and in wall seconds; ``t(0)`` (one validation forward) is
reported too. Both revisions' results are compared: validation errors, best step and the codes and
centroids kept.

    OMP_NUM_THREADS=1 python benchmarks/codequant_step.py --legacy c43b7ac --steps 3 --repeat 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.methods import codebook_finetune, codebooks

HID, WID = 7168, 2048
OUT = Path(__file__).parent / "results" / "codequant_step.json"


def _legacy(rev: str):
    """``methods/codebooks.py`` at ``rev``, imported as its own module (it imports the package's others)."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:moecompress/methods/codebooks.py"], cwd=root,
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "codebooks_legacy.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("codebooks_legacy", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["codebooks_legacy"] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _layer(n: int, g: torch.Generator, hid: int = HID, wid: int = WID) -> MoELayer:
    w = {
        "gate": torch.randn(n, wid, hid, generator=g) * 0.02,
        "up": torch.randn(n, wid, hid, generator=g) * 0.02,
        "down": torch.randn(n, hid, wid, generator=g) * 0.02,
    }
    spec = RouterSpec(num_experts=n, top_k=1, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    bank = ExpertBank(*(Dense(w[p].bfloat16()) for p in ("gate", "up", "down")))
    return MoELayer(0, spec, (torch.randn(n, hid, generator=g) * 0.02).bfloat16(), bank)


def _parts(layer: MoELayer) -> dict:
    ids = list(range(layer.experts.num_experts))
    parts = {}
    for name in ("gate", "up", "down"):
        w = getattr(layer.experts, name).dense().float()
        seeds = [codebooks.expert_seed(0, e) for e in ids]
        cents, codes, rows = codebooks.cluster(
            w, 4, w.shape[2], iters=300, seed=0, keep_sorted=True, seeds=seeds
        )
        parts["experts", name] = {"proj": name, "ids": ids, "live": layer.experts.width, "w": w, "cents": cents,
                                  "codes": codes, "scale": None, "rows": rows}  # fmt: skip
    return parts


def _fresh(parts: dict) -> dict:
    return {k: {**p, "cents": p["cents"].clone(), "codes": p["codes"].clone()} for k, p in parts.items()}


def _run(mod, layer, parts, x_fit, x_val, steps: int) -> tuple[tuple[float, float], dict, dict]:
    """``((CPU s, wall s), info, parts)`` of one :func:`finetune` on fresh copies of ``parts``."""
    p = _fresh(parts)
    t0, w0 = time.process_time(), time.perf_counter()
    info = mod.finetune(layer, layer, p, x_fit, x_val, steps=steps, lr=0.01, kl_weight=1.0)
    return (time.process_time() - t0, time.perf_counter() - w0), info, p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--legacy", default=None, help="git revision of the code to compare with")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=HID, help="H (the peer benchmark's: 1024)")
    ap.add_argument("--width", type=int, default=WID, help="I (the peer benchmark's: 512)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    layer = _layer(args.experts, g, args.hidden, args.width)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    n_fit = (3 * args.tokens) // 4
    x_fit, x_val = x[:n_fit], x[n_fit:]
    t0 = time.process_time()
    parts = _parts(layer)
    kmeans_s = (time.process_time() - t0) / args.experts
    mods = {"new": codebook_finetune} | ({"legacy": _legacy(args.legacy)} if args.legacy else {})
    times: dict = {k: {0: [], args.steps: []} for k in mods}
    results: dict = {}
    for _ in range(args.repeat):
        for name, mod in mods.items():
            for steps in (0, args.steps):
                t, info, p = _run(mod, layer, parts, x_fit, x_val, steps)
                times[name][steps].append(t)
                results[name, steps] = (info, p)
    out: dict = {"experts": args.experts, "hidden": args.hidden, "width": args.width, "tokens": args.tokens, "steps": args.steps, "repeat": args.repeat,
                 "kmeans_per_expert_s": kmeans_s, "threads": torch.get_num_threads(),
                 "legacy_rev": args.legacy}  # fmt: skip
    for name in mods:
        out[name] = {}
        for i, kind in enumerate(("", "wall_")):  # CPU seconds, then wall seconds
            t0_ = min(t[i] for t in times[name][0])
            ts = min(t[i] for t in times[name][args.steps])
            per = (ts - t0_) / args.steps / args.experts
            out[name].update({f"{kind}t0_s": t0_, f"{kind}t_steps_s": ts, f"{kind}step_per_expert_s": per})
        out[name]["info"] = results[name, args.steps][0]
    if "legacy" in mods:
        a, b = results["new", args.steps], results["legacy", args.steps]
        out["same_info"] = all(a[0][k] == v for k, v in b[0].items())  # the legacy keys (no steps_run)
        out["same_codes"] = all(torch.equal(a[1][k]["codes"], b[1][k]["codes"]) for k in a[1])
        out["same_cents"] = all(torch.equal(a[1][k]["cents"], b[1][k]["cents"]) for k in a[1])
    print(json.dumps(out, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
