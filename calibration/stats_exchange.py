"""Moving a statistics collector's sums between collectors: data-parallel rounds (one batch's contributions
per rank, added in batch order), expert-sharded rows (an expert's sums handed to the rank that keeps the
layer's statistics) and the backward's gradient sums.

:class:`CollectorExchange` is a base of :class:`~moecompress.calibration.stats.StatsCollector`; its methods
read and write that collector's sums, counts, maxima and kept samples.
"""

from __future__ import annotations

import torch
from safetensors.torch import load, save

from moecompress.errors import CheckpointError

PER_EXPERT = ("act_sq_mean", "expert_in_sq_mean", "expert_in_cov", "expert_out_norm_mean", "reap_saliency",
              "down_in_cov", "grad_sq_mean")  # fmt: skip
"""The sums with one row per expert (what :meth:`StatsCollector.expert_rows` moves between ranks)."""

BY_BLOCK = ("down_in_cov_pooled", "down_in_grad_cov_pooled")
"""``stats.POOLED_BY_BLOCK``: the sums with one row per block of experts (:func:`~moecompress.ir.fold_blocks`)."""


class CollectorExchange:
    """The exchange methods of :class:`~moecompress.calibration.stats.StatsCollector` (its base class)."""

    # -- data-parallel calibration (calibration/sweep.py) ---------------------------------------------
    def take_round(self) -> dict[str, torch.Tensor]:
        """This round's contributions (one batch) as CPU tensors, and a fresh start for the next round."""
        if self._attr is not None:  # pragma: no cover - refused before calibration starts
            raise CheckpointError("route_attrib is not collected data-parallel")
        self._flush_pool()  # the round's last partials of the sums pooled by blocks (a backward's hooks)
        out = {"n/tokens": torch.tensor(self._n_tokens), "n/grad_tokens": torch.tensor(self._n_grad_tokens)}
        out |= {f"s/{k}": v.cpu() for k, v in self._sums.items()}
        out |= {f"q/{k}": torch.stack(v).cpu() for k, v in (self._seq or {}).items()}
        out |= {f"c/{k}": v.clone() for k, v in self._counts.items()}
        out |= {f"io/{k}": torch.cat(v) for k, v in self._io.items() if v}
        for k, (best, chan) in self._absmax.items():
            out[f"ax/{k}"], out[f"ai/{k}"] = best.clone(), chan.clone()
        self._sums, self._counts, self._absmax = {}, {}, {}
        self._seq = {} if self._seq is not None else None
        self._io = {k: [] for k in self._io}
        self._n_tokens = self._n_grad_tokens = 0
        return out

    def add_round(self, part: dict[str, torch.Tensor]) -> None:
        """Add one batch's :meth:`take_round` as the single process would have added it, bit for bit:
        per-expert sums get one addition per batch, the unindexed ones each of theirs in order."""
        self._n_tokens += int(part["n/tokens"])
        self._n_grad_tokens += int(part["n/grad_tokens"])
        for key, v in part.items():
            kind, _, name = key.partition("/")
            if kind == "s":
                if name not in self._sums:
                    self._sums[name] = torch.zeros_like(v)
                self._sums[name] += v
            elif kind == "q":
                for one in v:
                    if name not in self._sums:
                        self._sums[name] = torch.zeros_like(one)
                    self._sums[name] += one
            elif kind == "c":
                if name not in self._counts:
                    self._counts[name] = torch.zeros_like(v)
                self._counts[name] += v
            elif kind == "io":
                self._keep(name, v)
            elif kind == "ax":
                if name not in self._absmax:
                    self._absmax[name] = (torch.zeros_like(v), torch.zeros_like(part[f"ai/{name}"]))
                best, chan = self._absmax[name]
                more = v > best
                best[more], chan[more] = v[more], part[f"ai/{name}"][more]

    # -- expert-sharded calibration (calibration/expert_sharded.py) -----------------------------------
    def expert_rows(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """Rows ``a..b`` of every per-expert sum, count and maximum, as CPU tensors: what the rank that ran
        experts ``[a, b)`` hands to the rank that keeps the layer's statistics (:meth:`put_expert_rows`).
        With ``spill``, the :data:`SPILLED` sums not yet handed out by :meth:`spill` come too (released here):
        that rank holds only its own experts' covariances. The rows of the sums pooled by blocks of experts
        (``stats.POOLED_BY_BLOCK``) of the blocks that start in ``[a, b)`` come too (``p/``), and the experts'
        outputs on the Ward tokens sampled for ``expert_out_gram`` (``w/``, ``grams.WardOutputs.rows``)."""
        self._flush_pool()
        out = {f"s/{k}": v[a:b].cpu().clone() for k, v in self._sums.items() if k in PER_EXPERT}
        ka, kb = self.pooled_rows(a, b)
        out |= {f"p/{k}": v[ka:kb].cpu().clone() for k, v in self._sums.items() if k in BY_BLOCK and kb > ka}
        out |= {f"w/{k}": v for k, v in self._ward.rows(a, b).items()}  # expert_out_gram's sampled outputs
        for name, apart in self._apart.items():  # spill=True: the float64 sums of the experts not handed out
            rows = [apart.pop(e, None) for e in range(a, b)]
            if any(r is not None for r in rows):
                like = next(r for r in rows if r is not None)
                out[f"s/{name}"] = torch.stack([torch.zeros_like(like) if r is None else r for r in rows]).cpu()
        out |= {f"c/{k}": v[a:b].clone() for k, v in self._counts.items()}
        if "down_out" in self._absmax:
            best, chan = self._absmax["down_out"]
            out["ax/down_out"], out["ai/down_out"] = best[a:b].clone(), chan[a:b].clone()
        return out

    def put_expert_rows(self, a: int, b: int, part: dict[str, torch.Tensor]) -> None:
        """Take another rank's :meth:`expert_rows` of experts ``[a, b)`` in place of this collector's own
        (which saw no token of those experts): the rows are copied, so they keep their bits."""
        e = self.layer.experts.num_experts
        ka, kb = self.pooled_rows(a, b)
        for key, v in part.items():
            kind, _, name = key.partition("/")
            if kind == "w":
                self._ward.put_rows(a, b, name, v)
            elif kind == "p":
                if name not in self._sums:
                    self._sums[name] = torch.zeros((self._n_experts(name), *v.shape[1:]), dtype=v.dtype)
                self._sums[name][ka:kb] = v.to(self._sums[name].device)
            elif kind == "s":
                if name not in self._sums:
                    self._sums[name] = torch.zeros((e, *v.shape[1:]), dtype=v.dtype)
                self._sums[name][a:b] = v.to(self._sums[name].device)
            elif kind == "c":
                if name not in self._counts:
                    self._counts[name] = torch.zeros(e, dtype=v.dtype)
                self._counts[name][a:b] = v
            elif kind == "ax":
                if name not in self._absmax:
                    self._absmax[name] = (torch.zeros(e), torch.zeros(e, dtype=torch.long))
                best, chan = self._absmax[name]
                best[a:b], chan[a:b] = v, part[f"ai/{name}"]

    def merge_backward(self, other: CollectorExchange) -> None:
        """Take the gradient sums of ``other`` (a backward-mode collector of the same layer)."""
        other._flush_pool()
        for name in ("grad_sq_mean", "out_grad_cov", "down_in_grad_cov_pooled"):
            if name in other._sums:
                self._sums[name] = other._sums[name]
        if "grad_tokens" in other._counts:
            self._counts["grad_tokens"] = other._counts["grad_tokens"]
        self._n_grad_tokens = other._n_grad_tokens


def merge_round(group, col: CollectorExchange, total: CollectorExchange) -> None:
    """One round of data-parallel calibration: every rank's batch contribution (``col``, made with
    ``rounds=True``), added into ``total`` in rank order (= batch order)."""
    for blob in group.all_gather_bytes(save(col.take_round())):
        total.add_round(load(blob))
