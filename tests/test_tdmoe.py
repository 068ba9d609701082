"""TD-MoE: Tucker oracles, the factorised forward, parameter budgets, loading, chaining and errors."""

from __future__ import annotations

import json

import pytest
import tensorly as tl
import torch
from tiny import save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.engine.recipe import load_recipe
from moecompress.errors import PassError, RecipeError
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.layouts.tucker import Tucker
from moecompress.methods.tucker import decompose, tucker_ranks
from moecompress.methods.whitening import Whitener, chol
from moecompress.reference import moe_forward

CAL = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}
E, W, H = 6, 12, 10  # experts, width, hidden


def _layer(seed=0, dense_ids=()):
    g = torch.Generator().manual_seed(seed)
    bank = ExpertBank(
        Dense(torch.randn(E, W, H, generator=g)), Dense(torch.randn(E, W, H, generator=g)),
        Dense(torch.randn(E, H, W, generator=g)),
    )  # fmt: skip
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, torch.randn(E, H, generator=g), bank)


def _tucker(weight: torch.Tensor, r: tuple[int, int, int], wh: Whitener, dense_ids=()):
    members = [e for e in range(weight.shape[0]) if e not in dense_ids]
    core, (u_e, u_out, u_in) = decompose(weight[members].double(), wh, *r, "hosvd")
    cores = torch.einsum("mj,jab->mab", u_e, core)
    index = torch.full((weight.shape[0],), -1, dtype=torch.int64)
    index[members] = torch.arange(len(members))
    dense = weight[list(dense_ids)] if dense_ids else None
    lay = Tucker(wh.unwhiten_out(u_out).float(), wh.unwhiten_in(u_in).float(), cores.float(), index, dense)
    return lay, core, [u_e, u_out, u_in]


@pytest.mark.parametrize("dense_ids", [(), (1, 4)])
def test_full_rank_tucker_reproduces_the_block_and_never_rebuilds_dense_weights(dense_ids):
    layer = _layer()
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    cov_x = chol(x.T @ x / 40)
    lays = {}
    for name in ("gate", "up", "down"):
        w = getattr(layer.experts, name).dense()
        m = E - len(dense_ids)
        right = cov_x if name != "down" else None  # input whitening on gate/up, none on down
        lays[name], _, _ = _tucker(w, (m, w.shape[1], w.shape[2]), Whitener(None, right), dense_ids)
    new = layer.replace(experts=ExpertBank(lays["gate"], lays["up"], lays["down"]))
    ref, got = moe_forward(layer, x), moe_forward(new, x)
    assert float((got - ref).norm() / ref.norm()) <= 1e-5
    for e in dense_ids:  # protected experts are stored exactly
        assert torch.equal(new.experts.gate.expert(e), layer.experts.gate.expert(e))

    class NoRebuild(Tucker):  # the factorised forward must not call expert()
        def expert(self, e):
            raise AssertionError("dense weights rebuilt in the forward")

    t = lays["down"]
    guarded = NoRebuild(t.u_out, t.u_in, t.core, t.members, t.exact)
    moe_forward(new.replace(experts=ExpertBank(lays["gate"], lays["up"], guarded)), x)


def test_factors_reconstruct_the_whitened_tensor_as_tensorly_does():
    w = _layer(3).experts.up.dense()
    b = chol(torch.cov(torch.randn(H, 200, generator=torch.Generator().manual_seed(2))))
    wh = Whitener(None, b)
    lay, core, factors = _tucker(w, (E, 5, 4), wh)
    want = torch.from_numpy(tl.tucker_to_tensor((core.numpy(), [f.numpy() for f in factors])))
    got = wh.whiten(torch.stack([lay.expert(e) for e in range(E)]).double())
    assert float((got - want).norm() / want.norm()) <= 1e-5


@pytest.mark.parametrize("ratio", [0.2, 0.4, 0.6])
def test_parameter_count_within_one_percent(tmp_path, ratio):
    save_tiny("qwen3_moe", tmp_path / "m")
    out = tmp_path / "o"
    mc.apply({"model": str(tmp_path / "m"), "output": str(out), "calibration": CAL,
              "steps": [{"tdmoe": {"ratio": ratio}}]}, progress=False)  # fmt: skip
    rep = json.loads((out / "steps" / "01-tdmoe" / "report.json").read_text())
    assert abs(rep["summary"]["routed_fraction_removed"] - ratio) <= 0.01
    assert all(abs(f - ratio) <= 0.01 for f in rep["summary"]["per_layer_fraction"].values())
    for m, o, i in ((8, 32, 64), (16, 768, 2048), (128, 768, 2048)):
        *_, p = tucker_ranks(m, o, i, ratio)
        assert abs(1 - p / (m * o * i) - ratio) <= 0.01


def test_output_loads_and_equals_its_dense_rebuild(tmp_path):
    save_tiny("deepseek_v3", tmp_path / "m")  # shared experts and the score bias stay as they were
    out = tmp_path / "o"
    protect = {"protect_super_experts": {"auto": False, "manual": [{"layer": 1, "experts": [2]}]}}
    mc.apply({"model": str(tmp_path / "m"), "output": str(out), "calibration": CAL,
              "steps": [protect, {"tdmoe": {"ratio": 0.4, "whitening": "both"}}]}, progress=False)  # fmt: skip
    layer = mc.open_checkpoint(out).read_layer(1)
    assert isinstance(layer.experts.gate, Tucker) and int(layer.experts.gate.members[2]) == -1

    def densify(layer):
        b = layer.experts
        return layer.replace(
            experts=ExpertBank(*(Dense(getattr(b, p).dense()) for p in ("gate", "up", "down")))
        )

    mc.rewrite_checkpoint(out, tmp_path / "dense", fn=densify)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = mc.load(out)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chain_protect_heapr_uniform_tdmoe_runs_and_loads(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    protect = {"protect_super_experts": {"auto": False, "manual": [{"layer": 0, "experts": [1]}]}}
    steps = [protect, {"heapr": {"ratio": 0.25, "layout": "uniform", "align": 8}}, {"tdmoe": {"ratio": 0.4}}]
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": CAL, "steps": steps}
    mc.apply(rec, progress=False)
    layer = mc.open_checkpoint(tmp_path / "o").read_layer(0)
    assert int(layer.experts.gate.members[1]) == -1  # the protected expert stays dense, full width
    assert layer.experts.gate.expert(1).shape == (32, 64)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(mc.load(tmp_path / "o")(ids).logits).all()
    out_white = [*steps[:2], {"tdmoe": {"whitening": "output"}}]
    bad = {**rec, "output": str(tmp_path / "bad"), "steps": out_white, "calibration": {**CAL, "recalibrate": "off"}}
    with pytest.raises(RecipeError, match=r"'down_in_grad_cov_pooled', which step 2 \(heapr\) changes and "
                       r"which needs a backward pass"):  # refused in the dry run (issue 34), not after calibration
        mc.apply(bad, dry_run=True, progress=False)
    assert not (tmp_path / "bad").exists()
    cut = mc.apply({**rec, "output": str(tmp_path / "cut"), "steps": out_white}, dry_run=True, progress=False)
    assert cut.report["dry_run"]["segments"][-1] == ["step 3 (tdmoe)"]  # recalibrate: auto, calibrated again


def test_dry_run_errors(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": CAL}
    with pytest.raises(PassError, match=r"step 1 \(tdmoe\), layer 0: r1=9 exceeds the 8 experts"):
        mc.apply({**rec, "steps": [{"tdmoe": {"r1": 9}}]}, dry_run=True)
    mc.apply({**rec, "output": str(tmp_path / "t"), "steps": [{"tdmoe": {"ratio": 0.3}}]}, progress=False)
    with pytest.raises(PassError, match="tdmoe needs dense experts, got a 'tucker' layout"):
        mc.apply({**rec, "model": str(tmp_path / "t"), "steps": [{"tdmoe": {}}]}, dry_run=True)
    needs = load_recipe({**rec, "steps": [{"tdmoe": {"whitening": "input"}}]}).needs
    assert "out_grad_cov" not in needs and "input_cov" in needs  # no backward sweep for input whitening


def test_adaptive_budget_keeps_the_mean_and_spares_the_sensitive_layer(tmp_path):
    from moecompress.engine.spec import LayerStats
    from moecompress.passes.tdmoe import TdmoeConfig, _plan

    y = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    stats = {
        i: LayerStats(i, {"io_sample_y": y, "out_grad_cov": torch.eye(8) * s})
        for i, s in enumerate((1, 4, 16))
    }
    r = _plan(stats, TdmoeConfig(ratio=0.4, budget="adaptive"))
    assert sum(r.values()) / 3 == pytest.approx(0.4, abs=1e-6)
    assert (
        r[0] > r[1] > r[2] >= 0.2
    )  # the most sensitive layer is compressed least, within [ratio/2, 2 ratio]
    save_tiny("qwen3_moe", tmp_path / "m")
    mc.apply({"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": CAL,
              "steps": [{"tdmoe": {"ratio": 0.4, "budget": "adaptive"}}]}, progress=False)  # fmt: skip
    rep = json.loads((tmp_path / "o" / "steps" / "01-tdmoe" / "report.json").read_text())
    assert abs(rep["summary"]["routed_fraction_removed"] - 0.4) <= 0.01
    assert len(set(rep["summary"]["per_layer_fraction"].values())) > 1


def test_whitened_error_is_the_float64_decompositions_whole_and_by_chunks():
    """``whitened_rel_error`` is ``‖X − X̂‖ / ‖X‖`` of the float64 decomposition (computed directly here),
    whole layer and by chunks (``gather``/``fit``/``project``: ``‖X_e‖²`` noted by ``gather`` per expert
    of the step's input, each chunk reading its own through ``Factors.chunk``)."""
    from moecompress.engine.chunks import sub_layer, take
    from moecompress.engine.spec import LayerStats
    from moecompress.methods.whitening import projection_whiteners
    from moecompress.passes.tdmoe import stacked, tdmoe
    from moecompress.passes.tdmoe_chunks import TdmoeConfig, add, fit, gather, merge_tdmoe, project
    from moecompress.passes.tdmoe_chunks import take as take_block

    layer = _layer(5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(80, H, generator=g, dtype=torch.float64) * torch.logspace(1, -1, H, dtype=torch.float64)
    h = torch.randn(80, W, generator=g, dtype=torch.float64)
    st = LayerStats(0, {"input_cov": x.T @ x / 80, "down_in_cov_pooled": h.T @ h / 80})
    cfg = TdmoeConfig(ratio=0.4)
    _, info = stacked(layer, st, cfg)  # tensorly
    _, two = tdmoe(layer, st, cfg)  # the two phases on the whole layer
    whs = projection_whiteners(st, "input")
    acc, bnds = None, [(0, 2), (2, 3), (3, E)]
    subs = [sub_layer(layer, take(layer.experts, list(range(a, b))), a) for a, b in bnds]
    for sub in subs:  # each chunk a block of its own
        acc = add(acc, take_block(gather(sub, st, cfg, acc)))
    pre = fit(acc, layer, st, cfg)
    parts = [project(sub, pre.chunk(a, b))[1] for sub, (a, b) in zip(subs, bnds)]
    merged = merge_tdmoe(parts, bnds, cfg)
    for proj in ("gate", "up", "down"):
        w = getattr(layer.experts, proj).dense().double()
        t = whs[proj].whiten(w)
        core, factors = decompose(w, whs[proj], *info[proj]["ranks"], "hosvd")
        rec = torch.from_numpy(tl.tucker_to_tensor((core.numpy(), [f.numpy() for f in factors])))
        want = float((t - rec).norm() / t.norm())
        assert info[proj]["whitened_rel_error"] == pytest.approx(want, abs=2e-6), proj
        assert two[proj]["whitened_rel_error"] == pytest.approx(want, abs=2e-6), proj
        assert merged[proj]["whitened_rel_error"] == pytest.approx(want, abs=2e-6), proj
    assert len(pre.energy["gate"]) == E and len(pre.chunk(2, 3).energy["gate"]) == 1


def test_chunks_of_a_16_bit_layer_work_in_float32_within_its_rounding():
    """bf16 weights: the chunked Grams, eigendecompositions and cores are float32 (``work_dtype``), and every
    expert's reconstruction is the whole layer's (float64, tensorly) within ``8·eps(bf16)·‖Ŵ_e‖``; the
    whitened errors agree to 1e-5. float32 weights stay float64."""
    from moecompress.engine.chunks import sub_layer, take
    from moecompress.engine.spec import LayerStats
    from moecompress.methods.tucker import work_dtype
    from moecompress.passes.tdmoe import stacked
    from moecompress.passes.tdmoe_chunks import TdmoeConfig, add, fit, gather, merge_tdmoe, project
    from moecompress.passes.tdmoe_chunks import take as take_block

    assert work_dtype(torch.float32) == torch.float64 and work_dtype(torch.float16) == torch.float32
    base = _layer(7)
    bank = base.experts
    layer = base.replace(experts=ExpertBank(*(Dense(getattr(bank, p).dense().bfloat16()) for p in ("gate", "up", "down"))))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(80, H, generator=g, dtype=torch.float64) * torch.logspace(1, -1, H, dtype=torch.float64)
    h = torch.randn(80, W, generator=g, dtype=torch.float64)
    st = LayerStats(0, {"input_cov": x.T @ x / 80, "down_in_cov_pooled": h.T @ h / 80})
    cfg = TdmoeConfig(ratio=0.4)
    whole, info = stacked(layer, st, cfg)  # tensorly, float64
    acc, bnds = None, [(0, 2), (2, 5), (5, E)]
    subs = [sub_layer(layer, take(layer.experts, list(range(a, b))), a) for a, b in bnds]
    for sub in subs:
        acc = gather(sub, st, cfg, acc)
        assert {g.dtype for g in (*acc.block.g_out.values(), *acc.block.g_in.values())} == {torch.float32}
        acc = add(acc, take_block(acc))
    pre = fit(acc, layer, st, cfg)
    assert {t.dtype for pq in pre.inner.values() for t in pq} == {torch.float32}
    parts = [project(sub, pre.chunk(a, b)) for sub, (a, b) in zip(subs, bnds)]
    merged = merge_tdmoe([i for _, i in parts], bnds, cfg)
    eps = torch.finfo(torch.bfloat16).eps
    for proj in ("gate", "up", "down"):
        want = getattr(whole.experts, proj)
        assert want.dtype == torch.bfloat16
        for (lay, _), (a, b) in zip(parts, bnds):
            got = getattr(lay.experts, proj)
            assert got.dtype == torch.bfloat16
            for e in range(a, b):
                x_w, x_c = want.expert(e).double(), got.expert(e - a).double()
                assert (x_w - x_c).norm() <= 8 * eps * x_w.norm(), (proj, e)
        assert merged[proj]["whitened_rel_error"] == pytest.approx(info[proj]["whitened_rel_error"], abs=1e-5)
