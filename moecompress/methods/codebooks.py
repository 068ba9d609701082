"""CodeQuant's building blocks on one MoE layer: rotation of the bank, per-row codebooks, output-aware
reassignment and centroid fine-tuning (used by :mod:`moecompress.passes.codequant`).

Shapes: a projection's weights ``w`` ``[M, out, in]`` (the quantised experts only), codebooks
``cents`` ``[M, out, G, K]`` (``G = in / gs`` groups of ``gs`` inputs, ``K = 2^bits``), indices ``codes``
``[M, out, in]`` (``uint8``: ``K <= 256``; widened to int64 one expert at a time where an index is needed).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moecompress.ir import ExpertBank, MoELayer
from moecompress.layouts.dense import Dense
from moecompress.methods.kmeans import CHUNK_VALUES, SortedRows, expert_uniforms, kmeans_1d, nearest
from moecompress.methods.rotation import fake_quant_tokens
from moecompress.reference import (
    _hidden,
    bank_input,
    expert_forward,
    moe_forward,
    physical_ids,
    route,
    router_logits,
    shared_forward,
)


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


WeightFn = Callable[[str, str, int], torch.Tensor]
"""``(bank, proj, i) ->`` the weights of the ``i``-th expert of a quantised part (decoded when asked)."""
_PROJ = ("gate", "up", "down")

CODE_DTYPE = torch.uint8
"""The codes' integer type while codequant works (``K = 2^bits <= 256``): 1 byte per weight, not int64's 8."""


def decode_one(cents: torch.Tensor, codes: torch.Tensor, i: int) -> torch.Tensor:
    """Weights ``[out, in]`` of expert ``i`` of codebooks ``cents`` ``[M, out, G, K]`` and indices ``codes``."""
    _, out, g, _ = cents.shape
    inn = codes.shape[-1]
    return cents[i].gather(2, codes[i].view(out, g, inn // g).long()).view(out, inn)


def cluster(
    w: torch.Tensor,
    bits: int,
    gs: int,
    *,
    iters: int,
    seed: int,
    keep_sorted: bool = False,
    seeds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, SortedRows]:
    """Per-group k-means (k-means++ seeded) of ``w`` ``[M, out, in]``: ``(cents [M, out, G, K], codes)``.
    Every group of every expert at once (:func:`kmeans_1d` chunks the rows to bound memory).
    ``keep_sorted``: also the groups' :class:`SortedRows` (``reassign_rows(w, G, None)`` without a sort).
    ``seeds``: one seed per expert (:func:`expert_seed`), so that an expert's codebooks do not depend on
    the other experts of the call (``seed`` is then unused)."""
    m, out, inn = w.shape
    g, k = inn // gs, 1 << bits
    u = None if seeds is None else expert_uniforms(k, out * g, seeds)
    res = kmeans_1d(w.reshape(m * out * g, gs), k, iters=iters, seed=seed, keep_sorted=keep_sorted,
                    code_dtype=CODE_DTYPE, uniforms=u)  # fmt: skip
    return (res[0].view(m, out, g, k), res[1].view(m, out, inn), *res[2:])  # type: ignore[return-value]


def expert_seed(seed: int, e: int) -> int:
    """The k-means++ seed of expert ``e`` of a layer (``-1``: the shared expert) for a step's ``seed``."""
    return seed * 1_000_003 + e + 1


def reassign(
    w: torch.Tensor, cents: torch.Tensor, scale: torch.Tensor | None, rows: SortedRows | None = None
) -> torch.Tensor:
    """Output-aware reassignment ``k*(i, j) = argmin_k (B_j W_ij − A_j C_ik)²``, i.e. the centroid
    nearest to ``W_ij · B_j / A_j`` (``scale = B / A`` ``[M, in]``; ``None`` = 1: nearest centroid), as
    :data:`CODE_DTYPE`, a few experts at a time (``CHUNK_VALUES`` weights).
    ``rows``: :func:`reassign_rows` of the same ``w`` and ``scale``, sorted once for repeated calls."""
    m, out, g, k = cents.shape
    inn = w.shape[-1]
    if rows is not None:
        return rows.assign(cents.reshape(m * out * g, k)).view(m, out, inn)
    codes = torch.empty(w.shape, dtype=CODE_DTYPE, device=w.device)
    step = max(1, CHUNK_VALUES // max(out * inn, 1))
    for a in range(0, m, step):
        b = min(a + step, m)
        t = w[a:b] if scale is None else w[a:b] * scale[a:b, None, :]
        codes[a:b] = nearest(t.reshape(-1, inn // g), cents[a:b].reshape(-1, k)).view(b - a, out, inn)
    return codes


def reassign_rows(w: torch.Tensor, groups: int, scale: torch.Tensor | None) -> SortedRows:
    """The values :func:`reassign` assigns (``W_ij · B_j / A_j`` per group of ``w`` ``[M, out, in]``), sorted."""
    m, out, inn = w.shape
    t = w if scale is None else w * scale[:, None, :]
    return SortedRows(t.reshape(m * out * groups, inn // groups), code_dtype=CODE_DTYPE)


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
    layer: MoELayer, x: torch.Tensor, ids: list[int], act_bits: int | None, routing: Routing | None = None
) -> torch.Tensor | None:
    """``B / A`` ``[len(ids), H]`` of each physical expert's (rotated, routed) gate/up input on tokens
    ``x`` of the layer; experts that received no token use every token. ``routing``: the tokens' routing
    given (a chunk of a layer's experts, :class:`Routing`), else ``layer``'s router routes them."""
    if act_bits is None:
        return None
    if routing is None:
        logical, _ = route(layer, x)
        phys = logical if layer.expert_map is None else layer.expert_map[logical]
    xin = bank_input(layer.experts, x)
    rows = []
    for e in ids:
        tok = routing.tokens(e) if routing is not None else torch.where((phys == e).any(-1))[0]
        rows.append(channel_scale(xin[tok] if len(tok) else xin, act_bits))
    return torch.stack(rows)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which tokens reach each expert and with what weight: ``mask`` ``[E, T]`` (bool) and ``gates``
    ``[E, T]`` (float32, 0 where not routed). What a chunk of a layer's experts is given of the layer's
    routing (its sub-layer's router holds only its rows, so it cannot route): :meth:`of` routes on the
    whole layer, :meth:`rows` keeps experts ``[a, b)``."""

    mask: torch.Tensor
    gates: torch.Tensor

    @classmethod
    def of(cls, layer: MoELayer, x: torch.Tensor) -> Routing:
        """The routing of tokens ``x`` by ``layer``'s router (logical ids; no merged experts)."""
        ids, w = route(layer, x)
        e, t = layer.router.num_experts, x.shape[0]
        tok = torch.arange(t, device=ids.device)[:, None].expand_as(ids)
        keep = ids < e  # an id past the last expert is a dropped slot
        mask = torch.zeros(e, t, dtype=torch.bool, device=ids.device)
        gates = torch.zeros(e, t, dtype=torch.float32, device=ids.device)
        mask[ids[keep], tok[keep]] = True
        gates[ids[keep], tok[keep]] = w[keep].float()
        return cls(mask, gates)

    def rows(self, a: int, b: int) -> Routing:
        return Routing(self.mask[a:b], self.gates[a:b])

    def tokens(self, e: int) -> torch.Tensor:
        """The tokens routed to expert ``e``, ascending."""
        return self.mask[e].nonzero()[:, 0]

    def partial(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        """``Σ_e gates[e, t] · E_e(x_t)`` over ``layer``'s experts (fp32 ``[T, H]``): their part of the block's
        output (no shared expert)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.mask.shape[0]):
            tok = self.tokens(e)
            if len(tok):
                out.index_add_(
                    0, tok, expert_forward(layer.experts, e, x[tok]).float() * self.gates[e, tok, None]
                )
        return out


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


class _Blocks:
    """The MoE block on fixed tokens ``x`` as a function of the quantised experts' weights only.

    The router is full precision and reads the same input whatever the centroids, so the routing
    (each expert's tokens and weights), the rotated (and activation-quantised) expert input, and the
    output of everything no part covers (protected experts, an unquantised shared expert) are computed
    once; a forward then runs only the quantised experts, each on its own routed tokens."""

    def __init__(
        self,
        rotated: MoELayer,
        parts: dict[tuple[str, str], dict],
        x: torch.Tensor,
        routing: Routing | None = None,
    ) -> None:
        bank = rotated.experts
        if routing is None:
            ids, weights = route(rotated, x)
            n_logical = bank.num_experts if rotated.expert_map is None else rotated.expert_map.numel()
            phys = physical_ids(ids, n_logical, rotated.expert_map)
        routed = next((p["ids"] for (b, _), p in parts.items() if b == "experts"), [])
        self.pos = {e: i for i, e in enumerate(routed)}
        self.keys = set(parts)
        self.rotated, self.xin, self.x = rotated, bank_input(bank, x), x
        self.routes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def each():  # (expert, its tokens ascending, their routing weights [n, 1])
            if routing is not None:
                for e in range(routing.mask.shape[0]):
                    tok = routing.tokens(e)
                    if len(tok):
                        yield e, tok, routing.gates[e, tok, None]
                return
            for e in torch.unique(phys).tolist():
                if e < 0:
                    continue
                tok, slot = torch.where(phys == e)
                yield e, tok, weights[tok, slot, None].float()

        with torch.no_grad():
            const = torch.zeros(x.shape, dtype=torch.float32)
            for e, tok, w in each():
                if e in self.pos:
                    self.routes[e] = (tok, w)
                else:
                    const.index_add_(0, tok, expert_forward(bank, e, x[tok]).float() * w)
            self.shared_gate = None
            self.shared = rotated.shared is not None and any(b == "shared" for b, _ in parts)
            if routing is not None:  # a chunk's experts: their part of the output only (no shared expert)
                pass
            elif rotated.shared is not None and not self.shared:
                const += shared_forward(rotated, x)
            elif self.shared and rotated.shared_gate is not None:
                self.shared_gate = torch.sigmoid(F.linear(x.float(), rotated.shared_gate.float()))
        self.const = const
        self.saved: dict[int | str, tuple[torch.Tensor, ...]] = {}  # activations of the last forward (keep)
        self.dense: dict[tuple[str, str], torch.Tensor] = {}  # projections no part covers (scope)
        for b in ("experts",) + (("shared",) if self.shared else ()):
            for proj in ("gate", "up", "down"):
                if (b, proj) not in parts:
                    src, keep = getattr(rotated, b), routed if b == "experts" else [0]
                    part = {
                        "proj": proj,
                        "ids": keep,
                        "live": next(p["live"] for (c, _), p in parts.items() if c == b),
                    }
                    self.dense[b, proj] = getattr(src, proj).dense().float()[part_slice(part)]

    def _weights(self, b: str, ws: WeightFn, i: int) -> list[torch.Tensor]:
        return [ws(b, p, i) if (b, p) in self.keys else self.dense[b, p][i] for p in _PROJ]

    def expert(self, e: int, ws: WeightFn, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed expert ``e``'s tokens and weighted output with the quantised weights ``ws`` (``keep``:
        its activations are kept for :meth:`backward`)."""
        tok, w = self.routes[e]
        xin = self.xin[tok]
        y, acts = _expert(self.rotated.experts, e, xin, *self._weights("experts", ws, self.pos[e]))
        if keep:
            self.saved[e] = (xin, *acts)
        return tok, y * w

    def shared_out(self, ws: WeightFn, keep: bool = False) -> torch.Tensor:
        x = self.x.float()
        s, acts = _expert(self.rotated.shared, 0, x, *self._weights("shared", ws, 0))  # type: ignore[arg-type]
        if keep:
            self.saved["shared"] = (x, *acts)
        return s if self.shared_gate is None else s * self.shared_gate

    def forward(self, ws: WeightFn, keep: bool = False) -> torch.Tensor:
        """Block output ``[T, H]`` (fp32) with the quantised experts' weights ``ws(bank, proj, i)`` (the
        ``[live, in]`` / ``[out, live]`` matrix of the part's ``i``-th expert, asked for one expert at a time).
        ``keep``: every expert's input and activations are kept for :meth:`backward` (``3·I + H`` floats
        per routed token of each expert: a few tens of MB, where a second forward would cost its time)."""
        self.saved = {}
        toks, ys = [], []
        for e in self.routes:
            tok, y = self.expert(e, ws, keep)
            toks.append(tok)
            ys.append(y)
        out = self.const if not toks else self.const.index_add(0, torch.cat(toks), torch.cat(ys))
        if self.shared:
            out = out + self.shared_out(ws, keep)
        return out

    def backward(
        self, grad: torch.Tensor, ws: WeightFn, sink: Callable[[str, str, int, torch.Tensor], None]
    ) -> None:
        """The gradients of the quantised weights given ``grad``, the gradient of the output of the last
        :meth:`forward` (``keep=True``, the same ``ws``), one expert at a time: ``sink(bank, proj, i, dL/dW)``.
        Written out as autograd computes it (bit for bit): with ``g`` the expert's output gradient
        (``grad[tok]`` times its routing weight), ``dW_down = gᵀ h``, ``dh = g W_down``, autograd through the
        activation only (``dh`` to the gate/up pre-activations), ``dW_gate = dgᵀ x_in`` (and up). Only the
        down weights are decoded again; one expert's gradients are alive at a time."""
        for e, (tok, w) in self.routes.items():
            self._one("experts", e, self.pos[e], grad[tok] * w, ws, sink)
        if self.shared:
            g = grad if self.shared_gate is None else grad * self.shared_gate
            self._one("shared", "shared", 0, g, ws, sink)
        self.saved = {}

    def _one(self, b: str, key: int | str, i: int, g: torch.Tensor, ws: WeightFn, sink) -> None:
        xin, gp, up, h = self.saved[key]
        if (b, "down") in self.keys:
            sink(b, "down", i, g.t().mm(h))
        need = [p for p in ("gate", "up") if (b, p) in self.keys]
        if not need:
            return
        wd = ws(b, "down", i) if (b, "down") in self.keys else self.dense[b, "down"][i]
        pre = {"gate": gp.requires_grad_(True), "up": up.requires_grad_(True)}
        with torch.enable_grad():
            hid = _hidden(getattr(self.rotated, b), 0 if b == "shared" else key, pre["gate"], pre["up"])  # type: ignore[arg-type]
            grads = torch.autograd.grad(hid, [pre[p] for p in need], g.mm(wd))
        for p, dp in zip(need, grads):
            sink(b, p, i, dp.t().mm(xin))


def _expert(bank: ExpertBank, e: int, xin: torch.Tensor, wg, wu, wd) -> tuple[torch.Tensor, tuple]:
    """Expert ``e`` of ``bank`` on its (rotated) input with live-cut weights (as :func:`expert_forward`), and
    its activations ``(gate pre-activation, up pre-activation, down input)``."""
    gp, up = xin @ wg.T, xin @ wu.T
    h = _hidden(bank, e, gp, up)
    y = h @ wd.T
    return (y + bank.biases["down"][e] if "down" in bank.biases else y), (gp, up, h)


def part_slice(part: dict) -> tuple:
    """Where a part's quantised weights sit in its bank's dense ``[E, out, in]``: its experts, and their
    first ``live`` neurons (rows of gate/up, columns of down)."""
    idx = torch.tensor(part["ids"], dtype=torch.long)
    live = slice(0, part["live"])
    return (idx, slice(None), live) if part["proj"] == "down" else (idx, live)


def _decoder(cents: dict, codes: dict) -> WeightFn:
    """``ws(bank, proj, i)``: expert ``i``'s weights decoded from its codebooks when asked (no dense copy)."""
    return lambda b, p, i: decode_one(cents[b, p], codes[b, p], i)


def _to_centroids(grads: dict, codes: dict, b: str, p: str, i: int, g: torch.Tensor) -> None:
    """Expert ``i``'s weight gradient ``g`` into its centroids' gradient: ``∂L/∂C_ik = Σ_{j: k_ij = k} ∂L/∂W_ij``."""
    _, o, n_g, _ = grads[b, p].shape
    grads[b, p][i].scatter_add_(2, codes[b, p][i].view(o, n_g, -1).long(), g.view(o, n_g, -1))


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
    routing: tuple[Routing, Routing] | None = None,
) -> dict:
    """Centroid fine-tuning (CodeQuant ACCF): Adam on the centroids of ``parts`` (``{(bank, proj): {"w":
    the (rotated) weights [M, out, in] of experts "ids" cut to "live" neurons, "cents", "codes", "scale"
    (B/A or None)}}``, assignment fixed within a step, reassigned after it) to
    minimise ``‖MoE_q(x) − MoE(x)‖² / ‖MoE(x)‖² + kl_weight · KL(router)`` on ``x_fit``; the step size of
    each projection is ``lr`` times its mean |weight|. The centroids (float16-rounded) with the lowest
    error on ``x_val`` are kept (the k-means result when no step improves). Updates ``parts`` in place
    and returns the fit/validation errors.

    Cost per step: the quantised experts' forward (activations kept) and backward (no second forward) on
    their routed tokens only (the routing and everything the centroids do not change are computed once,
    :class:`_Blocks`); the weights are decoded per expert and each expert's weight gradient is scattered
    into its centroids
    (``∂L/∂C_ik = Σ_{j: k_ij = k} ∂L/∂W_ij``); one reassignment of every weight; a validation forward.
    The router KL is a constant (the router and its input do not depend on the centroids: exactly 0 for
    codequant, which never changes them), so it is computed once.

    ``routing`` (the fit and validation tokens' :class:`Routing`): ``layer`` is a chunk of a layer's
    experts, which minimises the error of its own experts' part of the block's output (``Σ_{e in chunk}``;
    the terms between its experts and the other chunks' are dropped), relative to that part's norm; the
    router KL is 0."""
    with torch.no_grad():
        if routing is None:
            y_fit, y_val = moe_forward(layer, x_fit).float(), moe_forward(layer, x_val).float()
            kl_const = float(router_kl(layer, rotated, x_fit)) if kl_weight else 0.0
        else:
            y_fit, y_val = routing[0].partial(layer, x_fit), routing[1].partial(layer, x_val)
            kl_const = 0.0
    fit = _Blocks(rotated, parts, x_fit, None if routing is None else routing[0])
    val = _Blocks(rotated, parts, x_val, None if routing is None else routing[1])

    def val_error(cents, codes) -> float:
        with torch.no_grad():
            rounded = {k: v.half().float() for k, v in cents.items()}
            return rel_error(val.forward(_decoder(rounded, codes)), y_val)

    codes = {k: p["codes"] for k, p in parts.items()}
    rows = {
        k: p.pop("rows", None) or reassign_rows(p["w"], p["cents"].shape[2], p["scale"]) for k, p in parts.items()
    } if steps else {}  # fmt: skip
    params = {k: p["cents"].float().clone().requires_grad_(True) for k, p in parts.items()}
    opt = torch.optim.Adam(
        [{"params": [params[k]], "lr": lr * float(parts[k]["w"].abs().mean())} for k in params]
    )
    best = (val_error(params, codes), {k: v.detach().clone() for k, v in params.items()}, 0)
    first_codes = dict(codes)  # the k-means codes: the working codes of later steps are updated in place
    start, fit_first, fit_last = best[0], None, None
    denom = float((y_fit.double() ** 2).sum().clamp_min(1e-30)) / y_fit.numel()
    for step in range(1, steps + 1):
        with torch.no_grad():
            out = fit.forward(_decoder({k: v.detach() for k, v in params.items()}, codes), keep=True)
        out.requires_grad_(True)
        loss = ((out - y_fit) ** 2).mean() / denom
        fit_first = float(loss.detach()) if fit_first is None else fit_first
        loss.backward()
        grads = {k: torch.zeros_like(p) for k, p in params.items()}
        fit.backward(out.grad, _decoder({k: v.detach() for k, v in params.items()}, codes),  # type: ignore[arg-type]
                     functools.partial(_to_centroids, grads, codes))  # fmt: skip
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
        fit_last = float(loss.detach()) + kl_weight * kl_const
        with torch.no_grad():
            codes = {
                k: rows[k].update(params[k].reshape(-1, params[k].shape[-1])).view_as(codes[k])
                for k in params
            }
        err = val_error(params, codes)
        if err < best[0]:
            best = (err, {k: v.detach().clone() for k, v in params.items()}, step)
    for k, p in parts.items():
        p["cents"] = best[1][k]
        if best[2] == 0:
            p["codes"] = first_codes[k]
        elif best[2] == steps:
            p["codes"] = codes[k]
        else:  # the same codes as that step's reassignment (a function of its centroids)
            p["codes"] = reassign(p["w"], best[1][k], p["scale"], rows[k])
    return {
        "val_error_kmeans": start,
        "val_error_final": best[0],
        "best_step": best[2],
        "fit_loss_first": fit_first,
        "fit_loss_last": fit_last,
        "router_kl": kl_const,
    }
