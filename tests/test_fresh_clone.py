"""A fresh clone works from its root: no top-level folder shadows an installed package (issue 33).

`kernels/` and `calibration/` are reached as `moecompress.kernels` / `moecompress.calibration` and have no
`__init__.py`, so from the clone root (`python -c`, `python -m pytest`: the working directory first on
`sys.path`) an installed regular package of the same name still wins. `scripts/check_readme.py` (run by
CI) runs README's commands there; these tests check its parsing and the imports themselves.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import check_readme  # noqa: E402

sys.path.pop(0)


def _python_in_root(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})  # fmt: skip


@pytest.mark.parametrize("name", ["kernels", "calibration"])
def test_an_installed_package_wins_over_the_clone_folder(tmp_path, name):
    """A stand-in for a PyPI package of the same name, on PYTHONPATH (after the clone root on sys.path)."""
    site = tmp_path / "site"
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("WHO = 'installed'\n")
    code = f"import json, {name}; print(json.dumps([getattr({name}, 'WHO', None), {name}.__file__]))"
    r = _python_in_root(code, PYTHONPATH=str(site))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["installed", str(site / name / "__init__.py")]


@pytest.mark.parametrize("name", ["kernels", "calibration"])
def test_the_clone_folders_are_no_regular_packages(name):
    assert (ROOT / name).is_dir() and not (ROOT / name / "__init__.py").exists()
    assert (ROOT / "moecompress" / name).resolve() == (ROOT / name).resolve()
    mod = importlib.import_module(f"moecompress.{name}")
    assert [Path(p).resolve() for p in mod.__path__] == [(ROOT / name).resolve()]


def test_transformers_builds_an_moe_model_from_the_clone_root(tmp_path):
    """The failure a new user met: transformers imports PyPI's ``kernels`` (where installed) while building
    any MoE model; from the clone root that import must not reach the clone's ``kernels/``."""
    code = ("import importlib.util, json; from moecompress.testing import save_tiny; "
            f"save_tiny('qwen3_moe', {str(tmp_path / 'm')!r}); "
            "s = importlib.util.find_spec('kernels'); print(json.dumps(s and s.origin))")  # fmt: skip
    r = _python_in_root(code)
    assert r.returncode == 0, r.stderr[-2000:]
    origin = json.loads(r.stdout.splitlines()[-1])  # None: no regular package (not installed)
    assert origin is None or Path(origin).resolve().parent != (ROOT / "kernels").resolve()
    assert (tmp_path / "m" / "config.json").is_file()


def test_readme_commands_are_parsed_the_way_a_user_types_them():
    labels = [label for label, _ in check_readme.plan()]
    assert "README: moecompress apply recipes/quickstart.yaml" in labels
    assert any("save_tiny('deepseek_v3', 'tiny-dsv3')" in x for x in labels)
    assert any(x.startswith("README python block") for x in labels)
    assert not any("pytest -m" in x or "pip install" in x for x in labels)  # CI runs those itself
    joined = check_readme.bash_commands("a --x 1 \\\n    --y 2   # note\n# comment\nb\n")
    assert joined == ["a --x 1 --y 2", "b"]
