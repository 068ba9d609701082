"""Max relative error of ``moe_forward`` against transformers' own MoE block, per adapter and format.

    python benchmarks/oracle_errors.py [--tokens 256] [--seeds 3]

Builds tiny random checkpoints with transformers' classes (``moecompress.testing``), saves them in
the Hub per-expert form and the transformers 5 fused form, reads every MoE layer with
``open_checkpoint(...).read_layer`` and prints a Markdown table of max |ours - HF| / max |HF| (fp32).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import moecompress as mc
from moecompress.testing import MODEL_TYPES, save_tiny


def max_rel_err(model_type: str, fused: bool, tokens: int, seed: int, root: Path) -> float:
    path = root / f"{model_type}-{fused}-{seed}"
    model = save_tiny(model_type, path, fused=fused, seed=seed)
    ckpt = mc.open_checkpoint(path)
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for i in ckpt.moe_layer_indices:
        x = torch.randn(tokens, model.config.hidden_size, generator=g)
        with torch.no_grad():
            out = model.model.layers[i].mlp(x[None])
            want = (out[0] if isinstance(out, tuple) else out)[0]
            got = mc.moe_forward(ckpt.read_layer(i), x)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print("| model_type | hub form | fused form |\n|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for mt in MODEL_TYPES:
            errs = [
                max(max_rel_err(mt, fused, args.tokens, s, Path(tmp)) for s in range(args.seeds))
                for fused in (False, True)
            ]
            print(f"| {mt} | {errs[0]:.1e} | {errs[1]:.1e} |")


if __name__ == "__main__":
    main()
