"""Is a vLLM-vs-transformers difference of an A4 (4-bit activation) output a rounding tie? (issue 35)

Run with the vLLM venv of ``tests/test_vllm_plugin.py``::

    OMP_NUM_THREADS=1 /tmp/vllm-venv/bin/python benchmarks/vllm_a4_tie.py OUTPUT_DIR [eager|compile]

Generates the test's 8 prompts × 32 greedy tokens with vLLM, then replays vLLM's tokens through
transformers' reference path (``moecompress.load``, gradients on, so ``moecompress.reference`` runs the
per-token activation quantiser ``fake_quant_tokens``) and, per generated position, records the logprob
difference and the closest any quantiser input of the position's last token comes to a rounding boundary,
in units of the quantisation step (``|frac((x − lo)/s) − 0.5|``), and for each prompt's first differing
position the closest approach of any of its tokens (vLLM computes each token once and keeps its keys and
values, so a flip at an earlier token changes every later position). A difference whose approach is orders
of magnitude below the median is a rounding tie: float32 summation orders decide the side.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    import test_vllm_plugin as t

    import moecompress as mc
    import moecompress.reference as ref

    path, mode = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "eager")
    got = t.run_vllm(path, mode)
    quantise = ref.fake_quant_tokens
    closest = {"step": 1.0, "any": 1.0}

    def spy(x: torch.Tensor, bits: int) -> torch.Tensor:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        v = ((x - lo) / ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-12)).detach()
        gap = ((v - v.floor()) - 0.5).abs()
        closest["step"] = min(closest["step"], float(gap[..., -1:, :].min()))
        closest["any"] = min(closest["any"], float(gap.min()))  # every token so far, the prompt's included
        return quantise(x, bits)

    ref.fake_quant_tokens = spy  # this process only: a measurement, not the package's behaviour
    net = mc.load(path).eval()
    rows, first = [], []
    for pi, prompt in enumerate(t.PROMPTS):
        seq, seen = list(prompt), False
        for j, tok in enumerate(got["tokens"][pi]):
            closest["step"] = closest["any"] = 1.0
            net.model.embed_tokens.weight.requires_grad_(True)  # the differentiable (reference) path
            logits = net(torch.tensor([seq])).logits[0, -1].detach().float()
            lp = float(torch.log_softmax(logits, -1)[tok])
            rows.append((abs(lp - got["logprobs"][pi][j]), closest["step"], pi, j))
            if rows[-1][0] > 1e-4 and not seen:  # the prompt's first differing position
                first.append((pi, j, rows[-1][0], closest["any"]))
                seen = True
            seq.append(tok)
    rows.sort(reverse=True)
    steps = sorted(r[1] for r in rows)
    print("| logprob diff | closest approach (steps) | prompt | position |\n|---:|---:|---:|---:|")
    for d, c, pi, j in rows[:3]:
        print(f"| {d:.2e} | {c:.2e} | {pi} | {j} |")
    print(f"\nclosest approach over {len(rows)} positions: min {steps[0]:.2e}, median {steps[len(steps) // 2]:.2e}")
    print("\neach prompt's first position differing by more than 1e-4, and the closest approach of any of its tokens")
    print("(the prompt's included: vLLM keeps their keys and values, so a flip there changes every later position):")
    for pi, j, d, c in first:
        print(f"prompt {pi}, position {j}: diff {d:.2e}, closest approach {c:.2e}")


if __name__ == "__main__":
    main()
