"""rtn pass and layout: on-grid oracles, packing, error levels, protection, errors, end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from tiny import MODEL_TYPES, reference_logits, save_tiny
from transformers import AutoModelForCausalLM

import moecompress as mc
from moecompress.engine.spec import LayerStats
from moecompress.errors import LayoutError, PassError, RecipeError
from moecompress.ir import ExpertBank, Gating, MoELayer, RouterSpec
from moecompress.layouts import LAYOUTS
from moecompress.layouts.bitpack import packed_size
from moecompress.layouts.dense import Dense
from moecompress.layouts.ragged import Ragged
from moecompress.layouts.rtn import RTN
from moecompress.methods.scalar_quant import quantize
from moecompress.passes import BUILTIN_PASSES
from moecompress.passes.rtn import RtnConfig, rtn
from moecompress.reference import moe_forward

CAL = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}
E, W, H = 4, 16, 32
IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A 2-layer tiny qwen3_moe (experts [8, 32, 64], down [8, 64, 32]) shared read-only."""
    path = tmp_path_factory.mktemp("rtn") / "m"
    save_tiny("qwen3_moe", path, num_hidden_layers=2)
    return path


def _layer(seed=0, protected=frozenset()) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    bank = ExpertBank(Dense(torch.randn(E, W, H, generator=g)), Dense(torch.randn(E, W, H, generator=g)),
                      Dense(torch.randn(E, H, W, generator=g)))  # fmt: skip
    spec = RouterSpec(num_experts=E, top_k=2, gating=Gating.SOFTMAX_TOPK, norm_topk=True)
    return MoELayer(0, spec, torch.randn(E, H, generator=g), bank, protected=protected)


def _on_grid(bits: int, gs: int, symmetric: bool, seed: int = 0):
    """Weights ``(q − z)·s`` exactly on a grid the quantiser must recover: every group reaches both ends of
    its range, scales are powers of two (exact in float16), zero points vary per group."""
    g = torch.Generator().manual_seed(seed)
    n, out, inn = 3, 6, 32
    groups = inn // gs
    qmax = (1 << bits) - 1
    if symmetric:
        z = torch.full((n, out, groups), 1 << (bits - 1))
        lo, hi = 1, qmax  # symmetric codes span [z − (2^(b−1) − 1), z + 2^(b−1) − 1]
    else:
        z = torch.randint(0, qmax + 1, (n, out, groups), generator=g)
        lo, hi = 0, qmax
    q = torch.randint(lo, hi + 1, (n, out, groups, gs), generator=g)
    q[..., 0], q[..., 1] = lo, hi
    if symmetric:  # only one end needs to be reached: max|w| sets the scale
        q[..., 0] = torch.where(torch.rand(n, out, groups, generator=g) < 0.5, lo, z)
    s = 2.0 ** -torch.randint(3, 12, (n, out, groups), generator=g).float()
    w = ((q - z[..., None]).float() * s[..., None]).reshape(n, out, inn)
    return w, q.reshape(n, out, inn), s, z


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_weights_on_the_grid_round_trip_exactly(bits, symmetric):
    for gs in (8, -1):
        w, q, s, z = _on_grid(bits, 32 if gs == -1 else gs, symmetric)
        codes, scales, zeros = quantize(w, bits, gs, symmetric)
        assert torch.equal(codes.long(), q) and torch.equal(scales.float(), s), (bits, gs)
        assert zeros is None if symmetric else torch.equal(zeros.long(), z)
        lay = RTN.from_dense(w, bits, gs, symmetric=symmetric)
        assert torch.equal(lay.dense(), w), (bits, gs, symmetric)
        assert lay.codes.shape == (3, 6, packed_size(32, bits)) and lay.codes.dtype == torch.uint8
        back = LAYOUTS[lay.meta()["kind"]].from_tensors(lay.tensors(), lay.meta())
        assert torch.equal(back.dense(), w) and back.meta() == lay.meta()


def test_zero_and_constant_groups_and_exact_zero():
    w = torch.zeros(1, 2, 16)
    w[0, 1, :8] = 0.3  # a constant group
    w[0, 1, 8] = 0.0  # zero inside a group of mixed signs must stay exactly zero
    w[0, 1, 9:] = torch.linspace(-1, 1, 7)
    for sym in (False, True):
        lay = RTN.from_dense(w, 4, 8, symmetric=sym)
        d = lay.dense()
        assert torch.equal(d[0, 0], w[0, 0]) and float(d[0, 1, 8]) == 0.0
        assert torch.allclose(d[0, 1, :8], w[0, 1, :8], rtol=1e-3)
    assert torch.equal(RTN.from_dense(w, 4, 8).scales[0, 0], torch.zeros(2, dtype=torch.float16))


def test_error_levels_and_layout_contract():
    w = torch.randn(4, 16, 128, generator=torch.Generator().manual_seed(1))
    errs = {}
    for bits in (8, 4, 3, 2):
        lay = RTN.from_dense(w, bits, 32)
        errs[bits] = float((lay.dense() - w).norm() / w.norm())
    assert errs[8] < 0.005 and errs[8] < errs[4] < errs[3] < errs[2] < 0.5, errs
    lay = RTN.from_dense(w.to(torch.bfloat16), 4, -1, symmetric=True, protected={2})
    assert lay.dtype == torch.bfloat16 and lay.group_size == 128 and lay.symmetric
    assert set(lay.tensors()) == {"codes", "scales", "members", "dense"}  # no zeros when symmetric
    assert lay.members.tolist() == [0, 1, -1, 2] and torch.equal(lay.expert(2), w[2].to(torch.bfloat16))
    x = torch.randn(5, 128)
    assert torch.allclose(lay.apply(x, 1, rows=7), x.bfloat16() @ lay.expert(1)[:7].T)
    assert torch.allclose(
        lay.apply(x[:, :100], 0, cols=100), x[:, :100].bfloat16() @ lay.expert(0)[:, :100].T
    )
    assert lay.cast(torch.float32).expert(2).dtype == torch.float32
    with pytest.raises(LayoutError, match="group_size=48 does not divide the 128 input channels"):
        RTN.from_dense(w, 4, 48)
    with pytest.raises(LayoutError, match="symmetric=True but 'zeros' is present"):
        RTN.from_tensors({**RTN.from_dense(w, 4, 32).tensors()}, {**lay.meta(), "group_size": 32})


def test_pass_quantises_every_expert_but_the_protected_and_reports():
    layer = _layer(protected=frozenset({1}))
    new, info = rtn(layer, LayerStats(0), RtnConfig(bits=8, group_size=8))
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(2))
    rel = float((moe_forward(new, x) - moe_forward(layer, x)).norm() / moe_forward(layer, x).norm())
    assert rel < 0.01
    for name in ("gate", "up", "down"):
        lay, ref = getattr(new.experts, name), getattr(layer.experts, name)
        assert isinstance(lay, RTN) and lay.members.tolist() == [0, -1, 1, 2]
        assert torch.equal(lay.expert(1), ref.expert(1))  # protected: bit-identical
        assert not torch.equal(lay.expert(0), ref.expert(0))
    assert info["quantised_experts"] == 3 and info["protected"] == [1]
    assert 0 < info["rel_error"]["down"] < 0.01 and info["bytes_before"] == 3 * E * W * H * 4
    # per projection: 3 experts × 512 codes + 64 groups × (fp16 scale + uint8 zero), 1 dense fp32, members
    assert info["bytes_after"] == 3 * (3 * (512 + 64 * 3) + 512 * 4 + E * 8)
    again, info2 = rtn(layer, LayerStats(0), RtnConfig(bits=8, group_size=8))  # deterministic, pure
    assert torch.equal(again.experts.gate.codes, new.experts.gate.codes) and info2 == info
    assert isinstance(layer.experts.gate, Dense)
    json.dumps(info)


def test_ragged_banks_are_quantised_at_full_width():
    layer = _layer()
    keep = [torch.arange(k) for k in (16, 5, 16, 3)]
    bank = layer.experts
    pruned = layer.replace(experts=ExpertBank(
        Ragged.from_dense(bank.gate.dense(), keep, "out"), Ragged.from_dense(bank.up.dense(), keep, "out"),
        Ragged.from_dense(bank.down.dense(), keep, "in")))  # fmt: skip
    new, _ = rtn(pruned, LayerStats(0), RtnConfig(bits=8, group_size=-1))
    assert new.experts.widths.tolist() == [16, 5, 16, 3] and isinstance(new.experts.down, RTN)
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(3))
    y, ref = moe_forward(new, x), moe_forward(pruned, x)
    assert float((y - ref).norm() / ref.norm()) < 0.01
    with pytest.raises(PassError, match="layout 'rtn'"):
        rtn(new, LayerStats(0), RtnConfig())


def test_end_to_end_writes_rtn_loads_through_the_quantizer_and_matches_the_reference(tiny_qwen, tmp_path):
    out = tmp_path / "out"
    mc.apply({"model": str(tiny_qwen), "output": str(out), "calibration": CAL,
              "steps": [{"rtn": {"bits": 3, "group_size": 16}}]}, progress=False)  # fmt: skip
    rep = json.loads((out / "steps" / "01-rtn" / "report.json").read_text())
    # per layer and projection of 8 experts: codes 3·in/8, fp16 scale + uint8 zero per 16 inputs, members
    per_layer = sum(
        8 * o * (packed_size(i, 3) + 3 * i // 16) + 8 * 8 for o, i in ((32, 64),) * 2 + ((64, 32),)
    )
    layers = 2
    params = layers * 3 * 8 * 32 * 64
    assert rep["summary"]["routed_bytes_after"] == layers * per_layer
    assert rep["summary"]["routed_params"] == params
    assert rep["summary"]["routed_bits_per_param"] == pytest.approx(3 + 24 / 16 + layers * 3 * 8 * 64 / params)
    assert all(0.05 < e < 0.3 for e in rep["summary"]["rel_error"].values())
    cfg = json.loads((out / "config.json").read_text())
    desc = cfg["moecompress"]["layers"]["0"]["experts"]["down"]
    assert desc["kind"] == "rtn" and desc["bits"] == 3 and desc["group_size"] == 16 and not desc["symmetric"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.gate.codes").shape == (8, 32, 24)
        assert f.get_tensor("model.layers.0.mlp.experts.down.scales").dtype == torch.float16
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out)(IDS).logits
    torch.testing.assert_close(got, reference_logits(tiny_qwen, out, IDS), rtol=1e-5, atol=1e-5)
    assert BUILTIN_PASSES["rtn"].needs_for(RtnConfig()) == set()  # data-free
    # an rtn checkpoint is read on meta in the dry run, and quantising twice is refused there
    with pytest.raises(PassError, match=r"step 1 \(rtn\), layer 0: .*got layout 'rtn' \(gate\)"):
        mc.apply({"model": str(out), "output": str(tmp_path / "o2"), "calibration": CAL,
                  "steps": [{"rtn": {"group_size": 16}}]}, dry_run=True)  # fmt: skip


def test_recipe_errors_name_the_field_and_the_fix(tiny_qwen, tmp_path):
    rec = {"model": str(tiny_qwen), "output": str(tmp_path / "o"), "calibration": CAL}
    with pytest.raises(RecipeError, match=r"step 1 \(rtn\): field 'bits': bits must be 8, 4, 3 or 2; use"):
        mc.apply({**rec, "steps": [{"rtn": {"bits": 5}}]}, dry_run=True)
    with pytest.raises(RecipeError, match=r"field 'group_size': group_size must be a positive .* or -1"):
        mc.apply({**rec, "steps": [{"rtn": {"group_size": 0}}]}, dry_run=True)
    with pytest.raises(
        PassError,
        match=r"step 1 \(rtn\), layer 0: group_size=48 does not divide the 64 input channels of the gate "
        r"projection; use a common divisor of 32 and 64 \(e.g. 32\) or group_size: -1",
    ):
        mc.apply({**rec, "steps": [{"rtn": {"group_size": 48}}]}, dry_run=True)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_default_group_size_works_on_every_architecture(tmp_path, model_type):
    """``group_size: auto`` (the default) picks the largest of 128/64/32/16 dividing every projection's
    inputs; the tiny models' widths (32, 48, 64, 80) need 16 or -1, real ones get 128 or 64."""
    save_tiny(model_type, tmp_path / "m")
    res = mc.apply({"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": CAL,
                    "steps": [{"rtn": {}}]}, progress=False)  # fmt: skip
    ckpt = mc.open_checkpoint(res.output_dir)
    for i in ckpt.moe_layer_indices:
        bank = ckpt.read_layer(i).experts
        ins = {getattr(bank, p).shape[2] for p in ("gate", "up", "down")}
        gs = {getattr(bank, p).group_size for p in ("gate", "up", "down")}
        want = next((g for g in (128, 64, 32, 16) if all(n % g == 0 for n in ins)), None)
        assert gs == ({want} if want else ins), (model_type, ins, gs)
        assert all(getattr(bank, p).kind == "rtn" for p in ("gate", "up", "down"))


@pytest.mark.parametrize(("inputs", "want"), [((2048, 768), 128), ((2880, 2880), 64), ((64, 128), 64),
                                              ((80, 64), 16), ((48, 72), -1), ((7168, 2048), 128)])  # fmt: skip
def test_auto_group_rule(inputs, want):
    from moecompress.passes.rtn import group_size

    h, i = inputs
    g = torch.Generator().manual_seed(0)
    bank = ExpertBank(Dense(torch.randn(2, i, h, generator=g)), Dense(torch.randn(2, i, h, generator=g)),
                      Dense(torch.randn(2, h, i, generator=g)))  # fmt: skip
    layer = MoELayer(0, RouterSpec(num_experts=2, top_k=1, gating=Gating.SOFTMAX_TOPK), torch.zeros(2, h), bank)
    assert group_size(layer, RtnConfig()) == want
    assert group_size(layer, RtnConfig(group_size=32)) == 32  # an explicit value is used (and checked) as given


@pytest.mark.shared
@pytest.mark.parametrize("name", ["ref-qwen3moe", "ref-mixtral", "ref-deepseekv3", "ref-mixtral-upcycled"])
def test_default_rtn_runs_on_every_reference_model(shared_dir, tmp_path, name):
    res = mc.apply({"model": str(shared_dir / "data" / "models" / name), "output": str(tmp_path / "o"),
                    "calibration": CAL, "steps": [{"rtn": {}}]}, progress=False)  # fmt: skip
    layers = json.loads((res.output_dir / "steps" / "01-rtn" / "report.json").read_text())["layers"]
    assert layers and all(r["info"]["group_size"] in (128, 64, 32, 16) for r in layers)
    assert all(r["rel_error"] < 0.2 for r in layers), [r["rel_error"] for r in layers]  # 4-bit: ~0.1


def _close_errors(got, want, n: int) -> bool:
    """Relative errors equal to float32 rounding: summed by blocks (float64) against a whole-tensor float32
    norm of ``n`` weights, which may be off by about ``sqrt(n)`` float32 epsilons."""
    tol = 4 * math.sqrt(n) * torch.finfo(torch.float32).eps
    return bool(torch.allclose(torch.as_tensor(got), torch.as_tensor(want), rtol=tol, atol=0))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("protected", [frozenset({2, 9}), frozenset()])
def test_the_pass_stores_what_from_dense_stores_and_its_errors_match_the_decoded_weights(symmetric, protected):
    w = torch.randn(11, 16, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    from moecompress.passes.rtn import quantize_bank

    lay, errs = quantize_bank(w, 4, 16, symmetric, protected, chunk=3)  # chunks cut mid-bank
    ref = RTN.from_dense(w, 4, 16, symmetric=symmetric, protected=set(protected))
    got, want = lay.tensors(), ref.tensors()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert lay.meta() == ref.meta()
    ids = [e for e in range(11) if e not in protected]
    dec = torch.stack([ref.expert(e).float() for e in ids])  # bf16 logical dtype: compare in float32
    q = [ref.quantised(e) for e in ids]
    from moecompress.methods.scalar_quant import dequantize

    exact = torch.stack([dequantize(*t, 4) for t in q])
    want_errs = ((exact - w[ids].float()).flatten(1).norm(dim=1) / w[ids].float().flatten(1).norm(dim=1)).tolist()
    assert len(errs) == len(ids) and _close_errors(errs, want_errs, 16 * 64) and dec.shape == exact.shape


@pytest.mark.parametrize(("bits", "gs", "symmetric"), [(4, 16, False), (4, 16, True), (2, 8, False), (3, 16, False),
                                                      (8, -1, True), (4, -1, False)])  # fmt: skip
def test_quantize_with_error_equals_quantize_then_dequantize(bits, gs, symmetric):
    """The one-pass quantiser of the rtn pass: codes, scales, zeros bit for bit those of ``quantize`` and
    the per-expert error that of ``dequantize`` (to float32 rounding), whole or by blocks of rows that cut
    an expert; ``pack_codes`` the bytes of ``pack_bits``."""
    from moecompress.layouts.bitpack import pack_bits
    from moecompress.methods.scalar_quant import dequantize, pack_codes, quantize_with_error

    g = torch.Generator().manual_seed(bits)
    for dtype in (torch.bfloat16, torch.float32):
        w = (0.05 * torch.randn(5, 12, 48, generator=g)).to(dtype)
        w[1, 3] = 0  # an all-zero row: scale 0
        q, s, z = quantize(w, bits, gs, symmetric)
        ref = w.float()
        want = (dequantize(q, s, z, bits) - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-30)
        for block in (5 * 48, 12 * 48):  # 5 rows (the last block of an expert shorter), a whole expert
            q2, s2, z2, err = quantize_with_error(w, bits, gs, symmetric, block=block)
            assert torch.equal(q, q2) and torch.equal(s, s2) and ((z is None and z2 is None) or torch.equal(z, z2))
            assert err.dtype == torch.float32 and _close_errors(err, want, 12 * 48)
            assert torch.equal(pack_codes(q2, bits), pack_bits(q, bits))
    odd = torch.randint(0, 4, (3, 7), dtype=torch.uint8, generator=g)  # rows that do not fill whole bytes
    assert torch.equal(pack_codes(odd, 2), pack_bits(odd, 2))
