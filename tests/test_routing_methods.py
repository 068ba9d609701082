"""Routing-policy maths (``moecompress.methods.routing``) against plain-Python loops of the papers' rules."""

from __future__ import annotations

import math

import pytest
import torch

from moecompress.errors import MethodError
from moecompress.methods.routing import (
    apply_policy,
    capacity,
    capacity_drop,
    expanded_drop,
    expert_similarity,
    fill_dropped,
    loads,
    sere_reroute,
    straggler_ratio,
    topk_reduce,
)


def random_routing(t: int, e: int, k: int, seed: int, skew: float = 1.5):
    """Softmax-top-k routing of ``t`` tokens over ``e`` experts (skewed so some experts overflow), with
    ``norm_topk_prob`` weights; no ties."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) + skew * torch.linspace(1, 0, e)
    probs = logits.softmax(-1)
    top = probs.topk(k, dim=-1)
    return top.indices, top.values / top.values.sum(-1, keepdim=True), probs


# -- plain-Python references -------------------------------------------------------------------------
def ref_capacity_drop(ids, weights, probs, c, strategy, protected=()):
    t, k = ids.shape
    e = probs.shape[1]
    keep = [[int(ids[i, j]) < e for j in range(k)] for i in range(t)]
    for ex in range(e):
        slots = [(i, j) for i in range(t) for j in range(k) if int(ids[i, j]) == ex]
        if ex in protected or len(slots) <= c:
            continue
        if strategy == "score":
            slots.sort(key=lambda s: (-float(probs[s[0], ex]), s[0]))
        elif strategy == "first":
            slots.sort(key=lambda s: s[0])
        elif strategy == "last":
            slots.sort(key=lambda s: -s[0])
        for i, j in slots[c:]:
            keep[i][j] = False
    new_ids = [[int(ids[i, j]) if keep[i][j] else e for j in range(k)] for i in range(t)]
    new_w = [[float(weights[i, j]) if keep[i][j] else 0.0 for j in range(k)] for i in range(t)]
    return torch.tensor(new_ids), torch.tensor(new_w)


def ref_candidates_cut(ids, weights, probs, c, cand, protected, width):
    """Each expert keeps its ``c`` best candidates by probability; each token its ``width`` best survivors
    (own selections first); new slots weighted ``p * (w / p)`` of the token's top slot."""
    t, k = ids.shape
    e = probs.shape[1]
    own = {(i, int(ids[i, j])): float(weights[i, j]) for i in range(t) for j in range(k)}
    kept = set()
    for ex in range(e):
        toks = sorted((i for i in range(t) if ex in cand[i]), key=lambda i: (-float(probs[i, ex]), i))
        kept |= {(i, ex) for i in toks[:c]}
        if ex in protected:
            kept |= {(i, ex) for i in range(t) if (i, ex) in own}
    out = {}
    for i in range(t):
        j0 = max(range(k), key=lambda j: float(weights[i, j]))
        factor = float(weights[i, j0]) / float(probs[i, int(ids[i, j0])])
        mine = sorted((ex for (ti, ex) in kept if ti == i),
                      key=lambda ex: -(float(probs[i, ex]) + 2.0 * ((i, ex) in own)))[:width]  # fmt: skip
        for ex in mine:
            out[(i, ex)] = own.get((i, ex), float(probs[i, ex]) * factor)
    return out


def as_pairs(ids, weights, e):
    return {(i, int(ids[i, j])): float(weights[i, j]) for i in range(ids.shape[0]) for j in range(ids.shape[1])
            if int(ids[i, j]) < e}  # fmt: skip


def ref_sere(ids, weights, sim, s, rho, protected=()):
    t, k = ids.shape
    e = sim.shape[0]
    primary = set()
    for i in range(t):
        order = sorted(range(k), key=lambda j: -float(weights[i, j]))
        primary |= {int(ids[i, j]) for j in order[:s]}
    selected = {int(x) for x in ids.flatten()}
    target = {}
    for u in sorted(selected - primary - set(protected)):
        v = max(sorted(primary), key=lambda v: float(sim[u, v]))
        if float(sim[u, v]) >= rho:
            target[u] = v
    new_ids, new_w = ids.clone(), weights.clone()
    moved = 0
    for i in range(t):
        for j in range(k):
            u = int(ids[i, j])
            if u in target:
                new_ids[i, j] = target[u]
                moved += 1
        for j in range(1, k):
            for jj in range(j):
                if int(new_ids[i, jj]) == int(new_ids[i, j]) and int(new_ids[i, j]) < e:
                    new_w[i, jj] += new_w[i, j]
                    new_w[i, j] = 0
                    new_ids[i, j] = e
                    break
    executed = len({int(x) for x in new_ids.flatten() if int(x) < e})
    return new_ids, new_w, {"primary": len(primary), "rerouted": len(target), "rerouted_slots": moved,
                            "executed": executed, "critical": len(selected - primary - set(protected)) - len(target)}  # fmt: skip


# -- capacity -------------------------------------------------------------------------------------------
def test_capacity_formula():
    assert capacity(1.0, 2, 64, 8) == 16
    assert capacity(1.5, 2, 10, 8) == math.ceil(1.5 * 2 * 10 / 8)
    with pytest.raises(MethodError, match="gamma"):
        capacity(0, 2, 10, 8)


@pytest.mark.parametrize("strategy", ["score", "first", "last"])
@pytest.mark.parametrize("seed", range(6))
def test_token_drop_equals_reference(strategy, seed):
    t, e, k = 37, 8, 2
    ids, w, probs = random_routing(t, e, k, seed)
    c = capacity(1.0, k, t, e)
    got_ids, got_w = capacity_drop(ids, w, probs, c, strategy=strategy)
    ref_ids, ref_w = ref_capacity_drop(ids, w, probs, c, strategy)
    assert torch.equal(got_ids, ref_ids)
    assert torch.allclose(got_w.float(), ref_w, atol=0, rtol=0)
    assert int(loads(got_ids, e).max()) <= c
    assert int((got_ids == e).sum()) > 0, "the skewed routing must overflow some expert"


def test_token_drop_protected_experts_keep_every_slot():
    t, e, k = 40, 8, 2
    ids, w, probs = random_routing(t, e, k, 3)
    busiest = int(loads(ids, e).argmax())
    prot = torch.zeros(e, dtype=torch.bool)
    prot[busiest] = True
    c = capacity(0.5, k, t, e)
    got_ids, _ = capacity_drop(ids, w, probs, c, strategy="score", protected=prot)
    ref_ids, _ = ref_capacity_drop(ids, w, probs, c, "score", protected={busiest})
    assert torch.equal(got_ids, ref_ids)
    assert int(loads(got_ids, e)[busiest]) == int(loads(ids, e)[busiest]) > c


def test_random_strategy_is_seeded_and_respects_capacity():
    t, e, k = 50, 8, 2
    ids, w, probs = random_routing(t, e, k, 4)
    c = capacity(1.0, k, t, e)
    a = capacity_drop(ids, w, probs, c, strategy="random", seed=1)
    b = capacity_drop(ids, w, probs, c, strategy="random", seed=1)
    other = capacity_drop(ids, w, probs, c, strategy="random", seed=2)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], other[0])
    before, after = loads(ids, e), loads(a[0], e)
    assert torch.equal(after, torch.minimum(before, torch.full_like(before, c)))
    assert bool((a[1][a[0] == e] == 0).all())


def test_no_overflow_is_the_identity_for_every_strategy():
    t, e, k = 20, 8, 2
    ids, w, probs = random_routing(t, e, k, 5)
    for strategy in ("score", "random", "first", "last", "overselect"):
        got_ids, got_w = capacity_drop(ids, w, probs, t, strategy=strategy)
        assert torch.equal(got_ids, ids) and torch.equal(got_w, w), strategy
    got_ids, got_w = expanded_drop(ids, w, probs, t, local=torch.zeros(e, dtype=torch.bool))
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w)


def test_renormalize_keeps_each_tokens_total():
    ids, w, probs = random_routing(40, 8, 2, 6)
    c = capacity(0.6, 2, 40, 8)
    new_ids, new_w = capacity_drop(ids, w, probs, c, renormalize=True)
    some = (new_ids < 8).any(dim=1)
    assert torch.allclose(new_w.sum(-1)[some], w.sum(-1)[some], atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_overselect_equals_reference(seed):
    t, e, k, rounds = 30, 8, 2, 2
    ids, w, probs = random_routing(t, e, k, seed)
    c = capacity(1.0, k, t, e)
    got = as_pairs(*capacity_drop(ids, w, probs, c, strategy="overselect", rounds=rounds), e)
    extra = probs.topk(k * rounds, dim=-1).indices
    cand = [{int(x) for x in ids[i]} | {int(x) for x in extra[i]} for i in range(t)]
    ref = ref_candidates_cut(ids, w, probs, c, cand, (), k)
    assert got.keys() == ref.keys()
    assert all(abs(got[p] - ref[p]) < 1e-6 for p in ref)


@pytest.mark.parametrize("local", [None, [0, 3, 5]])
@pytest.mark.parametrize("seed", range(3))
def test_expanded_drop_equals_reference(local, seed):
    t, e, k = 24, 8, 2
    ids, w, probs = random_routing(t, e, k, seed)
    c = capacity(1.0, k, t, e)
    mask = None
    if local is not None:
        mask = torch.zeros(e, dtype=torch.bool)
        mask[local] = True
    got = as_pairs(*expanded_drop(ids, w, probs, c, local=mask), e)
    loc = set(range(e)) if local is None else set(local)
    cand = [{int(x) for x in ids[i]} | loc for i in range(t)]
    ref = ref_candidates_cut(ids, w, probs, c, cand, (), e)
    assert got.keys() == ref.keys()
    assert all(abs(got[p] - ref[p]) < 1e-6 for p in ref)
    assert max(sum(1 for (i, _) in got if i == tok) for tok in range(t)) >= k  # some token may run more


# -- SERE -----------------------------------------------------------------------------------------------
def random_similarity(e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(e, e, generator=g)
    s = (a + a.T) / 2
    s.fill_diagonal_(1.0)
    return s


@pytest.mark.parametrize("select_top", [1, 2])
@pytest.mark.parametrize("rho", [0.0, 0.3, 0.6])
@pytest.mark.parametrize("seed", range(4))
def test_sere_equals_reference(select_top, rho, seed):
    t, e, k = 16, 16, 4
    ids, w, _ = random_routing(t, e, k, seed, skew=0.5)
    sim = random_similarity(e, seed)
    got_ids, got_w, counts = sere_reroute(ids, w, sim, select_top=select_top, threshold=rho)
    ref_ids, ref_w, ref_counts = ref_sere(ids, w, sim, select_top, rho)
    assert torch.equal(got_ids, ref_ids)
    assert torch.allclose(got_w, ref_w, atol=1e-7)
    for key, value in ref_counts.items():
        assert counts[key] == value, key
    assert torch.allclose(got_w.sum(-1), w.sum(-1), atol=1e-6), "re-routing keeps every token's weight"


def test_sere_identities():
    ids, w, _ = random_routing(16, 16, 4, 7, skew=0.5)
    sim = random_similarity(16, 7)
    same = sere_reroute(ids, w, sim, select_top=4, threshold=0.0)
    assert torch.equal(same[0], ids) and torch.equal(same[1], w) and same[2]["rerouted"] == 0
    above = sere_reroute(ids, w, sim, select_top=1, threshold=1.01)
    assert torch.equal(above[0], ids) and torch.equal(above[1], w) and above[2]["critical"] > 0


def test_sere_never_reroutes_protected_experts():
    ids, w, _ = random_routing(16, 16, 4, 8, skew=0.5)
    sim = torch.ones(16, 16)
    prot = torch.zeros(16, dtype=torch.bool)
    secondary = sorted(set(ids[:, 1:].flatten().tolist()) - set(ids[:, 0].tolist()))
    prot[secondary[0]] = True
    new_ids, _, counts = sere_reroute(ids, w, sim, select_top=1, threshold=0.0, protected=prot)
    assert secondary[0] in new_ids.flatten().tolist()
    assert counts["executed"] == counts["primary"] + 1


def test_apply_policy_groups_positions_as_decode_batches():
    b, s, e, k = 4, 5, 16, 4
    ids, w, _ = random_routing(b * s, e, k, 9, skew=0.5)
    sim = random_similarity(e, 9)
    policy = {"sere": {"select_top": 1, "threshold": 0.2, "simulate_decode": True}}
    got_ids, got_w, counts = apply_policy(policy, ids, w, None, num_experts=e, top_k=k, batch_shape=(b, s), similarity=sim)
    assert counts["batches"] == s
    for p in range(s):
        rows = torch.arange(b) * s + p
        ref_ids, ref_w, _ = ref_sere(ids[rows], w[rows], sim, 1, 0.2)
        assert torch.equal(got_ids[rows], ref_ids) and torch.allclose(got_w[rows], ref_w, atol=1e-7)
    plain, _, none = apply_policy({"sere": dict(policy["sere"], simulate_decode=False)}, ids, w, None, num_experts=e, top_k=k,
                                  batch_shape=(b, s), similarity=sim)  # fmt: skip
    assert torch.equal(plain, ids) and none["batches"] == 0, "prefill is never re-routed"


def test_capacity_policy_is_never_applied_in_single_token_decode():
    ids, w, probs = random_routing(16, 8, 2, 10)
    policy = {"capacity_drop": {"gamma": 0.25, "strategy": "score"}}
    same, _, c = apply_policy(policy, ids, w, probs, num_experts=8, top_k=2, batch_shape=(16, 1))
    assert torch.equal(same, ids) and c["dropped"] == 0
    cut, _, c = apply_policy(policy, ids, w, probs, num_experts=8, top_k=2, batch_shape=(1, 16))
    assert c["dropped"] > 0 and int((cut == 8).sum()) == c["dropped"]
    inf, _, c = apply_policy({"capacity_drop": {"gamma": math.inf}}, ids, w, probs, num_experts=8, top_k=2, batch_shape=(1, 16))
    assert torch.equal(inf, ids) and c["dropped"] == 0


def test_topk_reduction():
    ids, w, _ = random_routing(20, 8, 4, 12)
    new_ids, new_w = topk_reduce(ids, w, 2, 8)
    for t in range(20):
        best = sorted(range(4), key=lambda j: -float(w[t, j]))[:2]
        assert {int(new_ids[t, j]) for j in best} == {int(ids[t, j]) for j in best}
        assert int((new_ids[t] == 8).sum()) == 2
    assert torch.allclose(new_w.sum(-1), w.sum(-1), atol=1e-6)
    same, _ = topk_reduce(ids, w, 4, 8)
    assert torch.equal(same, ids)


def test_fill_dropped_changes_nothing_the_experts_compute():
    ids, w, probs = random_routing(30, 8, 2, 11)
    new_ids, new_w = capacity_drop(ids, w, probs, 3)
    filled, fw = fill_dropped(new_ids, new_w, 8)
    assert bool((filled < 8).all())
    assert set(filled.unique().tolist()) <= set(new_ids[new_ids < 8].unique().tolist())
    assert torch.equal(fw, new_w)


# -- similarity -----------------------------------------------------------------------------------------
def test_similarity_of_identical_and_scaled_experts():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(12, 6, generator=g)
    outputs = torch.stack([a, a, 2 * a, torch.randn(12, 6, generator=g)])
    for kind in ("frobenius", "cosine", "cka"):
        s = expert_similarity(outputs, kind)
        assert torch.allclose(s, s.T) and torch.equal(s.diagonal(), torch.ones(4))
        assert abs(float(s[0, 1]) - 1.0) < 1e-6, kind
    assert abs(float(expert_similarity(outputs, "cosine")[0, 2]) - 1.0) < 1e-6
    assert abs(float(expert_similarity(outputs, "cka")[0, 2]) - 1.0) < 1e-6
    fro = expert_similarity(outputs, "frobenius")
    assert float(fro.min()) == pytest.approx(0.0, abs=1e-7)  # the farthest pair defines the scale
    with pytest.raises(MethodError, match="similarity"):
        expert_similarity(outputs, "l1")


def test_straggler_ratio():
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    assert straggler_ratio(ids, 4) == pytest.approx(4 / 2)
    assert straggler_ratio(torch.full((2, 2), 4), 4) == 1.0
