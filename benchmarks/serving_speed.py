"""Serving speed of loaded compressed models against the original, through transformers, one thread.

    python benchmarks/serving_speed.py --reference [--shared ../shared]      # ref-qwen3moe, real passes
    python benchmarks/serving_speed.py --synthetic [--experts 128 --layers 2] # Qwen3-30B-shaped layers

Each variant is loaded with ``moecompress.load`` (the lean CPU path of ``CompressedExperts``; the
original is transformers' own module) and timed the way users run a model:

- **prefill**: forward passes over windows of ``--window`` tokens (tokens/s);
- **decode**: ``generate`` with a KV cache, batch 1, ``--new`` greedy tokens after a 16-token prompt
  (tokens/s, ``min_new_tokens`` forces the length);
- **MoE share**: the time spent inside the experts modules during prefill and decode (forward hooks),
  so the speed-up of the layer itself is visible apart from attention and the LM head.

Times are the main thread's CPU time (``time.thread_time``; torch runs one thread, so every kernel runs
in it): on a shared machine wall time also counts the time other processes hold the core. Variants and
the original are measured interleaved, best of ``--repeats``; ratios are compressed over original
tokens/s measured in the same rounds (``> 1`` = faster). ``--reference`` compresses ref-qwen3moe with the
real passes (small calibration: speed does not depend on it). ``--synthetic`` writes a random
Qwen3-30B-A3B-shaped checkpoint (E 128, k 8, H 2048, I 768; ``--layers`` decoder layers, vocabulary
``--vocab``) and builds each layout directly with ``rewrite_checkpoint`` (random contents of the right
shapes and ranks: the passes' own cost at these shapes is the real-scale issue's benchmark); the
codebook variants reuse RTN's codes with each group's grid as its centroids (a valid per-row codebook).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import moecompress as mc

REFERENCE = {
    "heapr 50% (ragged)": {"heapr": {"ratio": 0.5}},
    "expert_prune 50%": {"expert_prune": {"ratio": 0.5, "method": "reap"}},
    "namex 50% (remap)": {"namex": {"ratio": 0.5, "router": "remap"}},
    "tdmoe 40%": {"tdmoe": {"ratio": 0.4}},
    "svd_experts 40%": {"svd_experts": {"ratio": 0.4}},
    "codequant 4-bit": {"codequant": {"bits": 4}},
    "codequant 2-bit": {"codequant": {"bits": 2}},
    "rtn 4-bit g32": {"rtn": {"bits": 4, "group_size": 32}},
}


class MoETimer:
    """Sums the wall time spent inside every experts module of ``model`` (forward hooks)."""

    def __init__(self, model) -> None:
        self.seconds, self._t0, self._handles = 0.0, 0.0, []
        for name, mod in model.named_modules():
            if name.endswith(".experts"):
                self._handles.append(mod.register_forward_pre_hook(self._start))
                self._handles.append(mod.register_forward_hook(self._stop))

    def _start(self, *_):
        self._t0 = time.thread_time()

    def _stop(self, *_):
        self.seconds += time.thread_time() - self._t0

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def measure(model, windows: torch.Tensor, prompt: torch.Tensor, new: int) -> dict:
    """One prefill pass over ``windows`` and one greedy decode of ``new`` tokens."""
    timer = MoETimer(model)
    try:
        with torch.no_grad():
            t0 = time.thread_time()
            for w in windows:
                model(w[None])
            prefill_s = time.thread_time() - t0
            moe_prefill, timer.seconds = timer.seconds, 0.0
            t0 = time.thread_time()
            model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)
            decode_s = time.thread_time() - t0
    finally:
        timer.close()
    return {
        "prefill_tok_s": windows.numel() / prefill_s, "decode_tok_s": new / decode_s,
        "moe_prefill_s": moe_prefill, "moe_decode_s": timer.seconds,
    }  # fmt: skip


def keep_best(best: dict[str, dict], name: str, m: dict) -> None:
    """Fold one measurement ``m`` of ``name`` into ``best`` (highest tokens/s, lowest seconds)."""
    b = best.setdefault(name, dict(m))
    for k, v in m.items():
        b[k] = max(b[k], v) if k.endswith("tok_s") else min(b[k], v)


def bench(models: dict, windows, prompt, new: int, repeats: int) -> dict:
    """Best of ``repeats`` per variant, the variants interleaved in every round."""
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for name, model in models.items():
            keep_best(best, name, measure(model, windows, prompt, new))
    return best


def table(best: dict, base: str = "original") -> str:
    """Markdown rows; a variant ``name`` is compared with ``original@name`` when that exists (the
    original measured in the variant's own rounds), else with ``base``."""
    lines = [
        "| variant | prefill tok/s | ratio | decode tok/s | ratio | MoE prefill s | MoE ratio | MoE decode s | MoE ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, b in best.items():
        if name.startswith(f"{base}@"):
            continue
        o = best.get(f"{base}@{name}", best[base])
        lines.append(
            f"| {name} | {b['prefill_tok_s']:.0f} | {b['prefill_tok_s'] / o['prefill_tok_s']:.2f} | "
            f"{b['decode_tok_s']:.1f} | {b['decode_tok_s'] / o['decode_tok_s']:.2f} | {b['moe_prefill_s']:.3f} | "
            f"{o['moe_prefill_s'] / b['moe_prefill_s']:.2f} | {b['moe_decode_s']:.3f} | "
            f"{o['moe_decode_s'] / b['moe_decode_s']:.2f} |"
        )
    return "\n".join(lines)


def _tokens(shared: Path, model_dir: Path, n: int) -> torch.Tensor:
    """``n`` held-out tokens (the last 2 % of each corpus file) in ``model_dir``'s tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids: list[int] = []
    for f in sorted((shared / "data" / "corpus").glob("*.txt")):
        text = f.read_text(errors="replace")
        ids += tok(text[int(len(text) * 0.98) :])["input_ids"]
        if len(ids) >= n:
            break
    return torch.tensor(ids[:n])


def reference(args, work: Path) -> dict:
    shared = Path(args.shared)
    model = shared / "data" / "models" / args.model
    corpus = sorted(str(p) for p in (shared / "data" / "corpus").glob("*.txt"))
    cal = {"source": "file:" + ",".join(corpus), "samples": 16, "seq_len": 128, "cache_dir": str(work / "cache")}
    models = {"original": mc.load(model)}
    for name, step in REFERENCE.items():
        out = work / name.split()[0] / name.replace(" ", "_").replace("%", "").replace("(", "").replace(")", "")
        if not out.is_dir():  # a kept --work dir is reused
            t0 = time.perf_counter()
            mc.apply({"model": str(model), "output": str(out), "calibration": cal, "steps": [step]}, progress=False)
            print(f"{name}: compressed in {time.perf_counter() - t0:.1f} s", flush=True)
        models[name] = mc.load(out)
        if args.dequantize and ("codequant" in name or "rtn" in name):
            models[f"{name}, dequantize={args.dequantize}"] = mc.load(out, dequantize=args.dequantize)
    toks = _tokens(shared, model, args.window * args.windows + 16)
    windows = toks[: args.window * args.windows].view(args.windows, args.window)
    return bench(models, windows, toks[-16:][None], args.new, args.repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", action="store_true", help="ref-qwen3moe compressed by the real passes")
    ap.add_argument("--synthetic", action="store_true", help="Qwen3-30B-A3B-shaped random layers")
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("--model", default="ref-qwen3moe")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--new", type=int, default=32, help="decoded tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--only", nargs="+", help="synthetic: only the variants whose name contains one of these")
    ap.add_argument("--dequantize", default=None, help="also time quantised variants loaded with dequantize=")
    ap.add_argument("--work", help="work dir (default: a temp dir, deleted at the end)")
    ap.add_argument("--json", help="write the results to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="serve-bench-"))
    results = {}
    try:
        if args.reference:
            results["reference"] = reference(args, work)
            print(f"\n{args.model}, {args.windows}x{args.window}-token prefill, decode {args.new} tokens, 1 thread\n")
            print(table(results["reference"]))
        if args.synthetic:
            from synthetic_serving import synthetic

            results["synthetic"] = synthetic(args, work)
            print(f"\nQwen3-30B-A3B-shaped, {args.layers} layers, {args.windows}x{args.window}-token prefill, "
                  f"decode {args.new} tokens, 1 thread\n")  # fmt: skip
            print(table(results["synthetic"]))
    finally:
        if not args.work:
            with contextlib.suppress(OSError):
                shutil.rmtree(work)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
