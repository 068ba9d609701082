"""Prune, then quantise: quality at equal bytes (issue 34). For each reference model, every arm's KL to the
base model and held-out perplexity (``mc.evaluate`` on the last 2 % of every corpus file, as in
``benchmarks/quality.py``) next to the bytes its output stores for the routed experts.

    OMP_NUM_THREADS=1 python benchmarks/chain_quality.py [--shared /work/shared] [--models ref-qwen3moe
        ref-mixtral] [--arms ...] [--samples 64] [--holdout 8] [--seq-len 256] [--sample-tokens 2048]
        [--eval-tokens 16384] [--peer-python /tmp/peer/bin/python] [--timeout 900] [--work DIR] [--json PATH]

Arms (``ARMS``; the moecompress ones start with ``protect_super_experts`` as the shipped recipes do, and
again without it, ``-np``, as the peer protects nothing): ``gptq`` 4-, 3- and 2-bit alone (group size
``auto``; 3-bit also with one group per output channel, ``g-1``, the fewest bytes 3 bits can take) to
bracket the bytes of the pruned + 4-bit outputs; ``expert_prune`` REAP 25 % → ``gptq`` 4-bit symmetric
(recipes/expert_prune_gptq.yaml); ``heapr`` 25 % → ``gptq`` 4-bit (recipes/heapr_gptq.yaml; ragged widths,
which gptq quantises at full width) and its ``layout: uniform`` form; ``codequant`` 4-bit alone and
``heapr`` 25 % → ``codequant`` 4-bit (ragged: refused; uniform: recipes/prune_then_quantize.yaml); and
``peer``: llm-compressor's ``REAPPruningModifier(sparsity=0.25)`` then ``GPTQModifier`` W4A16 (symmetric
int4, group ``--peer-group-size``, 64 by default: the stock preset's 128 does not divide the reference
models' 64- and 192-input projections and llm-compressor refuses it) in one ``oneshot``, run in its own
venv (``--peer-python``, a subprocess of this file in ``--peer`` mode, as ``benchmarks/reap_parity.py``
and ``benchmarks/peer_speed.py`` do; llm-compressor is never a dependency).

Calibration: the corpus files' training split (``file:`` source), ``--samples + --holdout`` windows of
``--seq-len`` tokens, seed 0, drawn by :func:`moecompress.calibration.sources.load_token_ids`; moecompress
holds the last ``--holdout`` back from its statistics, and the peer gets exactly the first ``--samples``,
so every arm's statistics are taken over the same token ids. The moecompress arms of a model share one
``cache_dir`` (statistics computed once per statistics set).

Expert bytes: the bytes of the stored tensors whose name holds ``.experts.`` in the output's
``*.safetensors`` files (read from the headers: codes, scales, zero points, centroids, rotations, dense
protected experts; routers excluded), the same count for the base checkpoint and for the peer's
compressed-tensors save. The peer's quality is measured on its fake-quantised weights (the weights
``oneshot`` leaves in the model, saved dense without the quantisation parameters).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ["ref-qwen3moe", "ref-mixtral"]
PSE = {"protect_super_experts": {}}
GPTQ4, GPTQ3 = {"gptq": {"bits": 4}}, {"gptq": {"bits": 3}}
GPTQ4S = {"gptq": {"bits": 4, "symmetric": True}}  # as recipes/expert_prune_gptq.yaml and the peer's W4A16
REAP25 = {"expert_prune": {"ratio": 0.25, "method": "reap"}}
HEAPR25 = {"heapr": {"ratio": 0.25, "align": 16}}  # ragged widths, as recipes/heapr_gptq.yaml
HEAPR25U = {"heapr": {"ratio": 0.25, "layout": "uniform", "align": 16}}  # one smaller width per expert
CQ4 = {"codequant": {"bits": 4, "rotation": "learned"}}
ARMS = {  # label: recipe steps; "-np": without protect_super_experts (as the peer, which protects nothing)
    "gptq4": [PSE, GPTQ4],
    "gptq3": [PSE, GPTQ3],
    "gptq3-g-1": [PSE, {"gptq": {"bits": 3, "group_size": -1}}],
    "gptq2": [PSE, {"gptq": {"bits": 2}}],
    "reap25-gptq4sym": [PSE, REAP25, GPTQ4S],
    "heapr25-gptq4": [PSE, HEAPR25, GPTQ4],
    "heapr25-uniform-gptq4": [PSE, HEAPR25U, GPTQ4],
    "codequant4": [PSE, CQ4],
    "heapr25-codequant4": [PSE, HEAPR25, CQ4],  # refused: codequant needs one width per layer
    "heapr25-uniform-codequant4": [PSE, HEAPR25U, CQ4],  # as recipes/prune_then_quantize.yaml
    "gptq4-np": [GPTQ4],
    "gptq3-np": [GPTQ3],
    "gptq3-g-1-np": [{"gptq": {"bits": 3, "group_size": -1}}],
    "gptq2-np": [{"gptq": {"bits": 2}}],
    "reap25-gptq4sym-np": [REAP25, GPTQ4S],
    "gptq4sym-np": [GPTQ4S],
    "peer-reap25-gptq-w4a16": None,  # llm-compressor, its own venv
}
PEER = "peer-reap25-gptq-w4a16"
QUANT_KEYS = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "weight_global_scale")


def expert_bytes(d: Path) -> int:
    """Bytes of the stored tensors named ``*.experts.*`` in ``d``'s safetensors files (from the headers)."""
    total = 0
    for f in sorted(Path(d).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__" and ".experts." in k:
                a, b = v["data_offsets"]
                total += b - a
    return total


# --- peer side (llm-compressor's venv; imports nothing from moecompress) --------------------------------
def run_peer(args) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.pruning import REAPPruningModifier
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    ids = load_file(args.ids)["ids"]
    out = Path(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]
    recipe = [
        REAPPruningModifier(sparsity=args.ratio),
        GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore)
        if args.peer_group_size == 128  # the stock preset (symmetric int4, group 128)
        else GPTQModifier(
            config_groups={
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": args.peer_group_size,
                    },
                }
            },
            ignore=ignore,
        ),
    ]
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=Dataset.from_dict(
            {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
        ),
        recipe=recipe,
        num_calibration_samples=len(ids),
        max_seq_length=ids.shape[1],
        shuffle_calibration_samples=False,
        batch_size=1,
        pipeline="sequential",
    )
    seconds = time.perf_counter() - t0
    n_quant = sum(1 for k in model.state_dict() if k.endswith("weight_scale") and ".experts." in k)
    # dense copy for evaluation: the fake-quantised weights, less the quantisation parameters, under the
    # base checkpoint's tensor names (llm-compressor's linearised Mixtral experts are mlp.experts.j.
    # gate_proj/up_proj/down_proj in memory; the checkpoint's block_sparse_moe.experts.j.w1/w3/w2)
    names = set(load_file(str(Path(args.model) / "model.safetensors")))
    sd = {}
    for k, v in model.state_dict().items():
        if k.rsplit(".", 1)[-1] in QUANT_KEYS:
            continue
        if k not in names and any(".block_sparse_moe." in n for n in names):
            k = k.replace(".mlp.", ".block_sparse_moe.")
            for a, b in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                k = k.replace(f".{a}.", f".{b}.")
        sd[k] = v.detach().contiguous().clone()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    if set(sd) - names:
        raise RuntimeError(
            f"dense copy: tensor names not in the base checkpoint: {sorted(set(sd) - names)[:5]}"
        )
    dense = out / "dense"
    dense.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(dense / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (dense / "config.json").write_text(json.dumps(cfg, indent=1))
    model.save_pretrained(out / "compressed", save_compressed=True)
    (out / "peer.json").write_text(json.dumps({"seconds": seconds, "quantised_expert_linears": n_quant}))


# --- moecompress side -----------------------------------------------------------------------------------
def run_ours(model: Path, out: Path, cal: dict, steps: list, ev: dict, base) -> dict:
    import moecompress as mc

    t0 = time.perf_counter()
    mc.apply({"model": str(model), "output": str(out), "calibration": cal, "steps": steps}, progress=False,
             overwrite=True)  # fmt: skip
    wall = time.perf_counter() - t0
    reports = {
        p.parent.name: json.loads(p.read_text()) for p in sorted((out / "steps").glob("*/report.json"))
    }
    last = reports[sorted(reports)[-1]].get("summary") or {}
    t1 = time.perf_counter()
    e = mc.evaluate(out, against=base, **ev)
    return {"expert_bytes": expert_bytes(out), "routed_bytes_after_report": last.get("routed_bytes_after"),
            "wall_s": wall, "eval_s": time.perf_counter() - t1, "perplexity": e["perplexity"], "kl": e["kl"],
            "top1_agreement": e["top1_agreement"], "base_perplexity": e["base_perplexity"],
            "summaries": {k: r.get("summary") for k, r in reports.items()},
            "warnings": [w for r in reports.values() for w in r.get("warnings") or []]}  # fmt: skip


def run_peer_arm(model: Path, out: Path, ids_path: Path, ev: dict, base, args) -> dict:
    import moecompress as mc

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [args.peer_python, __file__, "--peer", "--ids", str(ids_path), "--model", str(model), "--out", str(out),
           "--ratio", str(args.ratio), "--peer-group-size", str(args.peer_group_size)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"llm-compressor run stopped after {args.timeout:.0f} s wall"}
    wall = time.perf_counter() - t0
    (out / "peer.log").write_text(res.stdout + res.stderr)
    if res.returncode:
        lines = [x for x in res.stderr.strip().splitlines() if x.strip()] or ["?"]
        return {"error": lines[-1][:400], "wall_s": wall}
    info = json.loads((out / "peer.json").read_text())
    for f in model.glob("tokenizer*"):  # so that mc.evaluate finds the tokenizer
        shutil.copy(f, out / "dense" / f.name)
    t1 = time.perf_counter()
    e = mc.evaluate(out / "dense", against=base, **ev)
    return {"expert_bytes": expert_bytes(out / "compressed"), "wall_s": wall, "peer_oneshot_s": info["seconds"],
            "quantised_expert_linears": info["quantised_expert_linears"], "eval_s": time.perf_counter() - t1,
            "perplexity": e["perplexity"], "kl": e["kl"], "top1_agreement": e["top1_agreement"],
            "base_perplexity": e["base_perplexity"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--samples", type=int, default=64, help="calibration sequences whose statistics count")
    ap.add_argument("--holdout", type=int, default=8, help="moecompress's held-back extra sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--sample-tokens", type=int, default=2048, help="calibration.sample_tokens (codequant)")
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--ratio", type=float, default=0.25, help="the peer's REAP sparsity")
    ap.add_argument("--peer-group-size", type=int, default=64,
                    help="the peer's W4A16 group (128: the stock preset, which needs every projection's "
                    "inputs divisible by 128)")  # fmt: skip
    ap.add_argument("--peer-python", default="/tmp/peer/bin/python")
    ap.add_argument("--timeout", type=float, default=900.0, help="wall seconds for the peer's run")
    ap.add_argument("--work", help="work dir (default: a temp dir, deleted at the end)")
    ap.add_argument("--json", help="also write all rows to this JSON file")
    # internal: the peer mode
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return run_peer(args)

    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    import moecompress as mc
    from moecompress.calibration.sources import load_token_ids

    hf_logging.disable_progress_bar()
    data = Path(args.shared) / "data"
    corpus = sorted(str(p) for p in (data / "corpus").glob("*.txt"))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="chain-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    ev = {"texts": corpus, "max_tokens": args.eval_tokens, "seq_len": args.seq_len}
    source = "file:" + ",".join(corpus)
    results: dict = {"args": vars(args), "models": {}}
    for name in args.models:
        model = data / "models" / name
        total = args.samples + args.holdout
        ids = load_token_ids(source, model_dir=model, samples=total, seq_len=args.seq_len, seed=0)
        ids_path = work / f"{name}-ids.safetensors"
        save_file({"ids": ids[: args.samples].contiguous()}, str(ids_path))
        cal = {"source": source, "samples": total, "seq_len": args.seq_len, "seed": 0, "holdout": args.holdout,
               "batch_size": 8, "sample_tokens": args.sample_tokens, "cache_dir": str(work / f"{name}-cache")}  # fmt: skip
        base = mc.load(model)
        t0 = time.perf_counter()
        base_eval = mc.evaluate(model, **ev)
        res = {"base_expert_bytes": expert_bytes(model), "base_perplexity": base_eval["perplexity"],
               "calibration": cal, "rows": {}}  # fmt: skip
        print(f"{name}: base perplexity {base_eval['perplexity']:.3f}, expert bytes {res['base_expert_bytes']} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
        for label in args.arms:
            out = work / f"{name}-{label}"
            try:
                if label == PEER:
                    row = run_peer_arm(model, out, ids_path, ev, base, args)
                else:
                    row = run_ours(model, out, cal, ARMS[label], ev, base)
            except Exception as err:  # one arm failing must not stop the others
                row = {"error": f"{type(err).__name__}: {err}"[:400]}
            finally:
                if not args.work:
                    shutil.rmtree(out, ignore_errors=True)
            row["steps"] = ARMS[label]
            res["rows"][label] = row
            msg = row.get("error") or (f"{row['expert_bytes']} B, KL {row['kl']:.4f}, ppl {row['perplexity']:.3f}, "
                                       f"{row['wall_s']:.1f} s + eval {row['eval_s']:.1f} s")  # fmt: skip
            print(f"  {label}: {msg}", flush=True)
        results["models"][name] = res
        del base
    for name, res in results["models"].items():
        b = res["base_expert_bytes"]
        print(f"\n**{name}** (base: {b:,} expert bytes, fp32; held-out ppl {res['base_perplexity']:.3f})\n")
        print("| arm | expert bytes | bytes vs base | KL to base | held-out ppl |\n|---|---:|---:|---:|---:|")
        for label, row in res["rows"].items():
            if "error" in row:
                print(f"| {label} | error: {row['error'][:160]} | | | |")
                continue
            print(f"| {label} | {row['expert_bytes']:,} | {row['expert_bytes'] / b:.2%} | {row['kl']:.4f} | "
                  f"{row['perplexity']:.3f} |")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
