"""Quantised releases read directly: FP8 block-scaled (DeepSeek-V3 layout), compressed-tensors FP8 and
int4/int8 pack-quantized, gpt-oss MXFP4. Dequantisation on access equals the in-memory reference bit for
bit, the reference forward equals transformers' block on the same weights, identity runs copy every
tensor byte for byte, a changed layer leaves the quantisation of the rest intact."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import moecompress as mc
from moecompress.engine.layer_loop import rewrite_checkpoint
from moecompress.errors import RecipeError
from moecompress.testing_quantized import save_compressed_tensors, save_fp8_block, save_mxfp4

TOL = 1e-5
H = 192  # 128 + 64: every 128-block grid has a partial last block
CT_KINDS = ("fp8-channel", "fp8-block", "w4-group", "w4-asym", "w8-channel")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    made, models = {}, {}
    try:
        models["fp8"] = save_fp8_block(
            "deepseek_v3", root / "fp8", hidden_size=H, moe_intermediate_size=80, n_routed_experts=16
        )
        made["fp8"] = root / "fp8"
        for kind in CT_KINDS:
            models[kind] = save_compressed_tensors("qwen3_moe", root / kind, kind, hidden_size=H)
            made[kind] = root / kind
        models["mxfp4"] = save_mxfp4(root / "mxfp4", intermediate_size=96)
        made["mxfp4"] = root / "mxfp4"
    finally:
        torch.set_num_threads(threads)
    return made, models


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _fp8_reference(w: torch.Tensor, s: torch.Tensor, b: int = 128) -> torch.Tensor:
    """Block by block, independently of the implementation's broadcasting."""
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(math.ceil(w.shape[0] / b)):
        for j in range(math.ceil(w.shape[1] / b)):
            out[i * b : (i + 1) * b, j * b : (j + 1) * b] = (
                w[i * b : (i + 1) * b, j * b : (j + 1) * b].float() * s[i, j]
            )
    return out


# -- dequantisation, bit for bit -------------------------------------------------------------------
def test_fp8_block_dequantisation_is_bit_exact(ckpts):
    made, _ = ckpts
    ckpt = mc.open_checkpoint(made["fp8"])
    raw = _tensors(made["fp8"])
    names = ckpt.reader.quantized
    assert any(".experts." in n for n in names) and any("self_attn" in n for n in names)
    assert any(raw[n].shape[1] % 128 for n in names), "partial blocks are exercised"
    for n in names:
        got = ckpt.reader.get(n)
        assert raw[n].dtype == torch.float8_e4m3fn and got.dtype == torch.float32
        assert torch.equal(got, _fp8_reference(raw[n], raw[f"{n}_scale_inv"])), n
    assert "model.layers.1.mlp.gate.weight" in ckpt.reader.keys  # the router stays unquantised
    assert not any(k.endswith("_scale_inv") for k in ckpt.reader.keys)


@pytest.mark.parametrize("kind", CT_KINDS)
def test_compressed_tensors_dequantisation_is_bit_exact(ckpts, kind):
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    made, models = ckpts
    ckpt = mc.open_checkpoint(made[kind])
    raw = _tensors(made[kind])
    scaled = {k.removesuffix("_scale") for k in raw if k.endswith(".weight_scale")}
    plain = sorted({k.rpartition(".")[0] for k in raw if k.endswith(".weight") and k not in scaled})
    # the library's model-free dequantiser matches "Linear" by name alone: name the dense modules for it
    ref = CompressedTensorsDequantizer(str(made[kind]), ignore=plain, dtype=torch.float32).process(raw)
    names = ckpt.reader.quantized
    assert set(names) == scaled
    assert any(".experts." in n for n in names) and any("self_attn" in n for n in names)
    for n in names:
        assert torch.equal(ckpt.reader.get(n), ref[n]), n
    # and the codes decode near the weights they were made from (not a transposed or shifted grid)
    w = models[kind].model.layers[0].mlp.experts.gate_up_proj.detach()[0, :32]
    got = ckpt.reader.get("model.layers.0.mlp.experts.0.gate_proj.weight")
    assert (got - w).abs().max() <= 0.1 * w.abs().max()


def test_mxfp4_per_expert_dequantisation_is_bit_exact(ckpts):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    made, models = ckpts
    ckpt = mc.open_checkpoint(made["mxfp4"])
    raw = _tensors(made["mxfp4"])
    for i in ckpt.moe_layer_indices:
        for proj in ("gate_up_proj", "down_proj"):
            n = f"model.layers.{i}.mlp.experts.{proj}"
            want = convert_moe_packed_tensors(raw[f"{n}_blocks"], raw[f"{n}_scales"], dtype=torch.float32)
            got = ckpt.reader.get(n)
            assert ckpt.reader.shape(n) == tuple(want.shape) and torch.equal(got, want), n
            orig = getattr(models["mxfp4"].model.layers[i].mlp.experts, proj).detach()
            assert got.shape == orig.shape and (got - orig).abs().max() <= 0.25 * orig.abs().max()


# -- the forward on the dequantised layer ----------------------------------------------------------
def _dense_copy(ckpt, dst):
    """The logical (dequantised) view written as a stock checkpoint without quantization_config."""
    dst.mkdir()
    tensors = {k: v.contiguous() for k, v in ckpt.reader.get_many(ckpt.reader.keys).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = {k: v for k, v in ckpt.raw_config.items() if k != "quantization_config"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "w4-asym", "mxfp4"])
def test_reference_forward_matches_transformers_on_dequantised_weights(ckpts, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    made, _ = ckpts
    ckpt = mc.open_checkpoint(made[fmt])
    model = AutoModelForCausalLM.from_pretrained(str(_dense_copy(ckpt, tmp_path / "dense"))).eval()
    g = torch.Generator().manual_seed(1)
    for i in ckpt.moe_layer_indices:
        x = torch.randn(37, ckpt.adapter.hidden_size, generator=g)
        with torch.no_grad():
            out = model.model.layers[i].mlp(x[None])
            want = (out[0] if isinstance(out, tuple) else out)[0]
            got = mc.moe_forward(ckpt.read_layer(i), x)
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= TOL, f"{fmt} layer {i}: {err:.2e}"


# -- pass-through ----------------------------------------------------------------------------------
def _assert_byte_identical(src, dst):
    a, b = _tensors(src), _tensors(dst)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    qc_in = json.loads((src / "config.json").read_text())["quantization_config"]
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == qc_in


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "w4-group", "mxfp4"])
def test_identity_writes_every_tensor_byte_identical(ckpts, tmp_path, fmt):
    made, _ = ckpts
    rewrite_checkpoint(made[fmt], tmp_path / "rw", progress=False)
    _assert_byte_identical(made[fmt], tmp_path / "rw")
    rec = {"model": str(made[fmt]), "output": str(tmp_path / "id"), "steps": [{"identity": {}}],
           "calibration": {"source": "random", "samples": 2, "seq_len": 8}}  # fmt: skip
    mc.apply(rec, progress=False)
    _assert_byte_identical(made[fmt], tmp_path / "id")


PRUNED = {  # format: (a rewritten expert tensor, its quantised form, config count key, skip entry of layer 1)
    "fp8": ("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv",
            ("n_routed_experts", 12), "model.layers.1.mlp"),
    "mxfp4": ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj_blocks",
              ("num_local_experts", 6), "model.layers.1.mlp.experts"),
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(PRUNED))
def test_expert_prune_keeps_the_rest_quantised_and_loads(ckpts, tmp_path, fmt):
    made, _ = ckpts
    src, out = made[fmt], tmp_path / "pruned"
    dense, packed, (count_key, count), skip = PRUNED[fmt]
    rec = {"model": str(src), "output": str(out), "steps": [{"expert_prune": {"ratio": 0.25, "method": "frequency"}}],
           "calibration": {"source": "random", "samples": 4, "seq_len": 8}}  # fmt: skip
    mc.apply(rec, progress=False)
    ckpt_in = mc.open_checkpoint(src)
    moe = {k for i in ckpt_in.moe_layer_indices for k in ckpt_in.raw_moe_keys(i)}
    a, b = _tensors(src), _tensors(out)
    # FP8 attention stays FP8 (gpt-oss quantises its experts only)
    assert fmt == "mxfp4" or any(v.dtype == torch.float8_e4m3fn for k, v in a.items() if k not in moe)
    for k, v in a.items():  # everything outside the rewritten MoE blocks: the same bytes
        if k not in moe:
            assert torch.equal(v.view(torch.uint8), b[k].view(torch.uint8)), k
    # the kept experts stay in their on-disk encoding (renumbered), so the output is smaller than the input
    assert packed in b and b[packed].dtype == a[packed].dtype and (fmt == "mxfp4" or b[dense].dtype == torch.float8_e4m3fn)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[count_key] == count
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == fmt and skip not in (qc.get("modules_to_not_convert") or [])
    ckpt = mc.open_checkpoint(out)  # our reader: everything dequantised again
    assert any(".experts." in n for n in ckpt.reader.quantized)
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) < sum(f.stat().st_size for f in src.glob("*.safetensors"))
    model = mc.load(out)  # through transformers' own quantizer (it dequantises on CPU)
    for i in ckpt.moe_layer_indices:
        x = torch.randn(11, ckpt.adapter.hidden_size)
        with torch.no_grad():
            want = mc.moe_forward(ckpt.read_layer(i), x)
            got = model.model.layers[i].mlp(x[None])
            got = (got[0] if isinstance(got, tuple) else got)[0]
        # transformers' FP8 layers also quantise their activations (activation_scheme: dynamic), so a kept
        # FP8 expert agrees only to that precision (the input checkpoint loaded the same way: 0.1-0.2)
        assert float((got - want).abs().max() / want.abs().max()) <= (TOL if fmt == "mxfp4" else 0.35)


def test_calibration_analyze_on_fp8_equals_the_dequantised_model(ckpts, tmp_path):
    """Calibration runs transformers' decoder layers with the FP8 attention and dense MLP dequantised:
    its statistics equal those of a dense copy of the same weights."""
    made, _ = ckpts
    dense = _dense_copy(mc.open_checkpoint(made["fp8"]), tmp_path / "dense")
    infos = []
    for src in (made["fp8"], dense):
        out = tmp_path / f"an-{src.name}"
        rec = {"model": str(src), "output": str(out), "steps": [{"analyze": {}}],
               "calibration": {"source": "random", "samples": 4, "seq_len": 8}}  # fmt: skip
        mc.apply(rec, progress=False)
        infos.append(json.loads((out / "steps" / "01-analyze" / "report.json").read_text())["layers"])
    assert [r["layer"] for r in infos[0]] == [1, 2]
    for q, d in zip(*infos):
        assert q["info"]["tokens_per_expert"] == d["info"]["tokens_per_expert"]
        assert torch.allclose(
            torch.tensor(q["info"]["expert_out_norm_mean"]), torch.tensor(d["info"]["expert_out_norm_mean"])
        )


# -- validation and refusals -------------------------------------------------------------------------
def _mutated(src, dst, tensors=None, config=None):
    """A copy of checkpoint ``src`` with ``tensors(dict)`` and ``config(dict)`` applied in place."""
    dst.mkdir()
    t, cfg = _tensors(src), json.loads((src / "config.json").read_text())
    if tensors:
        tensors(t)
    if config:
        config(cfg)
    save_file({k: v.contiguous() for k, v in t.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


A = "model.layers.0.self_attn.q_a_proj.weight"
E = "model.layers.1.mlp.experts.3.up_proj.weight"
CASES = {
    "gptq": ("fp8", None, lambda c: c["quantization_config"].update(quant_method="gptq"), ["'gptq'", "dequantize"]),
    "bitsandbytes": ("fp8", None, lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}),
                     ["'bitsandbytes'", "bf16 release"]),
    "no block size": ("fp8", None, lambda c: c["quantization_config"].pop("weight_block_size"), ["weight_block_size"]),
    "missing scale": ("fp8", lambda t: t.pop(f"{E}_scale_inv"), None, [f"{E}_scale_inv", "no block scale"]),
    "scale shape": ("fp8", lambda t: t.update({f"{A}_scale_inv": torch.ones(1, 1)}), None, [f"{A}_scale_inv", "[1, 2]"]),
    "fp8 dtype": ("fp8", lambda t: t.update({E: t[E].float().to(torch.float8_e5m2)}), None, [E, "F8_E5M2"]),
    "orphan scale": ("fp8", lambda t: t.update({E: t[E].float()}), None, [f"{E}_scale_inv", "not FP8"]),
    "ct format": ("w4-group", None, lambda c: c["quantization_config"].update(format="nvfp4-pack-quantized"),
                  ["nvfp4-pack-quantized", "group_0"]),
    "ct ignored": ("w4-group", None, lambda c: c["quantization_config"]["ignore"].append("re:.*experts\\.3\\..*"),
                   ["experts.3", "ignore"]),
    "ct missing": ("w4-group", lambda t: t.pop("model.layers.0.mlp.experts.0.down_proj.weight_scale"), None,
                   ["model.layers.0.mlp.experts.0.down_proj.weight_scale"]),
    "ct packed shape": ("w4-group", lambda t: t.update({"model.layers.0.mlp.experts.0.down_proj.weight_shape":
                        torch.tensor([H, 64])}), None, ["weight_packed", "weight_shape [192, 64]"]),
    "mxfp4 scales": ("mxfp4", lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales": torch.zeros(8, 64, 1,
                     dtype=torch.uint8)}), None, ["down_proj_scales", "expected U8"]),
    "mxfp4 blocks": ("mxfp4", lambda t: t.pop("model.layers.1.mlp.experts.gate_up_proj_blocks"), None,
                     ["gate_up_proj_scales", "no blocks"]),
    "no quantization_config": ("fp8", None, lambda c: c.pop("quantization_config"), ["is not understood", "quantization_config"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_quantised_input_is_one_line_naming_the_tensor(ckpts, tmp_path, case):
    made, _ = ckpts
    src, tensors, config, words = CASES[case]
    bad = _mutated(made[src], tmp_path / "bad", tensors, config)
    out = tmp_path / "out"
    rec = {"model": str(bad), "output": str(out), "steps": [{"identity": {}}],
           "calibration": {"source": "random", "samples": 2, "seq_len": 8}}  # fmt: skip
    with pytest.raises(mc.MoecompressError) as err:
        mc.apply(rec, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert not out.exists()


def test_moecompress_format_layers_beside_a_kept_encoding_are_refused(ckpts, tmp_path):
    made, _ = ckpts
    out = tmp_path / "rtn"
    rec = {"model": str(made["fp8"]), "output": str(out), "steps": [{"rtn": {"bits": 4}}], "quantized_input": "keep",
           "calibration": {"source": "random", "samples": 2, "seq_len": 8}}  # fmt: skip
    with pytest.raises(
        RecipeError, match=r"step 1 \(rtn\), layer 1: .*cannot be combined with the input.s fp8 quantization.*"
        r"quantized_input: dequantize"
    ):
        mc.apply(rec, progress=False)
    assert not out.exists() and not list(tmp_path.iterdir())  # refused by the dry run: nothing written


@pytest.mark.parametrize("mode", ["auto", "dequantize"])
def test_moecompress_format_on_a_quantised_input_writes_everything_dequantised(ckpts, tmp_path, mode):
    """``quantized_input: auto`` (default) with a step that needs the moecompress format: every tensor is
    written in the compute dtype (the input's logical view), the quantization_config goes, the output loads."""
    made, _ = ckpts
    out = tmp_path / "rtn"
    rec = {"model": str(made["fp8"]), "output": str(out), "steps": [{"rtn": {"bits": 4}}], "quantized_input": mode,
           "calibration": {"source": "random", "samples": 2, "seq_len": 8}}  # fmt: skip
    assert mc.apply(rec, dry_run=True, progress=False).report["dry_run"]["dequantize_output"] is True
    mc.apply(rec, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "moecompress" and cfg["moecompress"]["layers"]
    b = _tensors(out)
    assert not any(v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for v in b.values())
    assert not any(k.endswith("weight_scale_inv") for k in b)
    src = mc.open_checkpoint(made["fp8"])
    moe = {k for i in src.moe_layer_indices for k in src.moe_keys(i)}
    for k in src.reader.keys:  # outside the MoE blocks: exactly the dequantised input
        if k not in moe:
            assert torch.equal(b[k], src.reader.get(k)), k
    model = mc.load(out)
    with torch.no_grad():
        logits = model(torch.arange(8)[None]).logits
    assert bool(torch.isfinite(logits).all())


def test_an_expert_prune_on_fp8_keeps_the_encoding_by_default(ckpts, tmp_path):
    made, _ = ckpts
    rec = {"model": str(made["fp8"]), "output": str(tmp_path / "o"), "steps": [{"expert_prune": {"ratio": 0.25}}],
           "calibration": {"source": "random", "samples": 2, "seq_len": 8}}  # fmt: skip
    assert mc.apply(rec, dry_run=True, progress=False).report["dry_run"]["dequantize_output"] is False


def test_expert_reads_touch_one_expert(ckpts, monkeypatch):
    """MXFP4 experts are read per expert (get_slice rows), never the whole fused tensor."""
    made, _ = ckpts
    ckpt = mc.open_checkpoint(made["mxfp4"])
    rows, whole = [], []
    get_rows, get_many = ckpt.raw.get_rows, ckpt.raw.get_many
    monkeypatch.setattr(ckpt.raw, "get_rows", lambda n, a, b: rows.append(b - a) or get_rows(n, a, b))
    monkeypatch.setattr(ckpt.raw, "get_many", lambda names: whole.extend(names) or get_many(names))
    ckpt.read_layer(0)
    assert rows and set(rows) == {1} and len(rows) == 2 * 2 * ckpt.adapter.num_experts
    assert not any(n.endswith(("_blocks", "_scales")) for n in whole)


@pytest.mark.parametrize("fmt", ["fp8", "w4-asym", "mxfp4"])
def test_logical_view_answers_the_reader_api(ckpts, fmt):
    from moecompress.tools.inspect import inspect_checkpoint

    made, _ = ckpts
    ckpt = mc.open_checkpoint(made[fmt])
    n = ckpt.reader.quantized[0]
    t = ckpt.reader.get(n)
    assert ckpt.reader.dtype(n) == "F32" and ckpt.reader.torch_dtype(n) == t.dtype == torch.float32
    assert ckpt.reader.meta(n).shape == t.shape == ckpt.reader.shape(n)
    assert ckpt.reader.nbytes(n) == t.numel() * 4 and n in ckpt.reader
    behind = ckpt.reader.raw_names([n])  # the payload and its scales (and shapes, zero points)
    assert len(behind) >= 2 and set(behind) <= set(ckpt.raw.keys) and ckpt.reader.shards == ckpt.raw.shards
    assert not set(behind[1:]) & set(ckpt.reader.keys)
    report = inspect_checkpoint(made[fmt])  # headers and light reads only, through the same view
    assert [row["layer"] for row in report["layers"]] == ckpt.moe_layer_indices


def test_mxfp4_output_loads_offline_on_the_cpu_with_the_dequantised_logits(ckpts, tmp_path, monkeypatch):
    """transformers runs MXFP4 experts through a Hub kernel it downloads; offline and on a CPU ``load``
    dequantises them instead, and the logits equal those of a stock dense copy of the same weights."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    made, _ = ckpts
    out = tmp_path / "pruned"
    rec = {"model": str(made["mxfp4"]), "output": str(out), "steps": [{"expert_prune": {"ratio": 0.25, "method": "frequency"}}],
           "calibration": {"source": "random", "samples": 4, "seq_len": 8}}  # fmt: skip
    mc.apply(rec, progress=False)
    ckpt = mc.open_checkpoint(out)
    dense = AutoModelForCausalLM.from_pretrained(str(_dense_copy(ckpt, tmp_path / "dense"))).eval()
    model = mc.load(out)
    ids = torch.randint(0, ckpt.raw_config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = dense(input_ids=ids).logits, model(input_ids=ids).logits
    assert float((got - want).abs().max() / want.abs().max()) <= TOL
