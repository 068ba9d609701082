"""One process against two ``torch.distributed`` ranks (gloo, one thread each) on a Qwen3-30B-shaped
synthetic checkpoint: wall time, calibration time, CPU seconds and peak RSS per rank, and whether the
outputs are byte-identical.

    python benchmarks/distributed.py        # heapr, rtn, expert_prune, rtn data-free; 2 layers, 128 experts
    python benchmarks/distributed.py --passes heapr rtn gptq --parallel auto batches --json OUT.json
    python benchmarks/distributed.py --passes distill --experts 32 --workdir DIR   # FSDP2 training
    python benchmarks/distributed.py --passes codequant heapr_gptq   # fine-tuned codequant, a chain

The checkpoint: ``qwen3_moe`` with Qwen3-30B-A3B's MoE shapes (hidden 2048, experts of width 768, top-8;
``--experts`` of them, 128 by default, 1.2 GB of bf16 expert weights per layer), random weights, a small
vocabulary and attention. Calibration computes in ``calibration.dtype: auto``: bfloat16 where the CPU has a
bfloat16 matmul kernel, float32 where it has not (AVX2-only x86; the row's ``compute_dtype``). Each configuration runs as fresh processes (``moecompress apply`` with the
variables ``torchrun`` sets, ``OMP_NUM_THREADS=1``), each with its own statistics cache. Peak RSS and
CPU seconds are each process's ``getrusage``; calibration seconds come from rank 0's ``report.json``.
What runs on several ranks (``docs/distributed.md``): calibration (``--parallel auto``, the default: each
MoE layer's forward and streamed backward with its experts split over the ranks; ``batches``:
data-parallel whole layers), and the layer loop's per-expert work (each MoE layer split in 2
chunks of experts, rank 1 working one and sending it to rank 0, which writes). ``rtn_data_free`` runs
``rtn`` with ``calibration.source: none``: no calibration, so its peak RSS is the layer loop's. The
page cache is written back (``os.sync``) before every run, so that a run does not pay for the previous one's
dirty pages (its output, its cache: GBs), and the load average (``os.getloadavg``) is recorded before and after every measurement: on a shared machine the
ratios are only as good as the machine was quiet.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

GiB = 1024**3
PASSES = {"heapr": {"ratio": 0.25}, "rtn": {"bits": 4}, "expert_prune": {"ratio": 0.25}, "identity": {},
          "rtn_data_free": {"bits": 4}, "gptq": {"bits": 4, "group_size": 128}, "namex": {"ratio": 0.25},
          "merge_experts": {"ratio": 0.25}, "tdmoe": {"ratio": 0.4}, "svd_experts": {"ratio": 0.4},
          "codequant": {"bits": 4, "finetune_steps": 8, "finetune_patience": None}}  # fmt: skip
CHAINS = {"heapr_gptq": [{"heapr": {"ratio": 0.25, "layout": "uniform", "align": 64}},
                         {"gptq": {"bits": 4, "group_size": 64}}]}  # fmt: skip
"""Benchmark names that run a chain of steps (gptq reads ``down_in_cov`` mapped to heapr's kept neurons)."""
DATA_FREE = {"rtn_data_free": "rtn"}
"""Benchmark names that run a pass (the value) with ``calibration.source: none``."""
STAGES = {"distill": {"steps": 4, "batch": 4, "seq_len": 64, "samples": 24, "holdout": 4, "lr": 1e-4,
                      "trainable": "compressed"}}  # fmt: skip
"""Whole-model stages: ``expert_prune {ratio: 0.25}`` then the stage (FSDP2 under 2 ranks). The trained bytes
are not one process's (the reduce-scatter adds in another order): the row gives the loss curves' largest
relative difference instead of ``identical``."""

WORKER = r"""
import json, os, resource, sys
from moecompress.engine.distributed import Launch
from moecompress.engine.executor import apply
from moecompress.engine.peak import peak_rss_bytes
rep = apply(sys.argv[1], launch=Launch.from_env(os.environ), progress=False).report
loop = rep["layer_loop"]["peak_rss_mb"] if "layer_loop" in rep else rep.get("peak_rss_mb", 0)
u = resource.getrusage(resource.RUSAGE_SELF)
print("BENCH " + json.dumps({"peak": peak_rss_bytes(), "cpu": u.ru_utime + u.ru_stime,
                             "loop_peak": loop * 2**20, "units": rep.get("layer_loop", {}).get("chunks")}), flush=True)
"""
"""Peak RSS is ``VmHWM`` (this process's own high-water mark): Linux keeps ``ru_maxrss`` across ``fork`` and
``exec``, so it would report the benchmark's own peak (building the checkpoint) when that is larger. The
layer loop's peak is the largest resident memory sampled in it (rank 0: the run report's ``peak_rss_mb``;
the other ranks: their ``layer_loop`` summary)."""


def build(path: Path, experts: int, layers: int, clusters: int = 0) -> None:
    """The checkpoint; ``clusters``: experts ``e`` of a layer are ``base[e mod clusters] + 0.3 · noise`` (an
    upcycled model's structure), so Ward groups them into many small groups instead of random weights' one
    large group and singletons (a merge's units then carry comparable work)."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    from moecompress.testing import save_tiny

    save_tiny("qwen3_moe", path, dtype=torch.bfloat16, hidden_size=2048, moe_intermediate_size=768,
              num_experts=experts, num_experts_per_tok=8, num_hidden_layers=layers, vocab_size=512,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768)  # fmt: skip
    if clusters:
        file = path / "model.safetensors"
        t = load_file(file)
        for k in sorted(t):
            m = re.search(r"\.experts\.(\d+)\.", k)
            if m and int(m.group(1)) >= clusters:
                base = t[k.replace(f".experts.{m.group(1)}.", f".experts.{int(m.group(1)) % clusters}.")]
                t[k] = (base.float() + 0.3 * base.float().std() * torch.randn(base.shape)).to(base.dtype)
        save_file(t, str(file), metadata={"format": "pt"})


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(recipe: Path, world: int, spy: Path | None = None) -> dict:
    """``world`` ranks of ``moecompress apply recipe``; wall seconds and each rank's peak and CPU. ``spy``: each
    rank run under ``py-spy record`` (its collapsed stacks in ``spy/<recipe>-r<rank>.txt``, idle frames too)."""
    port, procs = _port(), []
    t0 = time.perf_counter()
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        if world > 1:
            env |= {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        cmd = [sys.executable, "-c", WORKER, str(recipe)]
        if spy is not None:
            out = spy / f"{recipe.stem}-r{rank}.txt"
            cmd = ["py-spy", "record", "--format", "raw", "--idle", "-r", "50", "-o", str(out), "--", *cmd]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    ranks = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"rank failed ({p.returncode}): {err.strip().splitlines()[-1:] or ''}")
        line = [x for x in out.splitlines() if x.startswith("BENCH ")][-1]
        ranks.append(json.loads(line[6:]))
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 2), "peak_gib": [round(r["peak"] / GiB, 2) for r in ranks],
            "loop_peak_gib": [round(r["loop_peak"] / GiB, 2) for r in ranks],
            "cpu_s": [round(r["cpu"], 1) for r in ranks],
            "units_worked": [r.get("units") for r in ranks]}  # fmt: skip


def launch_twins(recipes: list[Path]) -> dict:
    """One process per recipe, all at once and independent (no process group): what this machine gives that
    many processes doing a whole run each. The slowest one's wall seconds (from the launch), and each one's as
    collected in launch order (a later one's is at least an earlier one's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in recipes]  # fmt: skip
    walls = []
    for p in procs:
        _, err = p.communicate()
        walls.append(round(time.perf_counter() - t0, 2))
        if p.returncode:
            raise RuntimeError(f"twin failed ({p.returncode}): {err.strip().splitlines()[-1:] or ''}")
    return {"wall_s": max(walls), "walls_s": walls}


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.rglob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def measure(
    name: str, cfg: dict, model: Path, root: Path, cal: dict, mode: str = "auto", spy: Path | None = None,
    chunk: int | None = None, twins: bool = False,
) -> dict:
    """One process, then 2 ranks with ``calibration.parallel: mode`` (``auto``: experts sharded; ``batches``:
    data-parallel whole layers); ``twins``: then two one-process runs at once (:func:`launch_twins`)."""
    row: dict = {"pass": name, "config": CHAINS.get(name, cfg), "parallel": mode, "expert_chunk": chunk}
    digests, curves = {}, {}
    cal = {"source": "none"} if name in DATA_FREE else {**cal, "parallel": mode}
    steps = [{"expert_prune": {"ratio": 0.25}}, {name: cfg}] if name in STAGES else [{DATA_FREE.get(name, name): cfg}]
    steps = CHAINS.get(name, steps)
    for world in (1, 2):
        rec = {"model": str(model), "output": str(root / f"out-{name}-{world}"), "steps": steps,
               "calibration": {**cal, "cache_dir": str(root / f"cache-{name}-{world}")}}  # fmt: skip
        if name in STAGES:
            rec["emit"] = "every_step"
        if chunk:
            rec["expert_chunk"] = chunk
        path = root / f"{name}-{world}.yaml"
        path.write_text(yaml.safe_dump(rec))
        t0 = time.perf_counter()
        os.sync()  # the previous run's dirty pages (GBs of shards, caches) flushed first, outside the timing
        synced = round(time.perf_counter() - t0, 2)
        load0 = os.getloadavg()[0]
        res = launch(path, world, spy)
        res["sync_before_s"] = synced
        res["load_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        report = json.loads((root / f"out-{name}-{world}" / "report.json").read_text())
        res["calibration_s"] = report.get("calibration", {}).get("seconds")
        res["compute_dtype"] = report.get("dry_run", {}).get("compute_dtype")
        if name in STAGES:
            (stage,) = (root / f"out-{name}-{world}" / "steps").glob(f"*-{name}")
            summ = json.loads((stage / "report.json").read_text())["summary"]
            curves[world] = summ["loss_curve"]
            res |= {"loss_curve": summ["loss_curve"], "heldout": [summ["heldout_loss_before"],
                    summ["heldout_loss_after"]], "train_s": summ["train_seconds"]}  # fmt: skip
        row[f"ranks{world}"] = res
        digests[world] = _digest(root / f"out-{name}-{world}")
        subprocess.run(["rm", "-rf", str(root / f"cache-{name}-{world}")], check=False)
    row["wall_ratio"] = round(row["ranks1"]["wall_s"] / row["ranks2"]["wall_s"], 2)
    # a contended machine's proxy: one process's CPU seconds over the busiest rank's
    row["cpu_ratio"] = round(row["ranks1"]["cpu_s"][0] / max(row["ranks2"]["cpu_s"]), 2)
    c1, c2 = row["ranks1"]["calibration_s"], row["ranks2"]["calibration_s"]
    row["calibration_ratio"] = round(c1 / c2, 2) if c1 and c2 else None
    row["peak_ratio"] = round(max(row["ranks2"]["peak_gib"]) / row["ranks1"]["peak_gib"][0], 2)
    row["identical"] = digests[1] == digests[2]
    if twins:
        paths = []
        for k in range(2):
            rec = yaml.safe_load((root / f"{name}-1.yaml").read_text())
            rec |= {"output": str(root / f"twin{k}-{name}"),
                    "calibration": {**rec["calibration"], "cache_dir": str(root / f"cache-twin{k}-{name}")}}
            paths.append(root / f"{name}-twin{k}.yaml")
            paths[-1].write_text(yaml.safe_dump(rec))
        os.sync()
        row["twins"] = launch_twins(paths)
        # two processes doing the whole run each, at once: 2 x one process's wall over theirs bounds what splitting
        # the work over 2 ranks can give here (an upper bound: each rank still starts up whole)
        row["ceiling"] = round(2 * row["ranks1"]["wall_s"] / row["twins"]["wall_s"], 2)
        for k in range(2):
            subprocess.run(["rm", "-rf", str(root / f"twin{k}-{name}"), str(root / f"cache-twin{k}-{name}")], check=False)
    if curves:
        row["loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(curves[1], curves[2], strict=True))
    for world in (1, 2):
        subprocess.run(["rm", "-rf", str(root / f"out-{name}-{world}")], check=False)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", nargs="*", default=["heapr", "rtn", "expert_prune", "rtn_data_free"])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--parallel", nargs="*", default=["auto"], choices=["auto", "batches"],
                    help="calibration.parallel of the 2-rank runs (each mode runs one process again beside it)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--clusters", type=int, default=0,
                    help="experts as noisy copies of this many bases per layer (many small merge groups)")
    ap.add_argument("--expert-chunk", type=int, default=None,
                    help="expert_chunk of every run (a merge then goes by units of groups, shared over the ranks)")
    ap.add_argument("--twins", action="store_true",
                    help="also run two one-process runs at once: the wall ratio this machine allows 2 processes")
    ap.add_argument("--py-spy", default=None, metavar="DIR",
                    help="profile every rank with py-spy (collapsed stacks in DIR; slows the runs a little)")
    args = ap.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="distributed-"))
    model = root / "model"
    if not model.exists():
        build(model, args.experts, args.layers, args.clusters)
    cal = {"source": "random", "samples": args.samples, "seq_len": args.seq_len, "batch_size": 2,
           "dtype": "auto", "holdout": 2}  # fmt: skip
    print(json.dumps({"load_average": os.getloadavg(), "cpus": os.cpu_count(), "experts": args.experts,
                      "layers": args.layers, "calibration": cal}), flush=True)  # fmt: skip
    rows = []
    for name in args.passes:
        for mode in args.parallel if name not in DATA_FREE else ["auto"]:
            try:
                spy = Path(args.py_spy) if args.py_spy else None
                if spy is not None:
                    spy.mkdir(parents=True, exist_ok=True)
                rows.append(measure(name, {**PASSES, **STAGES, **{k: {} for k in CHAINS}}[name], model, root, cal, mode, spy, args.expert_chunk,
                                    args.twins))  # fmt: skip
            except RuntimeError as err:
                rows.append({"pass": name, "parallel": mode, "error": str(err)})
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"experts": args.experts, "layers": args.layers,
                                                       "calibration": cal, "rows": rows}, indent=1))  # fmt: skip
    print("\n| pass | parallel | wall 1 / 2 ranks (s) | ratio | calibration 1 / 2 (s) | ratio | CPU s (1; 2 ranks) | CPU ratio "
          "| peak RSS GiB (1; per rank) | peak ratio | layer-loop RSS GiB (1; per rank) | identical | load 1 min (1; 2) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['pass']} | {r['parallel']} | failed: {r['error']} | | | | | | | | | | |")
            continue
        a, b = r["ranks1"], r["ranks2"]
        print(f"| {r['pass']} | {r['parallel']} | {a['wall_s']} / {b['wall_s']} | {r['wall_ratio']} | {a['calibration_s']} / "
              f"{b['calibration_s']} | {r['calibration_ratio']} | {a['cpu_s'][0]}; {' + '.join(map(str, b['cpu_s']))} | {r['cpu_ratio']} "
              f"| {a['peak_gib'][0]}; {', '.join(map(str, b['peak_gib']))} | {r['peak_ratio']} "
              f"| {a['loop_peak_gib'][0]}; {', '.join(map(str, b['loop_peak_gib']))} | {r['identical']}{' (loss curves: ' + format(r['loss_rel_diff'], '.1e') + ')' if 'loss_rel_diff' in r else ''} "
              f"| {a['load_1min']}; {b['load_1min']} |")  # fmt: skip
    for r in rows:
        if "twins" in r:
            print(f"{r['pass']}: two one-process runs at once {r['twins']['walls_s']} s against one alone "
                  f"{r['ranks1']['wall_s']} s: this machine allows 2 processes at most {r['ceiling']}x")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
