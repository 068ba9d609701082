"""The per-layer work at Qwen3-30B widths, one thread: ``rtn``'s quantiser by blocks of rows against an
expert at a time and against the chunk's 8 experts at once (before); the held-back error's forward with the
experts cast one at a time against the whole layer cast at once (the report's reconstruction error); and
calibration's reads of a layer's chunks of 32 experts (2 ranks' chunks) in float32, one read per chunk copied
into the reused chunk buffer as read, against a read per expert copied into it (before) and each chunk stacked
and cast whole (before that); and one process's cast of the layer it
holds whole, into the same buffer against fresh memory (before).

    OMP_NUM_THREADS=1 python benchmarks/layer_work.py [--experts 128] [--rounds 3] [--json OUT]

The layer: random bfloat16 experts of Qwen3-30B-A3B's shape (hidden 2048, width 768, top-8), saved by
transformers' model class to a temporary directory and read back; 256 held-back tokens in float32. Each
round times every variant once, interleaved; the table gives the best round. Both variants of a pair give
the same bits (checked): the block size only changes how the work goes through the cache, the pieces only
when the weights are cast, the buffer only where the chunk's bytes go.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from moecompress.calibration.chunk_buffer import ChunkBuffer
from moecompress.calibration.chunked import cast_into, read_into, ready_bank
from moecompress.engine.chunks import bounds
from moecompress.engine.held_back import forward_by_pieces
from moecompress.io.checkpoint import open_checkpoint
from moecompress.ir import cast_layer, layer_to
from moecompress.methods.scalar_quant import BLOCK, _group_params, quantize_with_error
from moecompress.reference import moe_forward
from moecompress.testing import save_tiny


def layer(experts: int, root: Path):
    """A Qwen3-30B-shaped MoE layer: transformers' own model saved (``root``) and read back by moecompress."""
    save_tiny("qwen3_moe", root, dtype=torch.bfloat16, hidden_size=2048, moe_intermediate_size=768,
              num_experts=experts, num_experts_per_tok=8, num_hidden_layers=1, vocab_size=64,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768)  # fmt: skip
    return open_checkpoint(root)


def chunk_at_once(w: torch.Tensor, bits: int, gs: int):
    """The quantiser before blocks (commit 75cc49e): the chunk's experts as one float32 copy, every step over
    all of it (the same codes, scales and zero points)."""
    m, out, inn = w.shape
    g = w.to(torch.float32, copy=True).reshape(m, out, inn // gs, gs)
    den = g.view(m, -1).norm(dim=1).clamp_min(1e-30)
    scales, s, safe, z = _group_params(g, bits, False)
    q = g.div_(safe[..., None]).round_().add_(z[..., None]).clamp_(0, (1 << bits) - 1)
    codes = q.to(torch.uint8).reshape(m, out, inn)
    num = q.sub_(z[..., None]).mul_(s[..., None]).view(m, -1).sub_(w.reshape(m, -1)).norm(dim=1)
    return codes, scales, z.to(torch.uint8), num / den


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        run(args, layer(args.experts, Path(tmp) / "model"))


def run(args, ckpt) -> None:
    i = ckpt.moe_layer_indices[0]
    lay = ckpt.read_layer(i)
    hx = torch.randn(256, 2048)
    cpu, f32 = torch.device("cpu"), torch.float32
    w = lay.experts.gate.dense()[:8]  # 8 experts: the rtn pass's chunk
    whole = w.shape[1] * w.shape[2]
    a, b, c = quantize_with_error(w, 4, 128, block=whole), quantize_with_error(w, 4, 128), chunk_at_once(w, 4, 128)
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a[:3], b[:3], c[:3], strict=True))
    y0 = moe_forward(layer_to(cast_layer(lay, f32), cpu), hx)
    assert torch.equal(y0, forward_by_pieces(lay, hx, f32, cpu))
    del y0
    buf, parts = ChunkBuffer(), bounds(args.experts, 32)
    for a, b in parts:
        want, got = ready_bank(ckpt.read_experts(i, a, b), f32, cpu), read_into(ckpt, i, a, b, buf, f32, cpu, True)
        assert all(torch.equal(getattr(want, p).weight, getattr(got, p).weight) for p in ("gate", "up", "down"))
    del want, got

    assert torch.equal(cast_into(lay, buf, f32, cpu).experts.down.weight, cast_layer(lay, f32).experts.down.weight)

    def whole_chunks():
        for a, b in parts:
            ready_bank(ckpt.read_experts(i, a, b), f32, cpu)

    def into_buffer():
        for a, b in parts:
            read_into(ckpt, i, a, b, buf, f32, cpu, True)

    def expert_by_expert():  # the eleventh session's read_into: a read per expert, then copied into the buffer
        for a, b in parts:
            outs = None
            for e in range(a, b):
                one = ckpt.read_experts(i, e, e + 1)
                outs = outs or {p: buf.take(p, (b - a, *getattr(one, p).weight.shape[1:]), f32, cpu) for p in ("gate", "up", "down")}
                for p, out in outs.items():
                    out[e - a].copy_(getattr(one, p).weight[0])

    runs = {
        "rtn 8 experts, all at once (before)": lambda: chunk_at_once(w, 4, 128),
        "rtn 8 experts, an expert at a time": lambda: quantize_with_error(w, 4, 128, block=whole),
        f"rtn 8 experts, by blocks of {BLOCK} weights": lambda: quantize_with_error(w, 4, 128),
        "held-back forward, the layer cast at once": lambda: moe_forward(layer_to(cast_layer(lay, f32), cpu), hx),
        "held-back forward, an expert cast at a time": lambda: forward_by_pieces(lay, hx, f32, cpu),
        f"calibration reads, {len(parts)} chunks of 32 stacked and cast (before)": whole_chunks,
        f"calibration reads, {len(parts)} chunks of 32, a read per expert copied into the chunk buffer (before)": expert_by_expert,
        f"calibration reads, {len(parts)} chunks of 32, one read per chunk into the chunk buffer": into_buffer,
        "calibration, the layer held whole cast to float32, fresh (before)": lambda: layer_to(cast_layer(lay, f32), cpu),
        "calibration, the layer held whole cast into the chunk buffer": lambda: cast_into(lay, buf, f32, cpu),
    }
    best = {k: float("inf") for k in runs}
    for _ in range(args.rounds):
        for k, f in runs.items():
            best[k] = min(best[k], timed(f))
    out = {"experts": args.experts, "cpu": platform.processor() or platform.machine(),
           "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "best_s": {k: round(v, 3) for k, v in best.items()}}  # fmt: skip
    print(f"| work | best of {args.rounds} (s) |\n| --- | ---: |")
    for k, v in best.items():
        print(f"| {k} | {v:.3f} |")
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
