"""CI's core-install lane: run inside an environment with only ``pip install -e .`` (no extras).

Every recipe in ``recipes/`` must dry-run (on the bundled quickstart model) with exit status 0, or exit
status 2 with one line that names the extra to install; then the quickstart must run and write its
report, with the plots skipped and said so, and ``moecompress export`` must refuse with the same line. Exits non-zero with the reason otherwise::

    python scripts/check_core_install.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRA_LINE = re.compile(r'^error: .* needs [\w, ]+, which is not installed: pip install "moecompress\[[\w-]+\]"$')


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moecompress.cli", *args], cwd=cwd, capture_output=True, text=True)


def main() -> int:
    optional = [m for m in ("tensorly", "matplotlib", "compressed_tensors", "datasets") if _importable(m)]
    if optional:
        print(f"not a core install: {optional} importable", file=sys.stderr)
        return 1
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
            out = work / f"out-{recipe.stem}"
            r = _cli("apply", str(recipe), "--dry-run", "--set", "model=moecompress:quickstart", "--set", f"output={out}",
                     cwd=work)  # fmt: skip
            lines = r.stderr.strip().splitlines()
            if r.returncode == 0:
                plan = json.loads(r.stdout)
                print(f"{recipe.name}: dry run ok ({len(plan['steps'])} steps)")
            elif r.returncode == 2 and len(lines) == 1 and EXTRA_LINE.match(lines[0]):
                print(f"{recipe.name}: {lines[0]}")
            else:
                failures.append(f"{recipe.name}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
            if out.exists():
                failures.append(f"{recipe.name}: the dry run wrote {out}")
        r = _cli("apply", str(ROOT / "recipes" / "quickstart.yaml"), "-q", cwd=work)
        report = work / "out" / "quickstart" / "report.md"
        if r.returncode != 0 or not report.is_file():
            failures.append(f"quickstart: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
        else:
            step = (work / "out" / "quickstart" / "steps" / "03-heapr" / "report.md").read_text()
            if "matplotlib not installed" not in step:
                failures.append("quickstart: the step report does not say that plots were skipped")
            print(f"quickstart: ok ({report})")
            r = _cli("export", str(work / "out" / "quickstart"), str(work / "ct"), cwd=work)
            lines = r.stderr.strip().splitlines()
            if r.returncode != 2 or len(lines) != 1 or not EXTRA_LINE.match(lines[0]) or (work / "ct").exists():
                failures.append(f"export: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
            else:
                print(f"export: {lines[0]}")
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
