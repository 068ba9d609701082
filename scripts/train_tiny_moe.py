"""Train the tiny Qwen3-MoE model bundled as ``moecompress:quickstart``.

The model is transformers' own ``Qwen3MoeForCausalLM`` (no custom code), trained from scratch on CPU
on plain-text files with the team's byte-level BPE tokenizer (4096 tokens)::

    python scripts/train_tiny_moe.py --out moecompress/data/quickstart-qwen3moe --overwrite

Settings (all defaults are the ones the bundled model was trained with; ``training.json`` in the
output folder records every one of them, the versions and the command line):

- Data: every ``*.txt`` in ``--corpus`` (sorted by name). The last 2% of each file
  (``len(text) // 50`` characters, the project convention also used by the calibration ``eval``
  split) is held out for validation; the rest is training text. Each split's files are tokenised
  without special tokens and joined with ``<|endoftext|>`` (id 0), as the calibration sources do.
- Batches: ``--batch`` windows of ``--seq-len`` + 1 tokens at uniform random offsets of the training
  stream, drawn from ``torch.Generator().manual_seed(seed)``: the data order depends on the seed only.
- Model: fp32 weights during training; ``--max-mb`` (5 MB = 5,000,000 bytes) bounds the whole output
  folder in bf16 and is checked before training starts and again after saving.
- Optimiser: AdamW (betas 0.9/0.95, weight decay on matrices only), linear warm-up then cosine decay
  to ``--min-lr-ratio`` × ``--lr`` at ``--steps``, gradient clipping at 1.0, and
  ``--aux-loss-coef`` × a load-balancing loss added to the next-token loss. The balancing loss is the
  Switch-Transformer one computed *per layer* and averaged (:func:`balance_loss`), not transformers'
  ``load_balancing_loss_func``: that one pools the routing counts of all layers, so it is satisfied
  when one layer sends every token to an expert that the other layers never use. (A first run with
  it left expert 5 dead in layers 1 and 2 and picked by 99% of tokens in layer 3.)
- Threads: ``--threads 1``. On the shared 2-core machine the model was trained on, one thread ran a
  step 3-8x faster than two (other jobs kept the load near 6, and two OpenMP threads then mostly
  wait for each other); on an idle machine ``--threads 2`` is somewhat faster.
- ``--seconds`` is a wall-clock cap: training stops early (before the schedule ends) if it is
  reached, and ``training.json`` says so. The weights then depend on the machine's speed; runs that
  finish their ``--steps`` are reproducible on the same software versions and thread count.
- Validation perplexity: ``exp`` of the mean next-token loss over all non-overlapping ``--seq-len``
  + 1 token windows of the held-out stream; ``val_ppl`` is measured with the saved (bf16-rounded)
  weights, ``val_ppl_fp32`` with the fp32 training weights. ``unigram_ppl`` is the baseline of a
  unigram model fitted on the training tokens (add-one smoothing).

Output: ``config.json``, ``generation_config.json``, ``model.safetensors`` (bf16, one shard),
``tokenizer.json`` (a byte-for-byte copy of ``--tokenizer``), ``tokenizer_config.json`` (bos/eos
``<|endoftext|>``) and ``training.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moecompress.calibration.tokenizing import _chunks  # the same line-start cutting as calibration

EOS = "<|endoftext|>"
EVAL_DIVISOR = 50  # the last len(text) // 50 characters (2%) of each file are held out
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "training.json",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="../shared/data/corpus", help="directory of *.txt files")
    p.add_argument("--tokenizer", default="../shared/data/tokenizer-bpe4096.json", help="tokenizer.json file")
    p.add_argument("--out", default="moecompress/data/quickstart-qwen3moe", help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace the model files already in --out")
    p.add_argument("--steps", type=int, default=900, help="optimiser steps (the cosine schedule's length)")
    p.add_argument("--seconds", type=float, default=600.0, help="wall-clock cap for the training loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (see the module docstring)")
    # sizes
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--max-position", type=int, default=512)
    p.add_argument("--max-mb", type=float, default=5.0, help="bound on the output folder, 1 MB = 10^6 bytes")
    # optimisation
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--aux-loss-coef", type=float, default=0.01, help="router load-balancing loss weight")
    p.add_argument("--eval-every", type=int, default=50, help="steps between quick validation checks")
    p.add_argument("--eval-windows", type=int, default=32, help="windows in a quick validation check")
    return p.parse_args(argv)


# --- data -------------------------------------------------------------------------------------------


def _encode(tokenizer, texts: list[str], sep: int) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        if not text:
            continue
        if ids:
            ids.append(sep)
        for enc in tokenizer.encode_batch(_chunks(text), add_special_tokens=False):
            ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int64)


def load_corpus(corpus: Path, tokenizer, eos_id: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    files = sorted(corpus.glob("*.txt"))
    if not files:
        raise SystemExit(f"no *.txt files in {corpus}")
    train, val = [], []
    for f in files:
        text = f.read_text(encoding="utf-8")
        cut = len(text) - len(text) // EVAL_DIVISOR
        train.append(text[:cut])
        val.append(text[cut:])
    return _encode(tokenizer, train, eos_id), _encode(tokenizer, val, eos_id), [f.name for f in files]


def unigram_ppl(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return math.exp(-float(logp[val].mean()))


# --- model ------------------------------------------------------------------------------------------


def build_config(args: argparse.Namespace, vocab: int, eos_id: int | None):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,  # dense-MLP width; unused (every layer is MoE)
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=args.max_position,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=True,
        router_aux_loss_coef=args.aux_loss_coef,
        output_router_logits=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


def expected_bytes(model: torch.nn.Module, tokenizer_file: Path) -> int:
    """bf16 weights (tied tensors once) + safetensors header + tokenizer + a margin for the JSON files."""
    params = {p.data_ptr(): p for p in model.parameters()}
    weights = sum(2 * p.numel() for p in params.values())
    header = 200 * len(model.state_dict())
    return weights + header + tokenizer_file.stat().st_size + 16_384


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss per layer, averaged over layers; ``top_k`` when balanced."""
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)  # [tokens, experts]
        experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices
        fraction = F.one_hot(chosen, experts).float().sum(dim=1).mean(dim=0)  # sums to top_k
        losses.append(experts * (fraction * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def val_windows(val: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = (val.numel() - 1) // seq_len
    return torch.stack([val[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logits = model(input_ids=w[:, :-1], use_cache=False).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    model.train()
    return math.exp(total / count)


# --- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tokenizers
    import transformers
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    tok_file = Path(args.tokenizer)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise SystemExit(f"{out} is not empty; pass --overwrite to replace its model files")

    tokenizer = Tokenizer.from_file(str(tok_file))
    vocab = tokenizer.get_vocab_size()
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    eos_id = tokenizer.token_to_id(EOS) if EOS in specials else None
    if eos_id is None:
        raise SystemExit(f"{tok_file} has no {EOS} special token (special tokens: {specials})")

    config = build_config(args, vocab, eos_id)
    model = Qwen3MoeForCausalLM(config)  # initialised from torch's global RNG, seeded above
    n_params = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    limit = int(args.max_mb * 1_000_000)
    size = expected_bytes(model, tok_file)
    print(
        f"model: {n_params:,} parameters, expected folder size {size / 1e6:.2f} MB (limit {limit / 1e6} MB)"
    )
    if size > limit:
        raise SystemExit(f"the model would take {size / 1e6:.2f} MB > {args.max_mb} MB; make it smaller")

    t0 = time.perf_counter()
    train, val, files = load_corpus(Path(args.corpus), tokenizer, eos_id)
    uni = unigram_ppl(train, val, vocab)
    windows = val_windows(val, args.seq_len)
    quick = windows[torch.linspace(0, len(windows) - 1, min(args.eval_windows, len(windows))).long()]
    print(
        f"corpus: {len(files)} files, {train.numel():,} train / {val.numel():,} val tokens "
        f"({len(windows)} val windows), unigram ppl {uni:.1f}, tokenised in {time.perf_counter() - t0:.1f}s"
    )

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)
    model.train()
    log: list[dict] = []
    start = time.perf_counter()
    step, stopped_early = 0, False
    while step < args.steps:
        if time.perf_counter() - start >= args.seconds:
            stopped_early = True
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, train.numel() - args.seq_len - 1, (args.batch,), generator=gen)
        w = train[starts[:, None] + offsets]
        res = model(input_ids=w[:, :-1], use_cache=False, output_router_logits=True)
        lm = F.cross_entropy(res.logits.flatten(0, 1), w[:, 1:].flatten())
        aux = balance_loss(res.router_logits, args.top_k)
        loss = lm + args.aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        if step % args.eval_every == 0 or step == args.steps:
            ppl = evaluate(model, quick, args.batch)
            t = time.perf_counter() - start
            log.append(
                {
                    "step": step,
                    "t": round(t),
                    "loss": round(lm.item(), 3),
                    "aux": round(aux.item(), 3),
                    "val_ppl_quick": round(ppl, 1),
                }
            )
            print(f"step {step:5d}  t {t:6.0f}s  loss {lm.item():.3f}  aux {aux.item():.3f}  "
                  f"lr {lr_at(step - 1, args):.2e}  val ppl (quick) {ppl:.1f}", flush=True)  # fmt: skip
    seconds = time.perf_counter() - start
    if stopped_early:
        print(f"stopped at step {step} of {args.steps}: --seconds {args.seconds} reached")

    ppl32 = evaluate(model, windows, 4 * args.batch)
    with torch.no_grad():  # the shipped weights: round to bf16, evaluate in fp32
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ppl16 = evaluate(model, windows, 4 * args.batch)
    print(f"validation perplexity: {ppl16:.2f} (bf16 weights), {ppl32:.2f} (fp32); unigram {uni:.1f}")

    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # save_pretrained leaves it owner-only
    shutil.copyfile(tok_file, out / "tokenizer.json")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "model_max_length": args.max_position,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    record = {
        "arch": config.model_type,
        "steps": step,
        "tokens": step * args.batch * args.seq_len,
        "seconds": round(seconds, 1),
        "stopped_early": stopped_early,
        "val_ppl": ppl16,
        "val_ppl_fp32": ppl32,
        "unigram_ppl": uni,
        "val_tokens": int(windows[:, 1:].numel()),
        "parameters": n_params,
        "log": log,
        "corpus": f"{args.corpus}/*.txt ({', '.join(files)}), last 2% of each file held out",
        "train_tokens_available": int(train.numel()),
        "tokenizer": tok_file.name,
        "seq": args.seq_len,
        "batch": args.batch,
        "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")},
        "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), decay on >=2-D tensors; warm-up + cosine",
        "balance_loss": "Switch-Transformer load-balancing loss per layer, mean over layers, x aux_loss_coef",
        "training_dtype": "float32",
        "saved_dtype": "bfloat16",
        "seed": args.seed,
        "threads": args.threads,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "command": shlex.join(["python", *sys.argv])
        if argv is None
        else shlex.join(["train_tiny_moe", *argv]),
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out}: {total:,} bytes in {len(list(out.iterdir()))} files")
    if total > limit:
        raise SystemExit(f"{out} takes {total / 1e6:.2f} MB > {args.max_mb} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
