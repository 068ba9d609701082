"""Compression time side by side with llm-compressor, in one run, on one synthetic Qwen3-MoE checkpoint.

The checkpoint (``--build``, written one decoder layer at a time by ``benchmarks/stream_memory.py``'s
builder, no model held): Qwen3-MoE, 64 experts, hidden 1024, expert width 512, top-8, 4 layers, bf16
(~1.7 GB), vocabulary 4096 (the reference model's tokenizer is copied in when ``/work/shared`` has it).
Both tools get the *same* calibration token ids: ``--samples`` x ``--seq-len`` windows of the ``random``
source (:func:`moecompress.calibration.sources.load_token_ids`); moecompress runs with ``--holdout``
extra sequences appended, which it holds back from its statistics, so both take statistics over the
identical tokens. Both RTNs are data-free: ours runs with ``calibration.source: none`` (no tokens, no
calibration, no reconstruction errors), as llm-compressor's RTN reads no data. The pairs:

==============  ====================================  ==============================================
pair            moecompress step                      llm-compressor recipe
==============  ====================================  ==============================================
rtn             ``rtn: {bits: 4}`` (group 128),       ``QuantizationModifier(scheme="W4A16")``
                ``calibration.source: none``          (data-free, as the peer's RTN)
reap            ``expert_prune: {ratio, method: reap}``  ``REAPPruningModifier(sparsity=ratio)``
codequant/gptq  ``codequant: {bits: 4}``              ``GPTQModifier(scheme="W4A16")``
==============  ====================================  ==============================================

Both quantise the routed experts only (the peer ignores attention, routers and ``lm_head``). Each
compression runs in its own subprocess (llm-compressor in its own venv, ``--peer-python``; it is never a
dependency of moecompress); reported: wall seconds of that subprocess (reading, compressing and writing
the output; interpreter start included on both sides) and its peak RSS (``VmHWM``, read by the child itself: ``ru_maxrss`` carries the driver's peak across ``fork`` and ``exec``), and its CPU seconds (user + system, all threads; the fairer figure
when other jobs share the cores). The pairs run
back to back, interleaved (ours, peer, ours, peer ...), ``--reps`` times; the table gives the min over
the repetitions, and ``uptime`` before and after says how loaded the (shared) machine was.

    python -m venv /tmp/peer && /tmp/peer/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl \\
        && /tmp/peer/bin/pip install llmcompressor "torch==2.13.0"
    python benchmarks/peer_speed.py --peer-python /tmp/peer/bin/python --reps 2
    OMP_NUM_THREADS=1 python benchmarks/peer_speed.py --timeout 1500   # a shared machine: one thread each

``--timeout`` stops a compression after that many wall seconds (its CPU seconds so far are reported);
``--calibrated-rtn`` runs our ``rtn`` with the default calibration instead of ``source: none``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REF_TOKENIZER = Path("/work/shared/data/models/ref-qwen3moe/tokenizer.json")
PAIRS = ("rtn", "reap", "codequant")
PEER_NAME = {"rtn": "RTN W4A16", "reap": "REAP", "codequant": "GPTQ W4A16"}
PEAK = Path(__file__).resolve().parents[1] / "moecompress" / "engine" / "peak.py"


def peak_rss_bytes() -> int:
    """:func:`moecompress.engine.peak.peak_rss_bytes`, loaded from its file (standard library only): the
    peer's venv has no moecompress."""
    spec = importlib.util.spec_from_file_location("_moecompress_peak", PEAK)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {PEAK}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.peak_rss_bytes()


# --- peer side (llm-compressor's venv; imports nothing from moecompress) -------------------------------
def run_peer(args) -> dict:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ignore = ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]
    kw: dict = {}
    if args.method == "rtn":
        from llmcompressor.modifiers.quantization import QuantizationModifier

        recipe = QuantizationModifier(targets="Linear", scheme="W4A16", ignore=ignore)
    else:
        ids = load_file(args.ids)["ids"]
        kw = dict(
            dataset=Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}),
            num_calibration_samples=len(ids), max_seq_length=ids.shape[1], shuffle_calibration_samples=False,
            batch_size=1, pipeline="sequential",
        )  # fmt: skip
        if args.method == "reap":
            from llmcompressor.modifiers.pruning import REAPPruningModifier

            recipe = REAPPruningModifier(sparsity=args.ratio)
            kw["moe_calibrate_all_experts"] = False  # REAP scores the experts the router picks
        else:
            from llmcompressor.modifiers.gptq import GPTQModifier

            recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    oneshot(model=model, recipe=recipe, **kw)
    model.save_pretrained(args.out, save_compressed=args.method != "reap")
    return {}


# --- moecompress side ------------------------------------------------------------------------------------
def run_ours(args) -> dict:
    import moecompress as mc

    step = {
        "rtn": {"rtn": {"bits": 4}},
        "reap": {"expert_prune": {"ratio": args.ratio, "method": "reap"}},
        "codequant": {"codequant": {"bits": 4}},
    }[args.method]
    cal = {"source": "random", "samples": args.samples + args.holdout, "seq_len": args.seq_len, "seed": 0,
           "holdout": args.holdout, "batch_size": 8, "device": "cpu", "cache_dir": f"{args.out}.cache"}  # fmt: skip
    if args.method == "rtn" and not args.calibrated_rtn:  # data-free, like the peer's RTN
        cal = {"source": "none", "device": "cpu", "cache_dir": f"{args.out}.cache"}
    rec = {"model": args.model, "output": args.out, "calibration": cal, "steps": [step]}
    mc.apply(rec, progress=False, overwrite=True)
    return {}


def child(args) -> None:
    t0 = time.perf_counter()
    (run_peer if args.side == "peer" else run_ours)(args)
    wall = time.perf_counter() - t0
    rss = peak_rss_bytes() / 2**20
    print(json.dumps({"inner_wall_s": wall, "peak_rss_mib": rss}))


# --- driver ---------------------------------------------------------------------------------------------
def build(root: Path, args) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from stream_memory import build_checkpoint

    model = root / "model"
    if not (model / "model.safetensors.index.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        ns = argparse.Namespace(hidden=1024, experts=64, width=512, top_k=8, vocab=4096, seq_len=args.seq_len)
        size = build_checkpoint(model, args.layers, ns)
        print(f"built {model}: {size / 2**30:.2f} GiB", file=sys.stderr)
        if REF_TOKENIZER.exists():
            shutil.copy(REF_TOKENIZER, model / "tokenizer.json")
    return model


def spawn(side: str, method: str, model: Path, root: Path, args) -> dict:
    py = args.peer_python if side == "peer" else sys.executable
    out = root / f"{side}-{method}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(f"{out}.cache", ignore_errors=True)  # statistics are never reused between runs
    cmd = [py, __file__, "--child", "--side", side, "--method", method, "--model", str(model), "--out", str(out),
           "--ids", str(root / "ids.safetensors"), "--ratio", str(args.ratio), "--samples", str(args.samples),
           "--seq-len", str(args.seq_len), "--holdout", str(args.holdout)]  # fmt: skip
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if args.calibrated_rtn:
        cmd.append("--calibrated-rtn")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:  # killed and reaped: its CPU time so far is in RUSAGE_CHILDREN
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
        return {
            "error": f"> {args.timeout:.0f} s wall (stopped)",
            "wall_s": time.perf_counter() - t0,
            "cpu_s": cpu,
        }
    wall, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    if res.returncode:
        return {"error": (res.stderr.strip().splitlines() or ["?"])[-1][:300], "wall_s": wall, "cpu_s": cpu}
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "wall_s": wall, "cpu_s": cpu}


def spawn_pair(method: str, model: Path, root: Path, args) -> dict:
    """Ours and the peer on the same pair at the same time (``--parallel``): each its own subprocess,
    its CPU seconds from its own ``wait4`` rusage, so the two see the same machine load."""
    procs = {}
    for side in ("ours", "peer"):
        py = args.peer_python if side == "peer" else sys.executable
        out = root / f"{side}-{method}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(f"{out}.cache", ignore_errors=True)
        cmd = [py, __file__, "--child", "--side", side, "--method", method, "--model", str(model), "--out", str(out),
               "--ids", str(root / "ids.safetensors"), "--ratio", str(args.ratio), "--samples", str(args.samples),
               "--seq-len", str(args.seq_len), "--holdout", str(args.holdout)]  # fmt: skip
        log = open(root / f"{side}-{method}.log", "w")  # noqa: SIM115 (closed when the child ends)
        procs[side] = (
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True),
            time.perf_counter(),
            log,
        )
    res = {}
    while len(res) < 2:
        pid, status, ru = os.wait4(-1, 0)
        side = next((s for s, (p, _, _) in procs.items() if p.pid == pid), None)
        if side is None:
            continue
        proc, t0, log = procs[side]
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.close()
        r = {
            "wall_s": time.perf_counter() - t0,
            "cpu_s": ru.ru_utime + ru.ru_stime,
        }
        lines = (root / f"{side}-{method}.log").read_text().strip().splitlines() or ["?"]
        if proc.returncode:
            r["error"] = lines[-1][:300]
        else:  # the child's own VmHWM (wait4's ru_maxrss includes the driver's peak at the fork)
            mine = [json.loads(x) for x in lines if x.startswith('{"inner_wall_s"')]
            r.update(mine[-1] if mine else {"error": "no result line in the child's log"})
        res[side] = r
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/peer_speed"))
    ap.add_argument("--peer-python", default="/tmp/peer/bin/python")
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=PAIRS)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=32, help="calibration sequences given to both tools")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--holdout", type=int, default=4, help="moecompress's held-back extra sequences")
    ap.add_argument("--ratio", type=float, default=0.25, help="REAP: fraction of experts removed")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--timeout", type=float, default=3600.0, help="wall seconds per compression")
    ap.add_argument("--calibrated-rtn", action="store_true",
                    help="our rtn calibrates (default source) instead of source: none")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    ap.add_argument("--parallel", action="store_true",
                    help="run ours and the peer of a pair at the same time (same load; CPU s from wait4)")  # fmt: skip
    # internal: one compression in a subprocess
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=["ours", "peer"], help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=PAIRS, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    from safetensors.torch import save_file

    from moecompress.calibration.sources import load_token_ids

    args.root.mkdir(parents=True, exist_ok=True)
    model = build(args.root, args)
    ids = load_token_ids("random", model_dir=model, samples=args.samples + args.holdout, seq_len=args.seq_len,
                         seed=0)  # fmt: skip
    save_file({"ids": ids[: args.samples].contiguous()}, str(args.root / "ids.safetensors"))
    load = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    runs: dict = {m: {"ours": [], "peer": []} for m in args.pairs}
    for rep in range(args.reps):
        for m in args.pairs:
            if args.parallel:
                for side, r in spawn_pair(m, model, args.root, args).items():
                    runs[m][side].append(r)
                    print(f"rep {rep} {m:<9} {side:<4} {json.dumps(r)}", file=sys.stderr, flush=True)
                continue
            for side in ("ours", "peer"):
                r = spawn(side, m, model, args.root, args)
                runs[m][side].append(r)
                print(f"rep {rep} {m:<9} {side:<4} {json.dumps(r)}", file=sys.stderr, flush=True)
    load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(
        f"checkpoint: {args.layers} layers x 64 experts, hidden 1024, width 512, bf16; calibration "
        f"{args.samples} x {args.seq_len} tokens (both); reps {args.reps}\nload: {load[0]}\n   -> {load[1]}\n"
    )
    print("| pair | moecompress wall s (min) | CPU s (min) | peak RSS MiB | llm-compressor | wall s (min) | CPU s "
          "(min) | peak RSS MiB |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for m in args.pairs:
        cells = []
        for side in ("ours", "peer"):
            ok = [r for r in runs[m][side] if "error" not in r]
            cells.append((min(r["wall_s"] for r in ok), min(r["cpu_s"] for r in ok),
                          max(r["peak_rss_mib"] for r in ok)) if ok else None)  # fmt: skip
        errs = [
            next((r["error"] for r in runs[m][side] if "error" in r), "failed") for side in ("ours", "peer")
        ]
        fmt = [f"{c[0]:.1f} | {c[1]:.1f} | {c[2]:.0f}" if c else f"{e} | | " for c, e in zip(cells, errs)]
        print(f"| {m} | {fmt[0]} | {PEER_NAME[m]} | {fmt[1]} |")
    if args.json:
        args.json.write_text(json.dumps({"load": load, "runs": runs}, indent=1))
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
