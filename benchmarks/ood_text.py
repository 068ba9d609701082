"""Out-of-domain held-out text for the distillation benchmarks (issue 38): text unlike the calibration
corpus, which no calibration or training source reads.

    python benchmarks/ood_text.py [--shared ../shared] [--model ref-qwen3moe] [--write PATH]

The text is the **license texts shipped in the installed packages' ``*.dist-info`` folders** (legal
prose: grants, conditions, disclaimers), deduplicated by their whitespace-normalised SHA-256, in sorted
path order. Licenses that the corpus already holds are dropped: the corpus' ``python_docs.txt`` quotes
many (PSF, MIT, BSD), so a license is kept only when fewer than 5 % of its lower-case word 8-grams
occur anywhere in the corpus, and
near-copies (half of the 8-grams in a license kept before it, e.g. the Apache 2.0 variants) are dropped. What is kept depends on
the environment's packages; :func:`ood_texts` returns the kept names and the scorer reports the text's
SHA-256, so two runs compare only when it matches.

Scoring (:func:`score`): the text is tokenised with the model's ``tokenizer.json``, joined into one
stream and cut into ``len // seq_len`` contiguous windows, of which ``max_tokens // seq_len`` evenly
spaced ones are kept (as ``moecompress.evaluate`` does with its held-out split, but on the whole text:
none of it is ever trained on). Every window predicts tokens 1..seq_len-1; ``perplexity`` is
``exp`` of the mean NLL, ``kl`` the mean KL(base ‖ model) and ``top1`` the argmax agreement with
``against``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import sys
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

SHARED = Path(__file__).resolve().parents[2] / "shared"


def _norm(s: str) -> str:
    return " ".join(s.split()).lower()


def _grams(text: str, n: int = 8) -> list[int]:
    """Hashes of the text's lower-case word ``n``-grams."""
    w = text.lower().split()
    return [hash(" ".join(w[i : i + n])) for i in range(len(w) - n + 1)]


@lru_cache(maxsize=4)
def ood_texts(corpus_dir: str = str(SHARED / "data" / "corpus"), max_overlap: float = 0.05) -> tuple[tuple[str, str], ...]:
    """``((name, text), ...)``: the installed packages' license texts not already in the corpus."""
    site = Path(sys.prefix) / "lib"
    files = sorted(glob.glob(str(site / "python3*" / "site-packages" / "*.dist-info" / "**" / "*LICEN[CS]E*"),
                             recursive=True))  # fmt: skip
    grams = set()
    for p in sorted(Path(corpus_dir).glob("*.txt")):
        grams.update(_grams(p.read_text(errors="replace")))
    seen, kept, kept_grams = set(), [], set()
    for f in files:
        p = Path(f)
        if not p.is_file():
            continue
        text = p.read_text(errors="replace")
        digest = hashlib.sha256(_norm(text).encode()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        mine = _grams(text)
        if not mine or sum(g in grams for g in mine) / len(mine) >= max_overlap:
            continue
        if sum(g in kept_grams for g in mine) / len(mine) >= 0.5:  # a near-copy of a kept one
            continue
        kept_grams.update(mine)
        kept.append((f.split("site-packages/")[-1], text))
    return tuple(kept)


def ood_windows(tokenizer_json: str | Path, seq_len: int = 256, max_tokens: int = 16384) -> tuple[torch.Tensor, str]:
    """``(windows [n, seq_len], sha256 of the text)``."""
    from tokenizers import Tokenizer

    text = "\n\n".join(t for _, t in ood_texts())
    ids = torch.tensor(Tokenizer.from_file(str(tokenizer_json)).encode(text).ids, dtype=torch.long)
    n = len(ids) // seq_len
    windows = ids[: n * seq_len].reshape(n, seq_len)
    keep = min(n, max(1, max_tokens // seq_len))
    pick = torch.linspace(0, n - 1, keep).round().long()
    return windows[pick], hashlib.sha256(text.encode()).hexdigest()


@torch.no_grad()
def score(model, windows: torch.Tensor, against=None, batch: int = 4) -> dict:
    """Perplexity of ``model`` (a checkpoint directory or a loaded model) on ``windows``; with ``against``
    also KL(against ‖ model) and top-1 agreement."""
    import moecompress as mc

    net = mc.load(model) if isinstance(model, (str, Path)) else model
    base = mc.load(against) if isinstance(against, (str, Path)) else against
    nll = kl = agree = 0.0
    n = 0
    for s in range(0, len(windows), batch):
        part = windows[s : s + batch]
        logp = F.log_softmax(net(input_ids=part).logits[:, :-1].float(), dim=-1)
        tgt = part[:, 1:]
        nll += float(-logp.gather(-1, tgt.unsqueeze(-1)).sum())
        n += tgt.numel()
        if base is not None:
            logq = F.log_softmax(base(input_ids=part).logits[:, :-1].float(), dim=-1)
            kl += float((logq.exp() * (logq - logp)).sum())
            agree += float((logq.argmax(-1) == logp.argmax(-1)).sum())
    out = {"loss": nll / n, "perplexity": float(torch.tensor(nll / n).exp()), "tokens": n}
    if base is not None:
        out.update(kl=kl / n, top1=agree / n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(SHARED))
    ap.add_argument("--model", default="ref-qwen3moe")
    ap.add_argument("--write", help="also write the text to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kept = ood_texts(str(Path(args.shared) / "data" / "corpus"))
    model = Path(args.shared) / "data" / "models" / args.model
    windows, digest = ood_windows(model / "tokenizer.json")
    print(f"{len(kept)} license texts, {sum(len(t) for _, t in kept):,} characters, sha256 {digest[:16]}")
    print(f"{args.model}: {windows.numel():,} tokens, {score(model, windows)}")
    if args.write:
        Path(args.write).write_text("\n\n".join(t for _, t in kept))


if __name__ == "__main__":
    main()
