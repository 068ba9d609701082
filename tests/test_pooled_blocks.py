"""The sums pooled over experts (``down_in_cov_pooled``, ``down_in_grad_cov_pooled``) are kept by the layer's
fixed blocks of experts (``stats.POOLED_BY_BLOCK``), so the whole layer, chunks that are unions of blocks and
ranks holding their chunks' rows add the same float64 terms in the same order. The oracle here drives the
collector directly with terms of a wide dynamic range, where float64 sums in another order differ (the tiny
models' float32 terms mostly add exactly in float64, which hides the order)."""

from __future__ import annotations

import pytest
import torch

import moecompress as mc
from moecompress.calibration.catalogue import ALWAYS
from moecompress.calibration.stats import StatsCollector, pooled_total
from moecompress.ir import fold_blocks
from moecompress.testing import save_tiny

NAME = "down_in_cov_pooled"
E, BATCHES, TOKENS = 16, 3, 24


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    path = tmp_path_factory.mktemp("m")
    save_tiny("qwen3_moe", path, num_hidden_layers=1, num_experts=E)
    return mc.open_checkpoint(path).read_layer(0)


def _batches(layer) -> list[dict]:
    """Per batch: the MoE input, the routing, and every expert's down inputs scaled by 2^s, s in [-40, 40]
    (so that the order of the float64 additions shows in their bits)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(BATCHES):
        x = torch.randn(TOKENS, layer.hidden_size, generator=g)
        logits = torch.randn(TOKENS, E, generator=g)
        w, ids = logits.softmax(-1).topk(layer.router.top_k, dim=-1)
        h = {}
        for e in range(E):
            tok, slot = torch.where(ids == e)
            scale = 2.0 ** int(torch.randint(-40, 41, (1,), generator=g))
            h[e] = (tok, slot, torch.randn(len(tok), layer.experts.width, generator=g) * scale)
        out.append({"x": x, "logits": logits, "ids": ids, "w": w, "h": h})
    return out


def _expert(col: StatsCollector, e: int, batch: dict) -> None:
    tok, slot, h = batch["h"][e]
    if len(tok):
        col.on_expert(e, tok, slot, h, torch.zeros(len(tok), 1))


def _whole(layer, batches) -> torch.Tensor:
    col = StatsCollector(layer, {NAME} | ALWAYS)
    for bt in batches:
        col.on_input(bt["x"])
        col.on_route(bt["logits"], bt["ids"], bt["w"])
        for e in range(E):
            _expert(col, e, bt)
        col.on_output(bt["x"])
    return col._sums[NAME]


def _by_chunks(layer, batches, size: int, owners: int = 1) -> torch.Tensor:
    """Chunks outer, batches inner (``calibration/chunked.py``); with ``owners`` collectors, chunk ``k`` run
    by collector ``k % owners`` and the others' rows handed to collector 0 (``expert_sharded._expert_rows``)."""
    cols = [StatsCollector(layer, {NAME} | ALWAYS, spill=r > 0) for r in range(owners)]
    states = [[] for _ in cols]
    for col, st in zip(cols, states, strict=True):
        for bt in batches:
            col.on_input(bt["x"])
            col.on_route(bt["logits"], bt["ids"], bt["w"])
            st.append(col.batch_state())
    ranges = [(a, min(a + size, E)) for a in range(0, E, size)]
    for k, (a, b) in enumerate(ranges):
        col = cols[k % owners]
        for bt, state in zip(batches, states[k % owners], strict=True):
            col.resume_batch(state, bt["x"])
            for e in range(a, b):
                _expert(col, e, bt)
    for k, (a, b) in enumerate(ranges):
        if k % owners:
            for e in range(a, b):
                cols[0].put_expert_rows(e, e + 1, cols[k % owners].expert_rows(e, e + 1))
    for bt, state in zip(batches, states[0], strict=True):
        cols[0].resume_batch(state, bt["x"])
        cols[0].on_output(bt["x"])
    return cols[0]._sums[NAME]


def test_whole_chunked_and_ranks_add_the_same_terms_in_the_same_order(layer):
    batches = _batches(layer)
    want = _whole(layer, batches)
    assert want.dtype == torch.float64 and want.shape[0] == len(fold_blocks(E)) == 8
    for size, owners in ((2, 1), (4, 1), (6, 1), (2, 2), (4, 2), (4, 3), (16, 1)):
        assert torch.equal(_by_chunks(layer, batches, size, owners), want), (size, owners)


def test_chunks_that_cut_the_blocks_add_in_another_order(layer):
    """The oracle can fail: chunks of 3 cut the blocks of 2, and the rows' bits change (not their values)."""
    batches = _batches(layer)
    want, cut = _whole(layer, batches), _by_chunks(layer, batches, 3)
    assert not torch.equal(cut, want)
    assert torch.allclose(pooled_total(cut), pooled_total(want), rtol=1e-12, atol=0)


def test_the_pooled_mean_is_every_routed_term_over_the_routed_pairs(layer):
    """The statistic itself: Σ_b Σ_e h_beᵀ h_be / Σ routed pairs, against one float64 sum."""
    batches = _batches(layer)
    col = StatsCollector(layer, {NAME} | ALWAYS)
    total, pairs = torch.zeros(layer.experts.width, layer.experts.width, dtype=torch.float64), 0
    for bt in batches:
        col.on_input(bt["x"])
        col.on_route(bt["logits"], bt["ids"], bt["w"])
        for e in range(E):
            _expert(col, e, bt)
            h = bt["h"][e][2].double()
            total += h.T @ h
            pairs += h.shape[0]
        col.on_output(bt["x"])
    got = col.result()[NAME].double()
    want = total / pairs
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
