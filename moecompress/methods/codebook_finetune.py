"""CodeQuant's centroid fine-tuning (ACCF) on one MoE layer: the block as a function of the quantised
experts' centroids, its forward and backward one expert at a time, and Adam on the centroids (used by
:mod:`moecompress.passes.codequant`; shapes as in :mod:`moecompress.methods.codebooks`).

A step reads every quantised weight a few times: decoded for the forward, again for the backward's down
projection, its gradient made and scattered into the centroids. Both go a block of rows at a time
(:data:`DECODE_VALUES`) through one reused int64 index: decodes into buffers reused across experts and
steps (:class:`Decoded`), gradients a block's product at a time, scattered while in cache
(:func:`mm_to_centroids`). Widening a whole expert's codes to int64 (8 bytes per weight) and faulting in
fresh result memory cost more than the gathers themselves. The validation forward of a state and the
next step's fit forward share one decode (:func:`forward_both`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from moecompress.ir import ExpertBank, MoELayer
from moecompress.methods.codebook_team import Exchange, Solo, mean_abs, pairs, target
from moecompress.methods.codebooks import Routing, reassign, reassign_rows
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

WeightFn = Callable[[str, str, int], torch.Tensor]
"""``(bank, proj, i) ->`` the weights of the ``i``-th expert of a quantised part (decoded when asked)."""
_PROJ = ("gate", "up", "down")

DECODE_VALUES = 1 << 16
"""Weights decoded, or gradients scattered, per block of rows: the block's int64 index (512 KB) stays in
cache. At DeepSeek-V3's shapes (``[2048, 7168]``, one thread) a decode costs 36 ms this way and 88 ms
through one index of the whole expert; a scatter 18 against 69 ms."""


def _row_blocks(codes: torch.Tensor, groups: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(a, b, index)``: rows ``[a, b)`` of one expert's codes ``[out, in]`` widened to int64 ``[b − a, G, gs]``,
    :data:`DECODE_VALUES` at a time, in one reused buffer (valid until the next block)."""
    out, inn = codes.shape
    rows = max(1, min(out, DECODE_VALUES // max(inn, 1)))
    idx = torch.empty(rows, groups, inn // groups, dtype=torch.long, device=codes.device)
    for a in range(0, out, rows):
        b = min(a + rows, out)
        block = idx[: b - a]
        block.copy_(codes[a:b].view(b - a, groups, -1))
        yield a, b, block


def decode_into(tables: list[torch.Tensor], codes: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """``outs[n][r, j] = tables[n][r, g(j), codes[r, j]]``: one expert's weights ``[out, in]`` from its
    codebooks ``[out, G, K]`` (several tables of the same codes read through one index, e.g. the
    centroids and their float16 rounding)."""
    for a, b, block in _row_blocks(codes, tables[0].shape[1]):
        for table, w in zip(tables, outs):
            torch.gather(table[a:b], 2, block, out=w[a:b].view(block.shape))


def mm_to_centroids(grad: torch.Tensor, codes: torch.Tensor, a: torch.Tensor, c: torch.Tensor) -> None:
    """``grad[r, g, k] += Σ_{j in group g: codes[r, j] = k} (a @ c)[r, j]``: one expert's weight gradient
    ``a @ c`` (``a`` ``[out, T]``, ``c`` ``[T, in]``) into its centroids' gradient ``[out, G, K]``, a block of
    rows at a time: the block's product is scattered while in cache, and the whole ``[out, in]`` gradient
    never exists (each row summed in the order of its inputs, as one ``scatter_add_`` does)."""
    buf = None  # sized by the first block, the largest
    for r0, r1, block in _row_blocks(codes, grad.shape[1]):
        if buf is None:
            buf = torch.empty(r1 - r0, c.shape[1], dtype=torch.promote_types(a.dtype, c.dtype), device=c.device)
        w = torch.mm(a[r0:r1], c, out=buf[: r1 - r0])
        grad[r0:r1].scatter_add_(2, block, w.view(block.shape))


class Decoded:
    """``ws(bank, proj, i)``: expert ``i``'s weights decoded from ``cents`` and ``codes`` (``{(bank, proj):
    [M, out, G, K] / [M, out, in]}``) into one buffer per part, taken from ``pool`` and reused across
    experts and steps; :meth:`rounded`: the same weights from the float16-rounded centroids ``rounded``
    (the validation's), decoded in the same pass over the codes. A part's buffer holds one expert: asking
    for another overwrites it, so a caller uses the weights before asking for the next expert's."""

    def __init__(self, cents: dict, codes: dict, pool: dict, rounded: dict | None = None) -> None:
        self.cents, self.codes, self.pool, self.round = cents, codes, pool, rounded
        self.held: dict[tuple[str, str], int] = {}

    def _buffer(self, key: tuple[str, str], kind: str) -> torch.Tensor:
        c = self.cents[key]
        shape = (c.shape[1], self.codes[key].shape[-1])
        buf = self.pool.get((key, kind))
        if buf is None or buf.shape != shape:
            buf = self.pool[key, kind] = torch.empty(shape, dtype=c.dtype, device=c.device)
        return buf

    def _get(self, key: tuple[str, str], i: int, kind: str) -> torch.Tensor:
        if self.held.get(key) != i:
            tables, outs = [self.cents[key][i]], [self._buffer(key, "w")]
            if self.round is not None:
                tables.append(self.round[key][i])
                outs.append(self._buffer(key, "r"))
            decode_into(tables, self.codes[key][i], outs)
            self.held[key] = i
        return self.pool[key, kind]

    def __call__(self, b: str, p: str, i: int) -> torch.Tensor:
        return self._get((b, p), i, "w")

    def rounded(self, b: str, p: str, i: int) -> torch.Tensor:
        assert self.round is not None, "Decoded(..., rounded=) gives the rounded weights"
        return self._get((b, p), i, "r")


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
        team: Exchange | None = None,
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

        self.team = team
        with torch.no_grad():
            const = torch.zeros(x.shape, dtype=torch.float32)
            others: list[torch.Tensor] = []  # a unit's experts no part covers (with a team): [tok, y, ...]
            for e, tok, w in each():
                if e in self.pos:
                    self.routes[e] = (tok, w)
                elif team is None:
                    const.index_add_(0, tok, expert_forward(bank, e, x[tok]).float() * w)
                else:
                    others += [tok, expert_forward(bank, e, x[tok]).float() * w]
            if team is not None:  # every unit's, in expert order; and every unit's routed tokens, once
                for tok, y in pairs(team.gather(others)):
                    const.index_add_(0, tok, y)
                toks = [t for ts in team.gather([t for t, _ in self.routes.values()]) for t in ts]
                self.all_tok = torch.cat(toks) if toks else torch.zeros(0, dtype=torch.long)
            self.shared_gate = None
            self.shared = rotated.shared is not None and any(b == "shared" for b, _ in parts)
            if routing is not None and team is None:  # a chunk's experts: their part of the output only
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

    def output(
        self, toks: list[torch.Tensor], ys: list[torch.Tensor], ws: WeightFn, keep: bool
    ) -> torch.Tensor:
        """Block output ``[T, H]`` (fp32): the routed experts' weighted outputs ``ys`` on tokens ``toks``
        (:meth:`expert`, in :attr:`routes` order), the constant part and the shared expert."""
        out = self.const if not toks else self.const.index_add(0, torch.cat(toks), torch.cat(ys))
        if self.shared:
            out = out + self.shared_out(ws, keep)
        return out

    def backward(self, grad: torch.Tensor, ws: Decoded, grads: dict) -> None:
        """Adds to ``grads`` (``{(bank, proj): [M, out, G, K]}``) the centroid gradients given ``grad``, the
        gradient of the output of the last forward (:func:`forward_both`, activations kept, the same
        centroids and codes ``ws``), one expert at a time. Written out as autograd computes it: with
        ``g`` the expert's output gradient (``grad[tok]`` times its routing weight), ``dW_down = gᵀ h``,
        ``dh = g W_down``, autograd through the activation only (``dh`` to the gate/up pre-activations),
        ``dW_gate = dgᵀ x_in`` (and up); each ``dW`` goes to its centroids by :func:`mm_to_centroids`
        (``∂L/∂C_ik = Σ_{j: k_ij = k} ∂L/∂W_ij``). Only the down weights are decoded again."""
        for e, (tok, w) in self.routes.items():
            self._one("experts", e, self.pos[e], grad[tok] * w, ws, grads)
        if self.shared:
            g = grad if self.shared_gate is None else grad * self.shared_gate
            self._one("shared", "shared", 0, g, ws, grads)
        self.saved = {}

    def _one(self, b: str, key: int | str, i: int, g: torch.Tensor, ws: Decoded, grads: dict) -> None:
        xin, gp, up, h = self.saved[key]
        if (b, "down") in self.keys:
            mm_to_centroids(grads[b, "down"][i], ws.codes[b, "down"][i], g.t(), h)
        need = [p for p in ("gate", "up") if (b, p) in self.keys]
        if not need:
            return
        wd = ws(b, "down", i) if (b, "down") in self.keys else self.dense[b, "down"][i]
        pre = {"gate": gp.requires_grad_(True), "up": up.requires_grad_(True)}
        with torch.enable_grad():
            hid = _hidden(getattr(self.rotated, b), 0 if b == "shared" else key, pre["gate"], pre["up"])  # type: ignore[arg-type]
            dpre = torch.autograd.grad(hid, [pre[p] for p in need], g.mm(wd))
        for p, dp in zip(need, dpre):
            mm_to_centroids(grads[b, p][i], ws.codes[b, p][i], dp.t(), xin)


def forward_both(fit: _Blocks | None, val: _Blocks, ws: Decoded) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The fit forward of one state (the centroids ``ws``; activations kept for :meth:`_Blocks.backward`)
    and the validation forward of the same state (its float16-rounded centroids, ``ws.rounded``; ``fit``
    ``None``: that one alone), an expert at a time: each expert's weights are decoded once for both. Each
    block's output is computed with the same operations, in the same order, as on its own. With a team
    (``val.team``), every unit's weighted outputs are gathered (one exchange for both blocks) and added in
    expert order, so every unit gets the layer's outputs."""
    runs = [(val, ws.rounded, False)] + ([] if fit is None else [(fit, ws, True)])
    outs: dict[int, tuple[list, list]] = {id(blk): ([], []) for blk, _, _ in runs}
    for blk, _, _ in runs:
        blk.saved = {}
    for e in sorted(set().union(*(blk.routes for blk, _, _ in runs))):
        for blk, w, keep in runs:
            if e in blk.routes:
                tok, y = blk.expert(e, w, keep)
                outs[id(blk)][0].append(tok)
                outs[id(blk)][1].append(y)
    if val.team is None:
        res = [blk.output(*outs[id(blk)], w, keep) for blk, w, keep in runs]
    else:
        h = val.x.shape[1]
        mine = [torch.cat(outs[id(blk)][1]) if outs[id(blk)][1] else torch.zeros(0, h) for blk, _, _ in runs]
        got = val.team.gather(mine)
        res = []
        for i, (blk, w, keep) in enumerate(runs):
            ys = torch.cat([g[i] for g in got])
            out = blk.const.index_add(0, blk.all_tok, ys) if len(blk.all_tok) else blk.const.clone()
            res.append(out + blk.shared_out(w, keep) if blk.shared else out)
    return (res[1] if fit is not None else None), res[0]


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
    patience: int | None = None,
    team: Exchange | None = None,
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
    :class:`_Blocks`); the weights are decoded per expert, once for the fit forward and the validation
    forward of the same state (:func:`forward_both`) and once more for the backward's down projection,
    and each expert's weight gradient goes to its centroids by blocks of rows (:func:`mm_to_centroids`,
    ``∂L/∂C_ik = Σ_{j: k_ij = k} ∂L/∂W_ij``); one reassignment of every weight.
    The router KL is a constant (the router and its input do not depend on the centroids: exactly 0 for
    codequant, which never changes them), so it is computed once.

    ``patience``: stop after that many steps without a lower validation error (``steps_run`` in the
    result): the kept centroids and codes are those of a run of ``steps_run`` steps.

    ``routing`` (the fit and validation tokens' :class:`Routing`): ``layer`` is a chunk of a layer's
    experts, which minimises the error of its own experts' part of the block's output (``Σ_{e in chunk}``;
    the terms between its experts and the other chunks' are dropped), relative to that part's norm; the
    router KL is 0.

    ``team`` (with ``routing``): ``layer`` is one of the units of a layer's experts fine-tuned at the same
    time, one per rank, which minimise the whole layer's error together: each unit runs its experts, the
    weighted outputs are gathered (:class:`Exchange`) and added in expert order, and each unit steps its own
    centroids (Adam is elementwise). A whole layer without an expert map runs the same way alone
    (:class:`Solo`), so the units' codebooks are the whole layer's bit for bit. The objective's target
    (:func:`target`), the step sizes' mean |weight| (float64 sums per expert, in expert order) and the
    router KL (0: neither the router nor its input changes) are computed so that they do not depend on
    the split."""
    if routing is None and layer.expert_map is None:  # the whole layer: a team of one
        routing, team = (Routing.of(rotated, x_fit), Routing.of(rotated, x_val)), Solo()
    with torch.no_grad():
        if team is not None:
            assert routing is not None
            y_fit, y_val = target(layer, routing[0], x_fit, team), target(layer, routing[1], x_val, team)
            kl_const = 0.0
        elif routing is None:
            y_fit, y_val = moe_forward(layer, x_fit).float(), moe_forward(layer, x_val).float()
            kl_const = float(router_kl(layer, rotated, x_fit)) if kl_weight else 0.0
        else:
            y_fit, y_val = routing[0].partial(layer, x_fit), routing[1].partial(layer, x_val)
            kl_const = 0.0
    fit = _Blocks(rotated, parts, x_fit, None if routing is None else routing[0], team)
    val = _Blocks(rotated, parts, x_val, None if routing is None else routing[1], team)
    scales = mean_abs(parts, team)
    if team is not None and len(fit.all_tok) == 0 and not fit.shared:
        steps = 0  # no routed token reaches a quantised expert of the layer: nothing to fine-tune

    codes = {k: p["codes"] for k, p in parts.items()}
    rows = {
        k: p.pop("rows", None) or reassign_rows(p["w"], p["cents"].shape[2], p["scale"]) for k, p in parts.items()
    } if steps else {}  # fmt: skip
    params = {k: p["cents"].float().clone().requires_grad_(True) for k, p in parts.items()}
    opt = torch.optim.Adam([{"params": [params[k]], "lr": lr * scales[k]} for k in params])
    first_codes = dict(codes)  # the k-means codes: the working codes of later steps are updated in place
    best: tuple[float, dict, int] | None = None
    fit_first = fit_last = None
    denom = float((y_fit.double() ** 2).sum().clamp_min(1e-30)) / y_fit.numel()
    pool: dict = {}  # decode buffers, one per part and kind, reused by every step
    last = 0  # the last state validated
    for step in range(steps + 1):  # state `step`: validated, then (but the last) stepped from
        cur = {k: v.detach() for k, v in params.items()}
        ws = Decoded(cur, codes, pool, rounded={k: v.half().float() for k, v in cur.items()})
        with torch.no_grad():
            out, out_val = forward_both(fit if step < steps else None, val, ws)
        err = rel_error(out_val, y_val)
        if best is None or err < best[0]:
            best = (err, {k: v.clone() for k, v in cur.items()}, step)
        if step == 0:
            start = err
        last = step
        if out is None or (patience is not None and step - best[2] >= patience):
            break
        out.requires_grad_(True)
        loss = ((out - y_fit) ** 2).mean() / denom
        fit_first = float(loss.detach()) if fit_first is None else fit_first
        loss.backward()
        grads = {k: torch.zeros_like(p) for k, p in params.items()}
        fit.backward(out.grad, Decoded(cur, codes, pool), grads)  # type: ignore[arg-type]
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
        fit_last = float(loss.detach()) + kl_weight * kl_const
        with torch.no_grad():
            codes = {
                k: rows[k].update(params[k].reshape(-1, params[k].shape[-1])).view_as(codes[k])
                for k in params
            }
    assert best is not None
    for k, p in parts.items():
        p["cents"] = best[1][k]
        if best[2] == 0:
            p["codes"] = first_codes[k]
        elif best[2] == last:
            p["codes"] = codes[k]
        else:  # the same codes as that step's reassignment (a function of its centroids)
            p["codes"] = reassign(p["w"], best[1][k], p["scale"], rows[k])
    return {
        "val_error_kmeans": start,
        "val_error_final": best[0],
        "best_step": best[2],
        "steps_run": last,
        "fit_loss_first": fit_first,
        "fit_loss_last": fit_last,
        "router_kl": kl_const,
    }
