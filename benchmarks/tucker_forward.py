"""CPU forward time and stored bytes of a Tucker-factorised MoE layer (TD-MoE) vs the dense layer.

    python benchmarks/tucker_forward.py                      # Qwen3-30B-A3B layer shapes, 512 tokens
    python benchmarks/tucker_forward.py --tokens 2048 --ratios 0.2 0.4 0.6

One MoE layer with Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of width 768, top-8; random fp32
weights and router) runs through the reference forward (:func:`moecompress.reference.moe_forward`,
the CPU path of the moecompress quantizer) dense and in the :class:`~moecompress.layouts.tucker.Tucker`
layout with the ranks ``tdmoe`` allocates for each ratio (``tucker_ranks``: expert mode kept, the
per-expert cores folded). Timing does not depend on the factor values, so the factors are random
with the right shapes (decomposing a 30B layer is not what is measured here). Prints the median of
``--repeats`` runs after a warm-up, the stored bytes of the routed experts, and the ratios to dense.
"""

from __future__ import annotations

import argparse

import torch
from ragged_forward import layer_args, timed  # this folder's sibling script

from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.layouts.tucker import Tucker
from moecompress.methods.tucker import tucker_ranks


def tucker_layout(e: int, out: int, inp: int, ratio: float, gen: torch.Generator) -> Tucker:
    _, r2, r3, _ = tucker_ranks(e, out, inp, ratio)
    return Tucker(
        torch.randn(out, r2, generator=gen) * r2**-0.5, torch.randn(inp, r3, generator=gen) * inp**-0.5,
        torch.randn(e, r2, r3, generator=gen) * r3**-0.5, torch.arange(e),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_args(ap, [0.4, 0.6])
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    e, i, h = args.experts, args.width, args.hidden
    spec = RouterSpec(num_experts=e, top_k=args.top_k, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    router = torch.randn(e, h, generator=gen) * h**-0.5
    x = torch.randn(args.tokens, h, generator=gen)
    dense = ExpertBank(
        Dense(torch.randn(e, i, h, generator=gen) * h**-0.5), Dense(torch.randn(e, i, h, generator=gen) * h**-0.5),
        Dense(torch.randn(e, h, i, generator=gen) * i**-0.5),
    )  # fmt: skip
    rows = [("dense", None, dense)]
    for r in args.ratios:
        bank = ExpertBank(
            tucker_layout(e, i, h, r, gen), tucker_layout(e, i, h, r, gen), tucker_layout(e, h, i, r, gen)
        )
        rows.append((f"tucker {r:g}", r, bank))
    print(
        f"\nMoE layer: hidden {h}, {e} experts x {i}, top-{args.top_k}, {args.tokens} tokens, fp32, "
        f"{torch.get_num_threads()} threads; median of {args.repeats} runs\n"
    )
    print(
        "| variant | ranks gate/up (r2, r3) | ranks down | stored expert bytes | bytes vs dense | forward ms | time vs dense |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    base_t = base_b = None
    for name, r, bank in rows:
        t = timed(MoELayer(0, spec, router, bank), x, args.repeats)
        b = bank.nbytes()
        base_t, base_b = base_t or t, base_b or b
        gu = "—" if r is None else str(bank.gate.ranks[1:])
        dn = "—" if r is None else str(bank.down.ranks[1:])
        print(
            f"| {name} | {gu} | {dn} | {b / 1e9:.3f} GB | {b / base_b:.2f} | {t * 1e3:.1f} | {t / base_t:.2f} |"
        )


if __name__ == "__main__":
    main()
