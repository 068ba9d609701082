"""Compressed models train: with grad enabled every layout runs forward and backward, its gradients (to
the input, the routing weights and every stored floating tensor) equal those of the reference forward on
the layouts' dense decode; ``no_grad`` / ``inference_mode`` keep the fast path (docs/serving.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_pass_contract import SAMPLES
from tiny import save_tiny

import moecompress as mc
from moecompress.io.format import PROJ, decode_bank
from moecompress.layouts import LAYOUTS
from moecompress.layouts.dense import Dense
from moecompress.passes import BUILTIN_PASSES
from moecompress.reference import expert_forward, experts_forward
from moecompress.runtime import quantizer
from moecompress.runtime.quantizer import CompressedExperts, CompressedShared
from moecompress.testing_quantized import save_fp8_block

CAL = {"source": "random", "samples": 8, "seq_len": 16}
SMALL = {"steps": 2, "lr": 1e-2, "samples": 6, "holdout": 2, "seq_len": 8, "batch": 2}
# output -> (input model, steps): the passes' outputs the layout tests draw their blocks from
OUTPUTS = {
    "heapr": ("qwen3_moe", [{"heapr": {"ratio": 0.4, "scope": "global"}}]),
    "svd_experts": ("qwen3_moe", [{"svd_experts": {"ratio": 0.4}}]),
    "tdmoe": ("qwen3_moe", [{"tdmoe": {"ratio": 0.4}}]),
    "codequant": (
        "deepseek_v3",
        [{"protect_super_experts": {"percentile": 90.0}}, {"codequant": {"bits": 3, "finetune_steps": 0}}],
    ),
    "rtn-gpt_oss": ("gpt_oss", [{"rtn": {"bits": 3, "group_size": 16}}]),
    "namex": ("qwen3_moe", [{"namex": {"ratio": 0.25, "router": "remap", "refine_steps": 0}}]),
    "rtn-heapr": ("qwen3_moe", [{"heapr": {"ratio": 0.4}}, {"rtn": {"bits": 4}}]),
}
# case -> (the output whose blocks carry it, layout kind; None: merged slots, an expert map)
LAYOUT_CASES = {
    "dense": ("namex", "dense"), "ragged": ("heapr", "ragged"), "lowrank": ("svd_experts", "lowrank"),
    "tucker": ("tdmoe", "tucker"), "codebook": ("codequant", "codebook"),  # rotation, exact experts
    "rtn": ("rtn-gpt_oss", "rtn"),  # biases, clamped SwiGLU
    "expert_map": ("namex", None), "rtn_widths": ("rtn-heapr", "rtn"),  # live widths of a pruned bank
}  # fmt: skip
EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.float16: torch.finfo(torch.float16).eps,
       torch.bfloat16: torch.finfo(torch.bfloat16).eps}  # fmt: skip


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """``outputs(name)``: the output of :data:`OUTPUTS`' recipe, written on first use."""
    root, made = tmp_path_factory.mktemp("grad"), {}

    def get(name: str):
        if name not in made:
            model, steps = OUTPUTS[name]
            if not (root / model).exists():
                save_tiny(model, root / model)
            rec = {"model": str(root / model), "output": str(root / name), "calibration": CAL, "steps": steps}
            mc.apply(rec, progress=False)
            made[name] = root / name
        return made[name]

    return get


def dense_reference(module: CompressedExperts, x, ids=None, weights=None):
    """The reference forward on the dense decode (``Layout.dense``) of the module's own stored tensors
    (decoded here, not by the module: its own decode is under test too)."""
    bank, emap = decode_bank(
        module.desc, {f"x.{k}": v for k, v in module.state_dict(keep_vars=True).items()}, "x"
    )
    dense = dataclasses.replace(bank, **{p: Dense(getattr(bank, p).dense()) for p in PROJ})
    if isinstance(module, CompressedShared):
        flat = x.reshape(-1, x.shape[-1])
        return expert_forward(dense, 0, flat).float().reshape(x.shape).to(x.dtype)
    return experts_forward(dense, x, ids, weights, emap).to(x.dtype)


def _by_reference(model):
    """``model`` with every compressed block's output replaced by :func:`dense_reference` (a forward hook)."""
    for m in model.modules():
        if isinstance(m, CompressedExperts):
            m.register_forward_hook(lambda mod, args, kwargs, out: dense_reference(mod, *args, *kwargs.values()),
                                    with_kwargs=True)  # fmt: skip
    return model


def tolerance(t: torch.Tensor, reduced: int) -> float:
    """Relative tolerance for a gradient of ``t``: its dtype's rounding, and fp32 sums of ``reduced`` terms."""
    return 4 * EPS.get(t.dtype, EPS[torch.float32]) + 16 * EPS[torch.float32] * reduced**0.5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _inputs(module: CompressedExperts, seed: int, tokens: int = 24):
    g = torch.Generator().manual_seed(seed)
    bank, emap = module.bank()
    n_logical = bank.num_experts if emap is None else emap.numel()
    hidden = bank.hidden_size
    x = torch.randn(tokens, hidden, generator=g)
    # two distinct slots per token; id n_logical is a routing policy's dropped slot
    ids = torch.stack([torch.randperm(n_logical + 1, generator=g)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=g)
    return x, ids, w


def _grads(module, x, ids, w, forward):
    module.zero_grad(set_to_none=True)
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    out = forward(x, ids, w)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    got = {"out": out.detach(), "x": x.grad, "weights": w.grad}
    return got | {n: p.grad for n, p in module.named_parameters()}


def layout_errors(module: CompressedExperts, seed: int = 0) -> dict[str, tuple[float, float]]:
    """``{name: (relative error, tolerance)}``: the served forward's output and gradients against the
    dense-decode reference's, on random tokens with a dropped slot among the routed ones."""
    x, ids, w = _inputs(module, seed)
    served = _grads(module, x, ids, w, module)
    want = _grads(module, x, ids, w, lambda a, b, c: dense_reference(module, a, b, c))
    reduced = max(module.bank()[0].hidden_size, module.bank()[0].width)
    params = dict(module.named_parameters())
    out = {}
    for name, ref in want.items():
        assert (served[name] is None) == (ref is None), f"{name}: a gradient on one side only"
        if ref is not None:
            out[name] = (rel_err(served[name], ref), tolerance(params.get(name, ref), reduced))
    return out


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_layout_gradients_equal_the_dense_reference(outputs, case):
    source, kind = LAYOUT_CASES[case]
    model = mc.load(outputs(source))
    blocks = [m for m in model.modules() if type(m) is CompressedExperts]  # shared experts: below
    if kind is not None:
        blocks = [m for m in blocks if any(m.desc["experts"][p]["kind"] == kind for p in PROJ)]
        if case == "rtn_widths":
            blocks = [m for m in blocks if m.bank()[0].widths is not None]
    else:  # merged slots: several logical experts on one physical one
        maps = [(m, m.bank()[1]) for m in blocks]
        blocks = [m for m, emap in maps if emap is not None and emap.unique().numel() < emap.numel()]
    assert blocks, f"{case}: no block of this kind in {source}"
    floats = 0
    for i, block in enumerate(blocks):
        errs = layout_errors(block, seed=i)
        floats += len(errs) - 3
        bad = {n: e for n, e in errs.items() if not e[0] <= e[1]}
        assert not bad, f"{case}: gradients differ from the reference (error, tolerance): {bad}"
    assert floats > 0, "no stored floating tensor received a gradient"


def test_every_layout_has_a_gradient_case():
    assert set(LAYOUTS) <= {kind for _, kind in LAYOUT_CASES.values()}


def test_a_compressed_shared_expert_trains(outputs):
    model = mc.load(outputs("codequant"))
    shared = [m for m in model.modules() if isinstance(m, CompressedShared)]
    assert shared, "deepseek_v3's codequant output quantises the shared expert"
    x = torch.randn(2, 5, shared[0].bank()[0].hidden_size, generator=torch.Generator().manual_seed(0))
    for m in shared:
        got = _grads(m, x, None, torch.zeros(1), lambda a, b, c, m=m: m(a))
        want = _grads(m, x, None, torch.zeros(1), lambda a, b, c, m=m: dense_reference(m, a))
        for name, ref in want.items():
            if ref is not None and name != "weights":
                assert rel_err(got[name], ref) <= tolerance(ref, 64), name


# -- dispatch: grad mode takes the differentiable path, no_grad / inference_mode the fast one -------------
def _raise(*args, **kwargs):
    raise AssertionError("this path must not run here")


def test_no_grad_and_inference_mode_keep_the_fast_path(outputs, monkeypatch):
    model = mc.load(outputs("rtn-heapr"))
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    monkeypatch.setattr(quantizer, "experts_forward", _raise)  # the differentiable path would fail
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want)
    model.requires_grad_(False)  # grad mode but nothing requires grad: nothing to differentiate
    assert torch.equal(model(ids).logits, want)
    model.requires_grad_(True)
    with pytest.raises(AssertionError, match="must not run"):  # and grad mode does reach it
        model(ids)


@pytest.mark.parametrize("dequantize", [None, "float16"])
def test_grad_mode_never_runs_the_fast_path(outputs, monkeypatch, dequantize):
    model = mc.load(outputs("rtn-heapr"), dequantize=dequantize)
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    monkeypatch.setattr(quantizer, "prepare_serving", _raise)
    for m in model.modules():
        m.__dict__.pop("_prepared_key", None)  # the prepared bank may not be reused either
    logits = model(ids).logits
    assert logits.grad_fn is not None
    assert rel_err(logits, want) <= (
        1e-5 if dequantize is None else EPS[torch.float16]
    )  # the fast path's model
    logits.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.endswith("scales"))
    with pytest.raises(AssertionError, match="must not run"), torch.no_grad():
        model(ids)


# -- end to end: an output of every built-in pass backpropagates like its dense-decode reference ----------
E2E = {name: [{name: SAMPLES[name]}] for name, spec in BUILTIN_PASSES.items() if not spec.report_only}
E2E["lora_heal"] = [{"heapr": {"ratio": 0.5}}, {"lora_heal": {**SMALL, "target": "attention_routed"}}]
for policy in ("capacity_drop", "sere"):  # a routing policy in front of compressed experts (dropped slots)
    E2E[f"heapr+{policy}"] = [{"heapr": {"ratio": 0.4}}, {policy: SAMPLES[policy]}]


def model_errors(path, ids) -> dict[str, tuple[float, float]]:
    """``{name: (relative error, tolerance)}`` of the logits and every parameter's gradient of ``path``
    loaded by :func:`moecompress.load`, against the same model with its blocks on the reference (and of
    the grad-mode logits against the ``no_grad`` fast path's)."""
    served, ref = mc.load(path), _by_reference(mc.load(path))
    g = torch.Generator().manual_seed(3)
    res = {}
    for model in (served, ref):
        logits = model(input_ids=ids).logits
        (logits * torch.randn(logits.shape, generator=g.manual_seed(3))).sum().backward()
        res[id(model)] = logits.detach()
    tol = tolerance(res[id(ref)], 64 * len(served.model.layers))
    with torch.no_grad():  # the fast path serves the same model
        fast = served(input_ids=ids).logits
    out = {
        "logits": (rel_err(res[id(served)], res[id(ref)]), tol),
        "fast": (rel_err(fast, res[id(served)]), tol),
    }
    want = dict(ref.named_parameters())
    for name, p in served.named_parameters():
        assert (p.grad is None) == (want[name].grad is None), f"{name}: a gradient on one side only"
        if p.grad is not None:
            out[name] = (rel_err(p.grad, want[name].grad), tolerance(p, 64 * len(served.model.layers)))
    return out


@pytest.mark.parametrize("name", sorted(E2E))
def test_an_output_of_every_pass_backpropagates(tmp_path, name):
    model_type = "deepseek_v3" if name == "codequant" else "qwen3_moe"
    save_tiny(model_type, tmp_path / "m")
    rec = {
        "model": str(tmp_path / "m"),
        "output": str(tmp_path / "o"),
        "calibration": CAL,
        "steps": E2E[name],
    }
    mc.apply(rec, progress=False)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    errs = model_errors(tmp_path / "o", ids)
    assert errs["model.embed_tokens.weight"][0] <= errs["model.embed_tokens.weight"][1]
    bad = {n: e for n, e in errs.items() if not e[0] <= e[1]}
    assert not bad, f"{name}: gradients differ from the reference (error, tolerance): {bad}"


def test_heapr_on_an_fp8_deepseek_v3_trains(tmp_path):
    """The issue's second case: heapr on an FP8 block-scaled DeepSeek-V3 (written dequantised)."""
    save_fp8_block(
        "deepseek_v3", tmp_path / "fp8", hidden_size=192, moe_intermediate_size=80, n_routed_experts=16
    )
    rec = {"model": str(tmp_path / "fp8"), "output": str(tmp_path / "o"), "calibration": CAL,
           "steps": [{"heapr": {"ratio": 0.4}}]}  # fmt: skip
    mc.apply(rec, progress=False)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    bad = {n: e for n, e in model_errors(tmp_path / "o", ids).items() if not e[0] <= e[1]}
    assert not bad, f"gradients differ from the reference (error, tolerance): {bad}"
