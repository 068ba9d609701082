"""Real shapes: DeepSeek-V3 (FP8, 128x128 block scales) and gpt-oss-120b (MXFP4) MoE layers.

    python benchmarks/real_scale.py deepseek          # headers only (a sparse file): what each step would need
    python benchmarks/real_scale.py gptoss            # 2 MoE layers written for real (~3.3 GB), then runs

**deepseek**: a DeepSeek-V3 checkpoint with its real shapes (hidden 7168, 256 routed experts of width 2048
plus one shared, MLA attention, vocabulary 129280), the dense first layer and 2 MoE layers, every Linear
weight FP8 e4m3 with ``weight_scale_inv`` block scales — written as a *sparse* file (the safetensors
header, then a hole: ~23 GB of apparent size, no disk used), so only what needs no weight values runs: the
dry run of ``heapr`` (with its streamed backward), ``expert_prune`` and ``rtn`` at 128 x 512 calibration
tokens, its calibration and per-step memory estimates, and what the dry run decides on this machine
(one line: run, or refused with the figure). Peak RSS of the dry run itself is printed.

**gptoss**: gpt-oss-120b's MoE shapes (hidden 2880, 128 experts of width 2880, top-4), MXFP4 experts
(``*_blocks`` / ``*_scales``, random codes and exponents), bf16 attention (64 heads of 64, 8 KV heads) and a
small vocabulary, 2 MoE layers; then ``expert_prune``, ``rtn`` and ``heapr`` each in a fresh process:
peak RSS (``VmHWM``), wall time, bytes read (``/proc/self/io`` ``rchar``) and written (the output's
size on disk), and the extrapolation to the full model (36 MoE layers: per-layer time x 36; memory does not
grow with depth).

Prints one JSON line per measurement; numbers go to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

GiB = 1024**3
CAL = {"source": "random", "samples": 128, "seq_len": 512}
STEPS = {"heapr": {"ratio": 0.25}, "expert_prune": {"ratio": 0.25}, "rtn": {"bits": 4}, "identity": {},
         "gptq": {"bits": 4, "group_size": 128}, "svd_experts": {"ratio": 0.4}, "tdmoe": {"ratio": 0.4},
         "namex": {"ratio": 0.25}, "merge_experts": {"ratio": 0.25}, "codequant": {"bits": 4, "shared": False}}


def _meta_shapes(model_type: str, **cfg) -> tuple[object, dict[str, tuple[int, ...]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    return config, {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _per_expert(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """transformers' fused in-memory expert tensors as the Hub's per-expert names (DeepSeek)."""
    out: dict[str, tuple[int, ...]] = {}
    for k, s in shapes.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", k)
        if m is None:
            out[k] = s
            continue
        e = s[0]
        for x in range(e):
            if m.group(2) == "gate_up_proj":
                out[f"{m.group(1)}.{x}.gate_proj.weight"] = (s[1] // 2, s[2])
                out[f"{m.group(1)}.{x}.up_proj.weight"] = (s[1] // 2, s[2])
            else:
                out[f"{m.group(1)}.{x}.down_proj.weight"] = (s[1], s[2])
    return out


def _layer_of(name: str) -> int:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return -1 if m is None else int(m.group(1))


def deepseek_checkpoint(
    root: Path, moe_layers: int = 2, experts: int = 256, vocab: int | None = None
) -> Path:
    """The sparse DeepSeek-V3-shaped FP8 checkpoint (the dense first layer and ``moe_layers`` MoE layers);
    ``experts`` < 256 keeps every shape but the routed-expert count (``n_group`` 8, ``topk_group`` 4)."""
    from moecompress.io.writer import safetensors_header
    from moecompress.testing_quantized import quantisable

    extra = {} if vocab is None else {"vocab_size": vocab}
    cfg, shapes = _meta_shapes(
        "deepseek_v3",
        num_hidden_layers=1 + moe_layers,
        first_k_dense_replace=1,
        tie_word_embeddings=False,
        n_routed_experts=experts,
        **extra,
    )  # every other size is DeepSeek-V3's (transformers' defaults for the config are the release's)
    shapes = _per_expert(shapes)
    entries, total = [], 0
    for name, shape in sorted(shapes.items()):
        meta = torch.empty(shape, device="meta")
        if quantisable(name, meta) and ".mlp.gate." not in name:
            grid = [math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)]
            for n, code, shp, size in ((name, "F8_E4M3", list(shape), math.prod(shape)),
                                       (name + "_scale_inv", "F32", grid, 4 * math.prod(grid))):  # fmt: skip
                entries.append((n, code, shp, size))
                total += size
        else:
            size = 2 * math.prod(shape) if "e_score_correction_bias" not in name else 4 * math.prod(shape)
            entries.append((name, "F32" if "e_score_correction_bias" in name else "BF16", list(shape), size))
            total += size
    path = root / f"deepseek-v3-fp8-{moe_layers}l-{experts}e"
    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple]] = [[]]
    for entry in sorted(entries, key=lambda x: (_layer_of(x[0]), x[0])):  # ~4 GB shards, as releases have
        if shards[-1] and sum(x[3] for x in shards[-1]) + entry[3] > 4 * 10**9:
            shards.append([])
        shards[-1].append(entry)
    weight_map = {}
    for k, part in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header = safetensors_header(part, {"format": "pt"})
        with open(path / name, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(x[3] for x in part))  # a hole: the dry run reads headers only
        weight_map.update(dict.fromkeys((x[0] for x in part), name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))  # fmt: skip
    raw = cfg.to_dict()
    raw.update(
        torch_dtype="bfloat16",
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )
    (path / "config.json").write_text(json.dumps(raw))
    used = sum(os.stat(p).st_blocks * 512 for p in path.glob("*.safetensors"))
    print(json.dumps({"checkpoint": path.name, "apparent_gib": round(total / GiB, 2), "shards": len(shards),
                      "disk_used_gib": round(used / GiB, 3)}))  # fmt: skip
    return path


def fill_checkpoint(path: Path, seed: int = 0, chunk: int = 1 << 26) -> None:
    """Write values into the sparse checkpoint's holes (``--fill``): FP8 codes of N(0, 1) with block scales
    ``scale_inv`` 0.01 (expert weights of std ~0.01, as 1/sqrt(hidden)), norms 1, the router N(0, 1/H),
    every other bf16 tensor N(0, 0.02²), the score bias 0, so calibration sees real activations and
    GPTQ real Hessians (a hole reads as zeros: every expert would fall back to round-to-nearest)."""
    g = torch.Generator().manual_seed(seed)
    for shard in sorted(path.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            base = 8 + n
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                a, b = meta["data_offsets"]
                f.seek(base + a)
                count = math.prod(meta["shape"])
                for k in range(0, count, chunk):
                    m = min(chunk, count - k)
                    if meta["dtype"] == "F8_E4M3":
                        t = torch.randn(m, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
                    elif meta["dtype"] == "F32":
                        t = torch.full((m,), 0.0 if "bias" in name else 0.01, dtype=torch.float32)
                    elif name.endswith("norm.weight"):
                        t = torch.ones(m, dtype=torch.bfloat16)
                    else:
                        std = meta["shape"][-1] ** -0.5 if ".mlp.gate." in name else 0.02
                        t = (torch.randn(m, generator=g) * std).to(torch.bfloat16)
                    f.write(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes())
                assert f.tell() == base + b, name


def deepseek(root: Path) -> None:
    path = deepseek_checkpoint(root)
    import moecompress as mc
    from moecompress.engine import resources
    from moecompress.engine.dry_run import dry_run
    from moecompress.engine.peak import peak_rss_bytes

    ckpt = mc.open_checkpoint(path)
    for name, cfg_step in STEPS.items():
        rec = mc.load_recipe({"model": str(path), "output": str(root / f"out-{name}"), "steps": [{name: cfg_step}],
                              "calibration": CAL})  # fmt: skip
        t = time.perf_counter()
        dry = dry_run(rec, ckpt)  # the plan; apply(dry_run=True) adds the check below and raises its line
        step = max(dry["step_memory"].values(), key=lambda v: v["bytes"])
        try:
            resources.check(rec, dry, root, memory=resources.available_memory(), disk_free=None)
            verdict = "runs"
        except mc.MoecompressError as err:
            verdict = str(err)
        print(json.dumps({"model": "deepseek-v3 fp8", "step": name, "dry_run_s": round(time.perf_counter() - t, 1),
                          "calibration_estimate_gib": round(dry["calibration_memory_bytes"] / GiB, 1),
                          "step_estimate_gib": round(step["bytes"] / GiB, 1),
                          "input_layer_gib": round(step["input_bytes"] / GiB, 1),
                          "dequantize_output": dry["dequantize_output"],
                          "available_gib": round((resources.available_memory() or 0) / GiB, 1), "verdict": verdict,
                          "dry_run_peak_rss_gib": round(peak_rss_bytes() / 2**30, 2)}))  # fmt: skip


def gptoss_checkpoint(path: Path, layers: int = 2) -> int:
    from moecompress.io.writer import ShardWriter

    cfg, shapes = _meta_shapes(
        "gpt_oss", num_hidden_layers=layers, hidden_size=2880, intermediate_size=2880, num_local_experts=128,
        num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=2048,
        layer_types=["full_attention"] * layers, tie_word_embeddings=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    total = 0
    with ShardWriter(path, max_shard_size="2GB") as w:
        for name, shape in shapes.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, rows, cols = shape[0], shape[2], shape[1]  # stored out-major: [E, out, in/32, 16]
                for suffix, shp, lo, hi in (("_blocks", (e, rows, cols // 32, 16), 0, 256),
                                            ("_scales", (e, rows, cols // 32), 119, 124)):  # fmt: skip
                    pieces = (
                        torch.randint(lo, hi, (1, *shp[1:]), generator=g, dtype=torch.uint8) for _ in range(e)
                    )
                    w.add_pieces(name + suffix, torch.uint8, shp, pieces)
                    total += math.prod(shp)
                continue
            if name.endswith("norm.weight") or "sinks" in name:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.randn(shape, generator=g).mul_(0.5 if "router" in name else 0.02).to(torch.bfloat16)
            w.add(name, t)
            total += t.numel() * 2
        raw = cfg.to_dict()
        raw.update(torch_dtype="bfloat16", quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})  # fmt: skip
        w.write_json("config.json", raw)
        w.commit()
    return total


WORKER = r"""
import json, resource, sys, time
import moecompress as mc
from moecompress.engine.peak import peak_rss_bytes
rec = json.loads(sys.argv[1])
t = time.perf_counter()
(mc.calibrate if len(sys.argv) > 2 else mc.apply)(rec, progress=False)
wall = time.perf_counter() - t
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": wall, "peak": peak_rss_bytes(), "read": int(io["rchar"]), "cpu_s": use.ru_utime,
                  "sys_s": use.ru_stime, "disk_read": int(io["read_bytes"])}))
"""


def gptoss(root: Path, steps: list[str], samples: int, seq_len: int, layers: int = 2, chunk: str = "auto",
           limit: str | None = None, source: str = "random") -> None:  # fmt: skip
    path = root / f"gpt-oss-120b-mxfp4-{layers}l"
    if not path.exists():
        t = time.perf_counter()
        size = gptoss_checkpoint(path, layers)
        print(
            json.dumps(
                {
                    "checkpoint": path.name,
                    "gib": round(size / GiB, 2),
                    "build_s": round(time.perf_counter() - t, 1),
                }
            )
        )
    for name in steps:
        out = root / f"out-{name}"
        cal = {"source": "none"} if source == "none" else {**CAL, "samples": samples, "seq_len": seq_len}
        cal = {**cal, "memory_limit": limit} if limit else cal
        rec = {"model": str(path), "output": str(out), "steps": [{name: STEPS[name]}], "expert_chunk": chunk,
               "calibration": {**cal, "cache_dir": str(root / f"cache-{name}")}}  # fmt: skip
        res = subprocess.run([sys.executable, "-c", WORKER, json.dumps(rec)], capture_output=True, text=True)
        if res.returncode:
            print(json.dumps({"step": name, "layers": layers, "expert_chunk": chunk,
                              "error": (res.stderr.strip().splitlines() or ["?"])[-1][:400]}))  # fmt: skip
            continue
        m = json.loads(res.stdout.strip().splitlines()[-1])
        written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        report = json.loads((out / "report.json").read_text())
        per_layer = sum(s["seconds"] for s in report["steps"]) / layers
        print(json.dumps({"model": f"gpt-oss-120b shapes, mxfp4, {layers} MoE layers", "step": name,
                          "expert_chunk": chunk, "chunks": report["dry_run"].get("expert_chunk"), "memory_limit": limit,
                          "calibration": source if source == "none" else f"{samples} x {seq_len}",
                          "peak_rss_gib": round(m["peak"] / GiB, 2),
                          "wall_s": round(m["wall_s"], 1), "cpu_s": round(m["cpu_s"], 1), "sys_s": round(m.get("sys_s", 0), 1),
                          "disk_read_gib": round(m.get("disk_read", 0) / GiB, 2),
                          "read_gib": round(m["read"] / GiB, 2), "written_gib": round(written / GiB, 2),
                          "calibration_s": report["calibration"].get("seconds"), "step_s_per_layer": round(per_layer, 1),
                          "full_model_36_layers_h": round((m["wall_s"] / layers) * 36 / 3600, 2)}))  # fmt: skip
        subprocess.run(["rm", "-rf", str(out), str(root / f"cache-{name}")], check=False)


def run_estimate(dry: dict) -> int:
    """The dry run's estimate of the whole run's peak: calibration, the copy of the non-MoE tensors, the steps."""
    steps = max((v["bytes"] for v in dry["step_memory"].values()), default=0)
    return max(dry["calibration_memory_bytes"], dry.get("copy_memory_bytes", 0), steps)


def deepseek_run(root: Path, steps: list[str], moe_layers: int, chunk: str, limit: str | None, samples: int,
                 seq_len: int, source: str, experts: int = 256, vocab: int | None = None,
                 fill: bool = False, calibrate_only: bool = False, keep_cache: bool = False) -> None:  # fmt: skip
    """The layer loop on the sparse DeepSeek-V3 checkpoint (its weights read as zeros; ``fill``: random
    values written in, :func:`fill_checkpoint`) in a fresh process: peak RSS, wall time, bytes read and
    written; ``source: none`` needs no calibration. ``calibrate_only``: ``moecompress calibrate`` of the
    recipe (a fresh statistics cache): its peak against the dry run's calibration estimate; ``keep_cache``:
    the cache stays for the next ``--run`` of the same step (which then reads it: the step alone is timed)."""
    path = root / f"deepseek-v3-fp8-{moe_layers}l-{experts}e"
    if fill and not (path / "filled").exists():
        shutil.rmtree(path, ignore_errors=True)
    if not path.exists():
        deepseek_checkpoint(root, moe_layers, experts, vocab)
        if fill:
            t = time.perf_counter()
            fill_checkpoint(path)
            (path / "filled").write_text("random values written by fill_checkpoint\n")
            print(json.dumps({"filled": path.name, "fill_s": round(time.perf_counter() - t, 1)}))
    for name in steps:
        out = root / f"out-{name}-{moe_layers}l-{chunk}"
        cal = {"source": "none"} if source == "none" else {**CAL, "samples": samples, "seq_len": seq_len}
        if limit:
            cal["memory_limit"] = limit
        rec = {"model": str(path), "output": str(out), "steps": [{name: STEPS[name]}], "expert_chunk": chunk,
               "max_shard_size": "2GB", "calibration": {**cal, "cache_dir": str(root / f"cache-{name}")}}  # fmt: skip
        if calibrate_only:
            shutil.rmtree(root / f"cache-{name}", ignore_errors=True)
        res = subprocess.run([sys.executable, "-c", WORKER, json.dumps(rec), *(["calibrate"] if calibrate_only else [])],
                             capture_output=True, text=True)  # fmt: skip
        line = {"model": f"deepseek-v3 fp8{' (filled)' if fill else ''}, {moe_layers} MoE layer(s) of {experts} experts", "step": name,
                "config": STEPS[name], "expert_chunk": chunk,
                "memory_limit": limit, "calibration": source if source == "none" else f"{samples} x {seq_len}"}  # fmt: skip
        if res.returncode:
            print(json.dumps({**line, "error": (res.stderr.strip().splitlines() or ["?"])[-1][:400]}))
            continue
        m = json.loads(res.stdout.strip().splitlines()[-1])
        if calibrate_only:
            from moecompress.engine.dry_run import dry_run  # the estimate, in this process

            dry = dry_run(__import__("moecompress").load_recipe(rec), __import__("moecompress").open_checkpoint(path))
            cache = sum(p.stat().st_size for p in (root / f"cache-{name}").rglob("*") if p.is_file())
            print(json.dumps({**line, "calibrate_only": True, "chunks": dry.get("expert_chunk"),
                              "peak_rss_gib": round(m["peak"] / GiB, 2),
                              "calibration_estimate_gib": round(dry["calibration_memory_bytes"] / GiB, 2),
                              "stats_estimate_gib": round(dry["calibration_stats_bytes"] / GiB, 2),
                              "wall_s": round(m["wall_s"], 1), "cpu_s": round(m["cpu_s"], 1), "sys_s": round(m.get("sys_s", 0), 1),
                              "disk_read_gib": round(m.get("disk_read", 0) / GiB, 2),
                              "cache_gib": round(cache / GiB, 2)}))  # fmt: skip
            if not keep_cache:
                shutil.rmtree(root / f"cache-{name}", ignore_errors=True)
            continue
        written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        report = json.loads((out / "report.json").read_text())
        step_reports = [json.loads(f.read_text()) for f in sorted(out.glob("steps/*/report.json"))]
        per_layer = [r.get("summary", {}).get("per_layer") for r in step_reports]  # e.g. codequant's steps run
        print(json.dumps({**line, "chunks": report["dry_run"].get("expert_chunk"), "peak_rss_gib": round(m["peak"] / GiB, 2),
                          "per_layer": [p for p in per_layer if p],
                          "step_estimate_gib": round(max(v["bytes"] for v in report["dry_run"]["step_memory"].values()) / GiB, 2),
                          "run_estimate_gib": round(run_estimate(report["dry_run"]) / GiB, 2),
                          "wall_s": round(m["wall_s"], 1), "cpu_s": round(m["cpu_s"], 1), "sys_s": round(m.get("sys_s", 0), 1),
                          "disk_read_gib": round(m.get("disk_read", 0) / GiB, 2),
                          "read_gib": round(m["read"] / GiB, 2), "written_gib": round(written / GiB, 2),
                          "step_s_per_layer": round(sum(s["seconds"] for s in report["steps"]) / moe_layers, 1)}))  # fmt: skip
        subprocess.run(["rm", "-rf", str(out)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["deepseek", "gptoss"])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--steps", nargs="*", default=["heapr", "expert_prune", "rtn", "identity", "gptq"], choices=list(STEPS))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--run", action="store_true", help="deepseek: run the layer loop (not only the dry run)")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--expert-chunk", default="auto")
    ap.add_argument("--memory-limit", default=None)
    ap.add_argument("--source", default="random", help="calibration source (none: data-free)")
    ap.add_argument("--experts", type=int, default=256, help="deepseek: routed experts per layer (real: 256)")
    ap.add_argument("--vocab", type=int, default=None, help="deepseek: vocabulary (real: 129280)")
    ap.add_argument("--fill", action="store_true", help="deepseek --run: write random values into the holes")
    ap.add_argument("--calibrate-only", action="store_true", help="deepseek --run: calibration alone, peak vs estimate")
    ap.add_argument("--keep-cache", action="store_true", help="deepseek --calibrate-only: keep the statistics for the next --run")
    ap.add_argument("--set", nargs="*", default=[], metavar="STEP.FIELD=JSON",
                    help="override a step's field, e.g. codequant.finetune_steps=10 (null: leave it unset)")
    args = ap.parse_args()
    for item in args.set:  # this run's step configs (printed with each measurement)
        key, value = item.split("=", 1)
        step, field = key.split(".", 1)
        STEPS[step] = {k: v for k, v in {**STEPS[step], field: json.loads(value)}.items() if v is not None}  # null: unset
    args.expert_chunk = int(args.expert_chunk) if args.expert_chunk.isdigit() else args.expert_chunk
    root = Path(args.workdir or tempfile.mkdtemp(prefix="real-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    if args.what == "deepseek" and args.run:
        deepseek_run(root, args.steps, args.moe_layers, args.expert_chunk, args.memory_limit, args.samples,
                     args.seq_len, args.source, args.experts, args.vocab, args.fill, args.calibrate_only,
                     args.keep_cache)  # fmt: skip
    elif args.what == "deepseek":
        deepseek(root)
    else:
        gptoss(root, args.steps, args.samples, args.seq_len, args.moe_layers, args.expert_chunk, args.memory_limit,
               args.source)  # fmt: skip


if __name__ == "__main__":
    main()
