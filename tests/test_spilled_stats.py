"""Per-expert covariances of a layer calibrated by chunks of experts (issue 37): written apart chunk by
chunk (``StatsCollector.spill``, ``cache.save_experts``), read back by rows (``cache.ExpertRows``), bit for
bit what the whole-layer sweep gives; a chunked ``gptq`` run on them writes the whole-layer run's bytes."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny

import moecompress as mc
from moecompress.calibration.cache import ExpertRows, LayerRows, load_layer, save_experts, save_layer
from moecompress.calibration.skeleton import Skeleton
from moecompress.calibration.stats import SPILLED
from moecompress.calibration.sweep import Batches, run_calibration
from moecompress.engine import resources
from moecompress.errors import CacheError

NEEDS = {"expert_in_cov", "down_in_cov", "expert_counts", "act_sq_mean", "router_prob_mean", "router_entropy",
         "holdout"}  # fmt: skip


def _calibrate(ckpt, chunks, spilled=None):
    fwd = {}
    ids = torch.randint(3, 128, (6, 12), generator=torch.Generator().manual_seed(0))
    save = None if spilled is None else (lambda i, a, s: spilled.setdefault(i, []).append((a, s)))
    run_calibration(Skeleton(ckpt, torch.float32), Batches.make(ids, holdout=2, batch_size=2), NEEDS,
                    save_forward=fwd.__setitem__, save_backward=lambda i, s: None, save_experts=save,
                    progress=False, expert_chunks=chunks)  # fmt: skip
    return fwd


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_spilled_rows_equal_the_whole_layer(tmp_path, model_type):
    save_tiny(model_type, tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    whole = _calibrate(ckpt, {})
    e = ckpt.adapter.num_experts
    for size in (1, 3):
        spilled: dict = {}
        fwd = _calibrate(ckpt, dict.fromkeys(ckpt.moe_layer_indices, size), spilled)
        for i in ckpt.moe_layer_indices:
            assert not set(SPILLED) & set(fwd[i]), "the layer's statistics leave the spilled ones out"
            for k, want in whole[i].items():
                if k not in SPILLED:
                    assert torch.equal(fwd[i][k], want), (size, i, k)
            starts = [a for a, _ in spilled[i]]
            assert starts == list(range(e))  # one hand-out per expert, in order
            for name in SPILLED:
                got = torch.cat([s[name] for _, s in spilled[i]])
                assert got.dtype == torch.float32 and torch.equal(got, whole[i][name]), (size, i, name)


def test_rows_cross_file_boundaries_and_hashes_are_checked(tmp_path):
    entry = tmp_path / "entry"
    entry.mkdir()
    full = {"expert_in_cov": torch.randn(7, 4, 4), "down_in_cov": torch.randn(7, 3, 3)}
    for a in range(0, 7, 3):
        save_experts(entry, 5, a, {k: v[a : a + 3] for k, v in full.items()})
    save_experts(entry, 5, 7, {})  # nothing to write
    rows = ExpertRows(entry, 5)
    assert rows.num_experts == 7 and set(rows.names) == set(SPILLED)
    for a, b in ((0, 7), (1, 5), (3, 6), (6, 7), (2, 3)):
        got = rows.rows(a, b)
        for k, v in full.items():
            assert torch.equal(got[k], v[a:b]), (a, b, k)
    assert set(rows.rows(1, 2, {"down_in_cov"})) == {"down_in_cov"}
    assert torch.equal(load_layer(entry, 5)["expert_in_cov"], full["expert_in_cov"])
    assert "expert_in_cov" not in load_layer(entry, 5, experts=False)
    assert not ExpertRows(entry, 4)
    # a file that changes under a published entry stops the read with one line naming it
    files = sorted(p.name for p in entry.glob("layer-*.safetensors"))
    (entry / "meta.json").write_text(json.dumps({"files": dict.fromkeys(files, "0" * 64), "stats": []}))
    with pytest.raises(CacheError, match=r"layer-005\.experts-000000-000003"):
        ExpertRows(entry, 5).rows(0, 1)


def test_a_layer_file_read_by_rows_keeps_only_the_asked_rows_and_checks_its_hash(tmp_path):
    """A layer calibrated whole but worked by units (under torchrun, or ``expert_chunk`` after a whole
    calibration): ``load_layer(skip=SPILLED)`` leaves the covariances in the file (hashed as it streams) and
    :class:`LayerRows` reads each unit's rows."""
    entry = tmp_path / "entry"
    entry.mkdir()
    full = {"expert_in_cov": torch.randn(7, 4, 4), "down_in_cov": torch.randn(7, 3, 3), "act_sq_mean": torch.randn(7, 3)}
    save_layer(entry, 2, full)
    light = load_layer(entry, 2, experts=False, skip=frozenset(SPILLED))
    assert set(light) == {"act_sq_mean"} and torch.equal(light["act_sq_mean"], full["act_sq_mean"])
    rows = LayerRows(entry, 2, frozenset(SPILLED))
    assert rows and rows.num_experts == 7 and set(rows.names) == set(SPILLED)
    for a, b in ((0, 7), (2, 5), (6, 7)):
        got = rows.rows(a, b)
        assert all(torch.equal(got[k], full[k][a:b]) for k in SPILLED), (a, b)
    assert set(rows.rows(1, 2, {"down_in_cov"})) == {"down_in_cov"}
    assert not LayerRows(entry, 3, frozenset(SPILLED))
    (entry / "meta.json").write_text(json.dumps({"files": {"layer-002.safetensors": "0" * 64}, "stats": []}))
    with pytest.raises(CacheError, match=r"layer-002\.safetensors changed"):
        load_layer(entry, 2, experts=False, skip=frozenset(SPILLED))


def _apply(model, out, chunk, cache, steps):
    rec = {"model": str(model), "output": str(out), "steps": steps, "expert_chunk": chunk,
           "calibration": {"source": "random", "samples": 4, "seq_len": 8, "batch_size": 4, "cache_dir": str(cache)}}  # fmt: skip
    return mc.apply(rec, progress=False)


def test_chunked_gptq_on_spilled_statistics_writes_the_whole_layer_bytes(tmp_path):
    save_tiny("deepseek_v3", tmp_path / "m", num_hidden_layers=2, num_experts_per_tok=2)
    steps = [{"gptq": {"bits": 4, "group_size": 16}}]
    _apply(tmp_path / "m", tmp_path / "whole", "off", tmp_path / "c1", steps)
    _apply(tmp_path / "m", tmp_path / "chunk", 3, tmp_path / "c2", steps)  # its own cache: calibrated by chunks
    (entry,) = [p for p in (tmp_path / "c2").iterdir() if p.is_dir()]
    apart = sorted(p.name for p in entry.glob("layer-001.experts-*.safetensors"))
    assert apart == [f"layer-001.experts-{e:06d}-{e + 1:06d}.safetensors" for e in range(8)]
    assert "expert_in_cov" not in load_layer(entry, 1, experts=False)
    # the whole calibration's entry reused by a run by chunks: the covariances read by rows from the layer file
    _apply(tmp_path / "m", tmp_path / "rows", 3, tmp_path / "c1", steps)
    assert len([p for p in (tmp_path / "c1").iterdir() if p.is_dir()]) == 1
    names = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    for name in names:
        for other in ("chunk", "rows"):
            assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / other / name).read_bytes(), (other, name)


def test_estimate_counts_one_chunk_of_the_per_expert_covariances(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    rec = mc.load_recipe({"model": str(ckpt.path), "output": str(tmp_path / "o"), "steps": [{"gptq": {"bits": 4}}],
                          "calibration": {"source": "random", "samples": 8, "seq_len": 16}})  # fmt: skip
    e, h = ckpt.adapter.num_experts, ckpt.raw_config["hidden_size"]
    sizes = {"expert_in_cov": e * h * h * 4}
    moe = ckpt.moe_layer_indices
    whole = resources.estimate(rec, ckpt, torch.float32, chunks={}, stats=sizes)
    one = resources.estimate(rec, ckpt, torch.float32, chunks=dict.fromkeys(moe, 1), stats=sizes)
    two = resources.estimate(rec, ckpt, torch.float32, chunks=dict.fromkeys(moe, 2), stats=sizes)
    assert whole["calibration_stats_bytes"] == resources.collector_bytes(sizes, "forward")
    assert one["calibration_stats_bytes"] == 2 * h * h * 4  # a chunk's float64 sums, then its rows
    assert two["calibration_stats_bytes"] == 2 * 2 * h * h * 4


def test_calibration_cap_is_balanced(tmp_path):
    """``expert_chunk: auto``'s calibration chunk: as many chunks as the largest fitting size needs, of equal
    size (8 experts, 5 fit: two chunks of 4, not 5 + 3)."""
    from moecompress.engine import units

    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    rec = mc.load_recipe({"model": str(ckpt.path), "output": str(tmp_path / "o"), "steps": [{"gptq": {"bits": 4}}],
                          "calibration": {"source": "random", "samples": 8, "seq_len": 16}})  # fmt: skip
    e, h = ckpt.adapter.num_experts, ckpt.raw_config["hidden_size"]
    sizes = {"expert_in_cov": e * h * h * 4}
    moe = ckpt.moe_layer_indices

    def need(n):
        return resources.estimate(rec, ckpt, torch.float32, chunks=dict.fromkeys(moe, n), stats=sizes)[
            "calibration_memory_bytes"]

    assert e == 8 and need(4) < need(5) < need(6)
    assert units.calibration_cap(rec, ckpt, torch.float32, need(5), sizes) == 4
    assert units.calibration_cap(rec, ckpt, torch.float32, need(2), sizes) == 2


def test_the_statistics_cache_is_counted_on_the_output_disk(tmp_path):
    """gptq's per-expert Hessians are 221 MB per DeepSeek-V3 expert on disk: the dry run states the cache's
    size, and a disk that cannot hold it is refused in one line naming calibration.cache_dir."""
    from moecompress.engine.dry_run import dry_run
    from moecompress.errors import RecipeError

    save_tiny("qwen3_moe", tmp_path / "m", num_hidden_layers=2)
    ckpt = mc.open_checkpoint(tmp_path / "m")
    rec = mc.load_recipe({"model": str(ckpt.path), "output": str(tmp_path / "o"), "steps": [{"gptq": {"bits": 4}}],
                          "calibration": {"source": "random", "samples": 8, "seq_len": 16}})  # fmt: skip
    plan = dry_run(rec, ckpt)
    e, h = ckpt.adapter.num_experts, ckpt.raw_config["hidden_size"]
    assert plan["statistics_cache_bytes"] >= len(ckpt.moe_layer_indices) * e * h * h * 4
    big = {**plan, "statistics_cache_bytes": 2 * 1024**3}
    resources.check(rec, big, tmp_path, memory=None, disk_free=3 * 1024**3 + 1)  # fits with the checkpoint
    with pytest.raises(RecipeError, match=r"GiB of calibration statistics.*calibration\.cache_dir") as err:
        resources.check(rec, big, tmp_path, memory=None, disk_free=2 * 1024**3)
    assert "\n" not in str(err.value)
