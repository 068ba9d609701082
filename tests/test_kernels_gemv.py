"""K3's decode kernel (``kernels/codebook_gemv.py``, issue 39): codebook 2/3/4-bit and rtn 2/4/8-bit
experts through the split-K GEMV equal the project's oracle ``reference.experts_forward``; the decode
layout round-trips to the stored codes; the tokens-per-expert bucket picks the GEMV or the K3 GEMM.

Under ``TRITON_INTERPRET=1`` on CPU and unchanged on CUDA (every bank and input reaches the kernels
through ``kernel_device.prepare_on`` / ``forward_on``). Banks come from ``test_kernels_codebook``'s
builders (the passes' own encoders); shapes stay tiny (E 6, intermediate 40, hidden 64; odd hidden 72).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import test_kernels_codebook as cb
from kernel_device import DEV, forward_on, prepare_on
from test_kernels_codebook import E, H, K, W, close, codebook_bank, routing, rtn_bank

from moecompress.ir import Act, ExpertBank
from moecompress.kernels import codebook_gemm as k3
from moecompress.kernels import codebook_gemv as kv
from moecompress.kernels._launch import KernelConfigError
from moecompress.layouts.bitpack import unpack_bits
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.rtn import RTN
from moecompress.methods.codebooks import cluster
from moecompress.reference import experts_forward

pytestmark = pytest.mark.interpreter

# Small tiles so the tiny shapes still take several K steps, several splits and several N blocks (BN 32:
# the smallest that compiles for sm_90 at every width, benchmarks/gpu_compile_check.py).
SMALL = kv.GemvConfig(bm=2, bn=32, bk=32, bn_down=32, bk_down=32, split_gu=2, split_down=2)


def run(bank: ExpertBank, t: int, dtype, *, cfg=SMALL, emap=None, ids=None, w=None, seed=0, h=H):
    """Decode-kernel output and the oracle's on ``t`` random tokens (the GEMV forced by ``cfg``)."""
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 1)) / 2).to(dtype)
    if ids is None:
        ids, w = routing(t, seed, E if emap is None else emap.numel())
    prep = prepare_on(k3.prepare, bank, emap, cfg)
    assert prep is not None and prep.gemv is not None
    assert prep.decode_config(ids.numel()) == (cfg or kv.decode_config(ids.numel(), prep.members.count))
    assert prep.decode_config(ids.numel()) is not None
    y = forward_on(prep.forward, x, ids, w)
    assert y.dtype == torch.float32 and y.shape == (t, h)
    return y.cpu(), experts_forward(bank, x, ids, w, emap), prep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_every_width_with_expert_map(bits, dtype):
    """Per-row codebooks; protected expert 1 exact (K2); 8 logical ids merged onto 6 with a ``-1``
    entry; dropped slots (id 8)."""
    bank = codebook_bank(bits, dtype, protected=(1,))
    emap = torch.tensor([0, 1, 2, 3, 4, 5, 2, -1])
    ids, w = routing(5, bits, 8)
    ids[0, 1] = ids[3, 0] = 8
    y, r, _ = run(bank, 5, dtype, emap=emap, ids=ids, w=w, seed=bits)
    close(y, r, dtype)


@pytest.mark.parametrize("group", [8, 16, 32])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_group_centroids(bits, group):
    """Per-group centroids: groups of 8 and 16 several to a tile (gathered from a ``[BN, groups, 2^bits]``
    table), groups of 32 one per tile; uniformly pruned experts stored narrower (live 24 or 32)."""
    bank = codebook_bank(bits, protected=(0,), live=24 if group == 8 else 32, group=group)
    y, r, prep = run(bank, 4, torch.float32, seed=group)
    close(y, r, torch.float32)
    assert prep.gemv.gate.groups == H // group


@pytest.mark.parametrize("bits,group,symmetric", [(4, 16, False), (4, 16, True), (4, -1, False), (4, 32, True),
                                                  (8, 32, False), (8, -1, True), (2, 16, False), (3, 16, True)])  # fmt: skip
def test_rtn(bits, group, symmetric):
    """Group scales and stored or implicit (``2^(bits−1)``) zero points; down in groups of 8 (several
    per tile) unless one group per row; one protected expert."""
    bank = rtn_bank(bits, group, symmetric, protected=(3,))
    y, r, _ = run(bank, 5, torch.float32, seed=bits + group)
    close(y, r, torch.float32)


def _odd_bank(kind: str, h: int, w: int, bits: int) -> ExpertBank:
    g = torch.Generator().manual_seed(h)
    dense = {n: torch.randn(E, *s, generator=g) / 8 for n, s in (("gate", (w, h)), ("up", (w, h)), ("down", (h, w)))}
    if kind == "rtn":
        return ExpertBank(*(RTN.from_dense(dense[n], bits, -1, protected={2}) for n in ("gate", "up", "down")))
    lays = []
    for n in ("gate", "up", "down"):
        ids = [e for e in range(E) if e != 2]
        cents, codes = cluster(dense[n][ids].float(), bits, dense[n].shape[2], iters=3, seed=1)
        lays.append(Codebook.build(dict(zip(ids, codes)), dict(zip(ids, cents)), {2: dense[n][2]}, bits, dense[n]))
    return ExpertBank(*lays)


@pytest.mark.parametrize("kind,bits", [("codebook", 3), ("rtn", 4), ("rtn", 8)])
def test_odd_shapes(kind, bits):
    """Hidden 72 and intermediate 23 (not multiples of a tile, of a word's codes or of 16 bytes)."""
    bank = _odd_bank(kind, 72, 23, bits)
    y, r, _ = run(bank, 3, torch.float32, seed=bits, h=72)
    close(y, r, torch.float32, red=72 + 23)


@pytest.mark.parametrize("bm", [1, 4, 8])
def test_blocks_empty_experts_and_all_tokens_to_one(bm):
    """Slots per program 1/4/8: an expert that receives nothing, and every token on one expert (several
    blocks of one expert, a partial last block)."""
    bank = codebook_bank(4, protected=(5,))
    cfg = dataclasses.replace(SMALL, bm=bm)
    ids, w = routing(5, 3, E - 2)  # experts 4 and 5 receive nothing
    y, r, _ = run(bank, 5, torch.float32, cfg=cfg, ids=ids, w=w)
    close(y, r, torch.float32)
    one = torch.full((9, K), 3)
    y, r, _ = run(bank, 9, torch.float32, cfg=cfg, ids=one, w=torch.rand(9, K))
    close(y, r, torch.float32)


def test_rotation_with_unrotated_experts():
    """codequant: gate/up read ``x @ R`` fake-quantised to 4 bits per token; the protected expert reads
    the raw input (``bank.unrotated``) through the shared glue."""
    bank = codebook_bank(3, protected=(2,), rotate=True, act_bits=4)
    assert bank.rotation is not None and bank.unrotated == {2}
    y, r, _ = run(bank, 5, torch.float32, seed=5)
    close(y, r, torch.float32)


def test_widths_biases_clamped_activation_fp16():
    """Live widths 40, 17, 0, 33, 40, 8 (width 0: only the down bias), gate/up/down biases added once
    across splits, GPT-OSS's clamped SwiGLU; fp16."""
    bank = rtn_bank(4, 16, False, torch.float16, protected=(4,))
    g = torch.Generator().manual_seed(9)
    biases = {"gate": torch.randn(E, W, generator=g).half(), "up": torch.randn(E, W, generator=g).half(),
              "down": (torch.randn(E, H, generator=g) / 4).half()}  # fmt: skip
    bank = dataclasses.replace(bank, widths=torch.tensor([40, 17, 0, 33, 40, 8]), biases=biases,
                               act=Act.SWIGLU_CLAMPED, limit=0.5)  # fmt: skip
    y, r, _ = run(bank, 6, torch.float16, seed=14)
    close(y, r, torch.float16)
    y1, _, _ = run(bank, 6, torch.float16, cfg=dataclasses.replace(SMALL, split_gu=1, split_down=1), seed=14)
    close(y, y1, torch.float16)


def test_bf16_is_upcast_under_the_interpreter():
    y, r, _ = run(codebook_bank(4, torch.bfloat16, protected=(1,)), 5, torch.bfloat16, seed=11)
    close(y, r, torch.bfloat16)


@pytest.mark.parametrize("make", [lambda: codebook_bank(3, protected=(0,), group=8),
                                  lambda: codebook_bank(2), lambda: rtn_bank(4, 16, False, protected=(0,)),
                                  lambda: rtn_bank(8, -1, True), lambda: rtn_bank(3, 16, False)])  # fmt: skip
def test_decode_layout_round_trips(make):
    """The words the kernel reads hold exactly the stored codes (2/4/8 bits: K3's rows viewed as int32,
    no copy; 3 bits: two bit planes), on the bank's device; ``pack_words``/``unpack_words`` invert."""
    bank = make()
    prep = prepare_on(k3.prepare, bank, None)
    for name in ("gate", "up", "down"):
        lay, gp = getattr(bank, name), getattr(prep.gemv, name)
        assert gp.words.device.type == DEV.type and gp.words.dtype == torch.int32
        stored = unpack_bits(lay.codes.to(DEV), lay.bits, lay.in_features)
        assert torch.equal(gp.codes(), stored)
        if lay.bits != 3:
            assert gp.words.data_ptr() == getattr(prep, name).codes.data_ptr()
            assert torch.equal(kv.pack_words(stored, lay.bits)[..., : gp.words.shape[2]], gp.words)
    q = torch.randint(0, 2, (3, 5, 77), device=DEV)
    assert torch.equal(kv.unpack_words(kv.pack_words(q, 1), 1, 77), q.to(torch.uint8))


def test_bucket_dispatch():
    """The default config: the GEMV for few tokens per expert (``m_e ≤ DECODE_MAX_ME``), the K3 GEMM
    above; a forced K3 ``Config`` never prepares the decode layout; an unfit group size (24 inputs at
    2 bits: no whole-word tile) leaves the GEMM serving every batch, still equal to the oracle."""
    bank = codebook_bank(4, protected=(1,))
    prep = prepare_on(k3.prepare, bank, None)
    m = prep.members.count
    assert prep.decode_config(1) == kv.DECODE_CONFIGS[0][1]
    assert prep.decode_config(int(kv.DECODE_MAX_ME * m)) is not None
    assert prep.decode_config(int(kv.DECODE_MAX_ME * m) + 1) is None
    assert [c.bm for _, c in kv.DECODE_CONFIGS] == sorted(c.bm for _, c in kv.DECODE_CONFIGS)
    assert prepare_on(k3.prepare, bank, None, k3.Config()).gemv is None
    unfit = dataclasses.replace(rtn_bank(2, 16, False), down=RTN.from_dense(cb.weights()["down"], 2, 20))
    prep2 = prepare_on(k3.prepare, unfit, None)
    assert prep2.gemv is None and kv.tile_k(256, kv.prepare_proj(prep2.down)) is None
    x, (ids, w) = torch.randn(3, H), routing(3)
    close(forward_on(prep2.forward, x, ids, w).cpu(), experts_forward(unfit, x, ids, w), torch.float32)
    y, r, _ = run(bank, 2, torch.float32, cfg=None)  # the default bucket table, end to end
    close(y, r, torch.float32)


def test_bad_configs_fail_on_cpu_as_they_would_on_a_gpu():
    bank = codebook_bank(2)
    x, (ids, w) = torch.randn(3, H), routing(3)
    for cfg in (dataclasses.replace(SMALL, bn=16), dataclasses.replace(SMALL, bm=16), dataclasses.replace(SMALL, bk=48)):
        with pytest.raises(KernelConfigError):
            forward_on(prepare_on(k3.prepare, bank, None, cfg).forward, x, ids, w)
