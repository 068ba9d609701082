"""Oracle for calibration statistics: the streamed executor equals a full in-memory forward/backward.

The streamed side materialises one decoder layer at a time from the shards (meta skeleton, catcher,
instrumented MoE block) and runs the streamed backward. The oracle loads the whole model with
transformers, swaps each MoE block *instance* for the same instrumented block (transformers has no
per-expert modules to hook) and runs one forward and one full ``loss.backward()``. MoE inputs are
also checked against plain forward hooks on the unmodified transformers blocks.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny import save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.calibration.skeleton import InstrumentedMoE, Skeleton
from moecompress.calibration.stats import StatsCollector
from moecompress.calibration.sweep import Batches, run_calibration
from moecompress.reference import route

NEEDS = {
    "act_sq_mean", "expert_in_sq_mean", "expert_in_cov", "input_cov", "expert_counts", "router_prob_mean", "router_entropy", "reap_saliency",
    "expert_out_norm_mean", "down_out_absmax", "down_out_argmax", "down_in_cov", "down_in_cov_pooled",
    "io_sample", "grad_sq_mean", "out_grad_cov", "down_in_grad_cov_pooled",
}  # fmt: skip
HOLDOUT = 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _tol(ckpt, layer: int, tokens: int) -> float:
    """Tolerance for fp32 results of two forwards that block their reductions differently (batches of 2
    vs all sequences at once; AVX2 vs AVX-512 kernels): rounding of a length-K reduction grows like
    eps·sqrt(K), K the largest reduction (hidden, expert width or token count), once per decoder layer
    the value has passed through (+1 for the statistic's own means), with a safety factor of 16."""
    cfg = ckpt.raw_config
    k = max(cfg["hidden_size"], cfg.get("intermediate_size", 0), cfg.get("moe_intermediate_size", 0), tokens)
    return 16 * torch.finfo(torch.float32).eps * math.sqrt(k) * (layer + 2)


def _oracle(path, ckpt, ids):
    full = AutoModelForCausalLM.from_pretrained(path).eval()
    adapter = ckpt.adapter
    hooked = {}
    handles = [
        getattr(full.model.layers[i], adapter.module_attr).register_forward_pre_hook(
            lambda m, args, i=i: hooked.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]).clone())
        )
        for i in ckpt.moe_layer_indices
    ]
    with torch.no_grad():
        full(ids)
    for h in handles:
        h.remove()
    fwd, blocks = {}, {}
    for i in ckpt.moe_layer_indices:
        fwd[i] = StatsCollector(ckpt.read_layer(i), NEEDS)
        blocks[i] = InstrumentedMoE(ckpt.read_layer(i), fwd[i], adapter.module_returns_tuple)
        setattr(full.model.layers[i], adapter.module_attr, blocks[i])
    with torch.no_grad():
        full(ids)
    bwd = {}
    for i in ckpt.moe_layer_indices:
        bwd[i] = StatsCollector(ckpt.read_layer(i), NEEDS)
        bwd[i].mode = "backward"
        blocks[i].observer = bwd[i]
    out = full(ids, labels=ids)
    out.loss.backward()
    return (
        hooked,
        {i: c.result() for i, c in fwd.items()},
        {i: c.result() for i, c in bwd.items()},
        float(out.loss.detach()),
    )


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"])
def test_streamed_statistics_equal_in_memory_oracle(tmp_path, model_type):
    save_tiny(model_type, tmp_path / "c")
    ckpt = mc.open_checkpoint(tmp_path / "c")
    ids = torch.randint(3, 128, (7, 12), generator=torch.Generator().manual_seed(0))
    fwd, bwd = {}, {}
    summary = run_calibration(
        Skeleton(ckpt, torch.float32),
        Batches.make(ids, holdout=HOLDOUT, batch_size=2),
        NEEDS,
        save_forward=fwd.__setitem__,
        save_backward=bwd.__setitem__,
        progress=False,
    )
    stats_ids = ids[: len(ids) - HOLDOUT]
    hooked, ref_fwd, ref_bwd, ref_loss = _oracle(tmp_path / "c", ckpt, stats_ids)
    assert summary["loss"] == pytest.approx(ref_loss, rel=1e-5)
    for i in ckpt.moe_layer_indices:
        tol = _tol(ckpt, i, stats_ids.numel())
        x = hooked[i]  # plain hooks on transformers' own MoE block
        assert _rel(fwd[i]["input_cov"], x.T @ x / x.shape[0]) <= tol
        assert _rel(fwd[i]["io_sample_x"], x[: len(fwd[i]["io_sample_x"])]) <= tol
        # expert_in_cov by brute force: E[x xᵀ] over the tokens the router sends to each expert
        layer = ckpt.read_layer(i)
        ids_e, _ = route(layer, x)
        for e in range(layer.experts.num_experts):
            xs = x[(ids_e == e).any(1)]
            want = xs.T @ xs / max(len(xs), 1)
            assert _rel(fwd[i]["expert_in_cov"][e], want) <= tol if len(xs) else not fwd[i]["expert_in_cov"][e].any()
        diag = torch.diagonal(fwd[i]["expert_in_cov"], dim1=1, dim2=2)
        assert _rel(diag, fwd[i]["expert_in_sq_mean"]) <= tol
        assert set(ref_fwd[i]) - {"holdout_x"} <= set(fwd[i])
        for name, want in ref_fwd[i].items():
            if name == "holdout_x":
                continue
            if name == "down_out_argmax":
                assert torch.equal(fwd[i][name], want), (model_type, i, name)
            else:
                assert _rel(fwd[i][name], want) <= tol, (model_type, i, name, _rel(fwd[i][name], want))
        assert sorted(bwd[i]) == ["down_in_grad_cov_pooled", "grad_sq_mean", "out_grad_cov"]
        for name, want in ref_bwd[i].items():
            assert _rel(bwd[i][name], want) <= tol, (model_type, i, name, _rel(bwd[i][name], want))
        assert float(bwd[i]["grad_sq_mean"].abs().sum()) > 0
        # held-back sequences feed the reconstruction sample, never the statistics
        assert int(fwd[i]["expert_counts"].sum()) == stats_ids.numel() * ckpt.adapter.router_spec().top_k
        assert fwd[i]["holdout_x"].shape[0] == min(512, HOLDOUT * ids.shape[1])


def test_offloaded_layer_inputs_give_the_same_gradients(tmp_path):
    save_tiny("qwen2_moe", tmp_path / "c")
    ckpt = mc.open_checkpoint(tmp_path / "c")
    ids = torch.randint(3, 128, (4, 10), generator=torch.Generator().manual_seed(1))
    results = []
    for offload in ("ram", "disk"):
        bwd: dict = {}
        run_calibration(
            Skeleton(ckpt, torch.float32), Batches.make(ids, 1, 2), {"grad_sq_mean"}, offload=offload,
            save_forward=lambda i, s: None, save_backward=bwd.__setitem__, progress=False,
        )  # fmt: skip
        results.append(bwd)
    for i in ckpt.moe_layer_indices:
        assert torch.equal(results[0][i]["grad_sq_mean"], results[1][i]["grad_sq_mean"])
