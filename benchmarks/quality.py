"""Compression quality on the reference models: perplexity, KL and top-1 agreement against the base
model for each method at each parameter budget (pruning by default; decomposition with ``--methods``).

    python benchmarks/quality.py --methods tdmoe-input tdmoe-output tdmoe-none svd-input --ratios 0.2 0.4 0.6
    python benchmarks/quality.py --methods codequant-learned codequant-none rtn-g128 --bits 4 3 2 --sample-tokens 2048
    python benchmarks/quality.py [--shared ../shared] [--models ref-qwen3moe ref-mixtral ref-deepseekv3]
        [--ratios 0.25 0.5] [--methods heapr-global heapr-layer expert-frequency expert-reap expert-random
        neuron-magnitude neuron-wanda] [--samples 64] [--cal-source SRC] [--seq-len 256] [--batch-size 8]
        [--eval-tokens 16384] [--work DIR] [--json PATH]

Quantisation methods (``QUANT``) take their parameter from ``--bits`` instead of ``--ratios``; their
rows report the stored bytes per routed-expert parameter (``summary.routed_bytes_per_param``).
For each model, ratio and method (``METHODS``: one recipe step, the ratio filled in) ``mc.apply`` runs
the step and ``mc.evaluate`` compares the result with the base model on the held-out split (last 2 %)
of every corpus file, as in RESULTS.md's reference evaluation. Every run of a model shares one
calibration config (the corpus files' training split) and one ``cache_dir`` under ``--work``, so
statistics are computed once per model and statistics set. Methods whose pass is not registered
(``moecompress.passes.BUILTIN_PASSES``) are skipped with a note; output checkpoints are deleted
after evaluation. "Removed" fractions come from the step report: routed-expert parameters from the
pass's ``summary.routed_fraction_removed``, whole-model from ``model_params_before/after``. "wall s" is the whole ``mc.apply`` (calibration
included unless cached; "cal s" is that part), evaluation excluded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import moecompress as mc
from moecompress.passes import BUILTIN_PASSES

MODELS = ["ref-qwen3moe", "ref-mixtral", "ref-deepseekv3"]
METHODS = {
    "heapr-global": lambda r: {"heapr": {"ratio": r, "scope": "global"}},
    "heapr-layer": lambda r: {"heapr": {"ratio": r, "scope": "layer"}},
    "expert-frequency": lambda r: {"expert_prune": {"ratio": r, "method": "frequency"}},
    "expert-reap": lambda r: {"expert_prune": {"ratio": r, "method": "reap"}},
    "expert-random": lambda r: {"expert_prune": {"ratio": r, "method": "random"}},
    "neuron-magnitude": lambda r: {"neuron_prune": {"ratio": r, "method": "magnitude"}},
    "neuron-wanda": lambda r: {"neuron_prune": {"ratio": r, "method": "wanda"}},
    "tdmoe-input": lambda r: {"tdmoe": {"ratio": r, "whitening": "input"}},
    "tdmoe-output": lambda r: {"tdmoe": {"ratio": r, "whitening": "output"}},
    "tdmoe-none": lambda r: {"tdmoe": {"ratio": r, "whitening": "none"}},
    "tdmoe-adaptive": lambda r: {"tdmoe": {"ratio": r, "whitening": "input", "budget": "adaptive"}},
    "tdmoe-structure": lambda r: {"tdmoe": {"ratio": r, "whitening": "input", "budget": "from_structure"}},
    "decompose-auto": lambda r: {"decompose": {"method": "auto", "ratio": r}},
    **{
        f"decompose-svd-at{i}": (lambda r, i=i: {"decompose": {"ratio": r, "override": {i: "svd_experts"}}})
        for i in range(4)
    },
    **{
        f"decompose-td-at{i}": (lambda r, i=i: {"decompose": {"ratio": r, "override": {i: "tdmoe"}}})
        for i in range(4)
    },
    "svd-input": lambda r: {"svd_experts": {"ratio": r, "whitening": "input"}},
    "svd-output": lambda r: {"svd_experts": {"ratio": r, "whitening": "output"}},
    "svd-none": lambda r: {"svd_experts": {"ratio": r, "whitening": "none"}},
    "namex-remap": lambda r: {"namex": {"ratio": r, "router": "remap"}},  # refines (refine_steps: 10)
    "namex-collapse": lambda r: {"namex": {"ratio": r, "router": "collapse"}},
    "namex-remap-norefine": lambda r: {"namex": {"ratio": r, "router": "remap", "refine_steps": 0}},
    "namex-collapse-norefine": lambda r: {"namex": {"ratio": r, "router": "collapse", "refine_steps": 0}},
    "namex-hcsmoe": lambda r: {
        "namex": {"ratio": r, "similarity": "output", "linkage": "average"}
    },  # before #19
    "namex-noalign": lambda r: {"namex": {"ratio": r, "router": "remap", "align": False}},
    "namex-gamma0": lambda r: {
        "namex": {"ratio": r, "router": "remap", "gamma_grid": [0.0], "refine_steps": 0}
    },
    "namex-gamma1": lambda r: {
        "namex": {"ratio": r, "router": "remap", "gamma_grid": [1.0], "refine_steps": 0}
    },
    "namex-router-sim": lambda r: {"namex": {"ratio": r, "router": "remap", "similarity": "router"}},
    "namex-auto": lambda r: {"namex": {"target_experts": "auto", "router": "remap"}},
    "merge-frequency-auto": lambda r: {"merge_experts": {"target_experts": "auto", "method": "frequency"}},
    "namex-output-tokens": lambda r: {
        "namex": {"ratio": r, "router": "remap", "similarity": "output_tokens"}
    },
    "namex-output-tokens-euclid": lambda r: {
        "namex": {"ratio": r, "router": "remap", "similarity": "output_tokens", "metric": "euclidean"}
    },
    "namex-ward": lambda r: {"namex": {"ratio": r, "similarity": "output_tokens", "linkage": "ward"}},
    "merge-frequency-ward": lambda r: {
        "merge_experts": {"ratio": r, "similarity": "output_tokens", "linkage": "ward"}
    },
    "namex-router-ward": lambda r: {"namex": {"ratio": r, "similarity": "router", "linkage": "ward"}},
    "merge-frequency-router": lambda r: {
        "merge_experts": {"ratio": r, "method": "frequency", "similarity": "router"}
    },
    "merge-hcsmoe": lambda r: {
        "merge_experts": {"ratio": r, "method": "frequency", "similarity": "output", "linkage": "average"}
    },  # the default before issue 19
    "merge-average": lambda r: {"merge_experts": {"ratio": r, "method": "average", "router": "remap"}},
    "merge-frequency": lambda r: {"merge_experts": {"ratio": r, "method": "frequency", "router": "remap"}},
}
CHOSEN = "@choose_groups"  # replaced by the summary's target_experts of a choose_groups run (resolve_chosen)
RR = {"router_robustness": {"epsilons": [0.0, 0.05, 0.1]}}
RR0 = {"router_robustness": {"epsilons": [0.0]}}
METHODS.update(
    {  # issue 19: analysis stages that change a later step (a list = a multi-step recipe)
        "heapr-hubs2": lambda r: [
            {"attribute_routing": {"protect": 2}},
            {"heapr": {"ratio": r, "scope": "global"}},
        ],
        "heapr-hubs4": lambda r: [
            {"attribute_routing": {"protect": 4}},
            {"heapr": {"ratio": r, "scope": "global"}},
        ],
        "heapr-hubs8": lambda r: [
            {"attribute_routing": {"protect": 8}},
            {"heapr": {"ratio": r, "scope": "global"}},
        ],
        "heapr-hubs8-mean": lambda r: [
            {"attribute_routing": {"protect": 8, "hub_score": "mean"}},
            {"heapr": {"ratio": r, "scope": "global"}},
        ],
        "heapr-hubs4-mean": lambda r: [
            {"attribute_routing": {"protect": 4, "hub_score": "mean"}},
            {"heapr": {"ratio": r, "scope": "global"}},
        ],
        "rr-heapr": lambda r: [RR, {"heapr": {"ratio": r, "scope": "global"}}, RR],
        "rr-reap": lambda r: [RR, {"expert_prune": {"ratio": r, "method": "reap"}}, RR],
        "rr-namex": lambda r: [RR, {"namex": {"ratio": r, "router": "remap"}}, RR],
        "rr-decompose": lambda r: [RR, {"decompose": {"method": "auto", "ratio": r}}, RR],
        **{
            f"namex-k{k}": (lambda r, k=k: {"namex": {"target_experts": k, "router": "remap"}})
            for k in range(2, 8)
        },
        **{
            f"merge-k{k}": (lambda r, k=k: {"merge_experts": {"target_experts": k, "method": "frequency"}})
            for k in range(2, 8)
        },
        # budgeted auto: choose_groups spends the budget over layers, its summary's counts go to the merge step
        "namex-budget": lambda r: [{"choose_groups": {"ratio": r}}, {"namex": {"target_experts": CHOSEN}}],
        "namex-budget-merged": lambda r: [
            {"choose_groups": {"ratio": r, "curve": "merged"}},
            {"namex": {"target_experts": CHOSEN}},
        ],
        "namex-budget-rel": lambda r: [
            {"choose_groups": {"ratio": r, "scale": "relative"}},
            {"namex": {"target_experts": CHOSEN}},
        ],
        "namex-budget-abs": lambda r: [
            {"choose_groups": {"ratio": r, "scale": "absolute"}},
            {"namex": {"target_experts": CHOSEN}},
        ],
        "merge-budget": lambda r: [
            {"choose_groups": {"ratio": r}},
            {"merge_experts": {"target_experts": CHOSEN}},
        ],
        # the same budget in one step: the merge's own plan spends it (expert_out_gram statistics)
        "namex-budget1": lambda r: {"namex": {"target_experts": {"ratio": r}}},
        "merge-budget1": lambda r: {"merge_experts": {"target_experts": {"ratio": r}}},
        # routing drift inside the recipe (run with --propagate compressed): router_robustness's drift columns
        "rrd-namex": lambda r: [RR0, {"namex": {"ratio": r, "router": "remap"}}, RR0],
        "rrd-reap": lambda r: [RR0, {"expert_prune": {"ratio": r, "method": "reap"}}, RR0],
    }
)
QUANT = {  # one parameter: bits
    "codequant-learned": lambda b: {"codequant": {"bits": b, "rotation": "learned"}},
    "codequant-hadamard": lambda b: {"codequant": {"bits": b, "rotation": "hadamard"}},
    "codequant-none": lambda b: {"codequant": {"bits": b, "rotation": "none"}},
    "codequant-noft": lambda b: {"codequant": {"bits": b, "rotation": "learned", "finetune_steps": 0}},
    "codequant-learned-a4": lambda b: {"codequant": {"bits": b, "rotation": "learned", "eval_act_bits": 4}},
    "codequant-hadamard-a4": lambda b: {"codequant": {"bits": b, "rotation": "hadamard", "eval_act_bits": 4}},
    "codequant-none-a4": lambda b: {"codequant": {"bits": b, "rotation": "none", "eval_act_bits": 4}},
    "rtn-g64": lambda b: {"rtn": {"bits": b, "group_size": 64}},
    "rtn-g128": lambda b: {"rtn": {"bits": b, "group_size": 128}},
    "rtn-g32": lambda b: {"rtn": {"bits": b, "group_size": 32}},
    "gptq-auto": lambda b: {"gptq": {"bits": b, "group_size": "auto", "symmetric": False}},
    "gptq-g128": lambda b: {"gptq": {"bits": b, "group_size": 128, "symmetric": False}},
    "gptq-g64": lambda b: {"gptq": {"bits": b, "group_size": 64, "symmetric": False}},
    "gptq-g64-ao": lambda b: {"gptq": {"bits": b, "group_size": 64, "symmetric": False, "act_order": True}},
    "gptq-g32": lambda b: {"gptq": {"bits": b, "group_size": 32, "symmetric": False}},
}
METHODS.update(QUANT)
REPORT_ONLY = {"analyze", "expert_structure", "choose_groups", "router_robustness", "routing_report"}
PRUNING = ["heapr-global", "heapr-layer", "expert-frequency", "expert-reap", "expert-random", "neuron-magnitude",
           "neuron-wanda"]  # fmt: skip


def removed(step: dict) -> tuple[float, float]:
    """(routed-expert fraction removed, from the pass's summary; whole-model fraction removed, from the
    step report's ``model_params_before/after``)."""
    whole = 1 - step["model_params_after"] / step["model_params_before"]
    return float(step["summary"].get("routed_fraction_removed", 0.0)), whole


def resolve_chosen(model: Path, out: Path, cal: dict, steps: list[dict]) -> list[dict]:
    """Steps after a ``choose_groups`` step whose ``target_experts`` is ``CHOSEN`` get the per-layer counts
    that step reports (a report-only run of the steps up to it); the ``choose_groups`` step stays."""
    for n, st in enumerate(steps):
        ((name, cfg),) = st.items()
        if cfg.get("target_experts") != CHOSEN:
            continue
        j = max(i for i in range(n) if "choose_groups" in steps[i])
        res = mc.apply({"model": str(model), "output": str(out), "calibration": cal, "steps": steps[: j + 1]},
                       progress=False, overwrite=True)  # fmt: skip
        rep = next(
            p
            for p in sorted((out / "steps").glob("*/report.json"))
            if p.parent.name.endswith("choose_groups")
        )
        chosen = json.loads(rep.read_text())["summary"]["target_experts"]
        del res
        shutil.rmtree(out, ignore_errors=True)
        steps = [*steps[:n], {name: {**cfg, "target_experts": chosen}}, *steps[n + 1 :]]
    return steps


def routing_drift(model: Path, out: Path, cal: dict, report: dict) -> dict:
    """Per MoE layer: the compressed model's routing on its own (propagated) inputs against the base's routing
    on the base's inputs, same calibration tokens (``router_sample`` of both checkpoints, calibrated with the
    same settings), top-k Jaccard and router KL; pruned routers are matched by the step's ``kept_experts``."""
    from moecompress.calibration.cache import load_layer
    from moecompress.methods.robustness import logit_stability

    rr = [{"router_robustness": {"epsilons": [0.0]}}]
    cal = {**cal, "propagate": "original"}  # each checkpoint's routing on its own inputs
    entries = [mc.calibrate({"model": str(m), "output": str(out.with_name(out.name + "-drift")), "calibration": cal,
                             "steps": rr}, progress=False) for m in (model, out)]  # fmt: skip
    top_k = json.loads((model / "config.json").read_text())["num_experts_per_tok"]
    kept = {r["layer"]: r["info"].get("kept_experts") for r in report.get("layers", [])}
    rows = {}
    for i in sorted(kept):
        b, c = (load_layer(e, i)["router_sample"].float() for e in entries)
        mapping = torch.tensor(kept[i]) if kept[i] is not None and c.shape[1] < b.shape[1] else None
        rows[str(i)] = logit_stability(b, c, top_k, mapping)
    n = max(len(rows), 1)
    return {"jaccard": sum(r["jaccard"] for r in rows.values()) / n, "kl": sum(r["kl"] for r in rows.values()) / n,
            "per_layer": rows}  # fmt: skip


DRIFT = False  # --drift: also measure routing_drift for every row


def run_one(model: Path, out: Path, cal: dict, step: dict, ev: dict, base) -> dict:
    t0 = time.perf_counter()
    try:
        steps = resolve_chosen(model, out, cal, step if isinstance(step, list) else [step])
        res = mc.apply({"model": str(model), "output": str(out), "calibration": cal, "steps": steps},
                       progress=False)  # fmt: skip
        wall = time.perf_counter() - t0
        reports = {
            p.parent.name: json.loads(p.read_text()) for p in sorted((out / "steps").glob("*/report.json"))
        }
        last = next(k for k in reversed(reports) if k.split("-", 1)[1] not in REPORT_ONLY)
        report = reports[last]
        e = mc.evaluate(out, against=base, **ev)
        drift = routing_drift(model, out, cal, report) if DRIFT else None
    finally:
        for d in (out, out.with_name(f".{out.name}.partial")):
            shutil.rmtree(d, ignore_errors=True)
    routed, whole = removed(report)
    c = res.report.get("calibration") or {}
    return {
        "perplexity": e["perplexity"], "base_perplexity": e["base_perplexity"], "kl": e["kl"],
        "top1_agreement": e["top1_agreement"], "routed_fraction_removed": routed,
        "whole_model_fraction_removed": whole, "wall_s": wall,
        "calibration_s": c.get("seconds"), "calibration_cached": c.get("cached"),
        "backward": c.get("backward"), "summary": report.get("summary"), "warnings": report.get("warnings"),
        "step_summaries": {k: r.get("summary") for k, r in reports.items()} if len(reports) > 1 else None,
        "drift": drift,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.25, 0.5])
    ap.add_argument("--bits", nargs="+", type=int, default=[4, 3, 2], help="grid of the quantisation methods")
    ap.add_argument("--methods", nargs="+", default=PRUNING, choices=list(METHODS))
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument(
        "--cal-source", default=None, help="calibration source (default: the corpus files' training split); "
        "e.g. builtin, to calibrate on text unlike the evaluation text"
    )  # fmt: skip
    ap.add_argument("--seq-len", type=int, default=256, help="calibration and evaluation window")
    ap.add_argument(
        "--sample-tokens", type=int, default=512, help="calibration.sample_tokens (io_sample size)"
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--work", help="work dir (default: a temp dir, deleted at the end)")
    ap.add_argument("--json", help="also write all rows to this JSON file")
    ap.add_argument("--drift", action="store_true", help="also measure the routing drift (routing_drift)")
    ap.add_argument(
        "--propagate",
        default="original",
        choices=["original", "compressed"],
        help="calibration.propagate of the compression runs (--drift always calibrates with original)",
    )
    args = ap.parse_args()
    global DRIFT
    DRIFT = args.drift
    hf_logging.disable_progress_bar()  # "Loading weights" bars of every mc.load / evaluate
    data = Path(args.shared) / "data"
    corpus = sorted(str(p) for p in (data / "corpus").glob("*.txt"))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="pq-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ev = {"texts": corpus, "max_tokens": args.eval_tokens, "seq_len": args.seq_len}
    have = set(BUILTIN_PASSES)
    methods = []
    for label in args.methods:
        first = METHODS[label](4 if label in QUANT else 0.5)
        name = next(iter(first[-1] if isinstance(first, list) else first))
        if name in have:
            methods.append(label)
        else:
            print(f"note: skipping {label}: pass {name!r} is not registered")
    rows, base_ppl = [], {}
    for name in args.models:
        model = data / "models" / name
        cal = {"source": args.cal_source or "file:" + ",".join(corpus), "samples": args.samples, "seq_len": args.seq_len,
               "batch_size": args.batch_size, "cache_dir": str(work / "cache"),
               "sample_tokens": args.sample_tokens, "propagate": args.propagate}  # fmt: skip
        t0 = time.perf_counter()
        base_ppl[name] = mc.evaluate(model, **ev)["perplexity"]
        print(f"{name}: base perplexity {base_ppl[name]:.2f} ({time.perf_counter() - t0:.1f} s)", flush=True)
        base = mc.load(model)  # `against` of every evaluation, loaded once
        grid = [(r, label) for r in args.ratios for label in methods if label not in QUANT]
        grid += [(b, label) for b in args.bits for label in methods if label in QUANT]
        for r, label in grid:
            step = METHODS[label](r)
            try:
                row = run_one(model, work / f"{name}-{label}-{r:g}", cal, step, ev, base)
            except Exception as err:  # a pass under development must not stop the grid
                print(f"note: {name} {label} ratio {r:g} failed: {type(err).__name__}: {err}", flush=True)
                row = {"error": str(err)}
            rows.append({"model": name, "ratio": r, "method": label, "step": step, **row})
            if "error" not in row:
                print(f"  {label} {r:g}: ppl {row['perplexity']:.2f}, {row['wall_s']:.1f} s", flush=True)
    print("\n| model | base perplexity |\n|---|---:|")
    for name, p in base_ppl.items():
        print(f"| {name} | {p:.2f} |")
    print(
        "\n| model | ratio | method | perplexity | KL to base | top-1 agreement | routed-expert params removed"
        " | whole-model params removed | routed bytes/param | wall s | cal s |"
        "\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for x in sorted(rows, key=lambda x: (args.models.index(x["model"]), x["ratio"])):
        if "error" in x:
            print(f"| {x['model']} | {x['ratio']:g} | {x['method']} | error: {x['error'][:80]} |" + " |" * 7)
            continue
        cal_s = "cached" if x["calibration_cached"] else f"{x['calibration_s'] or 0:.1f}"
        b = (x.get("summary") or {}).get("routed_bytes_per_param")
        bpp = "" if b is None else f"{b:.3f}"
        print(
            f"| {x['model']} | {x['ratio']:g} | {x['method']} | {x['perplexity']:.2f} | {x['kl']:.4f} | "
            f"{x['top1_agreement']:.3f} | {x['routed_fraction_removed']:.1%} | "
            f"{x['whole_model_fraction_removed']:.1%} | {bpp} | {x['wall_s']:.1f} | {cal_s} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"base_perplexity": base_ppl, "args": vars(args), "rows": rows},
                                              indent=2))  # fmt: skip
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
