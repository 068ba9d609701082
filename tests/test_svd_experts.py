"""svd_experts and the lowrank layout: oracles (full rank, plain SVD), whitening, budget, end to end."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny import reference_logits, save_tiny

import moecompress as mc
from moecompress.engine.spec import LayerStats
from moecompress.errors import LayoutError, PassError
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts import LAYOUTS
from moecompress.layouts.dense import Dense
from moecompress.layouts.lowrank import LowRank
from moecompress.methods.svd import factorize, rank_split
from moecompress.methods.whitening import Whitener, chol
from moecompress.passes import BUILTIN_PASSES
from moecompress.passes.svd_experts import SvdExpertsConfig, svd_experts
from moecompress.reference import moe_forward

CAL = {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4}
E, W, H = 4, 8, 12  # experts, width, hidden
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """One tiny qwen3_moe checkpoint (experts [8, 32, 64]) shared by the end-to-end tests (read only)."""
    path = tmp_path_factory.mktemp("svd") / "m"
    save_tiny("qwen3_moe", path)
    return path


def _layer(seed=0) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    bank = ExpertBank(Dense(torch.randn(E, W, H, generator=g)), Dense(torch.randn(E, W, H, generator=g)),
                      Dense(torch.randn(E, H, W, generator=g)))  # fmt: skip
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, torch.randn(E, H, generator=g), bank)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_full_rank_layout_reproduces_the_layer_and_round_trips():
    layer = _layer()
    g = torch.Generator().manual_seed(1)
    lays = []
    for name in ("gate", "up", "down"):
        w = getattr(layer.experts, name).dense()
        spd = (a := torch.randn(w.shape[2], w.shape[2], generator=g)) @ a.T + torch.eye(w.shape[2])
        pairs, err = factorize(w[[0, 2, 3]], Whitener(right=chol(spd)), min(w.shape[1:]))
        assert float(err.max()) < 1e-6
        lays.append(LowRank.from_factors(dict(zip([0, 2, 3], pairs)), {1: w[1]}, w))
    low = layer.replace(experts=ExpertBank(*lays))
    x = torch.randn(32, H, generator=g)
    assert _rel(moe_forward(low, x), moe_forward(layer, x)) <= 1e-5
    gate = lays[0]
    assert torch.equal(gate.expert(1), layer.experts.gate.expert(1))  # the dense expert is exact
    assert (
        gate.members.tolist() == [0, -1, 1, 2] and gate.u.shape == (W, 3 * W) and gate.v.shape == (3 * W, H)
    )
    back = LAYOUTS[gate.meta()["kind"]].from_tensors(gate.tensors(), gate.meta())
    assert torch.equal(back.dense(), gate.dense()) and back.meta() == gate.meta()
    assert gate.cast(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(LayoutError, match="no live widths"):
        gate.apply(x, 0, rows=3)
    w = gate.dense()
    all_low = LowRank.from_factors(dict(zip(range(E), factorize(w, Whitener(), 2)[0])), {}, w)
    assert "dense" not in all_low.tensors()  # nothing empty is written
    assert torch.equal(LowRank.from_tensors(all_low.tensors(), all_low.meta()).dense(), all_low.dense())


def test_without_whitening_each_expert_is_its_svd_truncation():
    layer = _layer()
    new, info = svd_experts(layer, LayerStats(0), SvdExpertsConfig(ratio=0.5, whitening="none"))
    for name in ("gate", "up", "down"):
        w, lay = getattr(layer.experts, name).dense(), getattr(new.experts, name)
        assert isinstance(lay, LowRank)
        for e in range(E):
            r = info["ranks"][name][e]
            u, s, vh = torch.linalg.svd(w[e].double(), full_matrices=False)
            want = (u[:, :r] * s[:r]) @ vh[:r]
            assert _rel(lay.expert(e).double(), want) <= 1e-5, (name, e)
    # 0.5 · 8·12/20 = 2.4 -> total rank 9 over 4 experts: ranks 3,2,2,2 (differ by at most 1)
    assert sorted(info["ranks"]["gate"]) == [2, 2, 2, 3]
    assert info["decomposed_after"] == 3 * 9 * (W + H)


class _Collect:  # input covariance and pooled down-input covariance, as the calibration engine defines them
    def __init__(self):
        self.h = []

    def on_route(self, logits, ids, weights): ...
    def on_shared(self, h, y): ...

    def on_expert(self, e, tok, slot, h, y):
        self.h.append(h.double())


def test_input_whitening_reduces_the_output_error_on_skewed_inputs():
    layer = _layer(2)
    g = torch.Generator().manual_seed(3)
    mix = torch.randn(H, H, generator=g) * torch.logspace(1, -2, H)  # a few dominant input directions
    fit, test = torch.randn(512, H, generator=g) @ mix.T, torch.randn(256, H, generator=g) @ mix.T
    obs = _Collect()
    moe_forward(layer, fit, obs)
    h = torch.cat(obs.h)
    stats = LayerStats(0, {"input_cov": fit.double().T @ fit.double() / len(fit),
                           "down_in_cov_pooled": h.T @ h / len(h)})  # fmt: skip
    want = moe_forward(layer, test)
    errs = {}
    for side, form in (("none", "chol"), ("input", "chol"), ("input", "inverse")):
        new, _ = svd_experts(layer, stats, SvdExpertsConfig(ratio=0.5, whitening=side, input_form=form))
        errs[side, form] = _rel(moe_forward(new, test), want)
    assert errs["input", "chol"] < 0.7 * errs["none", "chol"], errs
    assert errs["input", "inverse"] < 10  # TD-MoE's paper-text form runs (it is not an output-error optimum)


def test_ranks_meet_the_budget():
    for out, inn, m in ((64, 128, 16), (128, 64, 16), (32, 64, 8), (80, 64, 8)):
        base, extra = rank_split(out, inn, m, 0.4)
        achieved = 1 - (base * m + extra) * (out + inn) / (out * inn * m)
        assert 0.4 <= achieved <= 0.4 + (out + inn) / (out * inn * m) and 0 <= extra < m
        assert rank_split(out, inn, m, 0.4, "uniform") == (base, 0)
    assert rank_split(64, 128, 16, 0.4) == (25, 9)  # 409 = ⌊25.6·16⌋ rank units: removed 0.4009
    assert rank_split(32, 64, 8, 0.4, "uniform") == (12, 0)  # removes 0.4375: why balanced is the default


def test_end_to_end_writes_lowrank_loads_through_the_quantizer_and_matches_the_reference(tiny_qwen, tmp_path):
    out = tmp_path / "out"
    mc.apply({"model": str(tiny_qwen), "output": str(out), "calibration": CAL,
              "steps": [{"svd_experts": {"ratio": 0.4}}]}, progress=False)  # fmt: skip
    rep = json.loads((out / "steps" / "01-svd_experts" / "report.json").read_text())
    assert abs(rep["summary"]["decomposed_fraction_removed"] - 0.4) < 0.01
    assert abs(rep["summary"]["routed_fraction_removed"] - 0.4) < 0.01  # + a few int64 index entries
    assert rep["summary"]["rank_histogram"]["gate"] == {"12": 6, "13": 18}  # 102 = ⌊12.8·8⌋ per layer
    assert set(rep["layers"][0]["info"]["whitened_rel_error"]) == {"gate", "up", "down"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "moecompress"
    assert cfg["moecompress"]["layers"]["0"]["experts"]["down"]["kind"] == "lowrank"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.gate.ut").shape == (102, 32)  # rank axis first
        assert f.get_tensor("model.layers.0.mlp.experts.down.v").shape == (102, 32)
    with torch.no_grad():
        got = mc.load(out)(IDS).logits
    torch.testing.assert_close(got, reference_logits(tiny_qwen, out, IDS), rtol=1e-5, atol=1e-5)
    # a low-rank checkpoint is read on meta in the dry run, and decomposing twice is refused there
    with pytest.raises(PassError, match=r"step 1 \(svd_experts\), layer 0: .*layout 'lowrank'"):
        mc.apply({"model": str(out), "output": str(tmp_path / "o2"), "calibration": CAL,
                  "steps": [{"svd_experts": {}}]}, dry_run=True)  # fmt: skip


def test_dry_run_errors_and_needs(tiny_qwen, tmp_path):
    rec = {"model": str(tiny_qwen), "output": str(tmp_path / "o"), "calibration": CAL}
    with pytest.raises(PassError, match=r"ratio=0.99 leaves rank 0 for the gate projection \[32, 64\]"):
        mc.apply({**rec, "steps": [{"svd_experts": {"ratio": 0.99}}]}, dry_run=True)
    pruned = tmp_path / "p"
    mc.apply({**rec, "output": str(pruned), "steps": [{"neuron_prune": {"ratio": 0.25, "method": "magnitude"}}]},
             progress=False)  # fmt: skip
    with pytest.raises(PassError, match="before the pruning step, or prune with layout: uniform"):
        mc.apply({**rec, "model": str(pruned), "steps": [{"svd_experts": {}}]}, dry_run=True)
    spec = BUILTIN_PASSES["svd_experts"]
    assert spec.needs_for(SvdExpertsConfig()) == {"input_cov", "down_in_cov_pooled"}
    assert spec.needs_for(SvdExpertsConfig(whitening="none")) == set()
    assert "out_grad_cov" in spec.needs_for(SvdExpertsConfig(whitening="output"))
    plan = mc.apply({**rec, "steps": [{"svd_experts": {"whitening": "output"}}]}, dry_run=True).report
    assert plan["dry_run"]["backward"] and "out_grad_cov" in plan["dry_run"]["statistics"]
    assert not (tmp_path / "o").exists()


def test_output_whitening_runs_with_the_backward_statistics(tiny_qwen, tmp_path):
    out = tmp_path / "out"
    mc.apply({"model": str(tiny_qwen), "output": str(out), "calibration": CAL,
              "steps": [{"svd_experts": {"ratio": 0.3, "whitening": "both"}}]}, progress=False)  # fmt: skip
    rep = json.loads((out / "steps" / "01-svd_experts" / "report.json").read_text())
    assert rep["summary"]["whitening"] == "both" and all(r["rel_error"] < 1 for r in rep["layers"])
    with torch.no_grad():
        assert torch.isfinite(mc.load(out)(IDS).logits).all()


def test_dry_run_counts_the_float64_svd_workspace(tiny_qwen, tmp_path):
    """One projection copied and factorize's float64 workspace (SVD_WORKSPACE_COPIES copies of one expert);
    at Qwen3-30B shapes the estimate without it was 0.79 of the peak."""
    from moecompress.engine.dry_run import meta_layer
    from moecompress.io.checkpoint import open_checkpoint
    from moecompress.methods.svd import SVD_WORKSPACE_COPIES

    rec = {"model": str(tiny_qwen), "output": str(tmp_path / "o"), "calibration": CAL, "steps": [{"svd_experts": {}}]}
    est = next(iter(mc.apply(rec, dry_run=True, progress=False).report["dry_run"]["step_memory"].values()))
    ckpt = open_checkpoint(tiny_qwen)
    bank = meta_layer(ckpt, ckpt.moe_layer_indices[0]).experts
    _, out, inn = bank.gate.shape
    assert est["workspace_bytes"] >= SVD_WORKSPACE_COPIES * out * inn * 8 + bank.gate.nbytes()
    assert est["bytes"] >= est["input_bytes"] + est["workspace_bytes"] + est["output_bytes"]


def test_a_chunk_reads_the_layers_whiteners_from_the_prelude():
    """By chunks of experts the whiteners are made once per layer (``prelude``) and every chunk uses them
    rather than its statistics: a prelude of identity whiteners gives the unwhitened factorisation."""
    from moecompress.passes.svd_experts import prelude

    layer = _layer(4)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, H, generator=g, dtype=torch.float64) * torch.logspace(1, -1, H, dtype=torch.float64)
    tensors = {"input_cov": x.T @ x / 64, "down_in_cov_pooled": torch.eye(W, dtype=torch.float64) * 2}
    cfg = SvdExpertsConfig(ratio=0.5)
    pre = prelude(layer, LayerStats(0, tensors), cfg)
    assert pre.whiteners["gate"] is pre.whiteners["up"] and pre.whiteners["gate"].right_kind == "lower"
    whole, _ = svd_experts(layer, LayerStats(0, tensors), cfg)
    chunk, _ = svd_experts(layer, LayerStats(0, tensors, prelude=pre), cfg)
    plain, _ = svd_experts(layer, LayerStats(0), SvdExpertsConfig(ratio=0.5, whitening="none"))
    none = prelude(layer, LayerStats(0), SvdExpertsConfig(ratio=0.5, whitening="none"))
    ident, _ = svd_experts(layer, LayerStats(0, tensors, prelude=none), cfg)
    for name in ("gate", "up", "down"):
        for a, b in ((whole, chunk), (plain, ident)):
            ta, tb = getattr(a.experts, name).tensors(), getattr(b.experts, name).tensors()
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    assert not torch.equal(whole.experts.gate.tensors()["v"], plain.experts.gate.tensors()["v"])
    every = layer.replace(protected=frozenset(range(E)))
    assert prelude(every, LayerStats(0, tensors), cfg) is None
    some = prelude(layer.replace(protected=frozenset({0, 2})), LayerStats(0, tensors), cfg)
    assert [some.chunk(a, a + 1).before() for a in range(E)] == [0, 0, 1, 1]  # decomposed experts before a


@pytest.mark.parametrize("shape", [(8, 12), (12, 8), (2048, 7168), (7, 7)])
def test_chunk_rank_shares_add_up_to_the_whole_layers_total_whatever_the_chunking(shape):
    from moecompress.methods.svd import rank_share, rank_split

    out, inn = shape
    for ratio in (0.1, 0.4, 0.55):
        for m in (1, 5, 64, 256):
            base, extra = rank_split(out, inn, m, ratio)
            assert rank_share(out, inn, 0, m, ratio) == (base, extra)  # one chunk: the whole layer
            for size in (1, 3, 16):
                total = 0
                for a in range(0, m, size):
                    n = min(size, m - a)
                    b, x = rank_share(out, inn, a, n, ratio)
                    assert b == base and 0 <= x <= n, (ratio, m, size, a)
                    total += b * n + x
                assert total == base * m + extra, (ratio, m, size)
