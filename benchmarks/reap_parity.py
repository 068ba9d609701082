"""REAP parity: moecompress ``expert_prune method: reap`` against llm-compressor's ``REAPPruningModifier``.

Both tools get the *same* calibration token ids (``samples`` x ``seq_len`` windows of the corpus'
training split, drawn by :func:`moecompress.calibration.sources.load_token_ids`); moecompress runs with
``holdout`` extra sequences appended (it holds the last ``holdout`` back from its statistics), so the
statistics of both are taken over identical tokens. For every ratio the script prints the experts each
tool removes per layer, the per-expert saliency of both side by side where they disagree, and the
held-out perplexity of both outputs (``moecompress.evaluate`` on the last 2% of every corpus file).

llm-compressor is never a dependency: it runs in its own venv (``--peer-python``) through a subprocess of
this same file (``--peer`` mode), which writes the retained experts, its saliencies and the pruned model.

    python -m venv /tmp/reap_peer && /tmp/reap_peer/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl \\
        && /tmp/reap_peer/bin/pip install llmcompressor
    python benchmarks/reap_parity.py --peer-python /tmp/reap_peer/bin/python     # in moecompress's venv

``--propagate`` picks moecompress's ``calibration.propagate`` (``original`` / ``compressed``) and
``--peer-propagate`` llm-compressor's ``propagate_error`` (True = each layer's pruned output feeds the
next layer's calibration, its default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODEL = "/work/shared/data/models/ref-qwen3moe"
CORPUS = "/work/shared/data/corpus"


# --- peer side (runs in llm-compressor's venv; imports nothing from moecompress) ----------------------
def run_peer(args) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning import REAPPruningModifier
    from llmcompressor.modifiers.pruning.reap import utils as reap_utils
    from transformers import AutoModelForCausalLM

    ids = torch.load(args.ids)
    saliency: dict[str, list[float]] = {}
    counts: dict[str, list[float]] = {}
    original = reap_utils.REAPSaliencyTracker.compute_retained_experts

    def recording(self, *a, **kw):  # keep the saliency that decides, before the tracker is freed
        name = f"layer{len(saliency)}"
        saliency[name] = [float(v) for v in self.mean_saliency]
        counts[name] = [float(v) for v in self.count.cpu()]
        return original(self, *a, **kw)

    reap_utils.REAPSaliencyTracker.compute_retained_experts = recording
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    out = Path(args.out)
    report = out / "retained.json"
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=ds,
        recipe=REAPPruningModifier(sparsity=args.ratio, report_path=str(report)),
        num_calibration_samples=len(ids),
        max_seq_length=ids.shape[1],
        shuffle_calibration_samples=False,
        batch_size=1,
        pipeline="sequential",
        moe_calibrate_all_experts=args.all_experts,
        propagate_error=args.peer_propagate == "true",
    )
    seconds = time.perf_counter() - t0
    model.save_pretrained(out / "model")
    retained = json.loads(report.read_text())
    (out / "peer.json").write_text(
        json.dumps({"retained": retained, "saliency": saliency, "counts": counts, "seconds": seconds})
    )


# --- moecompress side ----------------------------------------------------------------------------------
def ours(model: str, ids_cfg: dict, ratio: float, root: Path, propagate: str) -> dict:
    import moecompress as mc

    out = root / f"ours-{ratio}-{propagate}"
    rec = {
        "model": model,
        "output": str(out),
        "calibration": {**ids_cfg, "propagate": propagate, "cache_dir": str(root / "cache")},
        "steps": [{"expert_prune": {"ratio": ratio, "method": "reap"}}],
    }
    t0 = time.perf_counter()
    mc.apply(rec, progress=False, overwrite=True)
    seconds = time.perf_counter() - t0
    rep = json.loads(next((out / "steps").glob("01-*/report.json")).read_text())
    infos = {int(r["layer"]): r["info"] for r in rep["layers"]}
    return {
        "dir": out,
        "removed": {i: x["removed_experts"] for i, x in infos.items()},
        "scores": {i: x["scores"] for i, x in infos.items()},
        "seconds": seconds,
    }


def peer(args, ids_path: Path, ratio: float, root: Path) -> dict:
    out = root / f"peer-{ratio}-{args.peer_propagate}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [args.peer_python, __file__, "--peer", "--ids", str(ids_path), "--model", args.model,
           "--ratio", str(ratio), "--out", str(out), "--peer-propagate", args.peer_propagate]  # fmt: skip
    if args.all_experts:
        cmd.append("--all-experts")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"llm-compressor run failed (rc {res.returncode}):\n{res.stderr[-4000:]}")
    data = json.loads((out / "peer.json").read_text())
    import shutil

    for f in Path(args.model).glob("tokenizer*"):  # so that moecompress.evaluate finds the tokenizer
        shutil.copy(f, out / "model" / f.name)
    names = sorted(data["retained"], key=lambda n: int(n.split(".")[2]))  # model.layers.<i>.mlp
    e = len(data["saliency"]["layer0"])
    removed = {}
    scores = {}
    for k, name in enumerate(names):
        i = int(name.split(".")[2])
        removed[i] = sorted(set(range(e)) - set(data["retained"][name]))
        scores[i] = data["saliency"][f"layer{k}"]
    return {"dir": out / "model", "removed": removed, "scores": scores, "seconds": data["seconds"]}


def perplexity(path, texts: list[str], max_tokens: int) -> float:
    import moecompress as mc

    return mc.evaluate(str(path), texts=texts, max_tokens=max_tokens, seq_len=256)["perplexity"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--corpus", default=CORPUS)
    ap.add_argument("--samples", type=int, default=64, help="calibration sequences given to both tools")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--holdout", type=int, default=8, help="moecompress's held-back extra sequences")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--propagate", default="original", choices=["original", "compressed"])
    ap.add_argument("--peer-propagate", default="true", choices=["true", "false"])
    ap.add_argument("--all-experts", action="store_true", help="llm-compressor moe_calibrate_all_experts")
    ap.add_argument("--peer-python", default="/tmp/reap_peer/bin/python")
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--root", default="out/reap_parity")
    ap.add_argument("--json", default=None, help="write the results here")
    # internal: the peer mode
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ratio", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return run_peer(args)

    import torch

    from moecompress.calibration.sources import load_token_ids

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    total = args.samples + args.holdout
    source = f"file:{args.corpus}"
    ids = load_token_ids(source, model_dir=args.model, samples=total, seq_len=args.seq_len, seed=args.seed)
    stats_ids = ids[: args.samples]  # moecompress's statistics sequences (the last `holdout` are held back)
    ids_path = root / "ids.pt"
    torch.save(stats_ids.clone(), ids_path)
    cal = {"source": source, "samples": total, "seq_len": args.seq_len, "seed": args.seed,
           "holdout": args.holdout, "batch_size": 8}  # fmt: skip
    texts = sorted(str(p) for p in Path(args.corpus).glob("*.txt"))
    results = {"model": args.model, "tokens": list(stats_ids.shape), "ratios": {}}
    base = perplexity(args.model, texts, args.eval_tokens)
    print(
        f"{args.model}: {tuple(stats_ids.shape)} calibration tokens for both tools; base perplexity {base:.2f}"
    )
    for ratio in args.ratios:
        a = ours(args.model, cal, ratio, root, args.propagate)
        b = peer(args, ids_path, ratio, root)
        pa, pb = perplexity(a["dir"], texts, args.eval_tokens), perplexity(b["dir"], texts, args.eval_tokens)
        print(f"\n== ratio {ratio}: moecompress (propagate {args.propagate}) vs llm-compressor "
              f"(propagate_error {args.peer_propagate})")  # fmt: skip
        print(f"{'layer':>5} {'moecompress removes':<40} {'llm-compressor removes':<40} same")
        for i in sorted(a["removed"]):
            ra, rb = a["removed"][i], b["removed"].get(i)
            print(f"{i:>5} {ra!s:<40} {rb!s:<40} {'yes' if ra == rb else 'NO'}")
        for i in sorted(a["removed"]):
            if a["removed"][i] != b["removed"].get(i):
                print(f"\nlayer {i} saliency (moecompress | llm-compressor), * = removed by that tool")
                for e, (sa, sb) in enumerate(zip(a["scores"][i], b["scores"][i])):
                    ma = "*" if e in a["removed"][i] else " "
                    mb = "*" if e in b["removed"][i] else " "
                    print(f"  expert {e:>2}: {sa:10.5f}{ma} | {sb:10.5f}{mb}")
        print(f"held-out perplexity: moecompress {pa:.2f}, llm-compressor {pb:.2f} (base {base:.2f})")
        results["ratios"][str(ratio)] = {
            "moecompress": {"removed": a["removed"], "scores": a["scores"], "perplexity": pa},
            "llmcompressor": {"removed": b["removed"], "scores": b["scores"], "perplexity": pb},
        }
    results["base_perplexity"] = base
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
