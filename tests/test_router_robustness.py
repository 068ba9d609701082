"""router_robustness: ε = 0 is a no-op, the attack respects its budget and beats random noise, stability."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.spec import LayerStats
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.methods.robustness import attack, router_kl, topk_jaccard
from moecompress.passes import BUILTIN_PASSES
from moecompress.passes.router_robustness import selection_scores
from moecompress.reference import route
from moecompress.testing import layer_statistics

E, W, H = 8, 12, 16
SPEC = BUILTIN_PASSES["router_robustness"]


def _layer(gating=Gating.SOFTMAX_TOPK):
    g = torch.Generator().manual_seed(0)
    bank = ExpertBank(*(Dense(torch.randn(E, *s, generator=g)) for s in ((W, H), (W, H), (H, W))))
    return MoELayer(
        0, RouterSpec(num_experts=E, top_k=2, gating=gating), torch.randn(E, H, generator=g), bank
    )


def _run(layer, stats_layer=None, **cfg):
    c = SPEC.config(**cfg)
    st = layer_statistics(stats_layer or layer, SPEC.needs_for(c))
    return SPEC.fn(layer, LayerStats.view(0, st, SPEC.needs_for(c)), c)[1]


def test_epsilon_zero_reports_jaccard_one_and_kl_zero():
    info = _run(_layer(), epsilons=(0.0,))
    assert info["attack"]["0.0"] == {"jaccard": 1.0, "kl": 0.0, "flipped": 0.0}
    assert info["stability"]["jaccard"] == 1.0 and info["stability"]["kl"] == 0.0


def test_attack_stays_in_budget_and_beats_random_noise_of_the_same_size():
    layer = _layer(Gating.SIGMOID)
    x = torch.randn(256, H, generator=torch.Generator().manual_seed(1))
    scores = selection_scores(layer)
    eps = 0.1
    xa = attack(scores, x, 2, eps, steps=10)
    ratio = (xa - x).norm(dim=1) / x.norm(dim=1)
    assert float(ratio.max()) <= eps * (1 + 10 * torch.finfo(torch.float32).eps)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    xr = x + eps * x.norm(dim=1, keepdim=True) * noise / noise.norm(dim=1, keepdim=True)
    ids = route(layer, x)[0]
    j_att = float(topk_jaccard(ids, route(layer, xa)[0]).mean())
    j_rnd = float(topk_jaccard(ids, route(layer, xr)[0]).mean())
    assert j_att < j_rnd < 1.0
    info = _run(layer, epsilons=(0.02, 0.3))
    assert info["attack"]["0.3"]["flipped"] >= info["attack"]["0.02"]["flipped"]
    assert info["attack"]["0.3"]["kl"] > info["attack"]["0.02"]["kl"] > 0


def test_metrics_are_the_textbook_ones():
    a, b = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 0], [2, 4]])
    assert topk_jaccard(a, b).tolist() == [1.0, 1 / 3]
    la = torch.tensor([[0.0, 1.0, 2.0]])
    p = la.double().softmax(-1)
    q = torch.zeros(1, 3).double().softmax(-1)
    assert torch.allclose(router_kl(la, torch.zeros(1, 3)), (p * (p / q).log()).sum(-1))


def test_stability_maps_removed_experts_back_to_the_base_columns():
    base = _layer()
    keep = [0, 2, 3, 5, 6, 7]
    pruned = base.replace(
        router=dataclasses.replace(base.router, num_experts=len(keep)), router_weight=base.router_weight[keep],
        experts=ExpertBank(*(Dense(getattr(base.experts, p).dense()[keep]) for p in ("gate", "up", "down"))),
    )  # fmt: skip
    info = _run(pruned, stats_layer=base, epsilons=(0.0,))
    s = info["stability"]
    # the kept columns are the same dot products, but from a matmul of another width: the rounding may
    # differ by the float32 bound of a length-H reduction (5.7e-8 relative was seen on an AMD EPYC)
    bound = torch.finfo(torch.float32).eps * base.router_weight.shape[1]
    assert s["experts_compared"] == len(keep) and s["match_error"] <= bound
    assert s["kl"] < 1e-12 and s["jaccard"] < 1.0  # same rows renormalised; the removed experts' tokens moved


def test_recipe_before_and_after_a_step(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    probe = {"router_robustness": {"epsilons": [0.0, 0.1], "steps": 5}}
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "o"),
           "calibration": {"source": "random", "samples": 8, "seq_len": 16, "batch_size": 4},
           "steps": [probe, {"expert_prune": {"ratio": 0.25}}, probe]}  # fmt: skip
    mc.apply(rec, progress=False)
    reps = [
        json.loads(p.read_text())["summary"] for p in sorted((tmp_path / "o" / "steps").glob("*/report.json"))
    ]
    assert reps[0]["stability_jaccard"] == 1.0 and reps[0]["attack"]["0.0"]["jaccard"] == 1.0
    assert reps[2]["stability_jaccard"] < 1.0


def test_logit_stability_compares_routings_on_different_inputs():
    """The drift metric (benchmarks/quality.py --drift): identical logits give J = 1, KL = 0; a pruned
    router's columns map back to the base ids; drifted inputs lower J."""
    from moecompress.methods.robustness import logit_stability

    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 8, generator=g, dtype=torch.float64)
    assert logit_stability(base, base, 2) == {"jaccard": 1.0, "kl": 0.0}
    kept = torch.tensor([0, 2, 3, 5, 6, 7])
    same = logit_stability(base, base[:, kept], 2, kept)
    assert same["kl"] < 1e-12 and 0 < same["jaccard"] < 1  # tokens that chose 1 or 4 now differ
    drifted = logit_stability(base, base + 0.5 * torch.randn(64, 8, generator=g, dtype=torch.float64), 2)
    assert drifted["jaccard"] < 1 and drifted["kl"] > 0


_CAL = {"source": "random", "samples": 5, "seq_len": 16, "batch_size": 2, "sample_tokens": 40}
"""Two batches of 32 tokens before the held-back one: the 40-token sample spans both."""


def _drift_run(tmp_path, name, step):
    """A ``[step, router_robustness]`` recipe under ``propagate: compressed`` on a tiny 2-layer model:
    (result, the probe's report)."""
    if not (tmp_path / "m").exists():
        save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    cal = {**_CAL, "propagate": "compressed"}
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / name), "calibration": cal,
           "steps": [step, {"router_robustness": {"epsilons": [0.0]}}]}  # fmt: skip
    res = mc.apply(rec, progress=False)
    return res, json.loads((tmp_path / name / "steps" / "02-router_robustness" / "report.json").read_text())


def test_drift_on_propagated_inputs_is_exact_for_identity_and_uses_the_base_routing(tmp_path):
    """Under ``propagate: compressed`` an identity step drifts by nothing, exactly; ``router_sample_base``
    is the input checkpoint's own ``router_sample``, bit for bit (a second stream of the sample's batches
    through the unmodified layers), and the drift grows downstream."""
    from moecompress.calibration.cache import load_layer

    ident, rep = _drift_run(tmp_path, "ident", {"identity": {}})
    assert all(r["info"]["drift"] == {"jaccard": 1.0, "kl": 0.0} for r in rep["layers"])
    res, rep = _drift_run(tmp_path, "reap", {"expert_prune": {"ratio": 0.5, "method": "reap"}})
    drift = {r["layer"]: r["info"]["drift"] for r in rep["layers"]}
    assert drift[1]["jaccard"] < 1 and drift[1]["kl"] > 0  # removed experts and drifted inputs
    assert drift[0]["kl"] < 1e-12  # layer 0: the same inputs, the kept rows exact
    for i in range(2):  # identity propagates the input checkpoint's own states (= propagate: original)
        base = load_layer(ident.cache_entry, i)["router_sample"]
        new = load_layer(res.cache_entry, i)
        assert torch.equal(new["router_sample_base"], base)
        assert i == 0 or not torch.equal(new["router_sample_base"], new["router_sample"])


@pytest.mark.slow  # three calibrations
def test_drift_on_propagated_inputs_equals_the_benchmark(tmp_path):
    """The stage's drift is ``benchmarks/quality.py --drift`` (each checkpoint calibrated on its own
    inputs, router_sample compared), per layer."""
    import importlib.util
    from pathlib import Path

    _, rep = _drift_run(tmp_path, "reap", {"expert_prune": {"ratio": 0.5, "method": "reap"}})
    drift = {str(r["layer"]): r["info"]["drift"] for r in rep["layers"]}
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quality.py"
    spec = importlib.util.spec_from_file_location("quality_bench", path)
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)  # type: ignore[union-attr]
    step = json.loads((tmp_path / "reap" / "steps" / "01-expert_prune" / "report.json").read_text())
    bench = quality.routing_drift(tmp_path / "m", tmp_path / "reap", _CAL, step)["per_layer"]
    assert bench.keys() == drift.keys()
    for i in drift:
        assert drift[i]["jaccard"] == pytest.approx(bench[i]["jaccard"], abs=1e-12)
        assert drift[i]["kl"] == pytest.approx(bench[i]["kl"], rel=1e-4, abs=1e-9)
