"""K3 (``kernels/codebook_gemm.py``): codebook and rtn experts through the Triton kernels equal the
plain-PyTorch reference (dequantise, then loop) and the project's oracle ``reference.experts_forward``.

Banks are built with the passes' own encoders (per-row k-means of ``methods.codebooks.cluster`` and
``Codebook.build``, codequant's rotation ``rotate_bank``, ``RTN.from_dense``); under ``TRITON_INTERPRET=1``
on CPU (tests/conftest.py) and unchanged on CUDA. Shapes stay tiny (interpreter: ≈2 ms per K step).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernel_device import forward_on, prepare_on

from moecompress.ir import Act, ExpertBank
from moecompress.kernels import codebook_gemm as k3
from moecompress.kernels._launch import KernelConfigError
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.dense import Dense
from moecompress.layouts.rtn import RTN
from moecompress.methods.codebooks import cluster, rotate_bank
from moecompress.methods.rotation import hadamard
from moecompress.reference import experts_forward

pytestmark = pytest.mark.interpreter
E, W, H, K = 6, 40, 64, 2  # W = 40: not a multiple of 16


def tol(dtype: torch.dtype, red: int) -> float:
    """Relative tolerance: a few ulps of ``dtype`` grown with the reduction length (√ of the summed terms)."""
    return 4 * torch.finfo(dtype).eps * (red**0.5)


def close(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype, red: int = H + W) -> bool:
    """Whether ``y`` is ``r`` (same shape, float32) within a few ulps of ``dtype`` grown with the reduction
    length, relative to the output's scale (``torch.testing.assert_close``'s rule, ``|y − r| ≤ atol + rtol·|r|``)."""
    t = tol(dtype, red)
    scale = float(r.abs().max().clamp_min(1)) if r.numel() else 1.0
    r = r.float()
    return y.shape == r.shape and y.dtype == r.dtype and bool(torch.isclose(y, r, rtol=t, atol=t * scale).all())


def weights(dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(E, *s, generator=g) / 8).to(dtype) for n, s in
            (("gate", (W, H)), ("up", (W, H)), ("down", (H, W)))}  # fmt: skip


def codebook_bank(bits: int, dtype=torch.float32, *, protected=(), live: int | None = None, group: int = -1,
                  rotate: bool = False, act_bits: int | None = None) -> ExpertBank:  # fmt: skip
    """codequant's encoding of random experts: optional Hadamard rotation of gate/up (protected experts
    exempt and read the raw input), per-row k-means codebooks, protected experts exact; ``live``
    stores uniformly pruned experts narrower (codequant after a uniform prune)."""
    w = weights(dtype)
    bank = ExpertBank(Dense(w["gate"]), Dense(w["up"]), Dense(w["down"]))
    if rotate:
        bank = rotate_bank(bank, hadamard(H, 3), frozenset(protected))
    ids = [e for e in range(E) if e not in protected]
    n = W if live is None else live
    lays = {}
    for name in ("gate", "up", "down"):
        dense = getattr(bank, name).dense()
        part = dense[ids][:, :n] if name != "down" else dense[ids][:, :, :n]
        gs = part.shape[2] if group == -1 else group
        cents, codes = cluster(part.float(), bits, gs, iters=4, seed=1)
        exact = {e: dense[e] for e in protected}
        lays[name] = Codebook.build(dict(zip(ids, codes)), dict(zip(ids, cents)), exact, bits, dense)
    widths = None if live is None else torch.tensor([W if e in protected else live for e in range(E)])
    return dataclasses.replace(bank, **lays, widths=widths, act_bits=act_bits)


def rtn_bank(bits: int, group: int, symmetric: bool, dtype=torch.float32, protected=()) -> ExpertBank:
    """``group`` inputs per scale for gate/up; down's 40 inputs use groups of 8 unless ``group`` is -1."""
    w = weights(dtype)
    gs = {"gate": group, "up": group, "down": group if group == -1 else 8}
    lay = {n: RTN.from_dense(w[n], bits, gs[n], symmetric=symmetric, protected=set(protected)) for n in w}
    return ExpertBank(lay["gate"], lay["up"], lay["down"])


def routing(t: int, seed: int = 0, n: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (t, K), generator=g), torch.rand(t, K, generator=g)


def run(bank: ExpertBank, t: int, dtype, *, emap=None, ids=None, w=None, config=None, seed=0):
    """Kernel output and the oracle's on ``t`` random tokens."""
    x = (torch.randn(t, H, generator=torch.Generator().manual_seed(seed + 1)) / 2).to(dtype)
    if ids is None:
        ids, w = routing(t, seed, E if emap is None else emap.numel())
    prep = prepare_on(k3.prepare, bank, emap, config)
    assert prep is not None
    y = forward_on(prep.forward, x, ids, w)
    assert y.dtype == torch.float32 and y.shape == (t, H)
    return y.cpu(), experts_forward(bank, x, ids, w, emap), prep, x, ids, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_equals_reference_and_oracle(bits, dtype):
    """Protected expert 1 exact; expert map merging 8 logical ids onto 6; dropped slots (id == 8)."""
    bank = codebook_bank(bits, dtype, protected=(1,))
    emap = torch.tensor([0, 1, 2, 3, 4, 5, 2, -1])  # -1: not served here (vLLM)
    ids, w = routing(7, bits, 8)
    ids[0, 1] = ids[5, 0] = 8  # dropped
    y, r, prep, x, _, _ = run(bank, 7, dtype, emap=emap, ids=ids, w=w)
    assert close(y, r, dtype)
    mids = prep.members.member_of.cpu()[emap[ids.clamp(max=7)].masked_fill(ids == 8, E)]
    kern = k3.codebook_moe_ref(x.float(), *(dataclasses.replace(p, codes=p.codes.cpu(), table=p.table.cpu())
                               for p in (prep.gate, prep.up, prep.down)), prep.widths.cpu(), mids, w)  # fmt: skip
    exact = experts_forward(bank, x, ids.masked_fill(mids < prep.members.count, 8), w, emap)  # exact expert alone
    assert close(y, kern + exact, dtype)


@pytest.mark.parametrize("t", [0, 1, 3, 33])
def test_token_counts(t):
    bank = codebook_bank(4, protected=(4,))
    y, r, *_ = run(bank, t, torch.float32, seed=t)
    assert close(y, r, torch.float32)


def test_bf16_is_upcast_under_the_interpreter():
    """bf16 banks compute right (tiles upcast to fp32 where the interpreter's bf16 is wrong; native on GPU)."""
    y, r, *_ = run(codebook_bank(4, torch.bfloat16, protected=(1,)), 7, torch.bfloat16, seed=11)
    assert close(y, r, torch.bfloat16)


def test_codequant_rotation_and_activation_quantisation():
    """Rotated gate/up input ``x @ R`` with 4-bit per-token fake quantisation; the protected expert
    reads the raw input (``bank.unrotated``)."""
    bank = codebook_bank(3, protected=(2,), rotate=True, act_bits=4)
    assert bank.rotation is not None and bank.unrotated == {2}
    y, r, _, x, ids, w = run(bank, 7, torch.float32, seed=5)
    assert close(y, r, torch.float32)
    plain = dataclasses.replace(bank, rotation=None, act_bits=None, unrotated=frozenset())
    assert (y - experts_forward(plain, x, ids, w)).abs().max() > 1e-2  # the transform matters here


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pruned_codebook_stored_narrower(dtype):
    """Uniformly pruned experts (live width 24 of 40) stored narrower, one exact expert at full width,
    per-group codebooks (groups of 8 inputs)."""
    bank = codebook_bank(4, dtype, protected=(0,), live=24, group=8)
    assert bank.gate.stored == (24, H) and bank.down.stored == (H, 24)
    y, r, *_ = run(bank, 7, dtype, seed=2)
    assert close(y, r, dtype)


@pytest.mark.parametrize("group", [-1, 16])
def test_register_lookup_tables(group):
    """``lut="reg"``: each row's centroids held in registers and gathered with ``tl.gather`` (one table
    per program for whole-row codebooks, one per K block for groups of 16 inputs); pruned to 32."""
    bank = codebook_bank(4, protected=(3,), live=32, group=group)
    cfg = k3.Config(bm=16, bn=32, bk=16, bn_down=64, bk_down=16, stages=1, lut="reg")
    prep = prepare_on(k3.prepare, bank, None, cfg)
    assert {k3._lut(cfg, getattr(prep, n), 16) for n in ("gate", "up", "down")} == {1 if group == -1 else 2}
    y, r, *_ = run(bank, 7, torch.float32, config=cfg, seed=12)
    assert close(y, r, torch.float32)


def test_empty_expert_and_all_tokens_to_one():
    bank = codebook_bank(2)
    ids, w = routing(9, 3, E - 1)  # expert E-1 receives nothing
    y, r, *_ = run(bank, 9, torch.float32, ids=ids, w=w)
    assert close(y, r, torch.float32)
    one = torch.full((33, K), 3)
    y, r, *_ = run(bank, 33, torch.float32, ids=one, w=torch.rand(33, K))
    assert close(y, r, torch.float32)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 16, False), (4, 16, True), (4, -1, False), (4, -1, True),
                                                  (8, 32, False), (8, -1, True), (2, 16, False)])  # fmt: skip
def test_rtn(bits, group, symmetric):
    """Group scales inside the tile (group 16/32) or in the epilogue (one group per row); zero points
    stored or implicit ``2^(bits−1)``; one protected expert."""
    bank = rtn_bank(bits, group, symmetric, protected=(3,))
    y, r, *_ = run(bank, 7, torch.float32, seed=bits + group)
    assert close(y, r, torch.float32)


def test_rtn_with_per_expert_widths():
    """Live widths 40, 17, 0, 33, 40, 8 (a width 0 expert yields only its down bias)."""
    bank = rtn_bank(4, 16, False, protected=(4,))
    bank = dataclasses.replace(bank, widths=torch.tensor([40, 17, 0, 33, 40, 8]),
                               biases={"down": torch.randn(E, H, generator=torch.Generator().manual_seed(3))})
    y, r, *_ = run(bank, 9, torch.float32, seed=14)
    assert close(y, r, torch.float32)


def test_rtn_fp16_and_split_k():
    """fp16 with a config that takes several K steps and splits the down reduction in two (the down
    bias is added by one split only)."""
    bank = rtn_bank(4, 16, False, torch.float16)
    bank = dataclasses.replace(bank, biases={"down": (torch.randn(E, H) / 4).half()})
    cfg = k3.Config(bm=16, bn=16, bk=16, bn_down=32, bk_down=16, split_k=2, stages=1)
    y, r, *_ = run(bank, 7, torch.float16, config=cfg, seed=4)
    assert close(y, r, torch.float16)
    y1, *_ = run(bank, 7, torch.float16, seed=4)
    assert close(y, y1, torch.float16)


def test_biases_and_clamped_activation():
    """GPT-OSS: gate/up/down biases and the clamped SwiGLU."""
    bank = codebook_bank(4, protected=(5,))
    g = torch.Generator().manual_seed(9)
    biases = {"gate": torch.randn(E, W, generator=g), "up": torch.randn(E, W, generator=g),
              "down": torch.randn(E, H, generator=g) / 4}  # fmt: skip
    bank = dataclasses.replace(bank, biases=biases, act=Act.SWIGLU_CLAMPED, limit=0.5)
    y, r, *_ = run(bank, 7, torch.float32, seed=7)
    assert close(y, r, torch.float32)


def test_dequant_reference_equals_layout():
    """The plain-PyTorch decode of the repacked codes equals the layout's own expert."""
    for bank in (codebook_bank(3, protected=(0,), group=8), rtn_bank(4, 16, False, protected=(0,))):
        prep = prepare_on(k3.prepare, bank, None)
        for name in ("gate", "up", "down"):
            lay = getattr(bank, name)
            for m, e in enumerate(range(1, E)):
                torch.testing.assert_close(k3.dequant(getattr(prep, name), m).cpu(), lay.expert(e).float())


def test_every_expert_exact():
    """A bank whose experts are all protected: no K3 launch, K2 serves them all."""
    bank = codebook_bank(4, protected=tuple(range(E)))
    assert int((bank.gate.members >= 0).sum()) == 0
    y, r, *_ = run(bank, 5, torch.float32, seed=13)
    assert close(y, r, torch.float32)


def test_unserved_banks_and_bad_configs():
    bank = codebook_bank(4)
    assert prepare_on(k3.prepare, dataclasses.replace(bank, down=Dense(weights()["down"])), None) is None
    mixed = dataclasses.replace(bank, up=rtn_bank(4, 16, False).up)
    assert prepare_on(k3.prepare, mixed, None) is None  # gate and up must share a format
    x, (ids, w) = torch.randn(3, H), routing(3)
    with pytest.raises(KernelConfigError, match="below 16"):
        forward_on(prepare_on(k3.prepare, bank, None, k3.Config(bm=8)).forward, x, ids, w)
    with pytest.raises(KernelConfigError, match="power of two"):
        forward_on(prepare_on(k3.prepare, bank, None, k3.Config(bn=48)).forward, x, ids, w)
