"""Reports: error metrics, json_safe, step/run report files, missing matplotlib, atomic writes."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from moecompress.methods import metrics
from moecompress.methods.metrics import relative_error, sqnr_db
from moecompress.report import write as rp
from moecompress.report.plots import MATPLOTLIB_MISSING
from moecompress.report.write import json_safe, write_run_report, write_step_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _strict_load(path: Path) -> object:
    """json.loads that refuses NaN/Infinity, i.e. only accepts standard JSON."""

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ------------------------------------------------------------------------------------------ metrics
def test_identical_and_zero_tensors():
    x = torch.randn(4, 5)
    assert sqnr_db(x, x.clone()) == math.inf
    assert relative_error(x, x.clone()) == 0.0
    zero = torch.zeros(3)
    assert sqnr_db(zero, zero) == math.inf
    assert relative_error(zero, zero) == 0.0
    assert relative_error(zero, torch.tensor([0.0, 1.0, 0.0])) == math.inf
    assert sqnr_db(zero, torch.tensor([0.0, 1.0, 0.0])) == -math.inf


def test_known_noise_closed_form():
    ref = torch.ones(1000, dtype=torch.float64)
    noisy = ref + 0.1  # signal 1000, noise 1000 * 0.01 = 10
    assert sqnr_db(ref, noisy) == pytest.approx(20.0, abs=1e-9)
    assert relative_error(ref, noisy) == pytest.approx(0.1, rel=1e-9)
    ref = torch.full((64, 32), 2.0)
    noisy = ref - 0.25  # exact in fp32: signal/noise = 4 / 0.0625 = 64
    assert sqnr_db(ref, noisy) == pytest.approx(10 * math.log10(64), rel=1e-12)
    assert relative_error(ref, noisy) == 0.125
    ref, approx = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])  # signal 25, noise 16
    assert relative_error(ref, approx) == pytest.approx(0.8, rel=1e-12)
    assert sqnr_db(ref, approx) == pytest.approx(10 * math.log10(25 / 16), rel=1e-12)
    # mixed dtypes are compared in float64: bf16 holds 3 and 0 exactly
    assert relative_error(ref, approx.to(torch.bfloat16)) == pytest.approx(0.8, rel=1e-12)


def test_chunked_sums_match_direct(monkeypatch):
    g = torch.Generator().manual_seed(0)
    ref, approx = torch.randn(13, 11, generator=g), torch.randn(13, 11, generator=g)
    r, a = ref.double(), approx.double()
    expected_rel = ((r - a).norm() / r.norm()).item()
    expected_sqnr = 10 * math.log10((r.square().sum() / (r - a).square().sum()).item())
    monkeypatch.setattr(metrics, "_CHUNK", 7)  # 143 elements -> 21 chunks, the last one partial
    assert relative_error(ref, approx) == pytest.approx(expected_rel, rel=1e-12)
    assert sqnr_db(ref, approx) == pytest.approx(expected_sqnr, rel=1e-12)
    assert relative_error(ref.t(), approx.t()) == pytest.approx(expected_rel, rel=1e-12)  # non-contiguous


def test_metric_errors():
    with pytest.raises(ValueError, match=r"shapes differ: reference \[2, 3\], approximation \[3, 2\]"):
        relative_error(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="meta"):
        sqnr_db(torch.zeros(2, device="meta"), torch.zeros(2, device="meta"))


# ---------------------------------------------------------------------------------------- json_safe
class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Gating(str, enum.Enum):
    SOFTMAX = "softmax_topk"


@dataclasses.dataclass(frozen=True)
class Inner:
    scale: torch.Tensor
    tag: Color


@dataclasses.dataclass
class Outer:
    name: str
    inner: Inner
    ids: set[int]


class Opaque:
    def __str__(self) -> str:
        return "opaque!"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (torch.tensor(3.5), 3.5),
        (torch.tensor(7), 7),
        (torch.tensor(True), True),
        (torch.tensor(float("inf")), "inf"),
        (torch.tensor([1.0, float("nan"), float("-inf")]), [1.0, "nan", "-inf"]),
        (torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), [[1, 2], [3, 4]]),
        (torch.tensor([0.5, 1.5], dtype=torch.bfloat16), [0.5, 1.5]),
        (torch.zeros(2, 3, device="meta"), {"shape": [2, 3], "dtype": "torch.float32", "device": "meta"}),
        (np.float32(1.5), 1.5),
        (np.int64(7), 7),
        (np.bool_(True), True),
        (np.float64("inf"), "inf"),
        (np.array([[1, 2], [3, 4]]), [[1, 2], [3, 4]]),
        (np.array(["a", "b"]), ["a", "b"]),
        (np.array([1.5, 2.5], dtype=">f8"), [1.5, 2.5]),
        (np.array([1, None], dtype=object), [1, None]),
        (Path("/models/out"), "/models/out"),
        (Color.RED, "red"),
        (Level.HIGH, 3),
        (Gating.SOFTMAX, "softmax_topk"),
        ({3, 1, 2}, [1, 2, 3]),
        (frozenset({"b", "a"}), ["a", "b"]),
        ({1, "a"}, ["a", 1]),
        (float("inf"), "inf"),
        (float("-inf"), "-inf"),
        (float("nan"), "nan"),
        ((1, 2.5, None), [1, 2.5, None]),
        ({3: "x", Color.RED: Path("p")}, {"3": "x", "red": "p"}),
        (torch.float16, "torch.float16"),
        (Opaque(), "opaque!"),
        (
            Outer("o", Inner(torch.tensor([2.0, float("nan")]), Color.RED), {5, 4}),
            {"name": "o", "inner": {"scale": [2.0, "nan"], "tag": "red"}, "ids": [4, 5]},
        ),
    ],
)
def test_json_safe(value, expected):
    out = json_safe(value)
    assert out == expected
    assert type(out) is type(expected)
    assert json.loads(json.dumps(out, allow_nan=False)) == expected


def test_json_safe_summary_is_chunked(monkeypatch):
    monkeypatch.setattr(metrics, "_CHUNK", 1000)
    t = torch.randn(300, 301, generator=torch.Generator().manual_seed(1))
    out = json_safe(t)
    assert out["min"] == t.min().item() and out["max"] == t.max().item()
    assert out["mean"] == pytest.approx(t.double().mean().item(), abs=1e-12)
    assert out["std"] == pytest.approx(t.double().std(unbiased=False).item(), rel=1e-9)
    assert json_safe(t.numpy())["std"] == out["std"]  # numpy arrays follow the same rules


def test_json_safe_summarises_large_and_high_rank_tensors():
    big = torch.arange(rp.MAX_LIST_ELEMENTS + 1, dtype=torch.float32)
    out = json_safe(big)
    assert out["shape"] == [rp.MAX_LIST_ELEMENTS + 1]
    assert out["numel"] == rp.MAX_LIST_ELEMENTS + 1
    assert (out["min"], out["max"]) == (0.0, float(rp.MAX_LIST_ELEMENTS))
    assert out["mean"] == pytest.approx(rp.MAX_LIST_ELEMENTS / 2)
    cube = json_safe(torch.ones(2, 2, 2, dtype=torch.float16))
    assert cube == {
        "shape": [2, 2, 2],
        "dtype": "torch.float16",
        "numel": 8,
        "min": 1.0,
        "max": 1.0,
        "mean": 1.0,
        "std": 0.0,
    }
    json.dumps(out, allow_nan=False)


# ------------------------------------------------------------------------------------- step reports
def _layers() -> list[dict]:
    return [
        {
            "layer": 3,
            "params_before": 1000,
            "params_after": 750,
            "bytes_before": 4000,
            "bytes_after": 3000,
            "rel_error": 0.01,
            "sqnr_db": 20.0,
            "seconds": 0.1,
            "info": {"widths": torch.tensor([4, 3]), "kept": {2, 0}},
        },
        {
            "layer": 5,
            "params_before": 2000,
            "params_after": 1000,
            "bytes_before": 8000,
            "bytes_after": 4000,
            "rel_error": 0.001,
            "sqnr_db": 30.0,
            "seconds": 0.2,
            "info": {},
        },
        {
            "layer": 7,
            "params_before": 1000,
            "params_after": 1000,
            "bytes_before": 4000,
            "bytes_after": 4000,
            "rel_error": 0.0,
            "sqnr_db": float("inf"),
            "seconds": 0.3,
            "info": {"note": "untouched"},
        },
    ]


def _step(**extra) -> dict:
    report = {
        "step": 2,
        "name": "prune",
        "config": {"ratio": 0.25, "method": "reap"},
        "layers": _layers(),
        "seconds": 1.25,
        "peak_rss_mb": 512.0,
        "summary": {"experts_removed": 4},
        "warnings": ["layer 7: nothing pruned"],
        "plots": [
            {
                "file": "tokens_per_expert.png",
                "kind": "heatmap",
                "title": "Tokens per expert",
                "data": [[1, 2, 3, 4], [4, 3, 2, 1], [0, 5, 0, 5]],
                "xlabel": "expert",
                "ylabel": "layer",
            }
        ],
    }
    return {**report, **extra}


def test_step_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    d = tmp_path / "steps" / "02-prune"
    paths = write_step_report(d, _step())
    names = ["report.json", "report.md", "reconstruction.png", "size.png", "tokens_per_expert.png"]
    assert paths == [d / n for n in names]
    assert sorted(p.name for p in d.iterdir()) == sorted(names)  # no temp files left behind

    data = _strict_load(d / "report.json")
    assert [layer["layer"] for layer in data["layers"]] == [3, 5, 7]
    assert [layer["params_after"] for layer in data["layers"]] == [750, 1000, 1000]
    assert [layer["rel_error"] for layer in data["layers"]] == [0.01, 0.001, 0.0]
    assert [layer["sqnr_db"] for layer in data["layers"]] == [20.0, 30.0, "inf"]
    assert data["layers"][0]["info"] == {"widths": [4, 3], "kept": [0, 2]}
    assert data["config"] == {"ratio": 0.25, "method": "reap"}
    assert data["plots"] == ["reconstruction.png", "size.png", "tokens_per_expert.png"]
    assert data["plot_specs"][0]["data"] == [[1, 2, 3, 4], [4, 3, 2, 1], [0, 5, 0, 5]]
    assert data["notes"] == []
    totals = data["totals"]
    assert (totals["params_before"], totals["params_after"]) == (4000, 2750)
    assert (totals["bytes_before"], totals["bytes_after"]) == (16000, 11000)
    assert totals["params_reduction_pct"] == pytest.approx(31.25)
    assert totals["bytes_reduction_pct"] == pytest.approx(31.25)
    assert totals["seconds"] == pytest.approx(0.6)

    md = (d / "report.md").read_text()
    assert md.startswith("# Step 2: prune\n")
    assert "ratio: 0.25\nmethod: reap" in md
    assert "| 3 | 1,000 → 750 | -25.0% | 3.91 KiB → 2.93 KiB | 1.000e-02 | 20.00 | 0.10 |" in md
    assert "| 5 | 2,000 → 1,000 | -50.0% | 7.81 KiB → 3.91 KiB | 1.000e-03 | 30.00 | 0.20 |" in md
    assert "| 7 | 1,000 → 1,000 | +0.0% | 3.91 KiB → 3.91 KiB | 0.000e+00 | ∞ | 0.30 |" in md
    assert "| **total** | 4,000 → 2,750 | -31.2% | 15.62 KiB → 10.74 KiB |  |  | 0.60 |" in md
    assert "Overall reduction: params 31.2%, bytes 31.2%." in md
    assert "- layer 7: nothing pruned" in md
    assert "experts_removed: 4" in md
    for link in (
        "![Reconstruction error per layer](reconstruction.png)",
        "![Parameters per layer](size.png)",
        "![Tokens per expert](tokens_per_expert.png)",
    ):
        assert link in md

    assert _png_size(d / "reconstruction.png") == (800, 600)
    assert _png_size(d / "size.png") == (800, 450)
    assert _png_size(d / "tokens_per_expert.png") == (800, 450)
    assert min((d / n).stat().st_size for n in names[2:]) > 5000


def test_heatmap_draws_the_data(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    spec = {
        "file": "h.png",
        "kind": "heatmap",
        "title": "t",
        "data": torch.eye(4),
        "xlabel": "",
        "ylabel": "",
    }
    write_step_report(tmp_path, _step(plots=[spec]))
    pixels = image.imread(tmp_path / "h.png")[..., :3]
    colours = {tuple(np.round(p, 2)) for p in pixels.reshape(-1, 3)}
    assert len(colours) > 50  # a colour map and colour bar, not a blank canvas


def test_bad_plot_specs_are_noted_not_fatal(tmp_path):
    pytest.importorskip("matplotlib")
    specs = [
        {"file": "../escape.png", "kind": "bar", "data": [1, 2]},
        {"file": "size.png", "kind": "bar", "data": [1, 2]},
        {"file": "pie.png", "kind": "pie", "data": [1, 2]},
        {"file": "ragged.png", "kind": "heatmap", "data": [[1, 2], [3]]},
        {"file": "flat.png", "kind": "heatmap", "data": [1, 2, 3]},
        {"file": "ok.png", "kind": "line", "data": [[1, 2, 3], [3, 2, 1]], "title": "two series"},
    ]
    paths = write_step_report(tmp_path, _step(plots=specs))
    assert [p.name for p in paths] == ["report.json", "report.md", "reconstruction.png", "size.png", "ok.png"]
    assert not (tmp_path.parent / "escape.png").exists()
    notes = _strict_load(tmp_path / "report.json")["notes"]
    assert len(notes) == 5
    assert notes[0].startswith("plot '../escape.png' skipped")
    assert notes[1] == "plot size.png skipped: that file is already written by this report"
    assert notes[2].startswith("plot pie.png skipped: kind 'pie'")
    assert notes[3].startswith("plot ragged.png skipped: ValueError")
    assert notes[4].startswith("plot flat.png skipped: ValueError: heatmap data of shape [3]")
    assert "![two series](ok.png)" in (tmp_path / "report.md").read_text()


def test_missing_matplotlib_still_writes_json_and_md(tmp_path, monkeypatch):
    with contextlib.suppress(ImportError):  # cache the submodules: they must not hide the missing package
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = write_step_report(tmp_path, _step())
    assert [p.name for p in paths] == ["report.json", "report.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]
    data = _strict_load(tmp_path / "report.json")
    assert data["plots"] == []
    assert data["notes"] == ["plots skipped: matplotlib not installed (pip install moecompress[plots])"]
    assert data["notes"] == [MATPLOTLIB_MISSING]
    assert data["plot_specs"][0]["file"] == "tokens_per_expert.png"  # the data survives in the JSON
    md = (tmp_path / "report.md").read_text()
    assert f"- {MATPLOTLIB_MISSING}" in md
    assert "![" not in md
    assert "| 5 | 2,000 → 1,000 | -50.0% |" in md


def test_empty_layers(tmp_path):
    report = {"step": 1, "name": "analyze", "config": {}, "layers": [], "seconds": 0.0, "peak_rss_mb": 1.0}
    paths = write_step_report(tmp_path, report)
    data = _strict_load(tmp_path / "report.json")
    assert data["layers"] == []
    assert data["totals"]["params_before"] is None
    assert data["totals"]["params_reduction_pct"] is None
    md = (tmp_path / "report.md").read_text()
    assert "_No MoE layers in this step._" in md
    assert "## Warnings" not in md
    if data["notes"] != [MATPLOTLIB_MISSING]:
        assert [p.name for p in paths] == ["report.json", "report.md", "reconstruction.png", "size.png"]
        assert _png_size(tmp_path / "size.png") == (800, 450)


def test_non_finite_values_give_valid_json(tmp_path):
    layers = _layers()
    layers[0] = {**layers[0], "rel_error": float("nan"), "sqnr_db": float("-inf")}
    write_step_report(tmp_path, _step(layers=layers, summary={"worst": float("inf")}))
    data = _strict_load(tmp_path / "report.json")
    assert (data["layers"][0]["rel_error"], data["layers"][0]["sqnr_db"]) == ("nan", "-inf")
    assert data["summary"] == {"worst": "inf"}
    assert (
        "| 3 | 1,000 → 750 | -25.0% | 3.91 KiB → 2.93 KiB | nan | -∞ | 0.10 |"
        in (tmp_path / "report.md").read_text()
    )


def test_writes_are_atomic(tmp_path, monkeypatch):
    (tmp_path / "report.json").write_text('{"old": true}')

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("moecompress.report.plots.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_run_report(tmp_path, {"steps": []})
    assert (tmp_path / "report.json").read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


# -------------------------------------------------------------------------------------- run reports
def test_run_report(tmp_path):
    recipe = {"model": "tiny", "steps": [{"analyze": {}}, {"prune": {"ratio": 0.25}}]}
    run = {
        "recipe": recipe,
        "model": "tiny-qwen3",
        "output": str(tmp_path / "out"),
        "moecompress_version": "0.1.0",
        "steps": [
            {
                "step": 1,
                "name": "analyze",
                "report": "steps/01-analyze/report.md",
                "params_before": 4000,
                "params_after": 4000,
                "bytes_before": 16000,
                "bytes_after": 16000,
                "seconds": 0.5,
            },
            {
                "step": 2,
                "name": "prune",
                "report": "steps/02-prune/report.md",
                "params_before": 4000,
                "params_after": 3000,
                "bytes_before": 16000,
                "bytes_after": 12000,
                "seconds": 1.5,
            },
        ],
        "total_seconds": 2.5,
        "peak_rss_mb": 700.0,
        "calibration": {"source": "builtin", "samples": 16},
        "warnings": ["calibration set is small"],
    }
    paths = write_run_report(tmp_path, run)
    assert paths == [tmp_path / "report.json", tmp_path / "report.md"]
    data = _strict_load(tmp_path / "report.json")
    assert data["steps"] == run["steps"]
    assert data["recipe"] == recipe
    assert data["total_seconds"] == 2.5
    assert data["totals"]["params_before"] == 4000
    assert data["totals"]["params_after"] == 3000
    assert data["totals"]["bytes_reduction_pct"] == pytest.approx(25.0)
    assert data["totals"]["seconds"] == pytest.approx(2.0)

    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# moecompress run report\n")
    assert "- model: `tiny-qwen3`" in md
    assert "| 1 | [analyze](steps/01-analyze/report.md) | 4,000 → 4,000 | +0.0% |" in md
    assert (
        "| 2 | [prune](steps/02-prune/report.md) | 4,000 → 3,000 | -25.0% | 15.62 KiB → 11.72 KiB | -25.0% | 1.50 |"
        in md
    )
    assert "| **run** |  | 4,000 → 3,000 | -25.0% |" in md
    assert "- calibration set is small" in md
    recipe_block = md.split("## Recipe\n\n```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(recipe_block) == recipe
    assert recipe_block.startswith("model: tiny\nsteps:")  # sort_keys=False keeps the recipe's order


def test_empty_run_report(tmp_path):
    write_run_report(tmp_path, {"recipe": {}, "steps": [], "warnings": []})
    assert _strict_load(tmp_path / "report.json")["totals"]["params_before"] is None
    assert "_No steps._" in (tmp_path / "report.md").read_text()
