"""Expert-chunked calibration (``calibration/chunked.py``) equals the whole-layer sweep.

Forward statistics, the propagated activations and the LM loss are bit-identical (the experts' partials
are added to the same accumulators in the same order); so are the gradient statistics where the whole
layer runs the same expert-by-expert backward (``calibration/moe_backward.py``). The sums pooled over
experts, and the gradient statistics below a layer whose whole-layer backward is autograd's (a recipe
needing ``expert_out_gram_fisher``), agree within a tolerance derived from the dtype and the reduction sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import MODEL_TYPES, save_tiny

import moecompress as mc
from moecompress.calibration.cache import chunk_key
from moecompress.calibration.chunked import RecordingMoE
from moecompress.calibration.skeleton import Skeleton
from moecompress.calibration.sweep import Batches, run_calibration
from moecompress.engine import resources
from moecompress.engine.dry_run import dry_run
from moecompress.errors import CheckpointError, RecipeError
from moecompress.reference import moe_forward

HEAPR = {"act_sq_mean", "grad_sq_mean", "expert_counts"}
REAP = {"expert_counts", "reap_saliency"}
ALWAYS = {"expert_counts", "router_prob_mean", "router_entropy", "holdout"}
MORE = {"input_cov", "expert_in_sq_mean", "down_in_cov", "down_in_cov_pooled", "down_out_absmax", "down_out_argmax",
        "io_sample", "out_grad_cov", "down_in_grad_cov_pooled", "expert_out_norm_mean", "expert_out_gram",
        "expert_out_gram_fisher"}  # fmt: skip
ADAPTERS = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe"]


def _ids(n: int = 6, t: int = 12) -> torch.Tensor:
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(0))


def _calibrate(ckpt, needs, chunks, dtype=torch.float32, holdout=2):
    fwd, bwd = {}, {}
    summary = run_calibration(
        Skeleton(ckpt, dtype), Batches.make(_ids(), holdout=holdout, batch_size=2), needs,
        save_forward=fwd.__setitem__, save_backward=bwd.__setitem__, progress=False, expert_chunks=chunks,
    )  # fmt: skip
    return fwd, bwd, summary


def _tol(ckpt, dtype: torch.dtype, depth: int) -> float:
    """Relative tolerance for sums of the same terms in another order: eps·sqrt(K), K the largest
    reduction (hidden, expert width, tokens), per decoder layer the value passed through, safety 16."""
    cfg = ckpt.raw_config
    k = max(cfg["hidden_size"], cfg.get("intermediate_size", 0), cfg.get("moe_intermediate_size", 0), 72)
    return 16 * torch.finfo(dtype).eps * math.sqrt(k) * (depth + 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(model_type: str):
        if model_type not in made:
            path = tmp_path_factory.mktemp(model_type) / "m"
            save_tiny(model_type, path)
            made[model_type] = mc.open_checkpoint(path)
        return made[model_type]

    return get


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_decoder_layer_adds_its_moe_output_last(tiny, model_type):
    """What the chunked sweep relies on: layer(x) == layer_with_recorder(x) + MoE(recorded input)."""
    ckpt = tiny(model_type)
    skel = Skeleton(ckpt, torch.float32)
    hidden, kwargs = skel.capture(_ids(2, 10))
    moe_layers = set(ckpt.moe_layer_indices)
    for i in range(len(skel.meta_layers)):
        args, kw = kwargs[i]
        layer = ckpt.read_layer(i) if i in moe_layers else None
        with torch.no_grad():
            want = skel.layer(i, layer)(hidden, *args, **kw)
            if layer is not None:
                rec = RecordingMoE(ckpt.adapter.module_returns_tuple)
                h1 = skel.layer(i, block=rec)(hidden, *args, **kw)
                u = rec.seen.reshape(-1, rec.seen.shape[-1])
                got = h1 + moe_forward(layer, u).reshape(h1.shape)
                assert torch.equal(got, want), (model_type, i, _rel(got, want))
        hidden = want


@pytest.mark.parametrize("model_type", ADAPTERS)
def test_chunked_statistics_equal_the_whole_layer(tiny, model_type):
    ckpt = tiny(model_type)
    needs = HEAPR | REAP | ALWAYS | MORE
    fwd0, bwd0, s0 = _calibrate(ckpt, needs, {})
    e = ckpt.adapter.num_experts
    moe = ckpt.moe_layer_indices
    for size in (1, 3, e - 1):
        fwd, bwd, s = _calibrate(ckpt, needs, dict.fromkeys(moe, size))
        assert s["loss"] == s0["loss"], (size, s["loss"], s0["loss"])
        for i in moe:
            assert fwd[i].keys() == fwd0[i].keys() and bwd[i].keys() == bwd0[i].keys()
            for k, want in fwd0[i].items():  # down_in_cov_pooled too: 8 experts, blocks of 1 (stats.POOLED_BY_BLOCK)
                assert torch.equal(fwd[i][k], want), (size, i, k, _rel(fwd[i][k], want))
            depth = sum(1 for j in moe if j > i)  # MoE layers the incoming gradient came through
            for k, want in bwd0[i].items():
                if depth == 0:  # down_in_grad_cov_pooled too: blocks of 1 (stats.POOLED_BY_BLOCK)
                    assert torch.equal(bwd[i][k], want), (size, i, k, _rel(bwd[i][k], want))
                assert _rel(bwd[i][k], want) <= _tol(ckpt, torch.float32, depth), (size, i, k, _rel(bwd[i][k], want))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_gradient_statistics_are_the_whole_layers_bits(tiny, model_type):
    """Without a statistic that keeps autograd's whole-layer backward, every gradient statistic of every
    layer (the gradient passed down through chunked layers included) is the whole layer's, bit for bit."""
    ckpt = tiny(model_type)
    needs = HEAPR | ALWAYS | {"out_grad_cov"}
    _, bwd0, s0 = _calibrate(ckpt, needs, {})
    for size in (1, 3):
        _, bwd, s = _calibrate(ckpt, needs, dict.fromkeys(ckpt.moe_layer_indices, size))
        assert s["loss"] == s0["loss"]
        for i in ckpt.moe_layer_indices:
            assert bwd[i].keys() == bwd0[i].keys()
            for k, want in bwd0[i].items():
                assert torch.equal(bwd[i][k], want), (size, i, k, _rel(bwd[i][k], want))


def test_chunks_mixed_with_whole_layers_and_bfloat16(tiny):
    """Only some layers chunked, compute dtype bfloat16: forward statistics still bit-identical."""
    ckpt = tiny("deepseek_v3")
    needs = HEAPR | REAP | ALWAYS
    first = ckpt.moe_layer_indices[0]
    fwd0, bwd0, s0 = _calibrate(ckpt, needs, {}, torch.bfloat16)
    fwd, bwd, s = _calibrate(ckpt, needs, {first: 3}, torch.bfloat16)
    assert s["loss"] == s0["loss"]
    for i in ckpt.moe_layer_indices:
        for k, want in fwd0[i].items():
            assert torch.equal(fwd[i][k], want), (i, k)
        for k, want in bwd0[i].items():
            assert _rel(bwd[i][k], want) <= _tol(ckpt, torch.bfloat16, 1), (i, k, _rel(bwd[i][k], want))


def test_route_attrib_with_chunks(tiny):
    ckpt = tiny("qwen3_moe")
    needs = {"route_attrib"} | ALWAYS
    fwd0, _, _ = _calibrate(ckpt, needs, {})
    fwd, _, _ = _calibrate(ckpt, needs, dict.fromkeys(ckpt.moe_layer_indices, 3))
    for i in ckpt.moe_layer_indices:
        assert any(k.startswith("route_attrib_") for k in fwd0[i])
        for k, want in fwd0[i].items():
            assert torch.equal(fwd[i][k], want), (i, k)


def test_chunked_layers_are_never_read_whole(tiny):
    ckpt = tiny("mixtral")
    moe = ckpt.moe_layer_indices
    whole, parts = [], []
    read_layer, read_experts = ckpt.read_layer, ckpt.read_experts
    ckpt.read_layer = lambda i: whole.append(i) or read_layer(i)  # instance spies
    ckpt.read_experts = lambda i, a, b, alloc=None: parts.append((i, a, b)) or read_experts(i, a, b, alloc)
    try:
        _calibrate(ckpt, HEAPR | ALWAYS, {moe[0]: 3})
    finally:
        del ckpt.read_layer, ckpt.read_experts
    assert moe[0] not in whole and set(whole) == set(moe[1:])
    e = ckpt.adapter.num_experts
    chunks = [(moe[0], a, min(a + 3, e)) for a in range(0, e, 3)]
    assert [p for p in parts if p[0] == moe[0]] == chunks + chunks  # once in the forward sweep, once in the backward
    # the other layers: read whole in the forward, as one chunk into the chunk buffer in the expert-by-expert backward
    assert sorted(p for p in parts if p[0] != moe[0]) == [(i, 0, e) for i in moe[1:]]


def test_damaged_expert_in_a_chunk_is_named(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    shard = next((tmp_path / "m").glob("*.safetensors"))
    tensors = load_file(shard)
    i = 0
    name = f"model.layers.{i}.mlp.experts.5.up_proj.weight"
    tensors[name][3, 4] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    ckpt = mc.open_checkpoint(tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"layer 0: expert 5 up_proj"):
        _calibrate(ckpt, REAP | ALWAYS, {0: 2})


def test_propagate_compressed_with_chunks_is_refused(tiny, tmp_path):
    ckpt = tiny("qwen3_moe")
    with pytest.raises(RecipeError, match=r"calibration\.propagate") as err:
        run_calibration(Skeleton(ckpt, torch.float32), Batches.make(_ids(), 0, 2), ALWAYS, save_forward=print,
                        save_backward=print, on_layer=lambda i, m, s: None, progress=False,
                        expert_chunks={ckpt.moe_layer_indices[0]: 2})  # fmt: skip
    assert "\n" not in str(err.value) and "expert_chunk" in str(err.value)
    rec = mc.load_recipe({"model": str(ckpt.path), "output": str(tmp_path / "o"), "steps": [{"rtn": {"bits": 4}}],
                          "calibration": {"source": "random", "samples": 4, "seq_len": 8, "propagate": "compressed"},
                          "expert_chunk": 2})  # fmt: skip
    with pytest.raises(RecipeError, match=r"calibration\.propagate"):
        resources.estimate(rec, ckpt, torch.float32, chunks={ckpt.moe_layer_indices[0]: 2})
    with pytest.raises(RecipeError, match=r"calibration\.propagate"):
        dry_run(rec, ckpt)


def test_cache_key_names_the_chunking_only_when_it_changes_bits():
    chunks = {1: 4, 2: 4}
    assert chunk_key(REAP | ALWAYS, chunks) == {}
    assert chunk_key(HEAPR | ALWAYS, {}) == {}
    assert chunk_key(HEAPR | ALWAYS, chunks) == {"expert_chunks": {"1": 4, "2": 4}}
    assert chunk_key({"down_in_cov_pooled"}, chunks) != {}


def test_estimate_counts_a_chunk_not_the_layer(tiny, tmp_path):
    ckpt = tiny("qwen3_moe")
    cal = {"source": "random", "samples": 8, "seq_len": 16}

    def est(chunk, steps):
        rec = mc.load_recipe({"model": str(ckpt.path), "output": str(tmp_path / "o"), "steps": steps,
                              "calibration": cal, "expert_chunk": chunk})  # fmt: skip
        chunks = {int(i): n for i, n in dry_run(rec, ckpt)["expert_chunk"].items()}
        return resources.estimate(rec, ckpt, torch.float32, chunks=chunks)

    for steps in ([{"heapr": {"ratio": 0.25}}], [{"expert_prune": {"ratio": 0.25}}]):
        whole, one, two = est("off", steps), est(1, steps), est(2, steps)
        assert one["calibration_layer_bytes"] < two["calibration_layer_bytes"] < whole["calibration_layer_bytes"]
        act = 8 * 16 * ckpt.raw_config["hidden_size"] * 4
        diff = whole["calibration_layer_bytes"] - one["calibration_layer_bytes"]
        # the chunk replaces the layer (plus the recorded MoE input and the fp32 accumulator), in the forward
        # sweep and in the backward's layer phase; the backward's head phase (logits) may then be the larger
        low = whole["calibration_memory_bytes"] - diff + 2 * act
        assert low <= one["calibration_memory_bytes"] < whole["calibration_memory_bytes"]
        if "expert_prune" in steps[0]:  # forward only: exactly the difference
            assert one["calibration_memory_bytes"] == low


def test_tied_head_reads_the_released_embeddings_again(tmp_path):
    """The sweep frees the input embeddings after capturing; a tied LM head reads them again."""
    from transformers import AutoModelForCausalLM

    save_tiny("qwen3_moe", tmp_path / "m", tie_word_embeddings=True)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    _, bwd, s = _calibrate(ckpt, HEAPR | ALWAYS, dict.fromkeys(ckpt.moe_layer_indices, 3), holdout=0)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()(_ids(), labels=_ids()).loss
    assert abs(s["loss"] - float(want)) <= 1e-5 * float(want)
    assert all(float(bwd[i]["grad_sq_mean"].abs().sum()) > 0 for i in ckpt.moe_layer_indices)
