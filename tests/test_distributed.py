"""Runs over two ``torch.distributed`` ranks (gloo, one thread each) write the bytes of one process.

Each rank is a ``moecompress apply`` subprocess with the variables ``torchrun`` sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); one test goes through ``torchrun``
itself. Every run has its own statistics cache, so the two-rank run calibrates data-parallel.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from queue_ranks import QueueRanks
from rank_helpers import CAL, free_port, one_thread, output_hashes, rank_env
from safetensors.torch import load, save
from tiny import save_tiny

import moecompress as mc
from moecompress.calibration.stats import StatsCollector
from moecompress.engine.distributed import Launch
from moecompress.engine.journal import UNITS
from moecompress.engine.spec import Chunking, PassConfig, PassSpec
from moecompress.engine.units import LOOP_UNITS_PER_RANK
from moecompress.errors import Interrupted, PassError, RecipeError
from moecompress.io.checkpoint import open_checkpoint
from moecompress.reference import moe_forward

# rank 1 of the killed-rank test: it dies (as a crashed or OOM-killed process does) in its 3rd all-gather of
# calibration (data-parallel rounds and the expert-sharded forward both all-gather)
DIE = r"""
import os, sys
from moecompress.engine.distributed import Ranks
from moecompress.cli import main
gather, calls = Ranks.all_gather_buffers, []
def dying(self, blob):
    calls.append(1)
    if len(calls) == 3:
        os._exit(9)
    return gather(self, blob)
Ranks.all_gather_buffers = dying
sys.exit(main(sys.argv[1:]))
"""


def _two_ranks(recipe, *extra, die: bool = False, timeout: int = 240) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = []
    for rank in (0, 1):
        code = ["-c", DIE] if die and rank == 1 else ["-m", "moecompress.cli"]
        cmd = [sys.executable, *code, "apply", str(recipe), "--quiet", *extra]
        procs.append(subprocess.Popen(cmd, env=rank_env(rank, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


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
    with one_thread():
        mc.apply(str(one), progress=False)
    runs = _two_ranks(two)
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    ref = output_hashes(tmp_path / f"{name}-one")
    assert ref and any(k.endswith(".safetensors") for k in ref)
    assert output_hashes(tmp_path / f"{name}-two") == ref
    assert not (tmp_path / f"cache-{name}-two").exists() or any((tmp_path / f"cache-{name}-two").rglob("*"))


@pytest.fixture
def model(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "model", num_hidden_layers=2)
    return tmp_path


def test_launch_reads_torchrun_variables():
    assert Launch.from_env({}) == Launch(0, 1, 0)
    assert Launch.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Launch(1, 2, 1)
    assert Launch(1, 2, 1).ranks_here == 2  # not said: every rank on this host
    two_hosts = Launch.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert two_hosts == Launch(3, 4, 1, 2) and two_hosts.ranks_here == 2
    with pytest.raises(RecipeError, match="not a valid launch"):
        Launch.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(RecipeError, match="integers"):
        Launch.from_env({"RANK": "x", "WORLD_SIZE": "2"})


NEEDS = {"act_sq_mean", "expert_in_cov", "input_cov", "down_in_cov_pooled", "reap_saliency", "io_sample",
         "down_out_absmax", "router_sample", "expert_out_gram"}  # fmt: skip


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
    assert (
        got.keys() == ref.keys()
        and {"down_in_cov_pooled", "io_sample_x", "holdout_x", "expert_out_gram"} <= ref.keys()
    )
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


def test_backward_rounds_give_the_bits_of_one_collector_with_the_fisher_gram(model):
    """``expert_out_gram_fisher`` is computed once a layer's backward is complete, from the Ward tokens' MoE
    inputs (kept like a sample) and ``out_grad_cov``: rounds merged in batch order give the bits of one process."""
    layer = open_checkpoint(model / "model").read_layer(0)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, layer.hidden_size, generator=g) for n in (12, 8, 16)]
    needs = {"expert_out_gram_fisher", "grad_sq_mean"}

    def back(col, x):
        col.mode = "backward"
        xg = x.clone().requires_grad_(True)
        with torch.enable_grad():
            col.on_input(xg)
            y = moe_forward(layer, xg, col)
            col.on_output(y)
            y.pow(2).sum().backward()

    one = StatsCollector(layer, needs, sample_tokens=40)
    for x in xs:
        back(one, x)
    ref = one.result()
    part, parts = StatsCollector(layer, needs, sample_tokens=40, rounds=True), []
    for x in xs:
        back(part, x)
        parts.append(load(save(part.take_round())))
    merged = StatsCollector(layer, needs, sample_tokens=40)
    for p in parts:
        merged.add_round(p)
    got = merged.result()
    assert got.keys() == ref.keys() and {"expert_out_gram_fisher", "out_grad_cov"} <= ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(got[k], ref[k])]


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
def test_namex_budget_in_one_step_is_byte_identical(model):
    """The one-step budget: expert_out_gram (forward) and expert_out_gram_fisher (streamed backward) merged
    over ranks, the plan's allocation, the merge."""
    _compare(model, "nb", [{"namex": {"target_experts": {"ratio": 0.25}, "refine_steps": 2}}])


@pytest.mark.slow
def test_codequant_is_byte_identical(model):
    _compare(model, "cq", [{"codequant": {"bits": 3, "finetune_steps": 2}}])


@pytest.mark.slow
def test_a_killed_rank_fails_cleanly_and_resume_gives_the_same_bytes(model):
    one, two = _recipe(model, "k", [{"heapr": {"ratio": 0.25, "layout": "uniform", "align": 8}}])
    with one_thread():
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
    assert output_hashes(model / "k-two") == output_hashes(model / "k-one")


@pytest.mark.slow
def test_torchrun_launch_is_byte_identical(model):
    one, two = _recipe(model, "tr", [{"heapr": {"ratio": 0.25}}])
    with one_thread():
        mc.apply(str(one), progress=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "moecompress.cli", "apply", str(two), "--quiet"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert output_hashes(model / "tr-two") == output_hashes(model / "tr-one")


def _two_nodes(recipe, *extra, timeout: int = 300, die: Path | None = None) -> list[subprocess.CompletedProcess]:
    """Two ``torchrun`` launches of one process each, ``--nnodes 2`` with the ``c10d`` rendezvous on loopback:
    two hosts, as ``docs/distributed.md`` launches them (both here, so ``LOCAL_RANK`` is 0 on each); ``die``: a
    script (:data:`DIE`) the second node runs instead of the CLI."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
               "--rdzv_id", f"moecompress-test-{port}",
               *([str(die)] if die is not None and node == 1 else ["-m", "moecompress.cli"]),
               "apply", str(recipe), "--quiet", *extra]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


@pytest.mark.slow
def test_two_nodes_with_the_c10d_rendezvous_are_byte_identical(model):
    """``--nnodes 2`` on loopback (two launches standing in for two hosts): calibration data-parallel and the
    layer loop sharded by experts over the two nodes, the bytes of one process."""
    one, two = _recipe(model, "nn", [{"rtn": {"bits": 4, "group_size": 16}}])
    with one_thread():
        mc.apply(str(one), progress=False)
    done = _two_nodes(two)
    assert [r.returncode for r in done] == [0, 0], [r.stderr[-3000:] for r in done]
    assert output_hashes(model / "nn-two") == output_hashes(model / "nn-one")


@pytest.mark.slow
def test_a_killed_node_fails_cleanly_and_resume_gives_the_same_bytes(model):
    """A rank dies on the second node during calibration: both launches fail, nothing is written, and
    ``--resume`` on the two nodes gives one process's bytes."""
    one, two = _recipe(model, "kn", [{"rtn": {"bits": 4, "group_size": 16}}])
    with one_thread():
        mc.apply(str(one), progress=False)
    script = model / "die.py"
    script.write_text(DIE)
    first = _two_nodes(two, die=script)
    assert all(r.returncode != 0 for r in first), [r.stderr[-2000:] for r in first]
    assert not (model / "kn-two").exists()
    again = _two_nodes(two, "--resume")
    assert [r.returncode for r in again] == [0, 0], [r.stderr[-3000:] for r in again]
    assert output_hashes(model / "kn-two") == output_hashes(model / "kn-one")


@pytest.mark.slow
def test_one_process_is_unchanged_by_a_world_of_one(model):
    """WORLD_SIZE=1 (or none) is the one-process path: no process group, same bytes."""
    one, two = _recipe(model, "w1", [{"heapr": {"ratio": 0.25, "layout": "uniform", "align": 8}}])
    with one_thread():
        mc.apply(str(one), progress=False)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0"}
    done = subprocess.run([sys.executable, "-m", "moecompress.cli", "apply", str(two), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert output_hashes(model / "w1-two") == output_hashes(model / "w1-one")


# -- the layer loop sharded by experts (engine/shard.py) ----------------------------------------
# rank 1 counts the chunks it works (and, with DIE_AT, dies in its DIE_AT-th one, as a killed process does)
SERVE = r"""
import os, sys
from moecompress.engine import shard
from moecompress.cli import main
serve, calls = shard.serve, []
def counted(*a, **k):
    calls.append(1)
    if len(calls) == int(os.environ.get("DIE_AT", "0")):
        os._exit(9)
    return serve(*a, **k)
shard.serve = counted
grouped = shard._follow_grouped
def units(*a, **k):  # a merge's units of groups (engine/group_work.py)
    n = grouped(*a, **k)
    calls.extend([1] * n)
    return n
shard._follow_grouped = units
code = main(sys.argv[1:])
print(f"SERVED {len(calls)}", flush=True)
sys.exit(code)
"""


def _sharded(recipe, *extra, die_at: int = 0, timeout: int = 240) -> list[subprocess.CompletedProcess]:
    port, procs = free_port(), []
    for rank in (0, 1):
        code = ["-c", SERVE] if rank == 1 else ["-m", "moecompress.cli"]
        env = {**rank_env(rank, 2, port), "DIE_AT": str(die_at)}
        cmd = [sys.executable, *code, "apply", str(recipe), "--quiet", *extra]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


def _compare_sharded(tmp_path, name: str, steps: list, served: int | None, **over) -> None:
    """One process against two ranks whose rank 1 works ``served`` chunks of experts (``None``: some)."""
    one, two = _recipe(tmp_path, name, steps, **over)
    if over.get("calibration"):
        for path in (one, two):  # the per-recipe cache_dir stays
            rec = yaml.safe_load(path.read_text())
            rec["calibration"] = {**over["calibration"], "cache_dir": rec["calibration"]["cache_dir"]}
            path.write_text(yaml.safe_dump(rec))
    with one_thread():
        mc.apply(str(one), progress=False)
    runs = _sharded(two)
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    if served is None:
        assert "SERVED 0" not in runs[1].stdout and "SERVED " in runs[1].stdout, runs[1].stdout[-500:]
    else:
        assert f"SERVED {served}" in runs[1].stdout
    ref = output_hashes(tmp_path / f"{name}-one")
    assert ref and any(k.endswith(".safetensors") for k in ref)
    assert output_hashes(tmp_path / f"{name}-two") == ref


DATA_FREE = {"source": "none"}


@pytest.mark.slow  # 2 gloo ranks (~20 s, mostly two interpreters starting); the in-process test below is fast
def test_rtn_sharded_by_experts_is_byte_identical(model):
    """Data-free rtn (no calibration): each of the 2 MoE layers is split in 2 · LOOP_UNITS_PER_RANK units,
    rank 1 works every other one."""
    _compare_sharded(model, "rs", [{"rtn": {"bits": 4, "group_size": 16}}], served=2 * LOOP_UNITS_PER_RANK, calibration=DATA_FREE)


@pytest.mark.parametrize(
    ("chunk", "calibrated", "by_file", "mine"),
    [("off", False, True, None), ("off", False, False, None), (3, False, True, None), ("off", False, True, 1),
     pytest.param("off", True, True, None, marks=pytest.mark.slow)],  # calibrated: ~10 s
)  # fmt: skip
def test_sharded_layer_loop_in_two_threads_is_byte_identical(model, chunk, calibrated, by_file, mine, monkeypatch):
    """The sharding itself, fast: rank 1 (a thread) works chunks k mod 2 of every MoE layer (``off``: split
    in ``2 · LOOP_UNITS_PER_RANK`` units; ``3``: chunks of 3, rank 1 takes the middle one), or all but ``mine``
    of them (rank 0's share from ``engine/balance.py``, as when rank 0 is the slower one); rank 0 writes them:
    their tensors from rank 1's files in the run's units directory (``by_file``), else from the messages.
    Data-free rtn, or heapr (global plan), expert_prune and rtn after a data-parallel calibration."""
    from moecompress.engine import executor, wire
    from moecompress.engine.balance import Balance
    from moecompress.engine.dry_run import dry_run

    if mine is not None:
        monkeypatch.setattr(Balance, "share", lambda self, units, world: mine)

    if not by_file:  # as when rank 1 cannot see rank 0's staging directory (another host)
        files = wire.unit_files
        monkeypatch.setattr(wire, "unit_files", lambda ranks, staging: files(ranks, staging) and None)

    # expert_prune by frequency: expert_counts do not change with heapr, so the layer may go by chunks
    # (reap_saliency would be replayed on the pruned layer, which holds it whole: engine/follow.py)
    steps = [{"heapr": {"ratio": 0.25}}, {"expert_prune": {"ratio": 0.25, "method": "frequency"}}, {"rtn": {"bits": 4}}]
    steps = steps if calibrated else steps[2:]  # (expert-chunked calibration is not data-parallel)
    one, two = _recipe(model, f"q{chunk}{calibrated}", steps, expert_chunk=chunk)
    for path in (one, two):  # a short calibration (2 batches and 1 held back), or none
        rec = yaml.safe_load(path.read_text())
        small = {**rec["calibration"], "samples": 6, "seq_len": 8} if calibrated else DATA_FREE
        path.write_text(yaml.safe_dump({**rec, "calibration": small}))
    with one_thread():
        ref = mc.apply(str(one), progress=False).report
    rec = mc.load_recipe(str(two))
    ckpt = open_checkpoint(rec.model)
    plan, wire, out = dry_run(rec, ckpt), {}, {}
    fp = executor._check_calibration_source(rec, ckpt)

    def rank(r: int) -> dict:
        return executor._compress(rec, ckpt, plan, fp, None, False, QueueRanks(r, 2, wire=wire)).report

    t = threading.Thread(target=lambda: out.update(rank(1)))
    t.start()
    got = rank(0)
    t.join(60)
    units = 2 * LOOP_UNITS_PER_RANK if chunk == "off" else 2  # rank 1's units over the 2 layers
    units = units if mine is None else 2 * (2 * LOOP_UNITS_PER_RANK - mine)
    assert not t.is_alive() and out["layer_loop"]["chunks"] == units and out["layer_loop"]["layers"] == 2
    written = 1 if rec.emit == "final" else len(rec.steps)  # a file per unit and written step
    files = out["layer_loop"]["unit_files"]  # one per unit and written step with tensors (a pruned expert has none)
    assert files == (units * written if by_file else 0) if not calibrated else 0 < files <= units * written
    assert output_hashes(model / f"q{chunk}{calibrated}-two") == output_hashes(model / f"q{chunk}{calibrated}-one")
    assert not (model / f"q{chunk}{calibrated}-two" / UNITS).exists()
    sizes = [[(s["params_after"], s["bytes_after"]) for s in r["steps"]] for r in (ref, got)]
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("other", ["same", "missing", "elsewhere"])
def test_the_other_ranks_write_their_units_only_where_rank_0_reads_them(tmp_path, other):
    """``wire.unit_files``: rank 1 gets a units directory only when rank 0 reads back the probe rank 1 wrote
    there; a staging path that does not exist on rank 1's host, or exists there as another directory (a
    local disk at the same path), leaves the tensors in the messages, on both ranks."""
    from moecompress.engine.wire import unit_files

    staging = tmp_path / "out.partial"
    staging.mkdir()
    seen = {"same": staging, "missing": tmp_path / "nowhere", "elsewhere": tmp_path / "host2" / "out.partial"}[other]
    (tmp_path / "host2" / "out.partial").mkdir(parents=True)
    (tmp_path / "host2" / "out.partial" / UNITS).mkdir()
    queues, got = {}, {}
    t = threading.Thread(target=lambda: got.update(r1=unit_files(QueueRanks(1, 2, wire=queues), seen)))
    t.start()
    got["r0"] = unit_files(QueueRanks(0, 2, wire=queues), staging)
    t.join(30)
    assert not t.is_alive() and got["r0"] is None  # rank 0 writes its own units through its writers
    if other == "same":
        assert got["r1"] is not None and got["r1"].where == staging / UNITS and got["r1"].rank == 1
        name, offsets = got["r1"].write([torch.arange(3.0), torch.ones(2, dtype=torch.bfloat16)])
        assert offsets == [0, 12] and (staging / UNITS / name).stat().st_size == 16
    else:
        assert got["r1"] is None
    assert [p.name for p in (staging / UNITS).iterdir()] == ([name] if other == "same" else [])  # no probe left


def test_chunk_parts_travel_as_bytes_unchanged(model):
    """A chunk's parts through safetensors + JSON (no pickle) equal the parts themselves; an error raised
    on the sending rank is raised again, with its type and line, on the receiving one."""
    from moecompress.engine import wire as chunk_wire
    from moecompress.engine.context import RunContext
    from moecompress.engine.recipe import load_recipe
    from moecompress.engine.unit_work import ErrPart, chunk_parts, prepare

    rec = load_recipe({"model": str(model / "model"), "output": str(model / "o"), "calibration": DATA_FREE,
                       "steps": [{"expert_prune": {"ratio": 0.25, "method": "random"}}, {"rtn": {"bits": 4}}]})  # fmt: skip
    ckpt = open_checkpoint(model / "model")
    steps = list(rec.steps)
    lp = prepare(ckpt, steps, None, [None, None], RunContext.for_recipe(rec, ckpt, progress=False), 0)
    want = list(chunk_parts(lp, 2, 7, {0, 1}))
    got = chunk_wire.decode(*chunk_wire.encode(chunk_parts(lp, 2, 7, {0, 1}), steps))
    assert len(got) == len(want) and not any(isinstance(p, ErrPart) for p in got)
    for a, b in zip(want, got, strict=True):
        assert (a.s, a.g0, a.info, a.bound, a.changed, a.stock) == (
            b.s,
            b.g0,
            b.info,
            b.bound,
            b.changed,
            b.stock,
        )
        assert [(h, n) for h, n, _ in a.writes] == [(h, n) for h, n, _ in b.writes] and a.writes
        assert all(
            torch.equal(x, y) and x.dtype == y.dtype for (_, _, x), (_, _, y) in zip(a.writes, b.writes)
        )
        assert (
            a.skeleton.num_experts == b.skeleton.num_experts and b.skeleton.gate.kind == a.skeleton.gate.kind
        )
    with pytest.raises(PassError, match=r"^step 2 \(rtn\), layer 0: broken$"):
        chunk_wire.decode(*chunk_wire.encode_error(PassError("step 2 (rtn), layer 0: broken")))


# rank 1 sends three messages through an Outbox and only then lets rank 0 receive (a marker file): with
# blocking sends it would wait forever; then a step's error, raised on rank 1 and sent to rank 0
OUTBOX = r"""
import os, sys, time
from pathlib import Path
from moecompress.engine import distributed, wire
from moecompress.errors import PassError
marker = Path(sys.argv[1])
ranks = distributed.start(distributed.Launch.from_env(os.environ), "cpu")
if ranks.rank == 1:
    out = wire.Outbox(ranks)
    for k in range(3):
        out.send(lambda: (f"head{k}".encode(), bytes([k]) * (1000 * k)))
        if k == 0:
            marker.write_text("sent")
    def broken():
        raise PassError("step 1 (rtn), layer 0: broken")
    try:
        out.send(broken)
    except PassError:
        print("RAISED", flush=True)
    out.wait()
else:
    for _ in range(600):
        if marker.exists():
            break
        time.sleep(0.1)
    print("MARKER", marker.exists(), flush=True)
    for k in range(3):
        head, blob = wire.receive(ranks, 1)
        assert head == f"head{k}".encode() and bytes(blob.numpy()) == bytes([k]) * (1000 * k), k
    try:
        wire.decode(*wire.receive(ranks, 1))
    except PassError as err:
        print("GOT", err, flush=True)
distributed.stop(ranks)
"""


def test_a_rank_works_on_while_rank_0_has_yet_to_receive_its_message(tmp_path):
    """``wire.Outbox`` over gloo: rank 1's send returns before rank 0 receives (gloo's own send waits for
    the receive), messages arrive in order, and an error raised while making one reaches rank 0 as itself."""
    port, procs = free_port(), []
    for rank in (0, 1):
        cmd = [sys.executable, "-c", OUTBOX, str(tmp_path / "sent")]
        procs.append(subprocess.Popen(cmd, env=rank_env(rank, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], (err0[-500:], err1[-500:])
    assert "MARKER True" in out0 and "GOT step 1 (rtn), layer 0: broken" in out0
    assert "RAISED" in out1


@pytest.mark.slow  # 2 ranks with calibration (~25 s)
def test_codequant_kmeans_rotated_sharded_by_experts_is_byte_identical(model):
    """codequant k-means only (exact by chunks) with a rotation: the layers are shared out by chunks (rank 1
    works one of 2 per layer), the rotation goes once with the chunk of the layer's first expert."""
    steps = [{"codequant": {"bits": 3, "finetune_steps": 0, "rotation": "hadamard", "kmeans_iters": 50}}]
    _compare_sharded(model, "cqs", steps, served=2 * LOOP_UNITS_PER_RANK)


@pytest.mark.slow  # 2 ranks with calibration (~30 s)
def test_codequant_fine_tuned_by_a_team_of_ranks_is_byte_identical(model):
    """codequant fine-tuned (every expert against the block's output) after a protection, rotated, with
    activation quantisation: each layer goes in 2 units worked at the same time (``Chunking.team``), rank 1
    the second, exchanging their experts' outputs at every step; the output is one process's."""
    steps = [
        {"protect_super_experts": {"manual": [{"layer": 1, "experts": [2, 6]}]}},
        {"codequant": {"bits": 3, "finetune_steps": 3, "finetune_patience": None, "rotation": "hadamard",
                       "eval_act_bits": 4}},
    ]  # fmt: skip
    _compare_sharded(model, "cqt", steps, served=2)


@pytest.mark.slow  # 2 ranks with calibration (~25 s)
@pytest.mark.parametrize("layout", ["uniform", "ragged"])
def test_heapr_then_gptq_sharded_by_experts_is_byte_identical(model, layout):
    """heapr then gptq: gptq reads ``down_in_cov`` mapped to the kept neurons, which each unit maps for its own
    experts (``follow.by_units``), so the layers are shared out by units: one process's bytes."""
    steps = [{"heapr": {"ratio": 0.25, "layout": layout}}, {"gptq": {"bits": 4, "group_size": 8}}]
    _compare_sharded(model, "hg" + layout[0], steps, served=2 * LOOP_UNITS_PER_RANK)


@pytest.mark.slow  # 2 ranks with calibration (~25 s)
def test_per_expert_chain_sharded_by_experts_is_byte_identical(model):
    """heapr (global plan), expert_prune (a selection on the shell), rtn, every step written; the held-back
    error sums cross ranks."""
    steps = [
        {"heapr": {"ratio": 0.25}},
        {"expert_prune": {"ratio": 0.25, "method": "frequency"}},  # reap_saliency would hold the layer whole
        {"rtn": {"bits": 4, "group_size": 16}},
    ]
    _compare_sharded(model, "pe", steps, served=2 * LOOP_UNITS_PER_RANK)


@pytest.mark.slow
def test_expert_chunk_layers_calibrate_and_run_sharded_with_one_process_cache_and_bytes(model):
    """``expert_chunk: 3`` under 2 ranks: calibration by chunks with the experts split over the ranks (the
    per-expert covariances spilled expert by expert, rank 1's sent to rank 0), then gptq by chunks shared out:
    the statistics cache holds one process's files, bit for bit, and the output one process's bytes."""
    _compare_sharded(model, "xc", [{"gptq": {"bits": 4, "group_size": 16}}], served=2, expert_chunk=3)

    def cache(tag: str) -> dict:
        root = model / f"cache-xc-{tag}"
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*.safetensors")}

    one = cache("one")
    assert any(".experts-" in k for k in one), sorted(one)  # the covariances were spilled
    assert cache("two") == one


@pytest.mark.slow
def test_heapr_with_expert_chunk_calibrates_its_backward_by_chunks_over_the_ranks(model):
    """``expert_chunk: 3`` and a gradient statistic under 2 ranks (refused before the backward was sharded):
    forward and streamed backward by chunks of experts split over the ranks, then heapr's global plan by
    chunks shared out; one process's bytes."""
    _compare_sharded(model, "hx", [{"heapr": {"ratio": 0.25, "layout": "uniform", "align": 8}}], served=None,
                     expert_chunk=3)  # fmt: skip


@pytest.mark.slow
def test_cross_expert_step_runs_whole_on_rank_0_beside_sharded_layers(model):
    """A layer with tdmoe after expert_prune (its pooled covariance replayed: needs the whole layer) runs whole
    on rank 0 while rank 1 waits; with expert_chunk: 3 the per-expert rtn layers go by chunks k mod
    2 (rank 1: chunk 1 of 3)."""
    _compare_sharded(model, "cx", [{"expert_prune": {"ratio": 0.25}}, {"tdmoe": {"ratio": 0.4}}], served=0)
    _compare_sharded(model, "c3", [{"rtn": {"bits": 4}}], served=2, expert_chunk=3, calibration=DATA_FREE)


@pytest.mark.slow
def test_merging_by_chunks_shares_its_units_over_the_ranks(model):
    """namex by units of groups (expert_chunk: 3) under 2 ranks: the calibration by chunks is shared out,
    every rank decides the groups, rank 1 works units 1, 3, ... and sends them: one process's bytes."""
    _compare_sharded(model, "mg", [{"namex": {"ratio": 0.25, "refine_steps": 0}}], served=None, expert_chunk=3)


@pytest.mark.parametrize(
    "step",
    [{"namex": {"ratio": 0.25}},  # refined: the unwritten pass's infos travel, rank 0 chooses and broadcasts
     {"merge_experts": {"ratio": 0.5, "similarity": "weight"}}],  # the weight Gram from pairs, on every rank
)  # fmt: skip
def test_merge_units_in_two_threads_are_one_process_bytes(model, step):
    """A merge by units of groups (expert_chunk: 3), fast: rank 1 (a thread) decides the same groups, works
    units k mod 2 of both passes and sends them; rank 0 folds, chooses, writes. The statistics are the
    one-process run's cache entry."""
    from moecompress.engine import executor, shard
    from moecompress.engine.dry_run import dry_run

    name = "u" + next(iter(step))[:2]
    one, two = _recipe(model, name, [step], expert_chunk=3)
    shared = yaml.safe_load(one.read_text())["calibration"]
    rec2 = yaml.safe_load(two.read_text())
    two.write_text(yaml.safe_dump({**rec2, "calibration": shared}))  # the same cache entry
    with one_thread():
        mc.apply(str(one), progress=False)
    rec = mc.load_recipe(str(two))
    ckpt = open_checkpoint(rec.model)
    plan, wire, out, worked = dry_run(rec, ckpt), {}, {}, []
    fp = executor._check_calibration_source(rec, ckpt)
    grouped = shard._follow_grouped

    def rank(r: int) -> dict:
        return executor._compress(rec, ckpt, plan, fp, None, False, QueueRanks(r, 2, wire=wire)).report

    def units(*a, **k):
        worked.append(grouped(*a, **k))
        return worked[-1]

    shard._follow_grouped = units
    try:
        with one_thread():
            t = threading.Thread(target=lambda: out.update(rank(1)))
            t.start()
            got = rank(0)
            t.join(120)
    finally:
        shard._follow_grouped = grouped
    assert not t.is_alive() and out["layer_loop"]["layers"] == 2 and len(worked) == 2 and min(worked) >= 1
    assert got["calibration"]["cached"]
    assert output_hashes(model / f"{name}-two") == output_hashes(model / f"{name}-one")


@pytest.mark.slow
def test_a_rank_killed_in_the_sharded_layer_loop_fails_cleanly_and_resume_gives_the_same_bytes(model):
    steps = [{"heapr": {"ratio": 0.25}}, {"rtn": {"bits": 4}}]
    one, two = _recipe(model, "kl", steps)
    with one_thread():
        mc.apply(str(one), progress=False)
    first = _sharded(two, die_at=2)  # rank 1 dies in its second unit
    assert first[1].returncode == 9
    assert first[0].returncode == Interrupted.exit_code, first[0].stderr[-2000:]
    lines = first[0].stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 of 2: recv failed"), lines
    assert "nothing was written" in lines[0]
    assert not (model / "kl-two").exists() and not (model / ".kl-two.partial").exists()
    again = _sharded(two, "--resume")
    assert [r.returncode for r in again] == [0, 0], [r.stderr[-2000:] for r in again]
    assert output_hashes(model / "kl-two") == output_hashes(model / "kl-one")


def _fails_on_rank_1(layer, stats, cfg):
    if threading.current_thread().name == "rank 1":
        raise PassError("cannot take this chunk")
    return layer, {}


FAILS = PassSpec("fails_on_rank_1", PassConfig, _fails_on_rank_1,
                 chunking=Chunking("expert", merge=lambda infos, bounds, cfg: {}))  # fmt: skip


def test_a_pass_error_on_another_rank_is_raised_on_rank_0_with_its_line(model):
    """Rank 1's chunk fails in a pass: rank 0 raises the same PassError, naming the step and the layer."""
    from moecompress.engine import executor
    from moecompress.engine.dry_run import dry_run
    from moecompress.engine.recipe import load_recipe, pass_table

    rec = load_recipe({"model": str(model / "model"), "output": str(model / "pf"), "calibration": DATA_FREE,
                       "steps": [{"fails_on_rank_1": {}}]}, passes=pass_table([FAILS]))  # fmt: skip
    ckpt = open_checkpoint(rec.model)
    plan, wire, errs = dry_run(rec, ckpt), {}, {}

    def rank(r: int) -> None:
        try:
            executor._compress(rec, ckpt, plan, "", None, False, QueueRanks(r, 2, wire=wire))
        except PassError as err:
            errs[r] = str(err)

    t = threading.Thread(target=rank, args=(1,), name="rank 1")
    t.start()
    rank(0)
    t.join(60)
    want = "step 1 (fails_on_rank_1), layer 0: cannot take this chunk"
    assert errs == {0: want, 1: want}


@pytest.mark.slow  # 2 ranks with calibration (~25 s each)
def test_gptq_and_balanced_svd_sharded_by_experts_are_byte_identical(model):
    """gptq is exact by chunks (per-expert Hessians): its layers are shared out; so are svd_experts' with
    balanced ranks, which the ranks choose from the whole layer's spectra (gathered by blocks): one process's bytes."""
    _compare_sharded(model, "gq", [{"gptq": {"bits": 4, "group_size": 16}}], served=2 * LOOP_UNITS_PER_RANK)
    _compare_sharded(model, "sb", [{"svd_experts": {"ratio": 0.4}}], served=2 * LOOP_UNITS_PER_RANK)


# rank 1 starts its gathers only once rank 0 has started all of its own (a marker file): rank 0's starts do not
# wait for rank 1; then every rank's blob (sizes differ, one empty) arrives in rank order, as bytes and as buffers
GATHER_AHEAD = r"""
import os, sys, time
from pathlib import Path
from moecompress.calibration.gather_ahead import GatherAhead
from moecompress.engine import distributed
marker = Path(sys.argv[1])
ranks = distributed.start(distributed.Launch.from_env(os.environ), "cpu")
blobs = [bytes([ranks.rank + 1]) * (1000 * (ranks.rank + 1) * k) for k in range(3)]
got = []
with GatherAhead(ranks, ahead=3) as ahead:
    if ranks.rank == 1:
        for _ in range(600):
            if marker.exists():
                break
            time.sleep(0.1)
    for b in blobs:
        ahead.start(b, lambda parts: got.append([bytes(p.numpy()) for p in parts]))
    if ranks.rank == 0:
        marker.write_text("started")
        print("STARTED", got == [], flush=True)
want = [[bytes([1]) * (1000 * k), bytes([2]) * (2000 * k)] for k in range(3)]
print("GATHERED", got == want, flush=True)
print("BYTES", ranks.all_gather_bytes(blobs[1]) == want[1], flush=True)
distributed.stop(ranks)
"""


def test_a_rank_starts_its_gathers_without_waiting_for_the_others(tmp_path):
    """``GatherAhead`` over gloo: rank 0 starts three all-gathers while rank 1 has started none (a blocking
    gather would wait forever for the marker rank 0 writes after them); the parts arrive in rank order."""
    port, procs = free_port(), []
    for rank in (0, 1):
        cmd = [sys.executable, "-c", GATHER_AHEAD, str(tmp_path / "started")]
        procs.append(subprocess.Popen(cmd, env=rank_env(rank, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], (err0[-500:], err1[-500:])
    assert "STARTED True" in out0
    assert out0.count("GATHERED True") == 1 and out1.count("GATHERED True") == 1
    assert "BYTES True" in out0 and "BYTES True" in out1
