"""CodeQuant's fine-tuning pieces against oracles: the blocked decode equals one gather of the whole
expert bit for bit, the blocked gradient products scattered to the centroids one product and one
scatter_add to float32 rounding, and the hand-written backward gives autograd's centroid gradients
through the same forward; the shared decode of the fit and validation forwards gives each forward's
own output."""

from __future__ import annotations

import pytest
import torch

from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.methods import codebook_finetune as ft
from moecompress.methods.codebooks import cluster

E, W, H = 4, 16, 32


@pytest.mark.parametrize("groups", [1, 4])
def test_blocked_decode_and_gradient_equal_one_gather_and_one_product_scattered(groups):
    out, inn, k = 21, 4 * (ft.DECODE_VALUES // 10), 16  # 2 rows a block: blocks of 2, ..., the last of 1
    g = torch.Generator().manual_seed(0)
    cents = torch.randn(out, groups, k, generator=g)
    codes = torch.randint(0, k, (out, inn), generator=g, dtype=torch.uint8)
    idx = codes.view(out, groups, -1).long()
    want = cents.gather(2, idx).view(out, inn)
    got, rounded = torch.full((out, inn), float("nan")), torch.full((out, inn), float("nan"))
    ft.decode_into([cents, cents.half().float()], codes, [got, rounded])
    assert torch.equal(got, want) and torch.equal(rounded, want.half().float())
    a, c = torch.randn(out, 5, generator=g), torch.randn(5, inn, generator=g)
    want_c = torch.zeros_like(cents).scatter_add_(2, idx, (a @ c).view(out, groups, -1))
    got_c = torch.zeros_like(cents)
    ft.mm_to_centroids(got_c, codes, a, c)  # a block's product may round differently from the whole one
    torch.testing.assert_close(got_c, want_c, rtol=0, atol=inn * 5 * torch.finfo(torch.float32).eps * 8)


def _layer() -> MoELayer:
    g = torch.Generator().manual_seed(3)
    w = [
        torch.randn(E, W, H, generator=g),
        torch.randn(E, W, H, generator=g),
        torch.randn(E, H, W, generator=g) * 0.2,
    ]
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, torch.randn(E, H, generator=g), ExpertBank(*(Dense(t) for t in w)))


def _parts(layer: MoELayer, projs: tuple[str, ...]) -> dict:
    ids = [0, 1, 3]  # expert 2 stays dense (a protected expert)
    parts = {}
    for p in projs:
        w = getattr(layer.experts, p).dense()[torch.tensor(ids)].float()
        cents, codes = cluster(w, 2, w.shape[2], iters=20, seed=0)
        parts["experts", p] = {
            "proj": p,
            "ids": ids,
            "live": W,
            "w": w,
            "cents": cents,
            "codes": codes,
            "scale": None,
        }
    return parts


@pytest.mark.parametrize("projs", [("gate", "up", "down"), ("gate", "up")])
def test_backward_gives_autograds_centroid_gradients_and_the_shared_decode_each_forwards_output(projs):
    layer = _layer()
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(4))
    parts = _parts(layer, projs)
    fit, val = ft._Blocks(layer, parts, x[:48]), ft._Blocks(layer, parts, x[48:])
    cents = {k: p["cents"].float() for k, p in parts.items()}
    codes = {k: p["codes"] for k, p in parts.items()}
    y = torch.randn(48, H, generator=torch.Generator().manual_seed(5))

    # the oracle: the same forward with differentiable decoded weights, autograd to the centroids
    leaves = {k: c.clone().requires_grad_(True) for k, c in cents.items()}

    def decoded(c):
        return lambda b, p, i: (
            c[b, p][i].gather(2, codes[b, p][i].view(*c[b, p][i].shape[:2], -1).long()).flatten(1)
        )

    def forward(blk, ws):
        toks, ys = zip(*(blk.expert(e, ws) for e in blk.routes))
        return blk.output(list(toks), list(ys), ws, False)

    loss = ((forward(fit, decoded(leaves)) - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        want_val = forward(val, decoded({k: c.half().float() for k, c in cents.items()}))

    pool: dict = {}
    ws = ft.Decoded(cents, codes, pool, rounded={k: c.half().float() for k, c in cents.items()})
    out, out_val = ft.forward_both(fit, val, ws)
    assert torch.equal(out_val, want_val)
    out.requires_grad_(True)
    ((out - y) ** 2).mean().backward()
    grads = {k: torch.zeros_like(c) for k, c in cents.items()}
    fit.backward(out.grad, ft.Decoded(cents, codes, pool), grads)
    for k in cents:
        torch.testing.assert_close(
            grads[k], leaves[k].grad, rtol=1e-5, atol=1e-6 * float(leaves[k].grad.abs().max())
        )
        assert grads[k].abs().sum() > 0, k
    assert fit.saved == {}  # the activations are released after the backward
