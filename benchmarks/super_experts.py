"""Super experts on the reference models: the magnitude profile, a planted super expert, and what
ablating each expert of that layer does to perplexity.

    python benchmarks/super_experts.py [--shared ../shared] [--samples 64] [--seq-len 256] [--eval-tokens 4096]

1. ``protect_super_experts`` (defaults: P99.5, 0.1 x max, first 75 % of MoE layers) on each reference
   model, calibrated on the corpus; prints the per-layer top magnitudes (the paper's Table 1 view).
2. Plants a super expert in ref-qwen3moe: row ``CHANNEL`` of expert ``EXPERT``'s down projection in
   MoE layer ``LAYER`` is scaled x100, so whenever that expert runs, output channel ``CHANNEL`` carries
   a massive activation. Profiles again: the profiler must report exactly that expert.
3. Ablates (``ablate_experts``) each expert of that layer in turn, in the planted model and in the
   original, and evaluates perplexity on the held-out split of the corpus (``moecompress eval``).
4. Compresses the planted model with ``heapr`` (ratio 0.5) and ``expert_prune`` (ratio 0.5, reap and
   frequency),
   with and without ``protect_super_experts`` first: is the planted expert kept bit-identical, what is
   left of the top massive activation of its layer (step report), and perplexity.
   ``--compress-only`` runs only this part.
5. ``--finetune-steps N``: a planted outlier in a trained model is harmful, not load-bearing. To get a
   super expert the model depends on, the planted model is fine-tuned for N steps with the planted
   expert and its layer's router frozen; the profile, the ablation table and step 4 then run on it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import moecompress as mc

LAYER, EXPERT, CHANNEL, SCALE = 1, 3, 5, 100.0
MODELS = ["ref-qwen3moe", "ref-mixtral", "ref-deepseekv3"]


def profile(model: Path, out: Path, cal: dict) -> dict:
    mc.apply({"model": str(model), "output": str(out), "calibration": cal, "steps": [{"protect_super_experts": {}}]},
             progress=False)  # fmt: skip
    return json.loads((out / "steps" / "01-protect_super_experts" / "report.json").read_text())


def ablation_ppl(
    model: Path, work: Path, cal: dict, texts: list[str], tokens: int, n_experts: int
) -> list[float]:
    out = []
    for e in range(n_experts):
        dst = work / f"ablate-{e}"
        step = {"ablate_experts": {"experts": [{"layer": LAYER, "experts": [e]}]}}
        mc.apply(
            {"model": str(model), "output": str(dst), "calibration": cal, "steps": [step]}, progress=False
        )
        out.append(mc.evaluate(dst, texts=texts, max_tokens=tokens)["perplexity"])
        shutil.rmtree(dst)
    return out


COMPRESS = [("heapr 50%", {"heapr": {"ratio": 0.5}}),
            ("expert_prune 50% (reap)", {"expert_prune": {"ratio": 0.5, "method": "reap"}}),
            ("expert_prune 50% (frequency)", {"expert_prune": {"ratio": 0.5, "method": "frequency"}})]  # fmt: skip


def compression_on_planted(planted: Path, work: Path, cal: dict, texts: list[str], tokens: int) -> None:
    """Issue acceptance: heapr and expert_prune at 50% with and without protection of the planted expert."""
    orig = mc.open_checkpoint(planted).read_layer(LAYER).experts
    ppl0 = mc.evaluate(planted, texts=texts, max_tokens=tokens)["perplexity"]
    print(f"\n## Compressing the planted model (layer {LAYER}, expert {EXPERT}; perplexity {ppl0:.2f})\n")
    print("| step | protected | planted expert after | bit-identical | massive ratio (layer) | perplexity |")
    print("|---|---|---|---|---:|---:|")
    for label, step in COMPRESS:
        for protect in (True, False):
            out = work / f"compress-{label.split()[0]}-{label[-8:-1]}-{protect}"
            steps = [{"protect_super_experts": {}}] if protect else []
            mc.apply({"model": str(planted), "output": str(out), "calibration": cal, "steps": [*steps, step]},
                     progress=False)  # fmt: skip
            name = next(iter(step))
            rep = json.loads((out / "steps" / f"{len(steps) + 1:02d}-{name}" / "report.json").read_text())
            row = {r["layer"]: r for r in rep["layers"]}[LAYER]
            layer = mc.open_checkpoint(out).read_layer(LAYER)
            kept = row["info"].get("kept_experts", list(range(layer.router.num_experts)))
            if EXPERT not in kept:
                state, same = "removed", False
            else:
                new = layer.physical(kept.index(EXPERT))
                same = all(
                    torch.equal(getattr(orig, p).expert(EXPERT), getattr(layer.experts, p).expert(new))
                    for p in ("gate", "up", "down")
                )
                state = f"kept, width {layer.experts.width_of(new)} of {orig.width}"
            ppl = mc.evaluate(out, texts=texts, max_tokens=tokens)["perplexity"]
            ratio = row.get("massive_ratio", float("nan"))
            print(f"| {label} | {'yes' if protect else 'no'} | {state} | {same} | {ratio:.3f} | {ppl:.2f} |")
            shutil.rmtree(out)


def finetune(planted: Path, out: Path, source: str, steps: int, seq_len: int) -> list[float]:
    """Train the planted model on the corpus with the planted expert (its weights) and the layer's router
    frozen, so the rest of the model adapts to the massive activation, as it would have had the super
    expert arisen in training. AdamW, lr 3e-4, no weight decay, batches of 8 windows."""
    from transformers import AutoModelForCausalLM

    from moecompress.calibration.sources import load_token_ids

    ids = load_token_ids(source, model_dir=planted, samples=8 * steps, seq_len=seq_len, seed=1)
    model = AutoModelForCausalLM.from_pretrained(planted, dtype=torch.float32).train()
    moe = model.model.layers[LAYER].mlp
    moe.gate.weight.requires_grad_(False)
    for p in (moe.experts.gate_up_proj, moe.experts.down_proj):
        p.register_hook(lambda g: g.index_fill(0, torch.tensor([EXPERT]), 0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.0)
    losses = []
    for step in range(steps):
        batch = ids[8 * step : 8 * step + 8]
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(out)
    for f in planted.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--compress-only", action="store_true", help="skip the profiles and the ablation table")
    ap.add_argument(
        "--finetune-steps",
        type=int,
        default=0,
        help="also fine-tune the planted model (expert frozen) and ablate",
    )
    args = ap.parse_args()
    data = Path(args.shared) / "data"
    corpus = sorted(str(p) for p in (data / "corpus").glob("*.txt"))
    cal = {
        "source": "file:" + ",".join(corpus),
        "samples": args.samples,
        "seq_len": args.seq_len,
        "batch_size": 8,
    }
    work = Path(tempfile.mkdtemp(prefix="se-bench-"))
    cal["cache_dir"] = str(work / "cache")
    if not args.compress_only:
        profiles(data, work, cal)
    base = data / "models" / "ref-qwen3moe"
    planted = work / "planted"
    shutil.copytree(base, planted)
    tensors = load_file(planted / "model.safetensors")
    key = f"model.layers.{LAYER}.mlp.experts.{EXPERT}.down_proj.weight"
    tensors[key][CHANNEL] *= SCALE
    save_file(tensors, planted / "model.safetensors", metadata={"format": "pt"})
    texts = [f"file:{p}" for p in corpus]
    if not args.compress_only:
        planted_ablation(base, planted, key, work, cal, texts, args.eval_tokens)
    if args.finetune_steps:
        tuned = work / "tuned"
        losses = finetune(planted, tuned, cal["source"], args.finetune_steps, args.seq_len)
        print(
            f"\n## Fine-tuned planted model ({args.finetune_steps} steps; loss {losses[0]:.3f} -> {losses[-1]:.3f})"
        )
        planted_ablation(base, tuned, key, work, cal, texts, args.eval_tokens)
        compression_on_planted(tuned, work, cal, texts, args.eval_tokens)
    else:
        compression_on_planted(planted, work, cal, texts, args.eval_tokens)
    shutil.rmtree(work)


def profiles(data: Path, work: Path, cal: dict) -> None:
    print("## Profiles (max |down_proj output| per expert)\n")
    print(
        "| model | threshold | P99.5 | max/10 | super experts | per MoE layer: top-5 magnitudes |\n|---|---:|---:|---:|---|---|"
    )
    for name in MODELS:
        rep = profile(data / "models" / name, work / f"prof-{name}", cal)
        s = rep["summary"]
        tops = "; ".join(
            f"L{k}: " + ", ".join(f"{v:.2f}" for v in t[:5]) for k, t in s["top_magnitudes_per_layer"].items()
        )
        print(
            f"| {name} | {s['threshold']:.2f} | {s['P99.5']:.2f} | {s['max_over_10']:.2f} | {s['super_experts'] or 'none'} | {tops} |"
        )


def planted_ablation(
    base: Path, planted: Path, key: str, work: Path, cal: dict, texts: list[str], tokens: int
) -> None:
    rep = profile(planted, work / f"prof-{planted.name}", cal)
    info = {r["layer"]: r["info"] for r in rep["layers"]}[LAYER]
    print(f"\n## Planted: {key} row {CHANNEL} x{SCALE:g}\n")
    print(
        f"super experts found: {rep['summary']['super_experts']} (channels {info['channels']}); "
        f"layer {LAYER} top-5: {info['top'][:5]}"
    )
    n = len(info["magnitudes"])
    ppl_planted = mc.evaluate(planted, texts=texts, max_tokens=tokens)["perplexity"]
    ppl_base = mc.evaluate(base, texts=texts, max_tokens=tokens)["perplexity"]
    abl_planted = ablation_ppl(planted, work, cal, texts, tokens, n)
    abl_base = ablation_ppl(base, work, cal, texts, tokens, n)
    print(f"\nperplexity: original {ppl_base:.2f}, planted {ppl_planted:.2f}\n")
    print(
        f"| expert of layer {LAYER} ablated | ppl (planted model) | ppl (original model) |\n|---:|---:|---:|"
    )
    for e in range(n):
        mark = " (planted)" if e == EXPERT else ""
        print(f"| {e}{mark} | {abl_planted[e]:.2f} | {abl_base[e]:.2f} |")


if __name__ == "__main__":
    main()
