"""Project invariants: CI runs README's test command; the package imports light."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme)
    assert m, "README.md must hold the test command in a fenced block after <!-- test-command -->"
    command = m.group(1).strip()
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines


def test_ci_has_the_slow_and_core_lanes():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'python -m pytest -m slow -q' in ci and "scripts/check_core_install.py" in ci and "pip install -e .\n" in ci
    marked = [p for p in (ROOT / "tests").glob("test_*.py") if "@pytest.mark.slow" in p.read_text()]
    assert marked, "the slow lane must have tests to run"


def test_import_is_light():
    code = (
        "import sys, moecompress\n"
        "bad = [m for m in ('triton', 'tensorly', 'matplotlib', 'compressed_tensors', 'datasets', 'lm_eval') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_docs_list_every_statistic_and_builtin_step():
    from moecompress.calibration.catalogue import CATALOGUE
    from moecompress.passes import BUILTIN_PASSES

    doc = (ROOT / "docs" / "recipes.md").read_text()
    missing = [name for name in CATALOGUE if f"`{name}`" not in doc]
    assert missing == []
    assert all(f"`{p}`" in doc for p in BUILTIN_PASSES)
