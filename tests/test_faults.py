"""Nothing silent, nothing lost: damaged caches are recomputed, the input cannot be clobbered, one run
per output, resources checked up front, and every fault is one line that leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_tiny

import moecompress as mc
import moecompress.engine.run as run_mod
from moecompress.calibration.cache import load_layer
from moecompress.cli import main
from moecompress.engine import resources
from moecompress.engine.lock import RunLock
from moecompress.errors import CacheError, CheckpointError, Interrupted, LockedError, RecipeError, WriteError

CAL = {"source": "random", "samples": 4, "seq_len": 8}


@pytest.fixture
def model(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "m")
    return tmp_path / "m"


def _rec(model, out, steps=None, **cal):
    return {"model": str(model), "output": str(out), "calibration": {**CAL, **cal},
            "steps": steps or [{"heapr": {"ratio": 0.25, "scope": "layer"}}]}  # fmt: skip


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / ".moecompress-cache").iterdir()) if (root / ".moecompress-cache").exists() else []


# ------------------------------------------------------------------------------------------------ cache
@pytest.mark.parametrize("damage", ["same_shape_values", "truncated", "meta_garbage", "file_removed"])
def test_a_damaged_cache_entry_is_recomputed_and_the_output_equals_a_clean_run(tmp_path, model, damage, caplog):
    clean = mc.apply(_rec(model, tmp_path / "clean"), progress=False).output_dir
    (entry,) = _entries(tmp_path)
    target = entry / "layer-001.safetensors"
    if damage == "same_shape_values":
        stats = load_file(target)
        save_file({k: torch.rand_like(v.float()).to(v.dtype) if v.is_floating_point() else v for k, v in stats.items()},
                  target)  # fmt: skip
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "meta_garbage":
        (entry / "meta.json").write_text("{not json")
    else:
        (entry / "layer-001.grad.safetensors").unlink()
    res = mc.apply(_rec(model, tmp_path / "again"), progress=False)
    assert res.report["calibration"]["cached"] is False, "a damaged entry must not be used"
    assert _hashes(res.output_dir) == _hashes(clean)
    assert any("is damaged" in r.message for r in caplog.records)
    assert len(_entries(tmp_path)) == 1  # the damaged entry was replaced, not left beside the new one
    assert mc.apply(_rec(model, tmp_path / "third"), progress=False).report["calibration"]["cached"] is True


def test_a_cache_file_that_changes_during_a_run_stops_it_with_one_line(tmp_path, model):
    mc.apply(_rec(model, tmp_path / "a"), progress=False)
    (entry,) = _entries(tmp_path)
    (entry / "layer-002.safetensors").write_bytes(b"x" * 64)
    with pytest.raises(CacheError, match=r"layer-002.safetensors changed while this run used it; run again"):
        load_layer(entry, 2)


def test_a_failed_calibration_leaves_no_partial_entry(tmp_path, model):
    shard = model / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.1.mlp.experts.5.gate_proj.weight"][3, 7] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^layer 1: expert 5 gate_proj \(weight\) holds NaN/Inf weights"):
        mc.apply(_rec(model, tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    assert [p.name for p in _entries(tmp_path) if p.name.endswith(".partial")] == []


# ----------------------------------------------------------------------------------- inputs not clobbered
def test_output_equal_to_or_inside_the_input_is_refused_even_with_overwrite(tmp_path, model):
    before = _hashes(model) | {"config.json": hashlib.sha256((model / "config.json").read_bytes()).hexdigest()}
    link = tmp_path / "link"
    link.symlink_to(model)
    for out in (model, model / "sub", link, tmp_path):
        with pytest.raises(RecipeError, match="overlaps the input checkpoint"):
            mc.apply(_rec(model, out), overwrite=True, progress=False)
    for out in (tmp_path / "cache", tmp_path / "cache" / "x"):  # the statistics cache is refused too
        with pytest.raises(RecipeError, match="overlaps the statistics cache"):
            mc.apply(_rec(model, out, cache_dir=str(tmp_path / "cache")), overwrite=True, progress=False)
    after = _hashes(model) | {"config.json": hashlib.sha256((model / "config.json").read_bytes()).hexdigest()}
    assert after == before and sorted(p.name for p in model.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors"]
    )


def test_an_output_that_cannot_be_renamed_into_place_is_refused_up_front(tmp_path, model, small_tmpfs):
    disk = small_tmpfs(1_000_000)
    with pytest.raises(RecipeError, match="is a mount point or the root, which cannot be renamed into place"):
        mc.apply(_rec(model, disk, cache_dir=str(tmp_path / "cache")), overwrite=True, progress=False)
    assert list(disk.iterdir()) == [] and not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------------------------------- the lock
def test_a_second_run_on_the_same_output_fails_at_once_and_leaves_the_first_alone(tmp_path, model):
    out = tmp_path / "out"
    with RunLock(out, f"output {out}"):  # another run holds the output
        staging = tmp_path / ".out.partial"
        staging.mkdir()
        (staging / "theirs").write_text("work in progress")
        with pytest.raises(LockedError, match=rf"output {out} is being written by another run \(pid \d+ on "):
            mc.apply(_rec(model, out), progress=False)
        assert (staging / "theirs").read_text() == "work in progress"
    (staging / "theirs").unlink()
    staging.rmdir()
    mc.apply(_rec(model, out), progress=False)  # once it is gone, the output is free
    assert not (tmp_path / ".out.lock").exists()


def test_a_lock_left_by_a_dead_process_is_not_in_the_way(tmp_path, model):
    out = tmp_path / "out"
    code = f"from moecompress.engine.lock import RunLock; RunLock({str(out)!r}, 'x').acquire(); import os; os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True)  # dies holding it, without cleaning up
    assert (tmp_path / ".out.lock").exists()
    mc.apply(_rec(model, out), progress=False)
    assert (out / "model.safetensors").exists()


# ------------------------------------------------------------------------------------ resources up front
def test_calibration_that_cannot_fit_in_memory_is_refused_before_any_allocation(tmp_path, model):
    rec = _rec(model, tmp_path / "out", samples=1_000_000, seq_len=1_000_000)
    with pytest.raises(RecipeError, match=r"calibration needs about [\d.]+ GiB of memory .* lower calibration.samples"):
        mc.apply(rec, dry_run=True, progress=False)
    with pytest.raises(RecipeError, match=r"GiB are calibration.memory_limit"):
        mc.apply(_rec(model, tmp_path / "out", memory_limit="10KB"), progress=False)
    assert list(tmp_path.iterdir()) == [model]


def test_an_output_larger_than_the_free_disk_is_refused(tmp_path, model):
    rec = mc.load_recipe(_rec(model, tmp_path / "out"))
    plan = mc.apply(_rec(model, tmp_path / "out"), dry_run=True, progress=False).report["dry_run"]
    resources.check(rec, plan, tmp_path, memory=None, disk_free=10**12)  # fits
    with pytest.raises(RecipeError, match=r"needs about [\d.]+ GiB of disk next to .* only 0.00 GiB are free"):
        resources.check(rec, plan, tmp_path, memory=None, disk_free=1000)


# ------------------------------------------------------------------------------------- one line per fault
def test_disk_full_while_writing_is_one_line_and_resume_continues(tmp_path, model, small_tmpfs, monkeypatch):
    disk = small_tmpfs(180_000)  # room for about one shard, not the output
    monkeypatch.setattr(resources, "free_disk", lambda path: 10**12)  # the disk fills after the check
    rec = {**_rec(model, disk / "out", steps=[{"identity": {}}]), "max_shard_size": "40KB"}
    rec["calibration"]["cache_dir"] = str(tmp_path / "cache")
    with pytest.raises(WriteError, match="No space left on device") as err:
        mc.apply(rec, progress=False)
    assert "\n" not in str(err.value) and not (disk / "out").exists()
    kept = (disk / ".out.partial" / "journal.json").is_file()
    assert ("--resume" in str(err.value)) == kept and (disk / ".out.partial").exists() == kept
    subprocess.run(["mount", "-o", "remount,size=10m", str(disk)], check=True)  # space freed
    res = mc.apply(rec, resume=True, progress=False)
    clean = mc.apply({**rec, "output": str(tmp_path / "clean")}, progress=False)
    assert _hashes(res.output_dir) == _hashes(clean.output_dir) and len(_hashes(clean.output_dir)) > 1


def test_a_disk_full_in_the_final_commit_is_one_line_while_the_reports_are_drawn(tmp_path, model, monkeypatch):
    """The shards are finished in a thread while the step reports are drawn (``RecipeRun.finish``): its
    error is the run's, one line, and nothing reaches the output path."""
    import errno

    from moecompress.io.writer import ShardWriter

    drawn = []
    real = run_mod.write_step_report

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.out_dir))

    monkeypatch.setattr(ShardWriter, "commit", full)
    monkeypatch.setattr(run_mod, "write_step_report", lambda *a, **k: drawn.append(1) or real(*a, **k))
    with pytest.raises(WriteError, match="No space left on device") as err:
        mc.apply(_rec(model, tmp_path / "out"), progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists() and drawn


def test_a_read_only_output_location_is_refused_before_calibration(tmp_path, model, small_tmpfs):
    disk = small_tmpfs(100_000, read_only=True)
    with pytest.raises(RecipeError, match=r"cannot write in .* \(Read-only file system\); choose a writable"):
        mc.apply(_rec(model, disk / "out"), progress=False)
    assert not (tmp_path / ".moecompress-cache").exists()


def test_non_utf8_recipe_is_one_line(tmp_path, capsys):
    bad = tmp_path / "r.yaml"
    bad.write_bytes(b"model: m\noutput: \xff\xfe\n")
    assert main(["apply", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not UTF-8 text" in err and "\n" not in err


def test_ctrl_c_is_exit_130_and_leaves_nothing(tmp_path, model, monkeypatch, capsys):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr("moecompress.engine.run.RecipeRun.loop", interrupted)
    (tmp_path / "r.yaml").write_text(json.dumps(_rec(model, tmp_path / "out")))
    assert main(["apply", str(tmp_path / "r.yaml"), "-q"]) == 130
    assert capsys.readouterr().err.strip() == "error: interrupted; nothing was written"
    assert not (tmp_path / ".out.partial").exists() and not (tmp_path / "out").exists()
    assert Interrupted.exit_code == 130


def test_a_failing_step_leaves_no_staging_directory(tmp_path, model):
    class Cfg(mc.PassConfig):
        pass

    def boom(layer, stats, cfg):
        if layer.index == 1:
            raise mc.MoecompressError("deliberate")
        return layer, {}

    with pytest.raises(mc.MoecompressError, match=r"step 1 \(boom\), layer 1: deliberate; nothing was written$"):
        mc.apply(_rec(model, tmp_path / "out", steps=[{"boom": {}}]), passes=[mc.PassSpec("boom", Cfg, boom)],
                 progress=False)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [".moecompress-cache", "m"]


# ----------------------------------------------------------------------------------------- big recipes
def test_step_folders_sort_in_step_order_at_any_count(tmp_path, model):
    res = mc.apply(_rec(model, tmp_path / "out", steps=[{"identity": {}}] * 101), progress=False)
    names = sorted(p.name for p in (res.output_dir / "steps").iterdir())
    assert names[0] == "001-identity" and names[-1] == "101-identity" and len(names) == 101
    assert [int(n.split("-")[0]) for n in names] == list(range(1, 102))
    step = json.loads((res.output_dir / "steps" / "050-identity" / "report.json").read_text())
    assert step["plots"] == [] and "left every layer unchanged" in " ".join(step["notes"])


def test_reports_and_cards_carry_no_local_absolute_paths(tmp_path, model):
    res = mc.apply(_rec(model, tmp_path / "out", cache_dir=str(tmp_path / "cache")), progress=False)
    texts = {p.relative_to(res.output_dir).as_posix(): p.read_text()
             for p in res.output_dir.rglob("*") if p.suffix in (".json", ".md")}  # fmt: skip
    assert {"report.json", "report.md", "README.md"} <= set(texts)
    leaks = [name for name, text in texts.items() if str(tmp_path) in text]
    assert leaks == [], leaks
    run = json.loads(texts["report.json"])
    assert run["model"] == "…/m" and run["recipe"]["calibration"]["cache_dir"] == "…/cache"
    assert res.cache_entry is not None and res.cache_entry.name == run["calibration"]["entry"]


def test_only_model_files_are_copied_unless_asked(tmp_path, model):
    (model / "credentials.json").write_text("{}")
    (model / "notes.txt").write_text("mine")
    res = mc.apply(_rec(model, tmp_path / "out"), progress=False)
    assert not (res.output_dir / "credentials.json").exists() and not (res.output_dir / "notes.txt").exists()
    assert {"credentials.json", "notes.txt"} <= set(res.report["input_files_skipped"])
    assert "`notes.txt`" in (res.output_dir / "report.md").read_text()
    res = mc.apply({**_rec(model, tmp_path / "out2"), "copy_extra": ["notes.txt"]}, progress=False)
    assert (res.output_dir / "notes.txt").read_text() == "mine" and "notes.txt" not in res.report["input_files_skipped"]
    with pytest.raises(RecipeError, match=r"^recipe field 'copy_extra': .*no_such"):
        mc.apply({**_rec(model, tmp_path / "out3"), "copy_extra": ["no_such.txt"]}, dry_run=True, progress=False)


def test_statistics_being_computed_by_another_run_are_not_computed_twice(tmp_path, model):
    entry = mc.apply(_rec(model, tmp_path / "a"), progress=False).cache_entry
    import shutil

    shutil.rmtree(entry)  # gone again: the next run must compute it, but another run is doing so
    with RunLock(entry, "x"), pytest.raises(LockedError, match=rf"statistics cache entry {entry} is being written"):
        mc.apply(_rec(model, tmp_path / "b"), progress=False)
    assert not (tmp_path / "b").exists() and not (tmp_path / ".b.partial").exists()
    assert mc.apply(_rec(model, tmp_path / "b"), progress=False).cache_entry == entry


@pytest.mark.parametrize(
    ("dtype", "bad"),
    [(d, b) for d in (torch.float32, torch.bfloat16, torch.float16) for b in (float("nan"), float("inf"), -float("inf"), None)]
    + [(torch.float8_e4m3fn, float("nan")), (torch.float8_e4m3fn, None)],  # e4m3fn has no Inf
)
def test_all_finite_finds_one_nan_or_inf_in_any_dtype(dtype, bad):
    """The weight check's reduction (min and max) sees one NaN, +Inf or -Inf anywhere in a tensor."""
    from moecompress.calibration.skeleton import all_finite

    t = torch.randn(3, 5, 7).to(dtype)
    if bad is not None:
        t = t.float()
        t[1, 4, 2] = bad
        t = t.to(dtype)
    assert all_finite(t) == (bad is None)
    assert all_finite(torch.zeros(0, dtype=dtype)) and all_finite(torch.arange(4))
