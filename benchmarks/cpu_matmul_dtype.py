"""PyTorch's CPU matmul by dtype, in the shapes calibration multiplies (Qwen3-30B widths: 128 tokens, hidden 2048,
expert width 768), one thread: why ``calibration.dtype: auto`` computes in float32 on a CPU without a bfloat16
(float16) matmul kernel (``moecompress.engine.context.fast_cpu_matmul``).

    OMP_NUM_THREADS=1 python benchmarks/cpu_matmul_dtype.py [--json OUT.json]

Rows: ``forward`` ``x @ w.T`` (a linear layer), ``input grad`` ``g @ w`` (the weight as stored: a backward's
input gradient), ``weight grad`` ``g.T @ x``; milliseconds, best of 5, and each 16-bit dtype's time over float32's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moecompress.engine.context import fast_cpu_matmul


def best_ms(f, n: int = 5) -> float:
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: dict[str, dict[str, float]] = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x, w, g = torch.randn(128, 2048).to(dt), torch.randn(768, 2048).to(dt), torch.randn(128, 768).to(dt)
        rows[str(dt).removeprefix("torch.")] = {
            "forward": best_ms(lambda x=x, w=w: x @ w.t()),
            "input grad": best_ms(lambda g=g, w=w: g @ w),
            "weight grad": best_ms(lambda g=g, x=x: g.t() @ x),
        }
    info = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "fast_bfloat16": fast_cpu_matmul(torch.bfloat16), "fast_float16": fast_cpu_matmul(torch.float16)}  # fmt: skip
    print(json.dumps(info))
    print("| product | float32 ms | bfloat16 ms (x float32) | float16 ms (x float32) |\n|---|---:|---:|---:|")
    for op, base in rows["float32"].items():
        cells = [f"{rows[d][op]:.1f} ({rows[d][op] / base:.0f}x)" for d in ("bfloat16", "float16")]
        print(f"| {op} | {base:.1f} | {' | '.join(cells)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "ms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
