"""``svd_experts`` on layers held by chunks of experts (issue 37): ``ranks: uniform`` byte-identical to the
whole layer; ``ranks: balanced`` gives each chunk its share of the whole layer's total rank (ranks within
one of the whole layer's, the layer's total equal to it); the dry run's peak follows the chunk size."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from safetensors import safe_open
from tiny import save_tiny

import moecompress as mc

CAL = {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4}
E = 8  # the tiny models' routed experts
PROTECT = {"protect_super_experts": {"manual": [{"layer": 1, "experts": [2, 6]}]}}


def _recipe(model, out, steps, chunk, cache):
    return {"model": str(model), "output": str(out), "steps": steps, "expert_chunk": chunk,
            "calibration": {**CAL, "cache_dir": str(cache)}}  # fmt: skip


def _run(model, out, steps, chunk, cache):
    return mc.apply(_recipe(model, out, steps, chunk, cache), progress=False)


def _tensors(out):
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                got[k] = st.get_tensor(k)
    return got


def _config(out):
    cfg = json.loads((out / "config.json").read_text())
    cfg.get("moecompress", {}).pop("recipe_hash", None)  # the recipe differs in expert_chunk
    return cfg


def _svd_rows(out):
    (f,) = [f for f in out.glob("steps/*/report.json") if "svd_experts" in f.parent.name]
    return json.loads(f.read_text())["layers"]


def _tiny(model_type, path):
    extra = {"num_experts_per_tok": 2} if model_type == "deepseek_v3" else {}
    save_tiny(model_type, path, num_hidden_layers=2, **extra)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_uniform_ranks_by_chunks_equal_the_whole_layer(tmp_path, model_type):
    _tiny(model_type, tmp_path / "m")
    steps = [PROTECT, {"svd_experts": {"ratio": 0.4, "ranks": "uniform"}}]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    for chunk in (1, 3):  # chunk 1: chunks of one protected expert
        out = tmp_path / f"chunk{chunk}"
        _run(tmp_path / "m", out, steps, chunk, tmp_path / "c")
        names = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
        assert names == sorted(p.name for p in out.glob("*.safetensors"))
        for name in names:
            assert (tmp_path / "whole" / name).read_bytes() == (out / name).read_bytes(), (chunk, name)
        assert _config(tmp_path / "whole") == _config(out)
        for ra, rb in zip(_svd_rows(tmp_path / "whole"), _svd_rows(out), strict=True):
            for k in ("layer", "params_before", "params_after", "bytes_before", "bytes_after", "changed"):
                assert ra[k] == rb[k], k
            ia, ib = ra["info"], rb["info"]
            assert ia.keys() == ib.keys()
            for k, v in ia.items():
                if k == "whitened_rel_error":  # means over experts, summed in another order
                    assert ib[k] == pytest.approx(v, rel=1e-6)
                else:
                    assert ib[k] == v, k


def _budget(out, inn, n, ratio=0.4):
    """``⌊c·n⌋``: the total rank of ``n`` decomposed ``[out, in]`` experts under ``ranks: balanced``."""
    return math.floor((1 - Fraction(repr(ratio))) * out * inn / (out + inn) * n)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_balanced_ranks_by_chunks_spend_the_whole_layers_total(tmp_path, model_type):
    _tiny(model_type, tmp_path / "m")
    steps = [PROTECT, {"svd_experts": {"ratio": 0.4}}]
    _run(tmp_path / "m", tmp_path / "whole", steps, "off", tmp_path / "c")
    whole_rows, whole_t = _svd_rows(tmp_path / "whole"), _tensors(tmp_path / "whole")
    for chunk in (3, 4):
        out = tmp_path / f"chunk{chunk}"
        _run(tmp_path / "m", out, steps, chunk, tmp_path / "c")
        got = _tensors(out)
        assert got.keys() == whole_t.keys()
        for ra, rb in zip(whole_rows, _svd_rows(out), strict=True):
            prot = set(ra["info"]["protected"])
            assert rb["info"]["protected"] == ra["info"]["protected"]
            for name, ranks in ra["info"]["ranks"].items():
                mine = rb["info"]["ranks"][name]
                assert [r is None for r in mine] == [e in prot for e in range(E)]
                assert all(abs(a - b) <= 1 for a, b in zip(ranks, mine) if a is not None)  # ⌊c⌋ or ⌊c⌋ + 1
                key = next(k for k in got if f"layers.{ra['layer']}." in k and k.endswith(f".{name}.ut"))
                r_out = got[key].shape[1]  # ut [R, out]
                r_in = got[key.removesuffix(".ut") + ".v"].shape[1]
                whole = _budget(r_out, r_in, E - len(prot))
                assert sum(r or 0 for r in ranks) == whole == whole_t[key].shape[0]
                assert sum(r or 0 for r in mine) == whole == got[key].shape[0]  # the whole layer's total
                for a in range(0, E, chunk):  # each chunk: ⌊c·(before + n)⌋ − ⌊c·before⌋
                    before = sum(e not in prot for e in range(a))
                    n = sum(e not in prot for e in range(a, min(a + chunk, E)))
                    share = _budget(r_out, r_in, before + n) - _budget(r_out, r_in, before)
                    assert sum(r or 0 for r in mine[a : a + chunk]) == share, (chunk, a)
            dec = sum(sum(r for r in rs if r is not None) * (got[k].shape[1] + got[k.removesuffix(".ut") + ".v"].shape[1])
                      for n, rs in rb["info"]["ranks"].items()
                      for k in got if f"layers.{ra['layer']}." in k and k.endswith(f".{n}.ut"))  # fmt: skip
            assert rb["info"]["decomposed_after"] == dec
            assert rb["info"]["decomposed_before"] == ra["info"]["decomposed_before"]
        # the protected experts and everything but the routed experts' factors are the whole layer's
        for k, t in whole_t.items():
            if not (k.endswith(".ut") or k.endswith(".v") or k.endswith(".ranks")):
                assert got[k].dtype == t.dtype and got[k].shape == t.shape and (got[k] == t).all(), k


def test_dry_run_states_the_chunks_peak(tmp_path):
    _tiny("qwen3_moe", tmp_path / "m")
    steps, label = [{"svd_experts": {"ratio": 0.4}}], "step 1 (svd_experts)"

    def plan(chunk):
        rec = _recipe(tmp_path / "m", tmp_path / "o", steps, chunk, tmp_path / "c")
        return mc.apply(rec, dry_run=True, progress=False).report["dry_run"]

    whole = plan("off")
    assert whole["expert_chunk"] == {}
    w = whole["step_memory"][label]
    peaks = []
    for n in (1, 2, 4):  # the step's peak for the chunk size: its input, SVD workspace and output shrink
        chunked = plan(n)
        assert set(chunked["expert_chunk"].values()) == {n} and chunked["step_memory"][label]["chunk"] == n
        peaks.append(chunked["step_memory"][label]["bytes"])
    assert peaks == sorted(set(peaks)) and peaks[-1] < w["bytes"]
    # auto: just below the whole layer's estimate, the layer is held by chunks that fit
    limit = w["bytes"] - 1
    auto = mc.apply({**_recipe(tmp_path / "m", tmp_path / "o", steps, "auto", tmp_path / "c"),
                     "calibration": {**CAL, "cache_dir": str(tmp_path / "c"), "memory_limit": limit}},
                    dry_run=True, progress=False).report["dry_run"]  # fmt: skip
    assert auto["expert_chunk"] and auto["step_memory"][label]["bytes"] <= limit
