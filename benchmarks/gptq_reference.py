"""Check moecompress's GPTQ against a maintained implementation: llm-compressor's ``quantize_weight``.

llm-compressor (``llmcompressor.modifiers.gptq.gptq_quantize.quantize_weight``, the GPTQ used to make
vLLM's compressed-tensors checkpoints) runs in its own virtual environment, never as a dependency of
moecompress::

    python -m venv /tmp/peer
    /tmp/peer/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    /tmp/peer/bin/pip install llmcompressor "torch==2.13.0"
    python benchmarks/gptq_reference.py --peer-python /tmp/peer/bin/python

This script (in moecompress's environment) saves a random dense layer ``W`` ``[out, in]`` and a
correlated Hessian ``H = X Xᵀ / n`` with safetensors, runs itself with ``--peer`` in the peer's
interpreter (a subprocess; that mode imports only torch, safetensors and llm-compressor) and compares:

- ``same grid``: llm-compressor computes every group's scale and zero point before the column loop
  (from an observer on the original weights: "static groups"), so it is compared with our
  ``static_groups=True`` (what our ``act_order`` always uses), fed *our* float16 scales and uint8 zero
  points (its signed zero point is ``z − 2^(b−1)``): the grids are identical, so what differs is the
  algorithm and its arithmetic (llm-compressor factorises ``H`` in float32, we in float64).
- ``their grid``: llm-compressor with its own qparams (``calculate_qparams`` on the group min/max:
  float32 scales; symmetric divides ``max|w|`` by ``(2^b − 1)/2`` where we divide by ``2^(b−1) − 1``).
- our default (no act order): group scales computed when the group starts (the paper), against the same.

Reported per setting: the fraction of weights whose dequantised values are identical, the largest
difference in grid steps, and the relative output error ``‖(W − Ŵ)X‖² / ‖WX‖²`` of each side and of RTN.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SETTINGS = [  # (bits, group_size, symmetric, act_order)
    (4, 128, False, False),
    (4, 128, False, True),
    (3, 128, False, False),
    (3, 128, False, True),
    (4, 128, True, False),
    (2, 64, False, True),
]


def _tag(bits: int, gs: int, sym: bool, ao: bool) -> str:
    return f"b{bits}_g{gs}_{'sym' if sym else 'asym'}_{'ao' if ao else 'noao'}"


def peer(inp: Path, out: Path) -> None:
    """Runs in the peer's environment: llm-compressor's GPTQ on the saved layer, every setting."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    t = load_file(str(inp))
    w, h = t["W"], t["H"]
    res = {}
    for bits, gs, sym, ao in SETTINGS:
        tag = _tag(bits, gs, sym, ao)
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=gs,
                                actorder="weight" if ao else None)  # fmt: skip
        # same grid: our fp16 scales, our zero points shifted to the signed range
        s = t[f"{tag}_scales"].float()
        if sym:
            z = torch.zeros_like(s, dtype=torch.int8)
        else:
            z = (t[f"{tag}_zeros"].to(torch.int32) - (1 << (bits - 1))).to(torch.int8)
        q, _, _ = quantize_weight(w[None].clone(), h[None].clone(), s[None], z[None], None, args, 128, 0.01)
        res[f"{tag}_same"] = q[0].contiguous()
        # their grid: calculate_qparams on the original groups' min/max
        g = w.reshape(w.shape[0], -1, gs)
        ts, tz = calculate_qparams(g.amin(-1), g.amax(-1), args)
        q, _, _ = quantize_weight(w[None].clone(), h[None].clone(), ts[None], tz[None], None, args, 128, 0.01)
        res[f"{tag}_theirs"] = q[0].contiguous()
    save_file(res, str(out))


def _layer(out: int, inn: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = inn // 4
    x = torch.randn(inn, r, generator=g) @ torch.randn(r, 4 * inn, generator=g) + 0.3 * torch.randn(
        inn, 4 * inn, generator=g
    )
    x = x * torch.rand(inn, 1, generator=g).add(0.1) + 0.5 * torch.randn(
        inn, 1, generator=g
    )  # scales and means
    w = torch.randn(out, inn, generator=g) * 0.02
    return w, x @ x.T / x.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--peer-python", default="/tmp/peer/bin/python")
    ap.add_argument("--out", type=int, default=256)
    ap.add_argument("--inn", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.peer:
        peer(Path(args.peer[0]), Path(args.peer[1]))
        return
    from moecompress.methods.gptq import gptq_quantize, output_error
    from moecompress.methods.scalar_quant import dequantize, quantize

    if not Path(args.peer_python).exists():
        sys.exit(
            f"error: no peer interpreter at {args.peer_python}; make the venv as the module docstring says"
        )
    w, h = _layer(args.out, args.inn, args.seed)
    tensors, ours = {"W": w, "H": h}, {}
    for bits, gs, sym, ao in SETTINGS:
        tag = _tag(bits, gs, sym, ao)
        q, s, z = gptq_quantize(w, h, bits, gs, sym, ao, 0.01, 128, static_groups=True)
        ours[f"{tag}_static"] = (dequantize(q, s, z, bits), s)
        tensors[f"{tag}_scales"] = s
        if z is not None:
            tensors[f"{tag}_zeros"] = z
        if not ao:
            q, s2, z2 = gptq_quantize(w, h, bits, gs, sym, False, 0.01, 128)
            ours[f"{tag}_paper"] = (dequantize(q, s2, z2, bits), s2)
        ours[f"{tag}_rtn"] = (dequantize(*quantize(w, bits, gs, sym), bits), None)
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = Path(tmp) / "layer.safetensors", Path(tmp) / "peer.safetensors"
        save_file(tensors, str(inp))
        subprocess.run([args.peer_python, __file__, "--peer", str(inp), str(outp)], check=True)
        theirs = load_file(str(outp))
    rows = []
    for bits, gs, sym, ao in SETTINGS:
        tag = _tag(bits, gs, sym, ao)
        mine, s = ours[f"{tag}_static"]
        step = s.float().repeat_interleave(gs, dim=1).clamp_min(1e-30)
        same = theirs[f"{tag}_same"]
        row = {
            "setting": tag,
            "identical_fraction": float((mine == same).float().mean()),
            "max_diff_steps": float(((mine - same).abs() / step).max()),
            "max_abs_diff": float((mine - same).abs().max()),
            "err_ours_static": output_error(w, mine, h),
            "err_peer_same_grid": output_error(w, same, h),
            "err_peer_own_grid": output_error(w, theirs[f"{tag}_theirs"], h),
            "err_rtn": output_error(w, ours[f"{tag}_rtn"][0], h),
        }
        if f"{tag}_paper" in ours:
            row["err_ours_paper"] = output_error(w, ours[f"{tag}_paper"][0], h)
        rows.append(row)
    print(json.dumps({"layer": [args.out, args.inn], "damp": 0.01, "block": 128, "rows": rows}, indent=1))
    keys = ["identical_fraction", "max_diff_steps", "err_ours_static", "err_peer_same_grid", "err_ours_paper",
            "err_peer_own_grid", "err_rtn"]  # fmt: skip
    print("\n| setting | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['setting']} | " + " | ".join(f"{r[k]:.4g}" if k in r else "—" for k in keys) + " |")


if __name__ == "__main__":
    main()
