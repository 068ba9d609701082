"""Windows of large calibration texts, read without holding or tokenising the whole text.

A text's split (calibration: all but the last ``len(text) // EVAL_DIVISOR`` characters; eval: those) is
a byte range ``[lo, hi)`` of the file (:func:`_file_segment`: one streaming pass checks UTF-8 and counts
characters; files with ``\r`` are read as text mode does) or of an in-memory text (:class:`_Segment`).
:func:`_sampled` draws one window per equal byte range of the segments, starting and ending at a
whitespace, and tokenises only the windows (``encode``, the tokenizer's batch call). The rules are in
:mod:`moecompress.calibration.sources`, which calls these.
"""

from __future__ import annotations

import bisect
import codecs
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moecompress.errors import CalibrationError

EVAL_DIVISOR = 50  # the last len(text) // 50 characters (2%) of each text are the eval split
SAMPLE_BYTES_PER_TOKEN = 16  # the split needs this many bytes per requested token to be sampled
_READ_BYTES_PER_TOKEN = 8  # a window's first read; doubled until it holds seq_len tokens
_BLOCK = 1 << 20
_SPACE = re.compile(rb"[ \t\n\r\f\v]")
_SPACES = (b" ", b"\t", b"\n", b"\r", b"\f", b"\v")


def _split_text(text: str, split: str) -> str:
    cut = len(text) - len(text) // EVAL_DIVISOR
    return text[:cut] if split == "calibration" else text[cut:]


@dataclass(frozen=True)
class _Segment:
    """One text's split as UTF-8 bytes ``[lo, hi)``: in memory (``data``) or in a file (``path``)."""

    name: str
    data: bytes | None = None
    path: Path | None = None
    lo: int = 0
    hi: int = -1

    def __post_init__(self) -> None:
        if self.hi < 0:
            object.__setattr__(self, "hi", len(self.data or b""))

    def read(self, a: int, b: int) -> bytes:
        if self.data is not None:
            return self.data[a:b]
        with self.path.open("rb") as fh:
            fh.seek(a)
            return fh.read(b - a)


def _file_segment(path: Path, split: str) -> _Segment:
    """A file's split without holding the file: one streaming pass checks UTF-8 and counts characters,
    then the cut (``chars // 50`` from the end, as :func:`_split_text`) is found in the file's tail."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    chars, has_cr, size = 0, False, 0
    try:
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(_BLOCK), b""):
                chars += len(decoder.decode(block))
                has_cr = has_cr or b"\r" in block
                size += len(block)
            chars += len(decoder.decode(b"", final=True))
        if has_cr:  # text mode translates \r\n and \r: read it as Python (and datasets) do
            return _Segment(str(path), data=_split_text(path.read_text(encoding="utf-8"), split).encode())
        cut = size
        need = chars // EVAL_DIVISOR  # characters of the eval split, counted back from the end
        with path.open("rb") as fh:
            while need > 0:
                start = max(0, cut - _BLOCK)
                fh.seek(start)
                arr = np.frombuffer(fh.read(cut - start), dtype=np.uint8)
                heads = np.flatnonzero((arr & 0xC0) != 0x80)  # the first byte of every character
                if len(heads) >= need:
                    cut = start + int(heads[len(heads) - need])
                    need = 0
                else:
                    need -= len(heads)
                    cut = start
    except UnicodeDecodeError as err:
        raise CalibrationError(f"calibration file {path} is not UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise CalibrationError(f"calibration file {path} cannot be read: {err.strerror}") from None
    lo, hi = (0, cut) if split == "calibration" else (cut, size)
    return _Segment(str(path), path=path, lo=lo, hi=hi)


def _sampled(
    encode: Callable[[list[str]], list[list[int]]], segments: list[_Segment], samples: int, seq_len: int, seed: int
) -> torch.Tensor | None:
    """One window per equal byte range of the segments (see :mod:`moecompress.calibration.sources`); ``None`` when some
    range cannot supply ``seq_len`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    where = torch.rand(samples, generator=gen, dtype=torch.float64).tolist()
    order = torch.randperm(samples, generator=gen)
    offsets = [0]
    for s in segments:
        offsets.append(offsets[-1] + s.hi - s.lo)
    total = offsets[-1]
    jobs = []  # [segment, room_lo, room_hi, position, read length, backwards]
    for k in range(samples):
        a, b = k * total // samples, (k + 1) * total // samples
        p = a + int(where[k] * (b - a))
        i = bisect.bisect_right(offsets, p) - 1
        seg, base = segments[i], segments[i].lo - offsets[i]
        lo, hi = max(a, offsets[i]) + base, min(b, offsets[i + 1]) + base
        jobs.append([seg, lo, hi, p + base, seq_len * _READ_BYTES_PER_TOKEN, False])
    rows: list[list[int] | None] = [None] * samples
    while True:
        todo = [k for k in range(samples) if rows[k] is None]
        if not todo:
            break
        texts, done_reading = [], []
        for k in todo:
            seg, lo, hi, pos, length, back = jobs[k]
            a, b = (max(lo, hi - length), hi) if back else (pos, min(hi, pos + length))
            buf = seg.read(a, b)
            start = 0
            if a != seg.lo:  # inside a text: begin at a whitespace, never inside a word or a character
                m = _SPACE.search(buf)
                start = m.start() if m else len(buf)
            end = len(buf)
            if b != seg.hi:  # end at a whitespace too
                end = max(start, *(buf.rfind(c, start + 1) for c in _SPACES))
            texts.append(buf[start:end].decode("utf-8"))
            done_reading.append(a == lo if back else b == hi)
        for k, ids, exhausted in zip(todo, encode(texts), done_reading, strict=True):
            job = jobs[k]
            if len(ids) > seq_len or (exhausted and len(ids) == seq_len):
                rows[k] = ids[-seq_len:] if job[5] else ids[:seq_len]
            elif not exhausted:
                job[4] *= 2
            elif not job[5]:  # the forward read reached the range's end: read back from there
                job[4], job[5] = seq_len * _READ_BYTES_PER_TOKEN, True
            else:
                return None
    return torch.tensor(rows, dtype=torch.int64)[order]
