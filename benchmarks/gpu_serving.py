#!/usr/bin/env python
"""End-to-end serving speed through transformers on a GPU, every layout against the original (issue 40
item 5; docs/serving.md, "The fastest way to serve a loaded model with transformers").

    python benchmarks/gpu_serving.py [--budget-s 150]   # H200: <= 4 min; benchmarks/results/gpu_serving.json
    python benchmarks/gpu_serving.py --only tdmoe svd rtn codebook --out B.json  # rows the budget left
    python benchmarks/gpu_serving.py --dry-run          # CPU, tiny shapes, well under a minute

- **Model**: a random Qwen3-30B-A3B-shaped model built on the device in bf16 (E 128, k 8, H 2048,
  I 768, 32 heads, 4 KV heads, head_dim 128) with ``--layers`` 8 decoder layers and a ``--vocab`` 32k
  vocabulary, so the MoE share of a step is realistic. Nothing is written to disk.
- **Layouts**: each decoder layer's experts replaced by a ``CompressedExperts`` holding the layout a pass
  writes at that budget, built by ``benchmarks/synthetic_serving.py``'s transforms (ragged 50%, namex
  remap 50%, tdmoe 40%, svd_experts 40% with the passes' ranks, rtn 4-bit g128, codebook 4-/2-bit),
  prepared once (``CompressedExperts.prepare``: the Triton kernels where one serves the layout).
  expert_prune is a stock model with fewer experts (transformers' own module) and is not re-measured.
- **Forms**: ``eager``; ``compiled``: every decoder layer ``torch.compile``d (``--compile layers``, one
  graph serves all layers of a model) or the whole forward (``--compile whole``), ``--mode default`` or
  ``reduce-overhead`` (CUDA graphs).
- **Measured**: prefill (one forward over ``[1, --prefill]`` tokens, last logits only: tokens/s);
  decode batch 1 and 16 (``generate`` with a static cache, ``--new`` greedy tokens after a 16-token
  prompt, ``min_new_tokens`` forcing the length: tokens/s counted over all sequences). Each layout and
  the original are measured interleaved in ``--repeats`` rounds (best of each); ratios are layout over
  original in the same rounds and form (> 1: faster). Wall time, synchronised.

The dry run measures every layout eager and compiles one (prefill and decode batch 1). Work is ordered by
priority (eager rows first, then compiled rows, layouts in the issue's order) and
stops starting compiled rows after ``--budget-s`` seconds (compiles dominate: a compiled row may run a
minute past it); rows not run and rows that failed are listed in the JSON with their reason — run the
layouts left out with ``--only`` (each run ≤ 4 minutes). ``OMP_NUM_THREADS=1`` for the CPU dry run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import types
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from moecompress.io.format import encode_bank  # noqa: E402
from moecompress.ir import ExpertBank  # noqa: E402
from moecompress.layouts.dense import Dense  # noqa: E402
from moecompress.layouts.lowrank import LowRank  # noqa: E402
from moecompress.methods.svd import rank_split  # noqa: E402
from moecompress.runtime.quantizer import CompressedExperts  # noqa: E402

FULL = dict(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
)
DRY = dict(  # H and I multiples of 128: rtn/codebook's g128 groups
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
)
OUT = ROOT / "benchmarks" / "results" / "gpu_serving.json"


def build_original(shape: dict, layers: int, dtype: torch.dtype, dev: torch.device):
    """A random Qwen3-MoE of ``shape`` built directly on ``dev`` (transformers' own initialisation)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **shape,
        num_hidden_layers=layers,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3MoeForCausalLM(cfg)
    return model.to(dtype).eval()


def lowrank_on(lay, ratio: float, g: torch.Generator) -> LowRank:
    """``synthetic_serving._lowrank`` with its factors drawn on the layout's device (the CPU would spend
    a minute drawing 8 layers of Qwen3-shaped factors)."""
    m, out, inn = lay.shape
    base, extra = rank_split(out, inn, m, ratio)
    w = lay.dense()
    f = {}
    for e in range(m):
        r = base + (e < extra)
        f[e] = (torch.randn(out, r, generator=g, device=w.device, dtype=w.dtype) / r**0.5,
                torch.randn(r, inn, generator=g, device=w.device, dtype=w.dtype) / inn**0.5)  # fmt: skip
    return LowRank.from_factors(f, {}, torch.empty(1, out, inn, dtype=w.dtype, device=w.device))


def layouts() -> dict:
    """Layout name -> transform of a layer (``synthetic_serving``'s, in the issue's order)."""
    import synthetic_serving as s

    def svd(layer):
        b = layer.experts
        g = torch.Generator(device=b.gate.dense().device).manual_seed(1000 + layer.index)
        return layer.replace(experts=ExpertBank(*(lowrank_on(lay, 0.4, g) for lay in (b.gate, b.up, b.down))))

    return {"ragged 50%": s.ragged, "namex remap 50%": s.namex_remap, "tdmoe 40%": s.tdmoe, "svd_experts 40%": svd,
            "rtn 4-bit g128": s.rtn4, "codebook 4-bit": s.codebook(4), "codebook 2-bit": s.codebook(2)}  # fmt: skip


class _Layer(types.SimpleNamespace):
    """The parts of ``MoELayer`` the transforms read: ``experts``, ``index`` and ``replace``."""

    def replace(self, **kw):
        return {"experts": self.experts, "expert_map": None, **kw}


def compress(model, transform, dtype: torch.dtype):
    """A copy of ``model`` (attention and embeddings copied, experts not) whose every decoder layer's
    experts are a prepared ``CompressedExperts`` holding ``transform``'s layout."""
    mods = [layer.mlp.experts for layer in model.model.layers]
    out = copy.deepcopy(model, memo={id(m): None for m in mods})
    hidden = model.config.hidden_size
    for i, (layer, orig) in enumerate(zip(out.model.layers, mods)):
        n = orig.intermediate_dim
        gu = orig.gate_up_proj.data
        bank = ExpertBank(Dense(gu[:, :n]), Dense(gu[:, n:]), Dense(orig.down_proj.data))
        parts = transform(_Layer(experts=bank, index=i))
        new = parts["experts"]
        lays = {p: getattr(new, p).to(gu.device) for p in ("gate", "up", "down")}
        lays = {p: lay.cast(dtype) if lay.kind in ("tucker", "lowrank") else lay for p, lay in lays.items()}
        stored: dict[str, torch.Tensor] = {}
        desc = encode_bank(ExpertBank(lays["gate"], lays["up"], lays["down"]), "x", stored)
        if parts["expert_map"] is not None:
            stored["x.expert_map"] = parts["expert_map"].to(gu.device, torch.int64)
            desc.update(expert_map=True, num_logical_experts=int(parts["expert_map"].numel()))
        module = CompressedExperts(desc, hidden, f"bench.{i}")
        module.load_state_dict({k[2:]: v.to(gu.device) for k, v in stored.items()}, assign=True)
        layer.mlp.experts = module.prepare(gu.device)
    return out


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def runners(model, args, dev: torch.device) -> dict:
    """Shape name -> ``(call, tokens)`` of the three measurements."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefill = torch.randint(3, vocab, (1, args.prefill), generator=g).to(dev)
    prompts = {b: torch.randint(3, vocab, (b, 16), generator=g).to(dev) for b in (1, 16)}
    # disable_compile: on CUDA transformers would compile the stock model itself; the forms decide here
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, cache_implementation="static",
              pad_token_id=0, disable_compile=True)  # fmt: skip

    def decode(b):
        return lambda: model.generate(prompts[b], **kw)

    return {
        "prefill": (lambda: model(prefill, logits_to_keep=1), prefill.numel()),
        "decode_b1": (decode(1), args.new),
        "decode_b16": (decode(16), 16 * args.new),
    }


def compiled(model, how: str, mode: str):
    """Compile ``model`` in place (``layers``: each decoder layer; ``whole``: the forward); returns undo."""
    if how == "whole":
        eager = model.forward
        model.forward = torch.compile(eager, mode=mode)
        return lambda: setattr(model, "forward", eager)
    for layer in model.model.layers:
        layer.compile(mode=mode)
    return lambda: [setattr(layer, "_compiled_call_impl", None) for layer in model.model.layers]


def measure(model, args, dev, form: str, warm: bool = True) -> dict:
    """Tokens/s of every shape for one model in one form (``warm``: one untimed call first, for the
    compiles, Triton JIT and CUDA-graph capture of the first round). A warm compiled prefill is compared
    with the eager one: ``logits_rel_err``, max |compiled - eager| / max |eager| of the last logits."""
    calls = runners(model, args, dev)
    res = {}
    with torch.no_grad():
        ref = calls["prefill"][0]().logits.float() if form == "compiled" and warm else None
        undo = compiled(model, args.compile, args.mode) if form == "compiled" else None
        try:
            for shape, (call, tokens) in calls.items():
                if form == "compiled" and shape not in args.compiled_shapes:
                    continue
                if warm:
                    out = call()
                    if ref is not None and shape == "prefill":
                        diff = (out.logits.float() - ref).abs().max() / ref.abs().max()
                        res["logits_rel_err"] = float(diff)
                sync(dev)
                t0 = time.perf_counter()
                call()
                sync(dev)
                res[shape] = tokens / (time.perf_counter() - t0)
        finally:
            if undo is not None:
                undo()
    return res


def bench(args) -> dict:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    t_start = time.perf_counter()
    shape = DRY if args.dry_run else FULL
    original = build_original(shape, args.layers, dtype, dev)
    torch._dynamo.config.cache_size_limit = 256  # every model and shape keeps its compiled graphs
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    todo = [
        (name, fn) for name, fn in layouts().items() if not args.only or any(o in name for o in args.only)
    ]
    models, skipped, failed = {}, [], {}
    for name, fn in todo:
        t0 = time.perf_counter()
        try:
            models[name] = compress(original, fn, dtype)
        except Exception as err:
            failed[f"{name}/build"] = f"{type(err).__name__}: {err}"[:300]
            continue
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    best: dict[str, dict] = {}
    forms = ["eager"] + ([] if args.no_compile else ["compiled"])
    for form in forms:
        for name, model in models.items():
            if form != "eager" and time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"{name}/{form}: budget of {args.budget_s:.0f} s spent")
                continue
            if form != "eager" and args.dry_run and name != next(iter(models)):
                skipped.append(f"{name}/{form}: the dry run compiles one layout")
                continue
            try:
                for r in range(args.repeats):  # interleaved with the original, best of each
                    for label, m in ((f"original@{name}", original), (name, model)):
                        key = f"{label}/{form}"
                        for what, v in measure(m, args, dev, form, warm=r == 0).items():
                            best.setdefault(key, {})[what] = max(best.get(key, {}).get(what, 0.0), v)
            except Exception as err:
                failed[f"{name}/{form}"] = f"{type(err).__name__}: {err}"[:300]
                continue
            row = best[f"{name}/{form}"]
            base = best[f"original@{name}/{form}"]
            ratios = {s: row[s] / base[s] for s in row if s in base and not s.startswith("logits")}
            best[f"{name}/{form}"] = {**row, **{f"ratio_{s}": r for s, r in ratios.items()}}
            print(f"{name}/{form}: " + ", ".join(f"{s} {row[s]:.0f} tok/s ({r:.2f}x)" for s, r in ratios.items()),
                  flush=True)  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "layers": args.layers, "shape": shape,
        "prefill_tokens": args.prefill, "new_tokens": args.new, "repeats": args.repeats, "compile": args.compile,
        "mode": args.mode, "budget_s": args.budget_s, "dry_run": args.dry_run, "seconds": time.perf_counter() - t_start,
        "rows": best, "skipped": skipped, "failed": failed,
    }  # fmt: skip


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (CI)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (8; dry run 2)")
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens (2048; dry run 32)")
    p.add_argument("--new", type=int, default=None, help="decoded tokens per sequence (32; dry run 4)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds, best of (3; dry run 1)")
    p.add_argument("--compile", choices=("layers", "whole"), default="layers")
    p.add_argument(
        "--mode",
        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
        default=None,
        help="torch.compile mode (reduce-overhead on CUDA: CUDA graphs; default on CPU)",
    )
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--only", nargs="*", help="layouts whose name contains one of these")
    p.add_argument("--budget-s", type=float, default=150.0, help="no compiled row starts after this")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    dry = args.dry_run
    for name, full, tiny in (("layers", 8, 2), ("prefill", 2048, 32), ("new", 32, 4), ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if dry else full)
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    args.compiled_shapes = ("prefill", "decode_b1") if dry else ("prefill", "decode_b1", "decode_b16")
    if args.mode is None:
        args.mode = "reduce-overhead" if torch.cuda.is_available() and not dry else "default"
    return args


def main(argv=None) -> int:
    args = parse(argv)
    result = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s; {len(result['failed'])} failed, "
          f"{len(result['skipped'])} skipped)")  # fmt: skip
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
