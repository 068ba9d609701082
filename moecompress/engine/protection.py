"""The protection contract: experts in ``MoELayer.protected`` (super experts) must come out of every
step bit-identical.

The executor calls :func:`protection_violations` after every step on every MoE layer and fails the step
with a :class:`~moecompress.errors.PassError` naming the expert when it is not empty. What counts, for
each protected logical expert ``e``:

- it stays protected;
- its router row (and router bias / selection bias entry) is unchanged;
- the physical expert it runs has bit-identical gate/up/down weights, biases and live width;
- no other logical expert is merged into it (it is never a member or target of a merge).

A step that removes whole experts renumbers the survivors; it reports, in ``info[RENUMBER_KEY]``, the
old logical id of every expert it kept, in the new order (new id ``j`` was old id ``kept[j]``), and each
protected expert is then compared with its new id (it must be among the kept ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moecompress.ir import MoELayer

PROJ = ("gate", "up", "down")
RENUMBER_KEY = "kept_experts"
"""Step ``info`` key of a renumbering: old logical ids of the kept experts, in the new order."""


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def protection_violations(before: MoELayer, after: MoELayer, kept: Sequence[int] | None = None) -> list[str]:
    """Human-readable violations of the contract by a step that turned ``before`` into ``after``;
    ``kept``: the step's renumbering (``info[RENUMBER_KEY]``), ``None`` when ids are unchanged."""
    out: list[str] = []
    if kept is not None and len(kept) != after.router.num_experts:
        return [f"the step reports {len(kept)} kept experts but its layer has {after.router.num_experts}"]
    new_id = None if kept is None else {int(old): new for new, old in enumerate(kept)}
    for e in sorted(before.protected):
        n = e if new_id is None else new_id.get(e)
        if n is None:
            out.append(f"protected expert {e} was removed")
            continue
        if n not in after.protected:
            out.append(f"expert {e} lost its protection")
            continue
        if n >= after.router.num_experts or not _same(before.router_weight[e], after.router_weight[n]):
            out.append(f"router row of protected expert {e} changed")
        for name in ("router_bias", "score_bias"):
            b, a = getattr(before, name), getattr(after, name)
            if (b is None) != (a is None) or (b is not None and not _same(b[e], a[n])):
                out.append(f"{name} of protected expert {e} changed")
        p0, p1 = before.physical(e), after.physical(n)
        for name in PROJ:
            if not _same(getattr(before.experts, name).expert(p0), getattr(after.experts, name).expert(p1)):
                out.append(f"{name} weights of protected expert {e} changed")
        for name, bias in before.experts.biases.items():
            kept = after.experts.biases.get(name)
            if kept is None or not _same(bias[p0], kept[p1]):
                out.append(f"{name} bias of protected expert {e} changed")
        if before.experts.width_of(p0) != after.experts.width_of(p1):
            out.append(f"live width of protected expert {e} changed")
        if after.expert_map is not None and int((after.expert_map == p1).sum()) > 1:
            out.append(f"other experts were merged into protected expert {e}")
    return out


class TopActivation:
    """An :class:`~moecompress.reference.Observer` recording the largest |expert output| (routed or
    shared, before routing weights): the massive activation super experts produce."""

    def __init__(self) -> None:
        self.value = 0.0

    def on_route(self, logits, ids, weights) -> None:
        return None

    def on_expert(self, e, tok, slot, h, y) -> None:
        self.value = max(self.value, float(y.detach().abs().max())) if y.numel() else self.value

    def on_shared(self, h, y) -> None:
        self.on_expert(0, None, None, h, y)


MASSIVE_RATIO_WARNING = 0.5
"""Below this ratio of the top massive activation (after / before), a step report warns."""
