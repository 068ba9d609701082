"""Bytes per routed-expert parameter of the quantised layouts, at real MoE shapes and at the reference
models' shapes, measured on the stored tensors of one layer (``Layout.nbytes()``: codes, centroids or
scales/zero points, and the index metadata), not from a formula.

    python benchmarks/quant_bytes.py [--experts 4]

A layer of ``--experts`` experts with the model's (out, in) shapes is quantised with random weights
(k-means and RTN run for real; the byte count does not depend on the values), so large shapes run in
seconds. The rotation (``H × H``, once per layer) is amortised over the model's real expert count.
"""

from __future__ import annotations

import argparse

import torch

from moecompress.layouts.codebook import Codebook
from moecompress.layouts.rtn import RTN

SHAPES = {  # name: (hidden H, expert width I, experts per layer E)
    "Qwen3-30B-A3B": (2048, 768, 128),
    "Mixtral-8x7B": (4096, 14336, 8),
    "DeepSeek-V3": (7168, 2048, 256),
    "ref models (H=128, I=64)": (128, 64, 16),
}


def codebook_bytes(h: int, i: int, e: int, bits: int, n: int, rot_bytes: int = 4) -> float:
    """Bytes per routed parameter of gate/up [I, H] and down [H, I] in the codebook layout."""
    total = 0
    for out, inn in ((i, h), (i, h), (h, i)):
        rows = min(out, 64)  # bytes per row are the same for every row: measure 64 rows, scale up
        w = torch.randn(n, rows, inn)
        codes = {k: torch.randint(0, 1 << bits, (rows, inn)) for k in range(n)}
        cents = {k: torch.randn(rows, 1, 1 << bits) for k in range(n)}
        lay = Codebook.build(codes, cents, {}, bits, w)
        per_row = (lay.nbytes() - lay.members.numel() * 8) / (n * rows)
        total += per_row * out * e + e * 8  # members: int64 per expert
    total += h * h * rot_bytes  # the layer's rotation
    return total / (3 * e * h * i)


def rtn_bytes(h: int, i: int, e: int, bits: int, n: int, group: int, symmetric: bool) -> float:
    """The same for the ``rtn`` layout (``group`` inputs per scale; no rotation)."""
    total = 0
    for out, inn in ((i, h), (i, h), (h, i)):
        rows = min(out, 64)
        lay = RTN.from_dense(torch.randn(n, rows, inn), bits, group, symmetric=symmetric)
        total += (lay.nbytes() - lay.members.numel() * 8) / (n * rows) * out * e + e * 8
    return total / (3 * e * h * i)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=2, help="experts actually quantised per shape")
    args = ap.parse_args()
    print(
        "| shape | bits | codebook per row + rotation: B/param | bits/param | rtn g128 asym: B/param | bits/param "
        "| rtn g128 sym: bits/param |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, (h, i, e) in SHAPES.items():
        g = 128 if i % 128 == 0 else 64
        for bits in (4, 3, 2):
            b = codebook_bytes(h, i, e, bits, args.experts)
            r = rtn_bytes(h, i, e, bits, args.experts, g, False)
            rs = rtn_bytes(h, i, e, bits, args.experts, g, True)
            note = "" if g == 128 else " (g64)"
            print(f"| {name} | {bits} | {b:.4f} | {8 * b:.3f} | {r:.4f}{note} | {8 * r:.3f} | {8 * rs:.3f} |")


if __name__ == "__main__":
    main()
