"""``calibration.source: none``: data-free runs read no token, calibrate nothing, cache nothing, and say
that reconstruction errors were not measured; the dry run refuses a step that needs statistics."""

from __future__ import annotations

import json
import logging

import pytest
from tiny import save_tiny

import moecompress as mc
from moecompress.errors import RecipeError

NONE = {"source": "none"}
CAL = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("data_free") / "m"
    save_tiny("qwen3_moe", path, num_hidden_layers=2)
    return path


def _rec(model, out, steps, cal, cache):
    return {"model": str(model), "output": str(out), "steps": steps, "calibration": {**cal, "cache_dir": str(cache)}}


def _weights(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_none_reads_no_token_runs_no_sweep_and_caches_nothing(tiny_qwen, tmp_path, monkeypatch):
    import moecompress.engine.executor as ex

    def boom(*a, **k):
        raise AssertionError("a data-free run must not touch calibration")

    for name in ("load_token_ids", "source_fingerprint", "run_calibration"):
        monkeypatch.setattr(ex, name, boom)
    cache = tmp_path / "cache"
    res = mc.apply(_rec(tiny_qwen, tmp_path / "o", [{"rtn": {"bits": 4}}], NONE, cache), progress=False)
    assert res.cache_entry is None
    assert not cache.exists()  # no statistics cache entry, not even the directory
    cal = res.report["calibration"]
    assert cal["source"] == "none" and cal["reconstruction_errors"] is None and "not measured" in cal["reconstruction_note"]


def test_none_report_errors_are_null_not_zero(tiny_qwen, tmp_path):
    rec = _rec(tiny_qwen, tmp_path / "o", [{"identity": {}}, {"rtn": {"bits": 4}}], NONE, tmp_path / "c")
    res = mc.apply(rec, progress=False)
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["calibration"]["reconstruction_errors"] is None
    for step in ("01-identity", "02-rtn"):
        rows = json.loads((tmp_path / "o" / "steps" / step / "report.json").read_text())["layers"]
        assert rows and all(r["rel_error"] is None and r["sqnr_db"] is None for r in rows)
    md = (tmp_path / "o" / "steps" / "02-rtn" / "report.md").read_text()
    assert "0.000e+00" not in md  # unknown errors are shown as "—", never as a perfect 0
    assert res.report["dry_run"]["calibration_tokens"] == 0 and res.report["dry_run"]["statistics"] == []


def test_none_output_weights_byte_identical_to_calibrated_rtn(tiny_qwen, tmp_path):
    """rtn is data-free: the statistics a calibrated run collects change no output byte."""
    steps = [{"rtn": {"bits": 4, "group_size": 16}}]
    a = mc.apply(_rec(tiny_qwen, tmp_path / "a", steps, NONE, tmp_path / "c"), progress=False)
    b = mc.apply(_rec(tiny_qwen, tmp_path / "b", steps, CAL, tmp_path / "c"), progress=False)
    wa, wb = _weights(a.output_dir), _weights(b.output_dir)
    assert wa and wa == wb
    # the configs differ only by the recipe hash in the provenance (the recipes differ in their source)
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a.output_dir, b.output_dir))
    for c in (ca, cb):
        c["moecompress"]["recipe_hash"] = None
    assert ca == cb
    # the calibrated run measured its errors; the data-free one did not
    rows = {d: json.loads((d / "steps" / "01-rtn" / "report.json").read_text())["layers"] for d in (a.output_dir, b.output_dir)}
    assert all(r["rel_error"] is None for r in rows[a.output_dir])
    assert all(r["rel_error"] > 0 for r in rows[b.output_dir])


def test_none_identity_is_lossless(tiny_qwen, tmp_path):
    res = mc.apply(_rec(tiny_qwen, tmp_path / "o", [{"identity": {}}], NONE, tmp_path / "c"), progress=False)
    for p in sorted(tiny_qwen.glob("*.safetensors")):
        assert (res.output_dir / p.name).read_bytes() == p.read_bytes()


@pytest.mark.parametrize(
    ("step", "stat"),
    [
        ({"expert_prune": {"ratio": 0.25, "method": "reap"}}, "'expert_counts' (and 1 more: reap_saliency)"),
        ({"codequant": {"bits": 4}}, "'io_sample'"),
        ({"analyze": {}}, "'expert_counts'"),
    ],
)
def test_dry_run_refuses_none_for_a_step_that_needs_statistics(tiny_qwen, tmp_path, step, stat):
    rec = _rec(tiny_qwen, tmp_path / "o", [{"rtn": {"bits": 4}}, step], NONE, tmp_path / "c")
    with pytest.raises(RecipeError) as err:
        mc.apply(rec, dry_run=True, progress=False)
    msg = str(err.value)
    name = next(iter(step))
    assert "\n" not in msg
    assert f"calibration.source: none, but step 2 ({name}) needs the statistic {stat}" in msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


def test_calibrate_refuses_none(tiny_qwen, tmp_path):
    with pytest.raises(RecipeError, match="nothing to calibrate"):
        mc.calibrate(_rec(tiny_qwen, tmp_path / "o", [{"rtn": {}}], NONE, tmp_path / "c"), progress=False)


def test_dry_run_of_none_estimates_no_calibration(tiny_qwen, tmp_path):
    dry = mc.apply(_rec(tiny_qwen, tmp_path / "o", [{"rtn": {}}], NONE, tmp_path / "c"), dry_run=True,
                   progress=False).report["dry_run"]  # fmt: skip
    assert dry["calibration_memory_bytes"] == 0 and not dry["backward"] and dry["statistics"] == []
    assert dry["step_memory"]  # the step's own estimate is still there


def test_builtin_default_still_calibrates_and_hints(tiny_qwen, tmp_path, caplog):
    """Decided: the default source keeps calibrating a data-free recipe (its reports measure the
    reconstruction error on held-back tokens); it logs that ``source: none`` would skip it."""
    with caplog.at_level(logging.INFO, logger="moecompress.engine.executor"):
        res = mc.apply(_rec(tiny_qwen, tmp_path / "o", [{"rtn": {}}], CAL, tmp_path / "c"), progress=False)
    assert res.report["dry_run"]["data_free_steps"] is True
    assert "calibration.source: none would skip calibration" in caplog.text
    rows = json.loads((tmp_path / "o" / "steps" / "01-rtn" / "report.json").read_text())["layers"]
    assert all(isinstance(r["rel_error"], float) and r["rel_error"] > 0 for r in rows)
    assert res.cache_entry is not None


def test_card_says_data_free(tiny_qwen, tmp_path):
    mc.apply(_rec(tiny_qwen, tmp_path / "o", [{"rtn": {}}], NONE, tmp_path / "c"), progress=False)
    card = (tmp_path / "o" / "README.md").read_text()
    assert "source: `none` (data-free steps only)" in card and "samples:" not in card.split("## Calibration")[1][:300]
