"""A step by chunks of experts (issue 37): held-out KL to the base model of a step run on whole layers and on
layers held by chunks of a quarter of the experts (``expert_chunk: E/4``), for each of the step's variants:

- ``--step svd_experts`` (default): ``svd_experts {ratio: 0.4}`` with ``ranks: balanced`` (each chunk spends
  its share of the layer's total rank; before 2026-12-05 (fifth session) its own budget ⌊c·M_chunk⌋) and ``ranks: uniform`` (byte-identical);
- ``--step codequant``: ``codequant {bits: 4}`` with the default fine-tuning (each chunk fitted on its own
  experts' part of the block output), with ``finetune_steps: 0`` (k-means only, byte-identical) and, with
  ``--patience N``, with ``finetune_patience: N``;
- ``--step tdmoe``: ``tdmoe {ratio: 0.4}`` (HOSVD, input whitening): whole layers through tensorly's HOSVD of
  the stacked experts, chunks in two phases (the whitened mode Grams summed over the chunks, the factors
  fitted once, each chunk's cores projected).
- ``--step namex`` / ``merge_experts``: ``{ratio: 0.25}`` (``--merge-ratio``), namex with its default
  refinement and with ``refine_steps: 0``, merge_experts with ``router: remap`` and ``collapse``: by chunks
  the groups come from per-expert summaries gathered over the chunks and units of groups are merged.

Calibration, evaluation (the last 2 % of every corpus file held out) and expert bytes as in
``benchmarks/chain_quality.py`` (its ``expert_bytes``).

    OMP_NUM_THREADS=1 python benchmarks/svd_chunked.py [--step svd_experts|codequant|tdmoe|namex|merge_experts] [--shared /work/shared]
        [--models ref-qwen3moe ref-mixtral] [--samples 64] [--holdout 8] [--seq-len 256] [--eval-tokens 16384]
        [--json PATH] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chain_quality import expert_bytes

MODELS = ["ref-qwen3moe", "ref-mixtral"]


def digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(d).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _rank_totals(rep: dict) -> dict:
    return {"total_rank": {p: sum(sum(r for r in row["info"]["ranks"][p] if r is not None) for row in rep["layers"])
                           for p in ("gate", "up", "down")},
            "decomposed_fraction_removed": rep["summary"]["decomposed_fraction_removed"]}  # fmt: skip


def _codequant_errors(rep: dict) -> dict:
    per = rep["summary"]["per_layer"]
    mean = {k: sum(v.get(k) or 0.0 for v in per.values()) / max(len(per), 1)
            for k in ("val_error_kmeans", "val_error_final")}  # fmt: skip
    return {**{f"mean_{k}": v for k, v in mean.items()}, "best_steps": [v.get("best_step") for v in per.values()],
            "steps_run": [v.get("steps_run") for v in per.values()],
            "routed_bits_per_param": rep["summary"]["routed_bits_per_param"]}  # fmt: skip


def _tucker_errors(rep: dict) -> dict:
    s = rep["summary"]
    errs = [e for v in s["whitened_rel_error"].values() for e in v.values()]
    return {"ranks": s["ranks"], "mean_whitened_rel_error": sum(errs) / max(len(errs), 1),
            "routed_fraction_removed": s["routed_fraction_removed"]}  # fmt: skip


def _merge_errors(rep: dict) -> dict:
    s = rep["summary"]
    out = {"mean_rel_error_held": s["mean_rel_error_held"], "experts_after": s["experts_after"],
           "routed_fraction_removed": s["routed_fraction_removed"]}  # fmt: skip
    if "layers_refined" in s:
        out["layers_refined"] = s["layers_refined"]
    return out


# step -> (variant -> step config, the variant's key in the table, extra report columns)
STEPS = {
    "svd_experts": (
        lambda args: {r: {"svd_experts": {"ratio": args.ratio, "ranks": r}} for r in ("balanced", "uniform")},
        "ranks", _rank_totals,
    ),
    "codequant": (
        lambda args: {"finetune": {"codequant": {"bits": args.bits}},
                      "kmeans": {"codequant": {"bits": args.bits, "finetune_steps": 0}},
                      **({f"patience{args.patience}": {"codequant": {"bits": args.bits,
                                                                    "finetune_patience": args.patience}}}
                         if args.patience else {})},
        "variant", _codequant_errors,
    ),
    "tdmoe": (lambda args: {"hosvd": {"tdmoe": {"ratio": args.ratio}}}, "variant", _tucker_errors),
    "namex": (
        lambda args: {"refined": {"namex": {"ratio": args.merge_ratio}},
                      "unrefined": {"namex": {"ratio": args.merge_ratio, "refine_steps": 0}}},
        "variant", _merge_errors,
    ),
    "merge_experts": (
        lambda args: {"remap": {"merge_experts": {"ratio": args.merge_ratio}},
                      "collapse": {"merge_experts": {"ratio": args.merge_ratio, "router": "collapse"}}},
        "variant", _merge_errors,
    ),
}


def _cast(src: Path, dst: Path, dtype: str) -> Path:
    """``src`` saved to ``dst`` with its weights in ``dtype`` (transformers' own classes; the other files
    copied: tokenizer, generation config)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--step", choices=sorted(STEPS), default="svd_experts")
    ap.add_argument("--ratio", type=float, default=0.4, help="svd_experts, tdmoe: the ratio")
    ap.add_argument("--bits", type=int, default=4, help="codequant: the bits")
    ap.add_argument("--patience", type=int, default=None, help="codequant: also a variant with finetune_patience")
    ap.add_argument("--merge-ratio", type=float, default=0.25, help="namex, merge_experts: the ratio")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--holdout", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--json", help="also write all rows to this JSON file")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the reference models' weights cast to this dtype first (tdmoe by chunks works in float32 "
                         "for 16-bit weights)")  # fmt: skip
    args = ap.parse_args()

    from transformers.utils import logging as hf_logging

    import moecompress as mc
    from moecompress.io.checkpoint import open_checkpoint

    hf_logging.disable_progress_bar()
    data = Path(args.shared) / "data"
    corpus = sorted(str(p) for p in (data / "corpus").glob("*.txt"))
    work = Path(tempfile.mkdtemp(prefix=f"{args.step}-chunked-"))
    variants, key, extra = STEPS[args.step]
    ev = {"texts": corpus, "max_tokens": args.eval_tokens, "seq_len": args.seq_len}
    source = "file:" + ",".join(corpus)
    results: dict = {"args": vars(args), "models": {}}
    for name in args.models:
        model = data / "models" / name
        if args.dtype != "float32":
            model = _cast(model, work / f"{name}-{args.dtype}", args.dtype)
        ckpt = open_checkpoint(model)
        e = ckpt.read_layer_shell(ckpt.moe_layer_indices[0]).router.num_experts
        chunk = max(1, e // 4)
        cal = {"source": source, "samples": args.samples + args.holdout, "seq_len": args.seq_len, "seed": 0,
               "holdout": args.holdout, "batch_size": 8, "cache_dir": str(work / f"{name}-cache")}  # fmt: skip
        base = mc.load(model)
        res = {"experts": e, "chunk": chunk, "base_expert_bytes": expert_bytes(model), "rows": {}}
        for ranks, step in variants(args).items():
            for label, ec in (("whole", "off"), (f"chunk{chunk}", chunk)):
                out = work / f"{name}-{ranks}-{label}"
                steps = [step]
                t0 = time.perf_counter()
                mc.apply({"model": str(model), "output": str(out), "calibration": cal, "steps": steps,
                          "expert_chunk": ec}, progress=False, overwrite=True)  # fmt: skip
                wall = time.perf_counter() - t0
                rep = json.loads(next((out / "steps").glob("*/report.json")).read_text())
                t1 = time.perf_counter()
                ev_out = mc.evaluate(out, against=base, **ev)
                row = {key: ranks, "step": step, "expert_chunk": ec, "expert_bytes": expert_bytes(out),
                       "kl": ev_out["kl"], "perplexity": ev_out["perplexity"],
                       "base_perplexity": ev_out["base_perplexity"], "top1_agreement": ev_out["top1_agreement"],
                       "wall_s": wall, "eval_s": time.perf_counter() - t1, "sha256_16": digest(out),
                       **extra(rep)}  # fmt: skip
                res["rows"][f"{ranks}-{label}"] = row
                more = {k: v for k, v in row.items()
                        if k in ("total_rank", "mean_val_error_final", "best_steps", "steps_run", "mean_whitened_rel_error",
                                 "mean_rel_error_held", "layers_refined")}  # fmt: skip
                print(f"{name} {ranks} {label}: {row['expert_bytes']} B, KL {row['kl']:.5f}, ppl "
                      f"{row['perplexity']:.3f}, {more}, {wall:.1f} s + eval "
                      f"{row['eval_s']:.1f} s, sha {row['sha256_16']}", flush=True)  # fmt: skip
                shutil.rmtree(out, ignore_errors=True)
        results["models"][name] = res
        del base
    for name, res in results["models"].items():
        print(f"\n**{name}** ({res['experts']} experts, chunks of {res['chunk']}; base expert bytes "
              f"{res['base_expert_bytes']:,})\n")  # fmt: skip
        col = {"svd_experts": "total rank gate/up/down", "codequant": "mean val error (layer / chunk part)",
               "tdmoe": "mean whitened rel. error", "namex": "mean rel_error_held (layers refined)",
               "merge_experts": "mean rel_error_held"}[args.step]  # fmt: skip
        print(f"| {key} | layer held | expert bytes | {col} | KL to base | held-out ppl | top-1 agree | s | sha256[:16] |")
        print("|---|---|---:|---|---:|---:|---:|---:|---|")
        for r in res["rows"].values():
            if args.step == "svd_experts":
                tr = "/".join(str(r["total_rank"][p]) for p in ("gate", "up", "down"))
            elif args.step == "tdmoe":
                tr = f"{r['mean_whitened_rel_error']:.6f}"
            elif args.step in ("namex", "merge_experts"):
                tr = f"{r['mean_rel_error_held']:.6f}" + (f" ({r['layers_refined']})" if "layers_refined" in r else "")
            else:
                tr = f"{r['mean_val_error_final']:.4f}"
            held = "whole" if r["expert_chunk"] == "off" else f"chunks of {r['expert_chunk']}"
            print(f"| {r[key]} | {held} | {r['expert_bytes']:,} | {tr} | {r['kl']:.5f} | {r['perplexity']:.3f} | "
                  f"{r['top1_agreement']:.4f} | {r['wall_s']:.1f} | `{r['sha256_16']}` |")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
