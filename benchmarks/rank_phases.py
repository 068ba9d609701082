"""Where each rank's time goes, without a sampling profiler: a recipe's run with its phases timed (wall seconds
and the main thread's CPU seconds; their difference is time spent waiting).

    OMP_NUM_THREADS=1 python benchmarks/rank_phases.py recipe.yaml                        # one process
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/rank_phases.py recipe.yaml   # per rank

Each rank prints one line ``PHASES <rank> {"phase": [wall_s, cpu_s, calls], ...}``. py-spy (``benchmarks/
distributed.py --py-spy``) pauses a process to sample it, which shifted the ranks' balance; these timers do not.
Phases: ``start_up`` (process start to ``apply``; its second column: to the imports), ``prepare`` (dry run and
checks), ``plans``, ``loop`` (rank 0's layer loop) and ``follow`` (the other ranks'), ``release``, ``command``
(rank 0 sends a layer's command; the others wait for it), ``outbox_wait``, ``receive`` (rank 0 waits for a unit), ``calibration`` (all of it), ``forward`` / ``backward`` (expert-sharded layers; ``backward`` also one process's expert-by-expert backward), ``layer_read`` (a layer read whole: calibration's forward and the layer loop), ``cast`` (a layer held whole cast into the chunk buffer), ``chunk_read`` (a chunk
of experts read), ``gather`` (expert-sharded calibration settling its all-gathers), ``skeleton`` (the model
class on meta), ``reports`` and ``commit`` (the end of the run), ``total`` (``apply``; its CPU column is the
process's, every thread). The timers wrap the functions in this process only: a measurement harness, not
product code.
"""

from __future__ import annotations

import time

IMPORTED = time.time()  # before the imports below (torch, transformers, moecompress)

import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from moecompress.calibration import chunked, expert_sharded, gather_ahead, moe_backward, skeleton  # noqa: E402
from moecompress.engine import executor, run, shard, wire  # noqa: E402
from moecompress.engine.distributed import Launch  # noqa: E402
from moecompress.io import checkpoint  # noqa: E402

TIMES: dict[str, list[float]] = {}
MARKS: dict[str, float] = {}
"""Wall-clock (epoch) seconds at which each phase last ended, to line the ranks up against each other."""


def _process_start() -> float:
    """When this process started (epoch seconds), from ``/proc`` (Linux): the interpreter's and the imports'
    time counts too."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(float(x.split()[1]) for x in f if x.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def timed(name: str, f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            row = TIMES.setdefault(name, [0.0, 0.0, 0])
            row[0] += time.perf_counter() - t0
            row[1] += time.thread_time() - c0
            row[2] += 1
            MARKS[name] = time.time()

    return wrapper


def main() -> None:
    expert_sharded.forward_layer = timed("forward", expert_sharded.forward_layer)
    expert_sharded.backward_layer = timed("backward", expert_sharded.backward_layer)
    moe_backward.whole_layer = timed("backward", moe_backward.whole_layer)  # one process (or data-parallel)
    moe_backward.by_chunks = timed("backward", moe_backward.by_chunks)
    checkpoint.Checkpoint.read_layer = timed("layer_read", checkpoint.Checkpoint.read_layer)
    chunked.cast_into = timed("cast", chunked.cast_into)
    chunked.ChunkedLayer.chunk = timed("chunk_read", chunked.ChunkedLayer.chunk)
    gather_ahead.GatherAhead._settle = timed("gather", gather_ahead.GatherAhead._settle)
    skeleton.Skeleton.__init__ = timed("skeleton", skeleton.Skeleton.__init__)
    executor.run_calibration = timed("calibration", executor.run_calibration)
    executor._prepare = timed("prepare", executor._prepare)
    executor.run_plans = timed("plans", executor.run_plans)
    run.RecipeRun.loop = timed("loop", run.RecipeRun.loop)
    shard.follow = timed("follow", shard.follow)
    shard.release = timed("release", shard.release)
    shard._command = timed("command", shard._command)  # rank 0 sends a layer's command, the others wait for it
    wire.Outbox.wait = timed("outbox_wait", wire.Outbox.wait)  # a rank's message not yet received by rank 0
    shard.receive = timed("receive", shard.receive)  # rank 0 waits for another rank's unit
    run.RecipeRun._step_reports = timed("reports", run.RecipeRun._step_reports)
    run.RecipeRun._write_checkpoint_files = timed("commit", run.RecipeRun._write_checkpoint_files)
    start, ready = _process_start(), time.time()
    t0 = time.perf_counter()
    executor.apply(sys.argv[1], launch=Launch.from_env(os.environ), progress=False, overwrite=True)
    TIMES["total"] = [time.perf_counter() - t0, time.process_time(), 1]
    MARKS["total"] = time.time()
    rows = {k: [round(v[0], 2), round(v[1], 2), int(v[2])] for k, v in TIMES.items()}
    rows["start_up"] = [round(ready - start, 2), round(IMPORTED - start, 2), 1]  # [to apply, to the imports]
    marks = {k: round(v, 3) for k, v in MARKS.items()} | {"process_start": round(start, 3)}
    print("PHASES", os.environ.get("RANK", "0"), json.dumps(rows), flush=True)
    print("MARKS", os.environ.get("RANK", "0"), json.dumps(marks), flush=True)


if __name__ == "__main__":
    main()
