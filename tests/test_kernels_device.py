"""The kernel tests run unchanged on CUDA: everything a kernel family prepares stays on the bank's device,
and the kernel tests hand every bank and input to the kernels through ``kernel_device`` (which moves them
to the test's device and checks where the results are).

On a machine without a GPU the bank's device and the host are both the CPU, so placement is checked with
the default-device trap of ``tests/kernel_device.py``: ``prepare`` (and, under the interpreter, the
forward) runs with ``meta`` as the default device, so any tensor made without naming its device lands on
``meta`` — where it would have landed on the host next to a CUDA bank — and either fails at once or is
listed by :func:`kernel_device.misplaced`. A static check makes sure no kernel test calls a kernel entry
point directly (the pattern that left banks and inputs on the CPU on an H200: 60 failures)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import test_kernels_dispatch as disp
from kernel_device import DEV, TRAP, bank_to, default_device_trap, forward_on, misplaced, prepare_on

from moecompress.ir import Act, ExpertBank
from moecompress.kernels import factorized as k4
from moecompress.kernels.dispatch import prepare_triton
from moecompress.methods.rotation import hadamard
from moecompress.reference import experts_forward

pytestmark = pytest.mark.interpreter
ROOT = Path(__file__).resolve().parents[1]
NE, NH, NI = disp.NE, disp.NH, disp.NI
EMAP = torch.tensor([0, 0, 1, 2, -1, 3, 3, 4, 5, 5])  # merged ids, a dropped (-1) entry


def _biases(seed=4):
    gen = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(NE, NI, generator=gen), "up": torch.randn(NE, NI, generator=gen),
            "down": torch.randn(NE, NH, generator=gen)}  # fmt: skip


def _all_exact_codebook():
    gen = torch.Generator().manual_seed(5)
    lays = (disp.codebook_layout(o, i, gen, exact=tuple(range(NE))) for o, i in ((NI, NH), (NI, NH), (NH, NI)))
    return ExpertBank(*lays)


BANKS = {
    "dense": lambda: disp.dense_bank(),
    "dense_widths": lambda: disp.dense_bank(widths=torch.tensor([48, 16, 0, 31, 48, 7])),
    "dense_rotated_unrotated": lambda: disp.dense_bank(rotation=hadamard(NH, seed=1).float(), act_bits=4,
                                                       unrotated=frozenset({2})),
    "ragged_biases_clamped": lambda: disp.ragged_bank(biases=_biases(), act=Act.SWIGLU_CLAMPED, limit=1.5),
    "codebook": lambda: disp.compressed_bank("codebook"),
    "codebook_all_exact": _all_exact_codebook,
    "rtn": lambda: disp.compressed_bank("rtn"),
    "rtn_widths_biases": lambda: dataclasses.replace(disp.compressed_bank("rtn"), biases=_biases(),
                                                     widths=torch.tensor([48, 17, 0, 33, 48, 8])),
    "lowrank": lambda: disp.compressed_bank("lowrank"),
    "lowrank_biases_rotated": lambda: dataclasses.replace(disp.compressed_bank("lowrank"), biases=_biases(),
                                                          rotation=hadamard(NH, seed=2).float(), act_bits=4),
    "tucker": lambda: disp.compressed_bank("tucker"),
    "tucker_down_bias": lambda: dataclasses.replace(disp.compressed_bank("tucker"), biases=_biases()),
}


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("emap", [None, EMAP], ids=["no_map", "expert_map"])
@pytest.mark.parametrize("name", sorted(BANKS))
def test_prepare_keeps_everything_on_the_banks_device(name, emap):
    """Every family (dense, ragged, codebook, rtn, lowrank, tucker; expert maps, biases, rotations, live
    widths, all-exact banks): ``prepare_triton`` run with ``meta`` as the default device leaves no tensor
    off the bank's device (on a GPU machine also for the bank on ``cuda``)."""
    for dev in _devices():
        bank = bank_to(BANKS[name](), dev)
        with default_device_trap():
            prep = prepare_triton(bank, None if emap is None else emap.to(dev))
        assert prep is not None, name
        assert misplaced(prep, dev) == []


@pytest.mark.skipif(not TRAP, reason="the forward under the default-device trap needs Triton's interpreter")
@pytest.mark.parametrize("name", sorted(BANKS))
def test_forward_makes_nothing_on_the_default_device(name):
    """Under the interpreter, the whole forward (align, GEMMs, combine, exact experts, biases) runs with
    ``meta`` as the default device and still equals the oracle: nothing it makes lands on the host."""
    bank = BANKS[name]()
    x, ids, w = disp._inputs(7, k=2, n_logical=EMAP.numel(), seed=3)
    prep = prepare_on(prepare_triton, bank, EMAP)
    got = forward_on(prep.forward, x, ids, w)
    ref = experts_forward(bank, x, ids, w, EMAP)
    torch.testing.assert_close(got.float(), ref, atol=1e-4 * float(ref.abs().max().clamp_min(1e-3)), rtol=0)


def test_the_trap_catches_tensors_made_without_a_device(monkeypatch):
    """The check fails where a CUDA run would: a tensor made on the default device and kept, or mixed with
    the bank's tensors (here the factorised prepare with its per-member tables made on the host, as
    before issue 33). Run on a CPU bank with the trap on any machine."""

    @dataclasses.dataclass
    class Prep:
        ok: torch.Tensor
        table: torch.Tensor

    bank = disp.dense_bank()
    with default_device_trap():
        prep = Prep(bank.gate.weight[0] * 2, torch.arange(3))  # no device: the host on CUDA, meta here
    assert misplaced(prep, "cpu") == ["prep.table: meta"]

    def host_tables(m, device):
        return torch.zeros(m, dtype=torch.int64), lambda v: torch.full((m,), int(v), dtype=torch.int64)

    tucker = disp.compressed_bank("tucker")
    with default_device_trap():
        assert misplaced(prepare_triton(tucker), "cpu") == []
    monkeypatch.setattr(k4, "_index_makers", host_tables)
    with pytest.raises((NotImplementedError, RuntimeError), match="meta"), default_device_trap():
        prepare_triton(tucker)


ENTRY_POINTS = {"prepare", "prepare_triton", "operands", "grouped_moe", "moe_align", "moe_combine", "forward"}


def test_kernel_tests_reach_the_kernels_through_the_device_helpers():
    """No ``tests/test_kernels_*.py`` calls a kernel entry point itself (``prepare``, ``prepare_triton``,
    ``operands``, ``grouped_moe``, ``moe_align``, ``moe_combine``, ``.forward``): they pass it to
    ``prepare_on`` / ``forward_on``, which put the bank and the inputs on the test's device. (The H200's
    60 failures were such direct calls with banks or inputs left on the CPU.)"""
    direct = []
    for path in sorted((ROOT / "tests").glob("test_kernels_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in ENTRY_POINTS:
                    direct.append(f"{path.name}:{node.lineno} {ast.unparse(f)}(...)")
    allowed = {n for n in direct if n.startswith("test_kernels_device.py:")}  # this file's own trap probes
    assert sorted(set(direct) - allowed) == []


def test_device_fixture(device):
    assert device == DEV and device.type == ("cuda" if torch.cuda.is_available() else "cpu")
