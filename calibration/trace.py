"""The residual-stream trace behind the ``route_attrib`` statistic (routing attribution).

During the forward sweep, for the first :data:`~moecompress.methods.attribution.ATTRIB_TOKENS` tokens
of the non-held-back batches, the trace keeps the residual-stream components written so far — the
embeddings (layer 0's input), each decoder layer's attention output ``a^c = z^c − h^c`` and MoE output
``m^c`` (dense layers: their whole update ``h^{c+1} − h^c``, attention and MLP together) — and each MoE
layer's per-(token, slot) expert contributions ``w·y``. At MoE layer ℓ it hands the collector the
attribution statistics of :mod:`moecompress.methods.attribution` computed with that layer's router, so
only ``[C]`` and ``[P, E]`` tensors reach the cache. Memory: :func:`~moecompress.methods.attribution.
trace_bytes` (counted by the dry run's calibration estimate).
"""

from __future__ import annotations

import torch

from moecompress.methods.attribution import (
    ATTRIB_TOKENS,
    component_stats,
    expert_pull,
    norm_scale,
    sub_scores,
)


def first_tokens(hidden: list, holdout: list[bool], n: int) -> torch.Tensor:
    """The first ``n`` tokens ``[n, H]`` (float32) of the non-held-back batches, in the collector's order."""
    out, have = [], 0
    for h, held in zip(hidden, holdout):
        if held or have >= n:
            continue
        t = (h if isinstance(h, torch.Tensor) else h[0]).detach().float()
        t = t.reshape(-1, t.shape[-1])[: n - have]
        out.append(t)
        have += t.shape[0]
    return torch.cat(out)


class RoutingTrace:
    """Residual components and expert contributions of the traced tokens, layer after layer."""

    def __init__(self, tokens: int = ATTRIB_TOKENS) -> None:
        self.tokens = tokens
        self.parts: list[torch.Tensor] = []
        self.moe: list[tuple[torch.Tensor, torch.Tensor]] = []  # (contrib [T, k, H], ids [T, k])

    def after_layer(self, i: int, hidden: list, outs: list, holdout: list[bool], col) -> None:
        """Record decoder layer ``i`` (its inputs ``hidden``, outputs ``outs``); for an MoE layer (``col``
        its collector, which kept the same tokens' MoE input, output and contributions) compute and hand
        over the attribution statistics first."""
        h_in = first_tokens(hidden, holdout, self.tokens)
        h_out = first_tokens(outs, holdout, self.tokens)
        if not self.parts:
            self.parts.append(h_in)
        if col is None:
            self.parts.append(h_out - h_in)
            return
        x, y, contrib, ids = col.attribution_sample()
        n = min(len(x), len(h_in))
        h_in, h_out, x, y, contrib, ids = h_in[:n], h_out[:n], x[:n], y[:n], contrib[:n], ids[:n]
        z = h_out - y  # residual before the MoE block's norm
        parts = torch.stack([p[:n] for p in self.parts] + [z - h_in])
        gamma, u, fit = norm_scale(x, z)
        layer = col.layer
        w = layer.router_weight.float()
        sub = sub_scores(parts, gamma, u, w)
        if layer.router_bias is not None:
            sub = torch.cat([sub, layer.router_bias.double().expand(1, n, -1)])
        logits = x.double() @ w.double().T + (0 if layer.router_bias is None else layer.router_bias.double())
        choice = logits if layer.score_bias is None else logits + layer.score_bias.double()
        k = layer.router.top_k
        stats = component_stats(sub, choice, k)
        err = float((sub.sum(0) - logits).norm() / logits.norm().clamp_min(1e-300))
        e = layer.router.num_experts
        width = max([e] + [int(c[1].max()) + 1 for c in self.moe if c[1].numel()])
        hub = torch.zeros(3, len(self.moe), width, dtype=torch.float64)
        for p, (c, cid) in enumerate(self.moe):
            for j, v in enumerate(expert_pull(c[:n], cid[:n], gamma, u, w, choice, k, width)):
                hub[j, p] = v
        col.set_attribution(
            {**{f"route_attrib_{key}": v for key, v in stats.items()}, "route_attrib_hub_influence": hub[0],
             "route_attrib_hub_aarv": hub[1], "route_attrib_hub_count": hub[2],
             "route_attrib_sum_error": torch.tensor(err), "route_attrib_norm_fit_error": torch.tensor(fit)}
        )  # fmt: skip
        self.parts += [z - h_in, y]
        self.moe.append((contrib, ids))
