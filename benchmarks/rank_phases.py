"""Where each rank's time goes, without a sampling profiler: a recipe's run with its phases timed (wall seconds
and the main thread's CPU seconds; their difference is time spent waiting).

    OMP_NUM_THREADS=1 python benchmarks/rank_phases.py recipe.yaml                        # one process
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/rank_phases.py recipe.yaml   # per rank

Each rank prints one line ``PHASES <rank> {"phase": [wall_s, cpu_s, calls], ...}``. py-spy (``benchmarks/
distributed.py --py-spy``) pauses a process to sample it, which shifted the ranks' balance; these timers do not.
Phases: ``calibration`` (all of it), ``forward`` / ``backward`` (expert-sharded layers), ``chunk_read`` (a chunk
of experts read), ``gather`` (expert-sharded calibration settling its all-gathers), ``skeleton`` (the model
class on meta), ``reports`` and ``commit`` (the end of the run), ``total`` (``apply``; its CPU column is the
process's, every thread). The timers wrap the functions in this process only: a measurement harness, not
product code.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

from moecompress.calibration import chunked, expert_sharded, gather_ahead, skeleton
from moecompress.engine import executor, run
from moecompress.engine.distributed import Launch

TIMES: dict[str, list[float]] = {}


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

    return wrapper


def main() -> None:
    expert_sharded.forward_layer = timed("forward", expert_sharded.forward_layer)
    expert_sharded.backward_layer = timed("backward", expert_sharded.backward_layer)
    chunked.ChunkedLayer.chunk = timed("chunk_read", chunked.ChunkedLayer.chunk)
    gather_ahead.GatherAhead._settle = timed("gather", gather_ahead.GatherAhead._settle)
    skeleton.Skeleton.__init__ = timed("skeleton", skeleton.Skeleton.__init__)
    executor.run_calibration = timed("calibration", executor.run_calibration)
    run.RecipeRun._step_reports = timed("reports", run.RecipeRun._step_reports)
    run.RecipeRun._write_checkpoint_files = timed("commit", run.RecipeRun._write_checkpoint_files)
    t0 = time.perf_counter()
    executor.apply(sys.argv[1], launch=Launch.from_env(os.environ), progress=False, overwrite=True)
    TIMES["total"] = [time.perf_counter() - t0, time.process_time(), 1]
    rows = {k: [round(v[0], 2), round(v[1], 2), int(v[2])] for k, v in TIMES.items()}
    print("PHASES", os.environ.get("RANK", "0"), json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
