"""router_robustness: ε = 0 is a no-op, the attack respects its budget and beats random noise, stability."""

from __future__ import annotations

import dataclasses
import json

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
    assert s["experts_compared"] == len(keep) and s["match_error"] == 0.0
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
