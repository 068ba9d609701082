"""Time per layer of every built-in pass on ONE MoE layer of Qwen3-30B-A3B's shapes.

The layer: hidden 2048, 128 routed experts of width 768, top-8 softmax routing with normalised top-k,
bf16 weights drawn at random (a fixed seed). Its statistics come from the real collector
(:func:`moecompress.testing.layer_statistics`) on ``--tokens`` random hidden states (the gradient
statistics with the ``‖MoE(x)‖² / 2T`` stand-in loss), with ``io_sample`` of 512 tokens as
``calibration.sample_tokens`` gives by default. Every statistic has the shape calibration on 128 x 512
tokens gives; only the number of tokens averaged differs, which no pass's cost depends on (the passes
read accumulated means, covariances and the bounded sample).

Each pass runs in its own subprocess (``--one NAME``), so that its peak RSS (``VmHWM``, which includes
the ~1.2 GB layer and the statistics it reads) is its own, under ``--timeout`` seconds of wall time.
Reported per pass: ``thread_time`` of the pass call (CPU seconds of the main thread; torch's intra-op
threads are not counted there, so ``process_time`` is given as well), wall seconds, and peak RSS.
Default configs, plus ``codequant bits 4`` and ``rtn bits 4`` (both the defaults already); passes whose
config has required fields get the smallest sensible one (``ablate_experts``: expert 0;
``namex``/``merge_experts``: ``ratio 0.5``). Planned passes (``plan``) get their plan from the statistics
of this one layer, timed with the pass.

    python benchmarks/pass_speed.py                       # every pass, table on stdout
    python benchmarks/pass_speed.py --passes rtn codequant --timeout 900
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E, H, INTER, TOP_K = 128, 2048, 768, 8
CONFIGS: dict[str, dict] = {
    "ablate_experts": {"experts": [{"layer": 0, "experts": [0]}]},
    "namex": {"ratio": 0.5},
    "merge_experts": {"ratio": 0.5},
    "codequant": {"bits": 4},
    "rtn": {"bits": 4},
}


def make_layer(seed: int = 0, experts: int = E, hidden: int = H, width: int = INTER):
    """A Qwen3-30B-A3B-shaped MoE layer (bf16 experts, fp32 router as transformers keeps it in bf16)."""
    from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
    from moecompress.layouts.dense import Dense

    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale):  # drawn one expert at a time: no float32 copy of a whole bank
        out = torch.empty(*shape, dtype=torch.bfloat16)
        for e in range(shape[0]):
            out[e] = scale * torch.randn(*shape[1:], generator=g)
        return out

    bank = ExpertBank(
        Dense(w(experts, width, hidden, scale=hidden**-0.5)),
        Dense(w(experts, width, hidden, scale=hidden**-0.5)),
        Dense(w(experts, hidden, width, scale=width**-0.5)),
    )
    spec = RouterSpec(num_experts=experts, top_k=TOP_K, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, w(experts, hidden, scale=0.5 * hidden**-0.5), bank)


def all_needs() -> set[str]:
    from moecompress.passes import BUILTIN_PASSES

    needs: set[str] = set()
    for name, spec in BUILTIN_PASSES.items():
        needs |= set(spec.needs_for(spec.config(**CONFIGS.get(name, {}))))
    return needs


def prepare(work: Path, tokens: int) -> None:
    from moecompress.testing import layer_statistics

    path = work / "stats.safetensors"
    if path.exists():
        return
    layer = make_layer()
    t0 = time.perf_counter()
    stats = layer_statistics(layer, all_needs(), tokens=tokens, sample_tokens=512)
    print(f"statistics of {tokens} tokens: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    save_file({k: v.contiguous() for k, v in stats.items()}, str(path))


def one(name: str, work: Path) -> dict:
    from moecompress.calibration.catalogue import tensor_names
    from moecompress.engine.peak import peak_rss_bytes
    from moecompress.engine.spec import LayerStats
    from moecompress.passes import BUILTIN_PASSES

    spec = BUILTIN_PASSES[name]
    cfg = spec.config(**CONFIGS.get(name, {}))
    needs = spec.needs_for(cfg)
    layer = make_layer()
    available = {}
    if needs:
        with safe_open(str(work / "stats.safetensors"), "pt") as f:
            names = tensor_names(needs)
            available = {k: f.get_tensor(k) for k in f.keys() if k in names}
    base_rss = peak_rss_bytes()
    t_thread, t_proc, t_wall = time.thread_time(), time.process_time(), time.perf_counter()
    plan = None
    if spec.plan is not None:
        plan = spec.plan({0: LayerStats.view(0, available, needs, step=name)}, cfg).get(0)
    stats = LayerStats.view(0, available, needs, step=name, plan=plan)
    spec.fn(layer, stats, cfg)
    return {
        "pass": name,
        "config": CONFIGS.get(name, {}),
        "thread_s": time.thread_time() - t_thread,
        "process_s": time.process_time() - t_proc,
        "wall_s": time.perf_counter() - t_wall,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "rss_before_mib": base_rss / 2**20,
    }


def main() -> None:
    from moecompress.passes import BUILTIN_PASSES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", nargs="*", default=list(BUILTIN_PASSES))
    ap.add_argument("--work", type=Path, default=Path("/tmp/pass_speed"))
    ap.add_argument("--tokens", type=int, default=4096, help="random tokens the statistics average")
    ap.add_argument("--timeout", type=float, default=600.0, help="wall seconds per pass")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.work)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    prepare(args.work, args.tokens)
    rows = []
    print("| pass | config | thread s | process s | wall s | peak RSS MiB |\n|---|---|---|---|---|---|")
    for name in args.passes:
        cmd = [sys.executable, __file__, "--one", name, "--work", str(args.work)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ)
        except subprocess.TimeoutExpired:
            row = {"pass": name, "config": CONFIGS.get(name, {}), "error": f"> {args.timeout:.0f} s wall"}
        else:
            if res.returncode:
                row = {"pass": name, "config": CONFIGS.get(name, {}),
                       "error": (res.stderr.strip().splitlines() or ["?"])[-1][:200]}  # fmt: skip
            else:
                row = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append(row)
        cfg = json.dumps(row["config"]) if row["config"] else "default"
        if "error" in row:
            print(f"| {name} | {cfg} | {row['error']} | | | |", flush=True)
        else:
            print(f"| {name} | {cfg} | {row['thread_s']:.2f} | {row['process_s']:.2f} | {row['wall_s']:.2f} "
                  f"| {row['peak_rss_mib']:.0f} |", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
