"""How much of the perplexity lost by compression a ``distill`` / ``lora_heal`` stage recovers, per
method, at equal steps and tokens (issue 16).

    python benchmarks/distill_recovery.py [--shared ../shared] [--model ref-qwen3moe]
        [--compress heapr|tdmoe|namex] [--ratio 0.5] [--methods kd hidden_mse sft residual ...]
        [--steps 60] [--batch 4] [--seq-len 128] [--lr auto|1e-3] [--lr-probe-steps 0]
        [--samples N] [--set KEY=VALUE ...] [--label TEXT] [--threads 1] [--work DIR] [--json PATH]
        [--jsonl PATH]

The model is compressed once (``heapr``: global, ragged; ``tdmoe``: Tucker, input whitening;
``namex``: expert merging) at ``--ratio``, then each method trains the compressed model against the
original with the same seed, steps, batch and sequence length (``trainable: compressed``: what the
layout stores, unless the method says otherwise; the ``lora-*`` methods are ``lora_heal`` steps), on
the corpus files' training split (by default ``steps × batch`` distinct sequences: one epoch, no
repetition). ``--lr auto`` (the default) lets every method choose its lr from the stage's default
``lr_grid`` by probe runs scored on the stage's own 8 held-back calibration sequences (never the
evaluation text); the probes' CPU seconds are reported beside the training's. Perplexity is
measured by ``mc.evaluate`` on the held-out split (last 2 % of every corpus file, 16,384 tokens in
windows of 256), which training never reads and nothing is tuned on. "recovered" is
``(ppl_pruned - ppl_distilled) / (ppl_pruned - ppl_base)``; the same on out-of-domain text
(``benchmarks/ood_text.py``: license texts the corpus does not hold, never trained on) is
``ood_recovered`` (issue 38). ``--set`` overrides a stage setting for every method (ablations).
Times are the stage's wall and thread CPU seconds (the machine is shared: wall time is noisy).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import yaml
from ood_text import ood_windows, score
from transformers.utils import logging as hf_logging

import moecompress as mc
from moecompress.errors import PassError

ROUTED = {"lora_heal": True, "method": "kd", "target": "attention_routed", "lora_rank": 8}
METHODS = {
    "kd": {"method": "kd"},
    "hidden_mse": {"method": "hidden_mse"},
    "sft": {"method": "sft"},
    "residual": {"method": "residual"},
    "residual-nobeta": {"method": "residual", "beta": False},
    "residual-nomask": {"method": "residual", "mask": False},
    "residual-nopretrain": {"method": "residual", "pretrain_projector": False},
    "residual-mean": {"method": "residual", "fusion": "mean"},
    "residual-paper": {"method": "residual", "beta": True},  # METHODS.md §6's β (the default before issue 38)
    "residual-paper-nodims": {"method": "residual", "beta": True, "beta_dims": False},
    "residual-init-teacher": {"method": "residual", "beta": True, "projector_init": "teacher"},
    "kd-router": {"method": "kd", "trainable": "router"},
    "kd-all": {"method": "kd", "trainable": "all"},
    "kd-lora": {"method": "kd", "trainable": "lora", "lora_rank": 8},
    "lora-experts": {"lora_heal": True, "method": "kd", "target": "experts", "lora_rank": 8},
    "lora-attn-routed": {"lora_heal": True, "method": "kd", "target": "attention_routed", "lora_rank": 8},
    "lora-attn-routed-nobal": {**ROUTED, "lora_balance": 0.0},
    "lora-attn-plain": {"lora_heal": True, "method": "kd", "target": "attention", "lora_rank": 8},
    "hmse-attn-routed": {"lora_heal": True, "method": "hidden_mse", "target": "attention_routed", "lora_rank": 8},
    "kd-tr-nr": {"method": "kd", "token_rounding": {"tile": 128, "mode": "nr"}},
    "kd-tr-up": {"method": "kd", "token_rounding": {"tile": 128, "mode": "up"}},
    "kd-tr-down": {"method": "kd", "token_rounding": {"tile": 128, "mode": "down"}},
}

COMPRESS = {
    "heapr": lambda r: {"heapr": {"ratio": r, "scope": "global"}},
    "tdmoe": lambda r: {"tdmoe": {"ratio": r}},
    "namex": lambda r: {"namex": {"ratio": r}},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("--model", default="ref-qwen3moe")
    ap.add_argument("--compress", default="heapr", choices=list(COMPRESS))
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--methods", nargs="+", default=["kd", "hidden_mse", "sft", "residual"], choices=list(METHODS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--samples", type=int, default=None,
                    help="training sequences + holdout (8); default steps × batch + 8: no sequence is seen twice")
    ap.add_argument("--lr", default="auto", help="auto (chosen per method from lr_grid) or a number")
    ap.add_argument("--lr-grid", type=float, nargs="+", help="lr auto: the candidates (default: the stage's)")
    ap.add_argument("--lr-probe-steps", type=int, default=0, help="lr auto: steps per candidate (0: steps // 4)")
    ap.add_argument("--seed", type=int, default=0, help="the stage's seed (batches, LoRA and projector init)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="override the stage's settings for every method (YAML values), e.g. lambda_res=0.9")
    ap.add_argument("--label", default="", help="appended to each row's method name (ablations)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared)")
    ap.add_argument("--work", help="work dir (default: a temp dir, deleted at the end)")
    ap.add_argument("--json", help="also write all rows to this JSON file")
    ap.add_argument("--jsonl", help="append each row to this file as it is measured")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    data = Path(args.shared) / "data"
    corpus = sorted(str(p) for p in (data / "corpus").glob("*.txt"))
    model = data / "models" / args.model
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="distill-bench-"))
    source = "file:" + ",".join(corpus)
    cal = {"source": source, "samples": 64, "seq_len": 256, "batch_size": 8, "cache_dir": str(work / "cache")}
    ev = {"texts": corpus, "max_tokens": 16384, "seq_len": 256}
    pruned = work / f"{args.compress}-{args.ratio:g}"
    if not (pruned / "config.json").is_file():
        mc.apply({"model": str(model), "output": str(pruned), "calibration": cal,
                  "steps": [COMPRESS[args.compress](args.ratio)]}, progress=False)  # fmt: skip
    base = mc.load(model)
    ppl_base = mc.evaluate(model, **ev)["perplexity"]
    ppl_pruned = mc.evaluate(pruned, against=base, **ev)["perplexity"]
    windows, ood_sha = ood_windows(model / "tokenizer.json")
    ood_base = score(base, windows)["perplexity"]
    ood_pruned = score(pruned, windows, against=base)["perplexity"]
    print(f"{args.model}: base {ppl_base:.2f}, {args.compress} {args.ratio:g} {ppl_pruned:.2f}; "
          f"out of domain {ood_base:.2f} -> {ood_pruned:.2f}", flush=True)  # fmt: skip
    overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    lr = args.lr if args.lr == "auto" else float(args.lr)
    rows = []
    for label in args.methods:
        out = work / f"distill-{label}"
        step = {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "samples": args.samples or args.steps * args.batch + 8,
                "holdout": 8, "lr": lr, "lr_probe_steps": args.lr_probe_steps, "teacher": str(model), "data": source,
                "seed": args.seed, "projector_steps": max(1, args.steps // 3), **METHODS[label]}  # fmt: skip
        step.update(overrides)
        if args.lr_grid:
            step["lr_grid"] = args.lr_grid
        name = "lora_heal" if step.pop("lora_heal", False) else "distill"
        t0 = time.perf_counter()
        try:
            mc.apply({"model": str(pruned), "output": str(out), "calibration": cal, "steps": [{name: step}]},
                     overwrite=True, progress=False)  # fmt: skip
        except PassError as err:  # e.g. lora on Tucker experts: refused by the dry run
            row = {"method": label, "refused": str(err).splitlines()[0], "model": args.model, "compress": args.compress}
            print(json.dumps(row), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
            continue
        wall = time.perf_counter() - t0
        s = json.loads((out / "steps" / f"01-{name}" / "report.json").read_text())["summary"]
        e = mc.evaluate(out, against=base, **ev)
        lost = ppl_pruned - ppl_base
        o = score(out, windows, against=base)
        ood_lost = ood_pruned - ood_base
        row = {"method": label + args.label, "set": overrides, "ood_ppl": o["perplexity"], "ood_kl": o["kl"],
               "ood_recovered": (ood_pruned - o["perplexity"]) / ood_lost if ood_lost > 0 else None,
               "ood_ppl_base": ood_base, "ood_ppl_pruned": ood_pruned, "ood_sha256": ood_sha, "ppl": e["perplexity"], "kl": e["kl"], "top1": e["top1_agreement"],
               "recovered": (ppl_pruned - e["perplexity"]) / lost if lost > 0 else None,
               "train_heldout_before": s["heldout_loss_before"], "train_heldout_after": s["heldout_loss_after"],
               "tokens": s["train_tokens"], "tokens_per_s": s["tokens_per_second"], "train_s": s["train_seconds"],
               "train_cpu_s": s["train_cpu_seconds"], "wall_s": wall, "peak_mb": s["peak_memory_mb"],
               "trainable_params": s["trainable_params"], "lr": s["lr"], "loss_first": s["loss_first"],
               "loss_last": s["loss_last"], "loss_last10": sum(s["loss_curve"][-10:]) / max(1, len(s["loss_curve"][-10:])),
               "balance_first": s.get("balance_first"), "balance_last": s.get("balance_last"),
               "lr_search_cpu_s": round(sum(r["cpu_seconds"] for r in s["lr_search"]), 1),
               "lr_search": s["lr_search"], "model": args.model, "compress": args.compress, "ratio": args.ratio,
               "ppl_base": ppl_base, "ppl_pruned": ppl_pruned, "seed": args.seed}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
        shutil.rmtree(out, ignore_errors=True)
    result = {"model": args.model, "compress": args.compress, "ratio": args.ratio, "ppl_base": ppl_base, "ppl_pruned": ppl_pruned,
              "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "rows": rows}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print("| method | params | lr | ppl | KL | top-1 | recovered | OOD ppl | OOD recovered | train tokens | "
          "train CPU s | lr-search CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['trainable_params']:,} | {r['lr']:g} | {r['ppl']:.2f} | {r['kl']:.4f} | "
              f"{r['top1']:.3f} | {100 * r['recovered']:.1f}% | {r['ood_ppl']:.2f} | {100 * r['ood_recovered']:.1f}% | "
              f"{r['tokens']:,} | {r['train_cpu_s']:.1f} | {r['lr_search_cpu_s']:.1f} |")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
