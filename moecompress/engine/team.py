"""The units of one MoE layer worked at the same time, one per rank, by a step that needs every expert's
result at each of its iterations (``Chunking.team``: ``codequant``'s fine-tuning against the block's
output). Unit ``k`` is rank ``k``'s (:func:`moecompress.engine.units.unit_size` makes ``N`` units of the
layer, :func:`moecompress.engine.shard.layer_chunks` gives rank 0 its default share of one); each unit's step
reads :class:`Team` as ``stats.team`` and exchanges tensors through it. The method's maths lives apart
from the engine (:class:`moecompress.methods.codebook_team.Exchange`): it sees only :meth:`Team.gather`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import save

from moecompress.engine.distributed import Ranks
from moecompress.io.shard_format import load_buffer


@dataclass(frozen=True)
class Team:
    """Every rank's unit of one layer. :meth:`gather` is a collective: every rank's step calls it the same
    number of times, in the same order (a step decides from gathered values only)."""

    ranks: Ranks

    def gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's ``tensors``, in rank order (unit order): this rank's as given, the others' through the
        host (safetensors bytes), on the device of this rank's first tensor."""
        dev = tensors[0].device if tensors else torch.device("cpu")
        blob = save({str(i): t.detach().contiguous().cpu() for i, t in enumerate(tensors)})
        out = []
        for r, buf in enumerate(self.ranks.all_gather_buffers(blob)):
            if r == self.ranks.rank:
                out.append(list(tensors))
                continue
            got = load_buffer(buf)
            out.append([got[str(i)].to(dev) for i in range(len(got))])
        return out
