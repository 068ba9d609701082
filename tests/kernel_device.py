"""Where the kernel tests run: ``DEV`` (``cuda`` when available, else ``cpu`` under Triton's interpreter,
see conftest.py), and the placement checks that make them run unchanged on CUDA.

A kernel test builds its banks and inputs on the host (seeded CPU generators, CPU references), then
serves them through :func:`prepare_on` / :func:`forward_on`, which move the bank and the inputs to ``DEV``
and fail when anything prepared or returned is elsewhere. On CPU ``DEV`` is the host itself, so moving
proves nothing; there both calls run under :func:`default_device_trap` instead: the default device
becomes ``meta``, so a tensor made inside ``prepare``/``forward`` without naming its device is a meta
tensor (the CPU stand-in for the host tensor it would be on CUDA) and fails there (an op mixing it with
real data, ``.to()`` out of meta, a Triton launch) or in :func:`check_placement`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bank_to(bank, device: torch.device | str):
    """``bank`` (an ``ExpertBank``) with every tensor (layouts, widths, biases, rotation) on ``device``."""
    device = torch.device(device)
    t = lambda x: None if x is None else x.to(device)  # noqa: E731
    return dataclasses.replace(
        bank, gate=bank.gate.to(device), up=bank.up.to(device), down=bank.down.to(device), widths=t(bank.widths),
        biases={k: v.to(device) for k, v in bank.biases.items()}, rotation=t(bank.rotation),
    )  # fmt: skip


def on_dev(*ts: torch.Tensor | None):
    """The tensors on ``DEV`` (one tensor when one is given)."""
    out = tuple(None if t is None else t.to(DEV) for t in ts)
    return out[0] if len(out) == 1 else out


@contextlib.contextmanager
def default_device_trap(enabled: bool = True) -> Iterator[None]:
    """Factory calls without ``device=`` make ``meta`` tensors inside the block (see the module docstring)."""
    if not enabled:
        yield
        return
    with torch.device("meta"):
        yield


def tensors_of(obj: Any, path: str = "prep", seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj`` through dataclass fields, attributes, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_of(v, f"{path}[{k!r}]", seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors_of(v, f"{path}[{i}]", seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_of(getattr(obj, f.name), f"{path}.{f.name}", seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("moecompress"):
        for k, v in vars(obj).items():
            yield from tensors_of(v, f"{path}.{k}", seen)


def misplaced(obj: Any, device: torch.device | str) -> list[str]:
    """``path: device`` of every tensor reachable from ``obj`` that is not on ``device``."""
    device = torch.device(device)
    return [f"{p}: {t.device}" for p, t in tensors_of(obj) if t.device.type != device.type]


def check_placement(obj: Any, device: torch.device | str) -> None:
    bad = misplaced(obj, device)
    assert not bad, f"tensors off the bank's device {device}: {bad}"
    assert any(True for _ in tensors_of(obj)), "nothing prepared to check"


TRAP = DEV.type == "cpu"  # on CUDA the device boundary itself is the check


def prepare_on(prepare: Callable, bank, *args, **kw):
    """``prepare(bank on DEV, *args)`` (run under the default-device trap on CPU); everything it prepared
    must be on ``DEV``. ``None`` (a bank the kernel does not serve) passes through."""
    bank = bank_to(bank, DEV)
    args = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args)
    with default_device_trap(TRAP):
        prep = prepare(bank, *args, **kw)
    if prep is not None:
        check_placement(prep, DEV)
    return prep


def forward_on(fn: Callable, *args, **kw) -> torch.Tensor:
    """``fn`` (``prep.forward``, ``grouped_moe``, ...) on its tensor arguments moved to ``DEV`` (under the
    trap on CPU); its outputs must be on ``DEV``."""
    args = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args)
    kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with default_device_trap(TRAP):
        out = fn(*args, **kw)
    check_placement(out, DEV)
    return out
