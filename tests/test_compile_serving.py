"""A loaded compressed model under ``torch.compile`` (issue 40 item 4; docs/serving.md, "The fastest way
to serve a loaded model with transformers").

``torch.compile(model.forward, fullgraph=True)`` — the whole transformers forward in one graph, no graph
break — over a tiny Qwen3-MoE whose layers hold each layout family: dense/ragged-pruned (heapr),
merged/remapped (namex), quantised (rtn, codequant's codebooks with rotation and a protected expert),
factorised (tdmoe's Tucker, svd's low rank). Both compiled forms of ``CompressedExperts``:

- ``static``: the static-shape forward (:mod:`moecompress.runtime.static`) traced into the graph (no
  host sync, what CUDA graphs capture where no Triton kernel serves a layer);
- ``opaque``: the eager forward behind the custom op ``torch.ops.moecompress.experts`` (on CUDA, the
  Triton kernels).

Logits must equal the eager forward's within a tolerance of the dtype's rounding over the model's
sums, and ``generate(..., cache_implementation="static")`` with the compiled forward must give eager's
greedy tokens. Everything runs on the test device (CUDA where present). ``torch.compile`` on CPU needs
a C++ compiler; without one the tests skip.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.runtime.loading import prepare
from moecompress.runtime.quantizer import CompressedExperts

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEV.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
    pytest.skip(
        "torch.compile on CPU needs a C++ compiler (g++/clang++); none on PATH", allow_module_level=True
    )

STEPS = {
    "heapr-ragged": {"heapr": {"ratio": 0.4, "scope": "global"}},
    "namex-remap": {"namex": {"ratio": 0.5, "router": "remap", "refine_steps": 0}},
    "rtn-3": {"rtn": {"bits": 3, "group_size": 16, "symmetric": True}},
    "codequant-4": {"codequant": {"bits": 4, "finetune_steps": 0}},
    "tdmoe": {"tdmoe": {"ratio": 0.4}},
    "svd": {"svd_experts": {"ratio": 0.4}},
}
FAST = "heapr-ragged"  # the default lane compiles one layout; the others are slow (minutes on 2 cores)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    save_tiny("qwen3_moe", root / "m")
    return root


def _output(root, name):
    if not (root / name).is_dir():
        step = STEPS[name]
        mc.apply({
            "model": str(root / "m"),
            "output": str(root / name),
            "calibration": {"source": "random", "samples": 8, "seq_len": 16},
            "steps": [{"protect_super_experts": {}}, step] if name == "codequant-4" else [step],
        }, progress=False)  # fmt: skip
    return root / name


def tolerance(logits: torch.Tensor, model) -> float:
    """Relative: the dtype's rounding, grown with the square root of the sums a logit goes through."""
    cfg = model.config
    terms = cfg.num_hidden_layers * (cfg.hidden_size + cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    return 8 * torch.finfo(logits.dtype).eps * terms**0.5


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _check(root, name, mode):
    torch._dynamo.reset()
    model = mc.load(_output(root, name), device=DEV, static=mode == "static")
    blocks = [m for m in model.modules() if isinstance(m, CompressedExperts)]
    assert blocks, f"{name} loads as CompressedExperts"
    assert all((m._static is not None) == (mode == "static") for m in blocks)
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(model.forward, fullgraph=True)
    for shape in ((2, 11), (1, 1), (3, 1)):  # prefill, decode batch 1 (T·k <= E: per-slot path), batch 3
        ids = torch.randint(3, model.config.vocab_size, shape, generator=g).to(DEV)
        with torch.no_grad():
            want = model(ids).logits
            got = compiled(input_ids=ids).logits
        assert got.device == DEV
        err, tol = rel(got, want), tolerance(want, model)
        assert err <= tol, (
            f"{name}/{mode} {shape}: compiled logits differ from eager by {err:.2e} > {tol:.2e}"
        )
    return model


@pytest.mark.parametrize("mode", ["static", "opaque"])
def test_compiled_forward_equals_eager_fast(outputs, mode):
    _check(outputs, FAST, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "opaque"])
@pytest.mark.parametrize("name", [n for n in STEPS if n != FAST])
def test_compiled_forward_equals_eager(outputs, name, mode):
    _check(outputs, name, mode)


@pytest.mark.parametrize("name", [FAST, pytest.param("tdmoe", marks=pytest.mark.slow)])
def test_static_cache_generate_with_a_compiled_forward(outputs, name):
    """Greedy decoding with a static KV cache and a compiled forward gives eager's tokens."""
    torch._dynamo.reset()
    model = mc.load(_output(outputs, name), device=DEV, static=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1)).to(
        DEV
    )
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
    want = model.generate(ids, **kw)
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, fullgraph=True)
    try:
        got = model.generate(ids, **kw)
    finally:
        model.forward = eager_forward
    assert got.shape == want.shape == (2, 11)
    assert torch.equal(got, want)


def test_compiling_an_unprepared_model_names_the_fix(outputs):
    model = mc.load(_output(outputs, FAST), device=DEV)
    block = next(m for m in model.modules() if isinstance(m, CompressedExperts))
    block.to(DEV)  # a move drops what was prepared
    x = torch.randn(3, model.config.hidden_size, device=DEV)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEV)
    w = torch.ones(3, 2, device=DEV)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match=r"loading.prepare\(model\)"):
        torch.compile(block, fullgraph=True)(x, ids, w)
    prepare(model)
    with torch.no_grad():
        assert torch.compile(block, fullgraph=True)(x, ids, w).shape == x.shape
    with pytest.raises(ValueError, match="static='yes'"):
        prepare(model, static="yes")


def test_a_routing_policy_applies_under_compile(outputs):
    """``capacity_drop`` (forward hooks that rewrite the routing) is traced into the compiled graph."""
    torch._dynamo.reset()
    path = _output(outputs, FAST)
    model = mc.load(path, device=DEV, routing={"capacity_drop": {"gamma": 0.3}})
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2)).to(
        DEV
    )
    with torch.no_grad():
        off = mc.load(path, device=DEV, routing="off")(ids).logits
        want = model(ids).logits
        got = torch.compile(model.forward, fullgraph=True)(input_ids=ids).logits
    assert rel(want, off) > 1e-2, "the policy changes the logits"
    assert rel(got, want) <= tolerance(want, model)
