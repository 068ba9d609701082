"""``prepare_triton``: banks of every layout dispatched through the kernel table, each Prepared equal to
``moecompress.reference.experts_forward`` (interpreter on CPU, CUDA unchanged); and the GPU
benchmark's ``--dry-run`` (same harness, tiny shapes, interpreter) finishing."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kernel_device import forward_on, prepare_on

from moecompress.ir import Act, ExpertBank
from moecompress.kernels.dispatch import FAMILIES, available, family_of, prepare_triton
from moecompress.layouts import RTN, Codebook, Dense, LowRank, Tucker
from moecompress.layouts.ragged import Ragged
from moecompress.methods.rotation import hadamard
from moecompress.reference import experts_forward

pytestmark = pytest.mark.interpreter
ROOT = Path(__file__).resolve().parents[1]
NE, NH, NI = 6, 64, 48


def _w(*shape, gen):
    return torch.randn(*shape, generator=gen) / 8


def dense_bank(dtype=torch.float32, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    return ExpertBank(Dense(_w(NE, NI, NH, gen=gen).to(dtype)), Dense(_w(NE, NI, NH, gen=gen).to(dtype)),
                      Dense(_w(NE, NH, NI, gen=gen).to(dtype)), **kw)


def ragged_bank(dtype=torch.float32, seed=1, **kw):
    gen = torch.Generator().manual_seed(seed)
    keep = [torch.arange(n) for n in (48, 0, 17, 32, 5, 40)]
    g, u, d = _w(NE, NI, NH, gen=gen), _w(NE, NI, NH, gen=gen), _w(NE, NH, NI, gen=gen)
    return ExpertBank(Ragged.from_dense(g, keep, "out").cast(dtype), Ragged.from_dense(u, keep, "out").cast(dtype),
                      Ragged.from_dense(d, keep, "in").cast(dtype), **kw)


def codebook_layout(out, inn, gen, exact=(1,)):
    codes = {e: torch.randint(0, 16, (out, inn), generator=gen) for e in range(NE) if e not in exact}
    cents = {e: torch.randn(out, 1, 16, generator=gen) / 8 for e in codes}
    ex = {e: _w(out, inn, gen=gen) for e in exact}
    return Codebook.build(codes, cents, ex, 4, torch.empty(NE, out, inn))


def lowrank_layout(out, inn, gen, r=8):
    facts = {e: (_w(out, r, gen=gen), _w(r, inn, gen=gen)) for e in range(NE) if e != 2}
    return LowRank.from_factors(facts, {2: _w(out, inn, gen=gen)}, torch.empty(NE, out, inn))


def tucker_layout(out, inn, gen, r2=16, r3=16):
    members = torch.tensor([0, 1, -1, 2, 3, 4])
    return Tucker(_w(out, r2, gen=gen), _w(inn, r3, gen=gen), _w(5, r2, r3, gen=gen), members,
                  _w(1, out, inn, gen=gen))


def compressed_bank(kind, seed=2):
    gen = torch.Generator().manual_seed(seed)
    if kind == "codebook":
        return ExpertBank(*(codebook_layout(o, i, gen) for o, i in ((NI, NH), (NI, NH), (NH, NI))))
    if kind == "rtn":
        return ExpertBank(*(RTN.from_dense(_w(NE, o, i, gen=gen), 4, 16, protected={3}) for o, i in
                            ((NI, NH), (NI, NH), (NH, NI))))
    if kind == "lowrank":
        return ExpertBank(*(lowrank_layout(o, i, gen) for o, i in ((NI, NH), (NI, NH), (NH, NI))))
    return ExpertBank(*(tucker_layout(o, i, gen) for o, i in ((NI, NH), (NI, NH), (NH, NI))))


def _inputs(t, k=2, n_logical=NE, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, NH, generator=gen).to(dtype)
    ids = torch.randint(0, n_logical, (t, k), generator=gen)
    ids[0, -1] = n_logical  # a dropped slot
    return x, ids, torch.rand(t, k, generator=gen)


def _check(bank, t=7, expert_map=None, dtype=torch.float32, k=2):
    n_logical = NE if expert_map is None else expert_map.numel()
    x, ids, w = _inputs(t, k, n_logical, seed=t, dtype=dtype)
    prep = prepare_on(prepare_triton, bank, expert_map)
    assert prep is not None, f"no kernel served {bank.gate.kind}/{bank.up.kind}/{bank.down.kind}"
    got = forward_on(prep.forward, x, ids, w).float().cpu()
    ref = experts_forward(bank, x, ids, w, expert_map)
    eps = torch.finfo(dtype).eps
    scale = float(ref.abs().max().clamp_min(1e-3))
    atol = (1e-4 * math.sqrt((NH + NI) / 64) if dtype == torch.float32 else eps * math.sqrt(NH + NI)) * scale
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    return got


def test_family_table():
    assert family_of(dense_bank()) == "grouped_gemm" and family_of(ragged_bank()) == "grouped_gemm"
    gen = torch.Generator().manual_seed(0)
    mixed = ExpertBank(codebook_layout(NI, NH, gen), codebook_layout(NI, NH, gen), Dense(_w(NE, NH, NI, gen=gen)))
    assert family_of(mixed) == "codebook_gemm"
    two = ExpertBank(codebook_layout(NI, NH, gen), codebook_layout(NI, NH, gen), lowrank_layout(NH, NI, gen))
    assert family_of(two) is None and prepare_on(prepare_triton, two) is None  # two compressed families: PyTorch path
    assert set(FAMILIES) == {"dense", "ragged", "codebook", "rtn", "tucker", "lowrank"}


@pytest.mark.parametrize(("dtype", "t"), [(torch.float32, t) for t in (1, 3, 7, 33)] + [(torch.float16, 7)])
def test_dense_and_ragged(dtype, t):
    """(The full fp32/fp16 × T matrix of K2 is in test_kernels_grouped.py.)"""
    _check(dense_bank(dtype), t=t, dtype=dtype)
    _check(ragged_bank(dtype), t=t, dtype=dtype)


def test_uniform_pruned_with_expert_map():
    """Dense storage with live widths; a merge map with duplicates and a ``-1`` (dropped) entry."""
    emap = torch.tensor([0, 0, 1, 2, -1, 3, 3, 4, 5, 5])
    _check(dense_bank(widths=torch.tensor([48, 16, 0, 31, 48, 7])), t=33, expert_map=emap)


def test_biases_clamped_activation():
    gen = torch.Generator().manual_seed(4)
    b = {"gate": torch.randn(NE, NI, generator=gen), "up": torch.randn(NE, NI, generator=gen),
         "down": torch.randn(NE, NH, generator=gen)}
    _check(ragged_bank(biases=b, act=Act.SWIGLU_CLAMPED, alpha=1.702, limit=1.5), t=7)


def test_rotation_act_bits_unrotated():
    rot = hadamard(NH, seed=1).float()
    _check(dense_bank(rotation=rot, act_bits=4, unrotated=frozenset({2})), t=7, k=3)
    _check(ragged_bank(rotation=rot, act_bits=None, unrotated=frozenset()), t=3)


@pytest.mark.parametrize("kind", ["codebook", "rtn", "lowrank", "tucker"])
def test_compressed_banks_dispatch_through_table(kind):
    module = FAMILIES[kind]
    if not available(module):
        pytest.skip(f"kernels/{module}.py (helper K-b) is not present yet")
    bank = compressed_bank(kind)
    assert family_of(bank) == module
    _check(bank, t=7)


def test_gpu_benchmark_dry_run(tmp_path):
    """``benchmarks/gpu_moe.py --dry-run``: the GPU harness at tiny shapes under the interpreter."""
    r = subprocess.run(  # (no wall-clock bound: speed is for benchmarks/; the timeout only stops a hang)
        [sys.executable, str(ROOT / "benchmarks" / "gpu_moe.py"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = (tmp_path / "gpu_moe.csv").read_text().splitlines()
    assert len(rows) > 5 and rows[0].startswith("shape,")
    assert "k2" in (tmp_path / "gpu_moe.json").read_text()


def test_kernels_compile_for_h200_offline():
    """K1/K2/K5 and the vLLM baseline compile for sm_90 with triton's bundled ptxas (no GPU needed): shared
    memory within 227 KiB and pipelined 16-byte ``cp.async`` tile loads in the weight-streaming loops."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is absent")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_compile_check.py")], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 failed" in r.stdout and r.stdout.count("ok  ") >= 20
