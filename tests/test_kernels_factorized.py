"""K4 (``kernels/factorized.py``): tucker and lowrank experts through the Triton shrink/expand kernels
equal the plain-PyTorch reference (``factorized_moe_ref``: shared factors once per token, rank-space
k-sum) and the project's oracle ``reference.experts_forward``.

Banks come from the passes' own encoders: tdmoe's ``methods.tucker.decompose`` (HOSVD, identity
whitening; per-expert cores or a truncated expert mode) and svd_experts' ``methods.svd.factorize``
(ranks differing by one), plus hand-made lowrank factors of very different ranks. Runs under
``TRITON_INTERPRET=1`` on CPU (tests/conftest.py) and unchanged on CUDA; shapes stay tiny.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernel_device import forward_on, prepare_on

from moecompress.ir import Act, ExpertBank
from moecompress.kernels import factorized as k4
from moecompress.layouts.dense import Dense
from moecompress.layouts.lowrank import LowRank
from moecompress.layouts.tucker import Tucker
from moecompress.methods.svd import factorize
from moecompress.methods.whitening import Whitener
from moecompress.reference import experts_forward

pytestmark = pytest.mark.interpreter
E, W, H, K = 6, 40, 64, 2


def close(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype, red: int = H + W) -> bool:
    """Whether ``y`` is ``r`` (same shape, float32) within a few ulps of ``dtype`` grown with the reduction
    length, relative to the output's scale (``torch.testing.assert_close``'s rule, ``|y − r| ≤ atol + rtol·|r|``)."""
    t = 4 * torch.finfo(dtype).eps * red**0.5
    scale = float(r.abs().max().clamp_min(1)) if r.numel() else 1.0
    r = r.float()
    return y.shape == r.shape and y.dtype == r.dtype and bool(torch.isclose(y, r, rtol=t, atol=t * scale).all())


def weights(dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(E, *s, generator=g) / 4).to(dtype) for n, s in
            (("gate", (W, H)), ("up", (W, H)), ("down", (H, W)))}  # fmt: skip


def tucker(w: torch.Tensor, protected=(), ranks=(12, 20), r1: int | None = None) -> Tucker:
    """tdmoe's factorisation of one projection (HOSVD, no whitening), protected experts exact."""
    from moecompress.methods.tucker import decompose

    pytest.importorskip("tensorly")
    ids = [e for e in range(E) if e not in protected]
    m = len(ids)
    core, (u_e, u_out, u_in) = decompose(w[ids], Whitener(), r1 or m, *ranks, "hosvd")
    members = torch.full((E,), -1, dtype=torch.int64)
    members[ids] = torch.arange(m)
    dt = w.dtype
    cores = torch.einsum("mj,jab->mab", u_e, core) if r1 is None else core
    exact = w[list(protected)] if protected else None
    return Tucker(u_out.to(dt), u_in.to(dt), cores.to(dt), members, exact, None if r1 is None else u_e.to(dt))


def lowrank(w: torch.Tensor, protected=(), base: int = 7, extra: int = 3, ranks=None) -> LowRank:
    """svd_experts' factorisation (ranks ``base`` / ``base + 1``), or truncated SVDs at ``ranks``."""
    ids = [e for e in range(E) if e not in protected]
    if ranks is None:
        pairs, _ = factorize(w[ids], Whitener(), base, extra)
    else:
        pairs = []
        for e, r in zip(ids, ranks):
            u, s, vh = torch.linalg.svd(w[e].double(), full_matrices=False)
            pairs.append(((u[:, :r] * s[:r]).to(w.dtype), vh[:r].to(w.dtype)))
    return LowRank.from_factors(dict(zip(ids, pairs)), {e: w[e] for e in protected}, w)


def bank_of(kind: str, dtype=torch.float32, protected=(), down: str | None = None, **kw) -> ExpertBank:
    w = weights(dtype)
    make = {"tucker": tucker, "lowrank": lowrank}
    return ExpertBank(make[kind](w["gate"], protected, **kw), make[kind](w["up"], protected, **kw),
                      make[down or kind](w["down"], protected))  # fmt: skip


def routing(t: int, seed: int = 0, n: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (t, K), generator=g), torch.rand(t, K, generator=g)


def run(bank: ExpertBank, t: int, dtype, *, emap=None, ids=None, w=None, config=None, seed=0):
    x = (torch.randn(t, H, generator=torch.Generator().manual_seed(seed + 1)) / 2).to(dtype)
    if ids is None:
        ids, w = routing(t, seed, E if emap is None else emap.numel())
    prep = prepare_on(k4.prepare, bank, emap, config)
    assert prep is not None
    y = forward_on(prep.forward, x, ids, w)
    assert y.dtype == torch.float32 and y.shape == (t, H)
    return y.cpu(), experts_forward(bank, x, ids, w, emap), prep, x, ids, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["tucker", "lowrank"])
def test_equals_reference_and_oracle(kind, dtype):
    """Protected expert 2 exact; an expert map merging 8 logical ids onto 6 (one mapped to -1); dropped slots (id 8)."""
    bank = bank_of(kind, dtype, protected=(2,))
    emap = torch.tensor([0, 1, 2, 3, 4, 5, 1, -1])  # -1: not served here (vLLM)
    ids, w = routing(7, 1, 8)
    ids[1, 0] = ids[6, 1] = 8
    y, r, prep, x, _, _ = run(bank, 7, dtype, emap=emap, ids=ids, w=w)
    assert close(y, r, dtype)
    mids = prep.members.member_of.cpu()[emap[ids.clamp(max=7)].masked_fill(ids == 8, E)]
    ref = k4.factorized_moe_ref(x.float(), bank.gate, bank.up, bank.down, mids, w)
    exact = experts_forward(bank, x, ids.masked_fill(mids < prep.members.count, 8), w, emap)
    assert close(y, ref + exact, dtype)


@pytest.mark.parametrize("t", [0, 1, 3, 33])
@pytest.mark.parametrize("kind", ["tucker", "lowrank"])
def test_token_counts(kind, t):
    bank = bank_of(kind)
    y, r, *_ = run(bank, t, torch.float32, seed=t)
    assert close(y, r, torch.float32)


def test_bf16_is_upcast_under_the_interpreter():
    """bf16 banks compute right (tiles upcast to fp32 where the interpreter's bf16 is wrong; native on GPU)."""
    y, r, *_ = run(bank_of("tucker", torch.bfloat16, protected=(2,)), 7, torch.bfloat16, seed=11)
    assert close(y, r, torch.bfloat16)


def test_tucker_truncated_expert_mode():
    """``r1 < M``: a shared core and an expert factor, folded into per-expert cores at prepare."""
    bank = bank_of("tucker", protected=(0,), r1=3)
    assert bank.gate.u_expert is not None
    y, r, *_ = run(bank, 7, torch.float32, seed=3)
    assert close(y, r, torch.float32)


def test_lowrank_ranks_of_every_size_and_split_k():
    """Per-expert ranks 1..37 (the shrink's rank blocks and K steps run to runtime bounds), a
    config with several K steps split in two."""
    w = weights(torch.float16)
    ranks = [1, 37, 16, 5, 23, 9]
    bank = ExpertBank(*(lowrank(w[n], ranks=ranks) for n in ("gate", "up", "down")))
    cfg = k4.Config(bm=16, br=16, bk=16, bn=32, split_k=2, stages=1)
    y, r, *_ = run(bank, 7, torch.float16, config=cfg, seed=2)
    assert close(y, r, torch.float16)


def test_tucker_split_k_fp16():
    bank = bank_of("tucker", torch.float16, protected=(4,))
    cfg = k4.Config(bm=16, br=16, bk=16, bn=16, split_k=3, stages=1)
    y, r, *_ = run(bank, 7, torch.float16, config=cfg, seed=6)
    assert close(y, r, torch.float16)


@pytest.mark.parametrize("kinds", [("tucker", "lowrank"), ("lowrank", "tucker")])
def test_mixed_gate_up_and_down_layouts(kinds):
    bank = bank_of(kinds[0], down=kinds[1], protected=(1,))
    y, r, *_ = run(bank, 7, torch.float32, seed=4)
    assert close(y, r, torch.float32)


@pytest.mark.parametrize("kind", ["tucker", "lowrank"])
def test_biases_and_clamped_activation(kind):
    """GPT-OSS: biases (tucker's down bias summed with the routed weights outside rank space) and the
    clamped SwiGLU."""
    g = torch.Generator().manual_seed(8)
    biases = {"gate": torch.randn(E, W, generator=g), "up": torch.randn(E, W, generator=g),
              "down": torch.randn(E, H, generator=g)}  # fmt: skip
    bank = dataclasses.replace(bank_of(kind, protected=(3,)), biases=biases, act=Act.SWIGLU_CLAMPED, limit=1.0)
    y, r, *_ = run(bank, 7, torch.float32, seed=8)
    assert close(y, r, torch.float32)


def test_empty_expert_and_all_tokens_to_one():
    bank = bank_of("tucker", protected=(0,))
    ids, w = routing(9, 3, E - 1)
    y, r, *_ = run(bank, 9, torch.float32, ids=ids, w=w)
    assert close(y, r, torch.float32)
    y, r, *_ = run(bank, 33, torch.float32, ids=torch.full((33, K), 4), w=torch.rand(33, K))
    assert close(y, r, torch.float32)


def test_rotated_input_with_unrotated_exact_expert():
    """A bank input transform (rotation + 4-bit per-token quantisation) is applied once per token; the
    exact expert in ``unrotated`` reads the raw input."""
    from moecompress.methods.rotation import hadamard

    bank = dataclasses.replace(bank_of("lowrank", protected=(5,)), rotation=hadamard(H, 1).float(), act_bits=4,
                               unrotated=frozenset({5}))  # fmt: skip
    y, r, _, x, ids, w = run(bank, 7, torch.float32, seed=9)
    assert close(y, r, torch.float32)
    plain = dataclasses.replace(bank, rotation=None, act_bits=None, unrotated=frozenset())
    assert (y - experts_forward(plain, x, ids, w)).abs().max() > 1e-2


def test_unserved_banks():
    bank = bank_of("tucker")
    assert prepare_on(k4.prepare, dataclasses.replace(bank, down=Dense(weights()["down"])), None) is None
    assert prepare_on(k4.prepare, dataclasses.replace(bank, up=bank_of("lowrank").up), None) is None
    cut = dataclasses.replace(bank_of("lowrank"), widths=torch.tensor([W, W, 8, W, W, W]))
    assert prepare_on(k4.prepare, cut, None) is None  # neuron cuts cannot follow a factorisation
