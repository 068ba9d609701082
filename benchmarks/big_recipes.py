"""Long recipes stay cheap: parse, dry-run and run times of N identity steps on a tiny model.

    python benchmarks/big_recipes.py            # 1000 steps: parse, dry run, run; 100 000: parse, dry run

Prints one JSON line per size. The dry run is linear in steps x MoE layers; a step that leaves every
layer unchanged costs no reconstruction forward and no standard plots.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import moecompress as mc
from moecompress.testing import save_tiny


def measure(n: int, run: bool, root: Path) -> dict:
    rec = {"model": str(root / "m"), "output": str(root / f"out-{n}"),
           "calibration": {"source": "random", "samples": 4, "seq_len": 8}, "steps": [{"identity": {}}] * n}  # fmt: skip
    out: dict = {"steps": n}
    t = time.perf_counter()
    mc.load_recipe(rec)
    out["parse_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    mc.apply(rec, dry_run=True, progress=False)
    out["dry_run_s"] = round(time.perf_counter() - t, 2)
    if run:
        t = time.perf_counter()
        mc.apply(rec, progress=False)
        out["run_s"] = round(time.perf_counter() - t, 2)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_tiny("qwen3_moe", root / "m")
        for n, run in ((1000, True), (100_000, False)):
            print(json.dumps(measure(n, run, root)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
