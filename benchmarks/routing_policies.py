"""Routing policies on the reference models: held-out perplexity and KL to the base against the
straggler ratio (capacity-aware token drop) and against the distinct experts per decode batch (SERE),
next to the papers' baselines, on each base model and its HEAPr-50 % output; and CPU decode speed.

    python benchmarks/routing_policies.py [--shared ../shared] [--models ref-qwen3moe ref-mixtral ref-deepseekv3]
        [--eval-tokens 16384] [--samples 64] [--work DIR] [--json PATH] [--speed] [--no-quality]

Per model and variant (``base``, ``heapr50``: one ``heapr: {ratio: 0.5}`` step), one ``sere`` step stores
the expert similarity (frobenius, 512 calibration tokens); every row then sets its knobs on that loaded
checkpoint with :func:`moecompress.set_routing` and runs :func:`moecompress.evaluate` against the base
model on the held-out split (last 2 %) of every corpus file, windows of 256 tokens:

- capacity rows, evaluation batches of 4 windows (T = 1024 tokens per forward): no drop (gamma = inf),
  token drop with strategies score / random / first and expanded drop, gamma in {1.0, 1.5, 2.0}; the
  straggler ratio is max / mean expert load per forward (mean over layers and forwards) and "dropped"
  the fraction of (token, slot) pairs dropped;
- SERE rows, evaluation batches of B windows with ``simulate_decode`` (each position of the batch is one
  decode batch of B tokens; equal to teacher-forced decoding, ``docs/routing.md``): plain top-k, SERE
  with S in {1, 2} and rho in {0, 0.1, 0.3} (frobenius similarity; cosine and CKA at rho = 0 as the
  paper's ablation), and the baselines top-S routing (``top_k`` policy) and random re-routing (SERE's
  rule with a random similarity, rho = 0); "experts/batch" is the distinct
  experts run per decode batch (mean over layers and batches).

``--speed`` times greedy decoding (``generate``, batch 16, 16 prompt + 32 new tokens, KV cache, best
of 3, interleaved) with and without SERE, for transformers' ``eager`` and ``grouped_mm`` experts, on the
reference models and on a larger synthetic Qwen3-MoE (hidden 1024, 64 experts of width 512, top-8).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import moecompress as mc
from moecompress.runtime.routing import policies

MODELS = ["ref-qwen3moe", "ref-mixtral", "ref-deepseekv3"]
GAMMAS = [1.0, 1.5, 2.0]
BATCHES = [8, 16, 32]


def counts(model) -> dict[str, float]:
    """Sum of every layer's recorded counts; straggler ratios and experts/batch as means over layers."""
    mods = list(policies(model).values())
    tot: dict[str, float] = {}
    for m in mods:
        for k, v in m.counts.items():
            tot[k] = tot.get(k, 0.0) + float(v)
    out = {
        "dropped": tot.get("dropped", 0.0) / max(tot.get("slots", 0.0), 1.0),
        "rerouted": tot.get("rerouted_slots", 0.0) / max(tot.get("slots", 0.0), 1.0),
    }
    if tot.get("prefills"):
        out["straggler_before"] = tot["straggler_before"] / tot["prefills"]
        out["straggler_after"] = tot["straggler_after"] / tot["prefills"]
    if tot.get("batches"):
        out["experts_per_batch"] = tot["executed"] / tot["batches"]
        out["selected_per_batch"] = tot["selected"] / tot["batches"]
    return out


def scored(model, base, ev: dict, policy, batch: int) -> dict:
    mc.set_routing(model, "off")
    if policy:
        mc.set_routing(model, policy)
    for m in policies(model).values():
        m.record = True
        m.reset_counts()
    r = mc.evaluate(model, against=base, batch_size=batch, **ev)
    return {"perplexity": r["perplexity"], "kl": r["kl"], **counts(model)}


def capacity_rows(model, base, ev) -> list[dict]:
    rows = [{"policy": "no drop", "gamma": math.inf, **scored(model, base, ev, {"capacity_drop": {"gamma": math.inf}}, 4)}]
    for gamma in GAMMAS:
        for strategy in ("score", "random", "first"):
            p = {"capacity_drop": {"gamma": gamma, "strategy": strategy}}
            rows.append({"policy": f"drop-{strategy}", "gamma": gamma, **scored(model, base, ev, p, 4)})
        p = {"capacity_drop": {"gamma": gamma, "expanded": True}}
        rows.append({"policy": "expanded", "gamma": gamma, **scored(model, base, ev, p, 4)})
    return rows


def use_similarity(model, sims: dict[int, torch.Tensor]) -> None:
    for i, m in policies(model).items():
        m.similarity.copy_(sims[i])


def sere_rows(model, base, ev, top_k: int, others: dict[str, dict[int, torch.Tensor]]) -> list[dict]:
    """``others``: the similarity of each other kind (cosine, cka), by layer, for the ablation rows."""
    rows = []
    plain = {"sere": {"select_top": top_k, "threshold": 2.0, "simulate_decode": True}}  # counts only
    sims = {i: m.stored_similarity.clone() for i, m in policies(model).items()}
    for b in BATCHES:
        rows.append({"policy": f"top-{top_k} (original)", "batch": b, **scored(model, base, ev, plain, b)})
        for s in (1, 2):
            for rho in (0.0, 0.1, 0.3):
                p = {"sere": {"select_top": s, "threshold": rho, "simulate_decode": True}}
                rows.append({"policy": f"sere S={s} rho={rho}", "batch": b, **scored(model, base, ev, p, b)})
            p = {"top_k": {"k": s}, "sere": {"select_top": top_k, "threshold": 2.0, "simulate_decode": True}}
            rows.append({"policy": f"top-{s} routing", "batch": b, **scored(model, base, ev, p, b)})
            g = torch.Generator().manual_seed(b * 10 + s)
            for i, m in policies(model).items():  # SERE's rule with a random target: random re-routing
                r = torch.rand(sims[i].shape, generator=g)
                r = (r + r.T) / 2
                r.fill_diagonal_(1.0)
                m.similarity.copy_(r)
            p = {"sere": {"select_top": s, "threshold": 0.0, "simulate_decode": True}}
            rows.append({"policy": f"random re-route S={s}", "batch": b, **scored(model, base, ev, p, b)})
            for kind, other in others.items():
                use_similarity(model, other)
                p = {"sere": {"select_top": s, "threshold": 0.0, "simulate_decode": True}}
                rows.append({"policy": f"sere S={s} rho=0.0 {kind}", "batch": b, **scored(model, base, ev, p, b)})
            use_similarity(model, sims)
    return rows


def apply(model: Path, out: Path, cal: dict, steps: list) -> Path:
    if not out.exists():
        mc.apply({"model": str(model), "output": str(out), "calibration": cal, "steps": steps}, progress=False)
    return out


def decode_speed(path: Path, rounds: int = 3) -> list[dict]:
    prompts = torch.randint(0, 100, (16, 16), generator=torch.Generator().manual_seed(0))
    rows = []
    for impl in ("eager", "grouped_mm"):
        model = mc.load(path)
        model.set_experts_implementation(impl)
        top_k = model.config.num_experts_per_tok
        runs = {"off": None,
                "top-k": {"sere": {"select_top": top_k, "threshold": 2.0}},
                "sere S=1 rho=0.1": {"sere": {"select_top": 1, "threshold": 0.1}},
                "sere S=2 rho=0.1": {"sere": {"select_top": 2, "threshold": 0.1}},
                "sere S=1, all re-routed": {"sere": {"select_top": 1, "threshold": -2.0}},
                "sere S=2, all re-routed": {"sere": {"select_top": 2, "threshold": -2.0}}}  # fmt: skip
        best = {k: float("inf") for k in runs}
        experts = {}
        for _ in range(rounds):
            for name, p in runs.items():
                mc.set_routing(model, "off")
                if p is not None:
                    mc.set_routing(model, {"capacity_drop": None, **p})
                for m in policies(model).values():
                    m.record = True
                    m.reset_counts()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(prompts, max_new_tokens=32, min_new_tokens=32, do_sample=False)
                best[name] = min(best[name], time.perf_counter() - t0)
                experts[name] = counts(model).get("experts_per_batch")
        for name in runs:
            rows.append({"impl": impl, "policy": name, "tokens_per_s": 16 * 32 / best[name],
                         "experts_per_batch": experts[name]})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--work", help="work dir (default: a temp dir, deleted at the end)")
    ap.add_argument("--json", help="also write every row to this JSON file")
    ap.add_argument("--speed", action="store_true", help="time CPU decoding with and without SERE")
    ap.add_argument("--no-quality", action="store_true", help="skip the perplexity tables")
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    if not args.speed:
        torch.set_num_threads(1)  # quality only: one thread is as fast on these tiny models, and shares the cores
    data = Path(args.shared) / "data"
    corpus = sorted(str(p) for p in (data / "corpus").glob("*.txt"))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="routing-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ev = {"texts": corpus, "max_tokens": args.eval_tokens, "seq_len": 256}
    results: dict = {"quality": [], "speed": []}
    for name in args.models:
        model = data / "models" / name
        cal = {"source": "file:" + ",".join(corpus), "samples": args.samples, "seq_len": 256, "batch_size": 8,
               "cache_dir": str(work / "cache")}  # fmt: skip
        base = mc.load(model)
        top_k = base.config.num_experts_per_tok
        variants = {"base": model, "heapr50": apply(model, work / f"{name}-heapr50", cal, [{"heapr": {"ratio": 0.5}}])}
        for variant, path in variants.items():
            sere_dir = apply(path, work / f"{name}-{variant}-sere", cal,
                             [{"sere": {"select_top": 1, "threshold": 0.0, "similarity": "frobenius"}}])  # fmt: skip
            others = {}
            for kind in ("cosine", "cka"):
                d = apply(path, work / f"{name}-{variant}-sere-{kind}", cal, [{"sere": {"similarity": kind}}])
                others[kind] = {i: m.stored_similarity.clone() for i, m in policies(mc.load(d)).items()}
            if args.speed and variant == "base":
                for row in decode_speed(sere_dir):
                    results["speed"].append({"model": name, **row})
                    print(json.dumps(results["speed"][-1]), flush=True)
            if args.no_quality:
                continue
            loaded = mc.load(sere_dir, routing="off")
            t0 = time.perf_counter()
            for kind, rows in (("capacity", capacity_rows(loaded, base, ev)), ("sere", sere_rows(loaded, base, ev, top_k, others))):
                for row in rows:
                    results["quality"].append({"model": name, "variant": variant, "kind": kind, **row})
                    print(json.dumps(results["quality"][-1]), flush=True)
            print(f"{name} {variant}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.speed:
        results["speed"] += synthetic_speed(work)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print_tables(results)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def synthetic_speed(work: Path) -> list[dict]:
    from moecompress.testing import save_tiny

    src = work / "synthetic-qwen3"
    if not src.exists():
        save_tiny("qwen3_moe", src, hidden_size=1024, moe_intermediate_size=512, num_experts=64,
                  num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=128, vocab_size=1024)  # fmt: skip
    cal = {"source": "random", "samples": 8, "seq_len": 128, "batch_size": 4, "cache_dir": str(work / "cache")}
    sere_dir = apply(src, work / "synthetic-qwen3-sere", cal, [{"sere": {"select_top": 1, "threshold": 0.0}}])
    rows = [{"model": "synthetic qwen3 (h1024, 64x512, top-8)", **r} for r in decode_speed(sere_dir)]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def print_tables(results: dict) -> None:
    q = results["quality"]
    if q:
        print("\n| model | variant | policy | gamma | ppl | KL | straggler before -> after | dropped |")
        print("|---|---|---|---|---|---|---|---|")
        for r in (r for r in q if r["kind"] == "capacity"):
            print(f"| {r['model']} | {r['variant']} | {r['policy']} | {r['gamma']} | {r['perplexity']:.2f} | "
                  f"{r['kl']:.4f} | {r.get('straggler_before', 0):.2f} -> {r.get('straggler_after', 0):.2f} | "
                  f"{100 * r['dropped']:.1f}% |")  # fmt: skip
        print("\n| model | variant | B | policy | ppl | KL | experts/batch | re-routed |")
        print("|---|---|---|---|---|---|---|---|")
        for r in (r for r in q if r["kind"] == "sere"):
            print(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['policy']} | {r['perplexity']:.2f} | "
                  f"{r['kl']:.4f} | {r.get('experts_per_batch', float('nan')):.2f} | {100 * r['rerouted']:.1f}% |")  # fmt: skip
    if results["speed"]:
        print("\n| model | experts impl | policy | decode tokens/s (B=16) | experts/batch |")
        print("|---|---|---|---|---|")
        for r in results["speed"]:
            print(f"| {r['model']} | {r['impl']} | {r['policy']} | {r['tokens_per_s']:.1f} | {r['experts_per_batch'] or 0:.2f} |")


if __name__ == "__main__":
    main()
