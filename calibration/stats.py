"""The collector that gathers the statistics of :mod:`moecompress.calibration.catalogue` inside the
reference MoE forward.

transformers 5 runs experts as fused 3-D parameters with no per-expert modules, so nothing can be
hooked by name; moecompress computes its statistics in its own canonical forward
(:func:`moecompress.reference.moe_forward` with an :class:`~moecompress.reference.Observer`), which
equals the transformers block to ~1e-7. Notation: ``x`` MoE input ``[T, H]``, ``h`` the
down-projection input of an expert ``[n, I]`` (tokens routed to it), ``y`` an expert's unweighted
output ``[n, H]``, ``g`` the gradient of the LM loss (mean token NLL over the calibration set).

Forward statistics are means over the calibration (non-held-back) tokens; backward statistics come
from the executor's streamed backward. Counts use logical router ids for routing statistics and
physical expert ids for expert internals (identical unless experts were merged). Moving the sums between
collectors (data-parallel rounds, expert-sharded rows): :mod:`moecompress.calibration.stats_exchange`.
"""

from __future__ import annotations

import math

import torch

from moecompress.calibration.catalogue import ALWAYS
from moecompress.calibration.grams import WardOutputs
from moecompress.calibration.stats_exchange import BY_BLOCK, CollectorExchange
from moecompress.errors import CheckpointError
from moecompress.ir import MoELayer, fold_block_size, fold_blocks
from moecompress.methods.mixture import AUTO_TOKENS

SPILLED = ("expert_in_cov", "down_in_cov")
"""The per-expert covariances (``[E, H, H]``, ``[E, I, I]``): at DeepSeek-V3 shapes 205 MB of float32 per
expert. A layer calibrated by chunks of experts keeps their float64 sums for the current chunk only; once
its chunk-outer sweep is done they are finished and handed out (:meth:`StatsCollector.spill`) to be
written apart (``calibration/cache.py``, :func:`~moecompress.calibration.cache.save_experts`)."""

POOLED_BY_BLOCK = BY_BLOCK
"""Sums over every routed expert, kept by :func:`~moecompress.ir.fold_blocks`' fixed blocks of experts (one row
per block, ``[blocks, I, I]`` float64): per batch the terms of a block's experts are summed expert by expert and
added to the block's row once; the layer's sum adds the rows in block order (:func:`pooled_total`). So the
whole layer, chunks that are unions of blocks, and ranks each holding their chunks' rows
(:mod:`~moecompress.calibration.expert_sharded`) add the same terms in the same order, bit for bit."""


def pooled_total(rows: torch.Tensor) -> torch.Tensor:
    """A :data:`POOLED_BY_BLOCK` sum's rows ``[blocks, ...]`` added in block order."""
    total = torch.zeros_like(rows[0])
    for row in rows:
        total += row
    return total


IMPLIED = (
    ("expert_out_gram", "io_sample"),
    ("expert_out_gram_fisher", "out_grad_cov"),
    ("router_sample_base", "router_sample"),
)
"""``(statistic, what the collector keeps to compute it)``."""


class StatsCollector(CollectorExchange):
    """An :class:`~moecompress.reference.Observer` accumulating the requested statistics of one layer.

    ``mode`` is ``"stats"`` (forward statistics), ``"holdout"`` (only the held-back inputs/outputs used
    for reconstruction errors) or ``"backward"`` (gradient statistics via tensor hooks during the
    recomputation of the streamed backward).
    """

    def __init__(
        self, layer: MoELayer, names: set[str] | frozenset[str], sample_tokens: int = 512, *, rounds: bool = False,
        spill: bool = False,
    ) -> None:  # fmt: skip
        """``rounds``: a data-parallel rank's collector, whose per-batch contributions are taken round by
        round (:meth:`take_round`) and merged in batch order into another collector (:meth:`add_round`).
        ``spill``: the :data:`SPILLED` statistics are kept per expert and handed out by :meth:`spill` (an
        expert-chunked layer); :meth:`result` then leaves them out."""
        self.names = set(names) | ALWAYS
        self.names |= {dep for name, dep in IMPLIED if name in self.names}
        self.layer = layer
        self.sample_tokens = sample_tokens
        self.mode = "stats"
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}
        self._n_tokens = 0
        self._n_grad_tokens = 0
        self._io: dict[str, list[torch.Tensor]] = {
            "io_sample_x": [],
            "io_sample_y": [],
            "router_sample": [],
            "holdout_x": [],
            "gram_x": [],  # expert_out_gram_fisher: the backward's MoE inputs of the Ward tokens
            "moe_inputs": [],  # every calibration token's MoE input (a changed layer is replayed on them)
        }
        self._absmax: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._weights: torch.Tensor | None = None
        self._x: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None
        self._off = 0
        self._attr: dict | None = None  # route_attrib: the traced tokens (calibration/trace.py)
        self._attribution: dict[str, torch.Tensor] = {}
        self._seq: dict[str, list[torch.Tensor]] | None = {} if rounds else None
        """a round's unindexed additions, in order (one per batch and sum)"""
        self._pool: dict[str, tuple[int, torch.Tensor]] = {}
        """``down_in_cov_pooled`` by :data:`POOLED_BY_BLOCK`: the batch's terms of the current block of experts
        (:func:`~moecompress.ir.fold_blocks`), summed expert by expert (float64), added to the block's row of
        the layer's sum once the batch leaves the block (:meth:`_flush_pool`)"""
        self._spill = spill
        self._apart: dict[str, dict[int, torch.Tensor]] = {}
        self._ward = WardOutputs(layer, self.names)
        """``spill``: the :data:`SPILLED` float64 sums of the experts not yet handed out, by expert"""

    # -- helpers ---------------------------------------------------------------------------------
    def _add(self, name: str, value: torch.Tensor, index: int | None = None) -> None:
        value = value.detach().double()
        if self._spill and index is not None and name in SPILLED:  # the same additions as the [E, ...] sums
            apart = self._apart.setdefault(name, {})
            if index not in apart:
                apart[index] = torch.zeros_like(value)
            apart[index] += value
            return
        if index is None and self._seq is not None:  # kept apart: merged later in the one process's order
            self._seq.setdefault(name, []).append(value.clone())
            return
        if name not in self._sums:
            shape = (self._n_experts(name), *value.shape) if index is not None else value.shape
            self._sums[name] = torch.zeros(shape, dtype=torch.float64, device=value.device)
        if index is None:
            self._sums[name] += value
        else:
            self._sums[name][index] += value

    def _count(self, name: str, index: int, n: int) -> None:
        if name not in self._counts:
            self._counts[name] = torch.zeros(self._n_experts(name), dtype=torch.float64)
        self._counts[name][index] += n

    def _n_experts(self, name: str) -> int:
        """Rows of the indexed sum ``name``: an expert's, or a block's (:data:`POOLED_BY_BLOCK`)."""
        if name in POOLED_BY_BLOCK:
            return len(fold_blocks(self.layer.experts.num_experts))
        return self.layer.experts.num_experts

    def _absmax_update(self, name: str, index: int, size: int, y: torch.Tensor) -> None:
        a = y.detach().abs().float()
        val, flat = (v.cpu() for v in a.max(dim=0).values.max(dim=0))
        if name not in self._absmax:
            self._absmax[name] = (torch.zeros(size), torch.zeros(size, dtype=torch.long))
        best, chan = self._absmax[name]
        if val > best[index]:
            best[index] = val
            chan[index] = flat

    def _keep(self, key: str, t: torch.Tensor) -> None:
        have = sum(x.shape[0] for x in self._io[key])
        cap = AUTO_TOKENS if key == "gram_x" else 1 << 62 if key == "moe_inputs" else self.sample_tokens
        if have < cap:
            self._io[key].append(t.detach()[: cap - have].float().cpu().clone())

    # -- Observer --------------------------------------------------------------------------------
    def on_input(self, x: torch.Tensor) -> None:
        self._flush_pool()  # a batch's partials stay with it (a forward without on_output: moe_forward alone)
        if self.mode == "holdout":
            self._keep("holdout_x", x)
            return
        if self.mode == "backward" and "expert_out_gram_fisher" in self.names:
            self._keep("gram_x", x)
        if self.mode != "stats":
            return
        self._off = self._n_tokens
        self._n_tokens += x.shape[0]
        self._x = x
        if "route_attrib" in self.names:
            self._trace_input(x)
        if "input_cov" in self.names:
            xf = x.detach().float()
            self._add("input_cov", xf.T @ xf)
        if "io_sample" in self.names:
            self._keep("io_sample_x", x)
        if "moe_inputs" in self.names:
            self._keep("moe_inputs", x)

    def on_route(self, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._ids, self._weights = ids, weights.detach()
        if self.mode != "stats":
            return
        p = logits.detach().float().softmax(dim=-1)
        self._add("router_prob_mean", p.sum(0))
        self._add("router_entropy", -(p * p.clamp_min(1e-30).log()).sum())
        self._add("expert_counts", torch.bincount(ids.flatten(), minlength=logits.shape[1]).double())
        if "router_sample" in self.names:
            self._keep("router_sample", logits)
        if self._attr is not None and self._off < self._attr["n"]:
            self._attr["ids"].append(ids[: self._attr["n"] - self._off].detach().cpu().clone())

    def on_expert(
        self, e: int, tok: torch.Tensor, slot: torch.Tensor, h: torch.Tensor, y: torch.Tensor
    ) -> None:
        n = h.shape[0]
        if self.mode == "backward":
            if h.requires_grad and ({"grad_sq_mean", "down_in_grad_cov_pooled"} & self.names):
                h.register_hook(lambda g, e=e: self._on_grad_h(e, g))
            self._count("grad_tokens", e, n)
            return
        if self.mode != "stats":
            return
        self._count("routed", e, n)
        if self._attr is not None and self._off < self._attr["n"]:
            self._trace_expert(tok, slot, y)
        if "act_sq_mean" in self.names:
            self._add("act_sq_mean", (h.detach().float() ** 2).sum(0), e)
        if "expert_in_sq_mean" in self.names:
            assert self._x is not None
            self._add("expert_in_sq_mean", (self._x[tok].detach().float() ** 2).sum(0), e)
        if "expert_in_cov" in self.names:
            assert self._x is not None
            xe = self._x[tok].detach().float()
            self._add("expert_in_cov", xe.T @ xe, e)
        if {"expert_out_norm_mean", "reap_saliency"} & self.names:
            norms = y.detach().float().norm(dim=-1)
            self._add("expert_out_norm_mean", norms.sum(), e)
            assert self._weights is not None
            self._add("reap_saliency", (norms * self._weights[tok, slot]).sum(), e)
        if {"down_out_absmax", "down_out_argmax"} & self.names:
            self._absmax_update("down_out", e, self.layer.experts.num_experts, y)
        if "down_in_cov" in self.names or "down_in_cov_pooled" in self.names:
            hf = h.detach().float()
            c = hf.T @ hf
            if "down_in_cov" in self.names:
                self._add("down_in_cov", c, e)
            if "down_in_cov_pooled" in self.names:
                self._pool_add("down_in_cov_pooled", e, c)

    def on_shared(self, h: torch.Tensor, y: torch.Tensor) -> None:
        if self.mode == "stats" and {"shared_down_out_absmax", "shared_down_out_argmax"} & self.names:
            self._absmax_update("shared_down_out", 0, 1, y)

    def _pool_add(self, name: str, e: int, c: torch.Tensor) -> None:
        """Expert ``e``'s term ``c`` of a :data:`POOLED_BY_BLOCK` sum, into the batch's partial of its block."""
        k = e // fold_block_size(self.layer.experts.num_experts)
        held = self._pool.get(name)
        if held is not None and held[0] == k:
            held[1].add_(c.detach().double())
            return
        if held is not None:
            self._add(name, held[1], held[0])
        self._pool[name] = (k, c.detach().double())

    def end_terms(self) -> None:
        """A batch's terms of a chunk of experts are all seen (the streamed backward, whose gradient hooks fire
        expert by expert: ``moe_backward.chunk_terms``): their partials of the :data:`POOLED_BY_BLOCK` sums are
        added to the blocks' rows."""
        self._flush_pool()

    def _flush_pool(self) -> None:
        """The batch's partials of the current blocks into the layer's sums' block rows: one addition per
        batch and block (a chunk visits a batch's part of a block once; chunks that are unions of blocks
        give the whole layer's additions)."""
        for name, (k, v) in self._pool.items():
            self._add(name, v, k)
        self._pool = {}

    def pooled_rows(self, a: int, b: int) -> tuple[int, int]:
        """The rows ``[ka, kb)`` of the :data:`POOLED_BY_BLOCK` sums that experts ``[a, b)`` fill: the blocks
        that start in the range (the range a union of blocks)."""
        starts = [s for s, _ in fold_blocks(self.layer.experts.num_experts)]
        inside = [k for k, s in enumerate(starts) if a <= s < b]
        return (inside[0], inside[-1] + 1) if inside else (0, 0)

    def on_output(self, out: torch.Tensor) -> None:
        self._flush_pool()
        if self.mode == "stats" and self._attr is not None and self._off < self._attr["n"]:
            self._attr["y"].append(out.detach()[: self._attr["n"] - self._off].float().cpu().clone())
        if self.mode == "stats" and "io_sample" in self.names:
            self._keep("io_sample_y", out)
        elif self.mode == "backward" and out.requires_grad and "out_grad_cov" in self.names:
            out.register_hook(self._on_grad_out)

    # -- expert-chunked calibration (calibration/chunked.py) -----------------------------------
    def batch_state(self) -> tuple:
        """What :meth:`on_input` and :meth:`on_route` set for the batch just seen (its token offset, ids
        and weights): the chunked forward visits every batch once per chunk of experts."""
        return self._off, self._ids, self._weights

    def resume_batch(self, state: tuple, x: torch.Tensor) -> None:
        """Return to a batch of :meth:`batch_state` whose MoE input is ``x`` (no statistic is added; the
        partials of the batch left are added)."""
        self._flush_pool()
        self._off, self._ids, self._weights = state
        self._x = x

    def sample_chunk(self, first: int, bank) -> None:
        """Experts ``first, first + 1, …`` (a chunk, ``bank``) on the Ward tokens, kept for
        ``expert_out_gram`` (forward) or ``expert_out_gram_fisher`` (backward, every batch's gradient given
        first, :meth:`on_output_grad`): :class:`~moecompress.calibration.grams.WardOutputs`."""
        backward = self.mode == "backward"
        xs = self._io["gram_x" if backward else "io_sample_x"]
        grad_tokens = min(self.sample_tokens, self._n_grad_tokens)
        self._ward.sample(first, bank, backward, torch.cat(xs) if xs else None, grad_tokens)

    def on_output_grad(self, g: torch.Tensor) -> None:
        """The gradient ``g`` w.r.t. the MoE output of one batch (what the hook of :meth:`on_output` sees
        in the whole-layer backward)."""
        if self.mode == "backward" and "out_grad_cov" in self.names:
            self._on_grad_out(g)

    # -- route_attrib (calibration/trace.py) ------------------------------------------------------
    def _trace_input(self, x: torch.Tensor) -> None:
        if self._attr is None:
            from moecompress.methods.attribution import ATTRIB_TOKENS

            k, h = self.layer.router.top_k, x.shape[-1]
            self._attr = {"n": ATTRIB_TOKENS, "x": [], "y": [], "ids": [],
                          "contrib": torch.zeros(ATTRIB_TOKENS, k, h)}  # fmt: skip
        if self._off < self._attr["n"]:
            self._attr["x"].append(x.detach()[: self._attr["n"] - self._off].float().cpu().clone())

    def _trace_expert(self, tok: torch.Tensor, slot: torch.Tensor, y: torch.Tensor) -> None:
        g = tok + self._off
        keep = g < self._attr["n"]  # type: ignore[index]
        if bool(keep.any()):
            assert self._weights is not None
            w = self._weights[tok[keep], slot[keep]].float()[:, None]
            part = (w * y.detach().float()[keep]).cpu()
            self._attr["contrib"][g[keep].cpu(), slot[keep].cpu()] += part  # type: ignore[index]

    def attribution_sample(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x [n, H], y [n, H], w·y per slot [n, k, H], logical ids [n, k])`` of the traced tokens."""
        a = self._attr
        if a is None or not a["x"]:
            raise CheckpointError(f"layer {self.layer.index}: no calibration tokens reached the routing trace")
        x, y, ids = torch.cat(a["x"]), torch.cat(a["y"]), torch.cat(a["ids"])
        return x, y, a["contrib"][: len(x)], ids

    def set_attribution(self, tensors: dict[str, torch.Tensor]) -> None:
        self._attribution = {k: v.float() for k, v in tensors.items()}

    def _on_grad_h(self, e: int, g: torch.Tensor) -> None:
        gf = g.detach().float()
        if "grad_sq_mean" in self.names:
            self._add("grad_sq_mean", (gf**2).sum(0), e)
        if "down_in_grad_cov_pooled" in self.names:
            self._pool_add("down_in_grad_cov_pooled", e, gf.T @ gf)

    def _on_grad_out(self, g: torch.Tensor) -> None:
        gf = g.detach().float().reshape(-1, g.shape[-1])
        self._n_grad_tokens += gf.shape[0]
        self._add("out_grad_cov", gf.T @ gf)

    def spill(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """The finished :data:`SPILLED` means of experts ``[a, b)`` (float32 ``[b - a, ...]`` on the host,
        bit for bit rows ``a..b`` of what :meth:`result` gives whole), released here. Call it once the
        chunk-outer sweep of those experts is done: their sums and ``routed`` counts are final."""
        if not self._spill:
            raise ValueError("spill() needs a collector made with spill=True")
        routed = self._counts.get("routed", torch.zeros(self.layer.experts.num_experts, dtype=torch.float64))
        out = {}
        for name in SPILLED:
            if name not in self.names:
                continue
            apart = self._apart.get(name, {})
            n = self.layer.hidden_size if name == "expert_in_cov" else self.layer.experts.width
            rows = out[name] = torch.zeros(b - a, n, n)  # filled in place: the float64 sums go as it grows
            for e in range(a, b):
                s = apart.pop(e, None)
                if s is not None:  # else no token reached it: the zero rows of the [E, ...] sums
                    rows[e - a] = (s / routed[e].clamp_min(1).to(s.device)).float().cpu()
                del s
        return out

    # -- results ---------------------------------------------------------------------------------
    def result(self) -> dict[str, torch.Tensor]:
        """Means as float32 tensors, ready to save as safetensors."""
        if self._pool:  # a forward that ended without on_output (a bare moe_forward): its last batch's terms
            self._flush_pool()
        out: dict[str, torch.Tensor] = {}
        t = max(self._n_tokens, 1)
        routed = self._counts.get("routed", torch.zeros(self.layer.experts.num_experts, dtype=torch.float64))
        per_expert = routed.clamp_min(1)
        grad_routed = self._counts.get("grad_tokens", routed).clamp_min(1)
        for name, s in self._sums.items():
            if name in ("router_prob_mean", "router_entropy", "input_cov"):
                v = s / t
            elif name == "expert_counts":
                v = s
            elif name in ("act_sq_mean", "expert_in_sq_mean", "expert_out_norm_mean", "reap_saliency"):
                v = s / per_expert.to(s.device).view(-1, *([1] * (s.dim() - 1)))  # counts live on the host
            elif name in ("down_in_cov", "expert_in_cov"):  # expert by expert: no [E, n, n] float64 temporary
                v = torch.empty(s.shape, dtype=torch.float32)
                for e in range(s.shape[0]):
                    v[e] = (s[e] / per_expert[e].to(s.device)).float().cpu()
            elif name == "down_in_cov_pooled":
                v = pooled_total(s) / max(float(routed.sum()), 1.0)
            elif name == "grad_sq_mean":
                v = s / grad_routed.to(s.device).view(-1, 1)
            elif name == "down_in_grad_cov_pooled":
                v = pooled_total(s) / max(float(grad_routed.sum()), 1.0)
            elif name == "out_grad_cov":
                v = s / max(self._n_grad_tokens, 1)
            else:  # pragma: no cover - every accumulated name is listed above
                raise KeyError(name)
            if name in self.names:
                out[name] = v.float().cpu()
        for key, (best, chan) in self._absmax.items():
            out[f"{key}_absmax"], out[f"{key}_argmax"] = best.cpu().clone(), chan.cpu().clone()
        for key, parts in self._io.items():
            if parts and key != "gram_x":
                out[key] = torch.cat(parts)
        gram_x = torch.cat(self._io["gram_x"]) if self._io["gram_x"] else None
        out.update(self._ward.grams(out, gram_x, min(self.sample_tokens, self._n_grad_tokens)))
        if "route_attrib" in self.names:
            out.update(self._attribution)
        if math.isnan(float(out.get("router_entropy", torch.tensor(0.0)))):
            raise CheckpointError(
                f"layer {self.layer.index}: NaN in the router statistics (its inputs or router weights are not "
                "finite); the checkpoint is damaged, or calibration.dtype overflows: try float32"
            )
        return out
