"""Calibration token ids: where the text comes from, how it is tokenised, split and sampled.

``source`` forms:

- ``"builtin"`` (the recipe default): docstrings of a fixed, sorted list of standard-library modules
  (see :mod:`moecompress.calibration.builtin_text`). No download, so quickstarts and tests run
  offline; it varies slightly across Python versions, which the fingerprint covers by hashing it.
- ``"file:PATH"`` or a plain existing path: a UTF-8 text file, or a directory of ``*.txt`` files
  (sorted, not recursive). ``"file:A,B,..."`` is a comma list of files and/or directories.
- ``"hf:..."``: read through the Hugging Face ``datasets`` library (``pip install "moecompress[data]"``):

  - ``hf:text:PATH[,PATH...]``: UTF-8 text files (a directory: its sorted ``*.txt``), loaded with
    ``load_dataset("text", data_files=..., sample_by="document")``: each file is one text, so the
    token ids equal those of ``file:`` on the same files.
  - ``hf:json:PATH[,...]`` (JSON or JSON lines; a directory: ``*.json``, ``*.jsonl``), ``hf:csv:PATH``,
    ``hf:parquet:PATH``: ``load_dataset(FORMAT, data_files=...)``; ``hf:disk:DIR[@SPLIT]``: a directory
    written by ``save_to_disk``, through ``load_from_disk`` (a ``DatasetDict`` needs ``@SPLIT``, default
    ``train``).
  - ``hf:NAME[:CONFIG][@SPLIT]``: a Hub dataset (split ``train`` unless given); needs the network or
    the local ``datasets`` cache.

  Every form but ``hf:text`` takes one string column, ``#COLUMN`` at the end (default ``text``); its
  non-blank rows are joined by newlines into one text. Local forms hash their files for the
  fingerprint (like ``file:``); a Hub dataset hashes its text.
- ``"random"``: uniform token ids in ``[0, vocab_size)`` (``config.json`` in ``model_dir``); no
  tokenizer needed. For tests and benchmarks of models without tokenizer files.

Text sources are tokenised with the model's own tokenizer files in ``model_dir`` (never remote code;
:mod:`moecompress.calibration.tokenizing`).
Held-out split: the last 2% of each text (``len(text) // 50`` characters; each file, each builtin
module, each dataset is one text) is ``"eval"``, the rest is ``"calibration"``; they never overlap.
Random draws use ``torch.Generator().manual_seed(seed)``; two ways, chosen by the split's size:

- **Sampled** (the split holds at least ``16 * samples * seq_len`` bytes): the split's texts, end to
  end, are cut into ``samples`` equal byte ranges and one window is drawn in each: a random byte
  offset, moved to the next whitespace (so no window starts inside a word or a UTF-8 character), read
  forward (about 8 bytes per token, doubled until long enough; ended at a whitespace) and tokenised
  to its first ``seq_len`` tokens; a window that reaches the end of its range or text is read
  backwards from there instead and keeps its last ``seq_len`` tokens. The windows never overlap and
  their order is shuffled. Only the windows are tokenised (about ``8 * samples * seq_len`` bytes),
  so a 20 MB corpus costs a fraction of a second, not the whole file. Files are read by byte ranges
  (one streaming pass checks that they are UTF-8 and counts characters for the split); a file
  holding ``\r`` is read whole into memory (still not tokenised) so its line ends are translated
  exactly as Python's text mode and ``datasets`` do.
- **Whole** (smaller splits, or when some range cannot supply ``seq_len`` tokens, logged at INFO):
  the split's texts are tokenised once (no special tokens) and joined with the EOS token (a newline
  when the tokenizer has none); non-overlapping windows at a random phase when the text holds
  ``samples * seq_len`` tokens, otherwise overlapping windows at random offsets (logged at INFO).

``random`` draws its ``eval`` split from a different seed stream. Relative paths are taken from the
current directory. The result is cached under :func:`source_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from moecompress.errors import CalibrationError, MoecompressError

from .builtin_text import builtin_texts
from .tokenizing import _encode, _load_tokenizer, _tokenise, _tokenizer_files
from .windows import (  # noqa: F401 (EVAL_DIVISOR, _split_text, _READ_BYTES_PER_TOKEN: used by callers)
    _READ_BYTES_PER_TOKEN,
    EVAL_DIVISOR,
    SAMPLE_BYTES_PER_TOKEN,
    _file_segment,
    _sampled,
    _Segment,
    _split_text,
)

log = logging.getLogger(__name__)

SPLITS = ("calibration", "eval")
FORMS = "builtin, random, file:PATH[,PATH...], a path, hf:FORMAT:PATH (text, json, csv, parquet, disk) or hf:NAME[:CONFIG][@SPLIT]"
_FINGERPRINT_VERSION = 2  # 2: large splits are sampled by windows
HF_LOCAL = {  # hf:FORMAT:PATH -> the file names a directory contributes
    "text": ("*.txt",), "json": ("*.json", "*.jsonl"), "csv": ("*.csv",), "parquet": ("*.parquet",), "disk": (),
}  # fmt: skip
_HF_FORMS = "hf:text|json|csv|parquet:PATH[,PATH...][#COLUMN], hf:disk:DIR[@SPLIT][#COLUMN] or hf:NAME[:CONFIG][@SPLIT][#COLUMN]"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_COLUMN = re.compile(r"#([A-Za-z_][\w.-]*)$")


@dataclass(frozen=True)
class _Source:
    kind: str  # builtin | files | hf | random
    paths: tuple[Path, ...] = ()
    hf: tuple[str, str | None, str] = (
        "",
        None,
        "train",
    )  # Hub (name, config, split); disk: ("", None, split)
    hf_form: str = "hub"  # hub, or a key of HF_LOCAL (then ``paths`` holds the files / the directory)
    column: str = "text"


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
    what = f"{source!r} ({split} split)"
    if spec.kind == "files":
        segments = [_file_segment(path, split) for path in _expand(spec.paths)]
    else:
        segments = [_Segment(name, data=_split_text(text, split).encode()) for name, text in _texts(spec)]
    segments = [s for s in segments if s.hi > s.lo]
    total = sum(s.hi - s.lo for s in segments)
    if total >= SAMPLE_BYTES_PER_TOKEN * samples * seq_len:
        ids = _sampled(lambda texts: _encode(tokenizer, texts), segments, samples, seq_len, seed)
        if ids is not None:
            return ids
        log.info(
            "calibration text %s: a range is too short for %d-token windows; tokenising it whole",
            what,
            seq_len,
        )
    texts = [s.read(s.lo, s.hi).decode("utf-8") for s in segments]
    return _windows(_tokenise(tokenizer, texts), samples, seq_len, seed, what=what)


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
        elif spec.kind == "hf" and spec.hf_form != "hub":  # local files: hash their bytes, load nothing
            payload["hf"] = [spec.hf_form, spec.hf[2] if spec.hf_form == "disk" else None, spec.column]
            payload["texts"] = [[str(p.relative_to(d)), *_file_digest(p)] for d, p in _hf_files(spec)]
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
        return _parse_hf(source, text[3:])
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


def _parse_hf(source: str, rest: str) -> _Source:
    def bad(why: str) -> CalibrationError:
        return CalibrationError(f"calibration source {source!r}: {why}; expected {_HF_FORMS}")

    column = "text"
    m = _COLUMN.search(rest)
    if m:
        column, rest = m.group(1), rest[: m.start()]
    form, colon, tail = rest.partition(":")
    if colon and form in HF_LOCAL:
        if form == "disk":
            tail, at, split = tail.rpartition("@") if "@" in tail else (tail, "", "")
            if at and not split:
                raise bad("empty @SPLIT")
        items = [t.strip() for t in tail.split(",")] if form != "disk" else [tail.strip()]
        if not all(items):
            raise bad(f"hf:{form}: needs a path")
        if form == "text" and m:
            raise bad("hf:text: reads whole files and takes no #COLUMN")
        paths = tuple(Path(t).expanduser() for t in items)
        for p in paths:
            if not p.exists():
                raise CalibrationError(f"calibration source {source!r}: {p} does not exist")
        if form == "disk" and not paths[0].is_dir():
            raise bad(f"{paths[0]} is not a directory written by save_to_disk")
        split = (split or "train") if form == "disk" else "train"
        return _Source("hf", paths=paths, hf=("", None, split), hf_form=form, column=column)
    name_config, at, split = rest.partition("@")
    name, _, config = name_config.partition(":")
    if not name or (at and not split):
        raise bad("empty NAME or @SPLIT")
    if not _HUB_ID.fullmatch(name) or "/" in config or "/" in split:
        raise bad(f"{name_config!r} is neither a local form ({', '.join(HF_LOCAL)}) nor a Hub dataset id")
    return _Source("hf", hf=(name, config or None, split or "train"), column=column)


# --- text --------------------------------------------------------------------------------------------


def _expand(paths: tuple[Path, ...], patterns: tuple[str, ...] = ("*.txt",)) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted({q for pat in patterns for q in p.glob(pat) if q.is_file()})
            if not found:
                raise CalibrationError(f"calibration directory {p} contains no {' or '.join(patterns)} files")
            files.extend(found)
        else:
            files.append(p)
    return files


def _texts(spec: _Source) -> list[tuple[str, str]]:
    if spec.kind == "builtin":
        return builtin_texts()
    if spec.kind == "hf":
        return _hf_texts(spec)
    out = []
    for path in _expand(spec.paths):
        try:
            out.append((str(path), path.read_text(encoding="utf-8")))
        except UnicodeDecodeError as err:
            raise CalibrationError(f"calibration file {path} is not UTF-8 text ({err.reason})") from None
        except OSError as err:
            raise CalibrationError(f"calibration file {path} cannot be read: {err.strerror}") from None
    return out


def _hf_where(spec: _Source) -> str:
    if spec.hf_form == "hub":
        name, config, split = spec.hf
        return f"hf:{name}" + (f":{config}" if config else "") + f"@{split}"
    tail = f"@{spec.hf[2]}" if spec.hf_form == "disk" else ""
    return f"hf:{spec.hf_form}:" + ",".join(str(p) for p in spec.paths) + tail


def _hf_files(spec: _Source) -> list[tuple[Path, Path]]:
    """(root, file) of every local file an ``hf:FORMAT:PATH`` source reads, in a stable order."""
    if spec.hf_form == "disk":
        root = spec.paths[0]
        return [(root, p) for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    return [(p.parent, p) for p in _expand(spec.paths, HF_LOCAL[spec.hf_form])]


def _hf_texts(spec: _Source) -> list[tuple[str, str]]:
    """The texts of an ``hf:`` source, read with the ``datasets`` library."""
    from moecompress.extras import require

    where = _hf_where(spec)
    require("data", f"calibration source {where}")
    import datasets

    try:
        if spec.hf_form == "hub":
            name, config, split = spec.hf
            data = datasets.load_dataset(name, config, split=split)
        elif spec.hf_form == "disk":
            data = datasets.load_from_disk(str(spec.paths[0]))
            if isinstance(data, datasets.DatasetDict):
                if spec.hf[2] not in data:
                    raise CalibrationError(
                        f"calibration source {where}: the saved DatasetDict has no split {spec.hf[2]!r} "
                        f"(splits: {', '.join(data)}); add @SPLIT"
                    )
                data = data[spec.hf[2]]
        else:
            files = [str(p) for _, p in _hf_files(spec)]
            extra = {"sample_by": "document"} if spec.hf_form == "text" else {}
            data = datasets.load_dataset(spec.hf_form, data_files=files, split="train", **extra)
    except MoecompressError:
        raise
    except Exception as err:  # offline, unknown name, bad config/split, unreadable files: one line
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        hint = "offline? use source: builtin or file:PATH" if spec.hf_form == "hub" else "check the files"
        raise CalibrationError(
            f"could not load Hugging Face dataset {where} ({type(err).__name__}: {reason}); {hint}"
        ) from None
    columns = list(getattr(data, "column_names", []) or [])
    if spec.column not in columns:
        raise CalibrationError(
            f"Hugging Face dataset {where} has no {spec.column!r} column (columns: {columns}); "
            "name the column with #COLUMN at the end of the source"
        )
    rows = data[spec.column]
    if spec.hf_form == "text":  # one row per file (sample_by="document"): each file is one text
        return [(str(p), t) for (_, p), t in zip(_hf_files(spec), rows, strict=True)]
    if any(not isinstance(t, str) for t in rows if t is not None):
        raise CalibrationError(f"Hugging Face dataset {where}: column {spec.column!r} is not a string column")
    return [(where, "\n".join(t for t in rows if isinstance(t, str) and t.strip()))]


# --- sampling and digests ---------------------------------------------------------------------------


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
