"""Peak memory of streaming a checkpoint layer by layer, for models of different depth.

Builds synthetic qwen3_moe checkpoints with transformers' own classes (same per-layer shapes, only the
number of layers differs), then measures, each in a fresh interpreter, the growth of peak RSS over
the baseline (peak once torch, transformers and moecompress are imported and the checkpoint is open):

* read    -- ``read_layer`` for every MoE layer plus that layer's other tensors (``get_many``),
             every tensor touched, references dropped each iteration;
* rewrite -- ``rewrite_checkpoint`` with ``max_shard_size`` of one whole decoder layer + 2% (the
             buffer holds one layer and is flushed before the next is read), or ``--rewrite-shard-mb``;
* load-all (reference) -- ``reader.get_many(reader.keys)``, touched: what unbounded looks like.

If streaming is bounded, read and rewrite growth do not change with depth (ratio ~1), while load-all
grows with the model.

Probes run with ``MALLOC_MMAP_THRESHOLD_=131072`` (see ``--malloc-default``) so that RSS tracks live
memory rather than glibc's heap retention. The peak is ``VmHWM`` from ``/proc/self/status`` (Linux
only), not ``ru_maxrss``: Linux carries ``ru_maxrss`` across ``execve`` from the parent, which has
just built the model.

    python benchmarks/stream_read_memory.py                      # 2 and 6 layers, ~100 MB per layer
    python benchmarks/stream_read_memory.py --layers 2 6 12 --dtype bfloat16 --hidden 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

MB = 1e6

# Runs in a fresh interpreter; prints one JSON line. argv: mode, src[, dst, max_shard_size].
PROBE = r"""
import gc, json, sys

def touch(t):
    if t is not None:
        float(t.sum())

import moecompress as mc
from moecompress.engine.peak import peak_rss_bytes as peak

mode, src = sys.argv[1], sys.argv[2]
ckpt = mc.open_checkpoint(src)
r = ckpt.reader
groups = dict(ckpt.key_groups())
gc.collect()
base = peak()
if mode == "read":
    for i in ckpt.moe_layer_indices:
        layer = ckpt.read_layer(i)
        for t in (layer.experts.gate.weight, layer.experts.up.weight, layer.experts.down.weight,
                  layer.router_weight):
            touch(t)
        owned = set(ckpt.moe_keys(i))
        rest = r.get_many([k for k in groups[i] if k not in owned])
        for t in rest.values():
            touch(t)
        del layer, rest, t
    rest = r.get_many(groups.get(None, []))
    for t in rest.values():
        touch(t)
    del rest
elif mode == "all":
    everything = r.get_many(r.keys)
    for t in everything.values():
        touch(t)
elif mode == "rewrite":
    mc.rewrite_checkpoint(src, sys.argv[3], max_shard_size=int(sys.argv[4]), progress=False)
else:
    raise SystemExit(f"unknown mode {mode}")
print(json.dumps({"base": base, "growth": peak() - base}))
"""


def build(path: Path, layers: int, args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(
            "qwen3_moe",
            hidden_size=args.hidden,
            num_hidden_layers=layers,
            num_experts=args.experts,
            moe_intermediate_size=args.moe_intermediate,
            num_experts_per_tok=2,
            intermediate_size=64,
            head_dim=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=args.vocab,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
    shard_mb = max(1, int(1.5 * layer_bytes(args) / MB))  # several shards; shards cross layer boundaries
    model.save_pretrained(path, max_shard_size=f"{shard_mb}MB", save_original_format=True)
    del model


def decoder_layer_bytes(path: Path) -> int:
    """Bytes of the largest decoder layer (experts, router, attention, norms), from the headers."""
    import moecompress as mc

    ckpt = mc.open_checkpoint(path)
    return max(sum(ckpt.reader.nbytes(k) for k in keys) for i, keys in ckpt.key_groups() if i is not None)


def layer_bytes(args: argparse.Namespace) -> int:
    """Bytes of one MoE layer's routed experts."""
    elem = 4 if args.dtype == "float32" else 2
    return 3 * args.hidden * args.moe_intermediate * args.experts * elem


def measure(mode: str, *argv: str | Path, malloc_default: bool = False) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if not malloc_default:
        # A fixed glibc mmap threshold (no dynamic raise) hands every freed tensor straight back to the OS;
        # otherwise freed layers sometimes linger in the heap and add up to ~1 layer of noise to the peak.
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode, *map(str, argv)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"probe {mode} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 6], help="model depths to compare")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--rewrite-shard-mb", type=float, default=None, help="default: one decoder layer + 2%%")
    ap.add_argument(
        "--malloc-default",
        action="store_true",
        help="keep glibc's dynamic mmap threshold (adds heap-retention noise of up to ~1 layer)",
    )
    ap.add_argument("--no-load-all", action="store_true", help="skip the load-everything reference column")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where to build checkpoints (default: a tmp dir)"
    )
    args = ap.parse_args()
    if not Path("/proc/self/status").is_file():
        raise SystemExit("needs Linux (/proc/self/status VmHWM)")

    lb = layer_bytes(args)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="stream_read_memory-") as tmp:
        for n in sorted(set(args.layers)):
            t0 = time.perf_counter()
            src = Path(tmp) / f"L{n}"
            build(src, n, args)
            total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            md = args.malloc_default
            read = measure("read", src, malloc_default=md)
            shard = (
                int(args.rewrite_shard_mb * MB)
                if args.rewrite_shard_mb
                else int(1.02 * decoder_layer_bytes(src))
            )
            rewrite = measure("rewrite", src, Path(tmp) / f"L{n}-rewritten", shard, malloc_default=md)
            load_all = None if args.no_load_all else measure("all", src, malloc_default=md)
            rows.append((n, total, read, rewrite, load_all))
            shards = len(list(src.glob("*.safetensors")))
            print(f"  {n} layers ({shards} shards) done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            for p in [src, Path(tmp) / f"L{n}-rewritten"]:
                for f in p.glob("*"):
                    f.unlink()

    ref = rows[0]
    print(
        f"\nqwen3_moe, hidden {args.hidden}, {args.experts} experts x {args.moe_intermediate}, {args.dtype}; "
        f"rewrite max_shard_size = {shard / MB:.1f} MB; growth of peak RSS (VmHWM) over the baseline\n"
    )
    head = ["layers", "layer MB", "total MB", "read peak growth MB", "rewrite peak growth MB"]
    if not args.no_load_all:
        head.append("load-all growth MB (reference)")
    head.append(f"ratio vs {ref[0]} layers (read / rewrite)")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for n, total, read, rewrite, load_all in rows:
        cells = [str(n), f"{lb / MB:.1f}", f"{total / MB:.1f}", f"{read / MB:.1f}", f"{rewrite / MB:.1f}"]
        if load_all is not None:
            cells.append(f"{load_all / MB:.1f}")
        cells.append(f"{read / ref[2]:.2f} / {rewrite / ref[3]:.2f}")
        print("| " + " | ".join(cells) + " |")
    print(
        "\nread and rewrite growth in units of one layer: "
        + ", ".join(f"{n}L: {read / lb:.2f} / {rewrite / lb:.2f}" for n, _, read, rewrite, _ in rows)
    )


if __name__ == "__main__":
    main()
