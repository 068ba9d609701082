"""The experts' weight Gram (``similarity: weight``) and the pairs' sweep that makes it on chunks: the Gram is
the flattened weights' inner products, its points keep every distance, and the sweep visits every pair of
chunks once, the diagonal in chunk order, reading ``1 + n(n − 1)/2`` chunks while holding two."""

from __future__ import annotations

import pytest
import torch

from moecompress.engine.pair_sweep import pair_order, sweep_pairs
from moecompress.methods import weight_gram
from moecompress.methods.merging import pairwise_distance
from moecompress.methods.weight_gram import gram_block, gram_points


def _weights(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 12, 10, generator=g).bfloat16(), torch.randn(n, 10, 12, generator=g).bfloat16()]


def test_gram_block_is_the_flattened_weights_inner_products(monkeypatch):
    monkeypatch.setattr(weight_gram, "GRAM_COLS", 7)  # several blocks, a ragged last one
    a, b = _weights(0), _weights(1, n=4)
    flat = lambda ws: torch.cat([w.double().flatten(1) for w in ws], 1)  # noqa: E731
    want = flat(a) @ flat(b).T
    tol = dict(rtol=0, atol=1e-4 * float(want.abs().max()))  # float32 products of 7 bf16 pairs, float64 sums
    torch.testing.assert_close(gram_block(a, b), want, **tol)
    same = gram_block(a)
    torch.testing.assert_close(same, flat(a) @ flat(a).T, **tol)
    assert torch.equal(same, same.T)
    with pytest.raises(ValueError, match="columns"):
        gram_block(a, [b[0][:, :5], b[1]])


def test_gram_points_keep_cosine_and_euclidean_distances():
    a = _weights(2)
    flat = torch.cat([w.float().flatten(1) for w in a], 1)
    pts = gram_points(gram_block(a))
    assert pts.shape == (6, 6)
    for metric in ("cosine", "euclidean"):
        want = pairwise_distance(flat, metric)
        got = pairwise_distance(pts, metric)
        assert abs(got - want).max() < 1e-5 * max(1.0, abs(want).max()), metric


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_pairs_sweep_visits_each_pair_once_reading_few_chunks(n):
    """``pair_sweep.sweep_pairs``: every pair once, the diagonal in chunk order, ``1 + n(n - 1)/2`` reads, and
    never a third chunk alive (each chunk is an object whose finaliser counts it)."""
    import weakref

    order = pair_order(n)
    assert sorted(order) == [(i, j) for i in range(n) for j in range(i, n)]
    assert [i for i, j in order if i == j] == list(range(n))  # the diagonal in chunk order

    class Chunk:
        def __init__(self, k: int) -> None:
            self.k = k

    alive: set[int] = set()
    seen: list[tuple[int, int]] = []

    def read(k: int) -> Chunk:
        assert len(alive) <= 1, f"chunk {k} read while {sorted(alive)} are held"
        c = Chunk(k)
        alive.add(k)
        weakref.finalize(c, alive.discard, k)
        return c

    def visit(i: int, j: int, a: Chunk, b: Chunk) -> None:
        assert (a.k, b.k) == (i, j) and len(alive) <= 2
        seen.append((i, j))

    reads = sweep_pairs(n, read, visit)
    assert seen == order and reads == 1 + n * (n - 1) // 2 and not alive
