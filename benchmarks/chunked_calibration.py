"""Expert-chunked calibration at DeepSeek-V3 shapes: peak RSS at 1 vs 2 MoE layers (issue 18).

    python benchmarks/chunked_calibration.py --workdir /tmp/chunked-cal [--chunk 16] [--samples 16 --seq-len 128]

A DeepSeek-V3 checkpoint with the real shapes (hidden 7168, 256 routed experts of width 2048 plus one
shared, MLA attention, vocabulary 129280, every Linear FP8 e4m3 with 128x128 ``weight_scale_inv``), the
dense first layer and 1 or 2 MoE layers, written as a *sparse* file like ``benchmarks/real_scale.py``
(its shapes helpers): the header, then a hole, except for the tensors that shape the run's data flow,
which are written for real: the embeddings, the norms, the routers (bf16 random, so that tokens spread
over the experts as in a trained model), the score-correction bias and the LM head (so the streamed
backward carries a non-zero gradient). Every FP8 weight reads as zeros but is read, dequantised and
computed with at its full size, so memory and the reading work are those of the real model.

For each MoE depth and each statistics set (``expert_prune`` reap's: forward only; ``heapr``'s: with the
streamed backward), in a fresh process: ``moecompress.calibrate`` with ``expert_chunk: N`` (peak =
``VmHWM``, wall, CPU), the dry run's calibration estimate for the same recipe, and what the dry run
estimates and decides for the same recipe with ``expert_chunk: off`` (not run: it needs more memory than
this machine has). One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import torch

from moecompress.engine.peak import peak_rss_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_scale import _layer_of, _meta_shapes, _per_expert

GiB = 1024**3
STEPS = {"reap": {"expert_prune": {"ratio": 0.25, "method": "reap"}}, "heapr": {"heapr": {"ratio": 0.25}}}


def _values(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor | None:
    """The tensors written for real (bf16, or fp32 for the score bias); ``None``: left a hole (zeros)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if "e_score_correction_bias" in name:
        return torch.zeros(shape, dtype=torch.float32)
    if name.endswith(".mlp.gate.weight") or "embed_tokens" in name or name.startswith("lm_head"):
        return (torch.randn(shape, generator=g) * (1.0 if "embed" in name else 0.05)).to(torch.bfloat16)
    return None


def build(path: Path, moe_layers: int) -> dict:
    from moecompress.io.writer import safetensors_header
    from moecompress.testing_quantized import quantisable

    cfg, shapes = _meta_shapes("deepseek_v3", num_hidden_layers=1 + moe_layers, first_k_dense_replace=1,
                               tie_word_embeddings=False)  # fmt: skip
    shapes = _per_expert(shapes)
    entries, total = [], 0
    for name, shape in sorted(shapes.items()):
        meta = torch.empty(shape, device="meta")
        if quantisable(name, meta) and ".mlp.gate." not in name:
            grid = [math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)]
            entries.append((name, "F8_E4M3", list(shape), math.prod(shape)))
            entries.append((name + "_scale_inv", "F32", grid, 4 * math.prod(grid)))
        else:
            code, size = ("F32", 4) if "e_score_correction_bias" in name else ("BF16", 2)
            entries.append((name, code, list(shape), size * math.prod(shape)))
    total = sum(x[3] for x in entries)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple]] = [[]]
    for entry in sorted(entries, key=lambda x: (_layer_of(x[0]), x[0])):
        if shards[-1] and sum(x[3] for x in shards[-1]) + entry[3] > 4 * 10**9:
            shards.append([])
        shards[-1].append(entry)
    g = torch.Generator().manual_seed(0)
    weight_map, written = {}, 0
    for k, part in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header = safetensors_header(part, {"format": "pt"})
        n = struct.unpack("<Q", header[:8])[0]
        offsets = json.loads(header[8 : 8 + n])
        with open(path / name, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(x[3] for x in part))
            for tname, _, shape, _ in part:
                t = _values(tname, tuple(shape), g)
                if t is None:
                    continue
                f.seek(len(header) + offsets[tname]["data_offsets"][0])
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
                written += t.numel() * t.element_size()
        weight_map.update(dict.fromkeys((x[0] for x in part), name))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    raw = cfg.to_dict()
    raw.update(torch_dtype="bfloat16", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})  # fmt: skip
    (path / "config.json").write_text(json.dumps(raw))
    return {"checkpoint": path.name, "moe_layers": moe_layers, "apparent_gib": round(total / GiB, 2),
            "values_written_gib": round(written / GiB, 2)}  # fmt: skip


WORKER = r"""
import json, sys, time
import moecompress as mc
from moecompress.engine import resources
from moecompress.engine.peak import peak_rss_bytes
from moecompress.engine.dry_run import dry_run
rec, chunk = json.loads(sys.argv[1]), sys.argv[2]
ckpt = mc.open_checkpoint(rec["model"])
est = {}
for mode in ("off", chunk):
    r = mc.load_recipe({**rec, "expert_chunk": mode if mode in ("off", "auto") else int(mode)})
    plan = dry_run(r, ckpt)
    try:
        resources.check(r, plan, ckpt.path.parent, memory=resources.available_memory(), disk_free=None)
        verdict = "runs"
    except mc.MoecompressError as err:
        verdict = str(err)
    est[mode] = {"calibration_estimate": plan["calibration_memory_bytes"], "layer": plan["calibration_layer_bytes"],
                 "verdict": verdict}
base = peak_rss_bytes()
t, c = time.perf_counter(), time.process_time()
mc.calibrate({**rec, "expert_chunk": int(chunk)}, progress=False)
print(json.dumps({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c, "base": base,
                  "peak": peak_rss_bytes(), "estimates": est}))
"""


def measure(path: Path, root: Path, stats: str, chunk: int, samples: int, seq_len: int) -> dict:
    cache = root / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    rec = {"model": str(path), "output": str(root / "out"), "steps": [STEPS[stats]],
           "calibration": {"source": "random", "samples": samples, "seq_len": seq_len, "batch_size": 4,
                           "cache_dir": str(cache)}}  # fmt: skip
    res = subprocess.run([sys.executable, "-c", WORKER, json.dumps(rec), str(chunk)], capture_output=True, text=True,
                         env={**os.environ, "TQDM_DISABLE": "1"})  # fmt: skip
    if res.returncode:
        return {"stats": stats, "error": (res.stderr.strip().splitlines() or ["?"])[-1]}
    m = json.loads(res.stdout.strip().splitlines()[-1])
    est = m["estimates"]
    return {"stats": stats, "chunk": chunk, "calibration": f"{samples} x {seq_len}",
            "peak_rss_gib": round(m["peak"] / GiB, 2), "imports_gib": round(m["base"] / GiB, 2),
            "wall_s": round(m["wall_s"], 1), "cpu_s": round(m["cpu_s"], 1),
            "estimate_gib": round(est[str(chunk)]["calibration_estimate"] / GiB, 2),
            "estimate_over_peak": round(est[str(chunk)]["calibration_estimate"] / m["peak"], 2),
            "unchunked_estimate_gib": round(est["off"]["calibration_estimate"] / GiB, 2),
            "unchunked_layer_gib": round(est["off"]["layer"] / GiB, 2),
            "unchunked_verdict": est["off"]["verdict"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/chunked-cal")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--stats", nargs="*", default=["heapr", "reap"])
    args = ap.parse_args()
    root = Path(args.workdir)
    for stats in args.stats:
        for n in args.layers:
            path = root / f"deepseek-v3-fp8-{n}moe"
            if not (path / "config.json").is_file():
                print(json.dumps(build(path, n)), flush=True)
            row = measure(path, root, stats, args.chunk, args.samples, args.seq_len)
            print(json.dumps({"moe_layers": n, **row}), flush=True)
    print(json.dumps({"driver_peak_rss_gib": round(peak_rss_bytes() / 2**30, 2)}))


if __name__ == "__main__":
    main()
