"""Dequantisation on access at real expert shapes: time per expert and peak memory of the reader.

Writes synthetic shards with real per-expert shapes (DeepSeek-V3 FP8 128x128 blocks: gate/up
``[2048, 7168]``, down ``[7168, 2048]``; compressed-tensors int4 group-128 at the same shapes, packed by
the library's compressor; gpt-oss-120b MXFP4: ``gate_up_proj_blocks [E, 5760, 90, 16]``,
``down_proj_blocks [E, 2880, 90, 16]``), then, in a fresh process, reads every expert through
:class:`moecompress.io.quantized.QuantizedReader` into bf16 one tensor at a time, keeping nothing, and
prints CPU time per expert (``time.thread_time``: the shared machine's wall time is noisy) and the read
process's peak RSS next to one dequantised expert's size::

    python benchmarks/quantized_dequant.py [--experts 4] [--dir /tmp/qbench]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from moecompress.engine.peak import peak_rss_bytes

DSV3 = {"gate_proj": (2048, 7168), "up_proj": (2048, 7168), "down_proj": (7168, 2048)}


def make(root: Path, experts: int) -> None:
    from moecompress.testing_quantized import ct_scheme, quantize_fp8_block, quantize_mxfp4

    g = torch.Generator().manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    fp8, ct = {}, {}
    from compressed_tensors.compressors import BaseCompressor

    from moecompress.testing_quantized import _ct_qparams

    scheme, fmt = ct_scheme("w4-group")
    scheme.weights.group_size = 128
    comp = BaseCompressor.get_value_from_registry(fmt)
    for e in range(experts):
        for p, shape in DSV3.items():
            w = 0.02 * torch.randn(shape, generator=g)
            k = f"e.{e}.{p}.weight"
            fp8[k], fp8[f"{k}_scale_inv"] = quantize_fp8_block(w)
            s, _ = _ct_qparams(w, scheme.weights)
            ct.update(
                {
                    f"e.{e}.{p}.{n}": v
                    for n, v in comp.compress({"weight": w, "weight_scale": s}, scheme).items()
                }
            )
    for name, tensors in (("fp8", fp8), ("ct", ct)):
        (root / name).mkdir(exist_ok=True)
        save_file(tensors, str(root / name / "model.safetensors"))
    mx = {}
    for p, (rows, cols) in {"gate_up_proj": (5760, 2880), "down_proj": (2880, 2880)}.items():
        parts = [quantize_mxfp4(0.02 * torch.randn(1, rows, cols, generator=g)) for _ in range(experts)]
        mx[f"x.{p}_blocks"] = torch.cat([b for b, _ in parts])
        mx[f"x.{p}_scales"] = torch.cat([s for _, s in parts])
    (root / "mxfp4").mkdir(exist_ok=True)
    save_file(mx, str(root / "mxfp4" / "model.safetensors"))
    (root / "ct.json").write_text(json.dumps({"scheme": scheme.model_dump(mode="json"), "format": fmt}))


def read(root: Path, which: str) -> dict:
    from moecompress.io.quantized import QuantizedReader
    from moecompress.io.reader import ShardReader

    raw = ShardReader(root / which)
    if which == "fp8":
        from moecompress.io.quantized_fp8 import Fp8Block

        fmt = Fp8Block({"quant_method": "fp8", "weight_block_size": [128, 128]}, "bench")
    elif which == "mxfp4":
        from moecompress.io.quantized_mxfp4 import Mxfp4Input

        fmt = Mxfp4Input({"quant_method": "mxfp4"}, "bench")
    else:
        from moecompress.io.quantized_ct import CompressedTensorsInput

        meta = json.loads((root / "ct.json").read_text())
        qc = {"quant_method": "compressed-tensors", "format": meta["format"], "quantization_status": "compressed",
              "config_groups": {"group_0": meta["scheme"]}}  # fmt: skip
        fmt = CompressedTensorsInput(qc, "bench")
    view = QuantizedReader(raw, fmt, torch.bfloat16)
    names = view.quantized
    t0 = time.thread_time()
    nbytes = 0
    for n in names:
        t = view.get(n)
        nbytes = max(nbytes, t.numel() * t.element_size())
        del t
    cpu = time.thread_time() - t0
    experts = len(names) / 3 if which != "mxfp4" else raw.shape(names[0] + "_blocks")[0]
    return {"format": which, "tensors": len(names), "experts": experts, "cpu_s_per_expert": cpu / experts,
            "largest_tensor_mib": nbytes / 2**20, "peak_rss_mib": peak_rss_bytes() / 2**20}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qbench"))
    ap.add_argument("--read", choices=["fp8", "ct", "mxfp4", "none"])
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.read == "none":  # the imports alone
        import transformers.integrations.mxfp4  # noqa: F401

        import moecompress.io.quantized_ct  # noqa: F401

        print(peak_rss_bytes() / 2**20)
        return
    if a.read:
        print(json.dumps(read(a.dir, a.read)))
        return
    make(a.dir, a.experts)
    base = subprocess.run([sys.executable, __file__, "--read", "none", "--dir", str(a.dir)], capture_output=True,
                          text=True, check=True).stdout.strip().splitlines()[-1]  # fmt: skip
    print(f"baseline RSS of the imports alone: {float(base):.0f} MiB")
    for which in ("fp8", "ct", "mxfp4"):
        out = subprocess.run([sys.executable, __file__, "--read", which, "--dir", str(a.dir)], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]  # fmt: skip
        print(out)


if __name__ == "__main__":
    main()
