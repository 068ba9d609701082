"""CPU forward time of a neuron-pruned (ragged) MoE layer vs the unpruned one.

    python benchmarks/ragged_forward.py                     # Qwen3-30B-A3B layer shapes, 512 tokens
    python benchmarks/ragged_forward.py --tokens 2048 --ratios 0.25 0.5 --dtype bfloat16
    python benchmarks/ragged_forward.py --device cuda        # the same reference code on a GPU

One MoE layer with Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of width 768, top-8; random
weights and router) runs through the reference forward (:func:`moecompress.reference.moe_forward`, the
CPU path of the moecompress quantizer) as:

- ``dense``: unpruned;
- ``ragged r``: ``r`` of the neurons removed with unequal per-expert widths (drawn around ``1 - r``
  like a HEAPr global ranking produces them, summing exactly to the budget), stored in the
  :class:`~moecompress.layouts.Ragged` layout;
- ``uniform r``: every expert at width ``(1 - r)·768`` in the dense layout (the stock-checkpoint variant).

Prints the median of ``--repeats`` timed runs after one warm-up, the stored bytes, and the time
relative to dense. Routing is the same in every variant (the router is untouched by pruning).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.reference import moe_forward


def layer_with(bank: ExpertBank, router: torch.Tensor, top_k: int) -> MoELayer:
    spec = RouterSpec(num_experts=bank.num_experts, top_k=top_k, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(index=0, router=spec, router_weight=router, experts=bank)


def ragged_widths(e: int, width: int, ratio: float, gen: torch.Generator) -> torch.Tensor:
    """Unequal widths with exactly ``round((1 - ratio) * e * width)`` neurons kept."""
    frac = (1 - ratio) * (1 + 0.5 * (torch.rand(e, generator=gen) * 2 - 1))
    w = (frac * width).round().clamp(0, width).long()
    target = round((1 - ratio) * e * width)
    while int(w.sum()) != target:  # nudge random experts until the budget is exact
        i = int(torch.randint(e, (1,), generator=gen))
        step = 1 if int(w.sum()) < target else -1
        if 0 <= int(w[i]) + step <= width:
            w[i] += step
    return w


def timed(layer: MoELayer, x: torch.Tensor, repeats: int) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    with torch.no_grad():
        moe_forward(layer, x)
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            moe_forward(layer, x)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer_args(ap: argparse.ArgumentParser, ratios: list[float]) -> None:
    """The layer-shape options shared with ``tucker_forward.py`` (Qwen3-30B-A3B defaults)."""
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--ratios", type=float, nargs="+", default=ratios)
    ap.add_argument("--repeats", type=int, default=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_args(ap, [0.25, 0.5])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    e, i, h = args.experts, args.width, args.hidden
    scale = h**-0.5
    dev = torch.device(args.device)
    gate, up = (torch.randn(e, i, h, generator=gen).mul_(scale).to(dev, dtype) for _ in range(2))
    down = torch.randn(e, h, i, generator=gen).mul_(i**-0.5).to(dev, dtype)
    router = torch.randn(e, h, generator=gen).mul_(scale).to(dev, dtype)
    x = torch.randn(args.tokens, h, generator=gen).to(dev, dtype)
    dense = ExpertBank(Dense(gate), Dense(up), Dense(down))
    rows = [("dense", 0.0, dense)]
    for r in args.ratios:
        w = ragged_widths(e, i, r, gen)
        keep = [torch.arange(int(n), device=dev) for n in w]
        ragged = ExpertBank(
            Ragged.from_dense(gate, keep, "out"),
            Ragged.from_dense(up, keep, "out"),
            Ragged.from_dense(down, keep, "in"),
        )
        k = round((1 - r) * i)
        uniform = ExpertBank(
            Dense(gate[:, :k].clone()), Dense(up[:, :k].clone()), Dense(down[:, :, :k].clone())
        )
        rows += [(f"ragged {r:g}", r, ragged), (f"uniform {r:g}", r, uniform)]
    print(
        f"\nMoE layer: hidden {h}, {e} experts x {i}, top-{args.top_k}, {args.tokens} tokens, {args.dtype}, "
        f"{args.device} ({torch.get_num_threads()} CPU threads); median of {args.repeats} runs\n"
    )
    print("| variant | neurons removed | stored expert bytes | forward ms | time vs dense |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for name, r, bank in rows:
        t = timed(layer_with(bank, router, args.top_k), x, args.repeats)
        base = base or t
        print(f"| {name} | {r:.0%} | {bank.nbytes() / 1e9:.3f} GB | {t * 1e3:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
