"""K2 grouped GEMM and K5 combine under the Triton interpreter on CPU (and on CUDA unchanged).

Every case is compared with ``moe_loop`` (KERNELS.md §4) on per-expert weights of different widths;
``moe_loop`` itself is checked against ``moecompress.reference.experts_forward``. Tolerances scale with
the dtype's epsilon and the reduction length."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_device import forward_on, prepare_on

from moecompress.ir import Act, ExpertBank
from moecompress.kernels._launch import KernelConfigError
from moecompress.kernels.combine import combine_ref, moe_combine
from moecompress.kernels.grouped_gemm import GemmConfig, grouped_moe, moe_loop, operands
from moecompress.layouts import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.reference import experts_forward

pytestmark = pytest.mark.interpreter
SMALL = GemmConfig(16, 32, 32, 32, 32, stages=2, split_k=1)


def tol(dtype, reduction, ref):
    """``eps·√K·max|ref|`` (random-walk rounding over a K-term reduction; fp16 ≈ the guide's 1e-2)."""
    eps = torch.finfo(dtype).eps
    return eps * math.sqrt(reduction) * float(ref.abs().max().clamp_min(1e-3))


def make_bank(e, h, i, widths, dtype, seed=0, biases=False, act=Act.SWIGLU, ragged=True):
    gen = torch.Generator().manual_seed(seed)
    g, u, d = (torch.randn(e, *s, generator=gen) / 10 for s in ((i, h), (i, h), (h, i)))
    b = {}
    if biases:
        b = {"gate": torch.randn(e, i, generator=gen), "up": torch.randn(e, i, generator=gen),
             "down": torch.randn(e, h, generator=gen)}
    if ragged:
        keep = [torch.arange(int(n)) for n in widths]
        lays = Ragged.from_dense(g, keep, "out"), Ragged.from_dense(u, keep, "out"), Ragged.from_dense(d, keep, "in")
        bank = ExpertBank(*(lay.cast(dtype) for lay in lays), biases=b, act=act)
    else:
        bank = ExpertBank(Dense(g.to(dtype)), Dense(u.to(dtype)), Dense(d.to(dtype)), widths=widths, biases=b, act=act)
    return bank


def loop_lists(bank):
    """Per-expert ``w13 [2·I_e, H]``, ``w2 [H, I_e]`` and biases at the live widths, for ``moe_loop``."""
    w13, w2, b13, b2 = [], [], [], []
    for e in range(bank.num_experts):
        n = bank.width_of(e)
        w13.append(torch.cat([bank.gate.expert(e)[:n], bank.up.expert(e)[:n]]))
        w2.append(bank.down.expert(e)[:, :n])
        if bank.biases:
            b13.append(torch.cat([bank.biases["gate"][e][:n], bank.biases["up"][e][:n]]))
            b2.append(bank.biases["down"][e])
    return w13, w2, (b13 or None), (b2 or None)


def run_case(bank, x, ids, w, cfg):
    ops = prepare_on(operands, bank)
    got = forward_on(grouped_moe, ops, x.to(bank.gate.dtype), ids, w, config=cfg).cpu()
    w13, w2, b13, b2 = loop_lists(bank)
    ref = moe_loop(x.to(bank.gate.dtype), w13, w2, w, ids, b13, b2, bank.act.value, bank.alpha, bank.limit)
    return got, ref


WIDTHS = [0, 47, 16, 1, 64, 33, 0, 50]  # 0-width experts, non-multiples of 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 3, 7, 33])
def test_ragged_grouped_equals_loop(dtype, t):
    e, h, k = 8, 96, 2  # H = 96: K-loop tail masked (not a multiple of BK = 64)
    bank = make_bank(e, h, 64, torch.tensor(WIDTHS), dtype, seed=t)
    gen = torch.Generator().manual_seed(t)
    x, ids, w = torch.randn(t, h, generator=gen), torch.randint(0, e, (t, k), generator=gen), torch.rand(t, k)
    cfg = GemmConfig(16, 32, 64, 32, 32, stages=2, split_k=2 if t < 7 else 1)
    got, ref = run_case(bank, x, ids, w, cfg)
    assert got.dtype == torch.float32 and got.shape == (t, h)
    torch.testing.assert_close(got, ref, atol=tol(dtype, h + 64, ref), rtol=0)


@pytest.mark.parametrize("split", [1, 3])
def test_dense_uniform_pruned_clamped_biases(split):
    """Dense storage with uniform live widths, GPT-OSS clamped activation and biases, split-K parts."""
    e, h, i, t, k = 4, 64, 48, 7, 2
    bank = make_bank(e, h, i, torch.full((e,), 32), torch.float32, biases=True, act=Act.SWIGLU_CLAMPED,
                     ragged=False)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(t, h, generator=gen) * 3  # large enough that the clamp at limit bites
    ids, w = torch.randint(0, e, (t, k), generator=gen), torch.rand(t, k, generator=gen)
    got, ref = run_case(bank, x, ids, w, GemmConfig(16, 16, 32, 32, 16, stages=2, split_k=split))
    torch.testing.assert_close(got, ref, atol=tol(torch.float32, h + i, ref), rtol=0)


def test_all_tokens_to_one_expert_and_dropped_slots():
    e, h, t, k = 4, 64, 33, 2
    bank = make_bank(e, h, 32, torch.tensor([32, 17, 0, 5]), torch.float32)
    x, w = torch.randn(t, h), torch.rand(t, k)
    ids = torch.full((t, k), 1)
    ids[::3, 1] = e  # dropped slots (routing-policy convention id == E)
    got, ref = run_case(bank, x, ids, w, SMALL)
    torch.testing.assert_close(got, ref, atol=tol(torch.float32, h + 32, ref), rtol=0)
    assert got.abs().max() > 0


def test_zero_padding_equivalence():
    """A ragged bank equals the dense bank zero-padded to the full width (SiLU(0)·0 = 0)."""
    e, h, i, t = 4, 64, 48, 7
    widths = torch.tensor([48, 20, 0, 33])
    rag = make_bank(e, h, i, widths, torch.float32)
    pad = ExpertBank(Dense(rag.gate.dense()), Dense(rag.up.dense()), Dense(rag.down.dense()))
    x, ids, w = torch.randn(t, h), torch.randint(0, e, (t, 2)), torch.rand(t, 2)
    a = forward_on(grouped_moe, prepare_on(operands, rag), x, ids, w, config=SMALL).cpu()
    b = forward_on(grouped_moe, prepare_on(operands, pad), x, ids, w, config=SMALL).cpu()
    torch.testing.assert_close(a, b, atol=tol(torch.float32, h + i, b), rtol=0)


def test_moe_loop_equals_reference_forward():
    bank = make_bank(4, 32, 24, torch.tensor([24, 7, 0, 16]), torch.float32, biases=True)
    x, ids, w = torch.randn(5, 32), torch.randint(0, 5, (5, 2)), torch.rand(5, 2)
    w13, w2, b13, b2 = loop_lists(bank)
    torch.testing.assert_close(moe_loop(x, w13, w2, w, ids, b13, b2), experts_forward(bank, x, ids, w))


@pytest.mark.parametrize("bad", [
    GemmConfig(12, 32, 32, 32, 32),  # not a power of two
    GemmConfig(16, 8, 32, 32, 32),  # tl.dot N < 16
    GemmConfig(16, 32, 32, 32, 8),  # tl.dot K < 16
    GemmConfig(128, 256, 256, 64, 64, stages=4),  # shared memory beyond 227 KiB
])
def test_bad_config_raises_typed_error(bad):
    bank = make_bank(2, 32, 16, torch.tensor([16, 8]), torch.float32)
    with pytest.raises(KernelConfigError):
        forward_on(grouped_moe, prepare_on(operands, bank), torch.randn(1, 32), torch.zeros(1, 1, dtype=torch.int64),
                   torch.ones(1, 1), config=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_combine_equals_reference(dtype):
    t, k, n, e = 7, 3, 40, 5
    y = torch.randn(2, t * k, n).to(dtype)
    w = torch.rand(t, k)
    ids = torch.randint(0, e + 1, (t, k))
    emap = torch.tensor([0, 1, -1, 2, 2])
    ref = combine_ref(y, k, w, ids, 3, emap)
    got = forward_on(moe_combine, y, k, w, ids, 3, emap, block_n=16).cpu()
    torch.testing.assert_close(got, ref, atol=4 * torch.finfo(torch.float32).eps * k * 2, rtol=1e-6)
    y[:, ids.reshape(-1) == e] = float("nan")  # dropped slots' rows are never read
    assert not forward_on(moe_combine, y, k, None, ids, 3, emap).isnan().any()
