"""Messages between ranks in the layer loop (:mod:`moecompress.engine.shard`).

The wire: a chunk's parts (:mod:`moecompress.engine.unit_work`) as bytes, to send them from one rank to another:
safetensors for the tensors and JSON for everything else, never pickle.

A message is two sends: a UTF-8 JSON header, then a safetensors blob holding every real tensor the header
refers to (``{"t": key}``); apart, so that no side copies the tensors' bytes to join or split them. A ``meta`` tensor (a skeleton's weights)
travels as ``{"meta": shape, "dtype": name}``; a step ``info`` as JSON whose tensors are references,
every other value plain JSON (a value JSON cannot hold is a :class:`PassError` naming the step). The header
may instead carry an ``error`` (a :class:`~moecompress.errors.MoecompressError` the sending rank raised):
:func:`decode` raises it again, with the same type and line, on the receiving rank.

The other ranks send through an :class:`Outbox` (one message in flight); rank 0 takes each with :func:`receive`.
A written step's encoded tensors may instead go into a file of the sending rank's (:class:`UnitFiles`, agreed
by :func:`unit_files`) that rank 0's writer adopts: the header then says where (:class:`FileBytes`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save

from moecompress import errors
from moecompress.engine.distributed import Ranks, Sending
from moecompress.engine.journal import UNITS
from moecompress.engine.unit_work import ErrPart, StepPart
from moecompress.errors import MoecompressError, PassError, RecipeError
from moecompress.io.shard_format import _pwrite, load_buffer
from moecompress.ir import Act, ExpertBank
from moecompress.layouts import LAYOUTS


class Outbox:
    """A rank's messages to rank 0 with at most one in flight: the rank works its next unit while rank 0 has
    yet to receive the last (a blocking send waited for rank 0 to reach its receive, unit by unit:
    :meth:`~moecompress.engine.distributed.Ranks.isend_bytes`). :meth:`wait` before any collective."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self._flying: list[Sending] = []

    def send(self, make: Callable[[], tuple[bytes, bytes]]) -> None:
        """Send ``make()``'s message once the last one is received; an error ``make`` raises is sent, then
        raised here."""
        try:
            head, blob = make()
        except MoecompressError as err:
            self.wait()
            head, blob = encode_error(err)
            self.ranks.send_bytes(head, 0)
            self.ranks.send_bytes(blob, 0)
            raise
        self.wait()
        self._flying = [self.ranks.isend_bytes(head, 0), self.ranks.isend_bytes(blob, 0)]

    def wait(self) -> None:
        """Until rank 0 has received every message sent."""
        for sending in self._flying:
            sending.wait()
        self._flying = []


def receive(ranks: Ranks, src: int) -> tuple[bytes, torch.Tensor]:
    """The next message rank ``src`` sends (:meth:`Outbox.send`): its header, then its tensors' safetensors bytes
    (a uint8 tensor: :func:`decode` views the tensors in it)."""
    head = ranks.recv_bytes(src)
    return head, ranks.recv_buffer(src)


# -- the wire ------------------------------------------------------------------------------------------

PROJ = ("gate", "up", "down")


class _Tensors:
    """The real tensors of one message, each stored once (contiguous, its own storage)."""

    def __init__(self) -> None:
        self.out: dict[str, torch.Tensor] = {}
        self.storages: set[int] = set()

    def ref(self, t: torch.Tensor) -> dict:
        if t.device.type == "meta":
            return {"meta": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        t = t.detach().to("cpu").contiguous()
        store = t.untyped_storage()
        if t.numel() and (store.nbytes() != t.nbytes or store.data_ptr() in self.storages):
            t = t.clone()  # safetensors stores tensors that own their storage, once each
        if t.numel():
            self.storages.add(t.untyped_storage().data_ptr())
        key = f"t{len(self.out)}"
        self.out[key] = t
        return {"t": key}


def _tensor(ref: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    if "meta" in ref:
        return torch.empty(ref["meta"], dtype=getattr(torch, ref["dtype"]), device="meta")
    return tensors[ref["t"]]


def _bank(bank: ExpertBank, box: _Tensors) -> dict:
    lays = {p: {"kind": getattr(bank, p).kind, "meta": getattr(bank, p).meta(),
                "tensors": {k: box.ref(t) for k, t in getattr(bank, p).tensors().items()}} for p in PROJ}  # fmt: skip
    return {"layouts": lays, "widths": None if bank.widths is None else box.ref(bank.widths),
            "biases": {k: box.ref(v) for k, v in bank.biases.items()}, "act": bank.act.value, "alpha": bank.alpha,
            "limit": bank.limit, "rotation": None if bank.rotation is None else box.ref(bank.rotation),
            "act_bits": bank.act_bits, "unrotated": sorted(bank.unrotated)}  # fmt: skip


def _unbank(d: dict, tensors: dict[str, torch.Tensor]) -> ExpertBank:
    lays = [LAYOUTS[x["kind"]].from_tensors({k: _tensor(r, tensors) for k, r in x["tensors"].items()}, x["meta"])
            for x in (d["layouts"][p] for p in PROJ)]  # fmt: skip
    return ExpertBank(
        *lays, widths=None if d["widths"] is None else _tensor(d["widths"], tensors),
        biases={k: _tensor(r, tensors) for k, r in d["biases"].items()}, act=Act(d["act"]), alpha=d["alpha"],
        limit=d["limit"], rotation=None if d.get("rotation") is None else _tensor(d["rotation"], tensors),
        act_bits=d.get("act_bits"), unrotated=frozenset(d.get("unrotated", ())),
    )  # fmt: skip


def _info(info: dict, box: _Tensors, label: str) -> Any:
    def default(obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": box.ref(obj)}
        if isinstance(obj, tuple | frozenset | set):
            return list(obj)
        raise PassError(
            f"{label}: its info holds a {type(obj).__name__}, which cannot be sent between ranks as JSON; run "
            "one process"
        )

    return json.loads(json.dumps(info, default=default))


def _uninfo(info: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(info, dict):
        if set(info) == {"__tensor__"}:
            return _tensor(info["__tensor__"], tensors)
        return {k: _uninfo(v, tensors) for k, v in info.items()}
    if isinstance(info, list):
        return [_uninfo(v, tensors) for v in info]
    return info


def encode(parts, steps: list, files: UnitFiles | None = None, started: float | None = None) -> tuple[bytes, bytes]:
    """The parts of one chunk (an iterable of :class:`ErrPart` / :class:`StepPart`) as one message: its
    header and its tensors (safetensors), sent apart so that neither side copies the tensors' bytes again
    to join or split them (a message's peak: its tensors and one copy of their bytes). With ``files``, a
    written step's encoded tensors go to a file of this rank's instead (:class:`UnitFiles`) and the header
    says where. ``started``: when the unit's work began (the header then says its seconds, ``unit_s``)."""
    box, head = _Tensors(), []
    for p in parts:
        if isinstance(p, ErrPart):
            head.append({"err": p.state, "acc": box.ref(p.acc), "top": p.top})
            continue
        head.append({
            "s": p.s, "g0": p.g0, "secs": p.secs, "changed": p.changed, "stock": p.stock,
            "bound": None if p.bound is None else list(p.bound),
            "info": None if p.info is None else _info(p.info, box, steps[p.s].label),
            "skeleton": None if p.skeleton is None else _bank(p.skeleton, box),
            "writes": _writes(p.writes, box, files),
        })  # fmt: skip
        p.writes = []  # the encoded tensors now live in the message only
    blob = save(box.out) if box.out else b""
    box.out.clear()  # the parts' tensors now live in the blob only
    msg: dict[str, Any] = {"parts": head}
    if started is not None:  # the unit's seconds on this rank (rank 0's Balance)
        msg["unit_s"] = time.perf_counter() - started
    return json.dumps(msg).encode(), blob


def encode_error(err: MoecompressError) -> tuple[bytes, bytes]:
    """A message that makes the receiver raise ``err`` again."""
    return json.dumps({"error": {"type": type(err).__name__, "message": str(err)}}).encode(), b""


def decode(text: bytes, blob: bytes | torch.Tensor) -> list[ErrPart | StepPart]:
    """The parts of a message from :func:`encode` (or the error of :func:`encode_error`, raised); a received
    ``blob`` (uint8 tensor) is not copied: the parts' tensors are views into it (``load_buffer``)."""
    return decode_message(json.loads(text.decode()), blob)


def decode_message(head: dict, blob: bytes | torch.Tensor) -> list[ErrPart | StepPart]:
    """:func:`decode` of a header already parsed (rank 0 also reads its ``unit_s``)."""
    if "error" in head:
        kind = getattr(errors, head["error"]["type"], None)
        if not (isinstance(kind, type) and issubclass(kind, MoecompressError)):
            kind = MoecompressError
        try:
            err = kind(head["error"]["message"])
        except TypeError:
            err = MoecompressError(head["error"]["message"])
        raise err
    if isinstance(blob, torch.Tensor):
        tensors = load_buffer(blob) if blob.numel() else {}
    else:
        tensors = load(blob) if blob else {}
    out: list[ErrPart | StepPart] = []
    for d in head["parts"]:
        if "err" in d:
            out.append(ErrPart(d["err"], _tensor(d["acc"], tensors), d["top"]))
            continue
        out.append(StepPart(
            d["s"], d["g0"], None if d["skeleton"] is None else _unbank(d["skeleton"], tensors), d["secs"],
            None if d["info"] is None else _uninfo(d["info"], tensors),
            None if d["bound"] is None else tuple(d["bound"]), d["changed"], d["stock"],
            [(how, name, FileBytes.of(r) if "f" in r else _tensor(r, tensors)) for how, name, r in d["writes"]],
        ))  # fmt: skip
    return out


# -- a unit's encoded tensors through a file ---------------------------------------------------------------


@dataclass(frozen=True)
class FileBytes:
    """A written tensor that another rank wrote at ``offset`` in its file ``file`` of the run's units directory
    (:data:`~moecompress.engine.journal.UNITS`), for rank 0's writer to adopt
    (:meth:`~moecompress.io.writer.ShardWriter.adopt`) instead of receiving its bytes."""

    file: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @classmethod
    def of(cls, ref: dict) -> FileBytes:
        name = str(ref["f"])
        if not name or Path(name).name != name:
            raise RecipeError(f"a rank named the unit file {name!r}, not a file of the units directory")
        return cls(name, int(ref["o"]), getattr(torch, ref["dtype"]), tuple(int(d) for d in ref["shape"]))


@dataclass
class UnitFiles:
    """Rank ``rank``'s files in the units directory ``where``: one per written step of a unit, its tensors one
    after another, written and closed before the unit's message goes (so rank 0, on this host or another that
    sees the same file system, reads them whole)."""

    where: Path
    rank: int
    count: int = 0

    def write(self, tensors: list[torch.Tensor]) -> tuple[str, list[int]]:
        """A new file holding ``tensors``: its name and each tensor's offset."""
        name = f"r{self.rank}-{self.count:06d}.data"
        self.count += 1
        fd = os.open(self.where / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        offsets, off = [], 0
        try:
            for t in tensors:
                offsets.append(off)
                off += _pwrite(fd, t, off)
        finally:
            os.close(fd)
        return name, offsets


def _writes(writes: list, box: _Tensors, files: UnitFiles | None) -> list:
    """A step part's written tensors in a message's header: references into the blob, or (``files``) where
    they are in a new file of this rank's."""
    real = [t for _, _, t in writes if t.device.type != "meta"]
    if files is None or not real:
        return [[how, name, box.ref(t)] for how, name, t in writes]
    file, offsets = files.write(real)
    where = iter(offsets)
    return [
        [how, name, box.ref(t) if t.device.type == "meta" else
         {"f": file, "o": next(where), "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}]
        for how, name, t in writes
    ]  # fmt: skip


def unit_files(ranks: Ranks, staging: Path) -> UnitFiles | None:
    """Every rank, once before the layer loop (rank 0 has made ``staging``): where ranks ``1..N-1`` write their
    units' encoded tensors, or ``None`` (at world size 1, and when some rank does not see rank 0's staging
    directory — another host without a shared file system —: the tensors then travel in the messages). Rank 0
    makes the units directory; each other rank writes a probe of its own into it, and rank 0 reads it back."""
    if ranks.world_size == 1:
        return None
    where = staging / UNITS
    if ranks.is_writer:
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
    ranks.barrier()
    token = b""
    if not ranks.is_writer and where.is_dir():
        token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}".encode()
        try:
            (where / f"probe-{ranks.rank}").write_bytes(token)
        except OSError:
            token = b""
    tokens = ranks.all_gather_bytes(token)
    seen = True
    if ranks.is_writer:
        for r, t in enumerate(tokens[1:], 1):
            probe = where / f"probe-{r}"
            seen = seen and bool(t) and probe.is_file() and probe.read_bytes() == t
            probe.unlink(missing_ok=True)
    return UnitFiles(where, ranks.rank) if ranks.from_writer(seen) and not ranks.is_writer else None
