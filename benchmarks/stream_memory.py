"""Peak memory of ``moecompress apply`` on synthetic checkpoints with Qwen3-30B-A3B MoE layer shapes.

Acceptance check of the recipe engine: a recipe with ``analyze`` and a step that needs a gradient
statistic (so calibration runs the streamed forward *and* the streamed backward) must stay bounded
by a few layers, whatever the depth:

* peak RSS of the deepest run <= 1.15 x the shallowest run's, and
* peak RSS <= 3 x one MoE layer's expert bytes + the calibration cache bytes.

Checkpoints: ``qwen3_moe``, hidden 2048, 128 experts of width 768, top-8 (the MoE layers of
Qwen3-30B-A3B), random bf16 weights, every other dimension small (vocab 512, 4 heads of 64, 2 KV
heads). One MoE layer's experts are 3 * 2048 * 768 * 128 * 2 B = 1.21 GB, so the checkpoints are
written one layer (one shard) at a time with ``safetensors`` and never exist in memory as a model.
Tensor names and shapes come from transformers' ``Qwen3MoeForCausalLM`` built on ``meta`` with the
same config and one layer (its fused expert tensors mapped to the Hub's per-expert names) and are
cross-checked against the adapter; every checkpoint is validated with ``open_checkpoint`` and
``moecompress info``.

Each measurement's interpreter registers a report-only ``grad_probe`` pass (needs ``grad_sq_mean``
and ``act_sq_mean``, HEAPr's statistics) before calling ``moecompress.apply``. Two recipe variants
run, and a third with ``--heapr``:

* ``analyze+grad``: ``analyze`` + ``grad_probe``, report-only, so nothing but reports is written;
* ``+identity``: the same plus ``identity`` last, so a checkpoint is written (streaming writer,
  ``max_shard_size`` about one decoder layer);
* ``analyze+heapr`` (``--heapr``): ``analyze`` + the real ``heapr`` pass (``--heapr-ratio``, default
  0.5), which writes a ragged checkpoint.

``max_shard_size`` is about one decoder layer unless ``--shard-mb`` or ``--default-shard`` (the
recipe's default, 5 GB) says otherwise; ``--only`` picks variants.

Every measurement runs in a fresh interpreter with a fresh calibration cache directory (so
calibration really runs); the peak is ``VmHWM`` from ``/proc/self/status`` at the end (not
``ru_maxrss``, which Linux carries across ``execve`` from this parent), the baseline is ``VmHWM``
right after the imports. ``--phases`` adds a profile run per depth that calls the executor's pieces
one by one (``load_recipe``, ``open_checkpoint``, ``dry_run``, ``run_calibration`` with per-layer
callbacks, ``run_layer_loop``) and resets the high-water mark between them
(``/proc/self/clear_refs``), to show where the peak is reached.

    python benchmarks/stream_memory.py                       # 2 and 6 layers, ~2.4 + 7.3 GB on disk
    python benchmarks/stream_memory.py --layers 2 6 --phases --tmp /data/tmp
    python benchmarks/stream_memory.py --experts 16 --hidden 512 --width 256   # quick smoke run
    python benchmarks/stream_memory.py --layers 2 --heapr    # + the real heapr pass (ragged output)
    python benchmarks/stream_memory.py --experts 64 --hidden 1024 --width 512 --only analyze+heapr \
        --heapr-ratio 0.1 --default-shard         # issue 18's depth check (192 MiB per MoE layer)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

GB = 1e9
MB = 1e6
RATIO_LIMIT = 1.15
LAYER_FACTOR = 3

# Runs in a fresh interpreter; prints one JSON line last. argv: mode (apply | phases), recipe path.
WORKER = r"""
import json, sys, time

import torch, transformers  # noqa: F401
import moecompress
from moecompress.engine.peak import peak_rss_bytes, reset_peak_rss, rss_bytes
import moecompress.engine.executor, moecompress.engine.run, moecompress.calibration.skeleton  # noqa: F401
import moecompress.calibration.sweep  # noqa: F401
from moecompress.engine.spec import PassConfig, PassSpec

class GradProbeConfig(PassConfig):
    pass

def grad_probe(layer, stats, cfg):
    "Report the sum of the per-neuron mean squared gradients (benchmark probe)."
    return layer, {"grad_sq_mean_total": float(stats["grad_sq_mean"].sum())}

PROBE = PassSpec("grad_probe", GradProbeConfig, grad_probe, needs={"grad_sq_mean", "act_sq_mean"}, report_only=True)

mode, recipe_path = sys.argv[1], sys.argv[2]
base = peak_rss_bytes()
t0 = time.perf_counter()
out = {"base": base}
if mode == "apply":
    res = moecompress.apply(recipe_path, passes=[PROBE], progress=False)
    out["wall"] = time.perf_counter() - t0
    out["peak"] = peak_rss_bytes()
    out["rss_end"] = rss_bytes()
    rep = res.report
    out["report_peak_rss"] = rep.get("peak_rss_mb", 0.0) * 2**20
    out["checkpoint"] = rep.get("checkpoint")
    out["calibration"] = {k: rep["calibration"].get(k) for k in ("backward", "loss", "seconds", "cached")}
    steps = {s["name"]: s["seconds"] for s in rep["steps"]}
    out["step_seconds"] = steps
elif mode == "phases":
    from moecompress.calibration.cache import StatsCache, model_key, save_layer
    from moecompress.calibration.sources import load_token_ids
    from moecompress.calibration.catalogue import ALWAYS
    from moecompress.calibration.sweep import Batches, run_calibration
    from moecompress.engine.context import RunContext
    from moecompress.engine.dry_run import dry_run
    from moecompress.io.checkpoint import open_checkpoint
    from moecompress.engine.run import RecipeRun
    from moecompress.engine.recipe import load_recipe, pass_table
    from moecompress.calibration.skeleton import Skeleton

    phases = []
    can_reset = reset_peak_rss()
    out["peak_resettable"] = can_reset

    def mark(name):
        phases.append({"phase": name, "peak": peak_rss_bytes(), "rss": rss_bytes(),
                       "t": round(time.perf_counter() - t0, 2)})
        reset_peak_rss()

    rec = load_recipe(recipe_path, passes=pass_table([PROBE]))
    mark("load_recipe")
    ckpt = open_checkpoint(rec.model)
    mark("open_checkpoint")
    plan = dry_run(rec, ckpt)
    mark("dry_run")
    c = rec.calibration
    ids = load_token_ids(c.source, model_dir=ckpt.path, samples=c.samples, seq_len=c.seq_len, seed=c.seed)
    needs = set(rec.needs) | ALWAYS
    cache = StatsCache(c.cache_dir, model_key(ckpt), {"profile": True})
    entry = cache.begin(needs)
    ctx = RunContext.for_recipe(rec, ckpt, progress=False)
    skel = Skeleton(ckpt, ctx.dtype)
    mark("token ids + Skeleton (meta model, embeddings)")

    def fwd(i, s):
        save_layer(entry, i, s)
        mark(f"calibration forward, layer {i} (read + forward + save)")

    def bwd(i, s):
        save_layer(entry, i, s, grad=True)
        mark(f"calibration backward, layer {i} (read + recompute + backward + save)")

    summary = run_calibration(
        skel, Batches.make(ids, c.holdout_samples, c.batch_size), needs, sample_tokens=c.sample_tokens,
        offload=c.offload, save_forward=fwd, save_backward=bwd, progress=False,
    )
    del skel
    entry = cache.finish(entry, needs, summary)
    mark("calibration tail")
    run = RecipeRun(rec, ckpt, entry, {}, ctx, None)
    run.loop()
    rep = run.finish(summary, t0, plan)
    mark("layer loop (read, steps, write, reports)")
    out["phases"] = phases
    out["step_seconds"] = {s["name"]: s["seconds"] for s in rep["steps"]}
    out["wall"] = time.perf_counter() - t0
    out["peak"] = max(p["peak"] for p in phases)
else:
    raise SystemExit(f"unknown mode {mode}")
print(json.dumps(out))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- synthetic checkpoints -----------------------------------------------------------------------
def make_config(layers: int, args: argparse.Namespace):
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(
            "qwen3_moe",
            hidden_size=args.hidden,
            num_hidden_layers=layers,
            num_experts=args.experts,
            moe_intermediate_size=args.width,
            num_experts_per_tok=args.top_k,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            intermediate_size=256,
            head_dim=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=args.vocab,
            max_position_embeddings=max(128, args.seq_len),
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )


def layer_spec(args: argparse.Namespace) -> tuple[dict, dict]:
    """``({global name: shape}, {layer-0 name: shape})`` in the Hub's on-disk (per-expert) form."""
    import torch
    from transformers import AutoModelForCausalLM

    from moecompress.adapters.qwen3_moe import Qwen3MoeAdapter

    cfg = make_config(1, args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    del model
    glob = {k: s for k, s in shapes.items() if not k.startswith("model.layers.")}
    layer: dict[str, tuple[int, ...]] = {}
    p = "model.layers.0.mlp"
    for k, s in shapes.items():
        if not k.startswith("model.layers.0."):
            continue
        if k == f"{p}.experts.gate_up_proj":  # fused [E, 2I, H] -> per expert gate/up [I, H]
            e, two_i, h = s
            for x in range(e):
                layer[f"{p}.experts.{x}.gate_proj.weight"] = (two_i // 2, h)
                layer[f"{p}.experts.{x}.up_proj.weight"] = (two_i // 2, h)
        elif k == f"{p}.experts.down_proj":  # fused [E, H, I] -> per expert down [H, I]
            e, h, i = s
            for x in range(e):
                layer[f"{p}.experts.{x}.down_proj.weight"] = (h, i)
        else:
            layer[k] = s
    _, expected = Qwen3MoeAdapter(cfg).expected_tensors(0, [])
    moe = {k: s for k, s in layer.items() if k.startswith(f"{p}.")}
    if moe != {k: tuple(s) for k, s in expected.items()}:
        raise SystemExit("transformers' tensor names/shapes disagree with the qwen3_moe adapter")
    return glob, layer


def random_tensor(name: str, shape: tuple[int, ...], gen) -> object:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    std = 0.5 if name.endswith("mlp.gate.weight") else 0.02  # decisive routing
    return torch.randn(shape, generator=gen, dtype=torch.bfloat16).mul_(std)


def build_checkpoint(path: Path, layers: int, args: argparse.Namespace) -> int:
    """Write the checkpoint one decoder layer (= one shard) at a time; returns the total tensor bytes."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    cfg = make_config(layers, args)
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts", args.experts)  # the Hub's spelling
    raw["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")

    glob, layer = layer_spec(args)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(layers):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(1000 + i)
        names = {k.replace("model.layers.0.", f"model.layers.{i}.", 1): s for k, s in layer.items()}
        if i == 0:
            names = {"model.embed_tokens.weight": glob["model.embed_tokens.weight"], **names}
        if i == layers - 1:
            names.update({k: s for k, s in glob.items() if k != "model.embed_tokens.weight"})
        tensors = {k: random_tensor(k, s, gen) for k, s in names.items()}
        shard = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, shard))
        del tensors
        log(f"  wrote {shard} ({time.perf_counter() - t0:.1f}s)")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def validate(path: Path, layers: int) -> dict:
    import moecompress as mc

    ckpt = mc.open_checkpoint(path)  # checks every MoE tensor's name and shape from the headers
    if ckpt.moe_layer_indices != list(range(layers)):
        raise SystemExit(f"{path}: MoE layers {ckpt.moe_layer_indices}, expected {layers}")
    proc = subprocess.run(
        [sys.executable, "-m", "moecompress.cli", "info", str(path)],
        capture_output=True,
        text=True,
        env=env(),
    )
    if proc.returncode != 0:
        raise SystemExit(f"moecompress info {path} failed:\n{proc.stdout}\n{proc.stderr}")
    info = json.loads(proc.stdout)
    log(
        f"  moecompress info: {info['model_type']}, {info['num_layers']} layers, {info['num_experts']} "
        f"experts x {info['expert_width']}, top-{info['top_k']}, {len(info['shards'])} shards, "
        f"{info['tensors']} tensors"
    )
    return info


def decoder_layer_bytes(path: Path) -> int:
    import moecompress as mc

    ckpt = mc.open_checkpoint(path)
    return max(sum(ckpt.reader.nbytes(k) for k in keys) for i, keys in ckpt.key_groups() if i is not None)


# -- measurements --------------------------------------------------------------------------------
def env() -> dict[str, str]:
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    return e


def write_recipe(path: Path, model: Path, out: Path, cache: Path, tail: str | None, args, shard: int) -> None:
    import yaml

    steps: list[dict] = [{"analyze": {}}]
    if tail == "heapr":  # the real HEAPr pass: same statistics as grad_probe, writes a ragged checkpoint
        steps.append({"heapr": {"ratio": args.heapr_ratio}})
    else:
        steps.append({"grad_probe": {}})
    if tail == "identity":
        steps.append({"identity": {}})
    recipe = {
        "model": str(model),
        "output": str(out),
        "calibration": {
            "source": "random",
            "samples": args.samples,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "cache_dir": str(cache),
        },
        "steps": steps,
    }
    if shard:  # 0: the recipe's default max_shard_size (5 GB)
        recipe["max_shard_size"] = shard
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run_worker(mode: str, recipe: Path, malloc_threshold: int | None) -> dict:
    e = env()
    if malloc_threshold is not None:
        e["MALLOC_MMAP_THRESHOLD_"] = str(malloc_threshold)
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(recipe)], capture_output=True, text=True, env=e
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker {mode} {recipe} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(name: str, tail: str | None, n: int, ckpt: Path, work: Path, args, shard: int) -> dict:
    tag = f"L{n}-{tail or 'report'}"
    out, cache, recipe = work / f"{tag}-out", work / f"{tag}-cache", work / f"{tag}.yaml"
    write_recipe(recipe, ckpt, out, cache, tail, args, shard)
    log(f"  apply [{name}], {n} layers ...")
    r = run_worker("apply", recipe, args.malloc_mmap_threshold)
    r["cache_bytes"] = du(cache)
    r["out_bytes"] = du(out)
    log(
        f"    peak {r['peak'] / GB:.2f} GB (baseline {r['base'] / GB:.2f} GB, growth "
        f"{(r['peak'] - r['base']) / GB:.2f} GB), wall {r['wall']:.1f}s, cache {r['cache_bytes'] / MB:.2f} MB, "
        f"output {r['out_bytes'] / GB:.2f} GB, checkpoint written: {r['checkpoint']}, "
        f"calibration {r['calibration']}"
    )
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return r


def profile(n: int, ckpt: Path, work: Path, args, shard: int) -> dict:
    out, cache, recipe = work / f"L{n}-phases-out", work / f"L{n}-phases-cache", work / f"L{n}-phases.yaml"
    write_recipe(recipe, ckpt, out, cache, "identity", args, shard)
    log(f"  phases profile (+identity), {n} layers ...")
    r = run_worker("phases", recipe, args.malloc_mmap_threshold)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return r


def print_phases(n: int, r: dict, layer: int) -> None:
    reset = "reset between phases" if r.get("peak_resettable") else "CUMULATIVE (clear_refs unavailable)"
    print(f"\nphases, {n} layers (+identity recipe), peak = VmHWM within the phase ({reset}):\n")
    print("| phase | peak RSS GB | peak / layer | RSS at end GB | t s |")
    print("|---|---:|---:|---:|---:|")
    for p in r["phases"]:
        print(
            f"| {p['phase']} | {p['peak'] / GB:.2f} | {p['peak'] / layer:.2f} | {p['rss'] / GB:.2f} | {p['t']:.1f} |"
        )
    steps = ", ".join(f"{k} {v:.1f}s" for k, v in r.get("step_seconds", {}).items())
    print(f"\nlayer-loop step seconds: {steps}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 6], help="model depths to compare")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768, help="moe_intermediate_size")
    ap.add_argument("--top-k", type=int, default=8, help="num_experts_per_tok")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--shard-mb", type=float, default=None, help="max_shard_size (default: one decoder layer + 5%%)"
    )
    ap.add_argument(
        "--tmp", type=Path, default=None, help="where checkpoints and outputs go (default: system tmp)"
    )
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and outputs")
    ap.add_argument("--phases", action="store_true", help="also profile the executor's phases per depth")
    ap.add_argument(
        "--heapr", action="store_true", help="also run analyze + heapr (ragged output; see --heapr-ratio)"
    )
    ap.add_argument("--heapr-ratio", type=float, default=0.5, help="heapr's ratio (default 0.5)")
    ap.add_argument(
        "--default-shard", action="store_true", help="leave max_shard_size at the recipe default (5 GB)"
    )
    ap.add_argument(
        "--only", nargs="+", default=None, choices=["analyze+grad", "+identity", "analyze+heapr"],
        help="run only these variants (default: all enabled)",
    )  # fmt: skip
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="set MALLOC_MMAP_THRESHOLD_ in the workers (default: glibc's dynamic threshold, as users run)",
    )
    args = ap.parse_args()
    if not Path("/proc/self/status").is_file():
        raise SystemExit("needs Linux (/proc/self/status VmHWM)")
    layers = sorted(set(args.layers))
    layer = 3 * args.hidden * args.width * args.experts * 2  # one MoE layer's routed experts, bf16
    log(
        f"qwen3_moe hidden {args.hidden}, {args.experts} experts x {args.width}, top-{args.top_k}, bf16; "
        f"one layer's experts = {layer / GB:.3f} GB; depths {layers}"
    )

    variants = [("analyze+grad", None), ("+identity", "identity")]
    if args.heapr or (args.only and "analyze+heapr" in args.only):
        variants.append(("analyze+heapr", "heapr"))
    if args.only:
        variants = [v for v in variants if v[0] in args.only]
    results: dict[tuple[str, int], dict] = {}
    totals: dict[int, int] = {}
    phases: dict[int, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="stream_memory-", dir=args.tmp))
    t_all = time.perf_counter()
    try:
        for n in layers:
            ckpt = work / f"ckpt-L{n}"
            log(f"building {ckpt} ({n} layers, ~{n * layer / GB:.1f} GB)")
            totals[n] = build_checkpoint(ckpt, n, args)
            validate(ckpt, n)
            shard = int(args.shard_mb * MB) if args.shard_mb else int(1.05 * decoder_layer_bytes(ckpt))
            shard = 0 if args.default_shard else shard
            what = f"{shard / MB:.0f} MB" if shard else "the default (5 GB)"
            log(f"  checkpoint {totals[n] / GB:.2f} GB; recipe max_shard_size {what}")
            for name, tail in variants:
                results[name, n] = measure(name, tail, n, ckpt, work, args, shard)
            if args.phases:
                phases[n] = profile(n, ckpt, work, args, shard)
            if not args.keep:
                shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    log(f"done in {time.perf_counter() - t_all:.0f}s" + (f"; kept {work}" if args.keep else ""))

    ref_n = layers[0]
    print(
        f"\nqwen3_moe, hidden {args.hidden}, {args.experts} experts x {args.width}, top-{args.top_k}, bf16, "
        f"calibration random {args.samples} x {args.seq_len} (batch {args.batch_size}); peak RSS = VmHWM of a "
        f"fresh interpreter running moecompress.apply; bound = {LAYER_FACTOR} x one layer + cache\n"
    )
    head = [
        "variant",
        "layers",
        "one layer GB",
        "total ckpt GB",
        "peak RSS GB",
        "baseline GB",
        "peak − baseline GB",
        "cache MB",
        "wall s",
        f"ratio vs {ref_n}L",
        f"bound {LAYER_FACTOR}×layer+cache GB",
        f"ratio ≤ {RATIO_LIMIT}",
        "peak ≤ bound",
    ]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "|".join("---:" for _ in head[1:]) + "|")
    failed = []
    for name, _ in variants:
        for n in layers:
            r = results[name, n]
            ratio = r["peak"] / results[name, ref_n]["peak"]
            bound = LAYER_FACTOR * layer + r["cache_bytes"]
            ok_ratio = "—" if n == ref_n else ("PASS" if ratio <= RATIO_LIMIT else "FAIL")
            ok_bound = "PASS" if r["peak"] <= bound else "FAIL"
            failed += [
                f"{name} {n}L {c}" for c, ok in (("ratio", ok_ratio), ("bound", ok_bound)) if ok == "FAIL"
            ]
            cells = [
                name,
                str(n),
                f"{layer / GB:.3f}",
                f"{totals[n] / GB:.2f}",
                f"{r['peak'] / GB:.2f}",
                f"{r['base'] / GB:.2f}",
                f"{(r['peak'] - r['base']) / GB:.2f}",
                f"{r['cache_bytes'] / MB:.2f}",
                f"{r['wall']:.1f}",
                f"{ratio:.3f}",
                f"{bound / GB:.2f}",
                ok_ratio,
                ok_bound,
            ]
            print("| " + " | ".join(cells) + " |")
    for n, r in phases.items():
        print_phases(n, r, layer)
    print("\nresult: " + ("all conditions PASS" if not failed else "FAIL: " + ", ".join(failed)))


if __name__ == "__main__":
    main()
