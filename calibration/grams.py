"""``expert_out_gram`` and ``expert_out_gram_fisher`` of one layer (:class:`WardOutputs`): every expert's
outputs on the Ward tokens (the first ``min(64, ⌈N/2⌉)`` sampled tokens), their Gram made once the layer's
sweep is complete. A layer held whole computes them from its experts at the end; a layer calibrated by
chunks of experts (``calibration/chunked.py``) keeps each chunk's outputs as the chunk passes
(:meth:`WardOutputs.sample`) and makes the Gram from them by the same blocks and additions: the same bits.
"""

from __future__ import annotations

import torch

from moecompress.errors import CheckpointError
from moecompress.ir import ExpertBank, MoELayer
from moecompress.methods.mixture import (
    expert_output_gram,
    fit_tokens,
    gram_of_outputs,
    route_energy,
    sample_outputs,
)

FORWARD, FISHER = "expert_out_gram", "expert_out_gram_fisher"


class WardOutputs:
    """The Gram statistics a collector (:class:`~moecompress.calibration.stats.StatsCollector`) owes."""

    def __init__(self, layer: MoELayer, names: set[str]) -> None:
        self.layer, self.names = layer, names
        self._sampled: dict[str, torch.Tensor] = {}
        """a chunked layer's ``[E, T, H]`` outputs, filled chunk by chunk"""

    def sample(self, first: int, bank: ExpertBank, backward: bool, xs: torch.Tensor | None, grad_tokens: int) -> None:
        """Experts ``first …`` of a chunk (``bank``) on the Ward tokens of ``xs`` (forward: the
        ``io_sample`` tokens, all seen; backward: the backward's MoE inputs, ``grad_tokens`` counted)."""
        name = FISHER if backward else FORWARD
        if name not in self.names or xs is None:
            return
        n = fit_tokens(grad_tokens if backward else len(xs))
        dev = next(iter(bank.gate.tensors().values())).device
        part = sample_outputs(bank, xs[:n].to(dev)).cpu()
        if name not in self._sampled:
            self._sampled[name] = part.new_zeros(self.layer.experts.num_experts, *part.shape[1:])
        self._sampled[name][first : first + bank.num_experts] = part

    def rows(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """The sampled outputs of experts ``[a, b)`` (a chunk another rank ran), by statistic."""
        return {name: v[a:b].clone() for name, v in self._sampled.items()}

    def put_rows(self, a: int, b: int, name: str, rows: torch.Tensor) -> None:
        """Take another rank's :meth:`rows` of experts ``[a, b)`` for ``name``: copied, the same bits."""
        if name not in self._sampled:
            self._sampled[name] = rows.new_zeros(self.layer.experts.num_experts, *rows.shape[1:])
        self._sampled[name][a:b] = rows

    def grams(self, out: dict[str, torch.Tensor], gram_x: torch.Tensor | None, grad_tokens: int) -> dict[str, torch.Tensor]:
        """``expert_out_gram`` (forward: from ``out``'s ``io_sample_x``) and ``expert_out_gram_fisher``
        (backward: from the same tokens' MoE inputs seen again, ``gram_x``, and this sweep's
        ``out_grad_cov``), computed once the layer's sweep is complete, from the sample alone: a
        data-parallel merge, which rebuilds the sample bit for bit, gives the bits of one process."""
        grams: dict[str, torch.Tensor] = {}
        sampled, self._sampled = self._sampled, {}
        if FORWARD in self.names and "io_sample_x" in out:
            xs = out["io_sample_x"][: fit_tokens(len(out["io_sample_x"]))]
            grams[FORWARD] = gram_of_outputs(sampled[FORWARD]) if FORWARD in sampled else expert_output_gram(self._dense(), xs)
            info = [float(len(xs)), route_energy(self.layer, xs)]
            grams["expert_out_gram_route"] = torch.tensor(info, dtype=torch.float64)
        if FISHER in self.names and gram_x is not None and "out_grad_cov" in out:
            cov = out["out_grad_cov"]
            if FISHER in sampled:
                grams[FISHER] = gram_of_outputs(sampled[FISHER], cov)
            else:
                grams[FISHER] = expert_output_gram(self._dense(), gram_x[: fit_tokens(grad_tokens)], cov)
        return grams

    def _dense(self) -> MoELayer:
        if any(t.device.type == "meta" for t in self.layer.experts.gate.tensors().values()):
            raise CheckpointError(
                f"layer {self.layer.index}: expert_out_gram needs every expert of the layer, but it is calibrated "
                "by chunks of experts and no chunk was sampled; set expert_chunk: off"
            )
        return self.layer
