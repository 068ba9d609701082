"""The ``--synthetic`` part of ``serving_speed.py``: Qwen3-30B-A3B-shaped layers, each layout built directly.

A random Qwen3-MoE checkpoint with the real expert shapes (E 128, k 8, H 2048, I 768, 32 heads, 4 KV
heads, head_dim 128) and ``--layers`` decoder layers is written once; every variant is a
``moecompress.rewrite_checkpoint`` of it whose transform builds the layout a pass would write, with
the ranks and widths the passes choose at that budget (``methods.tucker.tucker_ranks``,
``methods.svd.rank_split``) and random contents — speed does not depend on the values:

- ragged 50 %: per-expert live widths drawn uniformly from [I/4, 3I/4] (mean I/2, like HEAPr's global
  ranking), the first ``w`` neurons kept;
- expert_prune 50 %: the first E/2 experts and their router rows (a stock checkpoint);
- namex remap 50 %: E/2 physical experts, logical pairs mapped onto one (``expert_map``);
- tdmoe 40 %, svd_experts 40 %: Tucker / low-rank factors of the passes' ranks;
- rtn 4-bit g128: ``RTN.from_dense`` of the weights; codebook 4-/2-bit: RTN's codes with each group's
  grid ``(c − z)·s`` as its centroids (a valid per-row codebook).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import moecompress as mc
from moecompress.ir import ExpertBank
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.dense import Dense
from moecompress.layouts.lowrank import LowRank
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.rtn import RTN
from moecompress.layouts.tucker import Tucker
from moecompress.methods.svd import rank_split
from moecompress.methods.tucker import tucker_ranks


def _base(path: Path, layers: int, experts: int, vocab: int) -> Path:
    if (path / "config.json").is_file():
        return path
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=experts, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    return path


def _gen(layer) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + layer.index)


def ragged(layer):
    b = layer.experts
    n, width = b.num_experts, b.width
    widths = torch.randint(width // 4, 3 * width // 4 + 1, (n,), generator=_gen(layer))
    keep = [torch.arange(int(w)) for w in widths]
    g, u, d = (lay.dense() for lay in (b.gate, b.up, b.down))
    return layer.replace(experts=ExpertBank(
        Ragged.from_dense(g, keep, "out"), Ragged.from_dense(u, keep, "out"), Ragged.from_dense(d, keep, "in")
    ))  # fmt: skip


def expert_prune(layer):
    b, k = layer.experts, layer.experts.num_experts // 2
    new = ExpertBank(*(Dense(lay.dense()[:k].clone()) for lay in (b.gate, b.up, b.down)))
    router = layer.router.__class__(**{**layer.router.__dict__, "num_experts": k})
    return layer.replace(experts=new, router=router, router_weight=layer.router_weight[:k].clone())


def namex_remap(layer):
    b = layer.experts
    n = b.num_experts
    new = ExpertBank(*(Dense(lay.dense()[0::2].clone()) for lay in (b.gate, b.up, b.down)))
    return layer.replace(experts=new, expert_map=torch.arange(n) // 2)


def _tucker(lay, ratio: float, g: torch.Generator) -> Tucker:
    m, out, inn = lay.shape
    _, r2, r3, _ = tucker_ranks(m, out, inn, ratio)
    return Tucker(
        torch.randn(out, r2, generator=g) / r2**0.5, torch.randn(inn, r3, generator=g) / r3**0.5,
        torch.randn(m, r2, r3, generator=g) / r3**0.5, torch.arange(m),
    )  # fmt: skip


def tdmoe(layer):
    b, g = layer.experts, _gen(layer)
    return layer.replace(experts=ExpertBank(_tucker(b.gate, 0.4, g), _tucker(b.up, 0.4, g), _tucker(b.down, 0.4, g)))


def _lowrank(lay, ratio: float, g: torch.Generator) -> LowRank:
    m, out, inn = lay.shape
    base, extra = rank_split(out, inn, m, ratio)
    ranks = [base + (e < extra) for e in range(m)]
    f = {e: (torch.randn(out, r, generator=g) / r**0.5, torch.randn(r, inn, generator=g) / inn**0.5)
         for e, r in enumerate(ranks)}  # fmt: skip
    return LowRank.from_factors(f, {}, torch.empty(1, out, inn))


def svd_experts(layer):
    b, g = layer.experts, _gen(layer)
    return layer.replace(
        experts=ExpertBank(_lowrank(b.gate, 0.4, g), _lowrank(b.up, 0.4, g), _lowrank(b.down, 0.4, g))
    )


def _rtn(lay, bits: int) -> RTN:
    return RTN.from_dense(lay.dense(), bits, 128)


def rtn4(layer):
    b = layer.experts
    return layer.replace(experts=ExpertBank(_rtn(b.gate, 4), _rtn(b.up, 4), _rtn(b.down, 4)))


def _codebook(lay, bits: int) -> Codebook:
    r = _rtn(lay, bits)
    grid = torch.arange(1 << bits, dtype=torch.float32)
    cents = (grid - r.zeros.float()[..., None]) * r.scales.float()[..., None]  # [M, out, G, K]
    return Codebook(r.codes, cents.half(), r.members, r.dense_experts, bits, r.in_features, r.logical_dtype)


def codebook(bits: int):
    def fn(layer):
        b = layer.experts
        return layer.replace(experts=ExpertBank(_codebook(b.gate, bits), _codebook(b.up, bits), _codebook(b.down, bits)))

    return fn


VARIANTS = {
    "ragged 50% (heapr-like)": ragged, "expert_prune 50%": expert_prune, "namex 50% (remap)": namex_remap,
    "tdmoe 40%": tdmoe, "svd_experts 40%": svd_experts, "codebook 4-bit": codebook(4),
    "codebook 2-bit": codebook(2), "rtn 4-bit g128": rtn4,
}  # fmt: skip


def synthetic(args, work: Path) -> dict:
    from serving_speed import keep_best, measure

    base = _base(work / "base", args.layers, args.experts, args.vocab)
    original = mc.load(base)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, args.vocab, (args.windows, args.window), generator=g)
    prompt = torch.randint(0, args.vocab, (1, 16), generator=g)
    best: dict[str, dict] = {}
    for name, fn in VARIANTS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        out = work / "".join(c if c.isalnum() else "_" for c in name)
        if not (out / "config.json").is_file():
            t0 = time.perf_counter()
            mc.rewrite_checkpoint(base, out, fn, progress=False)
            print(f"{name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        runs = {name: {}}
        if args.dequantize and ("codebook" in name or "rtn" in name):
            runs[f"{name}, dequantize={args.dequantize}"] = {"dequantize": args.dequantize}
        for label, kw in runs.items():
            model = mc.load(out, **kw)
            for _ in range(args.repeats):  # interleaved with the original, best of each
                o = measure(original, windows, prompt, args.new)
                keep_best(best, "original", o)
                keep_best(best, f"original@{label}", o)
                keep_best(best, label, measure(model, windows, prompt, args.new))
            print(f"  {label}: {best[label]}", flush=True)
            del model
    return best
