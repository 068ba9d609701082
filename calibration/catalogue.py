"""The statistics catalogue: every statistic a pass may declare in its ``needs``.

Notation: ``x`` MoE input ``[T, H]``, ``h`` the down-projection input of an expert ``[n, I]`` (tokens
routed to it), ``y`` an expert's unweighted output ``[n, H]``, ``g`` the gradient of the LM loss (mean
token NLL over the calibration set). Forward statistics are means over the calibration (non-held-back)
tokens; backward statistics come from the streamed backward. Counts use logical router ids for routing
statistics and physical expert ids for expert internals (identical unless experts were merged).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StatInfo:
    kind: str  # "forward" | "backward"
    shape: str
    doc: str
    tensors: tuple[str, ...] = ()
    """The tensors the statistic is stored as, when not one tensor of its own name (companions)."""


CATALOGUE: dict[str, StatInfo] = {
    "expert_counts": StatInfo("forward", "[E]", "tokens routed to each expert"),
    "router_prob_mean": StatInfo("forward", "[E]", "mean over tokens of softmax(router logits)"),
    "router_entropy": StatInfo("forward", "[]", "mean per-token entropy (nats) of softmax(router logits)"),
    "expert_out_norm_mean": StatInfo("forward", "[E]", "mean over routed tokens of ||y||_2"),
    "reap_saliency": StatInfo("forward", "[E]", "mean over routed tokens of routing weight * ||y||_2 (REAP)"),
    "act_sq_mean": StatInfo("forward", "[E, I]", "mean over routed tokens of h^2, per neuron"),
    "expert_in_sq_mean": StatInfo("forward", "[E, H]", "mean over routed tokens of x^2, per input channel"),
    "down_out_absmax": StatInfo("forward", "[E]", "max |y| over routed tokens and channels"),
    "down_out_argmax": StatInfo("forward", "[E]", "channel of down_out_absmax"),
    "shared_down_out_absmax": StatInfo("forward", "[S]", "max |y| of the shared expert(s)"),
    "shared_down_out_argmax": StatInfo("forward", "[S]", "channel of shared_down_out_absmax"),
    "input_cov": StatInfo("forward", "[H, H]", "E[x x^T] over all tokens (uncentred)"),
    "expert_in_cov": StatInfo("forward", "[E, H, H]", "E[x x^T] per expert over its routed tokens (GPTQ)"),
    "down_in_cov": StatInfo("forward", "[E, I, I]", "E[h h^T] per expert over its routed tokens"),
    "down_in_cov_pooled": StatInfo("forward", "[I, I]", "E[h h^T] over all routed (token, expert) pairs"),
    "io_sample": StatInfo(
        "forward", "[N, H] x2", "first N calibration tokens' MoE inputs and outputs", ("io_sample_x", "io_sample_y")
    ),
    "router_sample": StatInfo("forward", "[N, E]", "the io_sample tokens' router logits (routing stability)"),
    "router_sample_base": StatInfo(
        "forward", "[N, E]", "the input checkpoint's router logits on its own MoE inputs for the io_sample tokens: "
        "router_sample, except under calibration.propagate: compressed (routing drift, router_robustness)",
    ),
    "expert_out_gram": StatInfo(
        "forward", "[E, E], [2]",
        "sum_t <E_i(x_t), E_j(x_t)> (float64) over the merging passes' Ward tokens, the first min(64, ceil(N/2)) "
        "io_sample tokens, every expert on every token; expert_out_gram_route: (those tokens, mean_t sum_k w_tk^2)",
        ("expert_out_gram", "expert_out_gram_route"),
    ),
    "route_attrib": StatInfo(
        "forward", "[C] x5, [P, E] x3, [] x2",
        "router-logit attribution over the residual stream on the first ATTRIB_TOKENS calibration tokens "
        "(moecompress.methods.attribution): per component (embeddings, each earlier attention / MoE / dense "
        "layer output, this layer's attention) influence, mean positive / negative / selected sub-score and "
        "AARV; per earlier MoE layer and expert the summed influence, AARV and count; the sum check",
        ("route_attrib_influence", "route_attrib_aps", "route_attrib_ans", "route_attrib_selected",
         "route_attrib_aarv", "route_attrib_hub_influence", "route_attrib_hub_aarv", "route_attrib_hub_count",
         "route_attrib_sum_error", "route_attrib_norm_fit_error"),
    ),
    "moe_inputs": StatInfo(
        "forward", "[T, H]", "every calibration (non-held-back) token's MoE input: a layer an earlier step "
        "changed is replayed on them for the forward statistics of later steps (moecompress.engine.follow)",
    ),
    "holdout": StatInfo("forward", "[N, H]", "the held-back tokens' MoE inputs (reconstruction errors)", ("holdout_x",)),
    "grad_sq_mean": StatInfo("backward", "[E, I]", "mean over routed tokens of (dl/dh)^2, per neuron"),
    "out_grad_cov": StatInfo("backward", "[H, H]", "E[g g^T], g = dl/d(MoE output), over all tokens"),
    "down_in_grad_cov_pooled": StatInfo("backward", "[I, I]", "E[g_h g_h^T] over routed pairs, g_h = dl/dh"),
    "expert_out_gram_fisher": StatInfo(
        "backward", "[E, E]", "expert_out_gram with G = out_grad_cov: sum_t <G^1/2 E_i(x_t), G^1/2 E_j(x_t)> (float64)"
    ),
}
"""Every statistic a pass may declare in ``needs``. ``io_sample`` is stored as ``io_sample_x`` and
``io_sample_y``, ``holdout`` as ``holdout_x``; every other statistic as one tensor of its own name."""

ALWAYS = frozenset({"expert_counts", "router_prob_mean", "router_entropy", "holdout"})
"""Collected in every run (cheap; used by reports, reconstruction errors and the no-token warnings). A
step still receives only what it declares."""


def tensor_names(needs: Iterable[str]) -> frozenset[str]:
    """The stored tensor names of the statistics ``needs`` (companions included)."""
    out: set[str] = set()
    for name in needs:
        info = CATALOGUE.get(name)
        out.update(info.tensors if info is not None and info.tensors else (name,))
    return frozenset(out)


def backward_needed(names: set[str] | frozenset[str]) -> bool:
    return any(CATALOGUE[n].kind == "backward" for n in names)
