"""choose_groups: EM with a penalised likelihood recovers the number of clusters; target_experts: auto."""

from __future__ import annotations

import itertools

import pytest
import torch
from pydantic import ValidationError

from moecompress.engine.spec import LayerStats
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts.dense import Dense
from moecompress.methods.mixture import choose_k, fit_gmm, reduce_features
from moecompress.passes import BUILTIN_PASSES
from moecompress.passes.expert_merging import target_groups
from moecompress.testing import layer_statistics


def _clusters(k, per=4, d=24, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(100 * k + seed)
    centres = 3 * torch.randn(k, d, generator=g, dtype=torch.float64)
    return centres.repeat_interleave(per, 0) + spread * torch.randn(
        k * per, d, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_em_recovers_the_number_of_clusters(k, seed):
    x = _clusters(k, seed=seed)
    kmax = 2 * k + 2  # a search well past the truth (the full 1..n-1 scan is slow for n = 32 points)
    got, bic = choose_k(x, kmax)
    assert got == k, bic
    assert choose_k(reduce_features([x], 16), kmax)[0] == k  # also after the projection the passes use
    fit = fit_gmm(x, k)
    labels = fit["resp"].argmax(1).reshape(k, -1)  # every true cluster is one component
    assert all(len(set(row.tolist())) == 1 for row in labels) and len(set(labels[:, 0].tolist())) == k


def test_one_cluster_is_not_split():
    x = torch.randn(12, 24, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert choose_k(x)[0] == 1


E, W, H = 8, 12, 10


def _two_family_layer():
    """Experts 0-3 near-copies of A, 4-7 near-copies of B (weights and router rows)."""
    g = torch.Generator().manual_seed(0)

    def stack(*shape):
        a, b = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        return torch.stack([(a if e < 4 else b) + 0.02 * torch.randn(*shape, generator=g) for e in range(E)])

    bank = ExpertBank(Dense(stack(W, H)), Dense(stack(W, H)), Dense(stack(H, W)))
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, stack(H), bank)


@pytest.mark.parametrize("name", ["namex", "merge_experts"])
def test_target_experts_auto_merges_each_family_into_one(name):
    spec = BUILTIN_PASSES[name]
    cfg = spec.config(target_experts="auto", **({"refine_steps": 0} if name == "namex" else {}))
    layer = _two_family_layer()
    st = LayerStats.view(0, layer_statistics(layer, spec.needs_for(cfg)), spec.needs_for(cfg))
    new, info = spec.fn(layer, st, cfg)
    assert info["choose_groups"]["groups"] == 2, info["choose_groups"]
    assert sorted(info["groups"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert new.experts.num_experts == 2 and new.expert_map.tolist() == [0] * 4 + [1] * 4


def test_auto_with_collapse_is_refused():
    with pytest.raises(ValidationError, match="router: remap"):
        BUILTIN_PASSES["namex"].config(target_experts="auto", router="collapse")


def test_choose_groups_reports_the_count_auto_uses():
    spec = BUILTIN_PASSES["choose_groups"]
    layer = _two_family_layer()
    st = LayerStats.view(0, layer_statistics(layer, spec.needs), spec.needs)
    same, info = spec.fn(layer, st, spec.config())
    assert same is layer and info["groups"] == 2 and info["experts"] == E


def test_ward_linkage_recovers_clusters_keeps_singletons_and_merges_unused_experts_first():
    from moecompress.methods.merging import ward_linkage

    f = _clusters(3, per=2, d=6, seed=3)
    assert ward_linkage(f, 3, torch.ones(6)) == [[0, 1], [2, 3], [4, 5]]
    assert [1] in ward_linkage(f, 3, torch.ones(6), singletons=[1])
    # an unused expert costs nothing to merge: with one merge allowed, it is the one absorbed
    w = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    groups = ward_linkage(f, 5, w)
    assert any(4 in g and len(g) == 2 for g in groups)


def _weighted_ss(f, w, groups):
    f, w = f.double(), w.double()
    tot = 0.0
    for g in groups:
        mu = (w[g, None] * f[g]).sum(0) / w[g].sum()
        tot += float((w[g] * (f[g] - mu).pow(2).sum(1)).sum())
    return tot


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ward_lowers_the_first_order_merge_loss_where_average_linkage_chains(seed):
    """Near-copies of one expert (upcycled-like): Ward's groups leave less usage-weighted spread of the
    experts' outputs — the loss of replacing each group by its usage-weighted average — than HC-SMoE's."""
    from moecompress.methods.merging import average_linkage, ward_linkage

    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 12, generator=g)
    f = torch.stack([(base + 0.3 * torch.randn(64, 12, generator=g)).flatten() for _ in range(8)])
    w = torch.rand(8, generator=g) + 0.1
    ward = ward_linkage(f, 4, w)
    avg = average_linkage(f, 4, metric="cosine")
    assert _weighted_ss(f, w, ward) < _weighted_ss(f, w, avg)


def test_auto_keeps_a_layer_without_cluster_structure():
    g = torch.Generator().manual_seed(7)
    bank = ExpertBank(*(Dense(torch.randn(E, *s, generator=g)) for s in ((W, H), (W, H), (H, W))))
    layer = MoELayer(0, RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True),
                     torch.randn(E, H, generator=g), bank)  # fmt: skip
    spec = BUILTIN_PASSES["merge_experts"]
    cfg = spec.config(target_experts="auto")
    st = LayerStats.view(0, layer_statistics(layer, spec.needs_for(cfg)), spec.needs_for(cfg))
    new, info = spec.fn(layer, st, cfg)
    assert info["choose_groups"]["free_groups"] == 1 and info["choose_groups"]["groups"] == E
    assert new is layer


@pytest.mark.parametrize("seed", [0, 1])
def test_ward_costs_sum_to_the_loss_of_ward_groups(seed):
    from moecompress.methods.merging import ward_costs, ward_linkage

    g = torch.Generator().manual_seed(seed)
    f, w = (
        torch.randn(7, 20, generator=g, dtype=torch.float64),
        torch.rand(7, generator=g, dtype=torch.float64) + 0.1,
    )
    costs = ward_costs(f, w, singletons=[2])
    assert len(costs) == 5 and all(b >= a - 1e-12 for a, b in itertools.pairwise(costs))  # non-decreasing
    for m in range(6):
        groups = ward_linkage(f, 7 - m, w, singletons=[2])
        assert _weighted_ss(f, w, groups) == pytest.approx(sum(costs[:m]), rel=1e-9, abs=1e-12)


def test_allocate_merges_is_the_brute_force_optimum():
    import itertools

    from moecompress.errors import MethodError
    from moecompress.methods.merging import allocate_merges

    g = torch.Generator().manual_seed(3)
    convex = {i: torch.rand(5, generator=g).cumsum(0).tolist() for i in range(3)}  # non-decreasing
    bumpy = {i: (torch.rand(5, generator=g) - 0.3).tolist() for i in range(3)}  # measured curves need not be
    for curves, merges in itertools.product((convex, bumpy), range(16)):
        got = allocate_merges(curves, merges)
        best = min(sum((curves[i][: m[i]] and sum(curves[i][: m[i]])) or 0 for i in range(3))
                   for m in itertools.product(range(6), repeat=3) if sum(m) == merges)  # fmt: skip
        assert sum(got.values()) == merges
        assert sum(sum(curves[i][: got[i]]) for i in range(3)) == pytest.approx(best)
    with pytest.raises(MethodError, match="between 0 and 15"):
        allocate_merges(curves, 16)


@pytest.mark.parametrize("curve", ["ward", "merged"])
def test_choose_groups_spends_the_budget_where_merging_is_cheap_and_namex_follows_it(curve):
    spec = BUILTIN_PASSES["choose_groups"]
    fam = _two_family_layer()
    g = torch.Generator().manual_seed(7)
    bank = ExpertBank(*(Dense(torch.randn(E, *s, generator=g)) for s in ((W, H), (W, H), (H, W))))
    rnd = MoELayer(1, fam.router, torch.randn(E, H, generator=g), bank)
    cfg = spec.config(
        ratio=6 / 16, curve=curve
    )  # 6 merges over 16 experts: exactly the two families' near-copies
    infos = {}
    for layer in (fam, rnd):
        st = LayerStats.view(layer.index, layer_statistics(layer, spec.needs), spec.needs)
        infos[layer.index] = spec.fn(layer, st, cfg)[1]
    assert max(infos[0]["merge_costs"][:6]) < 1e-2 * min(infos[1]["merge_costs"])  # near-copies: ~free
    summary = spec.summarize(infos, cfg)["summary"]
    assert summary["target_experts"] == {"0": 2, "1": 8} and summary["experts_kept"] == 10
    ncfg = BUILTIN_PASSES["namex"].config(target_experts=summary["target_experts"], refine_steps=0)
    assert ncfg.target_experts == {0: 2, 1: 8}
    nspec = BUILTIN_PASSES["namex"]
    st = LayerStats.view(0, layer_statistics(fam, nspec.needs_for(ncfg)), nspec.needs_for(ncfg))
    new, _ = nspec.fn(fam, st, ncfg)
    assert new.experts.num_experts == 2
    assert target_groups(E, ncfg, 1) == 8 and target_groups(E, ncfg, 5) == E  # unlisted layers keep all
    with pytest.raises(ValidationError, match="same count in every layer"):
        BUILTIN_PASSES["namex"].config(target_experts={0: 2, 1: 8}, router="collapse")


def _budget_run(tmp_path, steps):
    """One recipe on a tiny 2-layer model; its steps' summaries."""
    import json

    import moecompress as mc
    from moecompress.testing import save_tiny

    if not (tmp_path / "m").exists():
        save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    cal = {"source": "random", "samples": 5, "seq_len": 16, "batch_size": 5, "cache_dir": str(tmp_path / "c")}
    out = tmp_path / f"o{len(list(tmp_path.glob('o*')))}"
    mc.apply(
        {"model": str(tmp_path / "m"), "output": str(out), "calibration": cal, "steps": steps}, progress=False
    )
    return [json.loads(p.read_text())["summary"] for p in sorted((out / "steps").glob("*/report.json"))]


@pytest.mark.parametrize(
    "merge, budget",
    [
        ("namex", {"ratio": 0.5}),
        pytest.param("merge_experts", {"total_experts": 9, "scale": "relative"}, marks=pytest.mark.slow),
    ],
)
def test_one_step_budget_is_the_two_run_allocation(tmp_path, merge, budget):
    """The oracle of the one-step budget: ``namex: {target_experts: {ratio: r}}`` allocates exactly the
    counts ``choose_groups {ratio: r}`` reports (the same Ward curves, from ``expert_out_gram``)."""
    extra = {"refine_steps": 0} if merge == "namex" else {}
    reps = _budget_run(tmp_path, [{"choose_groups": {**budget, "clusters": False}},
                                  {merge: {"target_experts": budget, **extra}}])  # fmt: skip
    chosen, merged = reps[0]["target_experts"], reps[1]["groups_per_layer"]
    assert merged == chosen and len(set(chosen.values())) > 1  # a per-layer allocation, not the uniform one
    assert sum(chosen.values()) == (8 if "ratio" in budget else 9)


def test_expert_out_gram_is_the_gram_of_the_ward_features():
    """The statistics equal what the two-run path computes from the layer (bit for bit), and the plan's
    curves equal ``choose_groups``' (loss and relative scales)."""
    from moecompress.methods.mixture import expert_output_gram, fit_tokens, merge_curve
    from moecompress.passes.merge_budget import plan_budget

    fam = _two_family_layer()
    needs = {"io_sample", "expert_counts", "expert_out_gram", "expert_out_gram_fisher"}
    st = layer_statistics(fam, needs, sample_tokens=100)
    xs = st["io_sample_x"][: fit_tokens(len(st["io_sample_x"]))]
    assert len(xs) == 50 and st["expert_out_gram"].dtype == torch.float64
    assert torch.equal(st["expert_out_gram"], expert_output_gram(fam, xs))
    assert torch.equal(st["expert_out_gram_fisher"], expert_output_gram(fam, xs, st["out_grad_cov"]))
    spec = BUILTIN_PASSES["choose_groups"]
    for scale in ("loss", "relative"):
        curve = merge_curve(fam, st["io_sample_x"][:50], st["expert_counts"], scale, st["out_grad_cov"])
        cfg = BUILTIN_PASSES["namex"].config(target_experts={"ratio": 0.25, "scale": scale})
        view = LayerStats.view(0, st, BUILTIN_PASSES["namex"].needs_for(cfg))
        assert plan_budget({0: view}, cfg) == {0: 6}
        info = spec.fn(fam, LayerStats.view(0, st, spec.needs), spec.config(ratio=0.25, scale=scale))[1]
        assert info["merge_costs"] == curve


def test_budget_configs_and_errors(tmp_path):
    import moecompress as mc
    from moecompress.errors import PassError, RecipeError
    from moecompress.passes.merge_budget import plan_budget
    from moecompress.testing import save_tiny

    namex = BUILTIN_PASSES["namex"]
    with pytest.raises(ValidationError, match="exactly one of ratio or total_experts"):
        namex.config(target_experts={"ratio": 0.5, "total_experts": 3})
    with pytest.raises(ValidationError, match="use router: remap"):
        namex.config(target_experts={"ratio": 0.5}, router="collapse")
    assert namex.needs_for(namex.config(ratio=0.5)) == {"io_sample", "expert_counts"}
    assert "expert_out_gram_fisher" in namex.needs_for(namex.config(target_experts={"ratio": 0.5}))
    rel = namex.config(target_experts={"total_experts": 2, "scale": "relative"})
    assert "expert_out_gram_fisher" not in namex.needs_for(rel)
    st = layer_statistics(_two_family_layer(), namex.needs_for(rel))
    view = LayerStats.view(0, st, namex.needs_for(rel), protected=frozenset({0, 1, 2}))
    with pytest.raises(
        PassError, match=r"target_experts=\{'total_experts': 2.*keeps 2 of 8 experts; the layers allow 4 to 8"
    ):
        plan_budget({0: view}, rel)
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    rec = {"model": str(tmp_path / "m"), "output": str(tmp_path / "o"),
           "calibration": {"source": "random", "samples": 4, "seq_len": 8, "propagate": "compressed"}}  # fmt: skip
    mc.apply({**rec, "steps": [{"namex": {"ratio": 0.5}}]}, dry_run=True, progress=False)  # no plan: allowed
    budget = {"ratio": 0.5, "scale": "relative"}  # forward statistics only (loss: a backward, refused first)
    with pytest.raises(RecipeError, match=r"cross-layer plans \(\['step 1 \(namex\)'\]\)"):
        mc.apply({**rec, "steps": [{"namex": {"target_experts": budget}}]}, dry_run=True, progress=False)
