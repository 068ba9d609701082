"""Runtime routing policies as pure tensor functions (no model, no engine).

A routing is ``ids [T, k]`` (logical expert ids; ``E`` = the number of experts marks a *dropped* slot,
which transformers' experts modules and :func:`moecompress.reference.experts_forward` skip) and
``weights [T, k]`` (what the model multiplies each expert's output by). ``probs [T, E]`` are the
router's probabilities (:func:`router_probs`) that the drop strategies rank by.

- **Capacity-aware token drop** (arXiv 2503.05066): capacity ``C = ceil(gamma * k * T / E)``; an expert
  with more than ``C`` assigned slots keeps the ``C`` ranked highest by the strategy (``score``: its
  router probability; ``random``; ``first``/``last``: position in the batch) and the others become
  dropped slots with weight 0. ``overselect`` ranks ``k * rounds`` candidates per token by probability,
  applies the capacity cut, then lets each token keep its ``k`` best survivors (its own top-k first).
  **Expanded drop** adds the local experts to every token's candidates and lets each expert keep its
  top-``C`` candidates by probability; a token may then run more than ``k`` experts.
- **SERE** (arXiv 2602.07616): in a decode batch, the primary experts ``P`` are the union of every
  token's top-``S``; each other selected expert ``u`` is re-routed to ``v* = argmax_{v in P} S[u, v]``
  when ``S[u, v*] >= rho`` (its slots keep their weights; two slots of one token that land on one expert
  are summed into one), else it stays (a *critical* expert).
- **Top-k reduction** (both papers' baseline): each token keeps its ``k`` best slots.
- Protected (super) experts are never dropped nor re-routed (top-k reduction aside: it is a baseline).

A new slot (overselect, expanded drop) is weighted ``probs * f_t`` with ``f_t`` the token's own
weight-to-probability factor (``1 / sum(top-k probs)`` under ``norm_topk_prob``, 1 without), so it is
weighted the way the model weights its own choices; ``renormalize`` rescales a token's kept weights to
the total its original slots had.
"""

from __future__ import annotations

import math

import torch

from moecompress.errors import MethodError
from moecompress.ir import Gating

STRATEGIES = ("score", "random", "first", "last", "overselect")
SIMILARITIES = ("frobenius", "cosine", "cka")


def router_probs(logits: torch.Tensor, gating: Gating) -> torch.Tensor:
    """Router probabilities ``[T, E]`` fp32: sigmoid scores for sigmoid routers, else the softmax."""
    x = logits.float()
    return x.sigmoid() if gating is Gating.SIGMOID else x.softmax(dim=-1)


def capacity(gamma: float, top_k: int, tokens: int, num_experts: int) -> int:
    """``C = ceil(gamma * k * T / E)``: slots each expert may take in a batch of ``tokens`` tokens."""
    if not gamma > 0:
        raise MethodError(f"capacity factor gamma must be > 0, got {gamma}")
    return max(1, math.ceil(gamma * top_k * tokens / num_experts))


def _assigned(ids: torch.Tensor, e: int) -> torch.Tensor:
    """``[T, E]`` bool: which experts each token's valid slots select."""
    out = torch.zeros(ids.shape[0], e + 1, dtype=torch.bool, device=ids.device)
    out.scatter_(1, ids.clamp(0, e), True)
    return out[:, :e]


def _keep_top(priority: torch.Tensor, c: int) -> torch.Tensor:
    """Per expert (column), the ``c`` finite entries of ``priority`` ranked highest (ties: lower token)."""
    cand = torch.isfinite(priority)
    t = priority.shape[0]
    if c >= t:
        return cand
    # a stable descending sort breaks ties by token position, the same on every machine
    order = priority.masked_fill(~cand, float("-inf")).argsort(dim=0, descending=True, stable=True)[:c]
    keep = torch.zeros_like(cand)
    keep.scatter_(0, order, True)
    return keep & cand


def _factor(ids: torch.Tensor, weights: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``[T, 1]``: each token's weight-to-probability factor, from its highest-weighted valid slot."""
    e = probs.shape[1]
    w = weights.float().masked_fill(ids >= e, float("-inf"))
    j = w.argmax(dim=1, keepdim=True)
    top = ids.gather(1, j)
    p = probs.gather(1, top.clamp(max=e - 1))
    f = weights.float().gather(1, j) / p.clamp_min(1e-30)
    return torch.where(top < e, f, torch.ones_like(f))


def _renormalize(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    total, kept = old.float().sum(-1, keepdim=True), new.float().sum(-1, keepdim=True)
    return torch.where(kept > 0, new.float() * total / kept.clamp_min(1e-30), new.float())


def capacity_drop(
    ids: torch.Tensor,
    weights: torch.Tensor,
    probs: torch.Tensor,
    c: int,
    *,
    strategy: str = "score",
    protected: torch.Tensor | None = None,
    renormalize: bool = False,
    rounds: int = 2,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token drop at capacity ``c`` (module docstring). Returns new ``(ids, weights)``; ``protected`` is
    an ``[E]`` bool mask of experts whose slots are always kept."""
    if strategy not in STRATEGIES:
        raise MethodError(f"unknown drop strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    t = ids.shape[0]
    e = probs.shape[1]
    assign = _assigned(ids, e)
    if strategy == "overselect":
        return _overselect(ids, weights, probs, c, assign, protected, renormalize, rounds)
    if strategy == "score":
        priority = probs.float()
    elif strategy == "random":
        gen = torch.Generator(device="cpu").manual_seed(seed)
        priority = torch.rand(t, e, generator=gen).to(probs.device)
    else:
        pos = torch.arange(t, device=probs.device, dtype=torch.float32)[:, None].expand(t, e)
        priority = -pos if strategy == "first" else pos
    keep = _keep_top(priority.masked_fill(~assign, float("-inf")), c)
    if protected is not None:
        keep |= assign & protected.to(assign.device)[None, :]
    slot = keep.gather(1, ids.clamp(max=e - 1)) & (ids < e)
    new_w = torch.where(slot, weights, torch.zeros_like(weights))
    if renormalize:
        new_w = _renormalize(weights, new_w).to(weights.dtype)
    return torch.where(slot, ids, torch.full_like(ids, e)), new_w


def _overselect(ids, weights, probs, c, assign, protected, renormalize, rounds):
    k = ids.shape[1]
    e = probs.shape[1]
    extra = probs.float().topk(min(e, k * max(1, rounds)), dim=1).indices
    cand = assign.clone()
    cand.scatter_(1, extra, True)
    keep = _keep_top(probs.float().masked_fill(~cand, float("-inf")), c)
    if protected is not None:
        keep |= assign & protected.to(assign.device)[None, :]
    return _pick(ids, weights, probs, keep, assign, k, renormalize)


def _pick(ids, weights, probs, keep, assign, width, renormalize):
    """Each token's best ``width`` experts among ``keep`` (its own selected experts first, then by
    probability), weighted by its own weight where it had the slot, else ``probs * factor``."""
    e = probs.shape[1]
    own = torch.zeros_like(probs, dtype=weights.dtype)
    valid = ids < e
    own.scatter_(1, ids.clamp(max=e - 1), torch.where(valid, weights, torch.zeros_like(weights)))
    key = (probs.float() + 2.0 * assign.float()).masked_fill(~keep, float("-inf"))
    width = min(e, width)
    top = key.topk(width, dim=1)
    ok = torch.isfinite(top.values)
    new_ids = torch.where(ok, top.indices, torch.full_like(top.indices, e))
    fresh = probs.float() * _factor(ids, weights, probs)
    w = torch.where(assign, own.float(), fresh).gather(1, top.indices)
    w = torch.where(ok, w, torch.zeros_like(w))
    if renormalize:
        w = _renormalize(weights, w)
    return new_ids, w.to(weights.dtype)


def expanded_drop(
    ids: torch.Tensor,
    weights: torch.Tensor,
    probs: torch.Tensor,
    c: int,
    *,
    local: torch.Tensor | None = None,
    protected: torch.Tensor | None = None,
    renormalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expanded drop (module docstring): candidates are each token's top-k plus the ``local`` experts
    (``[E]`` bool; ``None``: every expert); each expert keeps its ``c`` best candidates by probability.
    The result has as many slots as the busiest token needs (at least ``k``)."""
    t, k = ids.shape
    e = probs.shape[1]
    assign = _assigned(ids, e)
    loc = torch.ones(e, dtype=torch.bool, device=probs.device) if local is None else local.to(probs.device)
    cand = assign | loc[None, :]
    keep = _keep_top(probs.float().masked_fill(~cand, float("-inf")), c)
    if protected is not None:
        keep |= assign & protected.to(assign.device)[None, :]
    width = max(k, int(keep.sum(dim=1).max()) if t else k)
    return _pick(ids, weights, probs, keep, assign, width, renormalize)


def sere_reroute(
    ids: torch.Tensor,
    weights: torch.Tensor,
    similarity: torch.Tensor,
    *,
    select_top: int,
    threshold: float,
    protected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """SERE on one decode batch ``ids [T, k]`` (module docstring), or on ``G`` independent batches at once
    (``ids [G, T, k]``). Returns new ``(ids, weights)`` and counts (summed over batches): ``selected``,
    ``primary``, ``critical``, ``rerouted`` (experts), ``rerouted_slots``, ``executed`` (distinct experts
    run)."""
    if ids.dim() == 2:
        new_ids, new_w, counts = sere_reroute(ids[None], weights[None], similarity, select_top=select_top,
                                              threshold=threshold, protected=protected)  # fmt: skip
        return new_ids[0], new_w[0], counts
    e = similarity.shape[0]
    g, t, k = ids.shape
    valid = ids < e
    s = max(1, min(select_top, k))
    order = weights.float().masked_fill(~valid, float("-inf")).argsort(dim=2, descending=True, stable=True)
    top = torch.where(valid.gather(2, order[..., :s]), ids.gather(2, order[..., :s]), torch.full_like(ids[..., :s], e))
    primary = torch.zeros(g, e + 1, dtype=torch.bool, device=ids.device)
    primary.scatter_(1, top.reshape(g, -1), True)
    primary = primary[:, :e]
    selected = torch.zeros(g, e + 1, dtype=torch.bool, device=ids.device)
    selected.scatter_(1, ids.clamp(0, e).reshape(g, -1), True)
    selected = selected[:, :e]
    keep_fixed = primary if protected is None else primary | protected.to(primary.device)[None, :]
    secondary = selected & ~keep_fixed
    sim = similarity.float().to(ids.device)[None].masked_fill(~primary[:, None, :], float("-inf"))
    best, target = sim.max(dim=2)  # [G, E]: each expert's most similar primary expert of its batch
    reroute = secondary & (best >= threshold) & primary.any(dim=1, keepdim=True)
    mapping = torch.arange(e + 1, device=ids.device).repeat(g, 1)
    mapping[:, :e] = torch.where(reroute, target, mapping[:, :e])
    new_ids = mapping.gather(1, ids.clamp(0, e).reshape(g, -1)).reshape(g, t, k)
    moved = valid & reroute.gather(1, ids.clamp(max=e - 1).reshape(g, -1)).reshape(g, t, k)
    flat_ids, new_w = new_ids.reshape(g * t, k).clone(), weights.reshape(g * t, k).clone()
    for j in range(1, k):  # two slots of one token on one expert: computed once, weights summed
        same = (flat_ids[:, :j] == flat_ids[:, j : j + 1]) & (flat_ids[:, :j] < e)
        dup = same.any(dim=1)
        if bool(dup.any()):
            first = same.float().argmax(dim=1)
            rows = torch.nonzero(dup).flatten()
            new_w[rows, first[rows]] += new_w[rows, j]
            new_w[rows, j] = 0
            flat_ids[rows, j] = e
    executed = torch.zeros(g, e + 1, dtype=torch.bool, device=ids.device)
    executed.scatter_(1, flat_ids.reshape(g, -1), True)
    counts = {
        "selected": int(selected.sum()),
        "primary": int(primary.sum()),
        "critical": int((secondary & ~reroute).sum()),
        "rerouted": int(reroute.sum()),
        "rerouted_slots": int(moved.sum()),
        "executed": int(executed[:, :e].sum()),
    }
    return flat_ids.reshape(g, t, k), new_w.reshape(g, t, k), counts


def topk_reduce(
    ids: torch.Tensor, weights: torch.Tensor, k: int, num_experts: int, *, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k reduction: each token keeps its ``k`` highest-weighted valid slots (the others dropped),
    rescaled to the token's original total weight with ``renormalize``."""
    e = num_experts
    valid = ids < e
    order = weights.float().masked_fill(~valid, float("-inf")).argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(ids.shape[1], device=ids.device).expand_as(order))
    keep = valid & (rank < k)
    new_w = torch.where(keep, weights, torch.zeros_like(weights))
    if renormalize:
        new_w = _renormalize(weights, new_w).to(weights.dtype)
    return torch.where(keep, ids, torch.full_like(ids, e)), new_w


def expert_similarity(outputs: torch.Tensor, kind: str = "cosine") -> torch.Tensor:
    """``[E, E]`` fp32 similarity of experts from their outputs ``[E, N, H]`` on the same ``N`` tokens:
    ``frobenius`` ``1 - ||A_p - A_q||_F / max ||A_p - A_q||_F``; ``cosine`` of the flattened outputs;
    ``cka`` linear CKA (token Gram matrices, centred). Diagonal 1. Computed in fp64."""
    if kind not in SIMILARITIES:
        raise MethodError(f"unknown similarity {kind!r}; choose one of {', '.join(SIMILARITIES)}")
    e = outputs.shape[0]
    a = outputs.double().reshape(e, -1)
    if kind == "frobenius":
        d = torch.cdist(a, a)
        top = float(d.max())
        s = 1 - d / top if top > 0 else torch.ones_like(d)
    elif kind == "cosine":
        n = a / a.norm(dim=1, keepdim=True).clamp_min(1e-300)
        s = n @ n.T
    else:
        x = outputs.double() - outputs.double().mean(dim=1, keepdim=True)
        gram = (x @ x.transpose(1, 2)).reshape(e, -1)  # [E, N*N]
        hsic = gram @ gram.T
        norm = hsic.diagonal().clamp_min(1e-300).sqrt()
        s = hsic / (norm[:, None] * norm[None, :])
    s = s.clone()
    s.fill_diagonal_(1.0)
    return s.float()


def loads(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: slots each expert takes (dropped slots not counted)."""
    v = ids[ids < num_experts]
    return torch.bincount(v.flatten(), minlength=num_experts)


def straggler_ratio(ids: torch.Tensor, num_experts: int) -> float:
    """Max over mean expert load: how much longer the busiest expert runs than an average one."""
    n = loads(ids, num_experts).double()
    mean = float(n.mean())
    return float(n.max()) / mean if mean > 0 else 1.0


def apply_policy(
    policy: dict,
    ids: torch.Tensor,
    weights: torch.Tensor,
    probs: torch.Tensor | None,
    *,
    num_experts: int,
    top_k: int,
    batch_shape: tuple[int, int],
    similarity: torch.Tensor | None = None,
    protected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Apply a stored policy (``{"capacity_drop": knobs, "sere": knobs}``, plain dicts) to one forward's
    routing. ``batch_shape = (B, S)``: capacity drop applies when ``S > 1`` (``T = B * S`` tokens), SERE
    when ``S == 1`` (one decode batch) or, with ``simulate_decode``, to each position of a ``[B, S]``
    batch. ``probs`` (router probabilities) are needed for capacity drop. Returns new ``(ids, weights)``
    and counts: ``slots`` (valid before), ``dropped``, ``added`` (expanded drop), ``rerouted_slots``,
    ``batches``, ``selected`` and ``executed`` (distinct experts per SERE batch, summed)."""
    e = num_experts
    b, s = batch_shape
    counts = {"slots": int((ids < e).sum()), "dropped": 0, "added": 0, "rerouted_slots": 0,
              "batches": 0, "selected": 0, "executed": 0}  # fmt: skip
    cap = policy.get("capacity_drop")
    if cap and s > 1 and math.isfinite(float(cap["gamma"])) and probs is not None:
        c = capacity(float(cap["gamma"]), top_k, ids.shape[0], e)
        if cap.get("expanded"):
            loc = cap.get("local_experts", "all")
            local = None
            if loc != "all":
                local = torch.zeros(e, dtype=torch.bool, device=probs.device)
                local[torch.tensor([int(x) for x in loc], dtype=torch.long, device=probs.device)] = True
            new_ids, new_w = expanded_drop(ids, weights, probs, c, local=local, protected=protected,
                                           renormalize=bool(cap.get("renormalize")))  # fmt: skip
        else:
            new_ids, new_w = capacity_drop(
                ids, weights, probs, c, strategy=cap.get("strategy", "score"), protected=protected,
                renormalize=bool(cap.get("renormalize")), rounds=int(cap.get("rounds", 2)),
                seed=int(cap.get("seed", 0)),
            )  # fmt: skip
        kept = _assigned(new_ids, e)
        before = _assigned(ids, e)
        counts["dropped"] = int((before & ~kept).sum())
        counts["added"] = int((kept & ~before).sum())
        ids, weights = new_ids, new_w
    top = policy.get("top_k")
    if top:
        new_ids, weights = topk_reduce(ids, weights, int(top["k"]), e, renormalize=bool(top.get("renormalize", True)))
        counts["dropped"] += int(((ids < e) & (new_ids >= e)).sum())
        ids = new_ids
    sere = policy.get("sere")
    if sere and similarity is not None and (s == 1 or sere.get("simulate_decode")):
        # tokens are [B, S] flattened: position p of every sequence forms decode batch p
        width = ids.shape[1]
        grouped_ids = ids.view(b, s, width).transpose(0, 1)  # [S, B, width]
        grouped_w = weights.view(b, s, width).transpose(0, 1)
        new_ids, new_w, c = sere_reroute(
            grouped_ids, grouped_w, similarity, select_top=int(sere["select_top"]),
            threshold=float(sere["threshold"]), protected=protected,
        )  # fmt: skip
        ids = new_ids.transpose(0, 1).reshape(b * s, width)
        weights = new_w.transpose(0, 1).reshape(b * s, width)
        counts["batches"] += s
        counts["selected"] += c["selected"]
        counts["executed"] += c["executed"]
        counts["rerouted_slots"] += c["rerouted_slots"]
    return ids, weights, counts


def fill_dropped(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropped slots as weight-0 slots on an expert the token (else the batch) already runs: for experts
    implementations that cannot skip id ``E`` (transformers' ``grouped_mm`` / ``batched_mm`` leave such
    rows uninitialised, and ``0 * NaN`` is NaN). No new expert runs; the output is unchanged."""
    e = num_experts
    dropped = ids >= e
    if not bool(dropped.any()):
        return ids, weights
    valid = ~dropped
    first = torch.where(valid.any(dim=1), ids.masked_fill(dropped, e).min(dim=1).values, torch.full_like(ids[:, 0], -1))
    n = loads(ids, e)
    fallback = int(n.argmax()) if int(n.sum()) > 0 else 0
    first = torch.where(first >= 0, first, torch.full_like(first, fallback))
    return torch.where(dropped, first[:, None].expand_as(ids), ids), weights.masked_fill(dropped, 0)
