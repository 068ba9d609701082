"""Calibration token ids: where the text comes from, how it is tokenised, split and sampled.

``source`` forms:

- ``"builtin"`` (the recipe default): docstrings of a fixed, sorted list of standard-library modules
  (see :mod:`moecompress.calibration.builtin_text`). No download, so quickstarts and tests run
  offline; it varies slightly across Python versions, which the fingerprint covers by hashing it.
- ``"file:PATH"`` or a plain existing path: a UTF-8 text file, or a directory of ``*.txt`` files
  (sorted, not recursive). ``"file:A,B,..."`` is a comma list of files and/or directories.
- ``"hf:NAME[:CONFIG][@SPLIT]"``: the ``text`` column of a Hugging Face ``datasets`` dataset (split
  ``train`` unless given), rows joined by newlines into one text. Needs ``pip install datasets``.
- ``"random"``: uniform token ids in ``[0, vocab_size)`` (``config.json`` in ``model_dir``); no
  tokenizer needed. For tests and benchmarks of models without tokenizer files.

Text sources are tokenised with the model's own tokenizer files in ``model_dir`` (never remote code).
Held-out split: the last 2% of each text (``len(text) // 50`` characters; each file, each builtin
module, each dataset is one text) is ``"eval"``, the rest is ``"calibration"``; they never overlap.
The split's texts are tokenised once (no special tokens) and joined with the EOS token (a newline when
the tokenizer has none). ``samples`` windows of ``seq_len`` tokens are drawn with
``torch.Generator().manual_seed(seed)``: non-overlapping windows at a random phase when the text holds
``samples * seq_len`` tokens, otherwise overlapping windows at random offsets (logged at INFO).
``random`` draws its ``eval`` split from a different seed stream. Relative paths are taken from the
current directory. Tokenising costs a few seconds per 10 MB of text: cache the result under
:func:`source_fingerprint`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from moecompress.errors import MoecompressError

from .builtin_text import builtin_texts

log = logging.getLogger(__name__)

SPLITS = ("calibration", "eval")
EVAL_DIVISOR = 50  # the last len(text) // 50 characters (2%) of each text are the eval split
FORMS = "builtin, random, file:PATH[,PATH...], a path, or hf:NAME[:CONFIG][@SPLIT]"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
)  # fmt: skip
_FINGERPRINT_VERSION = 1
_CHUNK_CHARS = 1 << 16
_LINE_START = re.compile(r"\n(?=\S)")


class CalibrationError(MoecompressError):
    """A calibration source, its files, the tokenizer or the sampling arguments are unusable."""


@dataclass(frozen=True)
class _Source:
    kind: str  # builtin | files | hf | random
    paths: tuple[Path, ...] = ()
    hf: tuple[str, str | None, str] = ("", None, "train")


def load_token_ids(
    source: str, *, model_dir: str | Path, samples: int, seq_len: int, seed: int, split: str = "calibration"
) -> torch.LongTensor:
    """Return ``samples`` windows of ``seq_len`` token ids from ``source``: int64 ``[samples, seq_len]``."""
    spec, model_dir = _check(source, model_dir, samples, seq_len, seed, split)
    if spec.kind == "random":
        vocab = _vocab_size(model_dir)
        gen = torch.Generator().manual_seed(_split_seed(seed, split))
        return torch.randint(0, vocab, (samples, seq_len), generator=gen, dtype=torch.int64)
    tokenizer = _load_tokenizer(model_dir)
    texts = [_split_text(text, split) for _, text in _texts(spec)]
    ids = _tokenise(tokenizer, texts)
    return _windows(ids, samples, seq_len, seed, what=f"{source!r} ({split} split)")


def source_fingerprint(
    source: str, *, model_dir: str | Path, samples: int, seq_len: int, seed: int, split: str = "calibration"
) -> str:
    """A stable 16-hex-digit digest of everything that determines :func:`load_token_ids`'s result.

    Hashes file bytes (or the builtin / dataset text) and the tokenizer files; tokenises nothing.
    """
    spec, model_dir = _check(source, model_dir, samples, seq_len, seed, split)
    payload: dict = {"v": _FINGERPRINT_VERSION, "kind": spec.kind, "samples": samples}
    payload.update(seq_len=seq_len, seed=seed, split=split)
    if spec.kind == "random":
        payload["vocab_size"] = _vocab_size(model_dir)
    else:
        payload["tokenizer"] = [[p.name, _file_digest(p)] for p in _tokenizer_files(model_dir)]
        if spec.kind == "files":
            payload["texts"] = [_file_digest(p) for p in _expand(spec.paths)]
        else:  # builtin / hf: hash the text itself
            payload["hf"] = list(spec.hf) if spec.kind == "hf" else None
            payload["texts"] = [[n, hashlib.sha256(t.encode()).hexdigest()] for n, t in _texts(spec)]
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# --- arguments and source parsing -------------------------------------------------------------------


def _check(source, model_dir, samples, seq_len, seed, split) -> tuple[_Source, Path]:
    for field, value, low in (("samples", samples, 1), ("seq_len", seq_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CalibrationError(f"calibration {field} must be an integer >= {low}, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise CalibrationError(f"calibration seed must be an integer in [0, 2**63), got {seed!r}")
    if split not in SPLITS:
        raise CalibrationError(f"calibration split must be one of {', '.join(SPLITS)}; got {split!r}")
    spec = _parse(source)
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise CalibrationError(f"calibration model_dir {model_dir} is not a directory")
    return spec, model_dir


def _parse(source) -> _Source:
    if not isinstance(source, str) or not source.strip():
        raise CalibrationError(f"calibration source must be a non-empty string ({FORMS}); got {source!r}")
    text = source.strip()
    if text in ("builtin", "random"):
        return _Source(text)
    if text.startswith("hf:"):
        rest, at, hf_split = text[3:].partition("@")
        name, _, config = rest.partition(":")
        if not name or (at and not hf_split):
            raise CalibrationError(f"calibration source {source!r}: expected hf:NAME[:CONFIG][@SPLIT]")
        return _Source("hf", hf=(name, config or None, hf_split or "train"))
    if text.startswith("file:"):
        items = [s.strip() for s in text[5:].split(",")]
        if not all(items):
            raise CalibrationError(f"calibration source {source!r}: expected file:PATH[,PATH...]")
        paths = tuple(Path(s).expanduser() for s in items)
        for p in paths:
            if not p.exists():
                raise CalibrationError(f"calibration source {source!r}: {p} does not exist")
        return _Source("files", paths=paths)
    if Path(text).expanduser().exists():
        return _Source("files", paths=(Path(text).expanduser(),))
    raise CalibrationError(
        f"calibration source {source!r} is neither a known form nor an existing file or directory; "
        f"use {FORMS}"
    )


# --- text --------------------------------------------------------------------------------------------


def _expand(paths: tuple[Path, ...]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(q for q in p.glob("*.txt") if q.is_file())
            if not found:
                raise CalibrationError(f"calibration directory {p} contains no *.txt files")
            files.extend(found)
        else:
            files.append(p)
    return files


def _texts(spec: _Source) -> list[tuple[str, str]]:
    if spec.kind == "builtin":
        return builtin_texts()
    if spec.kind == "hf":
        return [(spec.hf[0], _hf_text(*spec.hf))]
    out = []
    for path in _expand(spec.paths):
        try:
            out.append((str(path), path.read_text(encoding="utf-8")))
        except UnicodeDecodeError as err:
            raise CalibrationError(f"calibration file {path} is not UTF-8 text ({err.reason})") from None
        except OSError as err:
            raise CalibrationError(f"calibration file {path} cannot be read: {err.strerror}") from None
    return out


def _hf_text(name: str, config: str | None, hf_split: str) -> str:
    where = f"hf:{name}" + (f":{config}" if config else "") + f"@{hf_split}"
    if importlib.util.find_spec("datasets") is None:
        raise CalibrationError(
            f"calibration source {where} needs the `datasets` package: pip install datasets "
            "(or use source: builtin or file:PATH)"
        )
    datasets = importlib.import_module("datasets")
    try:
        data = datasets.load_dataset(name, config, split=hf_split)
    except Exception as err:  # offline, unknown name, bad config/split: one line for the user
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CalibrationError(
            f"could not load Hugging Face dataset {where} ({type(err).__name__}: {reason}); "
            "offline? use source: builtin or file:PATH"
        ) from None
    columns = list(getattr(data, "column_names", []) or [])
    if "text" not in columns:
        raise CalibrationError(f"Hugging Face dataset {where} has no 'text' column (columns: {columns})")
    return "\n".join(t for t in data["text"] if isinstance(t, str) and t.strip())


def _split_text(text: str, split: str) -> str:
    cut = len(text) - len(text) // EVAL_DIVISOR
    return text[:cut] if split == "calibration" else text[cut:]


# --- tokenizer and sampling --------------------------------------------------------------------------


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


def _tokenise(tokenizer, texts: list[str]) -> torch.Tensor:
    pieces = [_chunks(t) for t in texts if t]
    flat = [p for ps in pieces for p in ps]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # encode_batch_fast skips offsets (tokenizers >= 0.21)
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        encoded = [e.ids for e in encode(flat, add_special_tokens=False)] if flat else []
    else:
        encoded = tokenizer(flat, add_special_tokens=False, verbose=False)["input_ids"] if flat else []
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


def _windows(ids: torch.Tensor, samples: int, seq_len: int, seed: int, *, what: str) -> torch.Tensor:
    n = ids.numel()
    if n < seq_len + 1:
        raise CalibrationError(
            f"calibration text {what} has only {n} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "lower seq_len or add text"
        )
    gen = torch.Generator().manual_seed(seed)
    fit = n // seq_len
    if fit >= samples:  # disjoint windows at a random phase
        phase = int(torch.randint(0, n - fit * seq_len + 1, (1,), generator=gen))
        starts = phase + seq_len * torch.randperm(fit, generator=gen)[:samples]
    else:
        msg = "calibration text %s has %d tokens < samples * seq_len = %d; windows overlap"
        log.info(msg, what, n, samples * seq_len)
        starts = torch.randint(0, n - seq_len + 1, (samples,), generator=gen)
    return ids[starts[:, None] + torch.arange(seq_len)]


def _vocab_size(model_dir: Path) -> int:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CalibrationError(f"source: random needs {path} with vocab_size ({err})") from None
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise CalibrationError(f"source: random needs a positive integer vocab_size in {path}, got {vocab!r}")
    return vocab


def _split_seed(seed: int, split: str) -> int:
    if split == "calibration":
        return seed
    digest = hashlib.sha256(f"{split}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _file_digest(path: Path) -> list:
    h = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError as err:
        raise CalibrationError(f"calibration file {path} cannot be read: {err.strerror}") from None
    return [path.stat().st_size, h.hexdigest()]
