"""The model's tokenizer for calibration text: its files in ``model_dir`` (loaded from there, never remote
code) and tokenising texts whole (long texts cut at line starts so the fast tokenizer batches them; texts
joined by the EOS token, a newline when the tokenizer has none). The rules are in
:mod:`moecompress.calibration.sources`, which calls these.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from moecompress.errors import CalibrationError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
)  # fmt: skip
_CHUNK_CHARS = 1 << 16
_LINE_START = re.compile(r"\n(?=\S)")


def _tokenizer_files(model_dir: Path) -> list[Path]:
    found = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    if not any(p.name != "special_tokens_map.json" and p.name != "added_tokens.json" for p in found):
        raise CalibrationError(
            f"no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...) in {model_dir}; "
            "add the model's tokenizer files there, or use source: random"
        )
    return found


def _load_tokenizer(model_dir: Path):
    files = {p.name for p in _tokenizer_files(model_dir)}
    try:
        if "tokenizer.json" in files and "tokenizer_config.json" not in files:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CalibrationError(
            f"cannot load the tokenizer in {model_dir} ({type(err).__name__}: {reason}); "
            "fix its tokenizer files or use source: random"
        ) from None


def _chunks(text: str) -> list[str]:
    """Cut long text at line starts (exact for byte-level BPE) so the fast tokenizer can batch it."""
    pieces, start = [], 0
    while start < len(text):
        m = _LINE_START.search(text, start + _CHUNK_CHARS)
        end = m.end() if m else len(text)
        pieces.append(text[start:end])
        start = end
    return pieces


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # encode_batch_fast skips offsets (tokenizers >= 0.21)
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _tokenise(tokenizer, texts: list[str]) -> torch.Tensor:
    pieces = [_chunks(t) for t in texts if t]
    flat = [p for ps in pieces for p in ps]
    encoded = _encode(tokenizer, flat)
    eos = getattr(tokenizer, "eos_token_id", None)
    sep = [eos] if isinstance(eos, int) else tokenizer.encode("\n", add_special_tokens=False)
    ids: list[int] = []
    pos = 0
    for ps in pieces:
        if ids:
            ids.extend(sep)
        for seq in encoded[pos : pos + len(ps)]:
            ids.extend(seq)
        pos += len(ps)
    return torch.tensor(ids, dtype=torch.int64)
