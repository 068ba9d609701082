"""gptq pass and maths: RTN oracles, on-grid round trips, output error below RTN's, act-order
permutation, fallback and protection, the statistics it needs, end to end with load and export."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from tiny import reference_logits, save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.engine.spec import LayerStats
from moecompress.errors import MethodError, PassError, RecipeError
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.layouts.rtn import RTN
from moecompress.methods.gptq import gptq_quantize, output_error
from moecompress.methods.scalar_quant import dequantize, quantize
from moecompress.passes import BUILTIN_PASSES
from moecompress.passes.gptq import GptqConfig, gptq
from moecompress.passes.rtn import RtnConfig, rtn
from moecompress.testing import layer_statistics

CAL = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def _spd(n: int, seed: int = 0, rank: int | None = None) -> torch.Tensor:
    """A correlated second moment ``X Xᵀ / m`` of ``n`` channels (low-rank structure plus noise)."""
    g = torch.Generator().manual_seed(seed)
    r = rank or max(n // 4, 2)
    x = torch.randn(n, r, generator=g) @ torch.randn(r, 8 * n, generator=g) + 0.2 * torch.randn(
        n, 8 * n, generator=g
    )
    x = x * torch.rand(n, 1, generator=g).add(0.2)  # channels of different scales
    s = x @ x.T / x.shape[1]
    return (s + s.T) / 2  # symmetric to the bit (a float32 product need not be: MKL on AMD EPYC)


def _on_grid(bits: int, gs: int, symmetric: bool, out: int = 6, inn: int = 32, seed: int = 0) -> torch.Tensor:
    """Weights ``(q − z)·s`` on the rtn grid, every group reaching the ends of its range (so the scale and
    zero point the quantiser computes are the ones used), power-of-two scales (exact in float16)."""
    g = torch.Generator().manual_seed(seed)
    groups, qmax = inn // gs, (1 << bits) - 1
    if symmetric:
        z = torch.full((out, groups), 1 << (bits - 1))
        lo, hi = 1, qmax
    else:
        z = torch.randint(0, qmax + 1, (out, groups), generator=g)
        lo, hi = 0, qmax
    q = torch.randint(lo, hi + 1, (out, groups, gs), generator=g)
    q[..., 0], q[..., 1] = lo, hi
    s = 2.0 ** -torch.randint(3, 12, (out, groups), generator=g).float()
    return ((q - z[..., None]).float() * s[..., None]).reshape(out, inn)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_weights_on_the_grid_come_back_exactly_for_any_hessian(bits, symmetric, act_order):
    for gs in (8, -1):
        w = _on_grid(bits, 32 if gs == -1 else gs, symmetric)
        codes, scales, zeros = gptq_quantize(w, _spd(32, seed=bits), bits, gs, symmetric, act_order)
        assert torch.equal(dequantize(codes, scales, zeros, bits), w), (bits, gs)
        assert (zeros is None) == symmetric


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("gs", [8, 16, -1])
def test_diagonal_or_zero_hessian_is_exactly_rtn(gs, symmetric, act_order):
    """No coupling between columns (H diagonal, in particular H = I; or H = 0: no calibration input) means
    no error to spread: codes, scales and zero points are RTN's bit for bit, in the original column order
    (with act_order the columns are visited in another order and must be put back)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(12, 48, generator=g)
    want = quantize(w, 3, gs, symmetric)
    for h in (torch.eye(48), torch.diag(torch.rand(48, generator=g) + 0.01), torch.zeros(48, 48)):
        got = gptq_quantize(w, h, 3, gs, symmetric, act_order, block=16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert (got[2] is None and want[2] is None) or torch.equal(got[2], want[2])


@pytest.mark.parametrize("bits", [3, 4])
def test_layer_output_error_is_well_below_rtn_on_correlated_inputs(bits):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g) * 0.05
    h = _spd(256, seed=3)
    q, s, z = quantize(w, bits, 64, False)
    rtn_err = output_error(w, dequantize(q, s, z, bits), h)
    for act_order in (False, True):
        for block in (128, 32):
            q, s, z = gptq_quantize(w, h, bits, 64, False, act_order, block=block)
            err = output_error(w, dequantize(q, s, z, bits), h)
            assert err < 0.6 * rtn_err, (bits, act_order, block, err, rtn_err)
    # ... and GPTQ's weights are further from W than RTN's (it trades weight error for output error)
    assert (dequantize(q, s, z, bits) - w).norm() > (
        dequantize(*quantize(w, bits, 64, False), bits) - w
    ).norm()


def test_output_error_is_measured_on_inputs():
    """``output_error`` is ‖(W − Ŵ)X‖² / ‖WX‖² for H = X Xᵀ."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(8, 16, generator=g), torch.randn(16, 100, generator=g)
    w_hat = w + 0.1 * torch.randn(8, 16, generator=g)
    want = float(((w - w_hat) @ x).norm() ** 2 / (w @ x).norm() ** 2)
    assert output_error(w, w_hat, x @ x.T) == pytest.approx(want, rel=1e-5)  # want in float32


def test_act_order_follows_the_channels_when_they_are_permuted():
    """With act_order the visiting order depends only on diag H, so permuting the input channels of W and H
    together permutes the codes and nothing else (one group per row: the group does not move); and the
    order matters: without act_order the codes differ."""
    g = torch.Generator().manual_seed(5)
    w, h = torch.randn(16, 40, generator=g), _spd(40, seed=6)
    perm = torch.randperm(40, generator=g)
    a = gptq_quantize(w, h, 3, -1, False, True)
    b = gptq_quantize(w[:, perm], h[perm][:, perm], 3, -1, False, True)
    assert torch.equal(b[0], a[0][:, perm]) and torch.equal(b[1], a[1]) and torch.equal(b[2], a[2])
    plain = gptq_quantize(w, h, 3, -1, False, False)
    assert not torch.equal(plain[0], a[0])


def test_bad_inputs_are_one_line_errors():
    w, h = torch.randn(4, 8), torch.eye(8)
    with pytest.raises(MethodError, match="W \\[out, in\\] and H \\[in, in\\]"):
        gptq_quantize(w, torch.eye(7), 4)
    with pytest.raises(MethodError, match="bits=5 is not supported"):
        gptq_quantize(w, h, 5)
    with pytest.raises(MethodError, match="inf/NaN"):
        gptq_quantize(w, h * float("nan"), 4)
    for bad in (float("inf"), float("-inf"), float("nan")):  # one entry is enough
        one = h.clone()
        one[2, 5] = bad
        with pytest.raises(MethodError, match="inf/NaN"):
            gptq_quantize(w, one, 4)
    singular = torch.ones(8, 8)  # rank one: not positive definite without damping
    with pytest.raises(MethodError, match=r"not positive definite after damp=0\.0; raise damp"):
        gptq_quantize(w, singular, 4, damp=0.0)
    gptq_quantize(w, singular, 4, damp=0.01)  # damping makes it definite


E, W, H = 4, 16, 32


def _layer(seed=0, protected=frozenset()) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    bank = ExpertBank(Dense(torch.randn(E, W, H, generator=g)), Dense(torch.randn(E, W, H, generator=g)),
                      Dense(torch.randn(E, H, W, generator=g)))  # fmt: skip
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, torch.randn(E, H, generator=g), bank, protected=protected)


def _stats(layer: MoELayer, dead: int | None = None) -> LayerStats:
    s = layer_statistics(layer, {"expert_in_cov", "down_in_cov"}, tokens=256)
    if dead is not None:  # an expert no calibration token reached
        s["expert_in_cov"][dead] = 0
        s["down_in_cov"][dead] = 0
    return LayerStats(0, s, frozenset({"expert_in_cov", "down_in_cov"}))


def test_pass_protects_falls_back_to_rtn_and_beats_rtn_on_the_routed_inputs():
    layer = _layer(protected=frozenset({1}))
    stats = _stats(layer, dead=3)
    cfg = GptqConfig(bits=3, group_size=16)
    new, info = gptq(layer, stats, cfg)
    ref, _ = rtn(layer, LayerStats(0), RtnConfig(bits=3, group_size=16))
    for p in ("gate", "up", "down"):
        lay = getattr(new.experts, p)
        assert isinstance(lay, RTN) and lay.group_size == 16 and lay.bits == 3
        assert torch.equal(lay.expert(1), getattr(layer.experts, p).expert(1))  # protected: exact
        assert torch.equal(lay.expert(3), getattr(ref.experts, p).expert(3))  # no tokens: rtn
        assert not torch.equal(lay.expert(0), getattr(ref.experts, p).expert(0))
    assert info["rtn_fallback"] == [3] and info["protected"] == [1] and info["quantised_experts"] == 3
    for p in ("gate", "up", "down"):
        assert info["output_error"][p] < info["output_error_rtn"][p], (p, info)
    assert info["bytes_after"] == sum(getattr(ref.experts, p).nbytes() for p in ("gate", "up", "down"))
    # the statistics: gate/up read E[x xᵀ] over the expert's routed tokens, whose diagonal is Wanda's E[x²]
    s = layer_statistics(
        layer, {"expert_in_cov", "expert_in_sq_mean", "expert_counts", "input_cov"}, tokens=256
    )
    torch.testing.assert_close(torch.diagonal(s["expert_in_cov"], dim1=1, dim2=2), s["expert_in_sq_mean"])
    summary = BUILTIN_PASSES["gptq"].summarize({0: info}, cfg)
    assert (
        summary["summary"]["rtn_fallback"] == {"0": [3]}
        and "no calibration tokens" in summary["warnings"][-1]
    )


def test_pass_refuses_bad_statistics_and_layouts():
    layer = _layer()
    bad = LayerStats(0, {"expert_in_cov": torch.zeros(E, H - 1, H - 1), "down_in_cov": torch.zeros(E, W, W)},
                     frozenset({"expert_in_cov", "down_in_cov"}))  # fmt: skip
    with pytest.raises(
        PassError, match=r"statistic expert_in_cov has shape \[4, 31, 31\], expected \[4, 32, 32\]"
    ):
        gptq(layer, bad, GptqConfig(bits=4, group_size=16))
    quantised, _ = rtn(layer, LayerStats(0), RtnConfig(bits=4, group_size=16))
    with pytest.raises(PassError, match=r"gptq quantises dense .* got layout 'rtn'"):
        gptq(quantised, _stats(layer), GptqConfig(bits=4))
    with pytest.raises(PassError, match="raise damp"):
        sing = LayerStats(0, {"expert_in_cov": torch.ones(E, H, H), "down_in_cov": torch.ones(E, W, W)},
                          frozenset({"expert_in_cov", "down_in_cov"}))  # fmt: skip
        gptq(layer, sing, GptqConfig(bits=4, damp=0.0))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("gptq") / "m"
    save_tiny("qwen3_moe", path, num_hidden_layers=2)
    return path


def test_recipe_runs_loads_and_exports(tiny_qwen, tmp_path):
    out = tmp_path / "out"
    mc.apply({"model": str(tiny_qwen), "output": str(out), "calibration": CAL,
              "steps": [{"gptq": {"bits": 4, "group_size": 16, "symmetric": True, "act_order": True}}]},
             progress=False)  # fmt: skip
    rep = json.loads((out / "steps" / "01-gptq" / "report.json").read_text())
    s = rep["summary"]
    assert s["bits"] == 4 and s["act_order"] and s["group_sizes_used"] == [16]
    for i, err in s["output_error"].items():
        assert err < s["output_error_rtn"][i], (i, err, s["output_error_rtn"])
    cfg = json.loads((out / "config.json").read_text())
    desc = cfg["moecompress"]["layers"]["0"]["experts"]["gate"]
    assert desc["kind"] == "rtn" and desc["bits"] == 4 and desc["group_size"] == 16 and desc["symmetric"]
    model = mc.load(out)
    with torch.no_grad():
        got = model(IDS).logits
        again = AutoModelForCausalLM.from_pretrained(out)(IDS).logits
    torch.testing.assert_close(got, reference_logits(tiny_qwen, out, IDS), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, got)
    pytest.importorskip("compressed_tensors")
    from moecompress.io.compressed_tensors import export

    ct = export(out, tmp_path / "ct", progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(ct)
    ckpt = mc.open_checkpoint(out)
    for i in ckpt.moe_layer_indices:  # the loaded experts are the gptq layout's decoded weights
        bank = ckpt.read_layer(i).experts
        experts = loaded.model.layers[i].mlp.experts
        assert torch.equal(experts.gate_up_proj, torch.cat([bank.gate.dense(), bank.up.dense()], 1)), i
        assert torch.equal(experts.down_proj, bank.down.dense()), i


def test_recipe_errors_and_needs(tiny_qwen, tmp_path):
    rec = {"model": str(tiny_qwen), "output": str(tmp_path / "o"), "calibration": CAL}
    with pytest.raises(RecipeError, match=r"step 1 \(gptq\): field 'bits': bits must be 8, 4, 3 or 2"):
        mc.apply({**rec, "steps": [{"gptq": {"bits": 5}}]}, dry_run=True)
    with pytest.raises(RecipeError, match=r"step 1 \(gptq\): field 'damp'"):
        mc.apply({**rec, "steps": [{"gptq": {"damp": -1}}]}, dry_run=True)
    with pytest.raises(PassError, match=r"step 1 \(gptq\), layer 0: group_size=48 does not divide"):
        mc.apply({**rec, "steps": [{"gptq": {"group_size": 48}}]}, dry_run=True)
    assert not (tmp_path / "o").exists()
    assert BUILTIN_PASSES["gptq"].needs_for(GptqConfig()) == {"expert_in_cov", "down_in_cov"}


@pytest.mark.parametrize("act_order", [False, True])
def test_a_shared_hessian_factor_gives_the_same_codes(act_order):
    """gate and up read one Hessian: its factor, computed once (``hessian_factor``), gives the bits of
    computing it inside ``gptq_quantize``; ``output_errors`` (float32 products) agrees with float64."""
    from moecompress.methods.gptq import hessian_factor, output_errors

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(200, 64, generator=g), torch.randn(40, 64, generator=g)
    h = x.T @ x / 200
    want = gptq_quantize(w, h, 4, 16, False, act_order, 0.01, 128, static_groups=act_order)
    got = gptq_quantize(w, h, 4, 16, False, act_order, 0.01, 128, static_groups=act_order,
                        factor=hessian_factor(h, 0.01, act_order))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(want, got) if a is not None)
    w_hat = w + 0.01 * torch.randn(w.shape, generator=g)
    d, hd = (w - w_hat).double(), h.double()
    exact = float(((d @ hd) * d).sum() / ((w.double() @ hd) * w.double()).sum())
    assert output_errors(w, [w_hat, w], h) == [pytest.approx(exact, rel=64 * torch.finfo(torch.float32).eps), 0.0]


@pytest.mark.parametrize("act_order", [False, True])
def test_output_errors_through_the_factorisations_triangular_root(act_order):
    """``tr(D H Dᵀ)`` read through the Cholesky factor the factorisation leaves (:class:`Root`: the damped,
    reversed, permuted Hessian, less the diagonal it added) equals the direct trace to float32 rounding,
    with a dead input channel; and the factor's codes are those without the root."""
    from moecompress.methods.gptq import hessian_factor, output_errors

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(300, 96, generator=g), torch.randn(40, 96, generator=g)
    x[:, 5] = 0  # a channel no token reached: H_55 = 0, given 1 by the factorisation
    h = x.T @ x / 300
    fac = hessian_factor(h, 0.05, act_order, root=True)
    assert all(torch.equal(a, b) for a, b in zip(fac[:2], hessian_factor(h, 0.05, act_order)) if a is not None)
    root = fac[2]
    assert root.c.dtype == torch.float32 and torch.equal(root.c, root.c.tril())
    hats = [w + 0.01 * torch.randn(w.shape, generator=g), w.round()]
    direct = output_errors(w, hats, h, rows=None)
    got = output_errors(w, hats, h, rows=None, root=root)
    bound = 96 * 64 * torch.finfo(torch.float32).eps  # products of 96 terms, a damped trace less its shift
    assert got == [pytest.approx(v, rel=bound) for v in direct]
    assert got != output_errors(w, hats, h + torch.eye(96), rows=None)  # it reads the Hessian factorised


def test_output_errors_read_evenly_spaced_rows_of_a_tall_projection():
    """Past ``rows`` output rows the errors are those of every ``⌈out/rows⌉``-th row (the same formula on
    those rows); up to ``rows`` rows, or ``rows=None``, every row is read."""
    from moecompress.methods.gptq import error_rows, output_errors

    g = torch.Generator().manual_seed(6)
    w, h = torch.randn(50, 24, generator=g), _spd(24, seed=7)
    hats = [w + 0.05 * torch.randn(w.shape, generator=g) for _ in range(2)]
    idx = error_rows(50, 16)
    assert idx.tolist() == list(range(0, 50, 4)) and error_rows(16, 16) is None and error_rows(50, None) is None
    assert output_errors(w, hats, h, rows=16) == output_errors(w[idx], [x[idx] for x in hats], h, rows=None)
    assert output_errors(w, hats, h, rows=50) == output_errors(w, hats, h, rows=None)
    assert output_errors(w, hats, h, rows=16) != output_errors(w, hats, h, rows=None)



@pytest.mark.parametrize("n", [1, 5, 8, 37])
def test_the_factor_is_the_cholesky_factor_of_the_inverse_hessian(n):
    """``U`` (one Cholesky of the reversed ``H`` and a triangular inverse by halves) is upper triangular
    with a positive diagonal and ``Uᵀ U (H + λI) = I``; it equals ``chol((H + λI)⁻¹)ᵀ`` formed the
    direct way, to float64 rounding scaled by the condition number (the float32 factor is its rounding);
    ``lower_inverse_`` at any leaf size inverts a lower-triangular matrix in place, row- or column-major."""
    from moecompress.methods.gptq import inverse_hessian_factor, lower_inverse_

    h = _spd(n, seed=n).double()
    hd = h + 0.01 * float(h.diagonal().mean()) * torch.eye(n, dtype=torch.float64)
    u = inverse_hessian_factor(h, 0.01, torch.float64)
    assert torch.equal(inverse_hessian_factor(h.float(), 0.01), u.float())
    tol = 16 * n * float(torch.linalg.cond(hd)) * torch.finfo(torch.float64).eps
    assert torch.equal(u, u.triu()) and bool((u.diagonal() > 0).all())
    assert float((u.T @ u @ hd - torch.eye(n, dtype=torch.float64)).abs().max()) < tol
    direct = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)), upper=True)
    assert float((u - direct).abs().max() / direct.abs().max()) < tol
    c = torch.linalg.cholesky(hd)
    for leaf, major in itertools.product((1, 2, 3, 512), ("row", "column")):
        buf = torch.empty(n, n, dtype=torch.float64)  # a fresh buffer (the Cholesky output is column-major)
        buf = (buf if major == "row" else buf.mT).copy_(c)
        inv = lower_inverse_(buf, leaf)
        assert inv.data_ptr() == buf.data_ptr() and torch.equal(inv, inv.tril())
        assert float((inv @ c - torch.eye(n, dtype=torch.float64)).abs().max()) < tol
