"""codequant's fine-tuning by units worked at the same time (``stats.team``, issue 36): a layer's experts
split into 2 or 3 units, each unit in a thread exchanging tensors with the others as ranks do
(:class:`moecompress.engine.team.Team`), gives the whole layer's centroids and codes bit for bit, with
protected experts, a rotation and activation quantisation; the same units without a team (a layer held by
chunks in one process) fit each unit's own part and differ."""

from __future__ import annotations

import threading

import pytest
import torch

from moecompress.engine import chunks
from moecompress.engine.spec import LayerStats
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.passes.codequant import CodequantConfig, codequant, prelude

E, W, H = 6, 16, 32


def _layer(protected=frozenset()) -> MoELayer:
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(E, W, H, generator=g), torch.randn(E, W, H, generator=g), torch.randn(E, H, W, generator=g) * 0.2]
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, torch.randn(E, H, generator=g), ExpertBank(*(Dense(t) for t in w)), protected=protected)


def _inputs(n=192):
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(4))
    x[:, 3] *= 20
    return x


class _Threads:
    """``n`` units in threads: :meth:`member` is unit ``r``'s exchange (what ``Team.gather`` does over ranks)."""

    def __init__(self, n: int) -> None:
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def member(self, r: int):
        threads = self

        class Member:
            def gather(self, tensors):
                threads.slots[r] = list(tensors)
                threads.barrier.wait()
                out = [list(s) for s in threads.slots]
                threads.barrier.wait()  # every unit has read the slots before they are written again
                return out

        return Member()


def _units(layer, x, cfg, bounds, team: bool):
    """codequant on each unit ``[a, b)`` (its sub-layer, the layer's prelude), in threads when ``team``."""
    stats = LayerStats(0, {"io_sample_x": x})
    pre = prelude(layer, stats, cfg)
    threads = _Threads(len(bounds))
    out: list = [None] * len(bounds)
    errors: list = []

    def work(k, a, b):
        try:
            sub = chunks.sub_layer(layer, chunks.take(layer.experts, list(range(a, b))), a)
            st = LayerStats(0, {"io_sample_x": x}, prelude=pre.chunk(a, b), first=a,
                            team=threads.member(k) if team else None)  # fmt: skip
            out[k] = codequant(sub, st, cfg)
        except BaseException as e:  # reported by the test, after the threads end
            errors.append(e)
            threads.barrier.abort()

    if team:
        ts = [threading.Thread(target=work, args=(k, a, b)) for k, (a, b) in enumerate(bounds)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        for k, (a, b) in enumerate(bounds):
            work(k, a, b)
    assert not errors, errors
    return out


def _tensors(layer):
    """Each projection's decoded weights ``[E, out, in]`` (codes through centroids; exact experts as stored)."""
    return {p: getattr(layer.experts, p).dense() for p in ("gate", "up", "down")}


@pytest.mark.parametrize(
    ("extra", "protected", "bounds"),
    [
        ({}, frozenset(), [(0, 3), (3, 6)]),
        ({"rotation": "hadamard", "eval_act_bits": 4}, frozenset({1, 4}), [(0, 2), (2, 4), (4, 6)]),
        ({"bits": 4}, frozenset({0, 1, 2}), [(0, 3), (3, 6)]),  # unit 0 quantises no expert
    ],
)
def test_units_fine_tuned_as_a_team_are_the_whole_layer(extra, protected, bounds):
    layer, x = _layer(protected), _inputs()
    cfg = CodequantConfig(**{"bits": 3, "kmeans_iters": 10, "finetune_steps": 6, "finetune_patience": None, **extra})
    whole, info = codequant(layer, LayerStats(0, {"io_sample_x": x}), cfg)
    assert info["best_step"] > 0  # the fine-tuning moved the centroids: there is something to compare
    units = _units(layer, x, cfg, bounds, team=True)
    want = _tensors(whole)
    for (a, b), (new, uinfo) in zip(bounds, units):
        got = _tensors(new)
        for k, v in got.items():
            assert torch.equal(v, want[k][a:b]), (k, a, b)
        for key in ("val_error_kmeans", "val_error_final", "best_step", "steps_run", "fit_loss_last"):
            assert uinfo[key] == info[key], key
    alone = _units(layer, x, cfg, bounds, team=False)  # each unit's own part of the output: other centroids
    assert any(not torch.equal(v, want[k][a:b]) for (a, b), (new, _) in zip(bounds, alone)
               for k, v in _tensors(new).items())  # fmt: skip
