"""Every built-in pass (its sample configuration, ``tests/pass_samples.py``) as one process and as two real
``torch.distributed`` ranks (gloo, one thread each, the variables ``torchrun`` sets), on a tiny 2-layer
``qwen3_moe`` with calibration: whether the weights and configs are byte-identical and the step reports equal
(``tests/test_every_pass_on_two_ranks.py`` checks the same with the ranks as threads over queues, in CI; this
runs the gloo transport too, ~20 s a pass: two interpreters per run).

    python benchmarks/every_pass_ranks.py [--passes heapr rtn ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' pass samples and helpers

from pass_samples import SAMPLES  # noqa: E402
from test_distributed import CAL, _env, _hashes, _port  # noqa: E402
from test_every_pass_on_two_ranks import _step_reports  # noqa: E402

from moecompress.testing import save_tiny  # noqa: E402


def run(root: Path, model: Path, name: str) -> dict:
    paths = {}
    for tag in ("one", "two"):
        rec = {"model": str(model), "output": str(root / f"{name}-{tag}"), "emit": "every_step",
               "steps": [{name: SAMPLES[name]}], "calibration": {**CAL, "cache_dir": str(root / f"cache-{name}-{tag}")}}  # fmt: skip
        paths[tag] = root / f"{name}-{tag}.yaml"
        paths[tag].write_text(yaml.safe_dump(rec))
    cli = [sys.executable, "-m", "moecompress.cli", "apply"]
    t0 = time.perf_counter()
    one = subprocess.run([*cli, str(paths["one"]), "--quiet"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    port = _port()
    procs = [subprocess.Popen([*cli, str(paths["two"]), "--quiet"], env=_env(r, 2, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]  # fmt: skip
    errs = [p.communicate(timeout=600)[1] for p in procs]
    secs = round(time.perf_counter() - t0, 1)
    codes = [one.returncode, *[p.returncode for p in procs]]
    if any(codes):
        last = [e.strip().splitlines()[-1:] for e in (one.stderr, *errs)]
        return {"pass": name, "ok": False, "returncodes": codes, "last_lines": last, "seconds": secs}
    w1, w2 = _hashes(root / f"{name}-one"), _hashes(root / f"{name}-two")
    (r1, e1), (r2, e2) = _step_reports(root / f"{name}-one"), _step_reports(root / f"{name}-two")
    worst = max((abs(a - b) / max(abs(a), 1e-30) for a, b in zip(e1, e2, strict=True) if a != b), default=0.0)
    return {"pass": name, "ok": w1 == w2 and r1 == r2, "weights_identical": w1 == w2, "weight_files": len(w1),
            "reports_equal": r1 == r2, "errors_max_rel_diff": worst, "seconds": secs}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", nargs="*", default=sorted(SAMPLES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        save_tiny("qwen3_moe", root / "model", num_hidden_layers=2)
        for name in args.passes:
            rows.append(run(root, root / "model", name))
            print(json.dumps(rows[-1]), flush=True)
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} passes: one process's bytes on 2 gloo ranks")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
