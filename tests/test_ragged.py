"""The Ragged layout: logical view, compact storage, live-width forward, validation."""

from __future__ import annotations

import pytest
import torch

from moecompress.errors import LayoutError
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts import LAYOUTS
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.reference import moe_forward

E, W, H = 4, 6, 5  # experts, width, hidden


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(E, W, H, generator=g),
        torch.randn(E, W, H, generator=g),
        torch.randn(E, H, W, generator=g),
    ]


def _keep():
    return [torch.tensor([0, 2, 5]), torch.tensor([1]), torch.tensor([], dtype=torch.int64), torch.arange(6)]


def _banks():
    gate, up, down = _weights()
    keep = _keep()
    ragged = ExpertBank(
        Ragged.from_dense(gate, keep, "out"),
        Ragged.from_dense(up, keep, "out"),
        Ragged.from_dense(down, keep, "in"),
    )
    # the same function, dense: kept neurons first, the rest zero
    dg, du, dd = torch.zeros(E, W, H), torch.zeros(E, W, H), torch.zeros(E, H, W)
    for e, k in enumerate(keep):
        dg[e, : len(k)], du[e, : len(k)], dd[e, :, : len(k)] = gate[e, k], up[e, k], down[e][:, k]
    return ragged, ExpertBank(Dense(dg), Dense(du), Dense(dd)), keep


def test_logical_view_and_compact_storage():
    ragged, dense, _ = _banks()
    assert ragged.widths.tolist() == [3, 1, 0, 6]  # derived from the layouts
    assert ragged.gate.shape == (E, W, H) and ragged.down.shape == (E, H, W)
    assert ragged.gate.tensors()["rows"].shape == (10, H)  # no padding
    assert ragged.down.tensors()["rows"].shape == (10, H)  # down columns stored transposed, contiguous
    for name in ("gate", "up", "down"):
        assert torch.equal(getattr(ragged, name).dense(), getattr(dense, name).dense())
        lay = getattr(ragged, name)
        back = LAYOUTS[lay.meta()["kind"]].from_tensors(lay.tensors(), lay.meta())
        assert torch.equal(back.dense(), lay.dense()) and back.meta() == lay.meta()
    assert ragged.nbytes() == 3 * (10 * H * 4 + E * 4)  # 10 of 24 neurons per projection, + int32 widths
    assert dense.nbytes() == 3 * 24 * H * 4


def test_forward_equals_the_zero_padded_dense_bank():
    ragged, dense, _ = _banks()
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(3))
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(4))
    a = moe_forward(MoELayer(0, spec, router, ragged), x)
    b = moe_forward(MoELayer(0, spec, router, dense), x)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the live part only is multiplied: expert 1 applies a [1, H] matrix
    assert ragged.gate.apply(x, 1, rows=1).shape == (16, 1)
    assert ragged.down.apply(torch.ones(16, 1), 1, cols=1).shape == (16, H)
    assert ragged.gate.apply(x, 1).shape == (16, W)  # the full logical product still works


def test_validation():
    with pytest.raises(LayoutError, match="do not fit"):
        Ragged(torch.zeros(5, H), torch.tensor([3, 3]), W, "out")
    with pytest.raises(LayoutError, match="axis"):
        Ragged(torch.zeros(3, H), torch.tensor([3]), W, "sideways")
    ragged, _, _ = _banks()
    with pytest.raises(LayoutError, match="disagree"):
        ExpertBank(ragged.gate, ragged.up, ragged.down, widths=torch.tensor([6, 6, 6, 6]))
    meta = Ragged(
        torch.empty(10, H, device="meta"), torch.empty(E, dtype=torch.int64, device="meta"), W, "out"
    )
    assert meta.shape == (E, W, H)  # dry runs build layers from shard headers
