"""The lean serving path (moecompress.runtime.lean) equals the reference forward for every layout."""

from __future__ import annotations

import pytest
import torch

from moecompress.ir import Act, ExpertBank
from moecompress.layouts.codebook import Codebook
from moecompress.layouts.dense import Dense
from moecompress.layouts.lowrank import LowRank
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.rtn import RTN
from moecompress.layouts.tucker import Tucker
from moecompress.reference import experts_forward
from moecompress.runtime.lean import prepare

E, H, WIDTH = 6, 24, 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _w(*shape, seed=0):
    return torch.randn(*shape, generator=_gen(seed)) / shape[-1] ** 0.5


def _dense():
    return [Dense(_w(E, WIDTH, H, seed=1)), Dense(_w(E, WIDTH, H, seed=2)), Dense(_w(E, H, WIDTH, seed=3))]


def _codebook(weight, bits, groups=1, exact=(), keep_out=None, keep_in=None):
    """Each row's values snapped to ``2^bits`` centroids per group (quantiles), experts ``exact`` kept."""
    n, out, inn = weight.shape
    out_s, in_s = keep_out or out, keep_in or inn
    codes, cents, ex = {}, {}, {}
    for e in range(n):
        if e in exact:
            ex[e] = weight[e]
            continue
        w = weight[e, :out_s, :in_s].reshape(out_s, groups, in_s // groups)
        q = torch.linspace(0, 1, 1 << bits)
        c = torch.quantile(w, q, dim=-1).permute(1, 2, 0).half()  # [out, G, K]
        codes[e] = (w[..., None] - c.float()[:, :, None, :]).abs().argmin(-1).reshape(out_s, in_s)
        cents[e] = c
    return Codebook.build(codes, cents, ex, bits, weight)


def _lowrank(weight, rank, exact=()):
    f, d = {}, {}
    for e in range(weight.shape[0]):
        if e in exact:
            d[e] = weight[e]
            continue
        u, s, vh = torch.linalg.svd(weight[e], full_matrices=False)
        f[e] = ((u[:, : rank + e % 2] * s[: rank + e % 2]).contiguous(), vh[: rank + e % 2].contiguous())
    return LowRank.from_factors(f, d, weight)


def _tucker(weight, r1, r2, r3, exact=()):
    n, out, inn = weight.shape
    fact = [e for e in range(n) if e not in exact]
    g = _gen(7)
    u_out, u_in = torch.randn(out, r2, generator=g) / r2**0.5, torch.randn(inn, r3, generator=g) / r3**0.5
    members = torch.full((n,), -1, dtype=torch.int64)
    members[fact] = torch.arange(len(fact))
    ex = weight[list(exact)] if exact else None
    if r1 is None:
        return Tucker(u_out, u_in, torch.randn(len(fact), r2, r3, generator=g), members, ex)
    return Tucker(u_out, u_in, torch.randn(r1, r2, r3, generator=g), members, ex, torch.randn(len(fact), r1, generator=g))


def _banks():
    gate, up, down = (lay.weight for lay in _dense())
    widths = torch.tensor([WIDTH, 0, 5, 16, 9, 1])
    keep = [torch.arange(int(w)) for w in widths]
    yield "dense", ExpertBank(*_dense())
    yield "ragged", ExpertBank(
        Ragged.from_dense(gate, keep, "out"), Ragged.from_dense(up, keep, "out"), Ragged.from_dense(down, keep, "in")
    )
    yield "dense-widths", ExpertBank(*_dense(), widths=widths)
    yield "dense-uniform-widths", ExpertBank(*_dense(), widths=torch.full((E,), 8))
    same = [torch.arange(12)] * E
    yield "ragged-uniform", ExpertBank(
        Ragged.from_dense(gate, same, "out"), Ragged.from_dense(up, same, "out"), Ragged.from_dense(down, same, "in")
    )
    yield "tucker-aligned", ExpertBank(_tucker(gate, None, 8, 4), _tucker(up, 2, 4, 8), _tucker(down, None, 8, 4))
    yield "lowrank", ExpertBank(_lowrank(gate, 3), _lowrank(up, 4, exact=(2,)), _lowrank(down, 2))
    yield "tucker-folded", ExpertBank(_tucker(gate, None, 8, 6), _tucker(up, None, 8, 6), _tucker(down, None, 6, 5))
    yield "tucker-expert-factor", ExpertBank(
        _tucker(gate, 3, 8, 6, exact=(1,)), _tucker(up, 3, 8, 6, exact=(1,)), _tucker(down, 2, 6, 5, exact=(1,))
    )
    for bits in (2, 3, 4, 8):
        yield f"codebook{bits}", ExpertBank(
            _codebook(gate, bits, exact=(4,)), _codebook(up, bits, groups=2, exact=(4,)),
            _codebook(down, bits, exact=(4,)),
        )  # fmt: skip
    yield "codebook-narrow", ExpertBank(
        _codebook(gate, 4, keep_out=12), _codebook(up, 4, keep_out=12), _codebook(down, 4, keep_in=12),
        widths=torch.full((E,), 12),
    )  # fmt: skip
    for bits, gs, sym in ((4, 8, False), (3, -1, False), (8, 12, True), (2, 4, True)):
        yield f"rtn{bits}-g{gs}-{'sym' if sym else 'asym'}", ExpertBank(
            RTN.from_dense(gate, bits, gs, symmetric=sym, protected={0}),
            RTN.from_dense(up, bits, gs, symmetric=sym, protected={0}),
            RTN.from_dense(down, bits, 8 if gs == 12 else gs, symmetric=sym, protected={0}),
        )  # fmt: skip
    rot = torch.linalg.qr(torch.randn(H, H, generator=_gen(5)))[0]
    yield "codebook-rotated", ExpertBank(
        _codebook(gate @ rot, 4, exact=(3,)), _codebook(up @ rot, 4, exact=(3,)), _codebook(down, 4, exact=(3,)),
        rotation=rot, act_bits=6, unrotated=frozenset({3}),
    )  # fmt: skip
    biases = {"gate": _w(E, WIDTH, seed=8), "up": _w(E, WIDTH, seed=9), "down": _w(E, H, seed=10)}
    yield "clamped-biases", ExpertBank(*_dense(), biases=biases, act=Act.SWIGLU_CLAMPED, alpha=1.702, limit=0.3)
    yield "tucker-biases", ExpertBank(
        _tucker(gate, None, 8, 6), _tucker(up, None, 8, 6), _tucker(down, None, 6, 5), biases=biases
    )
    yield "tucker-aligned-biases", ExpertBank(
        _tucker(gate, None, 8, 4), _tucker(up, None, 8, 4), _tucker(down, None, 8, 4), biases=biases,
        act=Act.SWIGLU_CLAMPED, limit=0.5,
    )  # fmt: skip
    yield "dense-biases", ExpertBank(*_dense(), biases=biases)


BANKS = dict(_banks())


def _routing(t, k, n_logical, seed):
    g = _gen(seed)
    ids = torch.stack([torch.randperm(n_logical, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("name", list(BANKS))
@pytest.mark.parametrize("t", [1, 3, 33])
@pytest.mark.parametrize("native", [None, False], ids=["native-if-built", "decoded"])
def test_lean_equals_reference(name, t, native):
    bank = BANKS[name]
    x = torch.randn(t, H, generator=_gen(t))
    ids, w = _routing(t, 2, E, seed=t + 1)
    want = experts_forward(bank, x, ids, w)
    got = prepare(bank, native=native)(x, ids, w)
    scale = want.abs().max().clamp_min(1e-6)
    assert float((got - want).abs().max() / scale) <= 1e-5


LOOPED = {"ragged", "dense-widths", "lowrank", "tucker-expert-factor", "codebook-rotated"}
"""Banks with per-expert shapes (ragged widths, ranks), exact experts inside shared factors, or experts
reading the unrotated input: served by the per-expert loop."""


@pytest.mark.parametrize("name", list(BANKS))
def test_grouped_path_taken_where_it_can_be(name):
    """One shape for every expert of a projection takes the grouped path (one grouped GEMM per projection
    where the strides allow, else a loop over the hit experts for the middle product only); the rest the
    per-expert loop (so both paths are compared with the reference above)."""
    assert (prepare(BANKS[name]).grouped is None) == (name in LOOPED)


@pytest.mark.parametrize("name", ["dense", "ragged", "codebook4", "rtn4-g8-asym", "tucker-expert-factor", "tucker-aligned"])
def test_lean_expert_map_dropped_and_skewed(name):
    """Merged experts (an expert map with duplicates), dropped slots (id == E_logical), every token
    routed to one expert, and an expert that receives nothing."""
    bank = BANKS[name]
    emap = torch.tensor([0, 0, 1, 2, 3, 4, 5, 5])
    x = torch.randn(7, H, generator=_gen(11))
    ids, w = _routing(7, 3, 8, seed=12)
    ids[0, 1], ids[2, 0], ids[5, 2] = 8, 8, 8  # dropped slots (a routing policy's id E)
    want = experts_forward(bank, x, ids, w, emap)
    got = prepare(bank, emap)(x, ids, w)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    one = torch.full((7, 1), 4)
    want = experts_forward(bank, x, one, w[:, :1], emap)
    assert float((prepare(bank, emap)(x, one, w[:, :1]) - want).abs().max() / want.abs().max()) <= 1e-5


def test_lean_all_dropped_is_zero():
    bank = BANKS["codebook4"]
    x = torch.randn(3, H)
    out = prepare(bank)(x, torch.full((3, 2), E), torch.ones(3, 2))
    assert torch.equal(out, torch.zeros(3, H))


@pytest.mark.parametrize("name", ["codebook4", "codebook-narrow", "rtn3-g-1-asym", "codebook-rotated"])
def test_dense_dtype_float32_equals_reference(name):
    """``dequantize="float32"`` decodes once at preparation: the same weights, so the same output."""
    bank = BANKS[name]
    x = torch.randn(5, H, generator=_gen(3))
    ids, w = _routing(5, 2, E, seed=4)
    want = experts_forward(bank, x, ids, w)
    lean = prepare(bank, dense_dtype=torch.float32)
    assert all(lay.kind == "dense" for lay in (lean.bank.gate, lean.bank.up, lean.bank.down))
    assert float((lean(x, ids, w) - want).abs().max() / want.abs().max()) <= 1e-5


def test_dense_dtype_float16_holds_codebook_centroids_exactly():
    """Codebook centroids are float16: decoding the quantised experts into float16 loses nothing."""
    bank = BANKS["codebook4"]
    lean = prepare(bank, dense_dtype=torch.float16)
    for e in (e for e in range(E) if int(bank.gate.members[e]) >= 0):
        assert torch.equal(lean.bank.gate.expert(e).float(), bank.gate.expert(e).float())


@pytest.mark.parametrize("name", ["dense", "ragged", "codebook4", "tucker-aligned"])
def test_two_slots_on_one_merged_expert_run_it_once(name):
    """Logical experts 0 and 1 are merged into physical expert 0: a token routed to both gets one run of
    expert 0 with the sum of the two weights, equal to the reference's two runs."""
    bank = BANKS[name]
    emap = torch.tensor([0, 0, 1, 2, 3, 4, 5, 5])
    x = torch.randn(2, H, generator=_gen(21))
    ids, w = torch.tensor([[0, 1], [1, 6]]), torch.tensor([[0.3, 0.5], [0.25, 0.6]])
    want = experts_forward(bank, x, ids, w, emap)
    assert float((prepare(bank, emap)(x, ids, w) - want).abs().max() / want.abs().max()) <= 1e-5
    from moecompress.runtime.lean import _coalesce

    tok, phys, summed = _coalesce(emap[ids.reshape(-1)], w.reshape(-1), 2, 6)
    assert tok.tolist() == [0, 1, 1] and phys.tolist() == [0, 0, 5]
    assert torch.allclose(summed, torch.tensor([0.8, 0.25, 0.6]))


@pytest.mark.parametrize("name", ["codebook4", "codebook-narrow", "rtn4-g8-asym", "rtn3-g-1-asym"])
@pytest.mark.parametrize("proj", ["gate", "down"])
def test_quantised_rows_decoded_native_and_chunked_agree(name, proj):
    """The three ways of running quantised experts give the same rows: decoded all at once, decoded one
    expert per chunk (the prefill case of a real layer), and the packed-code kernel (no decoding)."""
    from moecompress.runtime import cpu_lut
    from moecompress.runtime.grouped import grouped
    from moecompress.runtime.unpacked import Unpacked

    bank = BANKS[name]
    lay, cut = getattr(bank, proj), (None if bank.widths is None else int(bank.widths[0]))
    axis = "out" if proj == "gate" else "in"
    counts = [3, 0, 2, 1, 4, 2]
    x = torch.randn(sum(counts), lay.shape[2] if axis == "out" else cut or lay.shape[2], generator=_gen(30))
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    decoded = Unpacked(lay, native=False)
    whole = grouped(decoded, cut, axis).rows(x, counts, offs)
    one = grouped(decoded, cut, axis, chunk=1).rows(x, counts, offs)
    ref = torch.cat([x[a:b] @ lay.expert(e)[: cut if axis == "out" else None, : cut if axis == "in" else None].T
                     for e, (a, b) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist())) if b > a])  # fmt: skip
    for got in [whole, one] + ([grouped(Unpacked(lay, native=True), cut, axis).rows(x, counts, offs)]
                               if cpu_lut.available() else []):  # fmt: skip
        assert got.shape == ref.shape and float((got - ref).abs().max() / ref.abs().max()) <= 1e-5
