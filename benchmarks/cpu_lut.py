"""One expert's projection on CPU, one thread: dense float32 ``F.linear`` vs decode + ``F.linear`` vs the
packed-code kernel of :mod:`moecompress.runtime.cpu_lut`, at Qwen3-30B-A3B expert shapes.

    python benchmarks/cpu_lut.py [--tokens 1 4 8 32 64] [--repeats 7]

Rows (µs per call, the minimum over ``--repeats`` of the mean of a timed loop, ``time.thread_time`` so
that other processes on a shared machine do not count):

- ``dense``: ``F.linear(x, W)`` with the decoded float32 weight kept in memory (4 B/weight);
- ``decode``: what the prepared CPU path did before the kernel (``runtime/unpacked.py``): codes unpacked
  to uint8 once at load, then per call ``gather`` of the centroids (codebook) or ``(q − z)·s`` (rtn) and
  ``F.linear``;
- ``kernel``: ``codebook_matmul`` / ``rtn_matmul`` on the packed codes.

The weights are random (speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from moecompress.layouts.bitpack import pack_bits
from moecompress.methods.scalar_quant import dequantize, quantize
from moecompress.runtime import cpu_lut

SHAPES = {"gate/up [768 x 2048]": (768, 2048), "down [2048 x 768]": (2048, 768)}


def timed(fn, repeats: int, budget: float = 0.05) -> float:
    """µs per call: calls per loop sized to ~``budget`` s of CPU time, min over ``repeats`` loops."""
    fn()
    start = time.thread_time()
    fn()
    n = max(1, int(budget / max(time.thread_time() - start, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - start) / n)
    return best * 1e6


def cases(out: int, inn: int):
    """(name, dense weight, decode closure factory, kernel closure factory) for each quantised layout."""
    w = torch.randn(out, inn) * 0.02
    for bits in (4, 2):
        g = 1  # one codebook per row (codequant's default)
        q = torch.randint(0, 1 << bits, (out, inn), dtype=torch.uint8)
        cents = torch.randn(out, g, 1 << bits).half()
        packed, cf = pack_bits(q, bits), cents.float()
        yield (
            f"codebook {bits}-bit",
            cf.gather(2, q.long().view(out, g, -1)).view(out, inn),
            lambda x, q=q, cf=cf: F.linear(x, cf.gather(2, q.long().view(out, 1, -1)).view(out, inn)),
            lambda x, p=packed, c=cents, b=bits: cpu_lut.codebook_matmul(x, p, c, b),
        )
    q, s, z = quantize(w, 4, 128)
    packed = pack_bits(q, 4)
    yield (
        "rtn 4-bit g128",
        dequantize(q, s, z, 4),
        lambda x: F.linear(x, dequantize(q, s, z, 4)),
        lambda x: cpu_lut.rtn_matmul(x, packed, s, z, 4),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 4, 8, 32, 64], help="tokens T routed to the expert"
    )
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    start = time.perf_counter()
    ok = cpu_lut.available()
    print(f"kernel available: {ok} (first call {time.perf_counter() - start:.1f} s, build or cache load)")
    print(
        "\n| expert | layout | T | dense fp32 µs | decode + linear µs | kernel µs | kernel vs dense | vs decode |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, (out, inn) in SHAPES.items():
        for name, dense, decode, kernel in cases(out, inn):
            for t in args.tokens:
                x = torch.randn(t, inn)
                torch.testing.assert_close(kernel(x), decode(x), rtol=1e-4, atol=1e-4)
                d = timed(lambda x=x, dense=dense: F.linear(x, dense), args.repeats)
                g = timed(lambda x=x, decode=decode: decode(x), args.repeats)
                k = timed(lambda x=x, kernel=kernel: kernel(x), args.repeats)
                print(
                    f"| {label} | {name} | {t} | {d:.0f} | {g:.0f} | {k:.0f} | {d / k:.2f}x | {g / k:.1f}x |"
                )


if __name__ == "__main__":
    main()
