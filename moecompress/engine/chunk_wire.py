"""A chunk's parts (:mod:`moecompress.engine.chunk_work`) as bytes, to send them from one rank to another:
safetensors for the tensors and JSON for everything else, never pickle.

A message is an 8-byte little-endian length, a UTF-8 JSON header of that length, then a safetensors blob
holding every real tensor the header refers to (``{"t": key}``). A ``meta`` tensor (a skeleton's weights)
travels as ``{"meta": shape, "dtype": name}``; a step ``info`` as JSON whose tensors are references,
every other value plain JSON (a value JSON cannot hold is a :class:`PassError` naming the step). The header
may instead carry an ``error`` (a :class:`~moecompress.errors.MoecompressError` the sending rank raised):
:func:`decode` raises it again, with the same type and line, on the receiving rank.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors.torch import load, save

from moecompress import errors
from moecompress.engine.chunk_work import ErrPart, StepPart
from moecompress.errors import MoecompressError, PassError
from moecompress.ir import Act, ExpertBank
from moecompress.layouts import LAYOUTS

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


def encode(parts, steps: list) -> bytes:
    """The parts of one chunk (an iterable of :class:`ErrPart` / :class:`StepPart`) as one message."""
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
            "writes": [[how, name, box.ref(t)] for how, name, t in p.writes],
        })  # fmt: skip
        p.writes = []  # the encoded tensors now live in the message only
    return _frame({"parts": head}, save(box.out) if box.out else b"")


def encode_error(err: MoecompressError) -> bytes:
    """A message that makes the receiver raise ``err`` again."""
    return _frame({"error": {"type": type(err).__name__, "message": str(err)}}, b"")


def _frame(head: dict, blob: bytes) -> bytes:
    text = json.dumps(head).encode()
    return struct.pack("<Q", len(text)) + text + blob


def decode(msg: bytes) -> list[ErrPart | StepPart]:
    """The parts of a message from :func:`encode` (or the error of :func:`encode_error`, raised)."""
    (n,) = struct.unpack("<Q", msg[:8])
    head = json.loads(msg[8 : 8 + n].decode())
    if "error" in head:
        kind = getattr(errors, head["error"]["type"], None)
        if not (isinstance(kind, type) and issubclass(kind, MoecompressError)):
            kind = MoecompressError
        try:
            err = kind(head["error"]["message"])
        except TypeError:
            err = MoecompressError(head["error"]["message"])
        raise err
    tensors = load(msg[8 + n :]) if len(msg) > 8 + n else {}
    out: list[ErrPart | StepPart] = []
    for d in head["parts"]:
        if "err" in d:
            out.append(ErrPart(d["err"], _tensor(d["acc"], tensors), d["top"]))
            continue
        out.append(StepPart(
            d["s"], d["g0"], None if d["skeleton"] is None else _unbank(d["skeleton"], tensors), d["secs"],
            None if d["info"] is None else _uninfo(d["info"], tensors),
            None if d["bound"] is None else tuple(d["bound"]), d["changed"], d["stock"],
            [(how, name, _tensor(r, tensors)) for how, name, r in d["writes"]],
        ))  # fmt: skip
    return out
