"""tdmoe's default (HOSVD in two phases, expert mode kept) runs on the core install; the configurations that
use tensorly's ``tucker`` name the extra in one line, in the dry run, before any work."""

from __future__ import annotations

import sys

import pytest
from tiny import save_tiny

import moecompress as mc
from moecompress.errors import MissingExtraError
from moecompress.passes import BUILTIN_PASSES

CAL = {"source": "random", "samples": 4, "seq_len": 16, "batch_size": 4}


def test_the_default_runs_without_tensorly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorly", None)  # import tensorly fails, as on the core install
    save_tiny("qwen3_moe", tmp_path / "m")
    res = mc.apply({"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": CAL,
                    "steps": [{"tdmoe": {"ratio": 0.4}}]}, progress=False)  # fmt: skip
    assert res.report["steps"] and (tmp_path / "o" / "config.json").exists()


@pytest.mark.parametrize("cfg", [{"method": "hooi"}, {"r1": 2}, {"budget": "from_structure"}])
def test_what_needs_tensorly_names_the_extra_without_it(tmp_path, monkeypatch, cfg):
    monkeypatch.setitem(sys.modules, "tensorly", None)
    save_tiny("qwen3_moe", tmp_path / "m")
    with pytest.raises(MissingExtraError, match=r'^step 1 \(tdmoe\) needs tensorly, .*pip install "moecompress\[decompose\]"'):
        mc.apply({"model": str(tmp_path / "m"), "output": str(tmp_path / "o"), "calibration": CAL,
                  "steps": [{"tdmoe": {"ratio": 0.4, **cfg}}]}, dry_run=True, progress=False)  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_extras_for_reads_the_configuration():
    spec = BUILTIN_PASSES["tdmoe"]
    assert spec.extras_for(spec.config.model_validate({"ratio": 0.4})) == ()
    assert spec.extras_for(spec.config.model_validate({"ratio": 0.4, "method": "hooi"})) == ("decompose",)
    assert BUILTIN_PASSES["decompose"].extras_for(None) == ("decompose",)
