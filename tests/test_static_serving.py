"""The static-shape forward (``moecompress.runtime.static``, what ``torch.compile`` traces and CUDA graphs
capture) equals the reference forward on every bank of ``test_lean`` — ragged widths, pruning cuts,
Tucker with expert factors and exact experts, low rank with exact experts, codebooks, RTN, rotation with
unrotated experts and activation quantisation, biases, the clamped activation — at decode sizes (the
per-slot path, ``T·k ≤ E``) and above (every expert on every token), with merged experts and dropped
slots; and, compiled with ``fullgraph=True``, equals itself eager."""

from __future__ import annotations

import pytest
import torch
from test_lean import BANKS, E, H, _gen, _routing

from moecompress.reference import experts_forward
from moecompress.runtime.static import DenseOp, LowRankOp, TuckerOp, prepare_static

TOL = 1e-5  # fp32, relative to the largest output: only the order of the sums differs


def rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("name", list(BANKS))
@pytest.mark.parametrize("t", [1, 3, 33])
def test_static_equals_reference(name, t):
    bank = BANKS[name]
    x = torch.randn(t, H, generator=_gen(t))
    ids, w = _routing(t, 2, E, seed=t + 1)
    want = experts_forward(bank, x, ids, w)
    assert rel(prepare_static(bank)(x, ids, w), want) <= TOL


@pytest.mark.parametrize(
    "name", ["dense", "ragged", "codebook4", "tucker-expert-factor", "tucker-aligned", "lowrank"]
)
@pytest.mark.parametrize("t", [2, 7])  # 2·3 <= E: per slot; 7·3 > E: every expert
def test_static_expert_map_and_dropped_slots(name, t):
    bank = BANKS[name]
    emap = torch.tensor([0, 0, 1, 2, 3, 4, 5, 5])
    x = torch.randn(t, H, generator=_gen(11))
    ids, w = _routing(t, 3, 8, seed=12)
    ids[0, 1] = 8  # a dropped slot (a routing policy's id E)
    ids[t - 1] = torch.tensor([0, 1, 8])  # two logical experts merged into one physical expert
    want = experts_forward(bank, x, ids, w, emap)
    assert rel(prepare_static(bank, emap)(x, ids, w), want) <= TOL


def test_factorised_layouts_stay_factorised():
    """Tucker and low-rank projections keep their factors (the bytes of the layout), dense fallbacks
    only where a layout has exact experts or a pruning cut must be honoured."""
    kinds = {
        n: tuple(type(getattr(prepare_static(BANKS[n]), p)) for p in ("gate", "up", "down")) for n in BANKS
    }
    assert kinds["tucker-aligned"] == (TuckerOp, TuckerOp, TuckerOp)
    assert kinds["tucker-folded"] == (TuckerOp, TuckerOp, TuckerOp)
    assert kinds["tucker-expert-factor"] == (DenseOp, DenseOp, DenseOp)  # exact experts inside
    assert kinds["lowrank"] == (LowRankOp, DenseOp, LowRankOp)  # up has an exact expert
    assert kinds["codebook4"] == (DenseOp, DenseOp, DenseOp)


@pytest.mark.parametrize("name", ["codebook-rotated", "clamped-biases", "tucker-biases", "lowrank", "ragged"])
def test_static_compiles_fullgraph(name):
    torch._dynamo.reset()  # one code object for every bank: keep each test under the recompile limit
    static = prepare_static(BANKS[name])
    fn = torch.compile(static.__call__, fullgraph=True, dynamic=False)
    for t in (1, 9):
        x = torch.randn(t, H, generator=_gen(20 + t))
        ids, w = _routing(t, 2, E, seed=21 + t)
        assert rel(fn(x, ids, w), static(x, ids, w)) <= TOL


def _on_meta(static):
    """``static`` with every tensor on the meta device: a host read (``.item()``, ``.tolist()``,
    ``int(tensor)``, a data-dependent shape) of anything it computes then raises."""
    import dataclasses

    def meta(v):
        if isinstance(v, torch.Tensor):
            return v.to("meta")
        if isinstance(v, dict):
            return {k: meta(t) for k, t in v.items()}
        if dataclasses.is_dataclass(v) and not isinstance(v, type) and type(v).__module__.endswith("static"):
            return dataclasses.replace(v, **{f.name: meta(getattr(v, f.name)) for f in dataclasses.fields(v)})
        return v

    out = meta(static)
    if static.bank.rotation is not None:
        out.bank = dataclasses.replace(static.bank, rotation=static.bank.rotation.to("meta"))
    return out


@pytest.mark.parametrize("name", list(BANKS))
def test_static_never_reads_the_device(name):
    """No host sync: the whole forward runs on meta tensors, at decode sizes and above."""
    static = _on_meta(prepare_static(BANKS[name], torch.tensor([0, 0, 1, 2, 3, 4, 5, 5])))
    for t in (1, 9):
        ids = torch.zeros(t, 2, dtype=torch.int64, device="meta")
        out = static(torch.empty(t, H, device="meta"), ids, torch.empty(t, 2, device="meta"))
        assert out.shape == (t, H) and out.device.type == "meta"
