"""CodeQuant's building blocks on one MoE layer: rotation of the bank, per-row codebooks, output-aware
reassignment and centroid fine-tuning (used by :mod:`moecompress.passes.codequant`).

Shapes: a projection's weights ``w`` ``[M, out, in]`` (the quantised experts only), codebooks
``cents`` ``[M, out, G, K]`` (``G = in / gs`` groups of ``gs`` inputs, ``K = 2^bits``), indices ``codes``
``[M, out, in]`` (int64).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.dense import Dense
from moecompress.methods.kmeans import SortedRows, kmeans_1d, nearest
from moecompress.methods.rotation import fake_quant_tokens
from moecompress.reference import bank_input, moe_forward, route, router_logits


def rotate_bank(bank: ExpertBank, rotation: torch.Tensor, exempt: frozenset[int]) -> ExpertBank:
    """``bank`` reading ``x @ rotation``: gate/up of every expert but ``exempt`` stored as ``W @ rotation``
    (computed in float64), the function unchanged in exact arithmetic. ``rotation`` is kept in float32
    whatever the model dtype (bf16 would break the exactness); ``exempt`` experts keep their weights
    bit-identical and read the unrotated input."""
    r = rotation.double()
    new = {}
    for name in ("gate", "up"):
        w = getattr(bank, name).dense()
        rot = (w.double() @ r).to(w.dtype)
        keep = torch.tensor(sorted(exempt), dtype=torch.long)
        if len(keep):
            rot[keep] = w[keep]
        new[name] = Dense(rot)
    return dataclasses.replace(bank, **new, rotation=rotation.to(torch.float32), unrotated=exempt)


def decode(cents: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Weights ``[M, out, in]`` of codebooks ``cents`` ``[M, out, G, K]`` and indices ``codes``."""
    m, out, g, _ = cents.shape
    inn = codes.shape[-1]
    return cents.gather(3, codes.view(m, out, g, inn // g)).view(m, out, inn)


def cluster(
    w: torch.Tensor, bits: int, gs: int, *, iters: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group k-means (k-means++ seeded) of ``w`` ``[M, out, in]``: ``(cents [M, out, G, K], codes)``.
    Every group of every expert at once (:func:`kmeans_1d` chunks the rows to bound memory)."""
    m, out, inn = w.shape
    g, k = inn // gs, 1 << bits
    c, a = kmeans_1d(w.reshape(m * out * g, gs), k, iters=iters, seed=seed)
    return c.view(m, out, g, k), a.view(m, out, inn)


def reassign(
    w: torch.Tensor, cents: torch.Tensor, scale: torch.Tensor | None, rows: SortedRows | None = None
) -> torch.Tensor:
    """Output-aware reassignment ``k*(i, j) = argmin_k (B_j W_ij − A_j C_ik)²``, i.e. the centroid
    nearest to ``W_ij · B_j / A_j`` (``scale = B / A`` ``[M, in]``; ``None`` = 1: nearest centroid).
    ``rows``: :func:`reassign_rows` of the same ``w`` and ``scale``, sorted once for repeated calls."""
    m, out, g, k = cents.shape
    inn = w.shape[-1]
    flat = cents.reshape(m * out * g, k)
    if rows is not None:
        return rows.assign(flat).view(m, out, inn)
    t = w if scale is None else w * scale[:, None, :]
    return nearest(t.reshape(m * out * g, inn // g), flat).view(m, out, inn)


def reassign_rows(w: torch.Tensor, groups: int, scale: torch.Tensor | None) -> SortedRows:
    """The values :func:`reassign` assigns (``W_ij · B_j / A_j`` per group of ``w`` ``[M, out, in]``), sorted."""
    m, out, inn = w.shape
    t = w if scale is None else w * scale[:, None, :]
    return SortedRows(t.reshape(m * out * groups, inn // groups))


def channel_scale(x: torch.Tensor, act_bits: int | None) -> torch.Tensor | None:
    """``B / A`` per input channel for inputs ``x`` ``[n, in]``: ``A_j = E[x_j²]``, ``B_j = E[x_j x̂_j]``
    with ``x̂ = Q_act_bits(x)`` per token; ``None`` without activation quantisation (then ``B = A``).
    Channels without signal (``A_j = 0``) get 1."""
    if act_bits is None or x.shape[0] == 0:
        return None
    xf = x.double()
    a = (xf * xf).mean(0)
    b = (xf * fake_quant_tokens(xf, act_bits)).mean(0)
    return torch.where(a > 0, b / a.clamp_min(1e-300), torch.ones_like(a)).float()


def gate_up_scales(
    layer: MoELayer, x: torch.Tensor, ids: list[int], act_bits: int | None
) -> torch.Tensor | None:
    """``B / A`` ``[len(ids), H]`` of each physical expert's (rotated, routed) gate/up input on tokens
    ``x`` of the layer; experts that received no token use every token."""
    if act_bits is None:
        return None
    logical, _ = route(layer, x)
    phys = logical if layer.expert_map is None else layer.expert_map[logical]
    xin = bank_input(layer.experts, x)
    rows = []
    for e in ids:
        tok = torch.where((phys == e).any(-1))[0]
        rows.append(channel_scale(xin[tok] if len(tok) else xin, act_bits))
    return torch.stack(rows)  # type: ignore[arg-type]


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖y − ref‖² / ‖ref‖²``."""
    return float(((y.double() - ref.double()) ** 2).sum() / (ref.double() ** 2).sum().clamp_min(1e-30))


def router_kl(orig: MoELayer, new: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """``KL(P_orig ‖ P_new)`` of the router distributions on ``x`` (batch mean)."""
    return F.kl_div(
        router_logits(new, x).log_softmax(-1),
        router_logits(orig, x).log_softmax(-1),
        log_target=True,
        reduction="batchmean",
    )


def with_weights(layer: MoELayer, weights: dict[tuple[str, str], torch.Tensor]) -> MoELayer:
    """``layer`` whose projections ``{(bank, proj): W}`` (bank ``experts`` or ``shared``) are replaced by
    the dense ``W`` (may require grad)."""
    banks: dict[str, dict[str, Dense]] = {}
    for (bank, proj), w in weights.items():
        banks.setdefault(bank, {})[proj] = Dense(w)
    return layer.replace(**{b: dataclasses.replace(getattr(layer, b), **lays) for b, lays in banks.items()})


def part_slice(part: dict) -> tuple:
    """Where a part's quantised weights sit in its bank's dense ``[E, out, in]``: its experts, and their
    first ``live`` neurons (rows of gate/up, columns of down)."""
    idx = torch.tensor(part["ids"], dtype=torch.long)
    live = slice(0, part["live"])
    return (idx, slice(None), live) if part["proj"] == "down" else (idx, live)


def finetune(
    layer: MoELayer,
    rotated: MoELayer,
    parts: dict[tuple[str, str], dict],
    x_fit: torch.Tensor,
    x_val: torch.Tensor,
    *,
    steps: int,
    lr: float,
    kl_weight: float,
) -> dict:
    """Centroid fine-tuning (CodeQuant ACCF): Adam on the centroids of ``parts`` (``{(bank, proj): {"w":
    the (rotated) weights [M, out, in] of experts "ids" cut to "live" neurons, "cents", "codes", "scale"
    (B/A or None)}}``, assignment fixed within a step, reassigned after it) to
    minimise ``‖MoE_q(x) − MoE(x)‖² / ‖MoE(x)‖² + kl_weight · KL(router)`` on ``x_fit``; the step size of
    each projection is ``lr`` times its mean |weight|. The centroids (float16-rounded) with the lowest
    error on ``x_val`` are kept (the k-means result when no step improves). Updates ``parts`` in place
    and returns the fit/validation errors."""
    with torch.no_grad():
        y_fit, y_val = moe_forward(layer, x_fit).float(), moe_forward(layer, x_val).float()
    full = {}  # the dense projections a part covers only partly (protected experts, pruned neurons)
    for key, p in parts.items():
        lay = getattr(getattr(rotated, key[0]), key[1])
        if list(p["ids"]) != list(range(lay.shape[0])) or tuple(p["w"].shape) != tuple(lay.shape):
            full[key] = lay.dense().float()

    def weights(cents: dict, codes: dict) -> dict[tuple[str, str], torch.Tensor]:
        out = {}
        for key in parts:
            dec = decode(cents[key], codes[key])
            if key not in full:  # every expert, full width: nothing of the dense weights survives
                out[key] = dec
                continue
            w = full[key].clone()
            w[part_slice(parts[key])] = dec
            out[key] = w
        return out

    def val_error(cents, codes) -> float:
        with torch.no_grad():
            rounded = {k: v.half().float() for k, v in cents.items()}
            return rel_error(moe_forward(with_weights(rotated, weights(rounded, codes)), x_val), y_val)

    codes = {k: p["codes"] for k, p in parts.items()}
    rows = {k: reassign_rows(p["w"], p["cents"].shape[2], p["scale"]) for k, p in parts.items()} if steps else {}
    params = {k: p["cents"].float().clone().requires_grad_(True) for k, p in parts.items()}
    opt = torch.optim.Adam(
        [{"params": [params[k]], "lr": lr * float(parts[k]["w"].abs().mean())} for k in params]
    )
    best = (val_error(params, codes), {k: v.detach().clone() for k, v in params.items()}, dict(codes), 0)
    start, fit_first, fit_last, kl_last = best[0], None, None, 0.0
    denom = float((y_fit.double() ** 2).sum().clamp_min(1e-30)) / y_fit.numel()
    for step in range(1, steps + 1):
        q = with_weights(rotated, weights(params, codes))
        loss = ((moe_forward(q, x_fit).float() - y_fit) ** 2).mean() / denom
        fit_first = float(loss.detach()) if fit_first is None else fit_first
        if kl_weight:
            kl = router_kl(layer, q, x_fit)
            kl_last = float(kl.detach())
            loss = loss + kl_weight * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        fit_last = float(loss.detach())
        with torch.no_grad():
            codes = {k: reassign(parts[k]["w"], params[k], parts[k]["scale"], rows[k]) for k in params}
        err = val_error(params, codes)
        if err < best[0]:
            best = (err, {k: v.detach().clone() for k, v in params.items()}, dict(codes), step)
    for k in parts:
        parts[k]["cents"], parts[k]["codes"] = best[1][k], best[2][k]
    return {
        "val_error_kmeans": start,
        "val_error_final": best[0],
        "best_step": best[3],
        "fit_loss_first": fit_first,
        "fit_loss_last": fit_last,
        "router_kl": kl_last,
    }
