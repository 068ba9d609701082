"""Runs over two ``torch.distributed`` ranks (gloo, one thread each) write the bytes of one process.

Each rank is a ``moecompress apply`` subprocess with the variables ``torchrun`` sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); one test goes through ``torchrun``
itself. Every run has its own statistics cache, so the two-rank run calibrates data-parallel.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load, save
from tiny import save_tiny

import moecompress as mc
from moecompress.calibration.stats import StatsCollector
from moecompress.engine.distributed import Launch
from moecompress.errors import Interrupted, RecipeError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.reference import moe_forward

CAL = {"source": "random", "samples": 10, "seq_len": 12, "batch_size": 2, "holdout": 2}
# 5 batches: two ranks get 3 and 2 (an uneven last round), one of them held back

# rank 1 of the killed-rank test: it dies (as a crashed or OOM-killed process does) in its 3rd round
DIE = r"""
import os, sys
from moecompress.calibration.stats import StatsCollector
from moecompress.cli import main
take, calls = StatsCollector.take_round, []
def dying(self):
    calls.append(1)
    if len(calls) == 3:
        os._exit(9)
    return take(self)
StatsCollector.take_round = dying
sys.exit(main(sys.argv[1:]))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}  # fmt: skip


def _two_ranks(recipe, *extra, die: bool = False, timeout: int = 240) -> list[subprocess.CompletedProcess]:
    port = _port()
    procs = []
    for rank in (0, 1):
        code = ["-c", DIE] if die and rank == 1 else ["-m", "moecompress.cli"]
        cmd = [sys.executable, *code, "apply", str(recipe), "--quiet", *extra]
        procs.append(subprocess.Popen(cmd, env=_env(rank, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


def _bytes(p) -> bytes:
    """A file's bytes; a config without its ``recipe_hash`` (the two recipes name different outputs)."""
    data = p.read_bytes()
    if p.name == "config.json":
        text = data.decode()
        cfg = json.loads(text)
        digest = cfg.get("moecompress", {}).pop("recipe_hash", None)
        assert digest is not None and text.count(digest) == 1
        data = text.replace(digest, "").encode()
    return data


def _hashes(path) -> dict[str, str]:
    """Every weight file and config (reports hold timings; the recipe names its own output)."""
    files = [p for p in sorted(path.rglob("*")) if p.suffix == ".safetensors" or p.name.endswith("config.json")
             or p.name.endswith(".index.json")]  # fmt: skip
    return {str(p.relative_to(path)): hashlib.sha256(_bytes(p)).hexdigest() for p in files}


def _recipe(tmp_path, name: str, steps: list, **over) -> tuple:
    rec = {"model": str(tmp_path / "model"), "calibration": CAL, "emit": "every_step", "steps": steps, **over}
    paths = []
    for tag in ("one", "two"):
        r = {**rec, "output": str(tmp_path / f"{name}-{tag}"),
             "calibration": {**CAL, "cache_dir": str(tmp_path / f"cache-{name}-{tag}")}}  # fmt: skip
        (tmp_path / f"{name}-{tag}.yaml").write_text(yaml.safe_dump(r))
        paths.append(tmp_path / f"{name}-{tag}.yaml")
    return paths


def _compare(tmp_path, name: str, steps: list) -> None:
    one, two = _recipe(tmp_path, name, steps)
    mc.apply(str(one), progress=False)
    runs = _two_ranks(two)
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    ref = _hashes(tmp_path / f"{name}-one")
    assert ref and any(k.endswith(".safetensors") for k in ref)
    assert _hashes(tmp_path / f"{name}-two") == ref
    assert not (tmp_path / f"cache-{name}-two").exists() or any((tmp_path / f"cache-{name}-two").rglob("*"))


@pytest.fixture
def model(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model", num_hidden_layers=2)
    return tmp_path


def test_launch_reads_torchrun_variables():
    assert Launch.from_env({}) == Launch(0, 1, 0)
    assert Launch.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Launch(1, 2, 1)
    with pytest.raises(RecipeError, match="not a valid launch"):
        Launch.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(RecipeError, match="integers"):
        Launch.from_env({"RANK": "x", "WORLD_SIZE": "2"})


NEEDS = {"act_sq_mean", "expert_in_cov", "input_cov", "down_in_cov_pooled", "reap_saliency", "io_sample",
         "down_out_absmax", "router_sample"}  # fmt: skip


def _batch(col, layer, x, mode: str) -> None:
    col.mode = mode
    col.on_input(x)
    col.on_output(moe_forward(layer, x, col))


def test_rounds_merged_in_batch_order_give_the_bits_of_one_collector(model):
    """The merge itself, in one process: batch parts taken one by one and added in order equal one
    collector over every batch, to the bit (the pooled sums too); out of order, they need not."""
    layer = open_checkpoint(model / "model").read_layer(0)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, layer.hidden_size, generator=g) * (10.0**k) for k, n in enumerate((7, 5, 9, 6))]
    modes = ["stats", "stats", "stats", "holdout"]
    one = StatsCollector(layer, NEEDS, sample_tokens=16)
    with torch.no_grad():
        for x, m in zip(xs, modes):
            _batch(one, layer, x, m)
    ref = one.result()
    part = StatsCollector(layer, NEEDS, sample_tokens=16, rounds=True)
    parts = []
    with torch.no_grad():
        for x, m in zip(xs, modes):
            _batch(part, layer, x, m)
            parts.append(load(save(part.take_round())))
    merged = StatsCollector(layer, NEEDS, sample_tokens=16)
    for p in parts:
        merged.add_round(p)
    got = merged.result()
    assert got.keys() == ref.keys() and {"down_in_cov_pooled", "io_sample_x", "holdout_x"} <= ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(got[k], ref[k])]
    # the unindexed additions are replayed one by one: ((5 + 1e20) + 1) - 1e20 is 0, not 5 + (1e20 + 1 - 1e20)
    crafted = {"n/tokens": torch.tensor(0), "n/grad_tokens": torch.tensor(0)}
    merged.add_round({**crafted, "q/crafted": torch.tensor([[5.0]], dtype=torch.float64)})
    merged.add_round({**crafted, "q/crafted": torch.tensor([[1e20], [1.0], [-1e20]], dtype=torch.float64)})
    assert merged._sums["crafted"].tolist() == [0.0]
    backwards = StatsCollector(layer, NEEDS, sample_tokens=16)
    for p in reversed(parts):
        backwards.add_round(p)
    assert not torch.equal(backwards.result()["io_sample_x"], ref["io_sample_x"])


@pytest.mark.slow  # 2 ranks end to end (~20 s): the slow lane, which CI also runs
def test_heapr_global_backward_and_tdmoe_pooled_are_byte_identical(model):
    """Streamed backward (heapr's gradients, global ranking), pooled forward and backward covariances
    (tdmoe), the reference errors on held-back batches, every step's checkpoint."""
    _compare(
        model, "hb", [{"heapr": {"ratio": 0.25, "layout": "uniform", "align": 8}}, {"tdmoe": {"ratio": 0.4}}]
    )


@pytest.mark.slow
def test_identity_and_expert_prune_are_byte_identical(model):
    _compare(model, "ep", [{"identity": {}}, {"expert_prune": {"ratio": 0.25}}])


@pytest.mark.slow
def test_namex_is_byte_identical(model):
    _compare(model, "nx", [{"namex": {"ratio": 0.25, "refine_steps": 2}}])


@pytest.mark.slow
def test_codequant_is_byte_identical(model):
    _compare(model, "cq", [{"codequant": {"bits": 3, "finetune_steps": 2}}])


@pytest.mark.slow
def test_a_killed_rank_fails_cleanly_and_resume_gives_the_same_bytes(model):
    one, two = _recipe(model, "k", [{"heapr": {"ratio": 0.25, "layout": "uniform", "align": 8}}])
    mc.apply(str(one), progress=False)
    first = _two_ranks(two, die=True)
    assert first[1].returncode == 9
    assert first[0].returncode == Interrupted.exit_code, first[0].stderr[-2000:]
    lines = first[0].stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 of 2:"), lines
    assert "nothing was written" in lines[0]
    assert not (model / "k-two").exists() and not (model / ".k-two.partial").exists()
    again = _two_ranks(two, "--resume")
    assert [r.returncode for r in again] == [0, 0], [r.stderr[-2000:] for r in again]
    assert _hashes(model / "k-two") == _hashes(model / "k-one")


@pytest.mark.slow
def test_torchrun_launch_is_byte_identical(model):
    one, two = _recipe(model, "tr", [{"heapr": {"ratio": 0.25}}])
    mc.apply(str(one), progress=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
           "-m", "moecompress.cli", "apply", str(two), "--quiet"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _hashes(model / "tr-two") == _hashes(model / "tr-one")


@pytest.mark.slow
def test_one_process_is_unchanged_by_a_world_of_one(model):
    """WORLD_SIZE=1 (or none) is the one-process path: no process group, same bytes."""
    one, two = _recipe(model, "w1", [{"heapr": {"ratio": 0.25, "layout": "uniform", "align": 8}}])
    mc.apply(str(one), progress=False)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0"}
    done = subprocess.run([sys.executable, "-m", "moecompress.cli", "apply", str(two), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert _hashes(model / "w1-two") == _hashes(model / "w1-one")
