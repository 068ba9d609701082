"""``calibration.dtype: auto`` and the CPU's 16-bit matmuls: a CPU without a bfloat16 (float16) matmul kernel
computes in float32 (PyTorch's scalar fallback is 7-150x slower there, ``moecompress.engine.context``); an
explicit 16-bit dtype on such a CPU is kept, with one warning line. Both kinds of CPU are covered on either:
the pure rules take the CPU's answer as an argument, the dry-run tests follow what this CPU answers."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.engine.context import auto_dtype, fast_cpu_matmul, slow_dtype_note
from moecompress.engine.recipe import load_recipe

FAST, SLOW = (lambda d: True), (lambda d: False)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_auto_is_float32_on_a_cpu_without_the_16bit_kernel(stored):
    assert auto_dtype(stored, "cpu", SLOW) == torch.float32
    assert auto_dtype(stored, "cpu", FAST) == stored


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_auto_keeps_the_stored_dtype_on_cuda(stored):
    assert auto_dtype(stored, "cuda", SLOW) == stored
    assert auto_dtype(stored, "cuda:1", SLOW) == stored


@pytest.mark.parametrize("stored", [torch.float32, torch.uint8, torch.int32])
def test_auto_is_float32_for_float32_and_integer_tensors(stored):
    for fast in (SLOW, FAST):
        assert auto_dtype(stored, "cpu", fast) == torch.float32
        assert auto_dtype(stored, "cuda", fast) == torch.float32


def test_the_cpu_answer_is_pytorchs_own_check():
    assert fast_cpu_matmul(torch.float32) is True
    assert fast_cpu_matmul(torch.bfloat16) is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert fast_cpu_matmul(torch.float16) is bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _recipe(tmp_path, dtype: str, device: str = "cpu") -> dict:
    return {"model": str(tmp_path / "m"), "output": str(tmp_path / "out"), "steps": [{"identity": {}}],
            "calibration": {"source": "random", "samples": 4, "seq_len": 8, "dtype": dtype, "device": device}}  # fmt: skip


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_the_note_names_the_field_only_where_the_cpu_is_slow(tmp_path, name):
    rec = load_recipe(_recipe(tmp_path, name))
    note = slow_dtype_note(rec, "cpu", SLOW)
    assert note is not None and f"calibration.dtype: {name}" in note and "float32" in note and "\n" not in note
    assert slow_dtype_note(rec, "cpu", FAST) is None
    assert slow_dtype_note(rec, "cuda", SLOW) is None
    assert slow_dtype_note(load_recipe(_recipe(tmp_path, "auto")), "cpu", SLOW) is None
    assert slow_dtype_note(load_recipe(_recipe(tmp_path, "float32")), "cpu", SLOW) is None


def test_the_dry_run_computes_in_what_this_cpu_multiplies_fast(tmp_path, caplog):
    save_tiny("qwen3_moe", tmp_path / "m", dtype=torch.bfloat16)
    slow = not fast_cpu_matmul(torch.bfloat16)
    plan = mc.apply(_recipe(tmp_path, "auto"), dry_run=True, progress=False).report["dry_run"]
    assert plan["compute_dtype"] == ("float32" if slow else "bfloat16")
    with caplog.at_level(logging.WARNING, logger="moecompress.engine.dry_run"):
        plan = mc.apply(_recipe(tmp_path, "bfloat16"), dry_run=True, progress=False).report["dry_run"]
    assert plan["compute_dtype"] == "bfloat16"  # asked for: kept
    said = [r.getMessage() for r in caplog.records if "calibration.dtype" in r.getMessage()]
    assert len(said) == (1 if slow else 0)
    assert not (tmp_path / "out").exists()


def test_the_weights_written_keep_the_checkpoints_dtype(tmp_path):
    from safetensors import safe_open

    save_tiny("qwen3_moe", tmp_path / "m", dtype=torch.bfloat16)
    rec = _recipe(tmp_path, "float32") | {"steps": [{"heapr": {"ratio": 0.25}}]}
    mc.apply(rec, progress=False)
    dtypes = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            dtypes |= {k: h.get_slice(k).get_dtype() for k in h.keys()}
    floats = {k: d for k, d in dtypes.items() if not d.startswith(("I", "U"))}  # not the ragged widths (I32)
    assert any(k.endswith(".experts.gate.rows") for k in floats)  # heapr's ragged experts, pruned in float32
    assert set(floats.values()) == {"BF16"}
